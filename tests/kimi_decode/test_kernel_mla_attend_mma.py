"""CPU tests of the tensor-core MLA decode attention (kimi_decode/kernels/mla_attend_mma.py).

Oracles:
- the kernel compiles to sm_90a PTX at the K3 TP16 shapes it runs at (R = 6 rows per sequence,
  one and many sequences; uv mode at M = 1 and 8) and at R = 48 (B = 1, k = 7, checked on the
  device): the mma count the tile loops imply, the prmt of the V staging, the barrier's
  acquire/acq_rel/release operations, no local memory, and (ptxas) ≤ 255 registers, no spills
  (one CTA of 256 threads per SM is the grid merge's residency rule);
- the kernel's index maps, restated here from the PTX ISA's m16n8k16 fragment layouts and
  replayed in float64 on one tile: q·Kᵀ from the lanes' 128-bit words with the permuted k order,
  the V staging's shuffle + prmt into position pairs, p̃·V from shared memory, and the partial
  write's column quads: each equals the plain matrix product (so a wrong map fails here, not
  only on the GPU);
- the algorithm (the device-side tile split, per-split online softmax with p̃ rounded to bf16
  and summed rounded, the merge's weights) in float64 equals mla_attend.reference within bf16
  rounding, and a wrong mask does not;
- plan(): every CTA resident, the merge's loads per thread bounded; the device's tile split
  covers every valid tile exactly once; fused.py takes the kernel at R ≤ 6 only.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
cute = pytest.importorskip("cutlass.cute")

from cutlass import Int32  # noqa: E402

from tests.kimi_decode.ptxas_tool import ptxas_path, ptxas_usage  # noqa: E402
from kimi_decode.config import k3_tp16  # noqa: E402
from kimi_decode.kernels import _common  # noqa: E402
from kimi_decode.kernels import mla_attend_mma as km  # noqa: E402
from kimi_decode.kernels.mla_attend import reference  # noqa: E402

bf, f32 = torch.bfloat16, torch.float32
P = _common.dummy_ptr
SCALE = (128 + 64) ** -0.5


def config(batch: int, spec: int, uv: bool = False, groups: int | None = None) -> km.MMAConfig:
    """The build the wrapper compiles at (batch, spec): row_groups' default groups unless given."""
    cfg = k3_tp16(batch=batch, spec_tokens=spec)
    T, H = cfg.tokens_per_seq, cfg.mla_local_heads
    G = km.row_groups(T * H, batch) if groups is None else groups
    _, _, kq, nl = km.plan(batch, T * H, cfg.cache_len, cfg.kv_lora_rank, groups=G)
    return km.MMAConfig(H, T, cfg.kv_lora_rank, cfg.qk_rope_dim, SCALE, kq, nl,
                        uv_rows=batch * T if uv else 0, v_dim=cfg.v_head_dim, groups=G)


def ptx_of(tmp_path: Path, cfg: km.MMAConfig) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    opts = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    cute.compile(km.MLAAttendMMA(cfg), P(bf), P(bf), P(torch.int64), P(bf), P(f32), P(f32), P(torch.int32),
                 P(bf), P(bf), P(bf), P(torch.int64), Int32(1), Int32(1), Int32(1), _common.current_stream(),
                 options=opts)
    files = list(tmp_path.glob("*.ptx"))
    assert len(files) == 1, files
    return files[0].read_text()


