"""The manifest counts only if the lead's store dated it by the cutoff block's timestamp, and every
node reads until the chain has reached the settle block: what a node applies does not depend on
its load or on when the lead's PUT completed.

- a prompt node and one that comes to read long after the cutoff (loaded, or restarted) see the
  same manifest;
- without one, a node reads until the settle block and not a block less, and then applies
  nothing (not its own choice, which differs from node to node);
- a manifest stored after the cutoff (a PUT throttled past it) counts for nobody: not for a node
  that reads it, nor for one whose last read came before it landed, nor for the lead;
- a lead too late to publish before the cutoff, or whose manifest could not be stored, publishes
  no manifest and an empty aggregate, so the history replays what every node applied.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
from substrateinterface import Keypair

from codec.spec import ModelSpec
from lab.sim.forgeries import noise_update
from node.model.fingerprint import fingerprint
from node.model.llama import build_model
from node.window import consensus
from node.window.consensus import (
    Roster,
    agree,
    manifest_cutoff_block,
    may_publish,
    settle_block,
    wait_for_manifest,
)
from node.window.exchange import encode_signed
from node.window.gather import Fetched
from node.window.history import read_aggregate_bytes
from node.window.manifest import WindowManifest, publish_manifest
from protocol.keys import create_hotkey
from protocol.naming import applied_key
from protocol.stores import FileStore, ObjectInfo, StoreUnavailable, open_store
from tests.support.chain_time import SteppingChain
from tests.support.lead_views import checked_views, cutoff_run, decide, lead_roster
from validator.admission import Admission
from validator.fetching import Upload

pytestmark = pytest.mark.usefixtures("fast_manifest_polls")
RUN = cutoff_run("manifest-cutoff")
SPEC = ModelSpec.from_module(build_model(RUN.model, RUN.seed))
WINDOW, LEAD = 3, 9
START = fingerprint(build_model(RUN.model, RUN.seed))
CUTOFF = manifest_cutoff_block(RUN, WINDOW)

ALL = Admission(frozenset(range(100)))  # the lead admits every update that passed


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Keypair]:
    root = tmp_path_factory.mktemp("wallets")
    return {u: create_hotkey("c", f"k{u}", root=root) for u in (0, 1, LEAD)}


def _roster(keys: dict[int, Keypair], store: object) -> Roster:
    return lead_roster(keys, store, [0, 1], WINDOW, LEAD)


def _manifest(keys: dict[int, Keypair]) -> WindowManifest:
    return WindowManifest(
        run_id=RUN.run_id, window=WINDOW, roster_block=WINDOW * 60, validator_uid=LEAD,
        validator_hotkey=keys[LEAD].ss58_address, fingerprint_start=START, entries=(),
        rejected={"0": "copy", "1": "late"},
    )  # fmt: skip


def _views(keys: dict[int, Keypair]) -> tuple[dict[int, Fetched], dict[int, Upload], dict]:
    data = {
        u: encode_signed(
            noise_update(SPEC, RUN, 0.01, torch.Generator().manual_seed(u)), RUN, SPEC, WINDOW, u,
            keys[u],
        )
        for u in (0, 1)
    }  # fmt: skip
    return checked_views(data, keys, RUN, SPEC, WINDOW)


@pytest.fixture
def lead_view(tmp_path: Path, keys: dict[int, Keypair]) -> tuple:
    """The lead's bucket, roster, uploads, checks and scratch folder for the window."""
    store = open_store(f"file://{tmp_path}?bucket=lead")
    _, uploads, checks = _views(keys)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    return store, _roster(keys, store), uploads, checks, scratch


def test_a_prompt_and_a_loaded_node_see_the_same_manifest(
    tmp_path: Path, keys: dict[int, Keypair]
) -> None:
    store = open_store(f"file://{tmp_path}?bucket=lead")
    roster = _roster(keys, store)
    publish_at = CUTOFF - 3
    assert may_publish(RUN, WINDOW, publish_at - 1)

    def publish() -> None:
        publish_manifest(store, _manifest(keys), keys[LEAD])

    gather = CUTOFF - 40
    prompt = wait_for_manifest(roster, RUN, WINDOW, SteppingChain(gather, {publish_at: publish}))
    # the loaded node reads 500 blocks after the cutoff, on the same chain's timestamps
    at_gather = SteppingChain(gather).first_at
    loaded_chain = SteppingChain(CUTOFF + 500, first_at=at_gather + timedelta(seconds=540))
    loaded = wait_for_manifest(roster, RUN, WINDOW, loaded_chain)
    assert prompt == loaded == _manifest(keys)


