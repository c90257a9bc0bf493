"""The CI guide and the example workflow only use options that the commands really have."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from cli.trace_diff import command as diff_command

DOCS = Path(__file__).resolve().parents[2] / "docs"
FILES = [DOCS / "ci-trace-diff.md", DOCS / "examples" / "trace-diff.yml"]


def _options(cmd) -> set[str]:
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}


def _invocations(text: str, prog: str) -> list[str]:
    """Command lines that run `prog`, with backslash continuations joined."""
    text = text.replace("\\\n", " ")
    return [line[line.index(prog):] for line in text.splitlines() if prog in line]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_documented_flags_exist(path: Path) -> None:
    from cli.commands.capture import command as capture_command

    text = path.read_text()
    env = dict(re.findall(r"^\s*(\w+): (--.*)$", text, re.MULTILINE))  # e.g. CAPTURE_ARGS in the workflow
    checked = 0
    for prog, cmd in (("trace-diff ", diff_command), ("capture ", capture_command)):
        known = _options(cmd)
        for line in _invocations(text, prog):
            line = re.sub(r"\$(\w+)", lambda m: env.get(m.group(1), ""), line)
            flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", line))
            assert flags <= known, f"{path.name}: {line!r} uses {sorted(flags - known)}"
            checked += len(flags)
    assert checked > 0


def test_workflow_gates_on_trace_diff_exit_code() -> None:
    text = FILES[1].read_text()
    assert "--junit" in text and "--format markdown" in text
    assert re.search(r"exit \$\{\{ steps\.diff\.outputs\.rc \}\}", text)
