"""What an update may carry, and who may have sent it: the value cap and verify-first.

Attacks: a correctly signed update whose codebook holds 2^100, float32's largest value, NaN or
inf; a signature made by another key, or with a flipped byte; a header edited (or merely
re-encoded) after signing; a bad signature over a payload built to be expensive or malformed (it
must be refused before the payload is decoded).
"""

from __future__ import annotations

import struct

import msgpack
import pytest
import torch
from substrateinterface import Keypair

from codec import wire
from codec.compress import Compressor, SparseGroup, SparseTensor, scatter_add
from codec.errors import DecodeError
from codec.quantize import SCALE_LUT, decode_side, validate
from codec.spec import CodecParams, ModelSpec
from lab.sim.forgeries import noise_update
from node.model.llama import build_model
from node.strategy import make_strategy
from node.strategy.format import Decoded
from node.window.exchange import check_update, encode_signed
from protocol.keys import create_hotkey
from protocol.runconfig import RunConfig
from protocol.signing import SignatureError, sign_update

RUN = RunConfig.preset("tiny", name="bounds", inner_steps=2)
SPEC = ModelSpec.from_module(build_model(RUN.model, RUN.seed))
CAP = RUN.codec.max_abs_value
WINDOW = 4
F32_MAX = float(torch.finfo(torch.float32).max)
ONE = int((SCALE_LUT == 1.0).nonzero()[0])  # the scale code of exactly 1.0


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> list[Keypair]:
    root = tmp_path_factory.mktemp("wallets")
    return [create_hotkey("b", f"k{i}", root=root) for i in range(2)]


@pytest.fixture(scope="module")
def update() -> list[SparseTensor]:
    return noise_update(SPEC, RUN, 1e-3, torch.Generator().manual_seed(3))


def _check(data: bytes, key: Keypair) -> Decoded:
    return check_update(data, 0, key.ss58_address, RUN, SPEC, WINDOW)


def _with_codebook(update: list[SparseTensor], value: float) -> list[SparseTensor]:
    """Every high level of every codebook row set to `value` (low levels left as they were)."""
    out = []
    for s in update:
        book = s.codebook.clone()
        book[:, 1] = value
        out.append(SparseTensor(s.name, s.shape, s.groups, book))
    return out


def _with_top_level(update: list[SparseTensor], top: float) -> list[SparseTensor]:
    """Every chunk's scale exactly 1.0 on row 0, codebook (top / 2, top): the largest value
    any chunk decodes to is exactly `top`."""
    out = []
    for s in update:
        groups = [
            SparseGroup(g.idx, g.codes, torch.full_like(g.scales, ONE << 2)) for g in s.groups
        ]
        book = torch.tensor([[top / 2, top]] * s.codebook.shape[0], dtype=torch.float32)
        out.append(SparseTensor(s.name, s.shape, groups, book))
    return out


# -- the value cap -------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [2.0**100, F32_MAX, 50.0])
def test_a_signed_update_above_the_cap_is_refused(
    keys: list[Keypair], update: list[SparseTensor], value: float
) -> None:
    data = encode_signed(_with_codebook(update, value), RUN, SPEC, WINDOW, 0, keys[0])
    with pytest.raises(DecodeError, match=r"cap|outside"):
        wire.decode_update(data, SPEC, RUN.codec)
    with pytest.raises(DecodeError, match=r"cap|outside"):
        _check(data, keys[0])  # correctly signed, still refused


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_codebooks_are_refused(
    keys: list[Keypair], update: list[SparseTensor], value: float
) -> None:
    data = encode_signed(_with_codebook(update, value), RUN, SPEC, WINDOW, 0, keys[0])
    with pytest.raises(DecodeError, match="non-finite"):
        wire.decode_update(data, SPEC, RUN.codec)
    with pytest.raises(DecodeError, match="non-finite"):
        _check(data, keys[0])


def test_scales_cannot_be_non_finite() -> None:
    """Chunk scales travel as side bytes; every one of the 256 decodes to a finite scale in
    [0, 1.75], and scales in any other form (e.g. float, which could hold NaN) are refused."""
    scale, _ = decode_side(torch.arange(256, dtype=torch.int64).to(torch.uint8))
    assert (
        bool(torch.isfinite(scale).all()) and 0 <= float(scale.min()) <= float(scale.max()) <= 1.75
    )
    codes = torch.zeros(2, 4, dtype=torch.uint8)
    with pytest.raises(DecodeError, match="uint8"):
        validate(codes, torch.tensor([float("nan"), 1.0]), torch.tensor([[0.5, 1.0]]))


def test_the_cap_is_inclusive_at_the_decoder() -> None:
    codes = torch.zeros(3, 4, dtype=torch.uint8)
    scales = torch.full((3,), ONE << 2, dtype=torch.uint8)
    validate(codes, scales, torch.tensor([[0.5, 1.0]]), max_abs=1.0)  # exactly at the cap
    above = float(torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)))
    with pytest.raises(DecodeError, match="cap"):
        validate(codes, scales, torch.tensor([[0.5, above]]), max_abs=1.0)


