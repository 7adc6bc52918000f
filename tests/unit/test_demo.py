"""DeMo (`node.strategy.demo`): the per-chunk DCT against the textbook formula, its inverse the
same bits however it is blocked, the strategy against a plain reference implementation, sign
values, and strict decoding of its ``TSRC`` wire section."""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
import torch

from codec import dct, detmath, wire
from codec.chunking import ChunkLayout
from codec.errors import DecodeError
from codec.spec import CodecParams, ModelSpec
from node.strategy import make_strategy
from protocol.runconfig import RunConfig
from tests.support import wire_tampering as tampering
from tests.support.clip_reference import chunk_clipped_mean

SHAPES = {"w": (40, 23), "v": (200,), "n": (50,), "x": (3, 5, 9)}
SPEC = ModelSpec.from_shapes(SHAPES)
CODEC = {"tile": 8, "k": 6, "max_abs_value": 1e6}


def _run(bits: int = 2, beta: float = 0.9) -> RunConfig:
    return RunConfig.preset(
        "tiny", name="demo", strategy="demo", codec={**CODEC, "value_bits": bits},
        outer={"total_windows": 10, "ef_freeze_fraction": 0.0, "beta": beta},
    )  # fmt: skip


def _ref_matrix(n: int) -> np.ndarray:
    """The DCT-II matrix straight from its definition, one entry at a time, in float64."""
    p = np.zeros((n, n))
    for u in range(n):
        for i in range(n):
            c = math.sqrt(1 / n) if u == 0 else math.sqrt(2 / n)
            p[u, i] = c * math.cos(math.pi * (2 * i + 1) * u / (2 * n))
    return p


def _ref_tiles(x: torch.Tensor, params: CodecParams, inverse: bool) -> torch.Tensor:
    """Per-tile (inverse) DCT by dense matrix products, tile by tile, in float64."""
    layout = ChunkLayout.for_shape(tuple(x.shape), params)
    mat = x.double().reshape(layout.rows, layout.cols).numpy().copy()
    out = np.zeros_like(mat)
    for g in layout.groups:
        (r0, c0), (ga, gb), (a, b) = g.origin, g.grid, g.tile
        pa, pb = _ref_matrix(a), _ref_matrix(b)
        for i in range(ga):
            for j in range(gb):
                rs, cs = slice(r0 + i * a, r0 + (i + 1) * a), slice(c0 + j * b, c0 + (j + 1) * b)
                t = mat[rs, cs]
                out[rs, cs] = pa.T @ t @ pb if inverse else pa @ t @ pb.T
    return torch.from_numpy(out).reshape(x.shape)


