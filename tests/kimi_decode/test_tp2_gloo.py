"""TP = 2 with real torch.distributed collectives (gloo, two CPU processes) equals TP = 1.

Oracle: the tiny model at tp = 1 in this process. The tp = 2 ranks hold exact shards of the
tp = 1 weights and initial state (the Seeder generates sharded tensors chunk by chunk, so the
halves are the same numbers), so after each step every rank's output must equal the tp = 1
output up to float32 summation order (all-reduced partial sums): relative error < 1e-5,
while a missing or doubled collective changes the output by O(1).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kimi_decode.config import tiny
from kimi_decode.runner import build
from kimi_decode.stock import StockDecoder

STEPS = 2
LAYERS = (0, 1, 2, 3, 4)   # dense layer 0, KDA, MLA, a block boundary at 4


def _cfg(tp: int, rank: int):
    return tiny(layers=LAYERS, batch=2, tp=tp, rank=rank)


def _worker(rank: int, world: int, rdv: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        model, rt = build("stock", _cfg(world, rank), "cpu")
        assert type(rt.comm).__name__ == "DistComm"
        outs = []
        for s in range(STEPS):
            m, prefix, blocks = model.make_inputs(seed=70 + s)
            with torch.no_grad():
                o_m, o_prefix = model(m, prefix, blocks)
            outs.append((o_m, o_prefix, blocks))
        torch.save(outs, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_tp2_gloo_equals_tp1(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "rdv"), str(tmp_path)), nprocs=2, join=True)
    model, _ = build("stock", _cfg(1, 0), "cpu")
    expected = []
    for s in range(STEPS):
        m, prefix, blocks = model.make_inputs(seed=70 + s)
        with torch.no_grad():
            expected.append((*model(m, prefix, blocks), blocks))
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for step_got, step_exp in zip(got, expected):
            for g, e in zip(step_got, step_exp):
                err = float((g - e).norm() / e.norm())
                assert err < 1e-5, (rank, err)


def test_tp2_weights_are_shards_of_tp1():
    """The premise of the test above, checked directly on two sharded tensors."""
    full = StockDecoder(_cfg(1, 0))
    halves = [StockDecoder(_cfg(2, r)) for r in range(2)]   # weights only: no collective runs
    kda_full, kda_halves = full.layers[1].attn, [h.layers[1].attn for h in halves]
    assert torch.equal(torch.cat([h.o_proj for h in kda_halves], dim=1), kda_full.o_proj)
    assert torch.equal(torch.cat([h.rec_state for h in kda_halves], dim=1), kda_full.rec_state)
    moe_full, moe_halves = full.layers[1].mlp, [h.layers[1].mlp for h in halves]
    I = moe_halves[0].w2.shape[2]
    assert torch.equal(torch.cat([h.w2 for h in moe_halves], dim=2), moe_full.w2)
    assert torch.equal(torch.cat([h.w13[:, :I] for h in moe_halves], dim=1), moe_full.w13[:, :2 * I])
