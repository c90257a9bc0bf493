"""The fused decoder on the CPU: its own layer flow (prefix update inside AttnRes, side-stream
MoE order, the router fallback) must reproduce the stock step exactly when no kernel can run.

Oracle: the stock decoder from the same seeded weights and state, run side by side. With every
kernel off, fused issues the same float32 ops in the same order, so outputs, the AttnRes
blocks and every decode-state buffer must be bit-identical (tolerance 0): any slip in the
re-expressed flow (a missed block write, the prefix not reset at a block start, a wrong
routing weight) shows up as a difference. The kernels themselves are checked on the GPU
(kimi_decode/kernels/checks.py, bench/fused_correctness.md); here their float64 statements
are checked against the stock modules they replace.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from kimi_decode.config import tiny
from kimi_decode.fused import FusedDecoder
from kimi_decode.stock import AttnRes, StockDecoder
from kimi_decode.variants import variant_class
from kimi_decode.weights import Seeder


def run_side_by_side(cfg, steps: int) -> None:
    stock = StockDecoder(cfg)
    fused = FusedDecoder.from_stock(stock)
    assert fused.kernels == frozenset()                     # CPU: everything falls back
    for s in range(steps):
        m, prefix, blocks = stock.make_inputs(seed=40 + s)
        blocks_f = blocks.clone()
        with torch.no_grad():
            out_s = stock(m, prefix, blocks)
            out_f = fused(m, prefix, blocks_f)
        for a, b in zip(out_s, out_f):
            assert torch.equal(a, b)
        assert torch.equal(blocks, blocks_f)
    bufs_s, bufs_f = dict(stock.named_buffers()), dict(fused.named_buffers())
    assert bufs_s.keys() == bufs_f.keys()
    for name, buf in bufs_s.items():
        assert torch.equal(buf, bufs_f[name]), name


@pytest.mark.parametrize("batch,k", [(1, 0), (2, 0), (2, 7)])
def test_fused_matches_stock_exactly_on_cpu(batch: int, k: int) -> None:
    """Layers 3..8 of tiny: KDA, MLA (3, 7) and two block starts (4, 8); state over 3 steps."""
    run_side_by_side(tiny(layers=(3, 4, 5, 6, 7, 8), batch=batch, spec_tokens=k), steps=3)


def test_dense_layer_zero_and_embedding_start() -> None:
    run_side_by_side(tiny(layers=(0, 1, 2), batch=2), steps=2)


def test_from_stock_shares_weights_and_copies_state() -> None:
    stock = StockDecoder(tiny(layers=(2, 3), batch=1))
    fused = FusedDecoder.from_stock(stock)
    ps, pf = dict(stock.named_parameters()), dict(fused.named_parameters())
    assert ps.keys() == pf.keys()
    assert all(ps[n] is pf[n] for n in ps)
    for name, buf in fused.named_buffers():
        other = dict(stock.named_buffers())[name]
        assert buf.data_ptr() != other.data_ptr() and torch.equal(buf, other)
    assert [type(a.attn).__name__ for a in fused.layers] == [type(a.attn).__name__ for a in stock.layers]


def test_registered_as_variant() -> None:
    """The runner builds the fused variant from a config alone, with the stock weights."""
    from kimi_decode.runner import build
    assert variant_class("fused") is FusedDecoder
    cfg = tiny(layers=(2, 3), batch=2)
    fused, _ = build("fused", cfg, "cpu")
    stock, _ = build("stock", cfg, "cpu")
    m, prefix, blocks = stock.make_inputs(seed=9)
    with torch.no_grad():
        a, b = stock(m, prefix, blocks.clone()), fused(m, prefix, blocks.clone())
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_attn_res_kernel_formula_matches_stock() -> None:
    """kernels/attn_res.reference (what the kernel computes: <v, w>/rms(v) scores, prefix'
    rounded to its dtype) equals the stock AttnRes module after `prefix + delta`."""
    from kimi_decode.kernels.attn_res import reference
    cfg = tiny(hidden=256)
    mod = AttnRes(cfg, Seeder(cfg, torch.device("cpu")).sub("t"))
    gen = torch.Generator().manual_seed(3)
    for nb in (0, 1, 5):
        blocks = torch.randn(4, 8, 256, generator=gen)
        prefix, delta = torch.randn(4, 256, generator=gen), torch.randn(4, 256, generator=gen)
        want = mod(prefix + delta, blocks, nb).double()
        got = reference(blocks, nb, prefix, mod.w, mod.norm, cfg.rms_eps, delta)
        assert float((got - want).norm() / want.norm()) < 1e-5


def test_router_kernel_formula_against_brute_force() -> None:
    """kernels/router.reference (biased selection, unbiased renormalised weights) against a
    per-row Python sort of the same float64 scores."""
    from kimi_decode.kernels.router import reference
    gen = torch.Generator().manual_seed(5)
    y, w = torch.randn(6, 64, generator=gen), torch.randn(40, 64, generator=gen) * 0.125
    bias = torch.randn(40, generator=gen) * 0.02
    ids, weights, _ = reference(y, w, bias, 5, 2.5, logits_bf16=False)
    s = torch.sigmoid(y.double() @ w.double().t())
    for m in range(6):
        order = sorted(range(40), key=lambda e: -(float(s[m, e]) + float(bias[e])))[:5]
        assert sorted(ids[m].tolist()) == sorted(order)
        tot = sum(float(s[m, e]) for e in order)
        for j, e in enumerate(ids[m].tolist()):
            assert abs(float(weights[m, j]) - 2.5 * float(s[m, e]) / tot) < 1e-12


# --- the kernel call sites, with each kernel replaced by a torch emulation of its contract ---

def _emulate_attn_res(blocks, num_blocks, prefix, w_mix, norm_w, eps, delta=None, write_slot=None, out=None):
    """attn_res_rmsnorm's contract: (out, prefix'), blocks[:, write_slot] = prefix'."""
    from kimi_decode.kernels.attn_res import reference
    new_prefix = prefix if delta is None else prefix + delta
    if write_slot is not None:
        blocks[:, write_slot].copy_(new_prefix)
    return reference(blocks, num_blocks, prefix, w_mix, norm_w, eps, delta).to(prefix.dtype), new_prefix


def _emulate_kda(z, f_b, conv_w, conv_state, dt_bias, a_log, rec_state, o_norm, cfg):
    """kda_decode's contract: out [M, P]; conv and recurrent state advanced in place."""
    from kimi_decode import stock_ops as ops
    H, d, P = cfg.heads, cfg.head_dim, cfg.heads * cfg.head_dim
    batch = conv_state.shape[0]
    act, cs = ops.conv_update(conv_state, z[:, :3 * P], conv_w, batch)
    f_b_out = z[:, 4 * P:4 * P + d] @ f_b.t()
    o, S = ops.kda_recurrence(act, f_b_out, z[:, 4 * P + d:4 * P + d + H], dt_bias, a_log, rec_state,
                              cfg.gate_lower_bound, H)
    conv_state.copy_(cs)
    rec_state.copy_(S)
    return ops.gated_rms_norm(o, o_norm, z[:, 3 * P:4 * P], cfg.norm_eps, z.dtype)


def assert_state_close(stock, fused) -> None:
    """Every floating-point decode-state buffer of fused within float32 rounding of stock's."""
    bufs_f = dict(fused.named_buffers())
    for name, buf in stock.named_buffers():
        if buf.is_floating_point():
            assert float((buf - bufs_f[name]).norm() / buf.norm().clamp_min(1e-30)) < 1e-5, name


def record_ops(monkeypatch) -> list[str]:
    """The op names the fused step opens (fused.op_range), in issue order, into the returned
    list: the tests of what the MoE issues first."""
    import kimi_decode.fused as fused_mod
    order: list[str] = []
    real_op_range = fused_mod.op_range

    def recording(op: str):
        order.append(op)
        return real_op_range(op)
    monkeypatch.setattr(fused_mod, "op_range", recording)
    return order


def run_close(stock, fused, seed: int, steps: int) -> None:
    """`steps` steps side by side from the same inputs: outputs, AttnRes blocks and then the
    decode state agree within float32 rounding (the kernels are float64 torch emulations)."""
    for s in range(steps):
        m, prefix, blocks = stock.make_inputs(seed=seed + s)
        blocks_f = blocks.clone()
        with torch.no_grad():
            out_s, out_f = stock(m, prefix, blocks), fused(m, prefix, blocks_f)
        for a, b in zip(out_s, out_f):
            assert float((a - b).norm() / a.norm()) < 1e-5
        assert float((blocks - blocks_f).norm() / blocks.norm()) < 1e-5
    assert_state_close(stock, fused)


