"""What the simulation's adversaries upload, built on the real codec so the bytes are well formed.

* `perturbed_copy`: another peer's decoded update with its 2-bit values jittered and a few
  indices moved (a copier trying to dodge digest and overlap checks);
* `noise_update`: a random sparse update (random dense noise through the real `Compressor`);
* `zero_update`: what a freeloader who never trains can send cheaply;
* `poisoned`: an update whose codebook holds NaN (a peer uploading non-finite values);
* `at_the_cap`: every value at the largest magnitude a decoder admits, signs against a victim's;
* `scaled`: a victim's update with its values multiplied (a peer buying score or influence);
* `from_dense`: any dense vector (e.g. the last published aggregate) through the real compressor;
* `chunk_mix`: two peers' updates mixed chunk by chunk (each chunk whole from one of them),
  re-compressed by the real compressor (a copier splicing two victims to dodge copy checks);
* `split_by_chunks`: one update cut into several of disjoint supports (one training uploaded
  by several hotkeys).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from codec.compress import Compressor, SparseGroup, SparseTensor, densify, scatter_add
from codec.spec import CodecParams, ModelSpec, TensorSpec
from protocol.runconfig import RunConfig


def perturbed_copy(
    update: Sequence[SparseTensor],
    params: CodecParams,
    gen: torch.Generator,
    jitter: float = 0.3,
    move_chunks: float = 0.1,
) -> list[SparseTensor]:
    """Jitter a fraction `jitter` of the value codes and move one index in `move_chunks` of the
    chunks to a random free position of the same chunk (keeping the format valid)."""
    out = []
    for sparse in update:
        groups = []
        layout = sparse.layout(params)
        for g, lg in zip(sparse.groups, layout.groups, strict=True):
            idx, codes = g.idx.clone(), g.codes.clone()
            flip = torch.rand(codes.shape, generator=gen) < jitter
            codes[flip] ^= 2  # the magnitude bit: value jittered, sign kept
            n_chunks, k = idx.shape
            for row in torch.nonzero(torch.rand(n_chunks, generator=gen) < move_chunks).flatten():
                r = int(row)
                taken = set(idx[r].tolist())
                free = [p for p in range(lg.chunk_size) if p not in taken]
                if not free or k == 0:
                    continue
                col = int(torch.randint(k, (1,), generator=gen))
                idx[r, col] = free[int(torch.randint(len(free), (1,), generator=gen))]
                order = torch.argsort(idx[r])
                idx[r], codes[r] = idx[r][order], codes[r][order]
            groups.append(SparseGroup(idx=idx, codes=codes, scales=g.scales.clone()))
        out.append(SparseTensor(sparse.name, sparse.shape, groups, sparse.codebook.clone()))
    return out


def noise_update(
    spec: ModelSpec, run: RunConfig, scale: float, gen: torch.Generator
) -> list[SparseTensor]:
    """A random sparse update: Top-k of dense N(0, scale²) noise through the real compressor."""
    comp = Compressor(spec, run.codec)
    return [
        comp.compress(t.name, torch.randn(t.shape, generator=gen) * scale, 0.0, freeze=True)
        for t in spec.tensors
    ]


def zero_update(spec: ModelSpec, run: RunConfig) -> list[SparseTensor]:
    """An all-zero update in valid form: nothing learned, nothing spent."""
    comp = Compressor(spec, run.codec)
    return [comp.compress(t.name, torch.zeros(t.shape), 0.0, freeze=True) for t in spec.tensors]


def poisoned(update: Sequence[SparseTensor]) -> list[SparseTensor]:
    """The same update with a NaN in every codebook (decoders must refuse it)."""
    out = []
    for s in update:
        book = s.codebook.clone()
        book[0, 1] = float("nan")
        out.append(SparseTensor(s.name, s.shape, s.groups, book))
    return out


def _level_code(value: float) -> int:
    """The scale code whose chunk scale is exactly `value` (1.0 is exact in E4M2)."""
    from codec.quantize import SCALE_LUT

    return int(torch.nonzero(torch.eq(SCALE_LUT, value))[0])


def at_the_cap(update: Sequence[SparseTensor], cap: float) -> list[SparseTensor]:
    """Every kept value at magnitude `cap` (the largest a decoder admits), each sign flipped: the
    strongest update against `update`'s direction that still decodes."""
    side = _level_code(1.0) << 2  # chunk scale 1.0, codebook row 0
    out = []
    for s in update:
        groups = [
            SparseGroup(
                idx=g.idx.clone(),
                codes=(g.codes ^ 1) | 2,  # sign flipped, high magnitude
                scales=torch.full_like(g.scales, side),
            )
            for g in s.groups
        ]
        out.append(SparseTensor(s.name, s.shape, groups, torch.full((1, 2), cap)))
    return out


