#!/usr/bin/env bash
# Set up decodescope in ./.venv on a fresh machine (Python 3.11, Debian). Idempotent.
# torch==2.13.0 sits on the same pip line as the project: otherwise pip resolves a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
"$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
  || { echo "error: need Python 3.11 (the local torch 2.13.0+cpu wheel is cp311)" >&2; exit 1; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
export PIP_PROGRESS_BAR=off PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/python -m pip install -qq torch==2.13.0 -e '.[test]'
.venv/bin/python -m pip check
.venv/bin/python -c 'import torch; assert torch.__version__.startswith("2.13.0"), torch.__version__'
