"""Run-to-run diff for CI: is the candidate run slower than the base, beyond noise, and where?

Alignment is by (layer kind, layer index, op), never by kernel name, because a fused kernel
and the stock kernels it replaces have different names. Values per step come from
`analyzers.layers.layer_steps` (the slowest rank's row gates the step). For every aligned key
and side we take the median (the gate) and the p90 over steps, and a seeded percentile
bootstrap of the relative change (resampling steps of each side independently). Every time
stays an integer ns: medians and p90s are nearest-rank order statistics (see `rank_index`).
A key regresses only when the whole confidence interval of the median's relative change lies
above the threshold AND the interval of the absolute change lies above `min_delta` (so a
+50 % on a 40 ns op is not a CI failure). With one step on a side the interval is
degenerate: we say so and gate on the point estimate. Kernel-count increases are always
listed, and are the regressions when metric='kernels'.

When a side has no layer attribution (traces that do not follow our NVTX convention) the diff
falls back to kernel names, per step, and every output says `kernel-name fallback`.
"""
from __future__ import annotations

import difflib
import math
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import duckdb
import numpy as np
import pandas as pd

from tracer.errors import BadInput

METRICS = {"span": "span_ns", "busy": "busy_ns", "kernels": "kernels", "bubbles": "bubble_ns"}
RESAMPLES = 2000
CONFIDENCE = 0.95
SEED = 20261202
DEFAULT_MIN_DELTA_NS = 1000  # a change smaller than 1 µs in a (layer, op) never fails CI
ALL_LAYERS = "all layers"
ALL_KERNELS = "all kernels"

# One row per kernel attributed to a step, with its layer and op, for kernel-level detail and
# the kernel-name fallback. Reads the TEMP table kernel_attribution that attribute() leaves.
# start_ns is the kernel's exposed start (analyzers/sql/kernels/exposed.sql: under PDL a kernel
# is resident before its stream predecessor ends), as layers_steps counts it.
ATTRIBUTED_KERNELS_SQL = """
SELECT a.rank, a.step_index, a.layer, a.layer_kind, a.layer_index, a.op,
       k.name, e.exposed_start_ns AS start_ns, k.end_ns, k.category
FROM kernel_attribution AS a
JOIN kernels AS k ON k.run_id = a.run_id AND k.kernel_id = a.item_id
JOIN kernels_exposed('kernel_attribution', $run) AS e ON e.kernel_id = k.kernel_id
WHERE a.run_id = $run AND a.item_kind = 'kernel'
ORDER BY a.rank, start_ns, k.end_ns
"""


# Exposed communication |comm \\ compute| per step and per layer (layer '' is the whole step),
# the slowest rank's, from analyzers/sql/overlap/overlap_by_layer.sql.
EXPOSED_COMM_SQL = """
SELECT step_index, CASE WHEN level = 'step' THEN '' ELSE layer END AS layer,
       max(exposed_comm_ns) AS exposed_ns
FROM overlap_by_layer('kernel_attribution')
WHERE run_id = ? AND (level = 'step' OR layer <> '')
GROUP BY ALL
"""


class NotComparable(BadInput):
    """The two runs cannot be compared (no kernels, no steps in common...): exit 2."""


@dataclass
class RunSample:
    """What the diff needs from one run: its layer_steps rows and its attributed kernels."""

    run_id: int
    name: str
    layer_steps: pd.DataFrame  # the analyzers.layers.layer_steps contract
    kernels: pd.DataFrame  # ATTRIBUTED_KERNELS_SQL columns
    exposed_comm: pd.DataFrame | None = None  # EXPOSED_COMM_SQL columns; None when unavailable
    notes: list[str] = field(default_factory=list)

    @property
    def has_layers(self) -> bool:
        return bool(len(self.layer_steps)) and bool(self.layer_steps["layer"].notna().any())


