"""Fused Kimi K3 decode step: stock.py's math with custom CuTe DSL kernels where they exist.

Mirrors stock.py: same class names, forward signatures and NVTX op names, so a diff of the two
files is the list of fusions. `FusedDecoder.from_stock(stock)` re-uses the stock model's
weights (shared, not copied) and clones its decode state, so the two can run side by side
from the same state; `FusedDecoder(cfg, rt, device)` (the variant registry's constructor)
builds the stock model and converts it.

Fused (CuTe DSL kernels in kimi_decode/kernels/, used on a GPU when `can_implement` holds
and the kernel is in `VERIFIED`):
- `attn_res`, `mlp_res`: prefix add + optional block write + AttnRes mix + RMSNorm, one
  kernel (kernels/attn_res.py) instead of the stock op chain.
- KDA: f_b projection + conv update + SiLU + gate + β + L2 norms + delta-rule recurrence +
  gated RMSNorm for the local heads, one kernel (kernels/kda_decode.py) under op
  `kda_recurrence`; the stock ops `f_b_proj`, `conv`, `o_norm` disappear.
- MoE router: GEMV (fp32 accumulation) + sigmoid + correction-bias top-k + renormalisation,
  one kernel for M ≤ 16 (above: the stock router GEMM's fp32 logits + one kernel), op
  `router`; the stock op `routing` disappears. fp32 logits, as KIMI_K3.md asks and as the
  stock skinny GEMM gives them.
- Shared expert on the side stream, next to the latent down-projection, overlapping the
  router on the main stream (stock joins the side stream before the router starts).
- Projections at M = 1 (the per-M table, kernels/gemv.py GEMV_MAX_ROWS): a CuTe DSL GEMV
  streaming each weight once (in_proj 10.1 us = 4.6 TB/s vs 14.0 us for torch's GEMM on the
  H200) for in_proj, o_proj, g_proj, qkv_a, q_b, latent_down, shared gate_up; from M = 2 the
  stock GEMM op (its skinny GEMM or cuBLAS: at M = 8 the GEMV measured 33 us vs 13.8 us),
  and where K is not a multiple of 256 (shared down, K = 384).
- MLA: g_proj stays on the side stream until the gate multiply (stock joins at once).
- `prefetch` (opt-in, see DEFAULT_KERNELS): after the routed experts are issued, a
  side-stream kernel pulls the first `PREFETCH_BYTES` of the next layer's first attention
  weight into L2 (kernels/l2_prefetch.py), under its own NVTX op `prefetch`.

Still stock torch ops (not fused yet): o_proj + all-reduce + AttnRes stay three launches (no
GEMV+AR+AttnRes kernel); the MLA chain (norms, q_b, W_UK, KV insert, attention, W_UV, gate)
apart from its projections; the routed experts (grouped GEMMs); the MoE tail (collectives,
latent RMSNorm, up-projection); the dense layer-0 MLP.

On the CPU (no kernels) every op falls back to the stock ops, so fused equals stock exactly.
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn

from kimi_decode import stock
from kimi_decode.config import KimiConfig
from kimi_decode.ranges import layer_range, op_range
from kimi_decode.stock import Runtime, StockDecoder

# Kernels that passed their device checks on the H200 (bench/fused_correctness.md); a kernel
# not listed here is never used.
VERIFIED: frozenset[str] = frozenset({"attn_res", "kda", "router", "gemv", "prefetch"})
# Used by default: the L2 prefetch is correct but slowed its consumer GEMV in the device check
# (21.8 us cold vs 70.4 us after a prefetch), so it is opt-in (kernels={..., "prefetch"}).
DEFAULT_KERNELS: frozenset[str] = VERIFIED - {"prefetch"}
PREFETCH_BYTES = 24 << 20   # about half of the H200's usable L2


def _kernels_usable(device: torch.device) -> bool:
    return device.type == "cuda"


def _linear(x: torch.Tensor, w: torch.Tensor, use_gemv: bool, k: object) -> torch.Tensor:
    """x @ wᵀ. The per-M table: the CuTe GEMV (kernels/gemv.py) for M ≤ 8 where its shape
    rules hold, else the stock path's own GEMM op `k.linear` (its skinny GEMM or cuBLAS)."""
    if use_gemv:
        from kimi_decode.kernels.gemv import can_implement, gemv
        if x.is_contiguous() and can_implement(x.shape[0], w.shape[0], w.shape[1], (x.dtype, w.dtype)):
            return gemv(x, w)
    return k.linear(x, w)