def test_the_run_cap_is_inclusive_on_the_fetch_path(
    keys: list[Keypair], update: list[SparseTensor]
) -> None:
    at_cap = encode_signed(_with_top_level(update, CAP), RUN, SPEC, WINDOW, 0, keys[0])
    decoded = _check(at_cap, keys[0])
    assert max(float(v.abs().max()) for t in decoded.tensors for v in t.values()) == CAP
    above = float(torch.nextafter(torch.tensor(CAP), torch.tensor(2 * CAP)))
    over = encode_signed(_with_top_level(update, above), RUN, SPEC, WINDOW, 0, keys[0])
    with pytest.raises(DecodeError, match="cap"):
        _check(over, keys[0])


def test_an_honest_encoder_clamps_and_keeps_the_rest_in_error_feedback() -> None:
    params = CodecParams(tile=16, k=8, max_abs_value=0.25)
    spec = ModelSpec.from_shapes({"w": (32, 32)})
    comp = Compressor(spec, params)
    delta = torch.randn(32, 32, generator=torch.Generator().manual_seed(0)) * 0.01
    delta[0, 0], delta[5, 7] = 40.0, -9.0  # far above the cap
    sparse = comp.compress("w", delta, beta=0.95)
    data = wire.encode_update([sparse], params, spec)
    (decoded,) = wire.decode_update(data, spec, params).tensors  # decodable by everyone
    assert isinstance(decoded, SparseTensor)
    sent = torch.zeros(32, 32)
    scatter_add(sent, decoded, params)
    assert 0 < float(sent.abs().max()) <= 0.25
    assert 0 < sent[0, 0] <= 0.25 and -0.25 <= sent[5, 7] < 0  # sent, clamped
    ef = comp.error("w")
    assert ef[0, 0] == pytest.approx(40.0 - float(sent[0, 0]))  # the rest is kept for later
    assert ef[5, 7] == pytest.approx(-9.0 - float(sent[5, 7]))
    torch.testing.assert_close(ef + sent, delta, rtol=0, atol=1e-6)  # e = delta - transmitted


@pytest.mark.parametrize("cap", [1e-4, 3e-3, 0.25, 1.0])
def test_an_honest_encoder_never_exceeds_the_cap(cap: float) -> None:
    params = CodecParams(tile=16, k=12, max_abs_value=cap)
    spec = ModelSpec.from_shapes({"w": (48, 80), "b": (200,)})
    comp = Compressor(spec, params)
    gen = torch.Generator().manual_seed(int(cap * 1e4))
    for _ in range(3):  # error feedback grows what is left over from step to step
        for t in spec.tensors:
            heavy = torch.randn(t.shape, generator=gen) / torch.rand(t.shape, generator=gen)
            sparse = comp.compress(t.name, heavy * 0.01, beta=0.95)
            sparse.validate(params)
            assert max(float(v.abs().max()) for v in sparse.values()) <= cap


# -- verify first --------------------------------------------------------------------------------


def _signed_by(signer: Keypair, claimed: Keypair, update: list[SparseTensor]) -> bytes:
    """An update whose meta names `claimed` but whose signature `signer` made."""
    meta = {"run_id": RUN.run_id, "window": WINDOW, "uid": 0, "hotkey": claimed.ss58_address}
    return wire.encode_update(
        update,
        RUN.codec,
        SPEC,
        meta=meta,
        sign=lambda digest: sign_update(signer, RUN.run_id, WINDOW, 0, digest),
    )


def test_a_signature_by_another_key_is_refused(
    keys: list[Keypair], update: list[SparseTensor]
) -> None:
    _check(_signed_by(keys[0], keys[0], update), keys[0])
    with pytest.raises(SignatureError):
        _check(_signed_by(keys[1], keys[0], update), keys[0])
    # key 1's own, valid update relabelled as key 0's: header changed, signature is key 1's
    other = encode_signed(update, RUN, SPEC, WINDOW, 0, keys[1])
    header, _ = wire.read_header(other)
    relabelled = wire.with_signature(
        other, header.sig, meta={**header.meta, "hotkey": keys[0].ss58_address}
    )
    with pytest.raises(SignatureError):
        _check(relabelled, keys[0])


@pytest.mark.parametrize("byte", [0, 7, 31, 32, 63])
def test_a_flipped_signature_byte_is_refused(
    keys: list[Keypair], update: list[SparseTensor], byte: int
) -> None:
    good = encode_signed(update, RUN, SPEC, WINDOW, 0, keys[0])
    header, _ = wire.read_header(good)
    flipped = bytearray(header.sig)
    flipped[byte] ^= 1
    with pytest.raises(SignatureError):
        _check(wire.with_signature(good, bytes(flipped)), keys[0])
    with pytest.raises(SignatureError):
        _check(wire.with_signature(good, b""), keys[0])  # unsigned


