"""Catch-up against hostile published history: never a crash, never an allocation the run does
not allow, always the next validator.

Each hostile object is written into a real store (the embedded file store, or a hostile S3
server on loopback for a refused listing) under the exact key a validator would use, then read
through `node.window.history` as a late peer or a resyncing node would.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
import tracemalloc
from functools import partial
from pathlib import Path

import msgpack
import pytest
import torch
from safetensors.torch import save as save_safetensors

from codec.compress import Compressor
from codec.spec import ModelSpec
from lab.sim.slow_store import SlowStore
from node.model.fingerprint import fingerprint
from node.model.llama import build_model
from node.strategy import make_strategy
from node.strategy.aggregator import Aggregator
from node.strategy.outer import OuterOptimizer
from node.window.exchange import encode_signed
from node.window.history import (
    HistoryCaps,
    HistoryError,
    Source,
    catch_up,
    catch_up_any,
    latest_checkpoint,
    publish_aggregate,
    publish_checkpoint,
    read_aggregate_bytes,
    resync,
)
from protocol.credentials import ReadCredentials
from protocol.keys import create_hotkey
from protocol.naming import ObjectKind, aggregate_key, checkpoint_key, manifest_key
from protocol.runconfig import RunConfig
from protocol.signing import payload_digest, sign_object
from protocol.stores import ObjectStore, S3Store, open_store

RUN = RunConfig.preset("tiny", name="hostile-history")
WINDOWS = 3


class World:
    """Two peers' signed updates for `WINDOWS` windows, an honest validator's published history
    of them, and the fingerprint after each window."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.keys = [create_hotkey("w", f"k{i}", root=root / "wallets") for i in range(4)]
        self.peers = {i: k.ss58_address for i, k in enumerate(self.keys)}
        self.good = self.source(2, "good")
        self.evil_key = self.keys[3]
        model = build_model(RUN.model, RUN.seed)
        self.spec = ModelSpec.from_module(model)
        comps = [Compressor(self.spec, RUN.codec) for _ in range(2)]
        gen = torch.Generator().manual_seed(0)
        self.raw: dict[int, dict[int, bytes]] = {}
        self.fingerprints = {0: fingerprint(model)}
        for w in range(WINDOWS):
            self.raw[w] = {}
            for uid in range(2):
                sparse = [
                    comps[uid].compress(n, torch.randn(p.shape, generator=gen) * 1e-3, 0.95)
                    for n, p in model.named_parameters()
                ]
                self.raw[w][uid] = encode_signed(sparse, RUN, self.spec, w, uid, self.keys[uid])
            publish_aggregate(self.good.store, RUN, w, 2, self.keys[2], self.raw[w], self.peers)  # type: ignore[arg-type]
            catch_up(model, *self.replay(), self.good, w, w + 1)
            self.fingerprints[w + 1] = fingerprint(model)

    def replay(self) -> tuple[Aggregator, OuterOptimizer]:
        """A fresh strategy's aggregator and outer step (its outer state starts empty)."""
        strategy = make_strategy(RUN, self.spec)
        return strategy.aggregator, strategy.outer

    def source(self, uid: int, bucket: str) -> Source:
        return Source(uid, self.keys[uid].ss58_address, self.store(bucket))

    def store(self, bucket: str) -> ObjectStore:
        return open_store(f"file://{self.root}?bucket={bucket}")

    def evil(self, bucket: str = "evil") -> Source:
        """A validator (uid 3) whose bucket holds whatever a test writes into it."""
        return Source(3, self.evil_key.ss58_address, self.store(bucket))

    def refusing(self, endpoint: str) -> Source:
        """A validator whose (hostile S3) endpoint refuses every request, listings included."""
        key = ReadCredentials(access_key_id="r", secret_access_key="s")
        return Source(3, self.evil_key.ss58_address, S3Store("evil", key, endpoint=endpoint))

    def put_aggregate(self, source: Source, window: int, outer: bytes) -> None:
        source.store.put(aggregate_key(RUN.run_id, window, source.uid, source.hotkey), outer)  # type: ignore[attr-defined]

    def signed_body(self, window: int, body: bytes) -> bytes:
        sig = sign_object(
            self.evil_key, ObjectKind.AGGREGATE, RUN.run_id, window, 3, payload_digest(body)
        )
        return msgpack.packb({"body": body, "sig": sig})

    def manifest_sig(self, window: int, body: dict) -> str:
        """The evil validator's own signature over a checkpoint manifest body (hex)."""
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        digest = payload_digest(canonical)
        return sign_object(self.evil_key, ObjectKind.MANIFEST, RUN.run_id, window, 3, digest).hex()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return World(tmp_path_factory.mktemp("history"))