def _deltas(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def test_dct_matrix_is_the_textbook_one_and_orthonormal() -> None:
    for n in (1, 3, 8, 23, 64):
        p = dct.dct_matrix(n).double().numpy()
        np.testing.assert_allclose(p, _ref_matrix(n), rtol=0, atol=1e-7)
        np.testing.assert_allclose(p @ p.T, np.eye(n), rtol=0, atol=1e-6)
    for n in (128, 384, 4096):  # the sizes the presets' layouts use build without refusing
        assert dct.dct_matrix(n).shape == (n, n)


def test_per_chunk_dct_and_inverse_match_dense_matrix_products() -> None:
    params = CodecParams(**CODEC)
    for name, x in _deltas(1).items():
        layout = ChunkLayout.for_shape(tuple(x.shape), params)
        coef = dct.forward(x, layout)
        torch.testing.assert_close(coef.double(), _ref_tiles(x, params, False), rtol=0, atol=1e-5)
        back = dct.inverse(coef, layout)
        ref = _ref_tiles(coef, params, True)
        torch.testing.assert_close(back.double(), ref, rtol=1e-6, atol=1e-7, msg=name)
        torch.testing.assert_close(back, x, rtol=0, atol=1e-5)


def test_inverse_is_the_same_bits_however_it_is_blocked(monkeypatch: pytest.MonkeyPatch) -> None:
    params = CodecParams(tile=16, k=8)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(70, 50, generator=gen).pow(3)
    layout = ChunkLayout.for_shape((70, 50), params)
    base = dct.inverse(x, layout)
    threads = torch.get_num_threads()
    try:
        for block, n_threads in ((1 << 9, 1), (1 << 12, 2), (1 << 26, 1)):
            monkeypatch.setattr(detmath, "BLOCK_ELEMENTS", block)
            torch.set_num_threads(n_threads)
            assert torch.equal(dct.inverse(x, layout), base)
    finally:
        torch.set_num_threads(threads)
    assert not torch.equal((dct.dct_matrix(16).T @ x[:16, :16]) @ dct.dct_matrix(16), x[:16, :16])


def test_demo_follows_a_plain_reference_implementation() -> None:
    """Three peers, three windows: the error feedback lives in the DCT domain (β e + DCT(Δ),
    minus what was sent), each chunk sends the Top-k of |e|, and the window's mean is the
    inverse DCT of the chunk-clipped mean of the coefficients."""
    run, beta = _run(), 0.9
    params = run.codec
    peers = [make_strategy(run, SPEC) for _ in range(3)]
    ref_e = [{n: torch.zeros(s, dtype=torch.float64) for n, s in SHAPES.items()} for _ in peers]
    for window in range(3):
        updates = {}
        for uid, (peer, e) in enumerate(zip(peers, ref_e, strict=True)):
            deltas = _deltas(10 * window + uid)
            sent = peer.encoder.encode(deltas, window)
            data = peer.format.to_bytes(sent, {"window": window}, None)
            updates[uid] = peer.format.decode(data, peer.format.max_update_bytes()).tensors
            for piece in updates[uid]:
                n = piece.name
                e[n] = beta * e[n] + _ref_tiles(deltas[n], params, False)
                layout = ChunkLayout.for_shape(SHAPES[n], params)
                for gi, (g, chunk) in enumerate(
                    zip(layout.groups, layout.split(e[n]), strict=True)
                ):
                    top = torch.topk(chunk.abs(), g.k, dim=1).indices.sort(1).values
                    assert torch.equal(piece.groups[gi].idx, top)
                pos, vals = peer.format.entries(piece)
                e[n].view(-1)[pos] -= vals.double()
                torch.testing.assert_close(
                    peer.encoder.local_state_dict()[n].double(), e[n], atol=1e-5, rtol=0
                )
        mean = peers[0].aggregator.mean(updates)
        for n, shape in SHAPES.items():
            coefs = []
            for up in updates.values():
                pos, vals = peers[0].format.entries(next(p for p in up if p.name == n))
                coefs.append(torch.zeros(shape, dtype=torch.float64))
                coefs[-1].view(-1)[pos] = vals.double()
            coef = chunk_clipped_mean(coefs, ChunkLayout.for_shape(shape, params))
            ref = _ref_tiles(coef, params, True)
            torch.testing.assert_close(mean[n].double(), ref, rtol=1e-5, atol=1e-6)


def test_sign_values_decode_to_the_chunk_mean_magnitude() -> None:
    run = _run(bits=1)
    peer = make_strategy(run, SPEC)
    deltas = _deltas(3)
    sent = peer.encoder.encode(deltas, 0)
    two_bit = make_strategy(_run(bits=2), SPEC)
    ref_sent = two_bit.encoder.encode(deltas, 0)
    for piece, ref in zip(sent, ref_sent, strict=True):
        layout = ChunkLayout.for_shape(piece.shape, run.codec)
        coef = layout.split(dct.forward(deltas[piece.name], layout))
        for g, rg, vals, chunks in zip(piece.groups, ref.groups, piece.values(), coef, strict=True):
            assert torch.equal(g.idx, rg.idx)  # the same Top-k, only the values differ
            assert int(g.codes.max()) <= 1
            kept = torch.gather(chunks, 1, g.idx)
            assert torch.equal(torch.sign(vals), torch.sign(kept))
            mag = vals.abs()
            assert torch.equal(mag, mag[:, :1].expand_as(mag))  # one magnitude per chunk
            ratio = mag[:, 0] / kept.abs().mean(1)
            assert bool(((ratio > 0.85) & (ratio < 1.15)).all())  # E4M2 grid: within 1/8
    data = peer.format.to_bytes(sent, {}, None)
    assert len(data) < len(two_bit.format.to_bytes(ref_sent, {}, None))
    assert [
        p.name for p in peer.format.decode(data, peer.format.max_update_bytes()).tensors
    ] == list(SHAPES)


# -- the wire -----------------------------------------------------------------------------


def _good(bits: int = 2) -> tuple[RunConfig, bytes]:
    run = _run(bits)
    peer = make_strategy(run, SPEC)
    return run, peer.format.to_bytes(peer.encoder.encode(_deltas(4), 0), {"window": 0}, None)


_parts = partial(tampering.split, wire.DCT.frame)
_reframe = partial(tampering.reframe, wire.DCT.frame)
_decode = partial(tampering.decode, SPEC)


def test_a_sparseloco_update_is_not_a_demo_update_and_back() -> None:
    run, good = _good()
    sparse_run = run.model_copy(update={"strategy": "sparseloco"})
    with pytest.raises(DecodeError, match="magic"):
        _decode(sparse_run, good)
    peer = make_strategy(sparse_run, SPEC)
    with pytest.raises(DecodeError, match="magic"):
        _decode(run, peer.format.to_bytes(peer.encoder.encode(_deltas(4), 0), {}, None))


def test_hostile_demo_bytes_raise_decode_error_quickly() -> None:
    run, good = _good()
    _decode(run, good)
    header, payload = _parts(good)
    run1, good1 = _good(bits=1)
    h1, p1 = _parts(good1)
    corpus = {
        "truncated": good[:-5],
        "extra byte": good + b"\x00",
        "explicit default value_bits (not canonical)": _reframe(
            {**header, "value_bits": 2}, payload
        ),
        "claims 1-bit values": _reframe({**header, "value_bits": 1}, payload),
        "claims 3-bit values": _reframe({**header, "value_bits": 3}, payload),
        "claims shared values": _reframe({**header, "shared_k": 4}, payload),
        "claims a support": _reframe({**header, "support_digest": b"\x01" * 32}, payload),
        "flipped payload bit": good[:-30] + bytes([good[-30] ^ 8]) + good[-29:],
    }
    tampering.assert_refused_quickly(corpus, partial(_decode, run))
    with pytest.raises(DecodeError, match="1-bit values"):
        _decode(run, good1)  # the run sends 2-bit values
    rows = sum(t[3] for t in h1["tensors"])
    n_chunks = sum(g.n_chunks for t in SPEC.tensors
                   for g in ChunkLayout.for_shape(t.shape, run1.codec).groups)  # fmt: skip
    end = len(p1) - 8 * rows - n_chunks  # the codes section ends here
    assert not h1["codes_zstd"]
    padded = p1[: end - 1] + bytes([p1[end - 1] | 0x80]) + p1[end:]  # a bit in the padding
    with pytest.raises(DecodeError, match="padding"):
        _decode(run1, _reframe(h1, padded))
