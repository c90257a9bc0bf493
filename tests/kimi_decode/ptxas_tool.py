"""ptxas for the kernel tests' register and spill checks (the CUDA toolkit's assembler, the one
that turns the PTX the CPU tests compile into the machine code the H200 runs).

One policy for every test that uses it: where ptxas is missing (a developer machine without
the CUDA 13 toolkit) those checks are skipped or left out, but under CI (`CI` set, as .ci/run
does) a missing ptxas fails the test, so the register checks cannot disappear silently where
they are meant to run."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

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


def ptxas_usage(tmp_path: Path, ptx: str) -> tuple[int, int]:
    """(registers, spill bytes) from `ptxas -v` on `ptx` for sm_90a, as the device will load the
    kernel (require_ptxas(): skipped where ptxas is missing outside CI)."""
    src = tmp_path / "k.ptx"
    src.write_text(ptx)
    res = subprocess.run([require_ptxas(), "-arch=sm_90a", "-v", str(src), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True, check=True)
    regs = max(int(r) for r in re.findall(r"Used (\d+) registers", res.stderr))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill", res.stderr))
    return regs, spills