def _emulate_route(y, w_gate, bias, top_k, scaling, counter, logits=None, logits_bf16=False):
    """route's contract: fp32 logits computed in-kernel (small M) or the caller's."""
    from kimi_decode.kernels.router import reference
    if logits is None:
        ids, w, _ = reference(y, w_gate, bias, top_k, scaling, logits_bf16=logits_bf16)
        return ids, w.to(torch.float32)
    s = torch.sigmoid(logits.double())
    ids = (s + bias.double()).topk(top_k, dim=-1).indices
    w = s.gather(1, ids)
    return ids, (w / w.sum(-1, keepdim=True) * scaling).float()


@pytest.mark.parametrize("kda_kernel", [True, False])
def test_kernel_call_sites_on_cpu(monkeypatch, kda_kernel: bool) -> None:
    """Every kernel path of fused.py switched on, each kernel emulated in torch: the step must
    still match stock (float64 emulations, so up to float32 rounding, 1e-5), state included.
    This checks the wiring the GPU run relies on (argument order, prefix reset vs add, block
    writes, the side-stream MoE order, prefetch targets), not the kernels."""
    pytest.importorskip("cutlass")
    import kimi_decode.fused as fused_mod
    monkeypatch.setitem(fused_mod.MAX_ROWS, "router_kernel", 64)   # the wiring at every M, not the per-M table
    import kimi_decode.kernels.attn_res as k_ar
    import kimi_decode.kernels.gemv as k_gemv
    import kimi_decode.kernels.kda_decode as k_kda
    import kimi_decode.kernels.l2_prefetch as k_pf
    import kimi_decode.kernels.router as k_router
    gemv_calls = []
    monkeypatch.setattr(k_gemv, "can_implement", lambda *a: True)
    monkeypatch.setattr(k_gemv, "gemv", lambda x, w: gemv_calls.append(w.shape) or x @ w.t())
    monkeypatch.setattr(k_ar, "attn_res_rmsnorm", _emulate_attn_res)
    monkeypatch.setattr(k_kda, "kda_decode", _emulate_kda)
    monkeypatch.setattr(k_router, "route", _emulate_route)
    prefetched = []
    monkeypatch.setattr(k_pf, "prefetch_l2", lambda t, n=None: prefetched.append(t))
    import kimi_decode.kernels.mla_glue as k_glue
    from kimi_decode import stock_ops
    glue_calls = []
    monkeypatch.setattr(k_glue, "can_implement_uk", lambda *a: True)
    monkeypatch.setattr(k_glue, "can_implement_uv", lambda *a: True)
    monkeypatch.setattr(k_glue, "uk_insert", lambda q, a, ckv, w, cache, pos, T, off: glue_calls.append("uk") or
                        k_glue.stock_uk(q, a, ckv, w, cache, pos, T, off, stock_ops.OpSet(cfg)))
    monkeypatch.setattr(k_glue, "uv_gate", lambda o_lat, w_uv, g: glue_calls.append("uv") or
                        k_glue.stock_uv(o_lat, w_uv, g, stock_ops.sigmoid_gate))
    cfg = tiny(layers=(3, 4, 5, 6, 7, 8), batch=2, spec_tokens=7)
    stock = StockDecoder(cfg)
    fused = FusedDecoder.from_stock(stock)
    for i, layer in enumerate(fused.layers):
        layer.attn_res.use_kernel = layer.mlp_res.use_kernel = True
        if hasattr(layer.attn, "use_kernel"):
            layer.attn.use_kernel = kda_kernel
        layer.attn.use_gemv = layer.mlp.use_gemv = True
        if hasattr(layer.attn, "use_glue"):
            layer.attn.use_glue = True
        layer.mlp.use_router_kernel = True
        layer.mlp.router_counter = torch.zeros(1, dtype=torch.int32)
        nxt = fused.layers[i + 1].attn if i + 1 < len(fused.layers) else None
        target = None if nxt is None else getattr(nxt, "in_proj", getattr(nxt, "qkv_a", None))
        layer.mlp.prefetch_target = None if target is None else target.detach()
    run_close(stock, fused, seed=60, steps=2)
    assert len(prefetched) == 2 * 5          # every MoE layer but the last, each step
    assert glue_calls == ["uk", "uv"] * (2 * 2)   # 2 MLA layers, 2 steps
    # per step: KDA in_proj + o_proj (x4 layers), MLA g, qkv_a, q_b, o (x2), MoE 3 each (x6)
    assert len(gemv_calls) == 2 * (4 * 2 + 2 * 4 + 6 * 3)
    assert prefetched[0].data_ptr() == fused.layers[1].attn.in_proj.data_ptr()   # layer 4: KDA


def test_restate_shares_runtime_and_weights() -> None:
    """The runtime holds CUDA streams (not copyable) and must stay the model's own."""
    from kimi_decode.fused import KDAAttention, _restate
    stock = StockDecoder(tiny(layers=(1,), batch=1))
    attn = stock.layers[0].attn
    new = _restate(attn, KDAAttention)
    assert new.rt is attn.rt and new.in_proj is attn.in_proj
    assert new.rec_state.data_ptr() != attn.rec_state.data_ptr() and type(new) is KDAAttention


def experts_contract(z, idx, w, w13, w2, beta, lin_beta, out=None):
    """The routed-experts kernels' contract in torch: stock's grouped experts, written into
    `out` where given (the fakes of the wiring tests record their arguments, then call this)."""
    from kimi_decode import stock_ops as ops
    r = ops.experts_grouped(z, idx, w, w13, w2, beta, lin_beta)
    return r if out is None else out.copy_(r)


def emulate_moe_kernels(monkeypatch) -> None:
    """The routed-experts and moe_up kernels replaced by torch statements of their contracts
    (experts: stock's grouped experts written into `out`; moe_up: sum the all-reduce slots,
    the other ranks' reduce-scatter slots plus this rank's own shared slice, latent_up), at
    every shape."""
    import kimi_decode.kernels.moe_experts as k_ex
    import kimi_decode.kernels.moe_up as k_up
    from kimi_decode import stock_ops as ops

    def experts(z, idx, w, w13, w2, beta, lin_beta, out=None, **kw):
        return experts_contract(z, idx, w, w13, w2, beta, lin_beta, out)

    def moe_up(r_slots, sh_slots, sh_full, rank, latent_norm, up_rows, eps, out=None):
        n = up_rows.shape[0]
        shared = sh_slots.sum(0) - sh_slots[rank] + sh_full[:, rank * n:(rank + 1) * n]
        part = ops.latent_up(r_slots.sum(0), latent_norm, up_rows, shared, eps)
        return part if out is None else out.copy_(part)
    monkeypatch.setattr(k_ex, "experts", experts)
    monkeypatch.setattr(k_ex, "can_implement", lambda *a, **k: True)
    monkeypatch.setattr(k_up, "moe_up", moe_up)
    monkeypatch.setattr(k_up, "can_implement", lambda *a: True)


def run_with_filled_slots(stock, fused, rt, seed: int) -> None:
    """Three steps side by side; before the third the other ranks' slots of every collective
    buffer get data (both paths read the same buffers, so they contribute identically). The
    fused output is a tensor of stock's shape (a Gathered last layer is concatenated), and
    outputs and blocks agree within float32 rounding."""
    for s in range(3):
        if s == 2:
            gen = torch.Generator().manual_seed(5)
            for buf in rt.comm.bufs.values():
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)
        m, prefix, blocks = stock.make_inputs(seed=seed + s)
        blocks_f = blocks.clone()
        with torch.no_grad():
            out_s = stock(m, prefix, blocks)
            out_f = fused(m, prefix, blocks_f)
        assert isinstance(out_f[0], torch.Tensor) and out_f[0].shape == out_s[0].shape
        for a, b in zip(out_s, out_f):
            assert float((a - b).norm() / a.norm()) < 1e-5
        assert float((blocks - blocks_f).norm() / blocks.norm()) < 1e-5


def _emulate_attn_res_ar(blocks, num_blocks, prefix, w_mix, norm_w, eps, delta=None, write_slot=None,
                         out=None, *, delta_slots=None, reset=False):
    """attn_res_rmsnorm's contract with the all-reduce slots (kernel attn_res_ar)."""
    from kimi_decode.kernels.attn_res import prefix_reference
    if delta_slots is None:
        return _emulate_attn_res(blocks, num_blocks, prefix, w_mix, norm_w, eps, delta, write_slot, out)
    new_prefix = prefix_reference(prefix, delta_slots, reset)
    if write_slot is not None:
        blocks[:, write_slot].copy_(new_prefix)
    return _emulate_attn_res(blocks, num_blocks, new_prefix, w_mix, norm_w, eps)[0], new_prefix


