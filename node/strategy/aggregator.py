"""The window's aggregate: the validated, median-clipped mean of the applied updates.

One `Aggregator` per node and device (`node.strategy.make_strategy`; a sharded peer's rank 0
takes `Aggregator.on` its host), over the run's `node.strategy.format.UpdateFormat`. `mean` is
the consensus rule of docs/consensus.md: every update validated strictly, clipped to the lower
median of the window's norms, summed in ascending uid order and divided by the updates' count in
which each counts ``min(norm, B) / B`` (a null update counts 0 and dilutes nothing). Chunked
sparse strategies (SparseLoCo, DeMo, the shared mask: the format's `clips_chunks`) apply it
**chunk by chunk** (`codec.aggregate.chunk_clip`): in every chunk each update's part is scaled to
at most the lower median ``B_c`` of the parts' norms there, and the chunk divided by its own
count. The others (DiLoCo, GreedyLore) apply it to whole updates (`codec.aggregate.clip_factors`,
`mean_divisor`). Norms are exact and order-free. A strategy may sum in its own domain and map the
sum back at the end (DeMo: DCT coefficients, then the inverse DCT; GreedyLore: ``R̄``, then
``P R̄``). The run's outer step (`node.strategy.outer`) then applies the mean.

Hence one update's share of the step is at most ``α · B / N'`` in L2 norm (times the Nesterov
amplification ``1 / (1 − μ)`` in the limit), where ``N' > N / 2`` is the divisor (more than half
the ``N`` updates applied count fully); per chunk, at most ``α · B_c / N'_c`` in every chunk, so
an update cannot put its whole norm into the few chunks a targeted change needs. With ``N = 1``
the update is its own bound and is still bounded by the value cap. Raising a bound above every
honest norm takes a strict majority.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from codec.aggregate import (
    add_support,
    chunk_clip,
    clip_factors,
    divide_chunks,
    divide_exactly,
    keep_supported,
    mean_divisor,
)
from codec.chunking import ChunkLayout
from codec.errors import DecodeError
from node.strategy.format import Factor, Update, UpdateFormat


class Aggregator:
    """The window's mean of one run's updates on one device (see the module docstring)."""

    def __init__(self, fmt: UpdateFormat, device: torch.device | str = "cpu") -> None:
        self.format, self.device = fmt, torch.device(device)
        self.run, self.spec = fmt.run, fmt.spec

    def on(self, device: torch.device | str) -> Aggregator:
        """The same aggregator (its format and any state they share) summing on ``device``."""
        other = copy.copy(self)
        other.device = torch.device(device)
        return other

    def mean(self, updates: Mapping[Any, Update]) -> dict[str, torch.Tensor]:
        """The validated, clipped mean of a window's updates in ascending key order
        (zeros when there are none); a tensor an update leaves out counts as zero for it.

        Two passes that each look at one update at a time (validate and norm, then sum), so a
        lazy mapping (`node.window.gather.Pieces`) never has two decoded at once. Chunked
        formats clip chunk by chunk, the others whole updates (the module docstring)."""
        fmt = self.format
        keys = sorted(updates)
        norms: list[float] = []
        chunks: list[dict[str, list[torch.Tensor]]] = []
        for key in keys:
            peer = self.checked(updates[key])
            if fmt.clips_chunks:
                chunks.append({name: fmt.chunk_norms(piece) for name, piece in peer.items()})
            else:
                norms.append(fmt.norm(list(peer.values())))
        sums = self._zeros()
        if fmt.clips_chunks:
            self._sum_chunk_clipped(sums, keys, updates, chunks)
        else:
            self._sum_clipped(sums, keys, updates, norms)
        return self._finish_mean(sums)

    def checked(self, update: Update) -> dict[str, Any]:
        """An update's pieces by tensor name, each validated (`DecodeError` otherwise)."""
        peer = self._by_name(update)
        for piece in peer.values():
            self.format.validate(piece)
        return peer

    def _sum_clipped(
        self,
        sums: dict[str, torch.Tensor],
        keys: list[Any],
        updates: Mapping[Any, Update],
        norms: list[float],
    ) -> None:
        """Whole updates clipped to the lower median norm, summed and divided."""
        factors, divisor = clip_factors(norms), mean_divisor(norms)
        for key, factor in zip(keys, factors, strict=True):
            for name, piece in self._by_name(updates[key]).items():
                self._accumulate(sums, name, piece, factor)
        if divisor > 0:
            for t in sums.values():
                divide_exactly(t, divisor)

    def _sum_chunk_clipped(
        self,
        sums: dict[str, torch.Tensor],
        keys: list[Any],
        updates: Mapping[Any, Update],
        chunks: list[dict[str, list[torch.Tensor]]],
    ) -> None:
        """Every chunk clipped to the lower median of its parts' norms, summed and divided; with
        ``outer.min_support`` above 1, zero where fewer updates sent a value (in the domain the
        strategy sums in: DeMo's coefficients)."""
        layouts = {
            t.name: ChunkLayout.for_shape(t.shape, self.run.codec) for t in self.spec.tensors
        }
        clips = {
            name: chunk_clip([u.get(name) for u in chunks], [g.n_chunks for g in layout.groups])
            for name, layout in layouts.items()
        }
        support = self.run.outer.min_support
        counts = (
            {n: torch.zeros(t.shape, dtype=torch.uint8) for n, t in sums.items()}
            if support > 1
            else {}
        )
        for i, key in enumerate(keys):
            for name, piece in self._by_name(updates[key]).items():
                factors = clips[name].factors[i]
                assert factors is not None  # the update sends this tensor
                self._accumulate(sums, name, piece, factors)
                if support > 1:
                    add_support(counts[name], *self.format.entries(piece))
        for name, t in sums.items():
            divide_chunks(t, layouts[name], clips[name].divisors)
            if support > 1:
                keep_supported(t, counts[name], support)

    def _zeros(self) -> dict[str, torch.Tensor]:
        """The buffers `mean` sums into (by default one float32 zero tensor per tensor)."""
        return {
            t.name: torch.zeros(t.shape, dtype=torch.float32, device=self.device)
            for t in self.spec.tensors
        }

    def _accumulate(
        self, sums: dict[str, torch.Tensor], name: str, piece: Any, factor: Factor
    ) -> None:
        """How `mean` sums a piece (by default the format's `add_into`; a transform domain may
        differ)."""
        self.format.add_into(sums[name], piece, factor)

    def _finish_mean(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The mean in the parameters' domain from what `_accumulate` summed and divided."""
        return sums

    def _by_name(self, update: Update) -> dict[str, Any]:
        shapes = self.format.shapes
        out: dict[str, Any] = {}
        for piece in update:
            name = getattr(piece, "name", None)
            if not isinstance(name, str) or name not in shapes:
                raise DecodeError(f"unknown tensor {name!r}")
            if name in out:
                raise DecodeError(f"tensor {name!r} appears twice in one update")
            if tuple(piece.shape) != shapes[name]:
                raise DecodeError(f"{name}: shape {piece.shape} != {shapes[name]}")
            out[name] = piece
        return out
