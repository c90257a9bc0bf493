"""The timeline view's state: what the browser keeps, and how a zoom event becomes a window.

Kept apart from the page module so it can be tested without a Dash app.
"""
from __future__ import annotations

from typing import Any


def pack_state(run: int, rank: int, step: int | None, origin: int, t0: int, t1: int,
               mark: tuple[int, int] | None, extent: tuple[int, int]) -> dict[str, Any]:
    """The view state kept in the browser. Absolute ns travel as strings: a JSON number is a
    float64 in JavaScript and would lose up to 256 ns at epoch-ns magnitudes."""
    return {"run": run, "rank": rank, "step": step, "origin": str(origin), "t0": str(t0), "t1": str(t1),
            "mark": None if mark is None else [str(mark[0]), str(mark[1])],
            "extent": [str(extent[0]), str(extent[1])]}


def unpack_state(state: dict[str, Any]) -> dict[str, Any]:
    """pack_state's inverse: the ns fields back to int."""
    out = dict(state)
    for key in ("origin", "t0", "t1"):
        out[key] = int(state[key])
    out["extent"] = [int(v) for v in state["extent"]]
    out["mark"] = None if not state.get("mark") else (int(state["mark"][0]), int(state["mark"][1]))
    return out


def window_from_relayout(relayout: dict[str, Any], state: dict[str, Any]) -> tuple[int, int] | None:
    """The absolute-ns window a plotly relayout event asks for; None if it is not an x change.

    `state` is unpacked (ints). Axis values are ns since the origin; a reset (autorange)
    returns the whole run's window.
    """
    origin = state["origin"]
    if relayout.get("xaxis.autorange"):
        return int(state["extent"][0]), int(state["extent"][1])
    if "xaxis.range[0]" in relayout and "xaxis.range[1]" in relayout:
        lo, hi = relayout["xaxis.range[0]"], relayout["xaxis.range[1]"]
    elif isinstance(relayout.get("xaxis.range"), list):
        lo, hi = relayout["xaxis.range"]
    else:
        return None
    t0, t1 = origin + int(round(float(lo))), origin + int(round(float(hi)))
    return (t0, t1) if t1 > t0 else None