@pytest.mark.parametrize("moe_kernels", [True, False])
def test_collectives_finished_in_kernels_on_cpu(monkeypatch, moe_kernels: bool) -> None:
    """tp_sim with the slot path on (o_proj writes its all-reduce slot, the AttnRes kernel sums
    the slots; experts write theirs and moe_up finishes both MoE collectives): the step equals
    stock's, whose SimComm runs copy + sum kernels, when the other ranks' slots are zero AND
    when they hold data (both paths read the same persistent buffers, so the "other ranks"
    contribute identically). Each kernel is a torch emulation of its contract: this checks the
    wiring (which slot, which buffer, reset vs add, the shared slice), not the kernels."""
    pytest.importorskip("cutlass")
    import kimi_decode.fused as fused_mod
    monkeypatch.setitem(fused_mod.MAX_ROWS, "moe_up", 64)   # the wiring at every M, not the per-M table
    import kimi_decode.kernels.attn_res as k_ar
    from kimi_decode.runner import build
    monkeypatch.setattr(k_ar, "attn_res_rmsnorm", _emulate_attn_res_ar)
    if moe_kernels:
        emulate_moe_kernels(monkeypatch)
    cfg = tiny(layers=(3, 4, 5, 6, 7, 8), batch=2, spec_tokens=7, tp=2, weight_chunks=2, tp_sim=True, sim_world=2)
    stock, rt = build("stock", cfg, "cpu")
    fused = FusedDecoder.from_stock(stock)
    assert fused.rt is stock.rt                             # the same slot buffers
    for layer in fused.layers:
        layer.attn_res.use_kernel = layer.mlp_res.use_kernel = True
        layer.attn_res.use_slots = layer.mlp_res.use_slots = True
        layer.attn.ar_slots = True
        if hasattr(layer.mlp, "use_up_kernel"):
            layer.mlp.use_up_kernel = layer.mlp.use_experts_kernel = moe_kernels
    run_with_filled_slots(stock, fused, rt, seed=70)
    ar_shapes = {k[1] for k in rt.comm.bufs if k[0] == "ar"}
    assert (cfg.sim_world, cfg.rows, cfg.hidden) in ar_shapes             # o_proj's slots were used


def _emulate_attn_res_ag(calls, blocks, num_blocks, prefix, w_mix, norm_w, eps, delta=None, write_slot=None,
                         out=None, *, delta_slots=None, reset=False, delta_gather=None):
    """attn_res_rmsnorm's contract with the all-gather slots (kernel attn_res_ag) and the rest."""
    from kimi_decode.kernels.attn_res import gather_cols
    if delta_gather is None:
        return _emulate_attn_res_ar(blocks, num_blocks, prefix, w_mix, norm_w, eps, delta, write_slot, out,
                                    delta_slots=delta_slots, reset=reset)
    assert delta is None and delta_slots is None and not reset
    calls.append(tuple(delta_gather.shape))
    new_prefix = prefix + gather_cols(delta_gather)
    if write_slot is not None:
        blocks[:, write_slot].copy_(new_prefix)
    return _emulate_attn_res(blocks, num_blocks, new_prefix, w_mix, norm_w, eps)[0], new_prefix


@pytest.mark.parametrize("ag_kernel", [True, False])
def test_all_gather_finished_in_attn_res_on_cpu(monkeypatch, ag_kernel: bool) -> None:
    """tp_sim with moe_up writing its all-gather slot and the next layer's AttnRes reading the
    slots in place (Gathered; kernel attn_res_ag), or the fallback concatenation when that
    kernel is off: the step equals stock's, other ranks' slots zero and holding data; the last
    layer's output is concatenated by forward. Kernels are torch emulations of their contracts."""
    pytest.importorskip("cutlass")
    import kimi_decode.fused as fused_mod
    monkeypatch.setitem(fused_mod.MAX_ROWS, "moe_up", 64)   # the wiring at every M, not the per-M table
    import kimi_decode.kernels.attn_res as k_ar
    from kimi_decode.runner import build
    calls: list[tuple] = []
    monkeypatch.setattr(k_ar, "attn_res_rmsnorm", lambda *a, **k: _emulate_attn_res_ag(calls, *a, **k))

    emulate_moe_kernels(monkeypatch)
    cfg = tiny(layers=(3, 4, 5, 6, 7, 8), batch=2, spec_tokens=7, tp=2, weight_chunks=2, tp_sim=True, sim_world=2)
    stock, rt = build("stock", cfg, "cpu")
    fused = FusedDecoder.from_stock(stock)
    for i, layer in enumerate(fused.layers):
        layer.attn_res.use_kernel = layer.mlp_res.use_kernel = True
        layer.attn_res.use_gather = layer.mlp_res.use_gather = ag_kernel
        layer.mlp.use_up_kernel = layer.mlp.use_experts_kernel = True
        layer.mlp.gather_out = True        # the last layer too: forward must concatenate it
    run_with_filled_slots(stock, fused, rt, seed=80)
    # layers 4..8 read layer 3..7's all-gather slots, each step
    n = cfg.hidden // cfg.sim_world
    assert calls == ([(cfg.sim_world, cfg.rows, n)] * 5 * 3 if ag_kernel else [])


def test_the_last_layers_gather_is_the_steps_on_cpu(monkeypatch) -> None:
    """enable() lets every layer hand its all-gather slots on, the last one too (gather_out),
    and the step concatenates the last layer's slots in its own range, outside every layer
    range: the slice's last layer (L7.mla in the bench) must not count a gather kernel that
    K3's MLA layers followed by a KDA layer do not run. Oracle: the ranges actually open
    when the concatenation runs (a recorder in place of the profiler ranges), and the output
    equal to stock's."""
    pytest.importorskip("cutlass")
    import kimi_decode.fused as fused_mod
    import kimi_decode.kernels as kernels
    import kimi_decode.kernels.attn_res as k_ar
    import kimi_decode.ranges as ranges
    from kimi_decode.runner import build
    monkeypatch.setitem(fused_mod.MAX_ROWS, "moe_up", 64)
    monkeypatch.setattr(fused_mod, "_kernels_usable", lambda dev: True)
    monkeypatch.setattr(kernels, "applicable", lambda name, cfg: True)
    monkeypatch.setattr(k_ar, "can_implement", lambda *a, **kw: True)
    cfg = tiny(layers=(3, 4, 5, 6, 7), batch=1, tp=2, weight_chunks=2, tp_sim=True, sim_world=2)
    stock, rt = build("stock", cfg, "cpu")
    fused = FusedDecoder.from_stock(stock)
    on = fused.enable(frozenset({"attn_res", "attn_res_ag", "moe_up"}) & fused_mod.VERIFIED)
    assert {"attn_res", "attn_res_ag", "moe_up"} <= on
    assert [layer.mlp.gather_out for layer in fused.layers] == [True] * len(fused.layers)
    # without the all-gather slots nothing is handed on
    fused.enable(frozenset({"attn_res", "moe_up"}))
    assert not any(layer.mlp.gather_out for layer in fused.layers)

    calls: list[tuple] = []
    monkeypatch.setattr(k_ar, "attn_res_rmsnorm", lambda *a, **k: _emulate_attn_res_ag(calls, *a, **k))
    emulate_moe_kernels(monkeypatch)
    for layer in fused.layers:
        layer.attn_res.use_kernel = layer.mlp_res.use_kernel = True
        layer.attn_res.use_gather = layer.mlp_res.use_gather = True
        layer.mlp.use_up_kernel = layer.mlp.use_experts_kernel = True
        layer.mlp.gather_out = True
    stack: list[str] = []
    gathers: list[list[str]] = []
    real_gather = fused_mod.Gathered.gather

    @contextlib.contextmanager
    def recorder(name: str):
        stack.append(name)
        try:
            yield
        finally:
            stack.pop()

    def gather(self):
        gathers.append(list(stack))
        return real_gather(self)
    monkeypatch.setattr(ranges, "annotate", recorder)
    monkeypatch.setattr(fused_mod.Gathered, "gather", gather)
    run_with_filled_slots(stock, fused, rt, seed=70)
    assert gathers == [["step", "moe_gather"]] * 3     # one per step, under no layer range


@pytest.mark.parametrize("batch,k,mc,limit,wide", [(1, 0, True, None, None), (2, 0, True, None, None),
                                                   (3, 2, True, None, None), (64, 0, True, None, None),
                                                   (64, 0, True, 64, 0), (9, 7, True, None, None),
                                                   (9, 7, True, 64, 0), (64, 0, True, None, 2),
                                                   (64, 0, True, None, 1),
                                                   (1, 0, False, None, None), (64, 0, False, None, None)])
