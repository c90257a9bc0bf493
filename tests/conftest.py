"""Shared test setup: a deterministic hypothesis profile on CI, and browser tests that
skip locally when Debian Chromium is missing but fail under CI (a missing apt step must not pass)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hypothesis import settings

# Triton kernels in tests run in Triton's CPU interpreter; the switch must be set before anything
# (torch.compile included) imports triton, so here, not in the test module.
os.environ.setdefault("TRITON_INTERPRET", "1")

settings.register_profile("ci", deadline=None, derandomize=True, max_examples=60)
settings.register_profile("dev", deadline=None, max_examples=100)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO.parent / "shared" / "corpus"
CHROMIUM = os.environ.get("CHROMIUM_BIN", "/usr/bin/chromium")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    have_chromium = Path(CHROMIUM).exists() or shutil.which("chromium") is not None
    if have_chromium:
        return
    browser_items = [i for i in items if i.get_closest_marker("browser")]
    if not browser_items:
        return
    if os.environ.get("CI"):
        raise pytest.UsageError(f"browser tests need {CHROMIUM}; .ci/run installs Debian chromium")
    skip = pytest.mark.skip(reason=f"{CHROMIUM} not installed (CI installs it)")
    for item in browser_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def corpus() -> Path:
    """The public traces in ../shared/corpus (HTA, TraceLens, PARAM, nsys exports)."""
    if not CORPUS.is_dir():
        pytest.fail(f"corpus not found at {CORPUS}")
    return CORPUS
