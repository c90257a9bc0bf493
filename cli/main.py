"""`decodescope`: one click group; each module in cli/commands/ adds one subcommand.

Adding an analysis command means adding a file there that defines `command` (a click.Command);
the group discovers it, so commands never edit a shared list.
"""
from __future__ import annotations

import importlib
import pkgutil

import click

import cli.commands


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """decodescope: per-layer kernel, bubble and overlap analysis of LLM decode traces.

    \b
    Examples:
      decodescope dashboard                 # the bundled stock and fused K3 traces
      decodescope summary traces/k3_stock_b1_k0_graph.json.gz
      decodescope ingest trace_dir/ --db runs.duckdb
    """


for _info in sorted(pkgutil.iter_modules(cli.commands.__path__), key=lambda m: m.name):
    _mod = importlib.import_module(f"cli.commands.{_info.name}")
    if hasattr(_mod, "command"):
        main.add_command(_mod.command)


if __name__ == "__main__":
    main()
