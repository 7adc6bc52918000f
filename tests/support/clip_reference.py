"""The consensus mean's per-chunk clip, computed plainly from dense updates (a test reference for
`codec.aggregate.chunk_clip` and every strategy that clips chunk by chunk)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from codec.chunking import ChunkLayout


def chunk_clipped_mean(dense: Sequence[torch.Tensor], layout: ChunkLayout) -> torch.Tensor:
    """One tensor's mean over `dense` updates (float64, its shape): in every chunk each update
    scaled to at most the lower median of the chunk's norms over the updates, the chunk's sum
    divided by the count in which each counts min(norm, median) / median."""
    out = []
    for gi in range(len(layout.groups)):
        chunks = torch.stack([layout.split(d.double())[gi] for d in dense])  # (P, C, S)
        norms = chunks.norm(dim=2)  # (P, C)
        median = norms.sort(0).values[(len(dense) - 1) // 2]
        factor = torch.where(norms > median, median / norms, 1.0)
        count = (torch.minimum(norms, median) / median).sum(0)
        out.append((chunks * factor[..., None]).sum(0) / count[:, None])
    return layout.merge(out)