def collect(con: duckdb.DuckDBPyConnection, run_id: int, name: str | None = None,
            **attribution_kwargs: Any) -> RunSample:
    """Gather one run's per-step layer rows (analyzers.layers) and attributed kernels."""
    from analyzers.layers import layer_steps

    rows = con.execute("SELECT name FROM runs WHERE run_id = ?", [run_id]).fetchall()
    if not rows:
        raise NotComparable(f"run {run_id}", "no such run in the store")
    ls = layer_steps(con, run_id, **attribution_kwargs)
    if not _has_attribution(con, run_id):  # layer_steps attributes through a path of its own
        from analyzers.attribution import attribute

        attribute(con, [run_id], **attribution_kwargs)
    kernels = con.execute(ATTRIBUTED_KERNELS_SQL, {"run": run_id}).df()
    sample = RunSample(run_id, name or rows[0][0], ls, kernels)
    sample.exposed_comm, note = _exposed_comm(con, run_id)
    if note:
        sample.notes.append(note)
    return sample


# A run is a graph replay when its capture says so or when any kernel carries a graph id.
GRAPH_REPLAY_SQL = """
SELECT coalesce((SELECT graph_mode FROM runs WHERE run_id = $run), false)
    OR EXISTS (SELECT 1 FROM kernels WHERE run_id = $run AND graph_id IS NOT NULL)
"""


def is_graph_replay(con: duckdb.DuckDBPyConnection, run_id: int) -> bool:
    """Whether --graph-reference applies to this run."""
    return bool(con.execute(GRAPH_REPLAY_SQL, {"run": run_id}).fetchall()[0][0])


def is_read_only(con: duckdb.DuckDBPyConnection) -> bool:
    """A store opened read-only cannot take a --graph-reference trace next to its run."""
    from analyzers.views import _is_read_only

    return _is_read_only(con)


def _has_attribution(con: duckdb.DuckDBPyConnection, run_id: int) -> bool:
    exists = con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'kernel_attribution'").fetchall()
    return bool(exists[0][0]) and bool(
        con.execute("SELECT count(*) FROM kernel_attribution WHERE run_id = ?", [run_id]).fetchall()[0][0])


def _exposed_comm(con: duckdb.DuckDBPyConnection, run_id: int) -> tuple[pd.DataFrame | None, str | None]:
    """Exposed communication per step and layer ('' = whole step), max over ranks, from
    analyzers.overlap's definitions, over the kernel_attribution rows already computed."""
    try:
        from analyzers.overlap import HAS_COMM_SQL, NOT_APPLICABLE
    except ImportError:
        return None, "exposed communication unavailable: analyzers.overlap is not present"
    from analyzers.attribution import load_sql

    load_sql(con, "temporal", "overlap")
    if not con.execute(HAS_COMM_SQL, [run_id]).fetchall()[0][0]:
        return None, f"exposed communication not applicable: {NOT_APPLICABLE}"
    return con.execute(EXPOSED_COMM_SQL, [run_id]).df(), None


# -- statistics -------------------------------------------------------------------------------
# One order statistic everywhere, so every figure is a sample value and stays an integer ns
# like its inputs: the nearest-rank q-quantile, the ceil(q n)-th smallest of n values (the
# first when q n <= 1). The median is q = 1/2 (the lower median when n is even), p90 is
# q = 9/10, the ends of a percentile interval q = (1 - confidence)/2 and 1 - that. It is
# DuckDB's quantile_disc, which analyzers.layers (lower median) and analyzers.launch
# (p50/p90/p99) use in SQL; the bootstrap needs it on numpy rows, and
# tests/analyzers/test_diff.py checks that the two agree.

MEDIAN = Fraction(1, 2)
P90 = Fraction(9, 10)


def _exact(q: float | Fraction) -> Fraction:
    """q as written in decimal (0.9 is 9/10), so float noise never moves a rank."""
    return q if isinstance(q, Fraction) else Fraction(repr(q))


def rank_index(n: int, q: float | Fraction) -> int:
    """0-based position of the nearest-rank q-quantile among n sorted values."""
    return max(math.ceil(_exact(q) * n), 1) - 1


def nearest_rank(values: Any, q: float | Fraction) -> int:
    """The nearest-rank q-quantile of integer values (ns or kernel counts), as an int."""
    s = np.sort(_ints(values))
    return int(s[rank_index(len(s), q)])


def _ints(values: Any) -> np.ndarray:
    """Values as int64; a fractional one is a caller bug (times are integer ns end to end)."""
    arr = np.asarray(values)
    out = arr.astype(np.int64)
    if not np.array_equal(out, arr):
        raise ValueError("the diff statistics take integer values (ns or kernel counts)")
    return out