def _edits(header: wire.WireHeader) -> dict[str, dict[str, object]]:
    entry = header.tensors[0]
    grown = entry.model_copy(update={"codebook_rows": entry.codebook_rows % 4 + 1})
    return {
        "tensor order": {"tensors": header.tensors[::-1]},
        "tensor codebook rows": {"tensors": (grown, *header.tensors[1:])},
        "k": {"k": header.k + 1},
        "tile": {"tile": header.tile * 2},
        "codec version": {"codec_version": header.codec_version + 1},
        "spec digest": {"spec_digest": "0" * 32},
        "codes zstd": {"codes_zstd": not header.codes_zstd},
        "codes bytes": {"codes_bytes": header.codes_bytes + 1},
        "payload digest": {"digest": bytes(32)},
        "meta added": {"meta": {**header.meta, "note": "edited"}},
        "meta reordered": {"meta": dict(reversed(header.meta.items()))},
    }


def test_any_header_edit_after_signing_invalidates_the_signature(
    keys: list[Keypair], update: list[SparseTensor]
) -> None:
    good = encode_signed(update, RUN, SPEC, WINDOW, 0, keys[0])
    header, payload = wire.read_header(good)
    for name, edit in _edits(header).items():
        tampered = wire._frame(header.model_copy(update=edit), payload)
        with pytest.raises(SignatureError):
            _check(tampered, keys[0])
        assert wire.header_digest(wire.read_header(tampered)[0]) != wire.header_digest(header), name


def test_a_re_encoded_header_is_refused(keys: list[Keypair], update: list[SparseTensor]) -> None:
    """The same header values in another msgpack encoding would carry a valid signature under a
    different byte string; only the canonical encoding is accepted."""
    good = encode_signed(update, RUN, SPEC, WINDOW, 0, keys[0])
    n = int.from_bytes(good[5:9], "little")
    raw = good[9 : 9 + n]
    tile = b"\xa4tile" + bytes([RUN.codec.tile])  # a positive fixint
    assert raw.count(tile) == 1
    wide = raw.replace(tile, b"\xa4tile\xce" + RUN.codec.tile.to_bytes(4, "big"))  # as a uint32
    data = good[:5] + len(wide).to_bytes(4, "little") + wide + good[9 + n :]
    with pytest.raises(DecodeError, match="canonical"):
        _check(data, keys[0])
    with pytest.raises(DecodeError, match="canonical"):
        wire.decode_update(data, SPEC, RUN.codec)


def test_a_bad_signature_is_refused_before_the_payload_is_decoded(
    keys: list[Keypair], update: list[SparseTensor]
) -> None:
    good = encode_signed(update, RUN, SPEC, WINDOW, 0, keys[0])
    header, payload = wire.read_header(good)
    garbage = bytes(b ^ 0xFF for b in payload)  # undecodable, and its digest does not match
    bad = wire._frame(header.model_copy(update={"sig": bytes(64)}), garbage)
    with pytest.raises(SignatureError):  # a decoder running first would raise DecodeError
        _check(bad, keys[0])
    # the same garbage under the peer's valid signature: verified, then refused by the decoder
    with pytest.raises(DecodeError, match="digest"):
        _check(wire._frame(header, garbage), keys[0])


def test_meta_is_checked_before_the_signature(
    keys: list[Keypair], update: list[SparseTensor]
) -> None:
    good = encode_signed(update, RUN, SPEC, WINDOW, 0, keys[0])
    for uid, window, key in [(1, WINDOW, keys[0]), (0, WINDOW + 1, keys[0]), (0, WINDOW, keys[1])]:
        with pytest.raises(DecodeError, match="meta"):
            check_update(good, uid, key.ss58_address, RUN, SPEC, window)


def test_a_header_with_more_tensor_rows_than_the_model_is_refused_before_its_rows(
    keys: list[Keypair], update: list[SparseTensor]
) -> None:
    """The signature check reads the header first (`UpdateFormat.read_header`): a table of tens of
    thousands of rows is refused by its length, before any row is validated or re-packed."""
    data = encode_signed(update, RUN, SPEC, 2, 0, keys[0])
    (n,) = struct.unpack_from("<I", data, 5)
    header = msgpack.unpackb(data[9 : 9 + n], raw=False)
    header["tensors"] = [header["tensors"][0]] * 30_000
    raw = msgpack.packb(header, use_bin_type=True)
    forged = data[:5] + struct.pack("<I", len(raw)) + raw + data[9 + n :]
    with pytest.raises(DecodeError, match=f"30000 tensor rows, the model has {len(SPEC.tensors)}"):
        make_strategy(RUN, SPEC).format.read_header(forged, len(forged))
