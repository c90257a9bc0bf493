"""Registry of decode-step implementations: adding one (e.g. fused) is one line here.

Each entry names a module attribute `Class(cfg, rt, device)` with the StockDecoder interface:
`forward(m, prefix, blocks)` is one step, `make_inputs(seed)` gives step inputs, `.layers[i]`
carry `.idx` and `.kind`.
"""
from __future__ import annotations

import importlib

VARIANTS: dict[str, str] = {
    "stock": "kimi_decode.stock:StockDecoder",
    "fused": "kimi_decode.fused:FusedDecoder",
}


def variant_class(name: str) -> type:
    """The decoder class registered as `name` (imported on first use)."""
    if name not in VARIANTS:
        raise KeyError(f"unknown variant {name!r}; known: {sorted(VARIANTS)}")
    module, attr = VARIANTS[name].split(":")
    return getattr(importlib.import_module(module), attr)