def _resample_index(n: int, side: int, seed: int, resamples: int) -> np.ndarray:
    """Bootstrap indices for a sample of n steps; depends only on (seed, n, side), so a key's
    interval does not change when other keys are added."""
    return np.random.default_rng([seed, n, side]).integers(0, n, size=(resamples, n))


def bootstrap_change(base: Any, cand: Any, q: float | Fraction = MEDIAN, resamples: int = RESAMPLES,
                     seed: int = SEED, confidence: float = CONFIDENCE) -> dict[str, Any]:
    """Point estimate and percentile bootstrap CI of the q-quantile's relative and absolute change.

    rel = Q_q(cand) / Q_q(base) - 1 (in %, a float), abs = Q_q(cand) - Q_q(base) (an int), Q_q
    the nearest-rank quantile of each side's steps, and of each resample. With a single step on
    a side the interval is degenerate and equals the point estimate (`degenerate` says why).
    """
    return bootstrap_changes(base, cand, (q,), resamples, seed, confidence)[0]


def bootstrap_changes(base: Any, cand: Any, qs: tuple[float | Fraction, ...] = (MEDIAN, P90),
                      resamples: int = RESAMPLES, seed: int = SEED,
                      confidence: float = CONFIDENCE) -> list[dict[str, Any]]:
    """`bootstrap_change` for several quantiles over the same resamples (each side sorted once)."""
    base, cand = _ints(base), _ints(cand)
    degenerate = [side for side, arr in (("base", base), ("candidate", cand)) if len(arr) < 2]
    if not degenerate:
        bsorted = np.sort(base[_resample_index(len(base), 0, seed, resamples)], axis=1)
        csorted = np.sort(cand[_resample_index(len(cand), 1, seed, resamples)], axis=1)
    lo = (1 - _exact(confidence)) / 2
    ends = rank_index(resamples, lo), rank_index(resamples, 1 - lo)
    out = []
    for q in qs:
        qb, qc = nearest_rank(base, q), nearest_rank(cand, q)
        rel = float(_rel(np.array([qb]), np.array([qc]))[0])
        one: dict[str, Any] = {"base": qb, "cand": qc, "change_pct": rel, "delta": qc - qb}
        if degenerate:
            one.update(ci_pct=[rel, rel], ci_delta=[qc - qb, qc - qb],
                       degenerate="single step on " + " and ".join(degenerate) + ": point estimate only")
        else:
            bs, cs = bsorted[:, rank_index(len(base), q)], csorted[:, rank_index(len(cand), q)]
            rels, deltas = np.sort(_rel(bs, cs)), np.sort(cs - bs)
            # order statistics, no interpolation: a +inf change over a zero base stays +inf
            one.update(ci_pct=[float(rels[i]) for i in ends], ci_delta=[int(deltas[i]) for i in ends],
                       degenerate=None)
        out.append(one)
    return out