def _body(window: object, updates: object, hotkeys: object) -> bytes:
    """An aggregate body as the writer lays it out, with any values."""
    return msgpack.packb({"window": window, "hotkeys": hotkeys, "updates": updates})


def _read(world: World, source: Source, window: int = 0) -> dict[int, bytes]:
    return read_aggregate_bytes(source.store, RUN, world.spec, window, source.uid, source.hotkey)


# -- types before anything is hashed or allocated --------------------------------------------------


def test_an_integer_body_is_refused_before_anything_is_allocated(world: World) -> None:
    """The reproduced crash: `bytes(body)` of a 9-byte object's integer allocated 200 MB."""
    evil = world.evil("int-body")
    world.put_aggregate(evil, 0, msgpack.packb({"body": 200_000_000, "sig": b"x" * 64}))
    tracemalloc.start()
    try:
        with pytest.raises(HistoryError, match="must be bytes"):
            _read(world, evil)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize(
    ("outer", "rule"),
    [
        (msgpack.packb({"body": "a string, not bytes", "sig": b"x" * 64}), "must be bytes"),
        (msgpack.packb({"body": b"x", "sig": "a string"}), "must be bytes"),
        (msgpack.packb({"body": b"x", "sgn": b"x" * 64}), r"is not \{body, sig\}"),
        (msgpack.packb([b"body", b"sig"]), r"is not \{body, sig\}"),
        (msgpack.packb({"body": b"x", "sig": b"x" * 64, "extra": 1}), "not a valid history"),
        (b"\xc1\xc1\xc1 not msgpack at all", "not a valid history object"),
        (msgpack.packb({"body": b"x", "sig": b"x"}) + b"trailing", "not a valid history object"),
        (b"", "not a valid history object"),
    ],
    ids=[
        "str-body",
        "str-sig",
        "wrong-key",
        "array",
        "extra-field",
        "garbage",
        "trailing",
        "empty",
    ],
)
def test_malformed_aggregates_are_one_typed_error(world: World, outer: bytes, rule: str) -> None:
    evil = world.evil("malformed")
    world.put_aggregate(evil, 0, outer)
    with pytest.raises(HistoryError, match=rule):
        _read(world, evil)


def test_a_signed_body_with_wrong_types_is_refused(world: World) -> None:
    """The publisher's own valid signature over nonsense proves nothing: the body is checked."""
    evil = world.evil("wrong-types")
    hk = {0: world.peers[0]}
    for body, rule in (
        (msgpack.packb({"window": 0, "hotkeys": hk, "updates": {0: "not bytes"}}), "uid -> bytes"),
        (_body("0", {0: world.raw[0][0]}, hk), "does not match"),
        (_body(0, {-1: world.raw[0][0]}, {-1: world.peers[0]}), "uid -> bytes"),
        (
            msgpack.packb({"window": 0, "hotkeys": hk, "updates": [world.raw[0][0]]}),
            "does not match",
        ),
        (_body(1, {0: world.raw[0][0]}, hk), "does not match"),
        (msgpack.packb({"window": 0, "updates": {0: world.raw[0][0]}}), "window, hotkeys, updates"),
        (_body(0, {0: world.raw[0][0]}, {0: 5}), "hotkeys must name"),
    ):
        world.put_aggregate(evil, 0, world.signed_body(0, body))
        with pytest.raises(HistoryError, match=rule):
            _read(world, evil)


def test_an_aggregate_entry_without_its_hotkey_is_refused(world: World) -> None:
    """Every entry is verified under the hotkey the validator recorded for it at the window's
    roster: an entry without one is refused, not verified under today's metagraph."""
    evil = world.evil("unknown-uid")
    body = _body(0, {0: world.raw[0][0], 7: world.raw[0][1]}, {0: world.peers[0]})
    world.put_aggregate(evil, 0, world.signed_body(0, body))
    with pytest.raises(HistoryError, match="hotkeys must name every entry"):
        catch_up(build_model(RUN.model, RUN.seed), *world.replay(), evil, 0, 1)


def test_an_aggregate_over_the_run_cap_is_not_downloaded(world: World) -> None:
    cap = HistoryCaps.of(RUN, world.spec).aggregate
    evil = world.evil("oversize")
    world.put_aggregate(evil, 0, b"\x00" * (cap + 1))
    with pytest.raises(HistoryError):
        _read(world, evil)