def test_attn_res_cluster_kernel_by_rows_and_blocks_on_cpu(monkeypatch, batch: int, k: int, mc: bool,
                                                           limit: int | None, wide: int | None) -> None:
    """AttnRes._kernel: with `use_mc` (kernel "attn_res_mc") an AttnRes call of M rows mixing
    nb blocks goes to the cluster kernel (kernels/attn_res_mc.py) in all its modes (plain,
    block start, all-reduce slots, all-gather slots) when M ≤ MAX_ROWS["attn_res_mc"] (8), or
    M ≤ ATTN_RES_MC_WIDE_ROWS (64) with nb ≤ ATTN_RES_MC_WIDE_MAX_NB (4); every other call,
    and every call with the kernel off, goes to the one-CTA kernel. Layers 3..8 of tiny
    (blocks of 4) mix nb = 1, 2 and 3 blocks, so at M = 64 some calls take each kernel; M = 72
    (B 9, k 7) is above both limits; `limit` / `wide` set the table (64 rows for every nb;
    the wide rule up to nb = 1 or 2, splitting the step, or off). The step equals stock's within float32 rounding, other
    ranks' slots zero and holding data. Both kernels are the same torch emulation of their
    shared contract: this checks the dispatch and the arguments passed."""
    pytest.importorskip("cutlass")
    import kimi_decode.fused as fused_mod
    import kimi_decode.kernels.attn_res as k_ar
    import kimi_decode.kernels.attn_res_mc as k_mc
    from kimi_decode.runner import build
    monkeypatch.setitem(fused_mod.MAX_ROWS, "moe_up", 128)   # the wiring at every M, not the per-M table
    # the measured defaults (the note above MAX_ROWS in fused.py)
    assert (fused_mod.MAX_ROWS["attn_res_mc"], fused_mod.ATTN_RES_MC_WIDE_ROWS,
            fused_mod.ATTN_RES_MC_WIDE_MAX_NB) == (8, 64, 4)
    if limit is not None:
        monkeypatch.setitem(fused_mod.MAX_ROWS, "attn_res_mc", limit)
    if wide is not None:
        monkeypatch.setattr(fused_mod, "ATTN_RES_MC_WIDE_MAX_NB", wide)
    limit = fused_mod.MAX_ROWS["attn_res_mc"]
    max_nb = fused_mod.ATTN_RES_MC_WIDE_MAX_NB
    calls: list[tuple[str, int]] = []
    modes: set[str] = set()

    def emulated(kind: str):
        def run(blocks, nb, *a, **kw):
            calls.append((kind, nb))
            modes.add("ar" if kw.get("delta_slots") is not None else "ag" if kw.get("delta_gather") is not None
                      else "plain" if kw.get("delta") is not None else "prefix")
            return _emulate_attn_res_ag([], blocks, nb, *a, **kw)
        return run
    monkeypatch.setattr(k_ar, "attn_res_rmsnorm", emulated("one"))
    monkeypatch.setattr(k_mc, "attn_res_mc", emulated("mc"))
    monkeypatch.setattr(k_mc, "can_implement", lambda *a, **kw: True)   # tiny's width; K3's is tested in its file
    emulate_moe_kernels(monkeypatch)
    cfg = tiny(layers=(3, 4, 5, 6, 7, 8), batch=batch, spec_tokens=k, tp=2, weight_chunks=2, tp_sim=True,
               sim_world=2)
    stock, rt = build("stock", cfg, "cpu")
    fused = FusedDecoder.from_stock(stock)
    for layer in fused.layers:
        for res in (layer.attn_res, layer.mlp_res):
            res.use_kernel = res.use_slots = res.use_gather = True
            res.use_mc = mc
        layer.attn.ar_slots = True
        layer.mlp.use_up_kernel = layer.mlp.use_experts_kernel = True
        layer.mlp.gather_out = True
    run_with_filled_slots(stock, fused, rt, seed=90)
    # layer idx mixes ceil(idx / 4) blocks before its attention, one more after it at a block start
    want_nb = [nb for layer in fused.layers for nb in (layer.nb_attn, layer.nb_mlp)] * 3
    assert [nb for _, nb in calls] == want_nb and sorted(set(want_nb)) == [1, 2, 3]
    rows = cfg.rows
    want = ["mc" if mc and (rows <= limit or (rows <= 64 and nb <= max_nb)) else "one" for nb in want_nb]
    assert [kind for kind, _ in calls] == want
    if mc and rows == 64:                     # the wide rule splits the step between the kernels
        assert set(want) == ({"mc"} if limit == 64 or max_nb >= 3 else {"mc", "one"})
    assert {"ar", "ag"} <= modes


def test_enable_switches_the_cluster_kernel(monkeypatch) -> None:
    """enable(): use_mc on every AttnRes exactly when "attn_res" and "attn_res_mc" are both on
    (the cluster kernel is a variant of the AttnRes kernel, never used without it)."""
    import kimi_decode.fused as fused_mod
    import kimi_decode.kernels as kernels
    monkeypatch.setattr(fused_mod, "_kernels_usable", lambda dev: True)
    monkeypatch.setattr(fused_mod, "VERIFIED", fused_mod.VERIFIED | {"attn_res_mc"})
    monkeypatch.setattr(kernels, "applicable", lambda name, cfg: True)
    fused = FusedDecoder.from_stock(StockDecoder(tiny(layers=(3, 4), batch=1)))
    res = [r for layer in fused.layers for r in (layer.attn_res, layer.mlp_res)]
    for kernels_on, want in (({"attn_res", "attn_res_mc"}, True), ({"attn_res"}, False),
                             ({"attn_res_mc"}, False)):
        on = fused.enable(frozenset(kernels_on))
        assert on == frozenset(kernels_on)
        assert all(r.use_mc == want and r.use_kernel == ("attn_res" in on) for r in res)


@pytest.mark.parametrize("tp_sim,front_shared", [(False, True), (True, True), (False, False), (True, False)])
def test_gemv_multi_call_sites_on_cpu(monkeypatch, tp_sim: bool, front_shared: bool) -> None:
    """The one-launch fronts (kernels/gemv_multi.py) wired in, each emulated by its contract
    (route_and_project = the router's (ids, weights) + y @ wᵀ per projection; gemv_multi = x @ wᵀ
    per weight): the step equals stock within float32 rounding, state and blocks included, with
    the stock SimComm collectives or the slot path; every MoE layer issues exactly one front
    (no separate router / latent_down launch) with the router, latent down and shared gate/up
    weights in that order (without the shared gate/up where fused.FRONT_SHARED is off: the
    shared expert then runs after the front, and the step still equals stock), and every MLA
    layer one qkv_a + g_proj launch."""
    pytest.importorskip("cutlass")
    import kimi_decode.fused as fused_mod
    import kimi_decode.kernels.gemv_multi as k_multi
    import kimi_decode.kernels.attn_res as k_ar
    from kimi_decode.runner import build
    monkeypatch.setitem(fused_mod.MAX_ROWS, "gemv_multi", 64)   # the wiring at every M
    monkeypatch.setattr(fused_mod, "FRONT_SHARED", front_shared)
    fronts, multis, routes = [], [], []

    def route_and_project(y, w_gate, bias, top_k, scaling, counter, ws):
        fronts.append((w_gate.data_ptr(), *(w.data_ptr() for w in ws)))
        ids, w = _emulate_route(y, w_gate, bias, top_k, scaling, counter)
        return ids, w, [y @ w_.t() for w_ in ws]

    def gemv_multi(x, ws):
        multis.append(tuple(w.data_ptr() for w in ws))
        return [x @ w.t() for w in ws]
    monkeypatch.setattr(k_multi, "route_and_project", route_and_project)
    monkeypatch.setattr(k_multi, "gemv_multi", gemv_multi)
    monkeypatch.setattr(k_multi, "can_implement", lambda *a, **k: True)
    monkeypatch.setattr(fused_mod.LatentMoE, "_route", lambda self, y: routes.append(1))
    if tp_sim:
        monkeypatch.setattr(k_ar, "attn_res_rmsnorm", _emulate_attn_res_ar)
        emulate_moe_kernels(monkeypatch)
        monkeypatch.setitem(fused_mod.MAX_ROWS, "moe_up", 64)
        cfg = tiny(layers=(3, 4, 5, 6, 7, 8), batch=2, spec_tokens=7, tp=2, weight_chunks=2, tp_sim=True,
                   sim_world=2)
    else:
        cfg = tiny(layers=(3, 4, 5, 6, 7, 8), batch=2, spec_tokens=7)
    stock, rt = build("stock", cfg, "cpu")
    fused = FusedDecoder.from_stock(stock)
    for layer in fused.layers:
        if tp_sim:
            layer.attn_res.use_kernel = layer.mlp_res.use_kernel = True
            layer.attn_res.use_slots = layer.mlp_res.use_slots = True
            layer.attn.ar_slots = True
            layer.mlp.use_experts_kernel = layer.mlp.use_up_kernel = True
        layer.mlp.use_front = True
        layer.mlp.router_counter = torch.zeros(1, dtype=torch.int32)
        if hasattr(layer.attn, "use_multi"):
            layer.attn.use_multi = True
    if tp_sim:
        run_with_filled_slots(stock, fused, rt, seed=70)
        assert_state_close(stock, fused)
    else:
        run_close(stock, fused, seed=70, steps=2)
    steps = 3 if tp_sim else 2
    moe = [layer.mlp for layer in fused.layers]
    assert routes == []                                            # no separate router launch
    assert fronts == [(l.router.data_ptr(), l.down.data_ptr()) + ((l.shared_gate_up.data_ptr(),) if front_shared else ())
                      for l in moe] * steps
    mla = [layer.attn for layer in fused.layers if hasattr(layer.attn, "use_multi")]
    assert len(mla) == 2
    assert multis == [(a.qkv_a.data_ptr(), a.g_proj.data_ptr()) for a in mla] * steps


