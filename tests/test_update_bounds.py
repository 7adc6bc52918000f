"""What an update may carry, and who may have sent it: the value cap and verify-first.

Attacks: a correctly signed update whose codebook holds 2^100 (or NaN, or inf); a signature made by
another key, or with a flipped byte; a header edited after signing; a bad signature over a payload
built to be expensive or malformed (it must be refused before the payload is decoded).
"""

from __future__ import annotations

import pytest
import torch

from codec import wire
from codec.compress import Compressor, SparseTensor
from codec.errors import DecodeError
from codec.quantize import SCALE_LUT, validate
from codec.spec import CodecParams, ModelSpec
from deploy.sim.forgeries import noise_update
from node.model.llama import build_model
from node.window.exchange import check_update, encode_signed
from protocol.keys import create_hotkey
from protocol.runconfig import RunConfig
from protocol.signing import SignatureError

RUN = RunConfig.preset("tiny", name="bounds", inner_steps=2)
SPEC = ModelSpec.from_module(build_model(RUN.model, RUN.seed))
WINDOW = 4


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> list:
    root = tmp_path_factory.mktemp("wallets")
    return [create_hotkey("b", f"k{i}", root=root) for i in range(2)]


@pytest.fixture(scope="module")
def update() -> list[SparseTensor]:
    return noise_update(SPEC, RUN, 1e-3, torch.Generator().manual_seed(3))


def _with_codebook(update: list[SparseTensor], value: float) -> list[SparseTensor]:
    out = []
    for s in update:
        book = s.codebook.clone()
        book[:, 1] = value
        out.append(SparseTensor(s.name, s.shape, s.groups, book))
    return out


@pytest.mark.parametrize("value", [2.0**100, float(torch.finfo(torch.float32).max), 50.0])
def test_a_signed_update_above_the_cap_is_refused(keys: list, update: list, value: float) -> None:
    data = encode_signed(_with_codebook(update, value), RUN, SPEC, WINDOW, 0, keys[0])
    with pytest.raises(DecodeError, match=r"cap|outside"):
        wire.decode_update(data, SPEC, RUN.codec)
    with pytest.raises(DecodeError):
        check_update(data, 0, keys[0].ss58_address, RUN, SPEC, WINDOW)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_values_are_refused(keys: list, update: list, value: float) -> None:
    data = encode_signed(_with_codebook(update, value), RUN, SPEC, WINDOW, 0, keys[0])
    with pytest.raises(DecodeError):
        check_update(data, 0, keys[0].ss58_address, RUN, SPEC, WINDOW)


def test_the_cap_is_inclusive() -> None:
    one = int((SCALE_LUT == 1.0).nonzero()[0])
    codes = torch.zeros(3, 4, dtype=torch.uint8)
    scales = torch.full((3,), one << 2, dtype=torch.uint8)
    validate(codes, scales, torch.tensor([[0.5, 1.0]]), max_abs=1.0)  # exactly at the cap
    above = float(torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)))
    with pytest.raises(DecodeError, match="cap"):
        validate(codes, scales, torch.tensor([[0.5, above]]), max_abs=1.0)


def test_an_honest_encoder_clamps_and_keeps_the_rest_in_error_feedback() -> None:
    params = CodecParams(tile=16, k=8, max_abs_value=0.25)
    spec = ModelSpec.from_shapes({"w": (32, 32)})
    comp = Compressor(spec, params)
    delta = torch.randn(32, 32, generator=torch.Generator().manual_seed(0)) * 0.01
    delta[0, 0], delta[5, 7] = 40.0, -9.0  # far above the cap
    sparse = comp.compress("w", delta, beta=0.95)
    sparse.validate(params)  # decodable by everyone
    dense = torch.zeros(32, 32)
    from codec.compress import scatter_add

    scatter_add(dense, sparse, params)
    assert float(dense.abs().max()) <= 0.25
    assert dense[0, 0] > 0 and dense[5, 7] < 0  # sent, clamped
    ef = comp.error("w")
    assert ef[0, 0] == pytest.approx(40.0 - float(dense[0, 0]))  # the rest is kept for later
    assert ef[5, 7] == pytest.approx(-9.0 - float(dense[5, 7]))


# -- verify first ----------------------------------------------------------------------------------


def test_signature_from_another_key_or_flipped_is_refused(keys: list, update: list) -> None:
    good = encode_signed(update, RUN, SPEC, WINDOW, 0, keys[0])
    check_update(good, 0, keys[0].ss58_address, RUN, SPEC, WINDOW)
    other = encode_signed(update, RUN, SPEC, WINDOW, 0, keys[1])  # meta says key 0's hotkey?
    header, _ = wire.read_header(other)
    forged = wire.with_signature(
        other, header.sig, meta={**header.meta, "hotkey": keys[0].ss58_address}
    )
    with pytest.raises(SignatureError):
        check_update(forged, 0, keys[0].ss58_address, RUN, SPEC, WINDOW)
    header, _ = wire.read_header(good)
    flipped = bytearray(header.sig)
    flipped[7] ^= 1
    with pytest.raises(SignatureError):
        check_update(
            wire.with_signature(good, bytes(flipped)), 0, keys[0].ss58_address, RUN, SPEC, WINDOW
        )


def test_a_header_edited_after_signing_is_refused(keys: list, update: list) -> None:
    good = encode_signed(update, RUN, SPEC, WINDOW, 0, keys[0])
    header, payload = wire.read_header(good)
    edits = [
        {"codes_zstd": not header.codes_zstd},
        {"k": header.k + 1},
        {"tensors": header.tensors[::-1]},
        {"digest": bytes(32)},
    ]
    for edit in edits:
        tampered = wire._frame(header.model_copy(update=edit), payload)
        with pytest.raises(SignatureError):
            check_update(tampered, 0, keys[0].ss58_address, RUN, SPEC, WINDOW)


def test_a_bad_signature_is_refused_before_the_payload_is_decoded(keys: list, update: list) -> None:
    good = encode_signed(update, RUN, SPEC, WINDOW, 0, keys[0])
    header, payload = wire.read_header(good)
    garbage = bytes(b ^ 0xFF for b in payload)  # undecodable, digest mismatch
    bad = wire._frame(header.model_copy(update={"sig": bytes(64)}), garbage)
    with pytest.raises(SignatureError):  # a decoder running first would raise DecodeError
        check_update(bad, 0, keys[0].ss58_address, RUN, SPEC, WINDOW)
