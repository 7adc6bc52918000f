"""The window's consensus against hostile members: split views, forged manifests, bounded steps.

Real components throughout: the real codec and signatures, file:// buckets for the validator's
published aggregate and manifest, and the one outer step applied to real models.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from codec.aggregate import aggregate, update_norm
from codec.chunking import ChunkLayout
from codec.compress import SparseTensor, densify
from codec.spec import ModelSpec
from node.model.fingerprint import fingerprint
from node.model.llama import build_model
from node.strategy import make_strategy
from node.window.buckets import PeerBucket
from node.window.consensus import Roster, agree, local_choice
from node.window.exchange import check_update, encode_signed
from node.window.gather import Fetched
from node.window.history import publish_aggregate
from node.window.manifest import (
    Entry,
    ManifestError,
    WindowManifest,
    bytes_digest,
    publish_manifest,
    read_manifest,
)
from protocol.chain.models import Metagraph, Neuron
from protocol.keys import create_hotkey
from protocol.naming import ObjectKind, aggregate_key, applied_key
from protocol.runconfig import RunConfig
from protocol.signing import payload_digest, sign_object
from protocol.stores import ObjectExists, ObjectStore, open_store
from protocol.stores.spool import InMemory
from tests.support.clip_reference import chunk_clipped_mean
from tests.support.directions import along

RUN = RunConfig.preset("tiny", name="consensus", inner_steps=2)
SPEC = ModelSpec.from_module(build_model(RUN.model, RUN.seed))
WINDOW = 2
LEAD = 9
CAP = 1 << 20


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("wallets")
    return {uid: create_hotkey("c", f"k{uid}", root=root) for uid in (0, 1, 2, 3, 4, LEAD)}


def _honest(uid: int, shared: dict[str, torch.Tensor], scale: float = 1.0) -> list[SparseTensor]:
    """A peer's compressed update: a shared direction plus its own noise."""
    return along(SPEC, RUN.codec, 100 + uid, shared, scale)


@pytest.fixture(scope="module")
def shared() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {t.name: 1e-3 * torch.randn(t.shape, generator=gen) for t in SPEC.tensors}


def _fetched(uid: int, data: bytes, keys: dict) -> Fetched:
    update = check_update(data, uid, keys[uid].ss58_address, RUN, SPEC, WINDOW)
    return Fetched(uid, update, "ok", InMemory.of(data), None, len(data))


def _roster(keys: dict, lead_store: ObjectStore, selected: list[int]) -> Roster:
    neurons = [
        Neuron(
            uid=u,
            hotkey=k.ss58_address,
            stake=10.0 if u == LEAD else 0.0,
            validator_permit=u == LEAD,
        )
        for u, k in keys.items()
    ]
    meta = Metagraph(netuid=1, block=40, neurons=neurons)
    lead = PeerBucket(LEAD, keys[LEAD].ss58_address, lead_store)
    return Roster(WINDOW, 40, meta, {LEAD: lead}, {}, selected, (lead,))


def _decide(
    store: ObjectStore, keys: dict, applied: dict[int, bytes], start_fp: str
) -> WindowManifest:
    """What the lead validator publishes: the aggregate bytes, then the signed manifest."""
    lead = keys[LEAD]
    publish_aggregate(
        store, RUN, WINDOW, LEAD, lead, applied, {u: keys[u].ss58_address for u in applied}
    )
    manifest = WindowManifest(
        run_id=RUN.run_id, window=WINDOW, roster_block=40, validator_uid=LEAD,
        validator_hotkey=lead.ss58_address, fingerprint_start=start_fp,
        entries=tuple(
            Entry(uid=u, hotkey=keys[u].ss58_address, digest=bytes_digest(d), size=len(d))
            for u, d in sorted(applied.items())
        ),
    )  # fmt: skip
    publish_manifest(store, manifest, lead)
    return read_manifest(store, RUN.run_id, WINDOW, LEAD, lead.ss58_address, CAP)


def _apply(updates: dict) -> str:
    model = build_model(RUN.model, RUN.seed)
    strategy = make_strategy(RUN, SPEC)
    strategy.outer.step(
        model, strategy.aggregator.mean({u: up.tensors for u, up in updates.items()}), WINDOW
    )
    return fingerprint(model)


# -- agreement -----------------------------------------------------------------------------------


