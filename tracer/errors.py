"""Typed errors for user mistakes. The CLI maps each to one line on stderr and exit 2."""
from __future__ import annotations

from pathlib import Path


class BadInput(Exception):
    """A file, folder or database the user named cannot be used, and why.

    Raised before the ingest transaction commits, so the store stays as it was.
    """

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")
