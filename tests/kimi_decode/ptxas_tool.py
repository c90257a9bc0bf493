"""ptxas for the kernel tests' register and spill checks (the CUDA toolkit's assembler, the one
that turns the PTX the CPU tests compile into the machine code the H200 runs).

One policy for every test that uses it: where ptxas is missing (a developer machine without
the CUDA 13 toolkit) those checks are skipped or left out, but under CI (`CI` set, as .ci/run
does) a missing ptxas fails the test, so the register checks cannot disappear silently where
they are meant to run."""
from __future__ import annotations

import os
import shutil

import pytest


def ptxas_path() -> str | None:
    """ptxas on PATH; None where it is missing outside CI; a test failure under CI."""
    path = shutil.which("ptxas")
    if path is None and os.environ.get("CI"):
        pytest.fail("ptxas is not on PATH under CI: the kernel register checks need the CUDA toolkit's ptxas")
    return path


def require_ptxas() -> str:
    """ptxas_path(), skipping the calling test where it is missing outside CI."""
    path = ptxas_path()
    if path is None:
        pytest.skip("ptxas not installed")
    return path