def test_a_manifest_stored_after_the_cutoff_counts_for_nobody(
    tmp_path: Path, keys: dict[int, Keypair]
) -> None:
    """The lead began its PUT in time, but its store took it after the cutoff block's timestamp
    (throttled): the prompt node's last read came first and saw nothing, a loaded node reads it
    later; both apply nothing."""
    store = open_store(f"file://{tmp_path}?bucket=lead")
    roster = _roster(keys, store)
    settle = settle_block(RUN, WINDOW)
    # block timestamps put the cutoff 100 s in the past: whatever is stored now is late
    past = SteppingChain(CUTOFF).first_at - timedelta(seconds=100)
    prompt = SteppingChain(CUTOFF - 3, first_at=past - timedelta(seconds=3))
    assert wait_for_manifest(roster, RUN, WINDOW, prompt) is None
    assert prompt.seen[-1] == settle
    publish_manifest(store, _manifest(keys), keys[LEAD])
    loaded = SteppingChain(settle + 50, first_at=past + timedelta(seconds=settle + 50 - CUTOFF))
    assert wait_for_manifest(roster, RUN, WINDOW, loaded) is None
    on_time = SteppingChain(CUTOFF + 1)  # the same object, had the cutoff been now
    assert wait_for_manifest(roster, RUN, WINDOW, on_time) == _manifest(keys)


def test_without_a_manifest_a_node_reads_until_the_settle_block_then_applies_nothing(
    tmp_path: Path, keys: dict[int, Keypair]
) -> None:
    store = open_store(f"file://{tmp_path}?bucket=lead")
    roster = _roster(keys, store)
    chain = SteppingChain(CUTOFF - 5)
    assert wait_for_manifest(roster, RUN, WINDOW, chain) is None
    assert chain.seen[-1] == settle_block(RUN, WINDOW) > CUTOFF  # not a block less
    fetched, _, _ = _views(keys)
    agreed = agree(roster, fetched, None, START, RUN, SPEC)
    assert agreed.updates == {} and not agreed.forked  # every node alike, not its own copies
    assert agreed.note == f"no manifest by block {CUTOFF}: nothing applied"


def test_a_lead_too_late_for_the_cutoff_publishes_no_manifest_and_an_empty_history(
    keys: dict[int, Keypair], lead_view: tuple
) -> None:
    store, roster, uploads, checks, scratch = lead_view
    late = CUTOFF - 1  # inside the margin: a PUT now could land after some node's last read
    assert not may_publish(RUN, WINDOW, late)
    agreed = decide(
        store, RUN, SPEC, keys[LEAD], roster, checks, uploads, START, scratch,
        SteppingChain(late), ALL,
    )  # fmt: skip
    assert agreed.updates == {} and agreed.manifest is None
    assert not store.exists(applied_key(RUN.run_id, WINDOW, LEAD, keys[LEAD].ss58_address))
    history = read_aggregate_bytes(store, RUN, SPEC, WINDOW, LEAD, keys[LEAD].ss58_address)
    assert history == {}
    on_time = decide(
        store, RUN, SPEC, keys[LEAD], roster, checks, uploads, START, scratch,
        SteppingChain(late - 10), ALL,
    )  # fmt: skip
    assert on_time.manifest is not None and sorted(on_time.updates) == [0, 1]


def test_a_lead_past_its_last_block_after_the_aggregate_publishes_no_manifest(
    keys: dict[int, Keypair], lead_view: tuple
) -> None:
    """Uploading the aggregate took the lead into the margin before the cutoff: it does not begin
    the manifest's PUT then (it could land after some node's last read)."""
    store, roster, uploads, checks, scratch = lead_view
    last = CUTOFF - 2  # the last block to publish: the margin is two blocks of 1 s
    assert may_publish(RUN, WINDOW, last - 1) and not may_publish(RUN, WINDOW, last)
    agreed = decide(
        store, RUN, SPEC, keys[LEAD], roster, checks, uploads, START, scratch,
        SteppingChain(last - 1), ALL,
    )  # fmt: skip
    assert not store.exists(applied_key(RUN.run_id, WINDOW, LEAD, keys[LEAD].ss58_address))
    assert agreed.updates == {} and agreed.manifest is None