def scaled(update: Sequence[SparseTensor], factor: float, cap: float) -> list[SparseTensor]:
    """`update` with every value multiplied by `factor`, or by less (the same for every value)
    when that would put a value above `cap`, the largest magnitude a decoder admits."""
    top = _top_level(update, 1.0)
    f = min(factor, cap / top) if top > 0 else factor
    while f > 0 and _top_level(update, f) > cap:  # cap / top may round up by an ulp
        f = math.nextafter(f, 0.0)
    return [SparseTensor(s.name, s.shape, s.groups, s.codebook * f) for s in update]


def _top_level(update: Sequence[SparseTensor], factor: float) -> float:
    """The largest magnitude `update` decodes to once its codebooks are multiplied by `factor`."""
    from codec.quantize import chunk_levels

    levels = [
        float(chunk_levels(g.scales, s.codebook * factor).max())
        for s in update
        for g in s.groups
        if g.scales.numel()
    ]
    return max(levels, default=0.0)


def from_dense(
    dense: dict[str, torch.Tensor], spec: ModelSpec, run: RunConfig
) -> list[SparseTensor]:
    """A dense update compressed by the real compressor (no error feedback)."""
    comp = Compressor(spec, run.codec)
    return [comp.compress(t.name, dense[t.name], 0.0, freeze=True) for t in spec.tensors]


def chunk_mix(
    a: Sequence[SparseTensor],
    b: Sequence[SparseTensor],
    fraction: float,
    gen: torch.Generator,
    spec: ModelSpec,
    run: RunConfig,
) -> list[SparseTensor]:
    """In every chunk group, ``round(fraction * n)`` randomly chosen chunks taken whole (positions
    and decoded values) from `b` and the others from `a`, then compressed again."""
    dense = {}
    for sa, sb in zip(a, b, strict=True):
        if sa.name != sb.name:
            raise ValueError(f"tensors {sa.name!r} and {sb.name!r} cannot be mixed")
        layout = sa.layout(run.codec)
        flat = torch.zeros(math.prod(sa.shape), dtype=torch.float32)
        for gi, (ga, gb, va, vb) in enumerate(
            zip(sa.groups, sb.groups, sa.values(), sb.values(), strict=True)
        ):
            n = ga.idx.shape[0]
            from_b = (torch.randperm(n, generator=gen) < round(fraction * n))[:, None]
            idx = torch.where(from_b, gb.idx, ga.idx)
            flat[layout.flat_positions(gi, idx).view(-1)] = torch.where(from_b, vb, va).view(-1)
        dense[sa.name] = flat.view(sa.shape)
    return from_dense(dense, spec, run)


def requantised(
    update: Sequence[SparseTensor], spec: ModelSpec, run: RunConfig, gen: torch.Generator
) -> list[SparseTensor]:
    """A sign-preserving re-quantised copy: the same positions and signs, each magnitude scaled
    by a random factor in [0.5, 1.5], compressed again by the real compressor."""
    dense = {}
    for s in update:
        d = torch.zeros(s.shape)
        scatter_add(d, s, run.codec)
        dense[s.name] = d * (0.5 + torch.rand(d.shape, generator=gen))
    return from_dense(dense, spec, run)


def split_by_chunks(
    run: RunConfig, update: list[SparseTensor], parts: int
) -> list[list[SparseTensor]]:
    """`update` cut into `parts` updates of disjoint supports: piece ``i`` keeps the chunks whose
    index (in each tensor's chunk order) is ``i`` modulo `parts`, each chunk whole, and zeros
    elsewhere (what one training uploaded as several hotkeys' updates looks like)."""
    pieces: list[list[SparseTensor]] = [[] for _ in range(parts)]
    for s in update:
        layout = s.layout(run.codec)
        groups = layout.split(densify(s, run.codec))
        comp = Compressor(ModelSpec(tensors=(TensorSpec(name=s.name, shape=s.shape),)), run.codec)
        first = 0
        kept: list[list[torch.Tensor]] = [[] for _ in range(parts)]
        for chunks in groups:
            index = torch.arange(first, first + chunks.shape[0])
            first += chunks.shape[0]
            for i in range(parts):
                kept[i].append(chunks * (index % parts == i).unsqueeze(1))
        for i in range(parts):
            pieces[i].append(comp.compress(s.name, layout.merge(kept[i]), 0.0, freeze=True))
    return pieces
