"""Dense updates on the wire (`codec.dense`): exact round trip, and every hostile input refused
with one `DecodeError` (or `SignatureError` through `check_update`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from codec import dense, wire
from codec.errors import DecodeError
from codec.frame import pack_header, unpack_header
from codec.spec import ModelSpec
from node.strategy import make_strategy
from node.window.exchange import check_update, encode_signed
from protocol.keys import create_hotkey
from protocol.runconfig import RunConfig
from protocol.signing import SignatureError

SPEC = ModelSpec.from_shapes({"w": (48, 80), "b": (200,), "x": (3, 5, 9)})
CAP = 1.0


def _update(dtype: dense.DenseType, seed: int = 0) -> list[dense.DenseTensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        dense.DenseTensor(
            t.name,
            tuple(t.shape),
            dense.to_wire_precision(torch.randn(t.shape, generator=gen) * 0.01, dtype, CAP),
        )
        for t in SPEC.tensors
    ]


def _decode(data: bytes, dtype: dense.DenseType = "bf16") -> dense.DecodedDense:
    return dense.decode_dense(data, SPEC, dtype, CAP, dense.dense_bytes(SPEC, dtype))


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_round_trip_is_exact(dtype: dense.DenseType) -> None:
    update = _update(dtype)
    data = dense.encode_dense(update, dtype, SPEC, meta={"uid": 3})
    decoded = _decode(data, dtype)
    assert decoded.header.meta == {"uid": 3}
    assert [t.name for t in decoded.tensors] == [t.name for t in SPEC.tensors]
    for a, b in zip(update, decoded.tensors, strict=True):
        assert torch.equal(a.values, b.values)
    assert len(data) <= dense.dense_bytes(SPEC, dtype)
    assert len(data) > dense.ITEMSIZE[dtype] * SPEC.numel


def _parts(data: bytes) -> tuple[dict, bytes]:
    raw, payload = dense.FRAME.split(data, len(data))
    return dict(unpack_header(raw)), bytes(payload)


def _reframe(header: dict, payload: bytes, fix_digest: bool = True) -> bytes:
    if fix_digest:
        header["digest"] = dense.payload_digest(payload)
        header["payload_bytes"] = len(payload)
    return dense.FRAME.pack(pack_header(header), payload)


def _with_value(value: float) -> bytes:
    header, payload = _parts(dense.encode_dense(_update("fp32"), "fp32", SPEC))
    values = np.frombuffer(payload, dtype="<f4").copy()
    values[7] = value
    return _reframe(header, values.tobytes())


def test_hostile_inputs_are_refused() -> None:
    good = dense.encode_dense(_update("bf16"), "bf16", SPEC)
    header, payload = _parts(good)
    other_spec = ModelSpec.from_shapes({"w": (48, 80), "b": (200,), "x": (3, 5, 8)})
    reordered = dense.FRAME.pack(pack_header(dict(reversed(list(header.items())))), payload)
    cases = {  # each case with the rule that must refuse it (a later rule may not stand in)
        "sparse bytes": (
            wire.encode_update([], wire.CodecParams(), ModelSpec(tensors=())), "bad magic"
        ),
        "truncated": (good[: len(good) // 2], "header says"),
        "extra byte": (good + b"\x00", "header says"),
        "flipped payload bit": (good[:-5] + bytes([good[-5] ^ 1]) + good[-4:], "dense payload digest"),
        "non-canonical header": (reordered, "canonical form"),
        "short payload, fixed digest": (_reframe(dict(header), payload[:-2]), "the spec needs bf16"),
        "unknown header field": (_reframe({**header, "extra": 1}, payload), "Extra inputs"),
        "table row of three": (
            _reframe({**header, "tensors": [[*t, 1] for t in header["tensors"]]}, payload),
            "malformed tensor table",
        ),
        "table not the spec's": (
            _reframe({**header, "tensors": (*header["tensors"][:2], ("x", (5, 3, 9)))}, payload),
            "tensor table does not match",
        ),
        "another codec version": (
            _reframe({**header, "codec_version": header["codec_version"] + 1}, payload),
            "codec version",
        ),
        "another spec's digest": (
            _reframe({**header, "spec_digest": "0" * 32}, payload),
            "another model spec",
        ),
    }  # fmt: skip
    for name, (data, rule) in cases.items():
        with pytest.raises(DecodeError, match=rule):
            _decode(data)
            pytest.fail(name)
    with pytest.raises(DecodeError, match="exceeds"):
        dense.decode_dense(good, SPEC, "bf16", CAP, len(good) - 1)
    with pytest.raises(DecodeError, match="bf16"):
        dense.decode_dense(good, SPEC, "fp32", CAP, 1 << 30)
    with pytest.raises(DecodeError, match="spec"):
        dense.decode_dense(good, other_spec, "bf16", CAP, 1 << 30)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_are_refused_with_a_matching_digest(value: float) -> None:
    with pytest.raises(DecodeError, match="non-finite"):
        _decode(_with_value(value), "fp32")


def test_values_above_the_run_cap_are_refused_and_clamped_by_the_encoder() -> None:
    with pytest.raises(DecodeError, match="cap"):
        _decode(_with_value(1.5), "fp32")
    _decode(_with_value(-CAP), "fp32")  # the cap itself is allowed
    clamped = dense.to_wire_precision(torch.tensor([3.0, -7.0, 0.5]), "bf16", CAP)
    assert clamped.tolist() == [1.0, -1.0, 0.5]


def test_fuzzed_mutations_only_raise_decode_error() -> None:
    rng = np.random.default_rng(7)
    good = dense.encode_dense(_update("bf16", 1), "bf16", SPEC)
    for _ in range(300):
        data = bytearray(good)
        pos = int(rng.integers(0, len(data)))
        if rng.random() < 0.5:
            data[pos] ^= 1 << int(rng.integers(0, 8))
        else:
            data = data[:pos]
        try:
            _decode(bytes(data))
        except DecodeError:
            continue
        # a mutation that still decodes hit only meta or sig, which the signature covers
        assert (
            dense.read_dense_header(bytes(data), len(data))[0].digest == _parts(good)[0]["digest"]
        )


def test_a_diloco_run_verifies_before_it_decodes(tmp_path: Path) -> None:
    run = RunConfig.preset("tiny", name="dense-wire", strategy="diloco")
    spec = ModelSpec.from_shapes({"w": (64, 64), "n": (64,)})
    key, other = (create_hotkey("w", n, root=tmp_path) for n in ("a", "b"))
    strategy = make_strategy(run, spec)
    gen = torch.Generator().manual_seed(2)
    update = strategy.encoder.encode(
        {t.name: torch.randn(t.shape, generator=gen) * 1e-3 for t in spec.tensors}, 3
    )
    data = encode_signed(update, run, spec, 3, 5, key)
    decoded = check_update(data, 5, key.ss58_address, run, spec, 3)
    assert all(
        torch.equal(a.values, b.values) for a, b in zip(update, decoded.tensors, strict=True)
    )
    with pytest.raises(DecodeError, match="meta"):
        check_update(data, 5, key.ss58_address, run, spec, 4)  # another window
    header, payload = _parts(data)
    relabelled = {**header, "meta": {**header["meta"], "hotkey": other.ss58_address}}
    with pytest.raises(SignatureError):  # another peer's bytes claimed under its own hotkey
        check_update(_reframe(relabelled, payload, False), 5, other.ss58_address, run, spec, 3)
    with pytest.raises(SignatureError):
        check_update(
            _reframe({**header, "sig": bytes(64)}, payload, False),
            5,
            key.ss58_address,
            run,
            spec,
            3,
        )
    sparse_run = RunConfig.preset("tiny", name="dense-wire")  # a sparse run refuses dense bytes
    with pytest.raises(DecodeError, match="magic"):
        check_update(data, 5, key.ss58_address, sparse_run, spec, 3)


def test_the_encoder_and_the_adder_refuse_what_does_not_fit_the_spec() -> None:
    update = _update("fp32")
    with pytest.raises(ValueError, match="every tensor of the spec"):
        dense.encode_dense(update[::-1], "fp32", SPEC)
    first = update[0]
    bent = dense.DenseTensor(first.name, first.shape, first.values.reshape(-1))
    with pytest.raises(ValueError, match=f"{first.name}: shape"):
        dense.encode_dense([bent, *update[1:]], "fp32", SPEC)
    with pytest.raises(ValueError, match="out must be float32"):
        dense.add_dense(torch.zeros(first.shape, dtype=torch.float64), first)
    with pytest.raises(ValueError, match="out must be float32"):
        dense.add_dense(torch.zeros(3), first)
