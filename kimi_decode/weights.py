"""Seeded random weights whose tp-shards are exact slices of the tp = 1 weights.

A sharded tensor is generated in `cfg.weight_chunks` equal chunks along its sharded dimension,
each from its own generator seeded by (seed, name, chunk); rank r of tp takes chunks
[r·C/tp, (r+1)·C/tp). So the K3 TP16 rank generates only its 1/16 (no full-size tensor ever
exists), and a tiny tp = 2 model holds exactly the halves of the tiny tp = 1 model. Chunks
align with heads because weight_chunks divides the head counts (config check).
No hub downloads: scales are "realistic" (std fan_in^-1/2, norms near 1), values random.
"""
from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from kimi_decode.config import KimiConfig


class Seeder:
    """Makes named tensors for one rank, on one device, reproducibly."""

    def __init__(self, cfg: KimiConfig, device: torch.device, prefix: str = "") -> None:
        self.cfg, self.device, self.prefix = cfg, device, prefix

    def sub(self, prefix: str) -> "Seeder":
        return Seeder(self.cfg, self.device, f"{self.prefix}{prefix}.")

    def _randn(self, key: str, shape: Sequence[int]) -> torch.Tensor:
        if self.device.type == "meta":  # shapes only (tests of the real K3 layout on a CPU)
            return torch.empty(tuple(shape), device="meta")
        gen = torch.Generator(device=self.device)
        gen.manual_seed(zlib.crc32(f"{self.cfg.seed}/{self.prefix}{key}".encode()))
        return torch.randn(tuple(shape), generator=gen, device=self.device, dtype=torch.float32)

    def replicated(self, name: str, shape: Sequence[int], std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        """The same fp32 tensor on every rank."""
        return self._randn(f"{name}/R", shape) * std + mean

    def sharded(self, name: str, shape: Sequence[int], dim: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        """This rank's slice of a tensor whose FULL shape is `shape`, split along `dim` (fp32)."""
        chunks, tp, rank = self.cfg.weight_chunks, self.cfg.tp, self.cfg.rank
        if shape[dim] % chunks:
            raise ValueError(f"{name}: dim {dim} of {tuple(shape)} not divisible by {chunks} chunks")
        per = chunks // tp
        chunk_shape = list(shape)
        chunk_shape[dim] //= chunks
        parts = [self._randn(f"{name}/{c}", chunk_shape) for c in range(rank * per, (rank + 1) * per)]
        return torch.cat(parts, dim=dim) * std + mean