def test_mla_positions_hoisted_once_per_step() -> None:
    """The MLA query positions pos + t_off live in one tensor shared by every MLA layer and
    are refreshed right after pos advances, so between steps (where the per-layer bench graphs
    and the next step read them) they always equal pos + t_off, also across the cache wrap."""
    cfg = tiny(layers=(3, 4, 5, 6, 7, 8), batch=2, spec_tokens=7)
    stock = StockDecoder(cfg)
    fused = FusedDecoder.from_stock(stock)
    mla = [layer.attn for layer in fused.layers if layer.kind == "mla"]
    assert len(mla) == 2 and all(a.last_buf is fused.mla_last for a in mla)
    steps = (cfg.cache_len - cfg.context_len) // cfg.tokens_per_seq + 2     # past one wrap
    for s in range(steps):
        m, prefix, blocks = stock.make_inputs(seed=90 + s)
        with torch.no_grad():
            fused(m, prefix, blocks)
        assert torch.equal(fused.mla_last, fused.pos + mla[0].t_off), s


@pytest.mark.parametrize("enabled,v2_fits,expected", [
    ({"experts_v2"}, True, True),               # the new FC2
    ({"experts"}, True, False),                 # the verified kernels
    ({"experts", "experts_v2"}, True, True),    # both verified: v2 wins
    ({"experts", "experts_v2"}, False, False),  # v2's shape rules refuse: the old kernels
    ({"experts_v2"}, False, None),              # ... and without `experts`: the stock op
    ({"experts_v2", "experts_v2_async"}, True, True),   # v2 with cp.async staging
    ({"experts_v2", "experts_rows"}, True, True),       # v2 with FC2 as the resident grid
    ({"experts", "experts_rows"}, False, False),        # no v2: no rows either
    ({"experts_v2", "experts_v2_async", "experts_rows"}, True, True),   # rows wins over async
])
def test_experts_v2_wiring_on_cpu(monkeypatch, enabled: set, v2_fits: bool, expected: bool | None) -> None:
    """enable() switches LatentMoE._experts to FC2 v2 (kernels/moe_experts.py, `v2=True`) when
    kernel `experts_v2` is enabled and can_implement_v2 holds, to the verified kernels
    (`v2=False`) when only `experts` is, to the stock op otherwise. The kernels are the torch
    statement of their contract (stock's grouped experts), so the step still matches stock;
    every MoE layer of every step makes one call, with the expected `v2`. With
    `experts_rows` the v2 calls ask for FC2 as the resident grid (rows = STEP_BUFFERS, never
    with the cp.async staging). VERIFIED and the device test are patched: the lead adds a
    kernel to VERIFIED after its device check."""
    pytest.importorskip("cutlass")
    import kimi_decode.fused as fused_mod
    import kimi_decode.kernels as kernels_pkg
    import kimi_decode.kernels.moe_experts as k_ex
    import kimi_decode.kernels.moe_fc2_rows as k_rows
    calls: list[bool] = []
    staged: list[bool] = []
    rows_asked: list[int] = []

    def experts(z, idx, w, w13, w2, beta, lin_beta, out=None, *, inter=None, pdl=False, v2=False,
                stage_async=False, rows=0, ids_ready=None):
        calls.append(v2)
        staged.append(stage_async)
        rows_asked.append(rows)
        return experts_contract(z, idx, w, w13, w2, beta, lin_beta, out)
    monkeypatch.setattr(k_ex, "experts", experts)
    monkeypatch.setattr(k_ex, "can_implement", lambda *a, **k: True)
    monkeypatch.setattr(k_ex, "can_implement_v2", lambda *a, **k: v2_fits)
    monkeypatch.setattr(k_rows, "can_implement", lambda *a, **k: True)
    monkeypatch.setattr(fused_mod, "VERIFIED", fused_mod.VERIFIED | {"experts_v2", "experts_v2_async",
                                                                     "experts_rows"})
    monkeypatch.setattr(fused_mod, "_kernels_usable", lambda dev: True)
    monkeypatch.setattr(kernels_pkg, "applicable", lambda name, cfg: True)
    cfg = tiny(layers=(3, 4, 5, 6, 7, 8), batch=2, spec_tokens=7)
    stock = StockDecoder(cfg)
    fused = FusedDecoder.from_stock(stock)
    assert fused.enable(frozenset(enabled)) == frozenset(enabled)
    run_close(stock, fused, seed=90, steps=2)
    moe_layers = sum(isinstance(layer.mlp, fused_mod.LatentMoE) for layer in fused.layers)
    assert moe_layers == 6
    assert calls == ([] if expected is None else [expected] * (2 * moe_layers))
    # cp.async staging only with v2 and its own kernel name (experts_v2_async)
    rows = bool(expected) and "experts_rows" in enabled
    assert staged == [bool(expected) and "experts_v2_async" in enabled and not rows] * len(calls)
    assert rows_asked == [k_rows.STEP_BUFFERS if rows else 0] * len(calls)


def _emulate_fold_kernels(monkeypatch, cfg, calls: list) -> None:
    """gemv, gemv_rmsnorm, uk_insert(_norm), uv_gate replaced by their contracts in torch
    (the norms as stock's F.rms_norm), shape checks off (tiny sizes)."""
    import torch.nn.functional as F

    import kimi_decode.kernels.gemv as k_gemv
    import kimi_decode.kernels.mla_glue as k_glue
    from kimi_decode import stock_ops

    import kimi_decode.kernels.gemv_mma as k_mma

    def gemv_rmsnorm(a, w_norm, w, k, eps, out=None):
        calls.append("gemv_rmsnorm")
        return F.rms_norm(a[:, :k], (k,), w_norm, eps) @ w.t()

    def gemv_mma_rmsnorm(a, w_norm, w, k, eps):
        calls.append("gemv_mma_rmsnorm")
        return F.rms_norm(a[:, :k], (k,), w_norm, eps) @ w.t()
    monkeypatch.setattr(k_mma, "gemv_mma_rmsnorm", gemv_mma_rmsnorm)
    monkeypatch.setattr(k_mma, "can_implement_norm", lambda *a, **k: True)

    def uk_insert_norm(q, a, kv_norm, eps, w_uk_t, cache, pos, T, rope_off, ckv_off):
        calls.append("uk_insert_norm")
        c = w_uk_t.shape[2]
        ckv = F.rms_norm(a[:, ckv_off:ckv_off + c], (c,), kv_norm, eps)
        return k_glue.stock_uk(q, a, ckv, w_uk_t, cache, pos, T, rope_off, stock_ops.OpSet(cfg))

    def uk_insert(q, a, ckv, w, cache, pos, T, off):
        calls.append("uk_insert")
        return k_glue.stock_uk(q, a, ckv, w, cache, pos, T, off, stock_ops.OpSet(cfg))

    monkeypatch.setattr(k_gemv, "can_implement", lambda *a, **k: True)
    monkeypatch.setattr(k_gemv, "can_implement_norm", lambda *a, **k: True)
    monkeypatch.setattr(k_gemv, "gemv", lambda x, w, out=None: x @ w.t())
    monkeypatch.setattr(k_gemv, "gemv_rmsnorm", gemv_rmsnorm)
    for name in ("can_implement_uk", "can_implement_uv", "can_implement_uk_norm"):
        monkeypatch.setattr(k_glue, name, lambda *a, **k: True)
    monkeypatch.setattr(k_glue, "uk_insert", uk_insert)
    monkeypatch.setattr(k_glue, "uk_insert_norm", uk_insert_norm)
    monkeypatch.setattr(k_glue, "uv_gate", lambda o_lat, w_uv, g: k_glue.stock_uv(o_lat, w_uv, g, stock_ops.sigmoid_gate))


@pytest.mark.parametrize("batch,fold,fold_mma", [(1, True, False), (1, False, False), (2, True, False),
                                                 (2, False, True), (2, True, True), (1, False, True)])
