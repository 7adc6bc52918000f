"""Wire container: exact round trips and strict decoding of hostile bytes."""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence

import msgpack
import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from codec import wire
from codec.chunking import ChunkLayout
from codec.compress import Compressor, SparseTensor
from codec.errors import DecodeError
from codec.spec import CodecParams, ModelSpec
from tests.support import wire_tampering as tampering
from tests.support.allocation import peak_allocation

SPEC = ModelSpec.from_shapes(
    {"embed": (300, 96), "layer.q": (96, 96), "layer.norm": (96,), "odd": (2, 3, 50)}
)
PARAMS = CodecParams(tile=32, k=24)


def compress_random(spec: ModelSpec, params: CodecParams, seed: int) -> list[SparseTensor]:
    gen = torch.Generator().manual_seed(seed)
    comp = Compressor(spec, params)
    return [
        comp.compress(t.name, torch.randn(t.shape, generator=gen).pow(3), beta=0.9, freeze=False)
        for t in spec.tensors
    ]


def assert_same(a: list[SparseTensor], b: Sequence[wire.Piece]) -> None:
    assert [t.name for t in a] == [t.name for t in b]
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape
        assert torch.equal(x.codebook, y.codebook)
        for g, h in zip(x.groups, y.groups, strict=True):
            assert torch.equal(g.idx, h.idx)
            assert torch.equal(g.codes, h.codes)
            assert torch.equal(g.scales, h.scales)


@st.composite
def specs(draw: st.DrawFn) -> tuple[ModelSpec, CodecParams]:
    tile = draw(st.sampled_from([4, 8, 16, 64]))
    k = draw(st.integers(1, min(64, tile * tile)))
    n = draw(st.integers(1, 4))
    shapes = {}
    for i in range(n):
        dims = draw(st.lists(st.integers(1, 150), min_size=1, max_size=3))
        shapes[f"t{i}"] = tuple(dims)
    return ModelSpec.from_shapes(shapes), CodecParams(tile=tile, k=k)


@settings(max_examples=40, deadline=None)
@given(specs(), st.integers(0, 1000))
def test_round_trip(case: tuple[ModelSpec, CodecParams], seed: int) -> None:
    spec, params = case
    sparse = compress_random(spec, params, seed)
    data = wire.encode_update(sparse, params, spec, meta={"window": seed})
    decoded = wire.decode_update(data, spec, params)
    assert_same(sparse, decoded.tensors)
    assert decoded.header.meta == {"window": seed}


def test_signature_is_added_without_touching_the_payload() -> None:
    sparse = compress_random(SPEC, PARAMS, 1)
    data = wire.encode_update(sparse, PARAMS, SPEC)
    signed = wire.with_signature(data, b"\x01" * 64, meta={"uid": 3})
    header, payload = wire.read_header(signed)
    assert header.sig == b"\x01" * 64 and header.meta == {"uid": 3}
    assert wire.payload_digest(payload) == header.digest == wire.read_header(data)[0].digest
    assert_same(sparse, wire.decode_update(signed, SPEC, PARAMS).tensors)


def _frame(header: dict | list, payload: bytes) -> bytes:
    raw = msgpack.packb(header, use_bin_type=True)
    return struct.pack("<4sBI", wire.MAGIC, wire.FORMAT_VERSION, len(raw)) + raw + payload


