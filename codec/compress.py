"""Error feedback + chunked Top-k + 2-bit values, per tensor (SparseLoCo, Algorithm 1, lines 14-16).

For every tensor and outer step::

    e     <- beta * e + delta          # OuterEF accumulation
    d_hat <- Q(TopK_k(e)) per chunk    # what is transmitted (a `SparseTensor`)
    e     <- e - dequantize(d_hat)     # the quantization error stays in e

During the EF freeze (Appendix E) the buffer is neither used nor accumulated: ``delta`` itself is
compressed and ``e`` is left as it is (zero at the start of training).

The EF buffer of a tensor lives permanently in chunked layout: one contiguous
``(n_chunks, chunk_size)`` float32 buffer per chunk group (see `codec.chunking`). The update reads
the pseudo-gradient through strided tile views and writes the chunk rows directly, so Top-k
always runs on contiguous rows and no full-size copy of ``delta`` or ``e`` is ever made. Work is
done in blocks of whole chunks (a few MiB) so the temporaries stay in cache.

Top-k is exact: in every chunk the ``k_g`` entries of largest ``|e|``; among entries tied at the
threshold the lowest positions win. Positions come out sorted ascending per chunk. The selection
avoids a full sort: a lower bound on each chunk's k-th largest ``|e|`` (the k-th largest of the
maxima of ``2k`` strided bins: at least k entries reach it) leaves ~1.4k candidates per chunk,
whose exact k-th largest value is then found with `torch.topk` on a small padded matrix. Rows
crowded with candidates (more than 4k: ties, runs of zeros) take a dense path instead.

On a CUDA device (and with `triton` importable) the EF update and Top-k run as one Triton
program per chunk (`codec.gpu.select`) and the EF write-back as a Triton kernel
(`codec.gpu.scatter.feedback`), with the same results bit for bit. The quantiser runs on the
host for both paths: its statistics are float sums whose rounding depends on their order, so
that is the one way to get the same side bytes and codes from every device (the kept values,
k/C of the tensor, are copied there and back).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from codec import gpu
from codec.chunking import ChunkGroup, ChunkLayout
from codec.errors import DecodeError
from codec.quantize import dequantize, quantize_bits, validate
from codec.spec import CodecParams, ModelSpec

__all__ = [
    "BLOCK_ELEMENTS",
    "Compressor",
    "SparseGroup",
    "SparseTensor",
    "densify",
    "scatter_add",
    "topk_rows",
]

BLOCK_ELEMENTS = {"cpu": 1 << 21, "default": 1 << 25}
"""Elements of EF buffer processed at a time: 8 MiB of float32 on CPU (cache-sized blocks were
fastest on a 2-core box), 128 MiB elsewhere (fewer kernel launches)."""

MAX_KERNEL_CHUNK = 1 << 14
"""Largest chunk the Triton Top-k holds in one program (tile 128); larger chunks (tiles up to
1024) take the torch path on the GPU too."""

_CANDIDATE_CAP = 4
"""Rows with more candidates than this many times k (ties, zeros) are handled as dense rows."""


@dataclass
class SparseGroup:
    """The transmitted entries of one chunk group.

    ``idx``: int64 (n_chunks, k), local positions inside each chunk, strictly ascending per row;
    ``codes``: uint8 (n_chunks, k), 2-bit value codes; ``scales``: uint8 (n_chunks,), side bytes
    (see `codec.quantize`).
    """

    idx: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor


@dataclass
class SparseTensor:
    """One tensor's compressed update: its groups in layout order and its float32 (R, 2) codebook."""

    name: str
    shape: tuple[int, ...]
    groups: list[SparseGroup]
    codebook: torch.Tensor

    def layout(self, params: CodecParams) -> ChunkLayout:
        return ChunkLayout.for_shape(self.shape, params)

    def to(self, device: torch.device | str) -> SparseTensor:
        """The same entries with every tensor on ``device``."""
        groups = [
            SparseGroup(g.idx.to(device), g.codes.to(device), g.scales.to(device))
            for g in self.groups
        ]
        return SparseTensor(self.name, self.shape, groups, self.codebook.to(device))

    def validate(self, params: CodecParams) -> None:
        """Raise `DecodeError` unless this update is well formed for its shape under ``params``."""
        try:
            layout = self.layout(params)
        except (TypeError, ValueError) as exc:
            raise DecodeError(f"{self.name}: bad shape {self.shape}: {exc}") from exc
        if len(self.groups) != len(layout.groups):
            raise DecodeError(
                f"{self.name}: {len(self.groups)} groups, layout has {len(layout.groups)}"
            )
        for gi, (g, sg) in enumerate(zip(layout.groups, self.groups, strict=True)):
            try:
                _validate_group(g, sg)
                validate(
                    sg.codes, sg.scales, self.codebook, params.max_abs_value, params.value_bits
                )
            except DecodeError as exc:
                raise DecodeError(f"{self.name} group {gi}: {exc}") from exc

    def values(self) -> list[torch.Tensor]:
        """Decoded float32 values (n_chunks, k) per group."""
        return [dequantize(g.codes, g.scales, self.codebook) for g in self.groups]