def _restate(module: nn.Module, cls: type) -> nn.Module:
    """A copy of `module` that shares its parameters and runtime (streams, collectives),
    clones its buffers (decode state), and has class `cls` (a fused subclass)."""
    memo: dict[int, object] = {id(p): p for p in module.parameters()}
    for sub in module.modules():
        rt = getattr(sub, "rt", None)
        if rt is not None:
            memo[id(rt)] = rt
    new = copy.deepcopy(module, memo)
    new.__class__ = cls
    return new


@contextlib.contextmanager
def _on_side(rt: Runtime, *inputs: torch.Tensor) -> Iterator[torch.cuda.Stream | None]:
    """Issue the block on the aux stream after the main stream's work so far, WITHOUT joining
    at the end (call `_join` where the main stream first needs the results)."""
    side = rt.aux.stream
    if side is None:
        yield None
        return
    side.wait_stream(torch.cuda.current_stream())
    for t in inputs:
        t.record_stream(side)
    with torch.cuda.stream(side):
        yield side


def _join(rt: Runtime, *outputs: torch.Tensor) -> None:
    """The main stream waits for the aux stream; its outputs are marked used on main."""
    side = rt.aux.stream
    if side is None:
        return
    main = torch.cuda.current_stream()
    main.wait_stream(side)
    for t in outputs:
        t.record_stream(main)