def _rel(base: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """Relative change in %, +inf when the base is 0 and the candidate is not, 0 when both are 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(base == 0, np.where(cand == 0, 0.0, np.inf), (cand / np.where(base == 0, 1, base) - 1) * 100)
    return r.astype(float)


# -- per-step values per aligned key ------------------------------------------------------------

Key = tuple[str, int, str]  # (layer kind, layer index, op); op '' is the whole layer


def _layer_values(ls: pd.DataFrame, col: str) -> tuple[dict[Key, pd.DataFrame], dict[Key, str], list[str]]:
    """Per aligned key, a frame indexed by step with every metric column, all from the step's
    slowest rank: the one with the largest `col` (the compared metric; ties: the lowest rank).
    One rank's row per step keeps span = busy + bubble exact, which the explanation relies on."""
    notes: list[str] = []
    df = ls[ls["layer"].notna()].copy()
    if df["step_index"].isna().all():
        df["step_index"] = 0
        notes.append("no decode steps found: the whole run counts as one step")
    elif df["step_index"].isna().any():
        notes.append(f"{int(df['step_index'].isna().sum())} layer rows outside any step left out")
        df = df[df["step_index"].notna()]
    df["k_kind"] = df["layer_kind"].astype(object).where(df["layer_kind"].notna(), "")
    df["k_index"] = df["layer_index"].astype("Int64").fillna(-1).astype(int)
    df["k_op"] = df["op"].astype(object).where(df["op"].notna(), "")
    cols, keys = list(METRICS.values()), ["k_kind", "k_index", "k_op", "step_index"]
    df = df.sort_values([col, "rank"], ascending=[False, True], kind="stable")
    per = df.drop_duplicates(keys).set_index(keys).sort_index()[cols]
    values = {(k, int(i), o): g.droplevel([0, 1, 2]) for (k, i, o), g in per.groupby(level=[0, 1, 2])}
    labels = {(k, int(i), o): lay for k, i, o, lay in
              df[["k_kind", "k_index", "k_op", "layer"]].drop_duplicates(["k_kind", "k_index", "k_op"]).itertuples(index=False)}
    whole = per.xs("", level="k_op") if "" in per.index.get_level_values("k_op") else per.iloc[0:0]
    if len(whole):
        values[(ALL_LAYERS, -1, "")] = whole.groupby(level="step_index").sum()
        labels[(ALL_LAYERS, -1, "")] = ALL_LAYERS
    return values, labels, notes


def _kernel_name_values(kernels: pd.DataFrame) -> tuple[dict[Key, pd.DataFrame], dict[Key, str], list[str]]:
    """Kernel-name fallback: per kernel name and step, kernel time and count (bubbles are 0)."""
    notes: list[str] = []
    df = kernels.copy()
    if df["step_index"].isna().all():
        df["step_index"] = 0
        notes.append("no steps found: the whole trace counts as one step")
    elif df["step_index"].isna().any():
        notes.append(f"{int(df['step_index'].isna().sum())} kernels outside any step left out")
        df = df[df["step_index"].notna()]
    df["dur"] = df["end_ns"] - df["start_ns"]
    per = df.groupby(["name", "rank", "step_index"]).agg(time=("dur", "sum"), kernels=("dur", "size"))
    per = per.groupby(level=["name", "step_index"]).max()
    frame = pd.DataFrame({"span_ns": per["time"], "busy_ns": per["time"], "kernels": per["kernels"], "bubble_ns": 0})
    values: dict[Key, pd.DataFrame] = {(ALL_KERNELS, -1, ""): frame.groupby(level="step_index").sum()}
    labels: dict[Key, str] = {(ALL_KERNELS, -1, ""): ALL_KERNELS}
    for name, g in frame.groupby(level="name"):
        values[("kernel", -1, str(name))] = g.droplevel("name")
        labels[("kernel", -1, str(name))] = str(name)
    return values, labels, notes


# -- kernel-level detail inside one op ------------------------------------------------------------

def _fill_keys(kernels: pd.DataFrame) -> pd.DataFrame:
    df = kernels[kernels["step_index"].notna() | kernels["step_index"].isna().all()].copy()
    df["k_kind"] = df["layer_kind"].astype(object).where(df["layer_kind"].notna(), "")
    df["k_index"] = df["layer_index"].astype("Int64").fillna(-1).astype(int)
    df["k_op"] = df["op"].astype(object).where(df["op"].notna(), "")
    df["dur"] = df["end_ns"] - df["start_ns"]
    return df[df["layer"].notna()]


def representative_sequence(k: pd.DataFrame) -> tuple[list[str], list[int]]:
    """The most common ordered list of kernel names of one op over steps (lowest rank), and the
    median duration (ns, nearest rank) of each position over the steps that ran exactly that list."""
    if k.empty:
        return [], []
    k = k[k["rank"] == k["rank"].min()]
    step = k["step_index"].fillna(0).to_numpy()
    order = np.lexsort((k["end_ns"].to_numpy(), k["start_ns"].to_numpy(), step))
    step, names, durs = step[order], k["name"].to_numpy()[order], k["dur"].to_numpy()[order]
    cuts = np.flatnonzero(np.diff(step)) + 1
    seqs = [tuple(x) for x in np.split(names, cuts)]
    best, _ = Counter(seqs).most_common(1)[0]
    per_step = np.sort(_ints([d for d, sq in zip(np.split(durs, cuts), seqs) if sq == best]), axis=0)
    return list(best), [int(x) for x in per_step[rank_index(len(per_step), MEDIAN)]]


class _Sequences(dict):
    """(layer kind, layer index, op) -> representative_sequence, computed when first asked for."""

    def __init__(self, kernels: pd.DataFrame) -> None:
        super().__init__()
        self.frame = _fill_keys(kernels)
        self.groups = self.frame.groupby(["k_kind", "k_index", "k_op"]).indices

    def __missing__(self, key: tuple[str, int, str]) -> tuple[list[str], list[int]]:
        rows = self.groups.get(key)
        self[key] = representative_sequence(self.frame.iloc[rows]) if rows is not None else ([], [])
        return self[key]


def kernel_changes(base: tuple[list[str], list[int]], cand: tuple[list[str], list[int]]) -> list[dict[str, Any]]:
    """Align two kernel sequences of one op: same names match in order (difflib); inside a
    replaced block kernels pair by position as 'renamed'; the rest are 'added' or 'removed'."""
    (bn, bd), (cn, cd) = base, cand
    out: list[dict[str, Any]] = []

    def row(change: str, i: int | None, j: int | None) -> None:
        b = bd[i] if i is not None else 0
        c = cd[j] if j is not None else 0
        out.append({"change": change, "base_kernel": bn[i] if i is not None else None,
                    "cand_kernel": cn[j] if j is not None else None,
                    "base_ns": b if i is not None else None, "cand_ns": c if j is not None else None,
                    "delta_ns": c - b})

    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=bn, b=cn, autojunk=False).get_opcodes():
        pairs = min(i2 - i1, j2 - j1) if tag == "replace" else 0
        if tag == "equal":
            for d in range(i2 - i1):
                row("same", i1 + d, j1 + d)
            continue
        for d in range(pairs):
            row("renamed", i1 + d, j1 + d)
        for i in range(i1 + pairs, i2):
            row("removed", i, None)
        for j in range(j1 + pairs, j2):
            row("added", None, j)
    return out


