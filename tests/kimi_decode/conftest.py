"""Fixtures shared by the kernel tests."""
from __future__ import annotations

import pytest


@pytest.fixture
def on_cpu(monkeypatch):
    """kernels/checks.py's harness on the CPU (the kernel itself replaced by the test)."""
    from kimi_decode.kernels import checks
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    return monkeypatch