def expected_mma(cfg: km.MMAConfig) -> int:
    """mma per compiled tile body (scores: MT·KC·2; P·V: 2 k-steps · JW · MT · 4) × the tile
    bodies the kernel unrolls (NBUF)."""
    k = km.MLAAttendMMA(cfg)
    return k.NBUF * (k.MT * k.KC * 2 + (km.TILE // 16) * k.JW * k.MT * 4)


@pytest.mark.parametrize("batch,spec,groups", [(1, 7, None), (1, 7, 1), (8, 0, None)])
def test_compiles(tmp_path: Path, batch: int, spec: int, groups: int | None) -> None:
    """R = 48 both ways: in row groups of 16 (the default build: one m-tile per CTA, two tiles
    of cache words in flight) and ungrouped (three m-tiles)."""
    cfg = config(batch, spec, groups=groups)
    assert cfg.groups == (3 if (spec, groups) == (7, None) else 1)
    ptx = ptx_of(tmp_path, cfg)
    assert ".target sm_90a" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == expected_mma(cfg)
    k = km.MLAAttendMMA(cfg)
    assert ptx.count("prmt.b32") == 4 * k.KC * k.NBUF        # V staging: 4 pair words per chunk
    assert "shfl.sync.bfly" in ptx and "cvt.rn.bf16.f32" in ptx and "ex2" in ptx
    assert "ld.global.v4" in ptx and "ld.shared.v4" in ptx and "st.shared.v4" in ptx
    # the grid barrier: epoch read + poll (acquire), the arrival (acq_rel), the epoch bump
    assert ptx.count("ld.acquire.gpu") == 2
    assert ptx.count("atom.global.acq_rel.add") == 1 and ptx.count("atom.global.release.add") == 1
    if ptxas_path():
        regs, spills = ptxas_usage(tmp_path, ptx)
        assert spills == 0 and regs <= 255, (regs, spills)   # 205 (R = 48), 198 (R = 6) at commit time


@pytest.mark.parametrize("batch,spec", [(1, 0), (8, 0), (1, 7)])
def test_uv_mode_compiles(tmp_path: Path, batch: int, spec: int) -> None:
    """uv mode adds mla_attend's publish / uv_tile: one more acquire poll, two more acq_rel
    atomics (the publish and the workers' pass counter), the W_UV tile's loads and the bf16
    gate multiply; the attention code (its mma) is unchanged (at B = 1, k = 7 in row groups)."""
    base = ptx_of(tmp_path / "base", config(batch, spec))
    ptx = ptx_of(tmp_path / "uv", config(batch, spec, uv=True))
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert ptx.count("ld.acquire.gpu") == 3
    assert ptx.count("atom.global.acq_rel.add") == 3
    assert ptx.count("mul.bf16") == 1 and "mul.bf16" not in base
    assert ptx.count("ld.global.v4") > base.count("ld.global.v4")
    assert ptx.count("mma.sync.aligned") == base.count("mma.sync.aligned")
    if ptxas_path():
        regs, spills = ptxas_usage(tmp_path, ptx)
        assert spills == 0 and regs <= 255, (regs, spills)


# ---- the phase probe (bench/mla_mma_phases.py) ------------------------------------------------

def stored_words64(ptx: str) -> int:
    """64-bit words the PTX stores to global memory (the probe's stamps: scalar or vectors)."""
    return (ptx.count("st.global.b64") + ptx.count("st.global.u64") + ptx.count("st.global.s64")
            + 2 * ptx.count("st.global.v2.b64") + 2 * ptx.count("st.global.v2.u64")
            + 4 * ptx.count("st.global.v4.b64"))


@pytest.mark.parametrize("batch,spec,uv", [(1, 7, True), (1, 0, True), (1, 7, False)])
def test_probe_build_stamps_every_phase_and_keeps_the_math(tmp_path: Path, batch: int, spec: int, uv: bool) -> None:
    """The probe build reads %globaltimer and stores one 64-bit stamp per PROBE_PHASES entry;
    its arithmetic (mma, prmt, ex2) and the barrier's atomics are the default build's, and the
    default build reads no timer and stores no 64-bit word (the step's kernel carries no probe
    code); no local memory, and ptxas keeps it within one CTA of 256 threads per SM."""
    cfg = config(batch, spec, uv=uv)
    base = ptx_of(tmp_path / "base", cfg)
    ptx = ptx_of(tmp_path / "probe", replace(cfg, probe=True))
    assert "globaltimer" not in base and stored_words64(base) == 0
    # a timer read per phase (the tile's three per unrolled tile body; "published" only in uv mode)
    assert ptx.count("%globaltimer") >= len(km.PROBE_PHASES) - (0 if uv else 1)
    assert stored_words64(ptx) == len(km.PROBE_PHASES)
    # every stored stamp, in phase order, is a register the timer wrote (a stamp lost inside the
    # tile loop would be stored as the constant 0); only "published" is never stamped without uv
    timers = set(re.findall(r"mov\.u64\s+(%rd\d+), %globaltimer", ptx))
    stored = [w.strip() for line in re.findall(r"st\.global\.v2\.b64\s+\[[^]]+\],\s*\{([^}]*)\}", ptx)
              for w in line.split(",")]
    assert len(stored) == len(km.PROBE_PHASES)
    unstamped = {p for p, reg in zip(km.PROBE_PHASES, stored) if reg not in timers}
    assert unstamped == (set() if uv else {"published"}), (stored, timers)
    for op in ("mma.sync.aligned", "prmt.b32", "ex2.approx", "atom.global", "ld.acquire.gpu"):
        assert ptx.count(op) == base.count(op), op
    assert "ld.local" not in ptx and "st.local" not in ptx
    if ptxas_path():
        regs, spills = ptxas_usage(tmp_path, ptx)
        assert spills == 0 and regs <= 255, (regs, spills)   # 204-208 at commit time


def test_probe_buffer_matches_the_launch() -> None:
    """One row per CTA (B·G·splits; G = 3 at R = 48), one stamp per phase; _probe_ptr, which
    both wrappers call for their launch's probe argument, refuses a buffer of another shape,
    type or layout (the kernel would write past it)."""
    sc = km.make_scratch(1, 48, 4608, 512, "cpu", sms=132)
    pr = km.probe_buffer(sc)
    assert sc.groups == 3 and pr.shape == (3 * sc.splits, len(km.PROBE_PHASES)) and pr.dtype == torch.int64
    assert int(pr.abs().sum()) == 0
    for bad in (pr[:-1], pr.int(), pr.t()):
        with pytest.raises(ValueError, match="probe must be contiguous int64"):
            km._probe_ptr(bad, sc)


# ---- the index maps, replayed in float64 ------------------------------------------------------

def mma(a_lanes: list, b_lanes: list) -> list:
    """One m16n8k16 per the PTX ISA's fragment layouts, lanes' registers as (lo, hi) pairs:
    A: a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9];
    B: b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g]; C: c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][...]."""
    A = torch.zeros(16, 16, dtype=torch.float64)
    B = torch.zeros(16, 8, dtype=torch.float64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        a0, a1, a2, a3 = a_lanes[lane]
        b0, b1 = b_lanes[lane]
        A[g, 2 * t:2 * t + 2] = torch.tensor(a0, dtype=torch.float64)
        A[g + 8, 2 * t:2 * t + 2] = torch.tensor(a1, dtype=torch.float64)
        A[g, 2 * t + 8:2 * t + 10] = torch.tensor(a2, dtype=torch.float64)
        A[g + 8, 2 * t + 8:2 * t + 10] = torch.tensor(a3, dtype=torch.float64)
        B[2 * t:2 * t + 2, g] = torch.tensor(b0, dtype=torch.float64)
        B[2 * t + 8:2 * t + 10, g] = torch.tensor(b1, dtype=torch.float64)
    C = A @ B
    return [(C[lane // 4, 2 * (lane % 4)], C[lane // 4, 2 * (lane % 4) + 1],
             C[lane // 4 + 8, 2 * (lane % 4)], C[lane // 4 + 8, 2 * (lane % 4) + 1]) for lane in range(32)]


def words(row: torch.Tensor, v: int) -> list:
    """The 4 32-bit words (bf16 pairs) of 128-bit vector v of a row."""
    return [(float(row[8 * v + 2 * w]), float(row[8 * v + 2 * w + 1])) for w in range(4)]


def prmt(a: tuple, b: tuple, sel: int) -> tuple:
    return (a[0], b[0]) if sel == km.SEL_LO else (a[1], b[1])


@pytest.mark.parametrize("rows", [48, 6])
def test_fragment_maps_equal_the_products(rows: int) -> None:
    """One tile of the kernel's maps (km.MLAAttendMMA's loops, restated lane by lane):
    scores S = q·Kᵀ, the staged pair words sV, O = p̃·V and the partial's column quads."""
    cfg = km.MMAConfig(6, rows // 6, 512, 64, SCALE)
    k = km.MLAAttendMMA(cfg)
    D, C, RP, MT, KC, JW = k.D, k.C, k.RP, k.MT, k.KC, k.JW
    gen = torch.Generator().manual_seed(rows)
    q = torch.randint(-4, 5, (RP, D), generator=gen).double()
    q[rows:] = 0
    kt = torch.randint(-4, 5, (km.TILE, D), generator=gen).double()     # the tile's cache rows
    # 1. scores: warp (nq, kh), lane (g, t), chunk c, m-tile mt
    sS = torch.zeros(2, RP, km.TILE, dtype=torch.float64)
    for warp in range(km.WARPS):
        nq, kh = warp % km.NQ, warp // km.NQ
        for mt in range(MT):
            acc = [(0.0, 0.0, 0.0, 0.0)] * 32
            for c in range(KC):
                for u in range(2):                          # words 0, 1 then 2, 3
                    a_l, b_l = [], []
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        v = kh * (D // 16) + 4 * c + t
                        lo, hi = words(q[16 * mt + g], v), words(q[16 * mt + g + 8], v)
                        kw = words(kt[8 * nq + g], v)
                        a_l.append((lo[2 * u], hi[2 * u], lo[2 * u + 1], hi[2 * u + 1]))
                        b_l.append((kw[2 * u], kw[2 * u + 1]))
                    out = mma(a_l, b_l)
                    acc = [tuple(float(x) + float(y) for x, y in zip(acc[i], out[i])) for i in range(32)]
            for lane in range(32):
                g, t = lane // 4, lane % 4
                sS[kh, 16 * mt + g, 8 * nq + 2 * t:8 * nq + 2 * t + 2] = torch.tensor(acc[lane][:2])
                sS[kh, 16 * mt + g + 8, 8 * nq + 2 * t:8 * nq + 2 * t + 2] = torch.tensor(acc[lane][2:])
    assert torch.equal(sS[0] + sS[1], q @ kt.T)
    # 2. V staging: lanes g, g ^ 1 swap words, prmt, 128-bit store at (pair, column vector)
    sV = {}
    for warp in range(km.WARPS):
        nq, kh = warp % km.NQ, warp // km.NQ
        regs = {lane: [words(kt[8 * nq + lane // 4], kh * (D // 16) + 4 * c + lane % 4) for c in range(KC)]
                for lane in range(32)}
        for c in range(KC):
            d0 = kh * (D // 2) + 32 * c
            if d0 + 32 > C:
                continue
            send = {lane: (regs[lane][c][0], regs[lane][c][1]) if (lane // 4) % 2 else
                    (regs[lane][c][2], regs[lane][c][3]) for lane in range(32)}
            for lane in range(32):
                g, t = lane // 4, lane % 4
                recv = send[lane ^ 4]
                odd = g % 2
                if odd:
                    x0, x1, y0, y1 = recv[0], recv[1], regs[lane][c][2], regs[lane][c][3]
                else:
                    x0, x1, y0, y1 = regs[lane][c][0], regs[lane][c][1], recv[0], recv[1]
                w4 = [prmt(x0, y0, km.SEL_LO), prmt(x0, y0, km.SEL_HI), prmt(x1, y1, km.SEL_LO),
                      prmt(x1, y1, km.SEL_HI)]
                pair, cv = 4 * nq + g // 2, (d0 + 8 * t) // 4 + odd
                for j in range(4):
                    assert (pair, 4 * cv + j) not in sV
                    sV[(pair, 4 * cv + j)] = w4[j]
    assert len(sV) == km.TILE // 2 * C
    for (pair, col), w in sV.items():
        assert w == (float(kt[2 * pair, col]), float(kt[2 * pair + 1, col]))
    # 3. P·V from shared memory, and 4. the partial's column quads
    p = torch.randint(0, 4, (RP, km.TILE), generator=gen).double()
    p[rows:] = 0
    o = torch.full((RP, C), float("nan"), dtype=torch.float64)
    for warp in range(km.WARPS):
        for mt in range(MT):
            acc = {n: [(0.0, 0.0, 0.0, 0.0)] * 32 for n in range(4 * JW)}
            for u in range(km.TILE // 16):
                a_l = []
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    pw = lambda r, w: (float(p[r, 2 * w]), float(p[r, 2 * w + 1]))  # noqa: E731
                    a_l.append((pw(16 * mt + g, 8 * u + t), pw(16 * mt + g + 8, 8 * u + t),
                                pw(16 * mt + g, 8 * u + t + 4), pw(16 * mt + g + 8, 8 * u + t + 4)))
                for jw in range(JW):
                    for jj in range(4):
                        b_l = []
                        for lane in range(32):
                            g, t = lane // 4, lane % 4
                            cg = (warp * JW + jw) * 8 + g
                            b_l.append((sV[(8 * u + t, 4 * cg + jj)], sV[(8 * u + t + 4, 4 * cg + jj)]))
                        out = mma(a_l, b_l)
                        acc[4 * jw + jj] = [tuple(float(x) + float(y) for x, y in zip(acc[4 * jw + jj][i], out[i]))
                                            for i in range(32)]
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for half in range(2):
                    row = 16 * mt + g + 8 * half
                    for jw in range(JW):
                        qd = (warp * JW + jw) * 8 + 2 * t
                        for e in range(2):
                            for jj in range(4):
                                o[row, 4 * (qd + e) + jj] = acc[4 * jw + jj][lane][2 * half + e]
    assert torch.equal(o, p @ kt[:, :C])


# ---- the algorithm in float64 ------------------------------------------------------------------

def tile_split(n_valid: int, splits: int) -> list[range]:
    """The kernel's share of the valid tiles: split s takes ⌊s·n/S⌋ .. ⌊(s+1)·n/S⌋ − 1."""
    return [range(s * n_valid // splits, (s + 1) * n_valid // splits) for s in range(splits)]


@pytest.mark.parametrize("n_valid", [1, 2, 7, 129, 130, 144])
@pytest.mark.parametrize("splits", [1, 2, 15, 16, 72, 130, 132])
def test_tile_split_covers_every_valid_tile_once(n_valid: int, splits: int) -> None:
    parts = tile_split(n_valid, splits)
    assert sorted(i for r in parts for i in r) == list(range(n_valid))
    sizes = [len(r) for r in parts]
    assert max(sizes) - min(sizes) <= 1


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double()


def emulate(q: torch.Tensor, cache: torch.Tensor, last: torch.Tensor, heads: int, c: int, scale: float,
            splits: int, mask_shift: int = 0, groups: int = 1, wrong_group_mask: bool = False) -> torch.Tensor:
    """The kernel's algorithm in float64 (its rounding points: scores and p̃ to bf16), per
    sequence: valid tiles split as on the device, online softmax over each split's tiles
    (m, l, o), then the merge's weights e^{m − M} and o = Σ w·o / Σ w·l, rounded to bf16.
    With `groups` G > 1, as the grouped build: each row group (rows i·R/G ..) is its own
    sequence of R/G rows with `splits` splits, its mask taken at the group's global rows
    (`wrong_group_mask`: at its local rows, the bug a missing row offset would be)."""
    if groups > 1:
        R = q.shape[1]
        rg = R // groups
        parts = []
        for i in range(groups):
            sub = slice(i * rg, (i + 1) * rg)
            rows_last = last.repeat_interleave(heads)
            parts.append(_emulate_rows(q[:, sub], cache, last, heads, c, scale, splits, mask_shift,
                                       row_last=rows_last[:rg] if wrong_group_mask else rows_last[sub]))
        return torch.cat(parts, 1)
    return _emulate_rows(q, cache, last, heads, c, scale, splits, mask_shift)


def _emulate_rows(q: torch.Tensor, cache: torch.Tensor, last: torch.Tensor, heads: int, c: int, scale: float,
                  splits: int, mask_shift: int = 0, row_last: torch.Tensor | None = None) -> torch.Tensor:
    """emulate() for one set of rows; `row_last` the last valid position of each row (default:
    last[t] of row t·H + h)."""
    B, R, _ = q.shape
    T = last.shape[0]
    valid = min(int(last.max()) + 1, cache.shape[1])
    n_valid = (valid + km.TILE - 1) // km.TILE
    out = torch.empty(B, R, c, dtype=torch.float64)
    for b in range(B):
        parts = []
        for rng in tile_split(n_valid, splits):
            m = torch.full((R,), km.NEG, dtype=torch.float64)
            l = torch.zeros(R, dtype=torch.float64)
            o = torch.zeros(R, c, dtype=torch.float64)
            for tile in rng:
                pos = torch.arange(tile * km.TILE, min((tile + 1) * km.TILE, valid))
                kv = cache[b, pos].double()
                s = bf16(q[b].double() @ kv.T) * scale
                rl = last.repeat_interleave(heads) if row_last is None else row_last
                ok = pos[None, :] <= (rl[:, None] + mask_shift)
                s = torch.where(ok, s, torch.full_like(s, km.NEG))
                m_new = torch.maximum(m, s.max(1).values)
                alpha = torch.exp(m - m_new)
                p = torch.where(s > km.VALID, bf16(torch.exp(s - m_new[:, None])), torch.zeros_like(s))
                l = l * alpha + p.sum(1)
                o = o * alpha[:, None] + p @ kv[:, :c]
                m = m_new
            parts.append((m, l, o))
        M = torch.stack([x[0] for x in parts]).max(0).values
        w = [torch.where(x[0] > km.VALID, torch.exp(x[0] - M), torch.zeros_like(M)) for x in parts]
        L = sum(wi * x[1] for wi, x in zip(w, parts))
        O = sum(wi[:, None] * x[2] for wi, x in zip(w, parts))
        out[b] = bf16(O / L[:, None])
    return out


@pytest.mark.parametrize("batch,tokens,splits", [(1, 8, 5), (2, 1, 3), (1, 1, 7)])
def test_emulated_algorithm_matches_reference(batch: int, tokens: int, splits: int) -> None:
    heads, c, rope, C = 6, 32, 16, 200
    gen = torch.Generator().manual_seed(7 * batch + tokens)
    cache = torch.randn(batch, C, c + rope, generator=gen).bfloat16()
    q = (torch.randn(batch, tokens * heads, c + rope, generator=gen) * 0.5).bfloat16()
    last = 150 + torch.arange(tokens)
    ref = reference(q, cache, last, heads, c, SCALE)
    got = emulate(q, cache, last, heads, c, SCALE, splits)
    err = float((got - ref).norm() / ref.norm())
    assert err < 4e-3, err
    wrong = emulate(q, cache, last, heads, c, SCALE, splits, mask_shift=-3)
    assert float((wrong - ref).norm() / ref.norm()) > 1e-2


def test_emulated_row_groups_match_reference() -> None:
    """B = 1, k = 7 in 3 row groups of 16 (two tokens and a half each) with 44 splits each:
    within bf16 rounding of the reference; the same with each group masked at its local rows
    (the kernel without its row offset) is not."""
    heads, tokens, c, rope, C = 6, 8, 32, 16, 300
    gen = torch.Generator().manual_seed(48)
    cache = torch.randn(1, C, c + rope, generator=gen).bfloat16()
    q = (torch.randn(1, tokens * heads, c + rope, generator=gen) * 0.5).bfloat16()
    last = 250 + torch.arange(tokens)
    ref = reference(q, cache, last, heads, c, SCALE)
    got = emulate(q, cache, last, heads, c, SCALE, 5, groups=km.row_groups(tokens * heads))
    assert float((got - ref).norm() / ref.norm()) < 4e-3
    wrong = emulate(q, cache, last, heads, c, SCALE, 5, groups=3, wrong_group_mask=True)
    assert float((wrong - ref).norm() / ref.norm()) > 1e-2


@pytest.mark.parametrize("rows,groups", [(6, 1), (12, 1), (16, 1), (18, 2), (24, 2), (30, 2), (36, 3),
                                         (42, 3), (48, 3)])
def test_row_groups_are_the_fewest_that_divide(rows: int, groups: int, monkeypatch) -> None:
    """The fewest groups of ≤ GROUP_ROWS rows that divide R = T·H (H = 6, T = 1..8); none with
    GROUP_ROWS = 0 (the ungrouped build, fused_ab's --patch for the A/B)."""
    assert km.row_groups(rows) == groups
    assert rows % groups == 0 and rows // groups <= km.GROUP_ROWS
    monkeypatch.setattr(km, "GROUP_ROWS", 0)
    assert km.row_groups(rows) == 1


@pytest.mark.parametrize("batch,groups", [(1, 3), (2, 3), (3, 1), (8, 1)])
def test_row_groups_keep_enough_splits(batch: int, groups: int) -> None:
    """R = 48 on 132 SMs: 3 groups while 132 // (3B) ≥ GROUP_MIN_SPLITS (16: 44 at B = 1, 22 at
    B = 2), else none (no groups of more than GROUP_ROWS rows): at B = 8 the groups would leave
    5 splits of 29 tiles, measured slower than ungrouped."""
    assert km.row_groups(48, batch, 132) == groups


# ---- plan, limits, dispatch --------------------------------------------------------------------

@pytest.mark.parametrize("batch,spec", [(1, 0), (1, 7), (8, 0), (8, 7), (64, 0)])
def test_plan_fits_the_h200(batch: int, spec: int) -> None:
    cfg = k3_tp16(batch=batch, spec_tokens=spec)
    R = cfg.tokens_per_seq * cfg.mla_local_heads
    G = km.row_groups(R, batch)
    splits, tps, kq, nl = km.plan(batch, R, cfg.cache_len, cfg.kv_lora_rank, groups=G)
    assert km.fits(batch, R, cfg.cache_len, cfg.kv_lora_rank)
    assert batch * G * splits <= km.H200_SMS and splits <= km.THREADS and 1 <= nl <= km.MAX_NL
    assert (G, splits) == {(1, 7): (3, 44), (8, 7): (1, 16)}.get((batch, spec), (1, min(132 // batch, 130)))
    quads = cfg.kv_lora_rank // 4
    assert quads // kq >= 32 and (R // G * kq >= splits or kq == quads // 32)
    assert nl == math.ceil(splits / (km.THREADS * kq // quads))
    assert splits * tps >= (cfg.cache_len + km.TILE - 1) // km.TILE


def test_limits_and_wrapper_refusals() -> None:
    assert km.can_implement(6, 8, 512, 64, (bf,)) and km.can_implement(6, 1, 512, 64, (bf,))
    assert not km.can_implement(6, 9, 512, 64, (bf,))                  # R = 54 > 48
    assert not km.can_implement(6, 1, 256, 64, (bf,))                  # c ≠ 64 · warps
    assert not km.can_implement(6, 1, 512, 64, (torch.float16,))
    assert km.can_implement_uv(1, 6, 1, 512, 64, 128, 130, (bf,))
    assert not km.can_implement_uv(64, 6, 1, 512, 64, 128, 2, (bf,))   # M = 64: past uv_gate's rows
    assert km.fits(132, 6, 4160, 512)                                  # one split per sequence, 132 CTAs
    assert not km.fits(133, 6, 4160, 512)                              # more CTAs than SMs
    assert km.fits(1, 48, 4608, 512, groups=3) and km.fits(1, 48, 4608, 512, groups=1)
    assert not km.fits(1, 48, 4608, 512, groups=5) and not km.fits(1, 48, 4608, 512, groups=0)
    with pytest.raises(ValueError, match="5 row groups do not divide 48 rows"):
        km.make_scratch(1, 48, 4608, 512, "cpu", sms=132, groups=5)
    q = torch.zeros(1, 6, 576, dtype=bf)
    with pytest.raises(ValueError, match="mla_attend_mma cannot run"):
        km.mla_attend_mma(q, torch.zeros(1, 64, 512, dtype=bf), torch.zeros(1, dtype=torch.int64), 6, 512, SCALE)


def test_fused_uses_it_at_six_rows_per_sequence_and_48_in_one() -> None:
    """R ≤ 6 rows per sequence at every B; R = 48 (k = 7) only at B = 1 (in row groups; at
    B = 8 the kernel was slower than stock's chain)."""
    from kimi_decode import fused
    on = frozenset({"mla_attend_mma"})
    for batch, spec, used in ((1, 0, True), (8, 0, True), (64, 0, True), (1, 7, True), (8, 7, False)):
        sc = fused._mla_mma_scratch(k3_tp16(batch=batch, spec_tokens=spec), on, torch.device("cpu"))
        assert (sc is not None) == used, (batch, spec)
    assert fused._mla_mma_scratch(k3_tp16(), frozenset(), torch.device("cpu")) is None
    assert "mla_attend_mma" in fused.VERIFIED and "mla_attend_mma" in fused.DEFAULT_KERNELS


def test_registered_for_the_device_check() -> None:
    from kimi_decode.kernels import CHECK_MODULES, KERNELS
    from kimi_decode.kernels.checks import CHECKS
    assert "mla_attend_mma" in KERNELS and CHECK_MODULES["mla_attend_mma"] == "mla_attend_mma"
    assert "mla_attend_mma" in CHECKS


def prmt_b32(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): result byte i = byte (sel >> 4i) & 7 of {b, a} (a: bytes
    0-3, b: bytes 4-7), sign replication off (the kernel's selectors have bit 3 clear)."""
    src = a | (b << 32)
    return sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def test_prmt_selectors_pair_the_halves() -> None:
    """SEL_LO packs (a.lo, b.lo) and SEL_HI (a.hi, b.hi), low half first: the pair words the
    V staging builds from two positions' words (the test above assumes exactly this)."""
    a, b = 0x2222_1111, 0x4444_3333          # a = (lo 0x1111, hi 0x2222), b = (0x3333, 0x4444)
    assert prmt_b32(a, b, km.SEL_LO) == 0x3333_1111
    assert prmt_b32(a, b, km.SEL_HI) == 0x4444_2222


# ---- the device checks' harness on the CPU (kernels replaced by their contracts) --------------

@pytest.fixture
def emulated_mma(monkeypatch):
    """check / check_uv on the CPU: both modes of the kernel replaced by mla_attend's float64
    contract (the stock op's math) and mla_glue's uv_gate contract, as test_kernel_mla_attend
    does for mla_attend."""
    from tests.kimi_decode.test_kernel_mla_attend import _emulate_attend, _emulate_uv_gate
    import kimi_decode.kernels.mla_glue as mg
    from kimi_decode import stock_ops
    from kimi_decode.kernels import checks
    monkeypatch.setattr(checks, "DEVICE", "cpu")
    monkeypatch.setattr(stock_ops, "maybe_compiled", lambda fn, enabled: fn)
    monkeypatch.setattr(mg, "uv_gate", _emulate_uv_gate)
    monkeypatch.setattr(km, "mla_attend_mma",
                        lambda q, cache, last, h, c, scale, scratch=None: _emulate_attend(q, cache, last, h, c, scale))

    def attend_uv(q, cache, last, h, c, scale, w_uv, g, scratch):
        o_lat = _emulate_attend(q, cache, last, h, c, scale)
        return _emulate_uv_gate(o_lat, w_uv, g), o_lat
    monkeypatch.setattr(km, "mla_attend_mma_uv", attend_uv)
    return monkeypatch


def test_check_harness_passes_emulation(emulated_mma) -> None:
    rows = km.check(timing=False, cases=((1, 7), (8, 0)))
    assert [(r["B"], r["k"], r["groups"]) for r in rows] == [(1, 7, 3), (1, 7, 1), (8, 0, 1)]
    assert all(r["ok"] for r in rows), rows
    rows = km.check_uv(timing=False)
    assert [(r["B"], r["k"], r["workers"], r["groups"]) for r in rows] == [(1, 0, 48, 1), (8, 0, 48, 1),
                                                                           (1, 7, 48, 3)]
    assert all(r["ok"] and r["o_equal_two_launch"] for r in rows), rows


def test_check_harness_rejects_wrong_kernels(emulated_mma) -> None:
    """A kernel that drops the mask fails the attention check; a uv mode gating with σ(-g)
    (o_lat right) fails the uv check on its bit-equality to the two launches."""
    from tests.kimi_decode.test_kernel_mla_attend import _emulate_attend, _emulate_uv_gate
    emulated_mma.setattr(km, "mla_attend_mma", lambda q, cache, last, h, c, scale, scratch=None:
                         _emulate_attend(q, cache.nan_to_num(0.0), last + 5, h, c, scale))
    assert not any(r["ok"] for r in km.check(timing=False, cases=((1, 7),)))

    def wrong(q, cache, last, h, c, scale, w_uv, g, scratch):
        o_lat = _emulate_attend(q, cache, last, h, c, scale)
        return _emulate_uv_gate(o_lat, w_uv, -g), o_lat
    emulated_mma.setattr(km, "mla_attend_mma", lambda q, cache, last, h, c, scale, scratch=None:
                         _emulate_attend(q, cache, last, h, c, scale))
    emulated_mma.setattr(km, "mla_attend_mma_uv", wrong)
    rows = km.check_uv(timing=False, cases=((1, 0),))
    assert len(rows) == 1 and not rows[0]["ok"] and not rows[0]["o_equal_two_launch"]
    assert rows[0]["o_lat_equal_mla_attend_mma"]


# ---- PRE_WAIT_TILES: the positions and the first tiles before the PDL chain's wait -----------

def chained_lines(tmp_path: Path, cfg: km.MMAConfig, monkeypatch, pre: bool, reload: bool = True) -> list[str]:
    """The build's PTX instruction lines with the PDL chain on (no prefetch budget)."""
    from kimi_decode.kernels import chain
    monkeypatch.setattr(km, "PRE_WAIT_TILES", pre)
    monkeypatch.setattr(km, "RELOAD_NEW", reload)
    chain.set_chain(True, 0)
    try:
        ptx = ptx_of(tmp_path, cfg)
    finally:
        chain.set_chain(False, chain.DEFAULT_BUDGET)
    return [s.strip() for s in ptx.splitlines() if s.strip() and not s.strip().startswith("//")]


@pytest.mark.parametrize("batch,spec,uv", [(1, 0, True), (1, 7, True), (8, 0, False)])
def test_pre_wait_tiles_load_before_the_wait_and_reload_after(tmp_path: Path, monkeypatch, batch: int, spec: int,
                                                              uv: bool) -> None:
    """Off, nothing is loaded before griddepcontrol.wait. On (the default): `last` (T int64:
    one 32-bit load at T = 1, four 128-bit loads at T = 8) and the NBUF pre-loaded tiles' KC
    128-bit cache loads per lane come before the wait, and after it the build has exactly
    NBUF·KC 128-bit loads more than the default one (the re-load of this step's rows), none
    without RELOAD_NEW; the arithmetic (mma, prmt, ex2) is the default build's."""
    cfg = config(batch, spec, uv=uv)
    k = km.MLAAttendMMA(cfg)
    base = chained_lines(tmp_path / "base", cfg, monkeypatch, False)
    pre = chained_lines(tmp_path / "pre", cfg, monkeypatch, True)
    bare = chained_lines(tmp_path / "bare", cfg, monkeypatch, True, reload=False)

    def before_wait(lines: list[str]) -> list[str]:
        w = next(i for i, s in enumerate(lines) if s.startswith("griddepcontrol.wait"))
        return [s.split()[0] for s in lines[:w] if s.startswith("ld.global")]

    def count(lines: list[str], op: str) -> int:
        return sum(s.startswith(op) for s in lines)
    assert before_wait(base) == []
    last_loads = {"ld.global.b32": 1} if cfg.tokens == 1 else {"ld.global.v4.b32": cfg.tokens * 8 // 16}
    got = before_wait(pre)
    expect = {"ld.global.v4.b32": k.NBUF * k.KC + last_loads.get("ld.global.v4.b32", 0)}
    expect.update({op: n for op, n in last_loads.items() if op != "ld.global.v4.b32"})
    assert {op: got.count(op) for op in set(got)} == expect
    assert count(pre, "ld.global.v4") == count(base, "ld.global.v4") + k.NBUF * k.KC
    assert count(bare, "ld.global.v4") == count(base, "ld.global.v4")
    for op in ("mma.sync.aligned", "prmt.b32", "ex2.approx"):
        assert count(pre, op) == count(base, op), op
    if ptxas_path():
        regs, spills = ptxas_usage(tmp_path, "\n".join(pre))
        assert spills == 0 and regs <= 255, (regs, spills)


def test_pre_wait_tiles_change_nothing_without_the_chain(tmp_path: Path, monkeypatch) -> None:
    """The switch acts only where the chain is on: unchained, the PTX is the default build's."""
    cfg = config(1, 0, uv=True)
    monkeypatch.setattr(km, "PRE_WAIT_TILES", False)
    base = ptx_of(tmp_path / "base", cfg)
    monkeypatch.setattr(km, "PRE_WAIT_TILES", True)
    pre = ptx_of(tmp_path / "pre", cfg)
    strip = lambda p: [s for s in p.splitlines() if not s.strip().startswith("//")]  # noqa: E731
    assert strip(pre) == strip(base)


def test_chain_writer_releases_first_and_writes_last(tmp_path: Path) -> None:
    """The late writer: launch_dependents before the timer loop, its only global store after
    it; the wrapper refuses shapes it does not take."""
    from kimi_decode.kernels import chain_writer as cw
    opts = f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path}"
    cute.compile(cw.DelayedRowWriter(cw.WriterConfig(8, 576)), P(bf), P(bf), P(torch.int64), Int32(1), Int32(1),
                 Int32(1), _common.current_stream(), options=opts)
    lines = [s.strip() for s in next(tmp_path.glob("*.ptx")).read_text().splitlines()]
    first = lambda op: next(i for i, s in enumerate(lines) if s.startswith(op))  # noqa: E731
    assert first("griddepcontrol.launch_dependents") < first("mov.u64") < first("st.global")
    assert sum("%globaltimer" in s for s in lines) == 2
    with pytest.raises(ValueError, match="write_rows_late"):
        cw.write_rows_late(torch.zeros(1, 8, 576, dtype=bf), torch.zeros(1, 64, 576, dtype=bf),
                           torch.arange(7), 1000)


@pytest.fixture
def raced_writer(emulated_mma):
    """check_pre_wait on the CPU: the late writer's copy is held back and the kernel's contract
    decides what the attention sees: a build with the re-load sees the written rows, one
    without sees the rows as they were before the writer (the race the device check forces)."""
    from tests.kimi_decode.test_kernel_mla_attend import _emulate_attend, _emulate_uv_gate
    from kimi_decode.kernels import chain_writer
    pending: list = []
    emulated_mma.setattr(chain_writer, "write_rows_late",
                         lambda src, dst, last, delay_ns: pending.append((src, dst, last)))

    def land() -> None:
        while pending:
            src, dst, last = pending.pop()
            dst[:, last] = src

    def read(q, cache, last, h, c, scale):       # the contract, NaN in a row it reads propagating
        o = _emulate_attend(q, cache, last, h, c, scale)
        if not torch.isfinite(cache[:, :int(last.max()) + 1]).all():
            o = torch.full_like(o, float("nan"))
        return o

    def attend(q, cache, last, h, c, scale, scratch=None, reload=None):
        if km.RELOAD_NEW if reload is None else reload:
            land()
            return read(q, cache, last, h, c, scale)
        o = read(q, cache, last, h, c, scale)
        land()
        return o

    def attend_uv(q, cache, last, h, c, scale, w_uv, g, scratch):
        o_lat = attend(q, cache, last, h, c, scale)
        return _emulate_uv_gate(o_lat, w_uv, g), o_lat
    emulated_mma.setattr(km, "mla_attend_mma", attend)
    emulated_mma.setattr(km, "mla_attend_mma_uv", attend_uv)
    return emulated_mma, attend


def test_check_pre_wait_passes_a_reloading_kernel(raced_writer) -> None:
    raced_writer[0].setattr(km, "PRE_WAIT_TILES", False)
    rows = km.check_pre_wait()
    assert [(r["B"], r["k"], r["uv"]) for r in rows] == [(1, 0, False), (1, 0, True), (1, 7, False), (8, 0, False)]
    assert all(r["ok"] and r["control_nonfinite"] for r in rows), rows
    assert km.PRE_WAIT_TILES is False and km.RELOAD_NEW is True      # restored


def test_check_pre_wait_rejects_a_stale_read_and_an_unraced_control(raced_writer) -> None:
    """A kernel that never re-loads fails on its result; one that always sees the written rows
    fails on the control (the race was not shown, so nothing was proved)."""
    mp, attend = raced_writer
    mp.setattr(km, "mla_attend_mma", lambda *a, **kw: attend(*a, reload=False))
    rows = km.check_pre_wait(cases=((1, 0),))
    assert rows and not any(r["ok"] for r in rows if not r["uv"])
    mp.setattr(km, "mla_attend_mma", lambda *a, **kw: attend(*a, reload=True))
    rows = km.check_pre_wait(cases=((8, 0),))
    assert len(rows) == 1 and not rows[0]["ok"] and rows[0]["equal_to_unraced"] and not rows[0]["control_nonfinite"]


@pytest.mark.parametrize("bsz,k", [(1, 0), (1, 7), (8, 0), (8, 7)])
@pytest.mark.parametrize("sms", [132, 114])
def test_pre_wait_positions_put_the_new_rows_in_a_pre_wait_tile(bsz: int, k: int, sms: int) -> None:
    """The race check exercises the race only where this step's rows lie in a tile a split
    reads before the wait (its first): brute force over the kernel's split rule
    (split s takes valid tiles ⌊s·n/S⌋ .. ⌊(s+1)·n/S⌋ - 1), on the H200's and the H100's SMs."""
    from kimi_decode.config import k3_tp16
    cfg = k3_tp16(batch=bsz, spec_tokens=k)
    T, H = cfg.tokens_per_seq, cfg.mla_local_heads
    sc = km.make_scratch(bsz, T * H, cfg.cache_len, cfg.kv_lora_rank, "cpu", sms=sms)
    last = km.pre_wait_positions(sc.splits, T, torch.device("cpu")).tolist()
    n_valid = (max(last) + 1 + km.TILE - 1) // km.TILE
    first_tiles = {s * n_valid // sc.splits for s in range(sc.splits)
                   if (s + 1) * n_valid // sc.splits > s * n_valid // sc.splits}
    assert {p // km.TILE for p in last} <= first_tiles, (last, sc.splits)
    assert max(last) < cfg.context_len          # below check_inputs' NaN rows