# -- the report ---------------------------------------------------------------------------------

@dataclass
class DiffReport:
    """Everything the renderers print; `to_dict()` is the JSON output."""

    base: dict[str, Any]
    cand: dict[str, Any]
    mode: str  # 'layers' or 'kernel-name fallback'
    settings: dict[str, Any]
    rows: list[dict[str, Any]]
    alignment: dict[str, Any]
    kernel_count_increases: list[dict[str, Any]]
    notes: list[str]

    @property
    def fallback(self) -> bool:
        return self.mode != "layers"

    @property
    def regressions(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["verdict"] == "regression"]

    @property
    def improvements(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["verdict"] == "improvement"]

    @property
    def below_gate(self) -> list[dict[str, Any]]:
        """Regressions finer than the gate level: reported, not failing the run."""
        return [r for r in self.rows if r["verdict"] == "regression below gate"]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data; a relative change over a base of 0 (infinite) becomes null."""
        return _finite({"mode": self.mode, "base": self.base, "cand": self.cand, "settings": self.settings,
                "verdict": "regression" if self.regressions else "pass",
                "regressions": self.regressions, "improvements": self.improvements,
                "regressions_below_gate": self.below_gate,
                "kernel_count_increases": self.kernel_count_increases, "alignment": self.alignment,
                "notes": self.notes, "rows": self.rows})


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not np.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def diff_runs(con: duckdb.DuckDBPyConnection, base_run: int, cand_run: int, threshold_pct: float = 5.0,
              metric: str = "span", min_delta: int | None = None, resamples: int = RESAMPLES,
              seed: int = SEED, **attribution_kwargs: Any) -> DiffReport:
    """Diff two runs of one store (see `compare` for the rules)."""
    return compare(collect(con, base_run, **attribution_kwargs), collect(con, cand_run, **attribution_kwargs),
                   threshold_pct=threshold_pct, metric=metric, min_delta=min_delta, resamples=resamples, seed=seed)


GATES = ("op", "layer", "step")


def key_level(k: Key) -> str:
    """'step' (all layers / all kernels), 'layer' (a whole layer) or 'op' (an op of a layer, or
    one kernel name in the kernel-name fallback)."""
    kind, _, op = k
    if kind in (ALL_LAYERS, ALL_KERNELS):
        return "step"
    if kind == "kernel" or op:
        return "op"
    return "layer"


def compare(base: RunSample, cand: RunSample, threshold_pct: float = 5.0, metric: str = "span",
            min_delta: int | None = None, resamples: int = RESAMPLES, seed: int = SEED,
            gate: str = "op") -> DiffReport:
    """Align two runs by (layer kind, layer index, op) and gate each key on its bootstrap CI.

    `gate` is the finest level whose regressions fail the run: 'op' (every key), 'layer' (whole
    layers and the step: for two variants whose ops differ in granularity, e.g. stock vs fused,
    where a fused op absorbs others and is slower than its namesake while the layer is faster)
    or 'step' (all layers only). Finer regressions are still computed and reported, with
    verdict 'regression below gate'."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {sorted(METRICS)}")
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}")
    for side in (base, cand):
        if side.kernels.empty and not side.has_layers:
            raise NotComparable(side.name, "no GPU kernels in this run; nothing to compare")
    col = METRICS[metric]
    if min_delta is None:
        min_delta = 0 if metric == "kernels" else DEFAULT_MIN_DELTA_NS
    if min_delta != int(min_delta):
        raise ValueError(f"min_delta is a whole number of ns or kernels (got {min_delta})")
    min_delta = int(min_delta)
    notes = _side_notes(base.notes, cand.notes)
    mode, reason = "layers", None
    if not (base.has_layers and cand.has_layers):
        which = " and ".join(s for s, x in (("base", base), ("candidate", cand)) if not x.has_layers)
        mode, reason = "kernel-name fallback", f"no layer attribution on {which}"
    if mode == "layers":
        bv, bl, bnotes = _layer_values(base.layer_steps, col)
        cv, cl, cnotes = _layer_values(cand.layer_steps, col)
        if not (set(bv) & set(cv)) - {(ALL_LAYERS, -1, "")}:
            mode, reason = "kernel-name fallback", "no (layer kind, layer index, op) in common"
    if mode != "layers":
        notes.append(f"kernel-name fallback: {reason}; kernels are aligned by name, not by layer and op")
        bv, bl, bnotes = _kernel_name_values(base.kernels)
        cv, cl, cnotes = _kernel_name_values(cand.kernels)
        if not (set(bv) & set(cv)) - {(ALL_KERNELS, -1, "")}:
            raise NotComparable(f"{base.name} vs {cand.name}",
                                f"cannot be compared: {reason}, and no kernel name in common")
    notes += _side_notes(bnotes, cnotes)
    if mode != "layers" and metric == "bubbles":
        col = METRICS["busy"]
        notes.append("bubbles are not defined per kernel name: kernel time is compared instead")
    settings = {"metric": metric, "gate": gate, "threshold_pct": threshold_pct, "min_delta": min_delta,
                "resamples": resamples,
                "confidence": CONFIDENCE, "seed": seed, "statistic": "median (gate) and p90 over steps, nearest rank: the "
                "ceil(n/2)-th and ceil(0.9 n)-th smallest, integer ns",
                "ci": "percentile bootstrap of steps, each side resampled independently"}
    rows = [_key_row(k, bv.get(k), cv.get(k), {**cl, **bl}[k], col, metric, threshold_pct, min_delta, resamples, seed)
            for k in sorted(set(bv) | set(cv), key=_sort_key)]
    if mode == "layers":
        _explain(rows, base, cand, metric, min_delta, (bv, cv))
    else:
        for r in rows:
            if r["verdict"] == "regression":
                r["explanation"] = {"ops": [], "kernels": [], "median_step": None, "span_delta_ns": None,
                                    "kernel_time_delta_ns": r["busy_delta_ns"], "bubble_delta_ns": None,
                                    "exposed_comm_delta_ns": None}
    # the gate: regressions finer than its level are kept, but do not fail the run
    depth = GATES.index(gate)
    for k, r in zip(sorted(set(bv) | set(cv), key=_sort_key), rows):
        r["level"] = key_level(k)
        if r["verdict"] == "regression" and GATES.index(r["level"]) < depth:
            r["verdict"] = "regression below gate"
    increases = [{"layer": r["layer"], "op": r["op"], "kernel": r.get("kernel"), "base_kernels": r["base_kernels"],
                  "cand_kernels": r["cand_kernels"]}
                 for r in rows if r["base_kernels"] is not None and r["cand_kernels"] is not None
                 and r["cand_kernels"] > r["base_kernels"]]
    alignment = {"matched": sum(1 for k in bv if k in cv), "base_only": sum(1 for k in bv if k not in cv),
                 "cand_only": sum(1 for k in cv if k not in bv), "aligned_by": "kernel name" if mode != "layers"
                 else "(layer kind, layer index, op)", "fallback_reason": reason}
    info = _side_info(base, bv), _side_info(cand, cv)
    single = [role for role, i in zip(("base", "candidate"), info) if i["steps"] == 1]
    if single:
        notes.append(f"single step on {' and '.join(single)}: the confidence intervals are degenerate, "
                     "so the gate uses point estimates (capture more steps)")
    return DiffReport(*info, mode, settings, rows, alignment, increases, notes)


