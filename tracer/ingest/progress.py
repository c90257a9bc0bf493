"""Progress on stderr for ingests that take more than a second; silent when stderr is no terminal.

The display starts only once a step begins after `delay_s`, so fast ingests print nothing and
piped or captured stderr never receives control codes.
"""
from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Any


class Progress:
    """Named steps of one ingest, shown as a transient spinner line after `delay_s`."""

    def __init__(self, enabled: bool = True, label: str = "", delay_s: float = 1.0) -> None:
        # rich is imported only for a terminal: piped and test runs skip its import cost.
        self.enabled = enabled and sys.stderr.isatty()
        self.label = label
        self.delay_s = delay_s
        self._t0 = time.monotonic()
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        self._t0 = time.monotonic()
        return self

    def step(self, what: str) -> None:
        """Enter the next step; starts the display if the ingest has run past the delay."""
        if not self.enabled:
            return
        if self._bar is None and time.monotonic() - self._t0 >= self.delay_s:
            from rich.console import Console
            from rich.progress import Progress as RichProgress
            from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

            self._bar = RichProgress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                     console=Console(stderr=True), transient=True)
            self._bar.start()
            self._task = self._bar.add_task(f"{self.label}: {what}")
        elif self._bar is not None and self._task is not None:
            self._bar.update(self._task, description=f"{self.label}: {what}")

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.stop()
