"""`--render FILE` for the device bench scripts: print the markdown of a result file fetched
from the GPU machine, or exit with one line naming the file and what it should have been.

Why shared: fused_ab, graph_start and large_m_experts each carried the same read / parse /
render / one-line-error block; a bad file must give the same kind of message everywhere
(the project's rule: no traceback for a user mistake)."""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def print_rendered(path: Path, render: Callable[[Any], str], script: str, what: str) -> None:
    """Write render(json of `path`) to stdout; SystemExit "SCRIPT: PATH: not WHAT (why)" where
    the file cannot be read, is not JSON, or lacks what render needs."""
    try:
        sys.stdout.write(render(json.loads(path.read_text())))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{script}: {path}: not {what} ({e})") from None