def test_a_bucket_serving_different_bytes_cannot_fork_honest_nodes(
    tmp_path: Path, keys: dict, shared: dict
) -> None:
    """uid 3 serves version A to the validator and node X, version B to node Y, nothing to Z."""
    honest = {u: encode_signed(_honest(u, shared), RUN, SPEC, WINDOW, u, keys[u]) for u in range(3)}
    version_a = encode_signed(_honest(3, shared), RUN, SPEC, WINDOW, 3, keys[3])
    version_b = encode_signed(_honest(3, shared, scale=-1.0), RUN, SPEC, WINDOW, 3, keys[3])
    store = open_store(f"file://{tmp_path}?bucket=lead")
    start_fp = fingerprint(build_model(RUN.model, RUN.seed))
    manifest = _decide(store, keys, {**honest, 3: version_a}, start_fp)
    roster = _roster(keys, store, [0, 1, 2, 3])

    base = {u: _fetched(u, d, keys) for u, d in honest.items()}
    views = {
        "x": {**base, 3: _fetched(3, version_a, keys)},
        "y": {**base, 3: _fetched(3, version_b, keys)},
        "z": dict(base),
    }
    # on their own, the nodes would apply three different things...
    assert len({_apply(local_choice(roster, v)) for v in views.values()}) == 3
    # ...with the manifest they apply exactly the validator's bytes
    agreed = {name: agree(roster, v, manifest, start_fp, RUN, SPEC) for name, v in views.items()}
    assert all(a.manifest is not None and not a.forked for a in agreed.values())
    fps = {_apply(a.updates) for a in agreed.values()}
    assert fps == {_apply({u: f.update for u, f in views["x"].items()})}


def test_a_forked_node_learns_it_from_the_manifest(
    tmp_path: Path, keys: dict, shared: dict
) -> None:
    honest = {u: encode_signed(_honest(u, shared), RUN, SPEC, WINDOW, u, keys[u]) for u in range(2)}
    store = open_store(f"file://{tmp_path}?bucket=lead")
    manifest = _decide(store, keys, honest, "ab" * 16)
    roster = _roster(keys, store, [0, 1])
    fetched = {u: _fetched(u, d, keys) for u, d in honest.items()}
    assert agree(roster, fetched, manifest, "cd" * 16, RUN, SPEC).forked
    assert not agree(roster, fetched, manifest, "ab" * 16, RUN, SPEC).forked


def test_a_hostile_lead_cannot_inject_updates(tmp_path: Path, keys: dict, shared: dict) -> None:
    honest = {u: encode_signed(_honest(u, shared), RUN, SPEC, WINDOW, u, keys[u]) for u in range(2)}
    fetched = {u: _fetched(u, d, keys) for u, d in honest.items()}
    start_fp = "ab" * 16

    # a uid the roster did not select
    store = open_store(f"file://{tmp_path}?bucket=lead1")
    extra = encode_signed(_honest(4, shared), RUN, SPEC, WINDOW, 4, keys[4])
    manifest = _decide(store, keys, {**honest, 4: extra}, start_fp)
    out = agree(_roster(keys, store, [0, 1]), fetched, manifest, start_fp, RUN, SPEC)
    assert out.manifest is None and out.updates == {}  # every honest node refuses it alike

    # bytes for uid 1 that uid 1 never signed (the lead signs them itself)
    store = open_store(f"file://{tmp_path}?bucket=lead2")
    forged = encode_signed(_honest(1, shared, scale=50.0), RUN, SPEC, WINDOW, 1, keys[LEAD])
    manifest = _decide(store, keys, {0: honest[0], 1: forged}, start_fp)
    out = agree(_roster(keys, store, [0, 1]), fetched, manifest, start_fp, RUN, SPEC)
    assert out.manifest is None and out.updates == {} and "does not verify" in out.note


# -- the manifest itself -------------------------------------------------------------------------


def test_manifest_refuses_tampering_and_other_signers(tmp_path: Path, keys: dict) -> None:
    store = open_store(f"file://{tmp_path}?bucket=lead")
    lead = keys[LEAD]
    manifest = WindowManifest(
        run_id=RUN.run_id, window=WINDOW, roster_block=40, validator_uid=LEAD,
        validator_hotkey=lead.ss58_address, fingerprint_start="ab" * 16,
        entries=(Entry(uid=0, hotkey=keys[0].ss58_address, digest="0" * 64, size=10),),
    )  # fmt: skip
    key = publish_manifest(store, manifest, lead)
    read = lambda: read_manifest(store, RUN.run_id, WINDOW, LEAD, lead.ss58_address, CAP)  # noqa: E731
    assert read() == manifest

    raw = json.loads(store.get(key, CAP))
    raw["body"]["entries"] = []  # censorship after signing
    store.put(key, json.dumps(raw).encode())
    with pytest.raises(ManifestError, match="signature"):
        read()

    store.delete(key)
    publish_manifest(store, manifest, keys[0])  # signed by someone else
    with pytest.raises(ObjectExists):  # a manifest is published once
        publish_manifest(store, manifest, lead)
    with pytest.raises(ManifestError, match="signature"):
        read()

    for junk in (
        b"[]",
        b'{"body": 1, "sig": "00"}',
        b"\xff" * 40,
        json.dumps({"body": {}, "sig": "0" * 128}).encode(),
    ):
        store.put(applied_key(RUN.run_id, WINDOW, LEAD, lead.ss58_address), junk)
        with pytest.raises(ManifestError):
            read()