class AttnRes(stock.AttnRes):
    """prefix = delta or base + delta, optional block write, mix, RMSNorm: one kernel."""

    use_kernel = False

    def update_and_mix(self, base: torch.Tensor, delta: torch.Tensor, blocks: torch.Tensor, nb: int,
                       reset: bool, write_slot: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(new prefix, normalised mix); with `write_slot`, blocks[:, write_slot] = new prefix
        (the mix reads blocks[:nb] only, so the slot written is never a source)."""
        if not self.use_kernel:
            prefix, x = super().update_and_mix(base, delta, blocks, nb, reset)
            if write_slot is not None:
                blocks[:, write_slot].copy_(prefix)
            return prefix, x
        from kimi_decode.kernels.attn_res import attn_res_rmsnorm
        if reset:
            x, prefix = attn_res_rmsnorm(blocks, nb, delta, self.w, self.norm, self.eps,
                                         write_slot=write_slot)
        else:
            x, prefix = attn_res_rmsnorm(blocks, nb, base, self.w, self.norm, self.eps,
                                         delta=delta, write_slot=write_slot)
        return prefix, x


class KDAAttention(stock.KDAAttention):
    """in_proj GEMV, one fused KDA kernel, o_proj GEMV, all-reduce."""

    use_kernel = False
    use_gemv = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.use_kernel or self.use_gemv):
            return super().forward(x)
        cfg, k = self.cfg, self.k
        H, d, P = cfg.kda_local_heads, cfg.kda_head_dim, cfg.kda_local_dim
        with op_range("in_proj"):
            z = _linear(x, self.in_proj, self.use_gemv, k)                             # [M, R]
        if self.use_kernel:
            from kimi_decode.kernels.kda_decode import KDAConfig, kda_decode
            with op_range("kda_recurrence"):
                kcfg = KDAConfig(H, d, cfg.tokens_per_seq, cfg.in_proj_rows, cfg.gate_lower_bound,
                                 1e-6, cfg.rms_eps)
                o = kda_decode(z, self.f_b, self.conv_w, self.conv_state, self.dt_bias, self.a_log,
                               self.rec_state, self.o_norm, kcfg)                     # [M, P]
        else:                                                                          # stock ops
            qkv, gate_out = z[:, :3 * P], z[:, 3 * P:4 * P]
            f_a, beta_in = z[:, 4 * P:4 * P + d], z[:, 4 * P + d:4 * P + d + H]
            with op_range("f_b_proj"):
                f_b = k.linear(f_a, self.f_b)
            with op_range("conv"):
                act = k.conv_(self.conv_state, qkv, self.conv_w, cfg.batch)
            with op_range("kda_recurrence"):
                o = k.kda_(act, f_b, beta_in, self.dt_bias, self.a_log, self.rec_state,
                           cfg.gate_lower_bound, H)
            with op_range("o_norm"):
                o = k.gated_rms_norm(o, self.o_norm, gate_out, cfg.rms_eps, x.dtype)
        with op_range("o_proj"):
            out = _linear(o, self.o_proj, self.use_gemv, k)
        with op_range("all_reduce"):
            return self.rt.comm.all_reduce(out)


class MLAAttention(stock.MLAAttention):
    """The stock op sequence with GEMVs for the projections, and g_proj on the side stream
    until the gate multiply needs it (stock joins right after issuing it)."""

    use_gemv = False

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if not self.use_gemv:
            return super().forward(x, pos)
        cfg, fx, k, lin = self.cfg, self.fx, self.k, self.use_gemv
        B, T, H = cfg.batch, cfg.tokens_per_seq, cfg.mla_local_heads
        nope, rope, c, ql = cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.kv_lora_rank, cfg.q_lora_rank
        with _on_side(self.rt, x), op_range("g_proj"):
            g = _linear(x, self.g_proj, lin, k)                                        # [M, H*vd]
        with op_range("qkv_a"):
            a = _linear(x, self.qkv_a, lin, k)                                         # [M, ql+c+rope]
        with op_range("qkv_norm"):
            qa, ckv = k.mla_norms(a, self.q_a_norm, self.kv_a_norm, ql, c, cfg.rms_eps)
        with op_range("q_b_proj"):
            q = _linear(qa, self.q_b, lin, k).reshape(-1, H, nope + rope)              # [M, H, 192]
        with op_range("uk_bmm"):
            q_lat = torch.bmm(q[..., :nope].transpose(0, 1), self.w_uk_t).transpose(0, 1)
        with op_range("kv_insert"):
            q_full = k.kv_insert(q_lat, q, ckv, a, ql + c, self.cache, pos, T)
        with op_range("mla_decode"):
            last = pos + self.t_off
            o_lat = fx["attend"](q_full, self.cache, last, H, c, (nope + rope) ** -0.5)
        with op_range("uv_bmm"):
            o = torch.bmm(o_lat.reshape(B * T, H, c).transpose(0, 1), self.w_uv).transpose(0, 1)
        _join(self.rt, g)
        with op_range("gate_mul"):
            o = fx["gate"](o.reshape(B * T, -1), g)
        with op_range("o_proj"):
            out = _linear(o, self.o_proj, lin, k)
        with op_range("all_reduce"):
            return self.rt.comm.all_reduce(out)


class LatentMoE(stock.LatentMoE):
    """Router kernel; shared expert beside the latent down-projection on the side stream;
    L2 prefetch of the next layer's weights; experts and tail as stock."""

    use_router_kernel = False
    use_gemv = False
    prefetch_target: torch.Tensor | None = None

    def _route(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        if self.use_router_kernel:
            from kimi_decode.kernels.router import GEMV_MAX_ROWS, route
            # past the GEMV rows the logits come from the stock path's router GEMM
            logits = None if y.shape[0] <= GEMV_MAX_ROWS else self.k.linear(y, self.router, torch.float32)
            return route(y, self.router, self.bias, cfg.top_k, cfg.routed_scaling, self.router_counter,
                         logits=logits)
        logits = self.k.linear(y, self.router, torch.float32)                         # stock ops
        return self.fx["route"](logits, self.bias, cfg.top_k, cfg.routed_scaling)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        cfg, fx = self.cfg, self.fx
        Is, n = cfg.shared_local_inter, cfg.row_shard
        with _on_side(self.rt, y):
            with op_range("latent_down"):
                z = _linear(y, self.down, self.use_gemv, self.k)                       # [M, L]
            with op_range("shared_expert"):
                h = _linear(y, self.shared_gate_up, self.use_gemv, self.k)
                sh = fx["situ"](h, Is, cfg.situ_beta, cfg.situ_linear_beta)
                sh = _linear(sh, self.shared_down, self.use_gemv, self.k)              # [M, D] partial
        with op_range("router"):
            idx, w = self._route(y)                                                    # [M, K]
            self.last_idx = idx
        _join(self.rt, z, sh)
        with op_range("experts"):
            r = fx["experts"](z, idx, w, self.w13, self.w2, cfg.situ_beta, cfg.situ_linear_beta)
        if self.prefetch_target is not None:
            from kimi_decode.kernels.l2_prefetch import prefetch_l2
            with _on_side(self.rt), op_range("prefetch"):
                prefetch_l2(self.prefetch_target, PREFETCH_BYTES)
            _join(self.rt)
        with op_range("moe_tail"):
            r = self.rt.comm.all_reduce(r)                                             # [M, L]
            sh = self.rt.comm.reduce_scatter_cols(sh)                                  # [M, D/tp]
        with op_range("up_proj"):
            rank = self.rt.comm.rank
            part = fx["up"](r, self.latent_norm, self.up[rank * n:(rank + 1) * n], sh, cfg.rms_eps)
        with op_range("moe_gather"):
            return self.rt.comm.all_gather_cols(part)


class DenseMLP(stock.DenseMLP):
    """Not fused yet: the stock op sequence."""


class DecoderLayer(stock.DecoderLayer):
    """One K3 layer; the prefix update and block write live inside the AttnRes kernels."""

    def forward(self, m: torch.Tensor, prefix: torch.Tensor, blocks: torch.Tensor,
                pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with layer_range(self.idx, self.kind):
            with op_range("attn_res"):
                slot = self.block_slot if self.starts_block else None
                prefix, x = self.attn_res.update_and_mix(prefix, m, blocks, self.nb_attn, False, write_slot=slot)
            a = self.attn(x, pos) if self.kind == "mla" else self.attn(x)
            with op_range("mlp_res"):
                prefix, y = self.mlp_res.update_and_mix(prefix, a, blocks, self.nb_mlp, self.starts_block)
            return self.mlp(y), prefix


FUSED_CLASS = {stock.AttnRes: AttnRes, stock.KDAAttention: KDAAttention,
               stock.MLAAttention: MLAAttention, stock.LatentMoE: LatentMoE,
               stock.DenseMLP: DenseMLP, stock.DecoderLayer: DecoderLayer}


class FusedDecoder(StockDecoder):
    """The fused step; same interface as StockDecoder (forward, make_inputs, layers, pos)."""

    def __init__(self, cfg: KimiConfig, rt: Runtime | None = None,
                 device: torch.device | str = "cpu", kernels: frozenset[str] | None = None) -> None:
        nn.Module.__init__(self)
        self._adopt(StockDecoder(cfg, rt, device), kernels)

    @classmethod
    def from_stock(cls, model: StockDecoder, kernels: frozenset[str] | None = None) -> "FusedDecoder":
        """Fused decoder over `model`'s weights (shared) with a copy of its current state."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new._adopt(model, kernels)
        return new

    def _adopt(self, model: StockDecoder, kernels: frozenset[str] | None) -> None:
        memo = {id(p): p for p in model.parameters()}
        memo[id(model.rt)] = model.rt                                    # same runtime, not a copy
        clone = copy.deepcopy(model, memo)
        for mod in clone.modules():
            if type(mod) in FUSED_CLASS:
                mod.__class__ = FUSED_CLASS[type(mod)]
        self.cfg, self.rt = clone.cfg, clone.rt
        self.layers = clone.layers
        self.register_buffer("pos", clone.pos)
        self.kernels = self.enable(kernels if kernels is not None else DEFAULT_KERNELS)

    def enable(self, kernels: frozenset[str]) -> frozenset[str]:
        """Switch the named kernels on where they can run (GPU, supported shapes), the rest
        off; returns the set actually enabled."""
        from kimi_decode.kernels import applicable
        dev = self.pos.device
        on = frozenset(k for k in kernels & VERIFIED if _kernels_usable(dev) and applicable(k, self.cfg))
        for i, layer in enumerate(self.layers):
            for res in (layer.attn_res, layer.mlp_res):
                res.use_kernel = "attn_res" in on
            if isinstance(layer.attn, KDAAttention):
                layer.attn.use_kernel = "kda" in on
            if isinstance(layer.attn, (KDAAttention, MLAAttention)):
                layer.attn.use_gemv = "gemv" in on
            if isinstance(layer.mlp, LatentMoE):
                layer.mlp.use_router_kernel = "router" in on
                layer.mlp.use_gemv = "gemv" in on
                if "router" in on and not hasattr(layer.mlp, "router_counter"):
                    # grid-completion counter of the one-kernel router; the kernel re-zeroes it
                    layer.mlp.register_buffer("router_counter", torch.zeros(1, dtype=torch.int32, device=dev))
                nxt = self.layers[i + 1].attn if i + 1 < len(self.layers) else None
                target = None
                if "prefetch" in on and nxt is not None:
                    target = nxt.in_proj if isinstance(nxt, stock.KDAAttention) else nxt.qkv_a
                # a plain tensor view (a Parameter here would be registered as a second weight)
                layer.mlp.prefetch_target = None if target is None else target.detach()
        return on