def test_mla_norm_fold_call_sites_on_cpu(monkeypatch, batch: int, fold: bool, fold_mma: bool) -> None:
    """mla_norm_fold wired in (kernels emulated by their contracts): at M = 1 every MLA layer
    issues no `qkv_norm` op (q_b_proj runs gemv_rmsnorm, uk_insert the norming variant) and
    the step, its outputs, blocks and state (the latent cache included) equal stock within
    float32 rounding; with the kernel off, or at M = 2 (past the per-M table), the old sequence
    with qkv_norm, same results. mla_norm_fold_mma does the same at M = 2 with
    gemv_mma_rmsnorm, and nothing at M = 1 (below its table: gemv_rmsnorm's, or qkv_norm)."""
    pytest.importorskip("cutlass")
    import kimi_decode.fused as fused_mod
    cfg = tiny(layers=(3, 4, 5, 6, 7, 8), batch=batch, spec_tokens=0)
    calls, ops = [], []
    _emulate_fold_kernels(monkeypatch, cfg, calls)
    real = fused_mod.op_range

    def recording(op: str):
        ops.append(op)
        return real(op)
    monkeypatch.setattr(fused_mod, "op_range", recording)
    stock = StockDecoder(cfg)
    fused = FusedDecoder.from_stock(stock)
    mla = [layer.attn for layer in fused.layers if layer.kind == "mla"]
    assert len(mla) == 2
    for attn in mla:
        attn.use_gemv = attn.use_glue = True
        attn.use_fold = fold
        attn.use_fold_mma = fold_mma
    run_close(stock, fused, seed=80, steps=2)
    folded = (fold and batch == 1) or (fold_mma and batch >= 2)
    mla_ops = [op for op in ops if op in ("qkv_a", "qkv_norm", "q_b_proj", "uk_insert", "mla_decode")]
    per_layer = (["qkv_a", "q_b_proj", "uk_insert", "mla_decode"] if folded
                 else ["qkv_a", "qkv_norm", "q_b_proj", "uk_insert", "mla_decode"])
    assert mla_ops == per_layer * (2 * 2)                      # 2 MLA layers, 2 steps
    proj = "gemv_rmsnorm" if batch == 1 else "gemv_mma_rmsnorm"
    assert calls == ([proj, "uk_insert_norm"] if folded else ["uk_insert"]) * (2 * 2)


def test_mla_norm_fold_enabled_only_with_its_kernels(monkeypatch) -> None:
    """enable(): use_fold needs mla_norm_fold, mla_glue and gemv all on (and verified)."""
    import kimi_decode.fused as fused_mod
    import kimi_decode.kernels as kernels
    monkeypatch.setattr(fused_mod, "_kernels_usable", lambda dev: True)
    monkeypatch.setattr(kernels, "applicable", lambda name, cfg: True)
    monkeypatch.setattr(fused_mod, "VERIFIED", fused_mod.VERIFIED | {"mla_norm_fold"})
    fused = FusedDecoder.from_stock(StockDecoder(tiny(layers=(3, 4, 5, 6, 7, 8), batch=1)), kernels=frozenset())
    mla = [layer.attn for layer in fused.layers if layer.kind == "mla"]
    for on, want in ((("mla_norm_fold", "mla_glue", "gemv"), True), (("mla_glue", "gemv"), False),
                     (("mla_norm_fold", "gemv"), False), (("mla_norm_fold", "mla_glue"), False)):
        fused.enable(frozenset(on))
        assert all(a.use_fold is want for a in mla), on
    monkeypatch.setattr(fused_mod, "VERIFIED", fused_mod.VERIFIED - {"mla_norm_fold"})
    fused.enable(frozenset({"mla_norm_fold", "mla_glue", "gemv"}))
    assert not any(a.use_fold for a in mla)                    # not verified: never used
    monkeypatch.setattr(fused_mod, "VERIFIED", fused_mod.VERIFIED | {"mla_norm_fold_mma"})
    for on, want in ((("mla_norm_fold_mma", "mla_glue"), True), (("mla_norm_fold_mma",), False),
                     (("mla_glue", "gemv"), False)):
        fused.enable(frozenset(on))
        assert all(a.use_fold_mma is want for a in mla), on


@pytest.mark.parametrize("uv,batch,k", [(True, 1, 0), (True, 2, 7), (False, 1, 0)])
def test_mla_attend_call_sites_on_cpu(monkeypatch, uv: bool, batch: int, k: int) -> None:
    """mla_attend (and with `uv` mla_attend_uv) switched on through enable(), each emulated by
    its contract: mla_attend = stock_ops.mla_attend; mla_attend_uv = the same, then
    mla_glue.stock_uv with the eager gate (the stock ops uv_bmm + gate_mul), returning
    (o, o_lat). The emulations issue stock's own float ops, so the step must equal stock
    exactly (outputs, blocks, state). Per MLA layer the ops from the cache insert on are
    kv_insert, join (g from the side stream, before the kernel reads it), mla_decode, o_proj
    with uv (no uv_bmm / gate_mul / uv_gate), and kv_insert, mla_decode, uv_bmm, join,
    gate_mul, o_proj without. enable() turns the uv mode on only with both names enabled."""
    pytest.importorskip("cutlass")
    from types import SimpleNamespace

    import kimi_decode.fused as fused_mod
    import kimi_decode.kernels as kernels_pkg
    import kimi_decode.kernels.mla_attend as k_mla
    from kimi_decode import stock_ops
    from kimi_decode.kernels import mla_glue
    scratch = SimpleNamespace(splits=130)
    calls, ops = [], []

    def attend(q_full, cache, last, heads, c, scale, scratch=None):
        assert scratch is not None
        calls.append("attend")
        return stock_ops.mla_attend(q_full, cache, last, heads, c, scale)

    def attend_uv(q_full, cache, last, heads, c, scale, w_uv, g, scratch=None):
        assert scratch is not None and g.is_contiguous()
        calls.append("attend_uv")
        o_lat = stock_ops.mla_attend(q_full, cache, last, heads, c, scale)
        return mla_glue.stock_uv(o_lat, w_uv, g, stock_ops.sigmoid_gate), o_lat
    monkeypatch.setattr(k_mla, "mla_attend", attend)
    monkeypatch.setattr(k_mla, "mla_attend_uv", attend_uv)
    monkeypatch.setattr(k_mla, "can_implement", lambda *a: True)
    monkeypatch.setattr(k_mla, "can_implement_uv", lambda *a: True)
    monkeypatch.setattr(k_mla, "make_scratch", lambda *a, **kw: scratch)
    monkeypatch.setitem(fused_mod.MAX_ROWS, "mla_attend_rows", 64)   # the wiring at every M
    monkeypatch.setattr(fused_mod, "VERIFIED", fused_mod.VERIFIED | {"mla_attend_uv"})
    monkeypatch.setattr(fused_mod, "_kernels_usable", lambda dev: True)
    monkeypatch.setattr(kernels_pkg, "applicable", lambda name, cfg: True)
    real_range, real_join = fused_mod.op_range, fused_mod._join
    monkeypatch.setattr(fused_mod, "op_range", lambda op: ops.append(op) or real_range(op))
    monkeypatch.setattr(fused_mod, "_join", lambda rt, *t: ops.append("join") or real_join(rt, *t))

    cfg = tiny(layers=(3, 4, 5, 6, 7, 8), batch=batch, spec_tokens=k)
    stock = StockDecoder(cfg)
    fused = FusedDecoder.from_stock(stock)
    mla = [layer.attn for layer in fused.layers if layer.kind == "mla"]
    assert len(mla) == 2
    assert fused.enable(frozenset({"mla_attend"})) == {"mla_attend"}
    assert all(a.attend_scratch is scratch and not a.attend_uv for a in mla)
    names = frozenset({"mla_attend", "mla_attend_uv"} if uv else {"mla_attend"})
    assert fused.enable(names) == names
    assert all(a.attend_scratch is scratch and a.attend_uv == uv for a in mla)
    steps = 2
    for s in range(steps):
        m, prefix, blocks = stock.make_inputs(seed=80 + s)
        blocks_f = blocks.clone()
        with torch.no_grad():
            out_s, out_f = stock(m, prefix, blocks), fused(m, prefix, blocks_f)
        for a, b in zip(out_s, out_f):
            assert torch.equal(a, b)
        assert torch.equal(blocks, blocks_f)
    bufs_f = dict(fused.named_buffers())
    for name, buf in stock.named_buffers():
        assert torch.equal(buf, bufs_f[name]), name
    assert calls == ["attend_uv" if uv else "attend"] * (2 * steps)
    tails = []
    for i, op in enumerate(ops):
        if op == "kv_insert":
            tails.append(ops[i:ops.index("o_proj", i) + 1])
    want = (["kv_insert", "join", "mla_decode", "o_proj"] if uv
            else ["kv_insert", "mla_decode", "uv_bmm", "join", "gate_mul", "o_proj"])
    assert tails == [want] * (2 * steps)


@pytest.mark.parametrize("kernels_on,batch,k,want", [
    ({"kda", "kda_split", "kda_fast"}, 1, 0, "fast"), ({"kda_fast"}, 1, 0, "fast"),
    ({"kda", "kda_split"}, 1, 0, "split"), ({"kda"}, 1, 0, "kda"),
    ({"kda", "kda_split", "kda_fast"}, 2, 0, "split"), ({"kda", "kda_fast"}, 1, 7, "kda")])
