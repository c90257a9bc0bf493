"""`decodescope diff BASE CAND`: the same command as the `trace-diff` console script."""
from cli.trace_diff import command

__all__ = ["command"]
