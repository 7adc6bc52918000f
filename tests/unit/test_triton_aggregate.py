"""Triton scatter-add + dequantisation (`codec.gpu.scatter`) under the interpreter: the mean of
several peers' updates, with and without median clipping, equals the CPU aggregate bit for bit."""

from __future__ import annotations

import pytest
import torch

from codec.aggregate import aggregate
from codec.compress import Compressor, SparseTensor, densify
from codec.spec import CodecParams, ModelSpec
from tests.support.triton_interpreter import require_interpreter

SPEC = ModelSpec.from_shapes({"w": (40, 37), "b": (300,)})
PARAMS = CodecParams(tile=16, k=8, max_abs_value=2.0**64)


@pytest.fixture(autouse=True)
def interpreter() -> None:
    require_interpreter()


def _update(seed: int, scale: float) -> list[SparseTensor]:
    gen = torch.Generator().manual_seed(seed)
    comp = Compressor(SPEC, PARAMS, triton=False)
    return [
        comp.compress(t.name, torch.randn(t.shape, generator=gen) * scale, 0.9)
        for t in SPEC.tensors
    ]


@pytest.mark.parametrize("clip", [False, True])
def test_aggregate_matches_the_cpu_path_bit_for_bit(
    clip: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from codec.gpu import scatter

    monkeypatch.setattr(scatter, "BLOCK", 64)  # many programs per launch
    # scales far apart: clipping gives factors != 1, and float32 sums round differently per order
    updates = {f"peer{i}": _update(i, 10.0 ** (i - 2)) for i in range(4)}
    want = aggregate(updates, SPEC, PARAMS, clip_to_median=clip, triton=False)
    got = aggregate(updates, SPEC, PARAMS, clip_to_median=clip, triton=True)
    for name in want:
        assert torch.equal(got[name], want[name]), name
        assert got[name].abs().sum() > 0


def test_densify_through_the_kernel_is_exact() -> None:
    (sparse,) = _update(7, 1.0)[:1]
    out = torch.zeros(sparse.shape)
    from codec.compress import scatter_add

    scatter_add(out, sparse, PARAMS, triton=True)
    assert torch.equal(out, densify(sparse, PARAMS))


def test_the_triton_path_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from codec import gpu

    gpu.missing.cache_clear()
    monkeypatch.setenv("TESSERA_TRITON", "0")
    try:
        assert "TESSERA_TRITON=0" in (gpu.missing() or "")
    finally:
        gpu.missing.cache_clear()
    monkeypatch.delenv("TESSERA_TRITON")
    assert gpu.missing() is None