def test_kda_fast_wiring_on_cpu(monkeypatch, kernels_on: set, batch: int, k: int, want: str) -> None:
    """enable() + KDAAttention.forward: kda_fast (kernels/kda_fast.py) runs exactly at B = 1,
    T = 1 when it is on, kda_split otherwise when that is on, else kda_decode; each emulated by
    kda_decode's contract (the fast/split wrappers take kda_split's scratch), and the step
    still matches stock. MAX_ROWS["kda"] is raised so the fallbacks at B·T > 1 are reached."""
    pytest.importorskip("cutlass")
    import kimi_decode.fused as fused_mod
    import kimi_decode.kernels as kernels_pkg
    import kimi_decode.kernels.kda_decode as k_kda
    import kimi_decode.kernels.kda_fast as k_fast
    import kimi_decode.kernels.kda_split as k_split
    calls = []

    def emulated(kind: str):
        def fn(z, f_b, conv_w, conv_state, dt_bias, a_log, rec_state, o_norm, kcfg, *scratch):
            assert (len(scratch) == 1 and scratch[0].counter.numel() >= batch * kcfg.heads) == (kind != "kda")
            calls.append(kind)
            return _emulate_kda(z, f_b, conv_w, conv_state, dt_bias, a_log, rec_state, o_norm, kcfg)
        return fn
    monkeypatch.setattr(k_kda, "kda_decode", emulated("kda"))
    monkeypatch.setattr(k_split, "kda_decode_split", emulated("split"))
    monkeypatch.setattr(k_fast, "kda_decode_fast", emulated("fast"))
    monkeypatch.setitem(fused_mod.MAX_ROWS, "kda", 64)
    monkeypatch.setattr(fused_mod, "VERIFIED", fused_mod.VERIFIED | {"kda_fast"})
    monkeypatch.setattr(fused_mod, "_kernels_usable", lambda dev: True)
    monkeypatch.setattr(kernels_pkg, "applicable", lambda name, cfg: True)
    stock = StockDecoder(tiny(layers=(3, 4), batch=batch, spec_tokens=k))
    fused = FusedDecoder.from_stock(stock)
    assert fused.enable(frozenset(kernels_on)) == frozenset(kernels_on)
    kda_layers = [layer.attn for layer in fused.layers if isinstance(layer.attn, fused_mod.KDAAttention)]
    assert kda_layers and all(a.use_fast == (want == "fast") for a in kda_layers)
    run_close(stock, fused, seed=70, steps=2)
    assert calls == [want] * (2 * len(kda_layers))


@pytest.mark.parametrize("enabled,max_rows,one_fits,expected", [
    ({"experts_one", "experts_v2"}, 64, True, "one"),       # within the table: one launch
    ({"experts_one", "experts_v2"}, 1, True, True),         # M above the table: FC1 + FC2 v2
    ({"experts_one", "experts_v2"}, 64, False, True),       # its shape rules refuse: FC1 + FC2 v2
    ({"experts_one"}, 1, True, None),                       # ... and with no other kernel: stock
    ({"experts_v2"}, 64, True, True),                       # experts_one not enabled
])
def test_experts_one_wiring_on_cpu(monkeypatch, enabled: set, max_rows: int, one_fits: bool,
                                   expected: bool | str | None) -> None:
    """enable() switches LatentMoE._experts to the one-launch kernel (kernels/moe_experts_one.py)
    when `experts_one` is enabled, M ≤ MAX_ROWS["experts_one"] and can_implement_one holds,
    passing the layer's counter buffer (zeroed int32 [64], registered by enable()); else the
    previous order (experts_v2, experts, stock). Kernels are the torch statement of their
    contract, so the step still matches stock; every MoE layer of every step makes one call.
    VERIFIED and the device test are patched (the lead adds experts_one after its device run)."""
    pytest.importorskip("cutlass")
    import kimi_decode.fused as fused_mod
    import kimi_decode.kernels as kernels_pkg
    import kimi_decode.kernels.moe_experts as k_ex
    import kimi_decode.kernels.moe_experts_one as k_one
    calls: list = []

    def experts(z, idx, w, w13, w2, beta, lin_beta, out=None, *, inter=None, pdl=False, v2=False,
                stage_async=False, rows=0, ids_ready=None):
        calls.append(v2)
        return experts_contract(z, idx, w, w13, w2, beta, lin_beta, out)

    def experts_one(z, idx, w, w13, w2, beta, lin_beta, counters, out=None, *, inter=None):
        assert counters.dtype == torch.int32 and counters.shape == (64,) and int(counters.abs().sum()) == 0
        calls.append("one")
        return experts_contract(z, idx, w, w13, w2, beta, lin_beta, out)
    monkeypatch.setattr(k_ex, "experts", experts)
    monkeypatch.setattr(k_ex, "can_implement_v2", lambda *a, **k: True)
    monkeypatch.setattr(k_one, "experts_one", experts_one)
    monkeypatch.setattr(k_one, "can_implement_one", lambda *a, **k: one_fits)
    monkeypatch.setitem(fused_mod.MAX_ROWS, "experts_one", max_rows)
    monkeypatch.setattr(fused_mod, "VERIFIED", fused_mod.VERIFIED | {"experts_v2", "experts_one"})
    monkeypatch.setattr(fused_mod, "_kernels_usable", lambda dev: True)
    monkeypatch.setattr(kernels_pkg, "applicable", lambda name, cfg: True)
    cfg = tiny(layers=(3, 4, 5, 6, 7, 8), batch=2, spec_tokens=7)
    assert cfg.rows > 1
    stock = StockDecoder(cfg)
    fused = FusedDecoder.from_stock(stock)
    assert fused.enable(frozenset(enabled)) == frozenset(enabled)
    moe = [layer.mlp for layer in fused.layers if isinstance(layer.mlp, fused_mod.LatentMoE)]
    assert len(moe) == 6 and all(hasattr(m, "experts_counters") == ("experts_one" in enabled) for m in moe)
    run_close(stock, fused, seed=90, steps=2)
    assert calls == ([] if expected is None else [expected] * (2 * len(moe)))


@pytest.mark.parametrize("after", [True, False])
def test_shared_expert_issued_after_the_router(monkeypatch, after: bool) -> None:
    """fused.SHARED_AFTER_ROUTER: at M > 1 the MoE issues latent_down, the router, then the
    shared expert (on the side stream, after the routing); off: the shared expert right after
    latent_down, before the router. The step matches stock either way."""
    import kimi_decode.fused as fused_mod
    order = record_ops(monkeypatch)
    monkeypatch.setattr(fused_mod, "SHARED_AFTER_ROUTER", after)
    cfg = tiny(layers=(3, 4), batch=2, spec_tokens=3)
    stock = StockDecoder(cfg)
    fused = FusedDecoder.from_stock(stock)
    run_close(stock, fused, seed=7, steps=1)
    moe = [o for o in order if o in ("latent_down", "router", "shared_expert")]
    want = ("latent_down", "router", "shared_expert") if after else ("latent_down", "shared_expert", "router")
    per_layer = [tuple(moe[i:i + 3]) for i in range(0, len(moe), 3)]
    assert per_layer and all(p == want for p in per_layer), per_layer


