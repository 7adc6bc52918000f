"""2-bit values for the entries Top-k keeps: sign, one magnitude bit, per-chunk side byte.

Each kept value ``v`` of chunk ``j`` is sent as a 2-bit code ``c = 2*b + s`` (``s`` = 1 for a
negative value, ``b`` = the magnitude bit: 0 = low level, 1 = high level), and decodes as

    v_hat = (-1)**s * (S_j * L[r_j, b])

where ``L`` is the tensor's *codebook*, a float32 ``(R, 2)`` table of (low, high) magnitude
levels with ``1 <= R <= 4`` rows, and every chunk spends one *side byte*
``scale = (q << 2) | r``: ``r`` picks the codebook row (the chunk's high/low ratio) and ``q`` is
a 6-bit unsigned minifloat (4 exponent bits, 2 mantissa bits, bias 15, with subnormals) for the
chunk scale ``S_j`` in ``[0, 1.75]``; ``q = 0`` is exactly zero. Every minifloat value is exactly
representable in float32, so decoding is one float32 multiply and a sign flip: a pure
deterministic function of (codes, scales, codebook), bit-identical on every IEEE-754 machine.
The sender subtracts exactly this from its error feedback.

Why per-chunk ratios: the Top-k survivors of heavy-tailed chunks have very different spreads
from chunk to chunk (one chunk holds a single outlier 10x its neighbours, the next 64 similar
values). A per-chunk scale with one per-tensor (low, high) pair leaves ~0.105 relative squared
error on Student-t(3) chunks (k = 64 of 4096); letting each chunk pick one of four fitted
high/low ratios brings it to ~0.064, close to the 0.058 of a free per-chunk 2-means (two float32
levels per chunk, 64 bits of side information instead of 8). The 4-level uniform grid around the
mean (`uniform_baseline`) leaves ~0.35.

Side information: 8 bits per chunk (0.125 bits per value at k = 64) plus ``R * 64`` bits of
codebook per tensor.

The encoder (not part of the decoding contract, so it may change freely) fits: per-chunk
2-means on |v| (two Lloyd steps from sqrt(mean * max), which heavy tails need); the codebook's
high/low ratios by an energy-weighted 1-D Lloyd on the chunks' log(high/low); per chunk the
nearest ratio and the least-squares scale for it (one reassignment); scales rounded to the
minifloat grid against a per-tensor base (the largest scale maps to 1.75); finally every
magnitude bit is chosen as the nearer of the chunk's two *decoded* levels (exactly, in
float64). Work is done in blocks of chunks so the temporaries stay small.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from codec.errors import DecodeError

__all__ = [
    "MAX_LEVEL",
    "MAX_ROWS",
    "SCALE_LUT",
    "Quantized",
    "chunk_levels",
    "decode_side",
    "dequantize",
    "quantize",
    "quantize_bits",
    "quantize_signs",
    "relative_error",
    "side_info_bits",
    "uniform_baseline",
    "validate",
]

MAX_ROWS = 4
"""Most codebook rows a tensor may carry (the side byte has two bits for the row)."""

MAX_LEVEL = 2.0**100
"""Largest codebook level a decoder accepts; keeps every decoded value finite."""

_EXP_BITS, _MAN_BITS, _BIAS = 4, 2, 15


def _minifloat_values() -> list[float]:
    """All 64 values of the unsigned E4M2 minifloat, in code order (ascending)."""
    out = []
    for q in range(1 << (_EXP_BITS + _MAN_BITS)):
        e, m = divmod(q, 1 << _MAN_BITS)
        frac = m / (1 << _MAN_BITS)
        out.append(math.ldexp(frac, 1 - _BIAS) if e == 0 else math.ldexp(1 + frac, e - _BIAS))
    return out


SCALE_LUT = torch.tensor(_minifloat_values(), dtype=torch.float32)
"""Chunk scale for each 6-bit scale code; exact dyadic rationals, strictly increasing."""

_MAX_SCALE = float(SCALE_LUT[-1])
_LOG_RATIO_MAX = math.log(64.0)
_TWO_MEANS_ITERS = 2
_BLOCK_CHUNKS = 4096
_LLOYD_ITERS = 10
_FIT_SAMPLE = 16384


@dataclass
class Quantized:
    """2-bit codes of one tensor: per group ``codes`` (n, k) and ``scales`` (n,), one codebook."""

    codes: list[torch.Tensor]
    scales: list[torch.Tensor]
    codebook: torch.Tensor


def decode_side(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split side bytes into (chunk scale float32, codebook row int64)."""
    s = scales.to(torch.int64)
    return SCALE_LUT.to(scales.device)[s >> 2], s & 3


