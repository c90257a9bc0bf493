"""Stock Kimi K3 decode step for one TP rank: KIMI_K3.md math in plain PyTorch ops, issued in
the order and on the streams stock vLLM uses (KIMI_K3.md §2.4, Part 3).

Dimension legend: B batch, T = 1 + k tokens per sequence (k speculative rows), M = B·T rows,
D hidden, H local heads, d head dim, P = H·d, E experts, K top-k, L latent width (3584),
I local expert intermediate (padded), C MLA cache length, S AttnRes block slots (8).

Decode state that each step updates in place: per KDA layer the conv state [B, 3P, 3] and the
fp32 recurrent state [B, H, d, d]; per MLA layer the latent cache [B, C, 512 + 64] and the
shared position `pos`; the AttnRes `blocks` [M, S, D] (written when a layer starts a block).
With T > 1 all draft rows are accepted: the states advance by T tokens.

Collectives and side streams come from the runtime the runner binds (`comm.py`); ranges come
from `ranges.py`, one per op, inside `L{idx}.{kind}`, inside `step`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kimi_decode import stock_ops as ops
from kimi_decode.comm import LocalComm, SideStream
from kimi_decode.stock_ops import situ  # noqa: F401  (re-exported: fused.py uses stock.situ)
from kimi_decode.config import KimiConfig
from kimi_decode.ranges import layer_range, op_range, step_range
from kimi_decode.weights import Seeder


@dataclass
class Runtime:
    """What the runner decides and the model uses: collectives and the aux stream."""

    comm: object
    aux: SideStream


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w.to(x.dtype), eps)


def _param(t: torch.Tensor, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(t.to(dtype).contiguous(), requires_grad=False)


class AttnRes(nn.Module):
    """Weights of one AttnRes mix: w = w_norm ⊙ w_proj (fused at load) and the RMSNorm after it."""

    def __init__(self, cfg: KimiConfig, seed: Seeder) -> None:
        super().__init__()
        D = cfg.hidden
        self.eps = cfg.rms_eps
        self.k = ops.OpSet(cfg)
        w_norm = seed.replicated("res_norm", (D,), 0.1, 1.0)
        w_proj = seed.replicated("res_proj", (D,), D ** -0.5)
        self.w = _param(w_norm * w_proj, torch.float32)  # fused at load, as llama.cpp does
        self.norm = _param(seed.replicated("layernorm", (D,), 0.1, 1.0), torch.float32)

    def forward(self, prefix: torch.Tensor, blocks: torch.Tensor, nb: int) -> torch.Tensor:
        """RMSNorm(mix of [blocks[:nb], prefix])."""
        return self.k.attn_res_mix(prefix, blocks, self.w, self.norm, self.eps, nb)

    def update_and_mix(self, base: torch.Tensor, delta: torch.Tensor, blocks: torch.Tensor, nb: int,
                       reset: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(new prefix, normalised mix) with prefix = delta if reset else base + delta: one op."""
        return self.k.res_mix(base, delta, blocks, self.w, self.norm, self.eps, nb, reset)