def _validate_group(g: ChunkGroup, sg: SparseGroup) -> None:
    idx = sg.idx
    if idx.dtype != torch.int64 or tuple(idx.shape) != (g.n_chunks, g.k):
        raise DecodeError(
            f"idx must be int64 {(g.n_chunks, g.k)}, got {idx.dtype} {tuple(idx.shape)}"
        )
    if tuple(sg.codes.shape) != (g.n_chunks, g.k) or tuple(sg.scales.shape) != (g.n_chunks,):
        raise DecodeError("codes or scales do not match the chunk group")
    if g.n_chunks == 0:
        return
    if idx.device.type == "cpu" and idx.is_contiguous():
        from codec.native.rows import OUTSIDE, UNSORTED, check_rows  # numba, imported where it runs

        status = check_rows(idx.numpy(), g.chunk_size)
        outside, unsorted = status == OUTSIDE, status == UNSORTED
    else:
        outside = int(idx[:, 0].min()) < 0 or int(idx[:, -1].max()) >= g.chunk_size
        unsorted = g.k > 1 and not bool((idx[:, 1:] > idx[:, :-1]).all())
    if outside:
        raise DecodeError(f"position outside the chunk of {g.chunk_size}")
    if unsorted:
        raise DecodeError("positions not strictly ascending within a chunk")


def scatter_add(
    out: torch.Tensor,
    sparse: SparseTensor,
    params: CodecParams,
    factor: float | Sequence[torch.Tensor] = 1.0,
    triton: bool | None = None,
) -> None:
    """Add ``factor * decoded(sparse)`` into the dense float32 tensor ``out`` (in place).

    ``factor`` is one number for the whole tensor or, per chunk group, one per chunk
    (`codec.aggregate.chunk_clip`); either is rounded to float32 first. Each position is touched
    at most once, so the result is one float32 product and one float32 sum per position whatever
    the device: with a fixed order of calls the accumulation is bit-reproducible. A CUDA ``out``
    takes the Triton kernel (`codec.gpu.scatter`) when triton imports; ``triton`` forces (True)
    or forbids (False) it.
    """
    if tuple(out.shape) != tuple(sparse.shape) or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 {sparse.shape}, got {out.dtype} {tuple(out.shape)}")
    layout = sparse.layout(params)
    factors = _chunk_factors(layout, factor, out.device)
    if gpu.enabled(out) if triton is None else triton:
        from codec.gpu.scatter import scatter_add as kernel

        for gi, g in enumerate(sparse.groups):
            kernel(out, layout, gi, g.idx, g.codes, g.scales, sparse.codebook, factors[gi])
        return
    if out.device.type == "cpu" and out.is_contiguous():
        from codec.native.scatter import scatter_group  # numba, imported where it runs

        for gi, g in enumerate(sparse.groups):
            scatter_group(out, layout, gi, g.idx, g.codes, g.scales, sparse.codebook, factors[gi])
        return
    flat_out = out.view(-1)
    for gi, (g, vals) in enumerate(zip(sparse.groups, sparse.values(), strict=True)):
        flat = layout.flat_positions(gi, g.idx.to(out.device)).view(-1)
        v = vals.to(out.device) * factors[gi][:, None]
        flat_out.index_add_(0, flat, v.view(-1))  # positions are unique: one float32 sum each