def test_an_update_signed_by_someone_else_inside_a_signed_aggregate_is_refused(
    world: World,
) -> None:
    """A validator cannot put in bytes the peer did not sign: uid 1's update claimed for uid 0."""
    evil = world.evil("forged-entry")
    body = _body(0, {0: world.raw[0][1]}, {0: world.peers[0]})
    world.put_aggregate(evil, 0, world.signed_body(0, body))
    model = build_model(RUN.model, RUN.seed)
    with pytest.raises(HistoryError, match="uid 0"):
        catch_up(model, *world.replay(), evil, 0, 1)


# -- checkpoints and their manifests ---------------------------------------------------------------


def _manifest(world: World, source: Source, window: int, body: dict, sig: str) -> None:
    key = manifest_key(RUN.run_id, window, source.uid, source.hotkey)
    source.store.put(key, json.dumps({"body": body, "sig": sig}).encode())  # type: ignore[attr-defined]


def test_checkpoint_manifests_are_signed_typed_and_capped(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    evil = world.evil("checkpoints")
    model = build_model(RUN.model, RUN.seed)
    key = publish_checkpoint(evil.store, RUN, 1, 3, world.evil_key, model, outer={})  # type: ignore[arg-type]
    good = json.loads(evil.store.get(key, 4096))
    assert latest_checkpoint(evil, world.replay()[1], 1) is not None  # the untouched one loads

    cap = HistoryCaps.of(RUN, world.spec).checkpoint
    other = create_hotkey("w", "other", root=world.root / "wallets")
    forged_sig = sign_object(
        other, ObjectKind.MANIFEST, RUN.run_id, 1, 3, payload_digest(b"anything")
    ).hex()
    signed = partial(world.manifest_sig, 1)  # the evil validator signs its own lies
    huge = {**good["body"], "bytes": cap + 1}
    elsewhere = {**good["body"], "sha256": "0" * 64}
    cases = {
        "another signer": (good["body"], forged_sig, "does not verify"),
        "flipped signature": (good["body"], ("0" if good["sig"][0] != "0" else "1") + good["sig"][1:], "does not verify"),
        "bigger than the run allows": (huge, signed(huge), "claims"),
        "window as a string": ({**good["body"], "window": "1"}, good["sig"], "wrong types"),
        "bytes as a float": ({**good["body"], "bytes": float(good["body"]["bytes"])}, good["sig"], "wrong types"),
        "short signature": (good["body"], good["sig"][:-2], "wrong types"),
        "a field missing": ({k: v for k, v in good["body"].items() if k != "sha256"}, good["sig"], "wrong fields"),
        "another window's": ({**good["body"], "window": 2}, good["sig"], "names another object"),
        "another digest": (elsewhere, signed(elsewhere), "does not match its manifest"),
    }  # fmt: skip
    key = manifest_key(RUN.run_id, 1, evil.uid, evil.hotkey)
    raw = {
        "not JSON": (b"{not json", "is not JSON"),
        "beside the body": (json.dumps({**good, "note": 1}).encode(), r"is not \{body, sig\}"),
    }
    for name, (body, sig, rule) in cases.items():
        _manifest(world, evil, 1, body, sig)
        raw[name] = (evil.store.get(key, 4096), rule)
    for name, (data, rule) in raw.items():
        evil.store.put(key, data)  # type: ignore[attr-defined]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tessera.node.window.history"):
            assert latest_checkpoint(evil, world.replay()[1], 1) is None, name
        assert re.search(rule, caplog.text), (name, caplog.text)


def test_a_signed_checkpoint_of_the_wrong_content_is_refused(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    """Signed, matching its manifest's size and digest, and still refused by what it holds: bytes
    that are not safetensors, or tensors of another model."""
    evil = world.evil("wrong-content")
    other = build_model(RUN.model.model_copy(update={"n_layers": 1}), RUN.seed)
    for data, rule in [
        (b"\x00" * 4096, "is not safetensors"),
        (save_safetensors(dict(other.named_parameters())), "does not fit this model"),
    ]:
        evil.store.put(checkpoint_key(RUN.run_id, 1, 3, evil.hotkey), data)  # type: ignore[attr-defined]
        body = {"run_id": RUN.run_id, "window": 1, "uid": 3, "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest()}  # fmt: skip
        _manifest(world, evil, 1, body, world.manifest_sig(1, body))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tessera.node.window.history"):
            assert latest_checkpoint(evil, world.replay()[1], 1) is None
        assert rule in caplog.text, caplog.text


def test_a_checkpoint_that_is_not_the_model_is_refused(world: World) -> None:
    """Correctly signed, matching its manifest, yet NaN: never loaded."""
    evil = world.evil("nan-checkpoint")
    model = build_model(RUN.model, RUN.seed)
    with torch.no_grad():
        next(iter(model.parameters())).fill_(float("nan"))
    publish_checkpoint(evil.store, RUN, 1, 3, world.evil_key, model, outer={})  # type: ignore[arg-type]
    assert latest_checkpoint(evil, world.replay()[1], 1) is None
    assert evil.store.exists(checkpoint_key(RUN.run_id, 1, 3, evil.hotkey))


# -- falling through to the next validator ---------------------------------------------------------


def test_catch_up_falls_through_bad_validators_to_a_good_one(world: World) -> None:
    """Garbage, a refused listing and a forged history come first; the node still lands on the
    honest fingerprint, and a bad source never leaves its traces in the model."""
    garbage = world.evil("fallthrough-garbage")
    world.put_aggregate(garbage, 0, msgpack.packb({"body": 10**9, "sig": b""}))
    forged = world.evil("fallthrough-forged")
    only_one = _body(0, {0: world.raw[0][0]}, {0: world.peers[0]})  # valid, not what was applied
    world.put_aggregate(forged, 0, world.signed_body(0, only_one))
    world.put_aggregate(
        forged, 1, world.signed_body(1, _body(1, {0: b"junk"}, {0: world.peers[0]}))
    )
    with SlowStore(world.root, "deny") as endpoint:
        refusing = world.refusing(endpoint)
        model = build_model(RUN.model, RUN.seed)
        t0 = time.monotonic()
        reached = catch_up_any(
            model,
            *world.replay(),
            [garbage, refusing, forged, world.good],
            0,
            WINDOWS,
        )
        took = time.monotonic() - t0
    assert reached == WINDOWS
    assert fingerprint(model) == world.fingerprints[WINDOWS]
    assert took < 60


def test_a_window_one_validator_missed_is_taken_from_another(world: World) -> None:
    """The lead was down in window 1 (its history has windows 0 and 2), the standby in windows 0
    and 2: together they replay every window, on the honest fingerprint; the standby alone, or the
    lead alone, does not."""
    lead, standby = world.evil("hole-lead"), world.source(2, "hole-standby")
    for w in (0, 2):
        publish_aggregate(lead.store, RUN, w, 3, world.evil_key, world.raw[w], world.peers)  # type: ignore[arg-type]
    publish_aggregate(standby.store, RUN, 1, 2, world.keys[2], world.raw[1], world.peers)  # type: ignore[arg-type]
    for alone in (lead, standby):
        model = build_model(RUN.model, RUN.seed)
        assert catch_up_any(model, *world.replay(), [alone], 0, WINDOWS) < WINDOWS
    model = build_model(RUN.model, RUN.seed)
    assert catch_up_any(model, *world.replay(), [lead, standby], 0, WINDOWS) == WINDOWS
    assert fingerprint(model) == world.fingerprints[WINDOWS]


def test_a_refused_listing_is_a_history_error_not_a_crash(world: World) -> None:
    with SlowStore(world.root, "deny") as endpoint:
        refusing = world.refusing(endpoint)
        model = build_model(RUN.model, RUN.seed)
        with pytest.raises(HistoryError):
            catch_up(model, *world.replay(), refusing, 0, WINDOWS)


def test_resync_skips_a_source_whose_result_is_not_the_expected_model(world: World) -> None:
    """A forked node rebuilds from history and checks the result against the fingerprint it
    expects: a validator publishing a different (validly signed) history is skipped."""
    other = world.evil("other-history")
    publish_aggregate(other.store, RUN, 0, 3, world.evil_key, {0: world.raw[0][0]}, world.peers)  # type: ignore[arg-type]
    model = build_model(RUN.model, RUN.seed)
    with torch.no_grad():
        next(iter(model.parameters())).add_(1.0)  # forked
    forked = fingerprint(model)
    assert not resync(model, *world.replay(), [other], 1, world.fingerprints[1])
    assert fingerprint(model) == forked  # a failed resync leaves the model as it was
    assert resync(model, *world.replay(), [other, world.good], 1, world.fingerprints[1])
    assert fingerprint(model) == world.fingerprints[1]