def _side_notes(base: list[str], cand: list[str]) -> list[str]:
    """Each side's notes, labelled; a note both sides share is said once."""
    return ([f"base and candidate: {n}" for n in base if n in cand] + [f"base: {n}" for n in base if n not in cand]
            + [f"candidate: {n}" for n in cand if n not in base])


def _sort_key(k: Key) -> tuple[int, str, int, str]:
    return (0 if k[0] in (ALL_LAYERS, ALL_KERNELS) else 1, k[0], k[1], k[2])


def _side_info(s: RunSample, values: dict[Key, pd.DataFrame]) -> dict[str, Any]:
    attributed = int(s.kernels["layer"].notna().sum()) if len(s.kernels) else 0
    steps = max((len(v) for v in values.values()), default=0)
    return {"run_id": s.run_id, "name": s.name, "steps": steps, "kernels": int(len(s.kernels)),
            "kernels_in_layers": attributed,
            "kernels_in_layers_pct": round(100 * attributed / len(s.kernels), 2) if len(s.kernels) else None}


def _key_row(k: Key, b: pd.DataFrame | None, c: pd.DataFrame | None, label: str, col: str, metric: str,
             threshold: float, min_delta: int, resamples: int, seed: int) -> dict[str, Any]:
    """One aligned key: medians, p90s, bootstrap CIs and the verdict."""
    kind, index, op = k
    row: dict[str, Any] = {"layer": label, "layer_kind": kind or None,
                           "layer_index": index if index >= 0 else None, "op": op or None,
                           "base_steps": 0 if b is None else len(b), "cand_steps": 0 if c is None else len(c)}
    if kind == "kernel":
        row.update(layer=None, kernel=op, op=None)
    med = lambda f, name: None if f is None else nearest_rank(f[name].to_numpy(), MEDIAN)  # noqa: E731
    for name, short in (("kernels", "kernels"), ("busy_ns", "busy_ns"), ("bubble_ns", "bubble_ns")):
        row[f"base_{short}"], row[f"cand_{short}"] = med(b, name), med(c, name)
    row["busy_delta_ns"] = None if b is None or c is None else row["cand_busy_ns"] - row["base_busy_ns"]
    if b is None or c is None:
        row.update(verdict="added" if b is None else "removed", median=None, p90=None)
        return row
    row["median"], row["p90"] = bootstrap_changes(b[col].to_numpy(), c[col].to_numpy(), (MEDIAN, P90), resamples, seed)
    m = row["median"]
    if metric == "kernels":
        worse, better = m["delta"] > min_delta, m["delta"] < -min_delta
    else:
        worse = m["ci_pct"][0] > threshold and m["ci_delta"][0] > min_delta
        better = m["ci_pct"][1] < -threshold and m["ci_delta"][1] < -min_delta
    row["verdict"] = "regression" if worse else "improvement" if better else "unchanged"
    return row


