"""Triton scatter-add + dequantisation (`codec.gpu.scatter`) under the interpreter: the mean of
several peers' updates, with and without median clipping, equals the CPU aggregate bit for bit."""

from __future__ import annotations

import pytest
import torch

from codec.aggregate import aggregate
from codec.compress import Compressor, SparseTensor, densify
from codec.errors import DecodeError
from codec.spec import CodecParams, ModelSpec
from codec.wire import decode_update, encode_update
from tests.support.sparse_pieces import as_sparse
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


def test_the_whole_decode_on_the_device_path_gives_the_cpu_mean() -> None:
    """Wire bytes in, mean out: index streams walked and code bytes unpacked by the device path
    (`decode_update(triton=True)`), summed by the kernel, equal the host decode and CPU sum."""
    datas = [encode_update(_update(i, 10.0 ** (i - 2)), PARAMS, SPEC) for i in range(3)]
    host = {i: as_sparse(decode_update(d, SPEC, PARAMS).tensors) for i, d in enumerate(datas)}
    dev = {
        i: as_sparse(decode_update(d, SPEC, PARAMS, triton=True).tensors)
        for i, d in enumerate(datas)
    }
    for a, b in zip(
        (p for ps in host.values() for p in ps), (p for ps in dev.values() for p in ps), strict=True
    ):
        assert torch.equal(a.codebook, b.codebook)
        for ga, gb in zip(a.groups, b.groups, strict=True):
            assert torch.equal(ga.idx, gb.idx)
            assert torch.equal(ga.codes, gb.codes)
            assert torch.equal(ga.scales, gb.scales)
    want = aggregate(host, SPEC, PARAMS, clip_to_median=True, triton=False)
    got = aggregate(dev, SPEC, PARAMS, clip_to_median=True, triton=True)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def _outcome(data: bytes, triton: bool) -> str | list[torch.Tensor]:
    try:
        pieces = decode_update(data, SPEC, PARAMS, triton=triton, check_digest=False).tensors
    except DecodeError:
        return "refused"
    return [t for p in pieces for g in p.groups for t in (g.idx, g.codes, g.scales)]


def test_the_device_path_refuses_what_the_host_refuses() -> None:
    """Edits anywhere in the payload (index streams, codes, their padding, side bytes; the digest
    left unchecked): the device path refuses exactly the edits the host path refuses and reads
    the others to the same pieces."""
    clean = encode_update(_update(6, 1.0), PARAMS, SPEC)
    refused = 0
    for i, at in enumerate(range(0, len(clean), 7)):
        flip = (0x01, 0x5A)[i % 2]
        bad = bytearray(clean)
        bad[at] ^= flip
        host, dev = _outcome(bytes(bad), False), _outcome(bytes(bad), True)
        if isinstance(host, str) or isinstance(dev, str):
            assert host == dev, (at, flip)
            refused += 1
        else:
            assert all(torch.equal(a, b) for a, b in zip(host, dev, strict=True)), (at, flip)
    assert refused > 10
