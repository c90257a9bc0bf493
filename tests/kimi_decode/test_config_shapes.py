"""The K3 TP16 slice has the per-rank shapes of KIMI_K3.md §1.8 and the published layer pattern.

Oracle: the numbers are copied from the document's tables (and its 1-indexed
`full_attn_layers` list), not from our code; the model is built on the meta device, so the
real-size layout is checked on a CPU without allocating its 20 GB.
"""
from __future__ import annotations

import pytest

from kimi_decode.config import k3_tp16, parse_layers, tiny
from kimi_decode.stock import StockDecoder


def test_layer_pattern_is_the_published_one():
    cfg = k3_tp16()
    kinds = [cfg.layer_kind(i) for i in range(93)]
    mla = [i for i, k in enumerate(kinds) if k == "mla"]
    assert mla == list(range(3, 92, 4)) + [92]          # 0-indexed 3, 7, ..., 91 and 92
    assert len(mla) == 24 and kinds.count("kda") == 68 and kinds[0] == "dense"   # 69 KDA incl. layer 0


def test_k3_tp16_parameter_and_state_shapes():
    cfg = k3_tp16(batch=2, layers=(0, 1, 2, 3))
    model = StockDecoder(cfg, device="meta")
    shapes = {n: tuple(t.shape) for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    want = {
        "layers.1.attn.in_proj": (3216, 7168), "layers.1.attn.f_b": (768, 128),
        "layers.1.attn.conv_w": (2304, 4), "layers.1.attn.dt_bias": (768,), "layers.1.attn.a_log": (6,),
        "layers.1.attn.o_norm": (128,), "layers.1.attn.o_proj": (7168, 768),
        "layers.1.attn.conv_state": (2, 2304, 3), "layers.1.attn.rec_state": (2, 6, 128, 128),
        "layers.3.attn.qkv_a": (2112, 7168), "layers.3.attn.q_b": (1152, 1536),
        "layers.3.attn.kv_b": (1536, 512), "layers.3.attn.w_uk_t": (6, 128, 512),
        "layers.3.attn.w_uv": (6, 512, 128), "layers.3.attn.g_proj": (768, 7168),
        "layers.3.attn.o_proj": (7168, 768), "layers.3.attn.cache": (2, 4096 + 64, 576),
        "layers.1.mlp.router": (896, 7168), "layers.1.mlp.bias": (896,),
        "layers.1.mlp.down": (3584, 7168), "layers.1.mlp.up": (7168, 3584),
        "layers.1.mlp.shared_gate_up": (768, 7168), "layers.1.mlp.shared_down": (7168, 384),
        "layers.1.mlp.w13": (896, 512, 3584), "layers.1.mlp.w2": (896, 3584, 256),
        "layers.0.mlp.gate_up": (4224, 7168), "layers.0.mlp.down": (7168, 2112),
        "layers.1.attn_res.w": (7168,), "layers.1.mlp_res.norm": (7168,),
    }
    for name, shape in want.items():
        assert shapes[name] == shape, name


def test_run_parameters_are_checked():
    assert k3_tp16(batch=4, spec_tokens=7).rows == 32
    assert parse_layers("4-7") == (4, 5, 6, 7) and parse_layers("3,4") == (3, 4)
    for bad in (dict(batch=0), dict(batch=65), dict(layers=(4, 6)), dict(layers=tuple(range(13))),
                dict(layers=(93,)), dict(expert_impl="dense")):
        with pytest.raises(ValueError):
            k3_tp16(**bad)
    with pytest.raises(ValueError):
        tiny(tp=3)
