"""An independent float64 reference of one K3 decode step, written from KIMI_K3.md alone.

It shares nothing with kimi_decode.stock but the weights (read by name and un-fused here) and
uses other formulas where K3 offers two: the KDA update in its matrix form
S = (I - β k kᵀ) Diag(e^g) S + β k vᵀ, MLA un-absorbed (k_nope and v expanded from kv_b per
cached token), routing by a per-row argsort, experts and conv taps as explicit loops.
Collectives: tp = 1 (identity) or `sim_world` > 1 meaning tp_sim on rank `rank` (the other
ranks contribute zero partials and zero gathered slices), as kimi_decode.comm.SimComm defines.
Also used by the GPU job to check the real-size stock layer.
"""
from __future__ import annotations

import math

import torch

F64 = torch.float64
LAZY = ("mlp.w13", "mlp.w2")


def rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w.to(F64)


def situ(g: torch.Tensor, u: torch.Tensor, b: float, bl: float) -> torch.Tensor:
    return b * torch.tanh(g / b) / (1 + torch.exp(-g)) * bl * torch.tanh(u / bl)


class Reference:
    """Float64 copy of a StockDecoder's weights and state, stepped with the K3 formulas."""

    def __init__(self, model: torch.nn.Module, sim_world: int = 1, rank: int = 0) -> None:
        self.cfg = cfg = model.cfg
        self.sim_world, self.rank = sim_world, rank
        self.layers = []
        for layer in model.layers:
            # expert stacks stay in their dtype (GBs at K3 size): rows are upcast when used
            p = {k: v.detach() if k in LAZY else v.detach().to(F64).clone() for k, v in layer.named_parameters()}
            st = {k: v.detach().to(F64).clone() for k, v in layer.named_buffers()}
            self.layers.append((layer.idx, layer.kind, p, st))
        self.pos = int(model.pos.item())
        self.routes: list[torch.Tensor] = []  # own choice of experts per MoE row, in call order
        # Expert sets to use instead of the own choice (one per MoE row, in call order): lets a
        # bf16 run be compared on its own routing, where a near-tie can flip one expert.
        self.forced: list[torch.Tensor] = []

    # --- pieces -------------------------------------------------------------------------
    def attn_res(self, sources: list[torch.Tensor], w_fused: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        eps = self.cfg.rms_eps
        scores = torch.stack([rms(v, None, eps) @ w_fused for v in sources], dim=-1)   # [M, S]
        p = torch.exp(scores - scores.max(-1, keepdim=True).values)
        p = p / p.sum(-1, keepdim=True)
        mix = sum(p[:, i:i + 1] * v for i, v in enumerate(sources))
        return rms(mix, norm, eps)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x  # tp = 1, or tp_sim: the other partials are zero

    def kda(self, p: dict, st: dict, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        B, T, H, d, P = cfg.batch, cfg.tokens_per_seq, cfg.kda_local_heads, cfg.kda_head_dim, cfg.kda_local_dim
        W = p["attn.in_proj"]
        Wq, Wk, Wv, Wg = (W[i * P:(i + 1) * P] for i in range(4))
        Wfa, Wb = W[4 * P:4 * P + d], W[4 * P + d:4 * P + d + H]
        conv_w = p["attn.conv_w"]                                     # [3P, 4]
        out = torch.zeros(B * T, P, dtype=F64, device=x.device)
        for b in range(B):
            hist = st["attn.conv_state"][b].clone()                   # [3P, 3] previous inputs
            S = st["attn.rec_state"][b].clone()                       # [H, d, d]
            for t in range(T):
                xr = x[b * T + t]
                pre = torch.cat([Wq @ xr, Wk @ xr, Wv @ xr])           # [3P]
                window = torch.cat([hist, pre[:, None]], dim=1)       # [3P, 4], oldest first
                conv = sum(conv_w[:, j] * window[:, j] for j in range(cfg.conv_kernel))
                hist = window[:, 1:]
                act = conv * torch.sigmoid(conv)
                q, k, v = act[:P].view(H, d), act[P:2 * P].view(H, d), act[2 * P:].view(H, d)
                fb = p["attn.f_b"] @ (Wfa @ xr)                        # [P]
                beta = torch.sigmoid(Wb @ xr)                          # [H]
                gate = torch.sigmoid(Wg @ xr).view(H, d)
                o = torch.zeros(H, d, dtype=F64, device=x.device)
                for h in range(H):
                    qh = q[h] / max(q[h].norm(), 1e-6) / math.sqrt(d)
                    kh = k[h] / max(k[h].norm(), 1e-6)
                    A = torch.exp(p["attn.a_log"][h])
                    g = cfg.gate_lower_bound * torch.sigmoid(A * (fb[h * d:(h + 1) * d] + p["attn.dt_bias"][h * d:(h + 1) * d]))
                    S[h] = (torch.eye(d, dtype=F64, device=x.device) - beta[h] * torch.outer(kh, kh)) @ torch.diag(torch.exp(g)) @ S[h] \
                        + beta[h] * torch.outer(kh, v[h])
                    o[h] = rms(S[h].T @ qh, p["attn.o_norm"], cfg.rms_eps) * gate[h]
                out[b * T + t] = o.reshape(P)
            st["attn.conv_state"][b] = hist
            st["attn.rec_state"][b] = S
        return self.all_reduce(out @ p["attn.o_proj"].T)

    def mla(self, p: dict, st: dict, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        B, T, H = cfg.batch, cfg.tokens_per_seq, cfg.mla_local_heads
        nope, rope, c, ql, vd = cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.kv_lora_rank, cfg.q_lora_rank, cfg.v_head_dim
        kv_b = p["attn.kv_b"].view(H, nope + vd, c)
        out = torch.zeros(B * T, H * vd, dtype=F64, device=x.device)
        cache = st["attn.cache"]
        for b in range(B):
            for t in range(T):
                xr = x[b * T + t]
                a = p["attn.qkv_a"] @ xr
                qa = rms(a[:ql], p["attn.q_a_norm"], cfg.rms_eps)
                ckv, kpe = rms(a[ql:ql + c], p["attn.kv_a_norm"], cfg.rms_eps), a[ql + c:]
                cache[b, self.pos + t] = torch.cat([ckv, kpe])
                q = (p["attn.q_b"] @ qa).view(H, nope + rope)
                n = self.pos + t + 1                                   # causal: cached + this row
                lat, pe = cache[b, :n, :c], cache[b, :n, c:]
                gate = torch.sigmoid(p["attn.g_proj"] @ xr).view(H, vd)
                for h in range(H):
                    k_nope = lat @ kv_b[h, :nope].T                    # un-absorbed [n, nope]
                    v = lat @ kv_b[h, nope:].T                          # [n, vd]
                    s = (k_nope @ q[h, :nope] + pe @ q[h, nope:]) / math.sqrt(nope + rope)
                    w = torch.softmax(s, 0)
                    out[b * T + t, h * vd:(h + 1) * vd] = (w @ v) * gate[h]
        return self.all_reduce(out @ p["attn.o_proj"].T)

    def moe(self, p: dict, y: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        I, Ip, Is, K = cfg.expert_local_inter, cfg.expert_local_inter_padded, cfg.shared_local_inter, cfg.top_k
        r = torch.zeros(y.shape[0], cfg.latent_dim, dtype=F64, device=y.device)
        for i, yr in enumerate(y):
            s = torch.sigmoid(p["mlp.router"] @ yr)
            chosen = torch.argsort(s + p["mlp.bias"], descending=True)[:K]
            self.routes.append(chosen)
            if self.forced:
                chosen = self.forced.pop(0).to(chosen.device)
            wts = s[chosen] / s[chosen].sum() * cfg.routed_scaling
            z = p["mlp.down"] @ yr
            for e, wt in zip(chosen.tolist(), wts):
                w1, w3 = p["mlp.w13"][e, :I].to(F64), p["mlp.w13"][e, Ip:Ip + I].to(F64)
                w2 = p["mlp.w2"][e, :, :I].to(F64)
                r[i] += wt * (w2 @ situ(w1 @ z, w3 @ z, cfg.situ_beta, cfg.situ_linear_beta))
        r = rms(self.all_reduce(r), p["mlp.latent_norm"], cfg.rms_eps)
        gu = y @ p["mlp.shared_gate_up"].T
        sh = situ(gu[:, :Is], gu[:, Is:], cfg.situ_beta, cfg.situ_linear_beta) @ p["mlp.shared_down"].T
        full = r @ p["mlp.up"].T + sh
        if self.sim_world == 1:
            return full
        n = cfg.hidden // self.sim_world                                # this rank's rows survive the gather
        out = torch.zeros_like(full)
        out[:, self.rank * n:(self.rank + 1) * n] = full[:, self.rank * n:(self.rank + 1) * n]
        return out

    def dense(self, p: dict, y: torch.Tensor) -> torch.Tensor:
        cfg, I = self.cfg, self.cfg.dense_local_inter
        gu = y @ p["mlp.gate_up"].T
        return self.all_reduce(situ(gu[:, :I], gu[:, I:], cfg.situ_beta, cfg.situ_linear_beta) @ p["mlp.down"].T)

    # --- one step (KIMI_K3.md §1.3) -----------------------------------------------------
    def step(self, m: torch.Tensor, prefix: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cfg, blk = self.cfg, self.cfg.attn_res_block
        m, prefix, blocks = m.to(F64), prefix.to(F64), blocks.to(F64).clone()
        for idx, kind, p, st in self.layers:
            prefix = prefix + m
            if idx % blk == 0:
                blocks[:, idx // blk] = prefix
            nb = math.ceil(idx / blk)
            x = self.attn_res([blocks[:, j] for j in range(nb)] + [prefix],
                              p["attn_res.w"], p["attn_res.norm"])
            a = self.mla(p, st, x) if kind == "mla" else self.kda(p, st, x)
            prefix = a if idx % blk == 0 else prefix + a
            nb2 = nb + int(idx % blk == 0)
            y = self.attn_res([blocks[:, j] for j in range(nb2)] + [prefix], p["mlp_res.w"], p["mlp_res.norm"])
            m = self.dense(p, y) if idx == 0 else self.moe(p, y)
        T = cfg.tokens_per_seq
        if any(kind == "mla" for _, kind, _, _ in self.layers):
            self.pos = cfg.context_len if self.pos + 2 * T > cfg.cache_len else self.pos + T
        return m, prefix, blocks