class KDAAttention(nn.Module):
    """Kimi Delta Attention for H local heads (KIMI_K3.md §1.4), vLLM's fused in_proj layout."""

    def __init__(self, cfg: KimiConfig, seed: Seeder, rt: Runtime) -> None:
        super().__init__()
        self.cfg, self.rt = cfg, rt
        D, d, Hf = cfg.hidden, cfg.kda_head_dim, cfg.kda_heads
        H, P, dt = cfg.kda_local_heads, cfg.kda_local_dim, cfg.torch_dtype
        std = D ** -0.5
        parts = [seed.sharded(n, (Hf * d, D), 0, std) for n in ("q_proj", "k_proj", "v_proj", "g_proj")]
        parts.append(seed.replicated("f_a_proj", (d, D), std))
        parts.append(seed.sharded("b_proj", (Hf, D), 0, std))
        pad = cfg.in_proj_rows - cfg.in_proj_used
        parts.append(torch.zeros(pad, D, device=seed.device))
        self.in_proj = _param(torch.cat(parts), dt)                                   # [R, D]
        self.f_b = _param(seed.sharded("f_b_proj", (Hf * d, d), 0, d ** -0.5), dt)     # [P, d]
        conv = [seed.sharded(n, (Hf * d, cfg.conv_kernel), 0, 0.5) for n in ("q_conv", "k_conv", "v_conv")]
        self.conv_w = _param(torch.cat(conv), torch.float32)                           # [3P, 4]
        self.dt_bias = _param(seed.sharded("dt_bias", (Hf * d,), 0, 0.5), torch.float32)
        a_log = torch.log(1 + 15 * torch.sigmoid(seed.sharded("A_log", (Hf,), 0)))   # log(1..16)
        self.a_log = _param(a_log, torch.float32)                                      # [H]
        self.o_norm = _param(seed.replicated("o_norm", (d,), 0.1, 1.0), dt)
        self.o_proj = _param(seed.sharded("o_proj", (D, Hf * d), 1, P ** -0.5 * cfg.tp ** -0.5), dt)
        B = cfg.batch
        self.register_buffer("conv_state", (seed.sharded("conv_state0", (B, 3, Hf * d, cfg.conv_kernel - 1), 2)
                                            .reshape(B, 3 * P, cfg.conv_kernel - 1).to(dt)))
        self.register_buffer("rec_state", seed.sharded("rec_state0", (B, Hf, d, d), 1, 0.05))
        self.k = ops.OpSet(cfg)
        # the torch functions by name, as before OpSet (fused.py calls them)
        self.fx = {name: ops.maybe_compiled(fn, cfg.compile_ops) for name, fn in
                   (("conv", ops.conv_update), ("rec", ops.kda_recurrence), ("norm", ops.gated_rms_norm))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg, k = self.cfg, self.k
        H, d, P = cfg.kda_local_heads, cfg.kda_head_dim, cfg.kda_local_dim
        with op_range("in_proj"):
            z = k.linear(x, self.in_proj)                                              # [M, R]
        qkv, gate_out = z[:, :3 * P], z[:, 3 * P:4 * P]
        f_a, beta_in = z[:, 4 * P:4 * P + d], z[:, 4 * P + d:4 * P + d + H]
        with op_range("f_b_proj"):
            f_b = k.linear(f_a, self.f_b)                                              # [M, P]
        with op_range("conv"):
            act = k.conv_(self.conv_state, qkv, self.conv_w, cfg.batch)                # [B, T, 3P]
        with op_range("kda_recurrence"):
            o = k.kda_(act, f_b, beta_in, self.dt_bias, self.a_log, self.rec_state,
                       cfg.gate_lower_bound, H)                                        # [M, H, d] fp32
        with op_range("o_norm"):
            o = k.gated_rms_norm(o, self.o_norm, gate_out, cfg.rms_eps, x.dtype)       # [M, P]
        with op_range("o_proj"):
            out = k.linear(o, self.o_proj)
        with op_range("all_reduce"):
            return self.rt.comm.all_reduce(out)


class MLAAttention(nn.Module):
    """Gated NoPE MLA for H local heads, decode with the absorbed latent cache (§1.5)."""

    def __init__(self, cfg: KimiConfig, seed: Seeder, rt: Runtime) -> None:
        super().__init__()
        self.cfg, self.rt = cfg, rt
        D, Hf, H, dt = cfg.hidden, cfg.mla_heads, cfg.mla_local_heads, cfg.torch_dtype
        nope, rope, vd, c = cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.qkv_a = _param(seed.replicated("qkv_a", (cfg.qkv_a_rows, D), D ** -0.5), dt)
        self.q_a_norm = _param(seed.replicated("q_a_norm", (cfg.q_lora_rank,), 0.1, 1.0), dt)
        self.kv_a_norm = _param(seed.replicated("kv_a_norm", (c,), 0.1, 1.0), dt)
        self.q_b = _param(seed.sharded("q_b", (Hf * (nope + rope), cfg.q_lora_rank), 0, cfg.q_lora_rank ** -0.5), dt)
        kv_b = seed.sharded("kv_b", (Hf * (nope + vd), c), 0, c ** -0.5).reshape(H, nope + vd, c)
        self.kv_b = _param(kv_b.reshape(H * (nope + vd), c), dt)       # kept for the un-absorbed check
        self.w_uk_t = _param(kv_b[:, :nope], dt)                       # [H, nope, c]: q_nope -> latent
        self.w_uv = _param(kv_b[:, nope:].transpose(1, 2), dt)         # [H, c, vd]: latent -> v
        self.g_proj = _param(seed.sharded("g_proj", (Hf * vd, D), 0, D ** -0.5), dt)
        self.o_proj = _param(seed.sharded("o_proj", (D, Hf * vd), 1, (H * vd) ** -0.5 * cfg.tp ** -0.5), dt)
        cache = seed.replicated("cache0", (cfg.batch, cfg.cache_len, c + rope))
        cache[:, :, :c] = F.rms_norm(cache[:, :, :c], (c,), self.kv_a_norm.float(), cfg.rms_eps)
        cache[:, cfg.context_len:] = 0                                 # not yet written
        self.register_buffer("cache", cache.to(dt))
        self.t_off = torch.arange(cfg.tokens_per_seq, device=seed.device)             # not state: no buffer
        self.fx = {name: ops.maybe_compiled(fn, cfg.compile_ops) for name, fn in
                   (("norms", ops.mla_norms), ("attend", ops.mla_attend), ("gate", ops.sigmoid_gate))}
        self.k = ops.OpSet(cfg)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cfg, fx = self.cfg, self.fx
        B, T, H = cfg.batch, cfg.tokens_per_seq, cfg.mla_local_heads
        nope, rope, c, ql = cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.kv_lora_rank, cfg.q_lora_rank
        with self.rt.aux.run(x) as side:
            with op_range("g_proj"):
                side.append(self.k.linear(x, self.g_proj))                             # [M, H*vd]
        with op_range("qkv_a"):
            a = self.k.linear(x, self.qkv_a)                                           # [M, ql+c+rope]
        with op_range("qkv_norm"):
            qa, ckv = self.k.mla_norms(a, self.q_a_norm, self.kv_a_norm, ql, c, cfg.rms_eps)
        with op_range("q_b_proj"):
            q = self.k.linear(qa, self.q_b).reshape(-1, H, nope + rope)                # [M, H, 192]
        with op_range("uk_bmm"):
            q_lat = torch.bmm(q[..., :nope].transpose(0, 1), self.w_uk_t).transpose(0, 1)  # [M, H, c]
        with op_range("kv_insert"):
            q_full = self.k.kv_insert(q_lat, q, ckv, a, ql + c, self.cache, pos, T)    # [B, T*H, c+rope]
        with op_range("mla_decode"):
            last = pos + self.t_off                                                    # [T] positions
            o_lat = fx["attend"](q_full, self.cache, last, H, c, (nope + rope) ** -0.5)  # [B, T*H, c]
        with op_range("uv_bmm"):
            o = torch.bmm(o_lat.reshape(B * T, H, c).transpose(0, 1), self.w_uv).transpose(0, 1)  # [M, H, vd]
        with op_range("gate_mul"):
            o = fx["gate"](o.reshape(B * T, -1), side[0])
        with op_range("o_proj"):
            out = self.k.linear(o, self.o_proj)
        with op_range("all_reduce"):
            return self.rt.comm.all_reduce(out)


class LatentMoE(nn.Module):
    """Router (fp32 sigmoid, correction bias for selection only), latent routed experts with
    TP-sliced intermediates, fused shared expert, and the vLLM tail (§1.6, §2.4 #11-22)."""

    def __init__(self, cfg: KimiConfig, seed: Seeder, rt: Runtime) -> None:
        super().__init__()
        self.cfg, self.rt = cfg, rt
        D, E, L, dt = cfg.hidden, cfg.num_experts, cfg.latent_dim, cfg.torch_dtype
        If, I, Ip = cfg.moe_intermediate, cfg.expert_local_inter, cfg.expert_local_inter_padded
        Sf = cfg.moe_intermediate * cfg.num_shared_experts
        self.router = _param(seed.replicated("gate", (E, D), D ** -0.5), dt)
        self.bias = _param(seed.replicated("e_score_correction_bias", (E,), 0.02), torch.float32)
        self.down = _param(seed.replicated("routed_expert_down_proj", (L, D), D ** -0.5), dt)
        self.latent_norm = _param(seed.replicated("routed_expert_norm", (L,), 0.1, 1.0), dt)
        self.up = _param(seed.replicated("routed_expert_up_proj", (D, L), L ** -0.5), dt)  # replicated
        sh = [seed.sharded(n, (Sf, D), 0, D ** -0.5) for n in ("shared_gate", "shared_up")]
        self.shared_gate_up = _param(torch.cat(sh), dt)                                # [2*Is, D] gate first
        self.shared_down = _param(seed.sharded("shared_down", (D, Sf), 1, Sf ** -0.5), dt)
        zpad = torch.zeros(E, Ip - I, L, device=seed.device)
        w1 = seed.sharded("w1", (E, If, L), 1, L ** -0.5)
        w3 = seed.sharded("w3", (E, If, L), 1, L ** -0.5)
        self.w13 = _param(torch.cat([w1, zpad, w3, zpad], dim=1), dt)                  # [E, 2*Ip, L]
        w2 = seed.sharded("w2", (E, L, If), 2, If ** -0.5)
        self.w2 = _param(torch.cat([w2, zpad.transpose(1, 2)], dim=2), dt)             # [E, L, Ip]
        self.expert_impl = cfg.expert_impl
        self.last_idx: torch.Tensor | None = None  # the latest routing, for byte counts in bench
        self.last_w: torch.Tensor | None = None    # and its weights (fused-vs-stock parity forces them)
        self.k = ops.OpSet(cfg)
        self.fx = {"situ": self.k.situ, "route": self.k.route, "experts": self.k.experts, "up": self.k.up}

    def _experts(self, z: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Unweighted expert outputs [M, K, L] (kept for fused.py, which finalizes itself)."""
        return ops.EXPERT_OUTPUTS[self.expert_impl](z, idx, self.w13, self.w2, self.cfg.situ_beta,
                                                    self.cfg.situ_linear_beta)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        cfg, fx, k = self.cfg, self.fx, self.k
        Is, n = cfg.shared_local_inter, cfg.row_shard
        with self.rt.aux.run(y) as side:
            with op_range("latent_down"):
                side.append(k.linear(y, self.down))                                    # [M, L]
        with op_range("router"):
            logits = k.linear(y, self.router, torch.float32)                           # [M, E] fp32
        with op_range("shared_expert"):
            sh = fx["situ"](k.linear(y, self.shared_gate_up), Is, cfg.situ_beta, cfg.situ_linear_beta)
            sh = k.linear(sh, self.shared_down)                                        # [M, D] partial
        with op_range("routing"):
            idx, w = fx["route"](logits, self.bias, cfg.top_k, cfg.routed_scaling)     # [M, K]
            self.last_idx, self.last_w = idx, w
        with op_range("experts"):
            r = fx["experts"](side[0], idx, w, self.w13, self.w2, cfg.situ_beta, cfg.situ_linear_beta)
        with op_range("moe_tail"):
            r = self.rt.comm.all_reduce(r)                                             # [M, L]
            sh = self.rt.comm.reduce_scatter_cols(sh)                                  # [M, D/tp]
        with op_range("up_proj"):
            rank = self.rt.comm.rank
            part = fx["up"](r, self.latent_norm, self.up[rank * n:(rank + 1) * n], sh, cfg.rms_eps)
        with op_range("moe_gather"):
            return self.rt.comm.all_gather_cols(part)


class DenseMLP(nn.Module):
    """Layer 0: SiTU GLU with intermediate 33792, column/row parallel, all-reduced."""

    def __init__(self, cfg: KimiConfig, seed: Seeder, rt: Runtime) -> None:
        super().__init__()
        self.cfg, self.rt = cfg, rt
        D, If = cfg.hidden, cfg.dense_intermediate
        gu = [seed.sharded(n, (If, D), 0, D ** -0.5) for n in ("gate_proj", "up_proj")]
        self.gate_up = _param(torch.cat(gu), cfg.torch_dtype)
        self.down = _param(seed.sharded("down_proj", (D, If), 1, If ** -0.5), cfg.torch_dtype)
        self.k = ops.OpSet(cfg)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        cfg, I, k = self.cfg, self.cfg.dense_local_inter, self.k
        with op_range("dense_gate_up"):
            h = k.linear(y, self.gate_up)
        with op_range("situ"):
            a = k.situ(h, I, cfg.situ_beta, cfg.situ_linear_beta)
        with op_range("dense_down"):
            out = k.linear(a, self.down)
        with op_range("all_reduce"):
            return self.rt.comm.all_reduce(out)


class DecoderLayer(nn.Module):
    """One K3 layer with Attention Residuals (KIMI_K3.md §1.3 steps 1-6)."""

    def __init__(self, cfg: KimiConfig, idx: int, seed: Seeder, rt: Runtime) -> None:
        super().__init__()
        self.idx, self.kind = idx, cfg.layer_kind(idx)
        blk = cfg.attn_res_block
        self.starts_block = idx % blk == 0
        self.block_slot = idx // blk
        self.nb_attn = math.ceil(idx / blk)                       # stored blocks the attention mix sees
        self.nb_mlp = self.nb_attn + int(self.starts_block)
        self.attn_res = AttnRes(cfg, seed.sub("self_attention_res"))
        self.mlp_res = AttnRes(cfg, seed.sub("mlp_res"))
        self.attn = (MLAAttention if self.kind == "mla" else KDAAttention)(cfg, seed.sub("attn"), rt)
        self.mlp = (DenseMLP if idx == 0 else LatentMoE)(cfg, seed.sub("mlp"), rt)

    def forward(self, m: torch.Tensor, prefix: torch.Tensor, blocks: torch.Tensor,
                pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with layer_range(self.idx, self.kind):
            with op_range("attn_res"):
                prefix, x = self.attn_res.update_and_mix(prefix, m, blocks, self.nb_attn, False)
                if self.starts_block:  # the mix above reads blocks[:nb_attn] only: slot is free
                    blocks[:, self.block_slot].copy_(prefix)
            a = self.attn(x, pos) if self.kind == "mla" else self.attn(x)
            with op_range("mlp_res"):
                prefix, y = self.mlp_res.update_and_mix(prefix, a, blocks, self.nb_mlp, self.starts_block)
            return self.mlp(y), prefix


class StockDecoder(nn.Module):
    """The layer slice `cfg.layers` of one rank; `forward` is one decode step.

    Inputs: `m` [M, D] the previous layer's MLP output (the token embedding when the slice
    starts at layer 0, with `prefix` zero), `prefix` [M, D] the running sum of the current
    AttnRes block, `blocks` [M, S, D] stored blocks (updated in place). Returns (m, prefix) of
    the last layer. The MLA position advances by T after the layers, wrapping back to
    `context_len` when the cache is full, so replays can run indefinitely.
    """

    def __init__(self, cfg: KimiConfig, rt: Runtime | None = None, device: torch.device | str = "cpu") -> None:
        super().__init__()
        device = torch.device(device)
        self.cfg = cfg
        self.rt = rt or Runtime(LocalComm(), SideStream(device))
        seed = Seeder(cfg, device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, seed.sub(f"layers.{i}"), self.rt) for i in cfg.layers)
        self.register_buffer("pos", torch.tensor([cfg.context_len], dtype=torch.long, device=device))

    def forward(self, m: torch.Tensor, prefix: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        with step_range():
            for layer in self.layers:
                m, prefix = layer(m, prefix, blocks, self.pos)
            if any(layer.kind == "mla" for layer in self.layers):
                T = cfg.tokens_per_seq
                nxt = self.pos + T
                self.pos.copy_(torch.where(nxt + T > cfg.cache_len, cfg.context_len, nxt))
        return m, prefix

    def make_inputs(self, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Random step inputs of realistic scale (hidden states with rms ~1)."""
        cfg, dev = self.cfg, self.pos.device
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed)
        M, D, S = cfg.rows, cfg.hidden, cfg.attn_res_slots
        m = torch.randn(M, D, generator=gen, device=dev)
        prefix = torch.zeros(M, D, device=dev) if cfg.layers[0] == 0 else torch.randn(M, D, generator=gen, device=dev)
        blocks = torch.randn(M, S, D, generator=gen, device=dev)
        dt = cfg.torch_dtype
        return m.to(dt), prefix.to(dt), blocks.to(dt)
