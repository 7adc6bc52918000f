"""Updates on a shared support (`sparseloco-mask`, SCAPE's idea in this protocol).

Every chunk carries ``s_g`` *shared* values, at positions every honest node derives alike from
data it holds bit for bit (`shared_support`), so they need no index, followed by ``k_g`` *fresh*
entries of the sender's own Top-k outside that support, with their indices (so the support can
move). On the wire (`codec.wire`, frame ``TSRM``) a chunk's value codes are its shared values in
ascending position order, then its fresh values in ascending position order; the index stream of
each group holds only the fresh positions.

The support of a window is a pure function of the previous window's aggregate ``m`` (the mean
every node applied) and a 64-bit seed derived from it and the run: per chunk, the ``s_g - x_g``
positions of largest ``|m|`` (ties: a pseudo-random order), then ``x_g`` *exploration* positions
drawn pseudo-randomly from the rest, ``x_g = round(explore * s_g)``. The pseudo-random order is
`mix64` of (seed, position), integer arithmetic only, so every machine gets the same support.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from codec.chunking import ChunkLayout, group_k
from codec.compress import Compressor, SparseGroup, SparseTensor, topk_rows
from codec.errors import DecodeError
from codec.quantize import dequantize, quantize_bits, validate
from codec.spec import CodecParams

__all__ = [
    "MaskCompressor",
    "MaskedTensor",
    "mix64",
    "shared_counts",
    "shared_support",
    "support_digest",
]

_GOLDEN, _M1, _M2 = (
    np.uint64(0x9E3779B97F4A7C15),
    np.uint64(0xBF58476D1CE4E5B9),
    np.uint64(0x94D049BB133111EB),
)


def mix64(x: np.ndarray, seed: int) -> np.ndarray:
    """SplitMix64 finaliser of ``x ^ seed`` (uint64 in, uint64 out): a keyed pseudo-random map."""
    with np.errstate(over="ignore"):
        z = (x.astype(np.uint64) ^ np.uint64(seed)) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def shared_counts(layout: ChunkLayout, params: CodecParams, shared_k: int) -> list[int]:
    """Shared values per chunk of each group (the fresh Top-k of a group is its ``k``).

    A group keeps ``shared_k`` scaled to its chunk size like ``k`` (`codec.chunking`); a 1-D
    tensor shorter than one chunk keeps ``shared_k``; never more than the chunk has room for."""
    out = []
    for g in layout.groups:
        if shared_k == 0:
            out.append(0)
            continue
        short = len(layout.shape) == 1 and g.chunk_size < params.chunk_size
        want = shared_k if short else group_k(shared_k, g.chunk_size, params.chunk_size)
        out.append(min(want, g.chunk_size - g.k))
    return out


@dataclass
class MaskedTensor:
    """One tensor's update on a shared support, as decoded (the support not yet applied).

    ``groups[i].idx``: fresh positions (n_chunks, k_g), ascending per row; ``groups[i].codes``:
    (n_chunks, shared[i] + k_g) value codes, shared slots first; ``scales`` and ``codebook`` as in
    `codec.compress.SparseTensor`. ``digest``: the support it was made for (`support_digest`).
    """

    name: str
    shape: tuple[int, ...]
    groups: list[SparseGroup]
    codebook: torch.Tensor
    shared: tuple[int, ...]
    digest: bytes

    def validate(self, params: CodecParams) -> None:
        """`DecodeError` unless well formed for its shape under ``params`` (support aside)."""
        try:
            layout = ChunkLayout.for_shape(self.shape, params)
        except (TypeError, ValueError) as exc:
            raise DecodeError(f"{self.name}: bad shape {self.shape}: {exc}") from exc
        if len(self.groups) != len(layout.groups) or len(self.shared) != len(layout.groups):
            raise DecodeError(f"{self.name}: groups do not match the chunk layout")
        for gi, (g, sg, s) in enumerate(zip(layout.groups, self.groups, self.shared, strict=True)):
            n, k = g.n_chunks, g.k
            idx = sg.idx
            if idx.dtype != torch.int64 or tuple(idx.shape) != (n, k):
                raise DecodeError(f"{self.name} group {gi}: fresh idx must be int64 {(n, k)}")
            if tuple(sg.codes.shape) != (n, s + k) or tuple(sg.scales.shape) != (n,):
                raise DecodeError(f"{self.name} group {gi}: codes or scales do not fit")
            if n and (int(idx.min()) < 0 or int(idx.max()) >= g.chunk_size):
                raise DecodeError(f"{self.name} group {gi}: position outside the chunk")
            if n and k > 1 and not bool((idx[:, 1:] > idx[:, :-1]).all()):
                raise DecodeError(f"{self.name} group {gi}: fresh positions not ascending")
            try:
                validate(
                    sg.codes, sg.scales, self.codebook, params.max_abs_value, params.value_bits
                )
            except DecodeError as exc:
                raise DecodeError(f"{self.name} group {gi}: {exc}") from exc

    def resolve(self, support: Sequence[torch.Tensor]) -> SparseTensor:
        """The same entries as a `SparseTensor` (positions merged ascending, codes with them),
        given the shared positions (n_chunks, shared[i]) of each group; `DecodeError` if a
        fresh entry lies on the shared support."""
        if len(support) != len(self.groups):
            raise DecodeError(f"{self.name}: support has {len(support)} groups")
        groups = []
        for s_idx, sg, s in zip(support, self.groups, self.shared, strict=True):
            if tuple(s_idx.shape) != (sg.idx.shape[0], s):
                raise DecodeError(f"{self.name}: support does not match the update's layout")
            pos = torch.cat([s_idx.to(sg.idx.device), sg.idx], 1)
            order = torch.argsort(pos, dim=1, stable=True)
            merged = torch.gather(pos, 1, order)
            if merged.shape[1] > 1 and not bool((merged[:, 1:] > merged[:, :-1]).all()):
                raise DecodeError(f"{self.name}: a fresh entry lies on the shared support")
            groups.append(SparseGroup(merged, torch.gather(sg.codes, 1, order), sg.scales))
        return SparseTensor(self.name, self.shape, groups, self.codebook)

    def values(self) -> list[torch.Tensor]:
        return [dequantize(g.codes, g.scales, self.codebook) for g in self.groups]


def shared_support(
    last: torch.Tensor, layout: ChunkLayout, counts: Sequence[int], explore: float, seed: int
) -> list[torch.Tensor]:
    """The shared positions (n_chunks, counts[i]) int64, ascending per row, of each group of
    ``layout``, from the previous aggregate ``last`` of that tensor (see module docstring)."""
    out = []
    chunks = layout.split(last.detach().to("cpu", torch.float32))
    offset = 0  # element offset of the group: every position gets its own noise
    for g, rows, s in zip(layout.groups, chunks, counts, strict=True):
        n, c = g.n_chunks, g.chunk_size
        if s == 0:
            out.append(torch.zeros(n, 0, dtype=torch.int64))
            offset += n * c
            continue
        explored = min(s, int(explore * s + 0.5))
        flat = np.arange(offset, offset + n * c, dtype=np.uint64)
        noise = torch.from_numpy((mix64(flat, seed) >> np.uint64(1)).astype(np.int64)).view(n, c)
        by_noise = torch.argsort(noise, dim=1, stable=True)
        mags = torch.gather(rows.abs(), 1, by_noise)  # rank by |m|, ties in noise order
        ranked = torch.gather(by_noise, 1, torch.argsort(-mags, dim=1, stable=True))
        chosen = torch.zeros(n, c, dtype=torch.bool)
        chosen.scatter_(1, ranked[:, : s - explored], True)
        rest = torch.gather(chosen, 1, by_noise)  # exploration: the rest, in noise order
        picks = torch.argsort(rest.to(torch.int8), dim=1, stable=True)[:, :explored]
        chosen.scatter_(1, torch.gather(by_noise, 1, picks), True)
        out.append(chosen.nonzero()[:, 1].view(n, s))
        offset += n * c
    return out


def support_digest(supports: Sequence[Sequence[torch.Tensor]]) -> bytes:
    """BLAKE2b-256 of every tensor's shared positions, in order (what an update names)."""
    h = hashlib.blake2b(digest_size=32)
    for groups in supports:
        for s in groups:
            h.update(np.ascontiguousarray(s.to("cpu", torch.int64).numpy(), dtype="<i8").tobytes())
            h.update(b"|")
    return h.digest()


