"""`decodescope`: one click group; each module in cli/commands/ adds one subcommand.

Adding an analysis command means adding a file there that defines `command` (a click.Command);
the group discovers it, so commands never edit a shared list. Modules are imported lazily, only
the one that runs (all of them for `--help`), so `decodescope ingest` does not pay for pandas,
Dash or torch imported by other commands; a module's command name is its file name
(underscores may be spelt as dashes).
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any

import click

import cli.commands
from cli.common import one_line_usage_errors


def _module_names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(cli.commands.__path__))


def _load(module: str) -> click.Command | None:
    return getattr(importlib.import_module(f"cli.commands.{module}"), "command", None)


class _LazyGroup(click.Group):
    """Subcommands found by module name in cli/commands/, imported when needed."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        names = {cmd.name or m for m in _module_names() if (cmd := _load(m)) is not None}
        return sorted(names | set(super().list_commands(ctx)))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        module = cmd_name.replace("-", "_")
        if module in _module_names():
            cmd = _load(module)
            if cmd is not None and cmd.name == cmd_name:
                return cmd
        for m in _module_names():  # a command named differently from its file
            cmd = _load(m)
            if cmd is not None and cmd.name == cmd_name:
                return cmd
        return super().get_command(ctx, cmd_name)

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        """Usage mistakes on the group itself (`decodescope --bogus`) are one `error:` line."""
        with one_line_usage_errors():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: click.Context) -> Any:
        """Usage mistakes of a subcommand (unknown command or option, a value click rejects, a
        missing argument) are one `error:` line and exit 2, like every other bad input."""
        with one_line_usage_errors():
            return super().invoke(ctx)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """decodescope: per-layer kernel, bubble and overlap analysis of LLM decode traces.

    \b
    Examples:
      decodescope dashboard                 # the bundled K3 decode traces (traces/)
      decodescope summary traces/k3_stock_b1_k0_graph.json.gz
      decodescope ingest trace_dir/ --db runs.duckdb
    """


if __name__ == "__main__":
    main()