def test_a_lead_cannot_sign_its_way_past_the_manifest_rules(tmp_path: Path, keys: dict) -> None:
    """Each rule refuses a manifest the lead really signed: duplicated entries (one update
    counted twice would pass the median-norm bound twice), long reasons, another window's
    manifest replayed, extra keys beside the body, a signature that is not 64 bytes of hex."""
    store = open_store(f"file://{tmp_path}?bucket=lead")
    lead = keys[LEAD]
    key = applied_key(RUN.run_id, WINDOW, LEAD, lead.ss58_address)
    entry = Entry(uid=0, hotkey=keys[0].ss58_address, digest="0" * 64, size=10)
    good = WindowManifest(
        run_id=RUN.run_id, window=WINDOW, roster_block=40, validator_uid=LEAD,
        validator_hotkey=lead.ss58_address, fingerprint_start="ab" * 16, entries=(entry,),
    ).model_dump(mode="json")  # fmt: skip

    def put(body: dict, extra: dict | None = None, sig: str | None = None) -> None:
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        signed = sign_object(
            lead, ObjectKind.APPLIED, RUN.run_id, body["window"], LEAD, payload_digest(canonical)
        )
        obj = {"body": body, "sig": signed.hex() if sig is None else sig, **(extra or {})}
        store.put(key, json.dumps(obj).encode())

    def refused(rule: str) -> None:
        with pytest.raises(ManifestError, match=rule):
            read_manifest(store, RUN.run_id, WINDOW, LEAD, lead.ss58_address, CAP)

    put(good)
    assert read_manifest(store, RUN.run_id, WINDOW, LEAD, lead.ss58_address, CAP).uids == [0]
    twice = good["entries"] * 2
    put({**good, "entries": twice})
    refused("each uid once")
    put({**good, "entries": [entry.model_copy(update={"uid": 3}).model_dump(), *good["entries"]]})
    refused("sorted by uid")
    put({**good, "rejected": {"4": "x" * 201}})
    refused("reason too long")
    put({**good, "window": WINDOW - 1})  # last window's manifest, served at this window's key
    refused("manifest names")
    put(good, extra={"note": "unsigned"})
    refused("exactly")
    put(good, sig="ab" * 63)
    refused("64 bytes of hex")


# -- bounded influence ---------------------------------------------------------------------------


def _scaled(update: list[SparseTensor], factor: float) -> list[SparseTensor]:
    return [SparseTensor(s.name, s.shape, s.groups, s.codebook * factor) for s in update]


def test_one_update_moves_the_model_at_most_the_median_norm(shared: dict) -> None:
    """An honest update with its values ×5 is above the bound in every chunk, so it is clipped
    to the bound everywhere: ×50 moves the model as ×5 does, and the mean is the per-chunk rule
    computed from the dense updates."""
    honest = {u: _honest(u, shared) for u in range(3)}
    scaled = _scaled(_honest(0, shared), 5.0)  # an honest update, values x5
    updates = {**honest, 3: scaled}
    norms = sorted(update_norm(u) for u in updates.values())
    assert update_norm(scaled) > 4 * norms[1]  # the lower median of four
    strategy = make_strategy(RUN, SPEC)
    mean = strategy.aggregator.mean(updates)
    louder = strategy.aggregator.mean({**honest, 3: _scaled(_honest(0, shared), 50.0)})
    for n in mean:
        torch.testing.assert_close(louder[n], mean[n], rtol=1e-5, atol=1e-9)
    for t in SPEC.tensors:
        dense = [densify(up[i], RUN.codec) for up in updates.values() for i in range(len(up))
                 if up[i].name == t.name]  # fmt: skip
        ref = chunk_clipped_mean(dense, ChunkLayout.for_shape(t.shape, RUN.codec))
        torch.testing.assert_close(mean[t.name].double(), ref, rtol=1e-5, atol=1e-8)
    unclipped = aggregate(updates, SPEC, RUN.codec, clip_to_median=False)
    assert not all(torch.equal(mean[n], unclipped[n]) for n in mean)


def test_a_manifest_whose_aggregate_is_missing_applies_nothing_instead_of_crashing(
    tmp_path: Path, keys: dict, shared: dict
) -> None:
    """A lead (hostile or unlucky) whose aggregate object answers 404: the node that needs the
    lead's copy of an entry applies nothing and knows the lead's start, it does not raise out of
    `agree`."""
    data = {u: encode_signed(_honest(u, shared), RUN, SPEC, WINDOW, u, keys[u]) for u in range(2)}
    store = open_store(f"file://{tmp_path}?bucket=lead")
    start_fp = fingerprint(build_model(RUN.model, RUN.seed))
    manifest = _decide(store, keys, data, start_fp)
    store.delete(aggregate_key(RUN.run_id, WINDOW, LEAD, keys[LEAD].ss58_address))
    fetched = {0: _fetched(0, data[0], keys)}  # we never got uid 1's bytes
    out = agree(_roster(keys, store, [0, 1]), fetched, manifest, start_fp, RUN, SPEC)
    assert out.manifest is None and out.updates == {}
    assert out.note.startswith("manifest unusable")
    assert out.lead_fingerprint == start_fp and not out.forked