class MaskCompressor(Compressor):
    """SparseLoCo's error feedback, sending each chunk's values on a given shared support plus
    the Top-k of the rest (`MaskedTensor`). Buffers and their state are `Compressor`'s."""

    def compress_masked(
        self,
        name: str,
        delta: torch.Tensor,
        beta: float,
        freeze: bool,
        support: Sequence[torch.Tensor],
        digest: bytes,
    ) -> MaskedTensor:
        """Fold ``delta`` into the buffer of ``name`` (not while ``freeze``: then ``delta`` alone
        is sent and the buffer left alone), send ``support``'s values and the fresh Top-k."""
        delta = self._checked(name, delta, beta)
        layout = self.layouts[name]
        fresh, values, positions = [], [], []
        for g, rows, buf, s_idx in zip(
            layout.groups, layout.split(delta), self._ef[name], support, strict=True
        ):
            src = rows if freeze else buf.mul_(beta).add_(rows)
            s_idx = s_idx.to(src.device)
            taken = torch.zeros(src.shape, dtype=torch.bool, device=src.device)
            taken.scatter_(1, s_idx, True)
            rest = (~taken).nonzero()[:, 1].view(g.n_chunks, -1)
            pos, kept = topk_rows(torch.gather(src, 1, rest).contiguous(), g.k)
            fresh.append(torch.gather(rest, 1, pos))
            values.append(torch.cat([torch.gather(src, 1, s_idx), kept], 1))
            positions.append(torch.cat([s_idx, fresh[-1]], 1))
        q = quantize_bits(values, self.params.max_abs_value, self.params.value_bits)
        groups = [SparseGroup(i, c, s) for i, c, s in zip(fresh, q.codes, q.scales, strict=True)]
        shared = tuple(int(s.shape[1]) for s in support)
        piece = MaskedTensor(name, layout.shape, groups, q.codebook, shared, digest)
        if not freeze:
            for buf, pos, v, dq in zip(
                self._ef[name], positions, values, piece.values(), strict=True
            ):
                buf.scatter_(1, pos, v - dq)
        return piece