def chunk_levels(scales: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """The two magnitudes (low, high) each chunk decodes to: float32 (n, 2), ``S_j * L[r_j]``."""
    scale, row = decode_side(scales)
    return codebook.to(torch.float32)[row] * scale[:, None]


def dequantize(codes: torch.Tensor, scales: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Decoded float32 values (n, k) of codes (n, k), side bytes (n,) and codebook (R, 2).

    Inputs are trusted here; call `validate` first on anything that came over the wire.
    """
    c = codes.to(torch.int64)
    mag = torch.gather(chunk_levels(scales, codebook), 1, c >> 1)
    return torch.where((c & 1).bool(), -mag, mag)


def validate(
    codes: torch.Tensor,
    scales: torch.Tensor,
    codebook: torch.Tensor,
    max_abs: float = MAX_LEVEL,
    bits: int = 2,
) -> None:
    """Raise `DecodeError` unless (codes, scales, codebook) decode to finite values of magnitude
    at most `max_abs` (every chunk's two levels are checked, used or not) and every code fits in
    ``bits`` bits (1: a sign only, `quantize_signs`)."""
    if codebook.dtype != torch.float32 or codebook.dim() != 2 or codebook.shape[1] != 2:
        raise DecodeError(
            f"codebook must be float32 (R, 2), got {codebook.dtype} {tuple(codebook.shape)}"
        )
    rows = codebook.shape[0]
    if not 1 <= rows <= MAX_ROWS:
        raise DecodeError(f"codebook has {rows} rows, expected 1..{MAX_ROWS}")
    if not bool(torch.isfinite(codebook).all()):
        raise DecodeError("codebook has a non-finite entry")
    if bool((codebook < 0).any()) or bool((codebook > MAX_LEVEL).any()):
        raise DecodeError(f"codebook entry outside [0, {MAX_LEVEL}]")
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise DecodeError(f"codes and scales must be uint8, got {codes.dtype} and {scales.dtype}")
    if codes.dim() != 2 or scales.dim() != 1 or scales.shape[0] != codes.shape[0]:
        raise DecodeError(f"codes {tuple(codes.shape)} and scales {tuple(scales.shape)} disagree")
    if codes.numel() and int(codes.max()) >= 1 << bits:
        raise DecodeError(f"value code above {(1 << bits) - 1}")
    if scales.numel() and int((scales & 3).max()) >= rows:
        raise DecodeError(f"side byte names a codebook row >= {rows}")
    if scales.numel() and bool((chunk_levels(scales, codebook) > max_abs).any()):
        raise DecodeError(f"a value decodes above the run's cap of {max_abs:g}")


def _blocks(n: int) -> list[slice]:
    """Row blocks of a group: keeps the temporaries of the encoder small and cache-resident."""
    return [slice(i, min(i + _BLOCK_CHUNKS, n)) for i in range(0, n, _BLOCK_CHUNKS)]


@dataclass
class _ChunkStats:
    """What the encoder's first pass learns about each chunk of a group, each (n,)."""

    lo: torch.Tensor  # 2-means low centre of |v|
    hi: torch.Tensor  # 2-means high centre of |v|
    n_hi: torch.Tensor  # entries in the high cluster
    s_hi: torch.Tensor  # sum of |v| over the high cluster
    total: torch.Tensor  # sum of |v|

    @classmethod
    def cat(cls, parts: Sequence[_ChunkStats]) -> _ChunkStats:
        return cls(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(cls)))

    def log_ratio(self) -> torch.Tensor:
        """log(high / low), in [0, log 64]; a chunk whose low centre is zero gets the cap."""
        tiny = torch.finfo(torch.float32).tiny
        ratio = torch.where(self.lo > 0, self.hi / self.lo.clamp(min=tiny), math.inf)
        ratio = torch.where(self.hi > 0, ratio, 1.0)
        return ratio.log().clamp(0.0, _LOG_RATIO_MAX)

    def energy(self, k: int) -> torch.Tensor:
        """Squared norm of the chunk as its 2-means sees it (weights the ratio fit)."""
        return (k - self.n_hi) * self.lo.square() + self.n_hi * self.hi.square()


def _split_sums(mag: torch.Tensor, threshold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: number and sum of the magnitudes at or above ``threshold`` (n,)."""
    high = mag >= threshold[:, None]
    return high.sum(1, dtype=torch.int32).float(), torch.linalg.vecdot(mag, high.float())


def _chunk_stats(mag: torch.Tensor) -> _ChunkStats:
    """Per-row 2-means of nonnegative magnitudes (n, k), started at sqrt(mean * max)."""
    k = mag.shape[1]
    total = mag.sum(1)
    lo = hi = total / k
    th = (lo * mag.amax(1)).sqrt()
    n_hi = s_hi = total
    for _ in range(_TWO_MEANS_ITERS):
        n_hi, s_hi = _split_sums(mag, th)
        hi = s_hi / n_hi.clamp(min=1)
        lo = (total - s_hi) / (k - n_hi).clamp(min=1)
        hi = torch.where(n_hi > 0, hi, lo)
        lo = torch.where(n_hi < k, lo, hi)
        th = (lo + hi) / 2
    return _ChunkStats(lo=lo, hi=hi, n_hi=n_hi, s_hi=s_hi, total=total)


def _fit_ratios(log_ratio: torch.Tensor, weight: torch.Tensor, rows: int) -> torch.Tensor:
    """Weighted 1-D Lloyd: ``rows`` centres (ascending) for the chunks' log high/low ratios."""
    stride = max(1, log_ratio.numel() // _FIT_SAMPLE)
    x, w = log_ratio[::stride], weight[::stride]
    q = (torch.arange(rows, dtype=torch.float32, device=x.device) + 0.5) / rows
    centres = torch.quantile(x, q)
    for _ in range(_LLOYD_ITERS):
        assign = (x[:, None] - centres[None, :]).abs().argmin(1)
        sw = torch.zeros(rows, device=x.device).index_add_(0, assign, w)
        swx = torch.zeros(rows, device=x.device).index_add_(0, assign, w * x)
        centres = torch.where(sw > 0, swx / sw.clamp(min=1e-30), centres)
    return centres.sort().values


def _nearest(x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Index of the nearest entry of an ascending grid (ties go to the lower entry)."""
    if grid.numel() == 1:
        return torch.zeros(x.shape, dtype=torch.int64, device=x.device)
    hi = torch.bucketize(x, grid).clamp(1, grid.numel() - 1)
    lo = hi - 1
    return torch.where(x - grid[lo] <= grid[hi] - x, lo, hi)


def _ls_scale(
    k: int, n_hi: torch.Tensor, s_hi: torch.Tensor, total: torch.Tensor, rho: torch.Tensor
) -> torch.Tensor:
    """Least-squares scale s for levels (s, s * rho) given which entries are high."""
    num = total - s_hi + s_hi * rho
    den = (k - n_hi) + n_hi * rho.square()
    return num / den


def _chunk_scales(mag: torch.Tensor, st: _ChunkStats, rho: torch.Tensor) -> torch.Tensor:
    """Least-squares chunk scale for levels (1, rho), after one reassignment at the midpoint."""
    k = mag.shape[1]
    s = _ls_scale(k, st.n_hi, st.s_hi, st.total, rho)
    n_hi, s_hi = _split_sums(mag, s * (1 + rho) / 2)
    return _ls_scale(k, n_hi, s_hi, st.total, rho)


def _codes(v: torch.Tensor, scale: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """2-bit codes: sign, and high bit wherever the high decoded level is strictly nearer."""
    lv0 = levels[:, 0] * scale  # the same float32 products as `chunk_levels`
    lv1 = levels[:, 1] * scale
    midpoint = lv0.double() + lv1.double()  # exact: float32 sums fit in float64
    high = v.abs().double().mul_(2) > midpoint[:, None]
    code = (v < 0).to(torch.uint8)
    return code.add_(high.to(torch.uint8), alpha=2)


def quantize(values: Sequence[torch.Tensor], max_abs: float = MAX_LEVEL) -> Quantized:
    """Quantize one tensor's kept values, given per group as float32 (n_chunks, k).

    Every chunk must hold finite values; the codebook's rows are ``min(4, total chunks)``. No
    chunk decodes to a magnitude above `max_abs`: a chunk whose scale would exceed it takes the
    largest scale code that does not (the rest stays in the caller's error feedback).
    """
    if not values:
        raise ValueError("nothing to quantize")
    if not all(v.dtype == torch.float32 and v.dim() == 2 for v in values):
        raise ValueError("values must be float32 (n_chunks, k) per group")
    if not all(bool(torch.isfinite(v).all()) for v in values):
        raise ValueError("values to quantize must be finite")
    stats = [_ChunkStats.cat([_chunk_stats(v[b].abs()) for b in _blocks(len(v))]) for v in values]
    log_ratio = torch.cat([st.log_ratio() for st in stats])
    energy = torch.cat([st.energy(v.shape[1]) for st, v in zip(stats, values, strict=True)])
    centres = _fit_ratios(log_ratio, energy, min(MAX_ROWS, log_ratio.numel()))
    ratios = centres.exp()

    rows = [_nearest(st.log_ratio(), centres) for st in stats]
    raw = [
        torch.cat(
            [_chunk_scales(v[b].abs(), _slice_stats(st, b), ratios[r[b]]) for b in _blocks(len(v))]
        )
        for v, st, r in zip(values, stats, rows, strict=True)
    ]
    s_max = max(float(s.max()) for s in raw)
    base = s_max / _MAX_SCALE if s_max > 0 else 1.0
    codebook = torch.stack([torch.ones_like(ratios), ratios], 1).mul(base).clamp(max=MAX_LEVEL)
    lut = SCALE_LUT.to(codebook.device)
    limit = _scale_limits(codebook, lut, max_abs)
    q = [torch.minimum(_nearest(s / base, lut), limit[r]) for s, r in zip(raw, rows, strict=True)]

    codes = []
    for v, qc, r in zip(values, q, rows, strict=True):
        scale, levels = lut[qc], codebook[r]
        codes.append(torch.cat([_codes(v[b], scale[b], levels[b]) for b in _blocks(len(v))]))
    sides = [((qc << 2) | r).to(torch.uint8) for qc, r in zip(q, rows, strict=True)]
    return Quantized(codes=codes, scales=sides, codebook=codebook)


def quantize_signs(values: Sequence[torch.Tensor], max_abs: float = MAX_LEVEL) -> Quantized:
    """1-bit values (DeMo's sign option): code = the sign, every entry of a chunk decodes to
    ``±S_j * base``; one codebook row ``(base, base)``, so the side byte is the chunk scale alone.

    ``S_j * base`` is the least-squares magnitude for signs, ``mean |v|`` of the chunk, rounded to
    the minifloat grid (the largest chunk maps to 1.75) and capped so nothing decodes above
    `max_abs`. Codes are 0 or 1; `validate` with ``bits=1`` holds them to that.
    """
    if not values or not all(v.dtype == torch.float32 and v.dim() == 2 for v in values):
        raise ValueError("values must be float32 (n_chunks, k) per group")
    if not all(bool(torch.isfinite(v).all()) for v in values):
        raise ValueError("values to quantize must be finite")
    means = [v.abs().mean(1) for v in values]
    s_max = max((float(m.max()) for m in means if m.numel()), default=0.0)
    base = min(s_max / _MAX_SCALE, MAX_LEVEL) if s_max > 0 else 1.0
    codebook = torch.tensor([[base, base]], dtype=torch.float32, device=values[0].device)
    lut = SCALE_LUT.to(codebook.device)
    limit = _scale_limits(codebook, lut, max_abs)[0]
    q = [torch.minimum(_nearest(m / codebook[0, 0], lut), limit) for m in means]
    return Quantized(
        codes=[(v < 0).to(torch.uint8) for v in values],
        scales=[(qc << 2).to(torch.uint8) for qc in q],
        codebook=codebook,
    )


def quantize_bits(values: Sequence[torch.Tensor], max_abs: float, bits: int) -> Quantized:
    """`quantize` (2 bits) or `quantize_signs` (1 bit)."""
    return quantize(values, max_abs) if bits == 2 else quantize_signs(values, max_abs)


def _scale_limits(codebook: torch.Tensor, lut: torch.Tensor, max_abs: float) -> torch.Tensor:
    """Per codebook row, the largest scale code whose levels stay <= `max_abs` (code 0 is 0)."""
    levels = codebook.max(1).values[:, None] * lut[None, :]  # the products `chunk_levels` makes
    return (levels <= max_abs).sum(1) - 1


def _slice_stats(st: _ChunkStats, b: slice) -> _ChunkStats:
    return _ChunkStats(*(getattr(st, f.name)[b] for f in fields(st)))


def side_info_bits(n_chunks: int, n_values: int, codebook_rows: int = MAX_ROWS) -> float:
    """Side information per kept value: one byte per chunk plus the float32 codebook."""
    return (8 * n_chunks + 64 * codebook_rows) / n_values


def relative_error(values: torch.Tensor, approx: torch.Tensor) -> float:
    """sum((v - v_hat)^2) / sum(v^2), accumulated in float64."""
    v = values.double()
    return float((v - approx.double()).square().sum() / v.square().sum().clamp(min=1e-300))


def uniform_baseline(values: torch.Tensor, range_sigmas: float = 6.0) -> torch.Tensor:
    """Reference 2-bit quantizer for side-by-side numbers; returns the reconstruction.

    A 4-level uniform grid around the tensor mean with step ``range_sigmas * std / 4``:
    ``code = clamp(round((v - mean) / step) + 2, 0, 3)``, decoded to the mean of the values that
    fell into each code (the lookup table the deployed reference system sends).
    """
    v = values.to(torch.float32).reshape(-1)
    mean = v.mean()
    centred = v - mean
    step = range_sigmas * centred.std().clamp(min=1e-30) / 4
    code = (centred / step).round().add(2).clamp(0, 3).to(torch.int64)
    sums = torch.zeros(4, dtype=torch.float64, device=v.device).index_add_(
        0, code, centred.double()
    )
    counts = torch.bincount(code, minlength=4).clamp(min=1)
    lookup = (sums / counts).float()
    return (mean + lookup[code]).view_as(values)
