"""bench/decode.py's graph plumbing on the CPU (the device runs it, no CI machine can): every
graph the bench and bench/graph_start time is captured by capture_graph on the step's capture
stream with autograd off, and prefix_increments captures the step's first 1 .. n layers in turn
and returns the differences of their medians."""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from bench import decode


def test_capture_graph_runs_fn_once_on_the_capture_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    import kimi_decode.runner as runner
    seen: list[tuple] = []

    class FakeGraph:
        pass

    @contextmanager
    def fake_graph(g, stream=None):
        seen.append(("capture", type(g).__name__, stream))
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: seen.append(("sync",)))
    monkeypatch.setattr(runner, "capture_stream", lambda device=None: "the capture stream")

    def fn() -> None:
        seen.append(("fn", torch.is_grad_enabled()))

    g = decode.capture_graph(fn)
    assert isinstance(g, FakeGraph)
    assert seen == [("capture", "FakeGraph", "the capture stream"), ("fn", False), ("sync",)]


def test_prefix_increments_capture_each_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    prefixes: list[int] = []
    medians = {1: [10.0, 12.0, 11.0], 2: [30.0], 3: [45.0, 47.0]}

    def fake_capture(fn):
        fn()                                   # the bench calls it at once: n is this iteration's
        return prefixes[-1]

    monkeypatch.setattr(decode, "capture_graph", fake_capture)
    monkeypatch.setattr(decode, "run_layers", lambda model, inputs, n: prefixes.append(n))
    monkeypatch.setattr(decode, "time_replays", lambda g, reps: medians[g])

    class Model:
        layers = [object(), object(), object()]

    assert decode.prefix_increments(Model(), (None, None, None), reps=5) == [None, 19.0, 16.0]
    assert prefixes == [1, 2, 3]