def _chunk_factors(
    layout: ChunkLayout, factor: float | Sequence[torch.Tensor], device: torch.device
) -> list[torch.Tensor]:
    """Per chunk group, a float32 (n_chunks,) factor on ``device``."""
    if isinstance(factor, (int, float)):
        one = torch.tensor(factor, dtype=torch.float32)
        return [one.expand(g.n_chunks).to(device) for g in layout.groups]
    if len(factor) != len(layout.groups) or any(
        tuple(f.shape) != (g.n_chunks,) for f, g in zip(factor, layout.groups, strict=True)
    ):
        raise ValueError("per-chunk factors must hold one (n_chunks,) tensor per chunk group")
    return [f.to(device, torch.float32) for f in factor]


def densify(
    sparse: SparseTensor, params: CodecParams, device: torch.device | str | None = None
) -> torch.Tensor:
    """Dequantize and scatter into a dense float32 tensor of the original shape (zeros elsewhere)."""
    out = torch.zeros(sparse.shape, dtype=torch.float32, device=device or sparse.codebook.device)
    scatter_add(out, sparse, params)
    return out


@lru_cache(maxsize=1024)
def _n_bins(chunk_size: int, k: int) -> int:
    """Strided bins for the lower bound: the smallest divisor of C that is >= 2k, 0 if unusable."""
    for bins in range(2 * k, chunk_size // 2 + 1):
        if chunk_size % bins == 0:
            return bins
    return 0


def _kth_largest(a: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(a, k, dim=1, sorted=False).values.amin(1)


def _lower_bound(a: torch.Tensor, k: int) -> tuple[torch.Tensor, bool]:
    """Per row a value that at least k entries of ``a`` reach, and whether it is exact."""
    bins = _n_bins(a.shape[1], k)
    if bins == 0:
        return _kth_largest(a, k), True
    maxima = a.view(a.shape[0], -1, bins).amax(1)
    return _kth_largest(maxima, k), False


def _exact_threshold(
    a: torch.Tensor, k: int, row: torch.Tensor, cand: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Exact k-th largest per row from its candidates (row, |value|), at most 4k per row.

    Rows without candidates (handled elsewhere) get a meaningless threshold.
    """
    nb = a.shape[0]
    cap = max(k, int(counts.max()))
    start = torch.cumsum(counts, 0) - counts
    slot = torch.arange(row.numel(), device=a.device) - start[row]
    padded = torch.full((nb, cap), -1.0, dtype=a.dtype, device=a.device)
    padded.view(-1)[row * cap + slot] = cand
    return _kth_largest(padded, k)


def _keep_with_ties(
    cand: torch.Tensor, row: torch.Tensor, t: torch.Tensor, k: int, nb: int
) -> torch.Tensor:
    """Mask over candidates: all above the threshold, then the lowest positions tied at it."""
    tr = t[row]
    above = cand > tr
    tied = cand == tr
    need = k - torch.bincount(row[above], minlength=nb)
    counts = torch.bincount(row, minlength=nb)
    start = torch.cumsum(counts, 0) - counts
    tied_before = torch.cumsum(tied, 0) - tied.long()
    rank = tied_before - tied_before[start.clamp(max=cand.numel() - 1)][row]
    return above | (tied & (rank < need[row]))


def _dense_positions(a: torch.Tensor, k: int) -> torch.Tensor:
    t = _kth_largest(a, k)[:, None]
    above = a > t
    tied = a == t
    need = k - above.sum(1, keepdim=True)
    keep = above | (tied & (torch.cumsum(tied, 1) <= need))
    return keep.nonzero()[:, 1].view(-1, k)


def _dense_topk(x: torch.Tensor, a: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of whole rows (rows with many candidates: ties, zeros): (positions, values)."""
    pos = torch.arange(k, device=x.device).expand(x.shape[0], k).clone()  # all-zero rows
    live = (a.amax(1) > 0).nonzero().squeeze(1)
    if live.numel():
        pos[live] = _dense_positions(a[live], k)
    return pos, torch.gather(x, 1, pos)


def _sparse_topk(
    x: torch.Tensor,
    a: torch.Tensor,
    flat: torch.Tensor,
    row: torch.Tensor,
    counts: torch.Tensor,
    k: int,
    bound: tuple[torch.Tensor, bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k of the rows that have candidates (flat positions ``flat`` in rows ``row``,
    ``counts`` per row): (rows, positions, values)."""
    nb, c = a.shape
    signed = x.view(-1)[flat]
    cand = signed.abs()
    t = bound[0] if bound[1] else _exact_threshold(a, k, row, cand, counts)
    keep = cand >= t[row]
    rows = (counts > 0).nonzero().squeeze(1)
    if int(keep.sum()) != rows.numel() * k:
        keep = _keep_with_ties(cand, row, t, k, nb)
    pos = (flat[keep] - row[keep] * c).view(-1, k)
    return rows, pos, signed[keep].view(-1, k)


def topk_rows(
    x: torch.Tensor, k: int, work: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact per-row Top-k by ``|x|`` of a contiguous float32 (n, C) tensor.

    Returns the positions (n, k) int64, ascending in each row, and the values of ``x`` there.
    Ties at the threshold go to the lowest positions. ``work`` optionally provides float32 and
    bool scratch buffers of at least ``x.numel()`` elements.
    """
    nb, c = x.shape
    if not 1 <= k <= c:
        raise ValueError(f"k={k} outside 1..{c}")
    if work is None:
        a = torch.empty_like(x)
        mask = torch.empty(x.shape, dtype=torch.bool, device=x.device)
    else:
        a = work[0][: x.numel()].view(nb, c)
        mask = work[1][: x.numel()].view(nb, c)
    torch.abs(x, out=a)
    bound = _lower_bound(a, k)
    torch.ge(a, bound[0][:, None], out=mask)
    flat = _flat_nonzero(mask.view(-1))
    row = torch.div(flat, c, rounding_mode="floor")
    counts = torch.bincount(row, minlength=nb)
    crowded = torch.zeros(0, dtype=torch.int64, device=x.device)
    if not bound[1]:
        crowded = (counts > _CANDIDATE_CAP * k).nonzero().squeeze(1)
    if crowded.numel() == 0:
        _, pos, vals = _sparse_topk(x, a, flat, row, counts, k, bound)
        return pos, vals
    pos = torch.empty(nb, k, dtype=torch.int64, device=x.device)
    vals = torch.empty(nb, k, dtype=x.dtype, device=x.device)
    pos[crowded], vals[crowded] = _dense_topk(x[crowded], a[crowded], k)
    if crowded.numel() < nb:
        counts[crowded] = 0
        keep = counts.gt(0)[row]
        flat, row = flat[keep], row[keep]
        rows, sparse_pos, sparse_vals = _sparse_topk(x, a, flat, row, counts, k, bound)
        pos[rows], vals[rows] = sparse_pos, sparse_vals
    return pos, vals


def _flat_nonzero(mask: torch.Tensor) -> torch.Tensor:
    """Positions of the True entries of a 1-D bool tensor (numpy's scan on the CPU: several
    times faster than torch's there on these sparse masks)."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return mask.nonzero().squeeze(1)


def _blocks(g: ChunkGroup, block_elements: int) -> Iterator[tuple[int, slice, slice]]:
    """(first chunk, tile-row slice, tile-column slice) covering a group in chunk order."""
    a, b = g.grid
    per = max(1, block_elements // g.chunk_size)
    if b >= per:
        for i in range(a):
            for j in range(0, b, per):
                yield i * b + j, slice(i, i + 1), slice(j, min(j + per, b))
    else:
        rows = per // b
        for i in range(0, a, rows):
            yield i * b, slice(i, min(i + rows, a)), slice(0, b)


class Compressor:
    """Error-feedback buffers of a model and the compression step of SparseLoCo.

    The buffers are float32, in chunked layout, on ``device``; `state_dict` gives them back in
    the tensors' own shapes so that a node can checkpoint and restore them.
    """

    def __init__(
        self,
        spec: ModelSpec,
        params: CodecParams,
        device: torch.device | str = "cpu",
        block_elements: int | None = None,
        triton: bool | None = None,
    ) -> None:
        self.spec = spec
        self.params = params
        self.device = torch.device(device)
        # None: the Triton kernels on a CUDA device when triton imports (`codec.gpu.enabled`);
        # True forces them (on CPU tensors that needs the interpreter, TRITON_INTERPRET=1)
        probe = torch.empty(0, device=self.device)
        self._triton = gpu.enabled(probe) if triton is None else triton
        self.block_elements = block_elements or BLOCK_ELEMENTS.get(
            self.device.type, BLOCK_ELEMENTS["default"]
        )
        self.layouts = {t.name: ChunkLayout.for_shape(t.shape, params) for t in spec.tensors}
        self._ef = {
            name: [torch.zeros(g.n_chunks, g.chunk_size, device=self.device) for g in lay.groups]
            for name, lay in self.layouts.items()
        }
        self._work: tuple[torch.Tensor, ...] | None = None

    def _scratch(self) -> tuple[torch.Tensor, ...]:
        if self._work is None:
            largest = max(
                (g.chunk_size for lay in self.layouts.values() for g in lay.groups), default=1
            )
            n = max(self.block_elements, largest)
            self._work = (
                torch.empty(n, device=self.device),
                torch.empty(n, dtype=torch.bool, device=self.device),
                torch.empty(n, device=self.device),
            )
        return self._work

    def compress(
        self,
        name: str,
        delta: torch.Tensor,
        beta: float,
        freeze: bool = False,
        timings: dict[str, float] | None = None,
    ) -> SparseTensor:
        """Fold ``delta`` into the EF buffer of ``name`` and return what to transmit.

        ``freeze``: compress ``delta`` alone and leave the buffer untouched (Appendix E).
        ``timings``: if given, wall-clock seconds per phase are added to it.
        Raises ValueError (and changes nothing) for a wrong shape, a non-finite ``delta`` or a
        bad ``beta``; KeyError for a name not in the spec.
        """
        delta = self._checked(name, delta, beta)
        return self._compress(name, delta, beta, freeze, timings)

    def compress_all(
        self, deltas: Mapping[str, torch.Tensor], beta: float, freeze: bool = False
    ) -> list[SparseTensor]:
        """`compress` every tensor of the spec, in spec order, after checking all of them first."""
        if set(deltas) != set(self.layouts):
            raise ValueError(f"deltas must cover exactly the spec's {len(self.layouts)} tensors")
        checked = {t.name: self._checked(t.name, deltas[t.name], beta) for t in self.spec.tensors}
        return [self._compress(n, d, beta, freeze, None) for n, d in checked.items()]

    def _checked(self, name: str, delta: torch.Tensor, beta: float) -> torch.Tensor:
        layout = self._layout(name)
        if tuple(delta.shape) != layout.shape or not delta.is_floating_point():
            raise ValueError(
                f"{name}: delta must be floating {layout.shape}, got {tuple(delta.shape)}"
            )
        if not (math.isfinite(beta) and beta >= 0):
            raise ValueError(f"beta must be finite and >= 0, got {beta}")
        delta = delta.detach().to(self.device).contiguous()
        if not bool(torch.isfinite(delta.sum())):
            raise ValueError(f"{name}: delta has non-finite entries")
        return delta

    def _compress(
        self,
        name: str,
        delta: torch.Tensor,
        beta: float,
        freeze: bool,
        timings: dict[str, float] | None,
    ) -> SparseTensor:
        layout = self.layouts[name]
        clock = time.perf_counter()
        picked = [self._select(name, gi, delta, beta, freeze) for gi in range(len(layout.groups))]
        idx, vals = [p[0] for p in picked], [p[1] for p in picked]
        clock = _lap(timings, "select", clock)
        # The quantiser's statistics are float sums whose rounding depends on their order, so
        # they run on the host for either path: the same side bytes and codes from any device.
        q = quantize_bits(
            [v.cpu() for v in vals], self.params.max_abs_value, self.params.value_bits
        )
        clock = _lap(timings, "quantize", clock)
        dev = self.device
        groups = [
            SparseGroup(i, c.to(dev), s.to(dev))
            for i, c, s in zip(idx, q.codes, q.scales, strict=True)
        ]
        book = q.codebook.to(dev)
        sparse = SparseTensor(name=name, shape=layout.shape, groups=groups, codebook=book)
        if not freeze:
            bufs = self._ef[name]
            if self._triton:
                from codec.gpu.scatter import feedback

                for buf, g, v in zip(bufs, groups, vals, strict=True):
                    feedback(buf, g.idx, v, g.codes, g.scales, book)
            else:
                for buf, i, v, dq in zip(bufs, idx, vals, sparse.values(), strict=True):
                    buf.scatter_(1, i, v - dq)
        _lap(timings, "feedback", clock)
        return sparse

    def _select(
        self, name: str, gi: int, delta: torch.Tensor, beta: float, freeze: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """EF update and Top-k of one chunk group: one Triton program per chunk on the GPU path
        (`codec.gpu.select`, for chunks it can hold), else torch ops in cache-sized blocks."""
        layout = self.layouts[name]
        g = layout.groups[gi]
        buf = self._ef[name][gi]
        if self._triton and g.chunk_size <= MAX_KERNEL_CHUNK:
            from codec.gpu.select import select

            return select(delta, buf, layout, gi, beta, freeze)
        work = self._scratch()
        src = layout.group_view(delta, gi)
        gi_idx, gi_vals = [], []
        for first, rs, cs in _blocks(g, self.block_elements):
            view = src[rs, cs]
            n = view.shape[0] * view.shape[1]
            rows = work[2][: n * g.chunk_size].view(n, -1) if freeze else buf[first : first + n]
            if freeze:
                rows.view(view.shape).copy_(view)
            else:
                torch.add(view, rows.view(view.shape), alpha=beta, out=rows.view(view.shape))
            pos, kept = topk_rows(rows, g.k, (work[0], work[1]))
            gi_idx.append(pos)
            gi_vals.append(kept)
        return torch.cat(gi_idx), torch.cat(gi_vals)

    def error(self, name: str) -> torch.Tensor:
        """A copy of the EF buffer of ``name`` in the tensor's own shape."""
        return self._layout(name).merge(self._ef[name])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """EF buffers by tensor name, each float32 in the tensor's own shape."""
        return {name: self.error(name) for name in self.layouts}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore buffers saved by `state_dict`; every tensor of the spec must be present."""
        if set(state) != set(self.layouts):
            missing, extra = set(self.layouts) - set(state), set(state) - set(self.layouts)
            raise ValueError(
                f"EF state mismatch: missing {sorted(missing)}, unexpected {sorted(extra)}"
            )
        new = {}
        for name, lay in self.layouts.items():
            t = state[name]
            if tuple(t.shape) != lay.shape or not t.is_floating_point():
                raise ValueError(
                    f"{name}: EF state must be floating {lay.shape}, got {t.dtype} {tuple(t.shape)}"
                )
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name}: EF state has non-finite entries")
            new[name] = [c.to(self.device, torch.float32) for c in lay.split(t)]
        self._ef = new

    def _layout(self, name: str) -> ChunkLayout:
        try:
            return self.layouts[name]
        except KeyError:
            raise KeyError(f"unknown tensor {name!r}") from None


def _lap(timings: dict[str, float] | None, phase: str, since: float) -> float:
    now = time.perf_counter()
    if timings is not None:
        timings[phase] = timings.get(phase, 0.0) + now - since
    return now
