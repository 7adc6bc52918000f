"""A peer that signs two updates for one window and serves one to the lead and the other to a
follower validator: the follower applies the lead's bytes (the consensus rule), and marks the peer
``equivocation`` (paid nothing), since both versions verify under the peer's signature."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from codec.spec import ModelSpec
from lab.sim.forgeries import noise_update
from node.model.fingerprint import fingerprint
from node.model.llama import build_model
from node.window.buckets import PeerBucket
from node.window.consensus import Roster, agree
from node.window.exchange import check_update, encode_signed
from node.window.gather import Fetched
from node.window.history import publish_aggregate
from node.window.manifest import (
    Entry,
    WindowManifest,
    bytes_digest,
    publish_manifest,
    read_manifest,
)
from protocol.chain.models import Metagraph, Neuron
from protocol.keys import create_hotkey
from protocol.runconfig import RunConfig
from protocol.stores import open_store
from protocol.stores.spool import InMemory
from validator.agreement import mark_equivocations
from validator.checks import Verdict
from validator.classify import PeerCheck
from validator.config import ValidatorConfig
from validator.fetching import Upload
from validator.ratings import severity

RUN = RunConfig.preset("tiny", name="equivocation", inner_steps=2)
SPEC = ModelSpec.from_module(build_model(RUN.model, RUN.seed))
WINDOW, LEAD = 2, 9


def test_a_peer_serving_two_signed_updates_is_marked_by_the_follower(tmp_path: Path) -> None:
    keys = {u: create_hotkey("e", f"k{u}", root=tmp_path / "wallets") for u in (0, 1, LEAD)}
    version = {
        name: encode_signed(
            noise_update(SPEC, RUN, 0.01, torch.Generator().manual_seed(seed)),
            RUN, SPEC, WINDOW, 1, keys[1],
        )
        for name, seed in (("lead's", 1), ("follower's", 2))
    }  # fmt: skip
    honest = encode_signed(
        noise_update(SPEC, RUN, 0.01, torch.Generator().manual_seed(3)),
        RUN,
        SPEC,
        WINDOW,
        0,
        keys[0],
    )
    store = open_store(f"file://{tmp_path}?bucket=lead")
    applied = {0: honest, 1: version["lead's"]}
    publish_aggregate(store, RUN, WINDOW, LEAD, keys[LEAD], applied)  # type: ignore[arg-type]
    start = fingerprint(build_model(RUN.model, RUN.seed))
    publish_manifest(
        store,  # type: ignore[arg-type]
        WindowManifest(
            run_id=RUN.run_id,
            window=WINDOW,
            roster_block=40,
            validator_uid=LEAD,
            validator_hotkey=keys[LEAD].ss58_address,
            fingerprint_start=start,
            entries=tuple(
                Entry(uid=u, hotkey=keys[u].ss58_address, digest=bytes_digest(d), size=len(d))
                for u, d in sorted(applied.items())
            ),
        ),
        keys[LEAD],
    )
    manifest = read_manifest(store, RUN.run_id, WINDOW, LEAD, keys[LEAD].ss58_address, 1 << 20)  # type: ignore[arg-type]
    neurons = [
        Neuron(uid=u, hotkey=k.ss58_address, stake=10.0 if u == LEAD else 0.0,
               validator_permit=u == LEAD)
        for u, k in keys.items()
    ]  # fmt: skip
    lead = PeerBucket(LEAD, keys[LEAD].ss58_address, store)  # type: ignore[arg-type]
    roster = Roster(
        40, Metagraph(netuid=1, block=40, neurons=neurons), {LEAD: lead}, {}, [0, 1], lead
    )

    # the follower fetched the honest update and the other version of uid 1's
    ours = {0: honest, 1: version["follower's"]}
    checks, fetched = {}, {}
    for u, data in ours.items():
        update = check_update(data, u, keys[u].ss58_address, RUN, SPEC, WINDOW)
        fetched[u] = Fetched(u, update, "ok", InMemory.of(data), None, len(data))
        upload = Upload(u, keys[u].ss58_address, fetched[u], None)
        checks[u] = PeerCheck(u, keys[u].ss58_address, upload, Verdict.OK, "ok")
    agreed = agree(roster, fetched, manifest, start, RUN, SPEC)
    assert agreed.manifest is not None and sorted(agreed.updates) == [0, 1]
    assert agreed.updates[1].digest != fetched[1].update.digest  # type: ignore[union-attr]

    assert mark_equivocations(checks, agreed) == [1]
    assert checks[1].verdict is Verdict.EQUIVOCATION and "window 2" in checks[1].detail
    assert checks[0].verdict is Verdict.OK
    assert severity(Verdict.EQUIVOCATION, ValidatorConfig()) == pytest.approx(
        severity(Verdict.COPY, ValidatorConfig())
    )
