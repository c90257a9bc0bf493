"""`decodescope capture`: profile a Kimi K3 decode step and write a self-describing trace."""
from __future__ import annotations

from pathlib import Path

import click

from cli.common import verbose_option, with_boundary
from tracer.errors import BadInput


def layers_option(text: str) -> tuple[int, ...]:
    from kimi_decode.config import parse_layers

    try:
        return parse_layers(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.command("capture")
@click.option("--variant", default="stock", show_default=True, help="Registered decode variant.")
@click.option("--preset", type=click.Choice(["k3_tp16", "tiny"]), default="k3_tp16", show_default=True)
@click.option("--batch", type=int, default=1, show_default=True, help="Sequences B (1..64).")
@click.option("--spec-tokens", type=int, default=0, show_default=True, help="Draft rows k (M = B(1+k)).")
@click.option("--layers", default="4-7", show_default=True, help="0-indexed layers, e.g. 4-7 (KDA,KDA,KDA,MLA).")
@click.option("--graph/--eager", default=True, show_default=True, help="Replay a CUDA graph or run eagerly.")
@click.option("--steps", type=int, default=3, show_default=True, help="Profiled steps (after warm-up).")
@click.option("--warmup", type=int, default=3, show_default=True,
              help="Eager steps before profiling; graph mode then also replays the captured graph "
                   "for 50 ms (a fresh graph's first replays can run 3-8 % slow).")
@click.option("--tp-sim/--no-tp-sim", default=None, help="Simulate TP collectives (default: on when tp > 1).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", default=None, help="cuda or cpu (default: cuda when present).")
@click.option("--backend", type=click.Choice(["pytorch", "cupti"]), default="pytorch", show_default=True,
              help="Trace source: the PyTorch profiler, or CUPTI's activity API directly (cupti-python, GPU only).")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="traces/NAME.json.gz")
@verbose_option
@with_boundary
def command(variant: str, preset: str, batch: int, spec_tokens: int, layers: str, graph: bool,
            steps: int, warmup: int, tp_sim: bool | None, seed: int, device: str | None, backend: str,
            out: str, verbose: bool) -> None:
    """Profile STEPS decode steps of VARIANT and write a Kineto trace with a `decodescope` object.

    \b
    Example:
      decodescope capture --variant stock --batch 8 --spec-tokens 0 --layers 4-7 \\
          --graph --steps 3 --out traces/k3_stock_b8_k0_graph.json.gz
    """
    from kimi_decode.config import PRESETS
    from kimi_decode.variants import VARIANTS
    from tracer.capture import capture

    if backend == "cupti":  # fails fast (exit 2) without a GPU or cupti-python, before building
        from tracer.capture_cupti import capture_cupti, load_cupti, require_gpu

        require_gpu(device)
        load_cupti()
        capture = capture_cupti
    if device is not None and device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise BadInput(f"--device {device}", "no CUDA GPU on this machine (use --device cpu)")
    if variant not in VARIANTS:
        raise BadInput(variant, f"unknown variant; known: {', '.join(sorted(VARIANTS))}")
    try:
        cfg = PRESETS[preset](batch=batch, spec_tokens=spec_tokens, layers=layers_option(layers), seed=seed)
        if tp_sim is None:
            tp_sim = cfg.tp > 1
        cfg = cfg.with_(tp_sim=tp_sim)
    except ValueError as exc:
        raise BadInput(out, f"bad configuration: {exc}") from None
    meta = capture(variant, cfg, graph=graph, steps=steps, out=Path(out), warmup=warmup, device=device)
    click.echo(f"wrote {out}: {meta['gpu']}, graph={meta['graph_mode']}, tp_sim={meta['tp_sim']}, "
               f"map={len(meta['graph_capture_map'])} kernels (matched={meta['graph_capture_map_matched']}), "
               f"comm_streams={meta['comm_streams']}")