@pytest.mark.parametrize("early,enabled,expect", [
    (True, {"gemv_multi", "experts_v2"}, True),                   # the M = 1 front and FC2 v2: flag
    (False, {"gemv_multi", "experts_v2"}, False),                 # the switch off: the router counter
    (True, {"gemv_multi", "experts_v2", "experts_one"}, False),   # the one-launch experts take M = 1
    (True, {"gemv_multi", "experts"}, False),                     # no FC2 v2: no buffer at all
])
def test_fc1_early_ids_wiring_on_cpu(monkeypatch, early: bool, enabled: set, expect: bool) -> None:
    """moe_experts.FC1_EARLY_IDS: enable() gives each MoE layer a zeroed int32 routing sync
    buffer (router_fast.SYNC_WORDS) where the M = 1 front and FC2 v2 are on; forward then
    hands that buffer to the front as its counter with publish_ready and the same buffer to
    the experts as ids_ready, and nowhere else (a raised flag that no FC1 lowers would let a
    later FC1 read stale ids). Kernels are their torch contracts: the step still equals stock."""
    pytest.importorskip("cutlass")
    import kimi_decode.fused as fused_mod
    import kimi_decode.kernels as kernels_pkg
    import kimi_decode.kernels.gemv_multi as k_multi
    import kimi_decode.kernels.moe_experts as k_ex
    import kimi_decode.kernels.moe_experts_one as k_one
    from kimi_decode.kernels.router_fast import SYNC_WORDS
    fronts, ready = [], []

    def route_and_project(y, w_gate, bias, top_k, scaling, counter, ws, publish_ready=False):
        fronts.append((counter, publish_ready))
        ids, w = _emulate_route(y, w_gate, bias, top_k, scaling, counter)
        return ids, w, [y @ w_.t() for w_ in ws]

    def experts(z, idx, w, w13, w2, beta, lin_beta, out=None, *, inter=None, pdl=False, v2=False,
                stage_async=False, rows=0, ids_ready=None):
        ready.append(ids_ready)
        return experts_contract(z, idx, w, w13, w2, beta, lin_beta, out)

    def experts_one(z, idx, w, w13, w2, beta, lin_beta, counters, out=None, *, inter=None):
        ready.append("one")
        return experts_contract(z, idx, w, w13, w2, beta, lin_beta, out)
    monkeypatch.setattr(k_multi, "route_and_project", route_and_project)
    monkeypatch.setattr(k_multi, "gemv_multi", lambda x, ws: [x @ w.t() for w in ws])   # MLA's qkv_a + g
    monkeypatch.setattr(k_multi, "can_implement", lambda *a, **k: True)
    monkeypatch.setattr(k_ex, "experts", experts)
    monkeypatch.setattr(k_ex, "can_implement", lambda *a, **k: True)
    monkeypatch.setattr(k_ex, "can_implement_v2", lambda *a, **k: True)
    monkeypatch.setattr(k_ex, "FC1_EARLY_IDS", early)
    monkeypatch.setattr(k_one, "experts_one", experts_one)
    monkeypatch.setattr(k_one, "can_implement_one", lambda *a, **k: True)
    monkeypatch.setattr(fused_mod, "VERIFIED", fused_mod.VERIFIED | set(enabled))
    monkeypatch.setattr(fused_mod, "_kernels_usable", lambda dev: True)
    monkeypatch.setattr(kernels_pkg, "applicable", lambda name, cfg: True)
    cfg = tiny(layers=(3, 4, 5, 6), batch=1)
    assert cfg.rows == 1
    stock = StockDecoder(cfg)
    fused = FusedDecoder.from_stock(stock)
    assert fused.enable(frozenset(enabled)) == frozenset(enabled)
    moe = [layer.mlp for layer in fused.layers if isinstance(layer.mlp, fused_mod.LatentMoE)]
    bufs = [m.routing_sync for m in moe]
    if early and "experts_v2" in enabled:
        assert all(b is not None and b.dtype == torch.int32 and b.shape == (SYNC_WORDS,) and not b.any()
                   for b in bufs)
        assert all("routing_sync" not in dict(m.named_buffers()) for m in moe)   # scratch, not state
    else:
        assert all(b is None for b in bufs)
    run_close(stock, fused, seed=91, steps=2)
    assert len(fronts) == 2 * len(moe)
    if expect:
        assert [(c.data_ptr(), p) for c, p in fronts] == [(b.data_ptr(), True) for b in bufs] * 2
        assert [r.data_ptr() for r in ready] == [b.data_ptr() for b in bufs] * 2
    else:
        assert all(not p and c.numel() == 1 for c, p in fronts)
        assert all(r is None or r == "one" for r in ready) and len(ready) == 2 * len(moe)


def test_in_place_position_update_gives_the_same_positions(monkeypatch: pytest.MonkeyPatch) -> None:
    """fused.POS_UPDATE_IN_PLACE (add_ + masked_fill_ instead of copy_(where(..))): the same
    positions, MLA query positions and outputs as the default, step by step past a cache wrap."""
    import kimi_decode.fused as fused_mod
    cfg = tiny(layers=(3, 4, 5, 6, 7, 8), batch=2, spec_tokens=7)
    stock = StockDecoder(cfg)
    base, in_place = FusedDecoder.from_stock(stock), FusedDecoder.from_stock(stock)
    steps = (cfg.cache_len - cfg.context_len) // cfg.tokens_per_seq + 2     # past one wrap
    wrapped = False
    for s in range(steps):
        m, prefix, blocks = stock.make_inputs(seed=120 + s)
        with torch.no_grad():
            monkeypatch.setattr(fused_mod, "POS_UPDATE_IN_PLACE", False)
            before = base.pos.clone()
            out_b = base(m, prefix, blocks.clone())
            monkeypatch.setattr(fused_mod, "POS_UPDATE_IN_PLACE", True)
            out_i = in_place(m, prefix, blocks.clone())
        wrapped |= bool((base.pos < before).any())
        assert torch.equal(in_place.pos, base.pos), s
        assert torch.equal(in_place.mla_last, base.mla_last), s
        for a, b in zip(out_b, out_i):
            assert torch.equal(a, b), s
    assert wrapped


@pytest.mark.parametrize("large", [True, False])
def test_large_m_experts_call_on_cpu(monkeypatch, large: bool) -> None:
    """Where no CuTe experts kernel runs, fused.LatentMoE._experts calls the stock op with the
    fused byte rule (`inter` = the unpadded intermediate width, the O(P) sort) when
    fused.LARGE_M_EXPERTS is on, and as stock does when it is off; stock never passes them. On
    the CPU the op's torch path reads the zero padding, so the step stays bit-identical to
    stock either way (the Triton kernels' equality with and without the rule is
    test_stock_triton's)."""
    import kimi_decode.fused as fused_mod
    from kimi_decode import stock_ops
    calls: list[dict] = []
    original = stock_ops.OpSet.experts

    def recording(self, *args, **kw):
        calls.append(dict(kw))
        return original(self, *args, **kw)
    monkeypatch.setattr(stock_ops.OpSet, "experts", recording)
    monkeypatch.setattr(fused_mod, "LARGE_M_EXPERTS", large)
    cfg = tiny(layers=(3, 4, 5), batch=2, spec_tokens=7)
    stock = StockDecoder(cfg)
    fused = FusedDecoder.from_stock(stock)
    m, prefix, blocks = stock.make_inputs(seed=7)
    blocks_f = blocks.clone()
    with torch.no_grad():
        out_s = stock(m, prefix, blocks)
        n_stock = len(calls)
        out_f = fused(m, prefix, blocks_f)
    for a, b in zip(out_s, out_f):
        assert torch.equal(a, b)
    assert n_stock == 3 and all(c == {} for c in calls[:n_stock])
    fused_calls = calls[n_stock:]
    assert len(fused_calls) == 3
    for c in fused_calls:
        if large:
            assert c["inter"] == cfg.expert_local_inter and c["fast_align"] is True
        else:
            assert "inter" not in c and "fast_align" not in c


@pytest.mark.parametrize("min_rows", [None, 8, 9])
def test_linear_cublas_rows_on_cpu(monkeypatch, min_rows: int | None) -> None:
    """fused.LINEAR_CUBLAS_MIN_ROWS: from that many rows on, the projections `_linear` serves
    (in_proj, the MoE down-projection, ...) skip stock's GEMM op for torch.mm, and the latent
    up-projection stock's fused op for the norm + addmm; below it, and when None, they call
    stock's ops. Oracle: which weights reach OpSet.linear (recorded), and the step
    against stock (the same products, float32 summation order only)."""
    import kimi_decode.fused as fused_mod
    from kimi_decode import stock_ops
    seen: list[int] = []
    original = stock_ops.OpSet.linear

    def recording(self, x, w, out_dtype=None):
        seen.append(w.data_ptr())
        return original(self, x, w, out_dtype)
    monkeypatch.setattr(stock_ops.OpSet, "linear", recording)
    ups: list[int] = []
    original_up = stock_ops.OpSet.up

    def recording_up(self, *args):
        ups.append(1)
        return original_up(self, *args)
    monkeypatch.setattr(stock_ops.OpSet, "up", recording_up)
    monkeypatch.setattr(fused_mod, "LINEAR_CUBLAS_MIN_ROWS", min_rows)
    cfg = tiny(layers=(3, 4), batch=2, spec_tokens=3)          # M = 8 rows
    stock = StockDecoder(cfg)
    fused = FusedDecoder.from_stock(stock)
    m, prefix, blocks = stock.make_inputs(seed=3)
    with torch.no_grad():
        out_s = stock(m, prefix, blocks.clone())
        seen.clear()
        ups.clear()
        out_f = fused(m, prefix, blocks.clone())
    for a, b in zip(out_s, out_f):
        assert float((a - b).norm() / a.norm()) < 1e-5
    # with no kernel on, the attention modules run stock's forward; the MoE's projections go
    # through _linear in every mode
    for layer in fused.layers:
        down, gate_up = layer.mlp.down.data_ptr(), layer.mlp.shared_gate_up.data_ptr()
        cublas = min_rows is not None and cfg.rows >= min_rows
        assert (down in seen) == (not cublas) and (gate_up in seen) == (not cublas)
    assert len(ups) == (0 if cublas else len(fused.layers))      # the latent up-projection too
