"""Failover: the lead and a standby validator both decide every window; the lead's manifest
applies when it counts, the standby's when the lead's does not (silent, or stored after the
cutoff), and every node — peers, the lead, the standby — applies the same one.

Real components: the real codec and signatures, file:// buckets, the deciders' own `decide`.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from substrateinterface import Keypair

from codec.spec import ModelSpec
from lab.sim.forgeries import noise_update
from node.model.fingerprint import fingerprint
from node.model.llama import build_model
from node.window.buckets import PeerBucket
from node.window.consensus import (
    Roster,
    agree,
    manifest_cutoff_block,
    rank_deciders,
    wait_for_manifest,
)
from node.window.exchange import encode_signed
from node.window.history import read_aggregate_bytes
from node.window.manifest import WindowManifest, publish_manifest
from protocol.chain.models import Metagraph, Neuron
from protocol.keys import create_hotkey
from protocol.naming import applied_key
from protocol.stores import ObjectStore, open_store
from tests.support.chain_time import SteppingChain
from tests.support.lead_views import checked_views, cutoff_run, decide
from validator.admission import Admission

pytestmark = pytest.mark.usefixtures("fast_manifest_polls")
RUN = cutoff_run("failover")
SPEC = ModelSpec.from_module(build_model(RUN.model, RUN.seed))
WINDOW, LEAD, STANDBY, THIRD = 3, 9, 8, 7
START = fingerprint(build_model(RUN.model, RUN.seed))
CUTOFF = manifest_cutoff_block(RUN, WINDOW)
ALL = Admission(frozenset(range(100)))


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Keypair]:
    root = tmp_path_factory.mktemp("wallets")
    return {u: create_hotkey("f", f"k{u}", root=root) for u in (0, 1, THIRD, STANDBY, LEAD)}


def _roster(keys: dict[int, Keypair], root: Path) -> Roster:
    """Three validators with buckets (the lead most staked): the first two decide."""
    stake = {LEAD: 30.0, STANDBY: 20.0, THIRD: 10.0}
    neurons = [
        Neuron(uid=u, hotkey=k.ss58_address, stake=stake.get(u, 0.0), validator_permit=u in stake)
        for u, k in keys.items()
    ]
    buckets = {
        u: PeerBucket(u, keys[u].ss58_address, open_store(f"file://{root}?bucket=val{u}"))
        for u in stake
    }
    meta = Metagraph(netuid=1, block=40, neurons=neurons)
    return Roster(WINDOW, 40, meta, buckets, {}, [0, 1], rank_deciders(meta, buckets))


def _manifest(keys: dict[int, Keypair], uid: int, rejected: str) -> WindowManifest:
    return WindowManifest(
        run_id=RUN.run_id, window=WINDOW, roster_block=40, validator_uid=uid,
        validator_hotkey=keys[uid].ss58_address, fingerprint_start=START, entries=(),
        rejected={"0": rejected},
    )  # fmt: skip


def _store(roster: Roster, uid: int) -> ObjectStore:
    return roster.buckets[uid].store  # type: ignore[return-value]


def test_the_two_most_staked_validators_decide_in_rank(
    keys: dict[int, Keypair], tmp_path: Path
) -> None:
    roster = _roster(keys, tmp_path)
    assert [d.uid for d in roster.deciders] == [LEAD, STANDBY]
    assert roster.lead is not None and roster.lead.uid == LEAD
    assert roster.decider(THIRD) is None


def test_the_lead_s_manifest_wins_when_it_counts(keys: dict[int, Keypair], tmp_path: Path) -> None:
    roster = _roster(keys, tmp_path)
    publish_manifest(_store(roster, STANDBY), _manifest(keys, STANDBY, "standby"), keys[STANDBY])
    publish_manifest(_store(roster, LEAD), _manifest(keys, LEAD, "lead"), keys[LEAD])
    got = wait_for_manifest(roster, RUN, WINDOW, SteppingChain(CUTOFF - 5))
    assert got == _manifest(keys, LEAD, "lead")


def test_a_silent_lead_is_replaced_by_the_standby_on_every_node(
    keys: dict[int, Keypair], tmp_path: Path
) -> None:
    """The lead publishes nothing: a prompt node and a node reading long after the cutoff both
    apply the standby's manifest (without failover they would apply nothing)."""
    roster = _roster(keys, tmp_path)
    publish_manifest(_store(roster, STANDBY), _manifest(keys, STANDBY, "standby"), keys[STANDBY])
    prompt = wait_for_manifest(roster, RUN, WINDOW, SteppingChain(CUTOFF - 5))
    at_cutoff = SteppingChain(CUTOFF).first_at
    loaded = SteppingChain(CUTOFF + 300, first_at=at_cutoff + timedelta(seconds=300))
    assert prompt == wait_for_manifest(roster, RUN, WINDOW, loaded)
    assert prompt == _manifest(keys, STANDBY, "standby")