def median_step(values: pd.DataFrame, col: str) -> Any:
    """The step whose `col` is the median over steps: the ceil(n/2)-th of the steps ordered by
    (`col`, step index), so among equal values the step index decides."""
    order = np.lexsort((values.index.to_numpy(), values[col].to_numpy()))
    return values.index[order[rank_index(len(values), MEDIAN)]]


def _explain(rows: list[dict[str, Any]], base: RunSample, cand: RunSample, metric: str, min_delta: int,
             values: tuple[dict[Key, pd.DataFrame], dict[Key, pd.DataFrame]]) -> None:
    """Attach to each regression its ops, kernel-level changes and time decomposition.

    The decomposition is read at one step per side, the median step of the compared time metric
    (span for metric 'kernels'), so its parts add up exactly in integer ns: kernel time + bubbles
    = the change of the median span (with metric 'busy', kernel time is the median's change,
    with 'bubbles' the bubbles are). A difference of two separate medians would not add up."""
    seqs = [_Sequences(base.kernels), _Sequences(cand.kernels)]  # per (layer, op), once, when asked
    by_key = {(r["layer_kind"] or "", r["layer_index"] if r["layer_index"] is not None else -1, r["op"] or ""): r
              for r in rows}
    time_col = METRICS["span" if metric == "kernels" else metric]
    for r in rows:
        if r["verdict"] != "regression":
            continue
        kind, index, op = r["layer_kind"] or "", r["layer_index"] if r["layer_index"] is not None else -1, r["op"] or ""
        # the leaf (layer, op) keys under this regression: itself, its layer's ops, or every op
        leaves = [x for k, x in by_key.items() if k[2] != "" and k[0] != ALL_LAYERS
                  and (kind == ALL_LAYERS or k[:2] == (kind, index)) and (not op or k[2] == op)]
        ops = sorted(leaves, key=lambda x: -(_delta(x, metric) or 0))
        kernels: list[dict[str, Any]] = []
        for leaf in ops:
            lk = (leaf["layer_kind"] or "", leaf["layer_index"] if leaf["layer_index"] is not None else -1, leaf["op"])
            for ch in kernel_changes(seqs[0][lk], seqs[1][lk]):
                if ch["change"] != "same" or abs(ch["delta_ns"]) >= min_delta:
                    kernels.append({"layer": leaf["layer"], "op": leaf["op"], **ch})
        kernels.sort(key=lambda x: -abs(x["delta_ns"]))
        bvals, cvals = values[0][(kind, index, op)], values[1][(kind, index, op)]
        steps = median_step(bvals, time_col), median_step(cvals, time_col)
        at_b, at_c = bvals.loc[steps[0]], cvals.loc[steps[1]]
        r["explanation"] = {
            "ops": [{"layer": x["layer"], "op": x["op"], "verdict": x["verdict"], "delta": _delta(x, metric),
                     "base_kernels": x["base_kernels"], "cand_kernels": x["cand_kernels"]} for x in ops[:8]],
            "kernels": kernels[:12],
            "median_step": {"base": _step_id(steps[0]), "cand": _step_id(steps[1])},
            "span_delta_ns": int(at_c["span_ns"]) - int(at_b["span_ns"]),
            "kernel_time_delta_ns": int(at_c["busy_ns"]) - int(at_b["busy_ns"]),
            "bubble_delta_ns": int(at_c["bubble_ns"]) - int(at_b["bubble_ns"]),
            "exposed_comm_delta_ns": None if op else _exposed_delta(
                base, cand, "" if kind == ALL_LAYERS else r["layer"], steps),
        }


def _step_id(step: Any) -> int:
    """A step index as a plain int for JSON (DuckDB may hand it over as a float or numpy int)."""
    return int(step)


def _delta(row: dict[str, Any], metric: str) -> int | None:
    """The median change of the gating metric; for an added/removed key, its whole value."""
    if row.get("median"):
        return row["median"]["delta"]
    short = {"span": "busy_ns", "busy": "busy_ns", "kernels": "kernels", "bubbles": "bubble_ns"}[metric]
    b, c = row.get(f"base_{short}"), row.get(f"cand_{short}")
    return (c or 0) - (b or 0)


def _exposed_delta(base: RunSample, cand: RunSample, layer: str, steps: tuple[Any, Any]) -> int | None:
    """Exposed communication of the layer (`layer` '' is the whole step) at each side's median
    step (0 in a step without any), cand - base; None when a side has no overlap data."""
    if base.exposed_comm is None or cand.exposed_comm is None:
        return None

    def at(df: pd.DataFrame, step: Any) -> int:
        hit = df.loc[(df["layer"] == layer) & (df["step_index"] == step), "exposed_ns"]
        return int(hit.iloc[0]) if len(hit) else 0

    return at(cand.exposed_comm, steps[1]) - at(base.exposed_comm, steps[0])