def test_a_lead_whose_manifest_is_stored_after_the_cutoff_applies_nothing(
    keys: dict[int, Keypair], lead_view: tuple
) -> None:
    """The lead judges its own manifest by the rule every node applies: began in time, stored
    (by its store's clock) after the cutoff block's timestamp, it counts for nobody, and the
    lead's history says the window applied nothing."""
    store, roster, uploads, checks, scratch = lead_view
    start = CUTOFF - 20
    assert may_publish(RUN, WINDOW, start)
    chain = SteppingChain(start, first_at=SteppingChain(0).first_at - timedelta(seconds=200))
    agreed = decide(
        store, RUN, SPEC, keys[LEAD], roster, checks, uploads, START, scratch, chain, ALL
    )  # fmt: skip
    assert store.exists(applied_key(RUN.run_id, WINDOW, LEAD, keys[LEAD].ss58_address))
    assert agreed.updates == {} and agreed.manifest is None
    history = read_aggregate_bytes(store, RUN, SPEC, WINDOW, LEAD, keys[LEAD].ss58_address)
    assert history == {}


def test_a_lead_whose_manifest_cannot_be_stored_applies_nothing(
    tmp_path: Path, keys: dict[int, Keypair], lead_view: tuple
) -> None:
    store, roster, uploads, checks, scratch = lead_view
    key = applied_key(RUN.run_id, WINDOW, LEAD, keys[LEAD].ss58_address)
    (tmp_path / "lead" / key / "blocker").mkdir(parents=True)  # its PUT fails
    agreed = decide(
        store, RUN, SPEC, keys[LEAD], roster, checks, uploads, START, scratch, SteppingChain(0),
        ALL,
    )  # fmt: skip
    assert agreed.updates == {} and agreed.manifest is None
    history = read_aggregate_bytes(store, RUN, SPEC, WINDOW, LEAD, keys[LEAD].ss58_address)
    assert history == {}  # not the set the manifest would have applied


def test_a_run_without_validators_does_not_wait_for_a_manifest(keys: dict[int, Keypair]) -> None:
    """Nobody publishes one: the node applies its own verified copies at once."""
    roster = _roster(keys, None)
    roster = Roster(WINDOW, roster.block, roster.metagraph, {}, {}, [0, 1], ())
    chain = SteppingChain(0, stop_at=0)  # the chain never moves
    assert wait_for_manifest(roster, RUN, WINDOW, chain) is None
    fetched, _, _ = _views(keys)
    agreed = agree(roster, fetched, None, START, RUN, SPEC)
    assert sorted(agreed.updates) == [0, 1] and agreed.note == "no validator: own choice"


class _Failing(FileStore):
    """The lead's bucket answering every read with an outage for its first `fails` reads."""

    def __init__(self, root: Path, fails: int) -> None:
        super().__init__(root / "lead")
        self.fails = fails

    def head(self, key: str) -> ObjectInfo:
        if self.fails > 0:
            self.fails -= 1
            raise StoreUnavailable("the lead's store is down")
        return super().head(key)


def test_a_manifest_read_that_fails_is_tried_again_past_the_settle_block(
    tmp_path: Path, keys: dict[int, Keypair], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An outage of the lead's store around the cutoff is not taken for "no manifest": the node
    keeps reading past the settle block (for `READ_RETRY_S`) and applies the manifest stored in
    time; a store that stays down gives nothing, once that time is up."""
    publish_manifest(open_store(f"file://{tmp_path}?bucket=lead"), _manifest(keys), keys[LEAD])
    settle = settle_block(RUN, WINDOW)
    flaky = _roster(keys, _Failing(tmp_path, fails=30))
    at_cutoff = SteppingChain(CUTOFF).first_at
    later = SteppingChain(settle, first_at=at_cutoff + timedelta(seconds=settle - CUTOFF))
    assert wait_for_manifest(flaky, RUN, WINDOW, later) == _manifest(keys)
    assert later.seen[-1] > settle  # read on past the settle block
    monkeypatch.setattr(consensus, "READ_RETRY_S", 0.2)
    down = _roster(keys, _Failing(tmp_path, fails=10**9))
    assert wait_for_manifest(down, RUN, WINDOW, SteppingChain(settle)) is None
