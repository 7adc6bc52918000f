"""Compressed updates along a shared direction: what honest peers training on one model send,
each with its own small noise (for tests of the aggregate's bounds)."""

from __future__ import annotations

import torch

from codec.compress import Compressor, SparseTensor
from codec.spec import CodecParams, ModelSpec


def along(
    spec: ModelSpec,
    codec: CodecParams,
    seed: int,
    direction: dict[str, torch.Tensor],
    scale: float = 1.0,
) -> list[SparseTensor]:
    """``scale · (direction + 5e-4 · noise(seed))``, compressed per tensor (error feedback off)."""
    gen = torch.Generator().manual_seed(seed)
    comp = Compressor(spec, codec)
    return [
        comp.compress(
            t.name,
            scale * (direction[t.name] + 5e-4 * torch.randn(t.shape, generator=gen)),
            0.0,
            freeze=True,
        )
        for t in spec.tensors
    ]
