"""2-bit values: error on heavy-tailed Top-k survivors, strict validation, exact decoding."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from codec.errors import DecodeError
from codec.quantize import (
    SCALE_LUT,
    chunk_levels,
    dequantize,
    quantize,
    quantize_signs,
    relative_error,
    side_info_bits,
    uniform_baseline,
    validate,
)


def _top64(x: torch.Tensor, k: int = 64) -> torch.Tensor:
    """The Top-k survivors (by magnitude) of each row of x."""
    return torch.gather(x, 1, x.abs().topk(k, dim=1).indices)


def _roundtrip(values: torch.Tensor) -> torch.Tensor:
    q = quantize([values])
    validate(q.codes[0], q.scales[0], q.codebook)
    return dequantize(q.codes[0], q.scales[0], q.codebook)


@pytest.fixture(scope="module")
def heavy_tailed() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    n, c = 800, 4096
    normal = torch.randn(n, c, generator=gen)
    chi2 = torch.randn(3, n, c, generator=gen).square().sum(0)
    student3 = normal / (chi2 / 3).sqrt()
    uniform = torch.rand(n, c, generator=gen).clamp(1e-7, 1 - 1e-7)
    laplace = -torch.sign(uniform - 0.5) * torch.log1p(-2 * (uniform - 0.5).abs())
    # per-chunk magnitudes spread over two orders, as across rows of a real pseudo-gradient
    spread = torch.exp(torch.randn(n, 1, generator=gen))
    return {
        "student_t3": _top64(student3),
        "laplace": _top64(laplace),
        "student_t3_spread": _top64(student3 * spread),
    }


@pytest.mark.parametrize("name", ["student_t3", "laplace", "student_t3_spread"])
def test_error_target_and_baseline(heavy_tailed: dict[str, torch.Tensor], name: str) -> None:
    values = heavy_tailed[name]
    ours = relative_error(values, _roundtrip(values))
    baseline = relative_error(values, uniform_baseline(values))
    assert ours <= 0.08, f"{name}: relative squared error {ours:.4f}"
    assert ours < baseline


def test_uniform_baseline_is_far_off_on_student_t(heavy_tailed: dict[str, torch.Tensor]) -> None:
    values = heavy_tailed["student_t3"]
    assert relative_error(values, uniform_baseline(values)) > 0.2


def test_codes_and_side_bytes() -> None:
    gen = torch.Generator().manual_seed(0)
    groups = [torch.randn(50, 64, generator=gen), torch.randn(3, 8, generator=gen) * 4]
    q = quantize(groups)
    assert q.codebook.dtype == torch.float32 and tuple(q.codebook.shape) == (4, 2)
    for v, codes, scales in zip(groups, q.codes, q.scales, strict=True):
        assert codes.dtype == torch.uint8 and codes.shape == v.shape and int(codes.max()) <= 3
        assert scales.dtype == torch.uint8 and scales.shape == (v.shape[0],)
        decoded = dequantize(codes, scales, q.codebook)
        # the sign is always kept; magnitudes are the chunk's two levels
        assert torch.equal(decoded < 0, v < 0)
        levels = chunk_levels(scales, q.codebook)
        assert bool(((decoded.abs() == levels[:, :1]) | (decoded.abs() == levels[:, 1:])).all())


def test_high_bit_picks_nearer_level() -> None:
    v = torch.randn(200, 64, generator=torch.Generator().manual_seed(5))
    q = quantize([v])
    levels = chunk_levels(q.scales[0], q.codebook).double()
    high = (q.codes[0] >> 1).bool()
    m = v.abs().double()  # differences of float32 numbers are exact in float64
    d_lo, d_hi = (m - levels[:, :1]).abs(), (m - levels[:, 1:]).abs()
    assert bool((d_hi[high] < d_lo[high]).all())
    assert bool((d_lo[~high] <= d_hi[~high]).all())


def test_small_and_degenerate_inputs() -> None:
    zeros = torch.zeros(3, 5)
    q = quantize([zeros])
    assert torch.equal(dequantize(q.codes[0], q.scales[0], q.codebook), zeros)
    single = torch.tensor([[-2.5]])
    q = quantize([single])
    assert q.codebook.shape[0] == 1
    assert relative_error(single, dequantize(q.codes[0], q.scales[0], q.codebook)) < 0.02
    constant = torch.full((4, 16), 3.0)
    assert relative_error(constant, _roundtrip(constant)) < 0.02
    with pytest.raises(ValueError):
        quantize([torch.tensor([[1.0, float("nan")]])])
    with pytest.raises(ValueError):
        quantize([])


def test_scale_lut_is_exact_and_increasing() -> None:
    lut = SCALE_LUT.double()
    assert float(lut[0]) == 0.0 and float(lut[-1]) == 1.75
    assert bool((lut[1:] > lut[:-1]).all())
    # every entry is m * 2**e with a small integer m: exact in float32
    mant, _ = np.frexp(lut.numpy())
    assert np.all((mant * 8) == np.round(mant * 8))


def test_dequantize_is_a_pure_float32_function() -> None:
    gen = torch.Generator().manual_seed(7)
    n, k, rows = 300, 64, 3
    codes = torch.randint(0, 4, (n, k), generator=gen, dtype=torch.uint8)
    scales = (
        torch.randint(0, 64, (n,), generator=gen) << 2 | torch.randint(0, rows, (n,), generator=gen)
    ).to(torch.uint8)
    codebook = torch.rand(rows, 2, generator=gen) * 1e-3
    first = dequantize(codes, scales, codebook)
    assert torch.equal(first, dequantize(codes.clone(), scales.clone(), codebook.clone()))
    # reference: one IEEE float32 multiply, then the sign
    c, s, cb = codes.numpy().astype(np.int64), scales.numpy().astype(np.int64), codebook.numpy()
    scale = SCALE_LUT.numpy()[s >> 2]
    level = cb[(s & 3)[:, None], c >> 1]
    ref = (level * scale[:, None]).astype(np.float32)
    ref = np.where(c & 1, -ref, ref)
    assert np.array_equal(first.numpy().view(np.uint32), ref.view(np.uint32))


Triple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Mutation = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Triple]


def _valid() -> Triple:
    q = quantize([torch.randn(10, 8, generator=torch.Generator().manual_seed(3))])
    return q.codes[0], q.scales[0], q.codebook


@pytest.mark.parametrize(
    "bad",
    [
        lambda c, s, b: (c, s, b.clone().fill_(float("nan"))),
        lambda c, s, b: (
            c,
            s,
            torch.where(torch.arange(b.numel()).view_as(b) == 1, float("inf"), b),
        ),
        lambda c, s, b: (c, s, -b),
        lambda c, s, b: (c, s, b * 1e35),
        lambda c, s, b: (c, s, b.double()),
        lambda c, s, b: (c, s, b[:, :1]),
        lambda c, s, b: (c, s, torch.zeros(0, 2)),
        lambda c, s, b: (c, s, torch.rand(5, 2)),
        lambda c, s, b: (c.clone().fill_(4), s, b),
        lambda c, s, b: (c.to(torch.int64), s, b),
        lambda c, s, b: (c, s.float(), b),
        lambda c, s, b: (c, s[:-1], b),
        lambda c, s, b: (c, s | 3, b[:1]),
    ],
)
def test_validate_rejects(bad: Mutation) -> None:
    codes, scales, codebook = _valid()
    validate(codes, scales, codebook)
    with pytest.raises(DecodeError):
        validate(*bad(codes, scales, codebook))


def test_side_info_budget() -> None:
    bits = side_info_bits(n_chunks=24_414, n_values=24_414 * 64)
    assert 0.125 <= bits < 0.13


def test_the_quantisers_refuse_what_they_cannot_code() -> None:
    good = torch.ones(2, 3)
    with pytest.raises(ValueError, match="nothing to quantize"):
        quantize([])
    for quantiser in (quantize, quantize_signs):
        for bad in ([good.double()], [good.reshape(-1)]):
            with pytest.raises(ValueError, match="float32 \\(n_chunks, k\\)"):
                quantiser(bad)
        with pytest.raises(ValueError, match="must be finite"):
            quantiser([torch.tensor([[1.0, float("nan"), 2.0]])])