def _parts(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack_from("<I", data, 5)
    return msgpack.unpackb(data[9 : 9 + n], raw=False), data[9 + n :]


def _sections(header: dict, payload: bytes) -> tuple[bytes, bytes, bytes]:
    """(index streams, value codes, scales and codebooks) of a payload, by its header."""
    idx = sum(sum(t[2]) for t in header["tensors"])
    codes = idx + header["codes_bytes"]
    return payload[:idx], payload[idx:codes], payload[codes:]


def _corpus(good: bytes) -> dict[str, tuple[bytes, str]]:
    """Hostile variants of `good`, each with the rule that must refuse it (its message): every
    rule is pinned by a case that only it catches first, so deleting one fails the test."""
    header, payload = _parts(good)
    out = {
        "empty": (b"", "truncated before its header"),
        "truncated header": (good[:20], "header length .* is impossible"),
        "truncated payload": (good[:-7], "payload is .* bytes, header says"),
        "extra byte": (good + b"\x00", "payload is .* bytes, header says"),
        "bad magic": (b"XXXX" + good[4:], "bad magic"),
        "bad version": (good[:4] + b"\x09" + good[5:], "format version 9"),
        "header length lies": (
            good[:5] + struct.pack("<I", 1 << 30) + good[9:],
            "header length .* is impossible",
        ),
        "oversized header": (
            struct.pack("<4sBI", wire.MAGIC, wire.FORMAT_VERSION, 8 << 20) + b"\x00" * (8 << 20),
            "header length .* is impossible",
        ),
        "header not msgpack": (good[:9] + b"\xc1" * (len(good) - 9), "malformed update header"),
        "header not a map": (_frame([header], payload), "header is not a map"),
        "flipped payload bit": (good[:-40] + bytes([good[-40] ^ 4]) + good[-39:], "payload digest"),
    }
    variants = {
        "codec version": ({"codec_version": header["codec_version"] + 1}, "codec version"),
        "wrong k": ({"k": header["k"] + 1}, r"codec \(tile=32, k=25\)"),
        "wrong spec digest": ({"spec_digest": "0" * 32}, "another model spec"),
        "payload length lies": (
            {"payload_bytes": header["payload_bytes"] + 1},
            "payload is .* bytes, header says",
        ),
        "codes length lies": ({"codes_bytes": header["codes_bytes"] + 3}, "section lengths"),
        "extra field": ({"evil": 1}, "Extra inputs are not permitted"),
        "digest wrong type": ({"digest": "abc"}, "valid bytes"),
        "shape disagrees": (
            {"tensors": [[t[0], [t[1][0] + 1, *t[1][1:]], *t[2:]] for t in header["tensors"]]},
            r"tensor 'embed' \(301, 96\) != spec",
        ),
        "tensor missing at the end": (
            {"tensors": header["tensors"][:-1]},
            f"{len(header['tensors']) - 1} tensors, spec has",
        ),
        "index stream dropped": (
            {"tensors": [[*t[:2], t[2][:1], t[3]] for t in header["tensors"]]},
            "embed: 1 index streams, expected 2",
        ),
        "index length lies": (
            {"tensors": [[*t[:2], [t[2][0] + 5, *t[2][1:]], t[3]] for t in header["tensors"]]},
            "section lengths",
        ),
        "too many codebook rows": (
            {"tensors": [[*t[:3], 9] for t in header["tensors"]]},
            "less than",
        ),
        "table row too short": (
            {"tensors": [t[:2] for t in header["tensors"]]},
            "malformed tensor table row",
        ),
        "tens of thousands of rows": (  # refused by its length, before any row is read
            {"tensors": [header["tensors"][0]] * 30_000},
            f"30000 tensor rows, the model has {len(header['tensors'])}",
        ),
    }
    for name, (change, rule) in variants.items():
        out[name] = (_frame({**header, **change}, payload), rule)
    # payloads with the right digest whose sections lie
    idx, codes, rest = _sections(header, payload)
    assert header["codes_zstd"], "the cases below take a zstd value section"

    def repaid(h: dict, body: bytes) -> bytes:  # digest and length fixed to `body`
        return tampering.reframe(wire.FRAME, {**h, "payload_bytes": len(body)}, body)

    raw = {**header, "codes_zstd": False}  # the squeezed codes read as packed codes
    out["value codes too short"] = (repaid(raw, payload), "value codes are .* bytes, expected")
    junk = idx + b"\x00" * len(codes) + rest
    out["value codes not zstd"] = (repaid(header, junk), "value codes do not decompress")
    bad_index = b"\xff" * len(idx) + codes + rest
    out["index stream garbage"] = (repaid(header, bad_index), "^embed: ")
    return out


def test_adversarial_corpus_raises_decode_error_cheaply() -> None:
    """Each hostile update is refused by its own rule, and at a cost bounded by its own size,
    whatever its header claims (a lying length or count allocates nothing it names)."""
    good = wire.encode_update(compress_random(SPEC, PARAMS, 2), PARAMS, SPEC)
    wire.decode_update(good, SPEC, PARAMS)
    for name, (data, rule) in _corpus(good).items():

        def refuse(data: bytes = data, rule: str = rule) -> None:
            with pytest.raises(DecodeError, match=rule):
                wire.decode_update(data, SPEC, PARAMS)

        assert peak_allocation(refuse) < (1 << 20) + 32 * len(data), name


def test_value_codes_padded_with_ones_are_refused() -> None:
    """The bits after the last 2-bit code are zero; an update that sets them, with its digest
    and lengths fixed, is refused (a node that unpacks only some tensors' codes checks them
    too)."""
    spec, params = ModelSpec.from_shapes({"w": (40, 24), "b": (3,)}), CodecParams(tile=8, k=5)
    count = sum(ChunkLayout.for_shape(t.shape, params).n_values for t in spec.tensors)
    assert count % 4, "the last byte of 2-bit codes must hold padding"
    good = wire.encode_update(compress_random(spec, params, 8), params, spec)
    header, payload = _parts(good)
    idx, codes, rest = _sections(header, payload)
    packed = bytearray(zstandard.ZstdDecompressor().decompress(codes) if header["codes_zstd"]
                       else codes)  # fmt: skip
    packed[-1] |= (0xFF << (2 * (count % 4))) & 0xFF  # a code past the last one
    squeezed = zstandard.ZstdCompressor().compress(bytes(packed))
    body = idx + (squeezed if header["codes_zstd"] else bytes(packed)) + rest
    changed = {
        **header,
        "payload_bytes": len(body),
        "codes_bytes": len(body) - len(idx) - len(rest),
    }
    with pytest.raises(DecodeError, match="non-zero padding after the value codes"):
        wire.decode_update(tampering.reframe(wire.FRAME, changed, body), spec, params)
    for name in ("w", "b"):
        with pytest.raises(DecodeError, match="non-zero padding"):
            wire.decode_update(tampering.reframe(wire.FRAME, changed, body), spec, params,
                               only={name}, check_digest=False)  # fmt: skip


def test_the_encoder_refuses_pieces_that_do_not_match_its_spec() -> None:
    update = compress_random(SPEC, PARAMS, 6)
    with pytest.raises(ValueError, match="every tensor of the spec"):
        wire.encode_update(update[::-1], PARAMS, SPEC)
    with pytest.raises(ValueError, match="wrong kind of pieces"):
        wire.encode_update(update, PARAMS, SPEC, fmt=wire.MASKED)
    with pytest.raises(ValueError, match="wrong kind of pieces"):
        wire.encode_update(update, PARAMS, SPEC, shared_k=3)
    bent = [dataclasses.replace(update[0], shape=(96, 300)), *update[1:]]
    with pytest.raises(ValueError, match=r"embed: shape \(96, 300\) != spec"):
        wire.encode_update(bent, PARAMS, SPEC)


def test_size_cap_and_foreign_spec_are_refused() -> None:
    good = wire.encode_update(compress_random(SPEC, PARAMS, 3), PARAMS, SPEC)
    with pytest.raises(DecodeError, match="exceeds"):
        wire.decode_update(good, SPEC, PARAMS, max_bytes=len(good) - 1)
    other = ModelSpec.from_shapes({"embed": (300, 96)})
    with pytest.raises(DecodeError):
        wire.decode_update(good, other, PARAMS)
    with pytest.raises(DecodeError, match="codec"):
        wire.decode_update(good, SPEC, CodecParams(tile=32, k=25))


def test_non_finite_codebook_is_refused_even_with_a_matching_digest() -> None:
    good = wire.encode_update(compress_random(SPEC, PARAMS, 4), PARAMS, SPEC)
    header, payload = _parts(good)
    rows = sum(t[3] for t in header["tensors"])
    books = np.frombuffer(payload[-8 * rows :], dtype="<f4").copy()
    books[0] = np.nan
    payload = payload[: -8 * rows] + books.tobytes()
    header["digest"] = wire.payload_digest(payload)
    with pytest.raises(DecodeError, match="non-finite"):
        wire.decode_update(_frame(header, payload), SPEC, PARAMS)


def test_fuzzed_mutations_only_raise_decode_error() -> None:
    rng = np.random.default_rng(5)
    good = wire.encode_update(compress_random(SPEC, PARAMS, 5), PARAMS, SPEC)
    for _ in range(300):
        data = bytearray(good)
        pos = int(rng.integers(0, len(data)))
        if rng.random() < 0.5:
            data[pos] ^= 1 << int(rng.integers(0, 8))
        else:
            data = data[:pos]
        try:
            wire.decode_update(bytes(data), SPEC, PARAMS)
        except DecodeError:
            continue
        # A mutation that still decodes must have hit only the meta or signature values, which
        # the signature over the header catches (tests/unit/test_update_bounds.py).
        assert wire.read_header(bytes(data))[0].digest == wire.read_header(good)[0].digest