def test_a_lead_manifest_stored_after_the_cutoff_gives_way_to_the_standby_s(
    keys: dict[int, Keypair], tmp_path: Path
) -> None:
    """Both published; the standby's store dated its manifest 100 s ago, the lead's now, and the
    cutoff block's timestamp is 50 s ago: the lead's counts for nobody, the standby's applies."""
    roster = _roster(keys, tmp_path)
    publish_manifest(_store(roster, STANDBY), _manifest(keys, STANDBY, "standby"), keys[STANDBY])
    publish_manifest(_store(roster, LEAD), _manifest(keys, LEAD, "lead"), keys[LEAD])
    key = applied_key(RUN.run_id, WINDOW, STANDBY, keys[STANDBY].ss58_address)
    earlier = time.time() - 100
    os.utime(tmp_path / f"val{STANDBY}" / key, (earlier, earlier))
    now = SteppingChain(0).first_at
    chain = SteppingChain(CUTOFF + 10, first_at=now - timedelta(seconds=40))  # cutoff: 50 s ago
    assert wait_for_manifest(roster, RUN, WINDOW, chain) == _manifest(keys, STANDBY, "standby")


def _uploads(keys: dict[int, Keypair]) -> tuple:
    data = {
        u: encode_signed(
            noise_update(SPEC, RUN, 0.01, torch.Generator().manual_seed(u)), RUN, SPEC, WINDOW, u,
            keys[u],
        )
        for u in (0, 1)
    }  # fmt: skip
    return checked_views(data, keys, RUN, SPEC, WINDOW)


def test_the_standby_decides_alone_and_every_node_applies_its_set(
    keys: dict[int, Keypair], tmp_path: Path
) -> None:
    """The lead is down: the standby publishes its decision, applies it, and a peer that holds
    none of the bytes resolves every entry from the standby's aggregate; the lead, back for the
    next read, follows the standby's manifest and its history says so."""
    roster = _roster(keys, tmp_path)
    _, uploads, checks = _uploads(keys)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    standby = decide(
        _store(roster, STANDBY), RUN, SPEC, keys[STANDBY], roster, checks, uploads, START,
        scratch, SteppingChain(CUTOFF - 20), ALL,
    )  # fmt: skip
    assert standby.manifest is not None and standby.manifest.validator_uid == STANDBY
    assert sorted(standby.updates) == [0, 1]
    manifest = wait_for_manifest(roster, RUN, WINDOW, SteppingChain(CUTOFF + 1))
    peer = agree(roster, {}, manifest, START, RUN, SPEC)  # holds no bytes of its own
    assert sorted(peer.updates) == [0, 1] and not peer.forked
    for u in (0, 1):
        assert peer.updates[u].digest == standby.updates[u].digest
    # the lead, restarted after the cutoff: too late to publish; it applies the standby's
    late = decide(
        _store(roster, LEAD), RUN, SPEC, keys[LEAD], roster, checks, uploads, START, scratch,
        SteppingChain(CUTOFF + 1), ALL,
    )  # fmt: skip
    assert late.manifest == standby.manifest and sorted(late.updates) == [0, 1]
    history = read_aggregate_bytes(
        _store(roster, LEAD), RUN, SPEC, WINDOW, LEAD, keys[LEAD].ss58_address
    )
    assert sorted(history) == [0, 1]


def test_the_standby_follows_the_lead_and_its_history_holds_the_lead_s_set(
    keys: dict[int, Keypair], tmp_path: Path
) -> None:
    """Both decide; the lead refuses uid 1 where the standby would apply it: the standby applies
    the lead's set, and its published history (overwriting its own decision's aggregate) too."""
    roster = _roster(keys, tmp_path)
    _, uploads, checks = _uploads(keys)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    only_0 = Admission(frozenset({0}))
    lead = decide(
        _store(roster, LEAD), RUN, SPEC, keys[LEAD], roster, checks, uploads, START, scratch,
        SteppingChain(CUTOFF - 20), only_0,
    )  # fmt: skip
    standby = decide(
        _store(roster, STANDBY), RUN, SPEC, keys[STANDBY], roster, checks, uploads, START,
        scratch, SteppingChain(CUTOFF - 19), ALL,
    )  # fmt: skip
    assert sorted(lead.updates) == sorted(standby.updates) == [0]
    assert standby.manifest == lead.manifest
    stored = read_aggregate_bytes(
        _store(roster, STANDBY), RUN, SPEC, WINDOW, STANDBY, keys[STANDBY].ss58_address
    )
    assert sorted(stored) == [0]
