"""The manifest counts only if it is stored before the window's cutoff block, and every node reads
until the chain has reached that block: what a node applies does not depend on its load.

- a prompt node and one that comes to read long after the cutoff (loaded, or restarted) see the
  same manifest;
- without one, a node reads until the cutoff block and not a block less, and then applies
  nothing (not its own choice, which differs from node to node);
- a lead too late to publish before the cutoff, or whose manifest could not be stored, publishes
  no manifest and an empty aggregate, so the history replays what every node applied.
"""

from __future__ import annotations

from collections.abc import Callable
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
    wait_for_manifest,
)
from node.window.exchange import encode_signed
from node.window.gather import Fetched
from node.window.history import read_aggregate_bytes
from node.window.manifest import WindowManifest, publish_manifest
from protocol.keys import create_hotkey
from protocol.naming import applied_key
from protocol.runconfig import RunConfig
from protocol.stores import open_store
from tests.support.lead_views import checked_views, lead_roster
from validator.admission import Admission
from validator.agreement import lead_decision
from validator.fetching import Upload

RUN = RunConfig.preset(
    "tiny",
    name="manifest-cutoff",
    inner_steps=2,
    consensus={"fetch_budget_s": 10.0, "manifest_wait_s": 20.0},
    timing={"block_time_s": 1.0, "blocks_per_window": 60, "upload_deadline_blocks": 5},
)
SPEC = ModelSpec.from_module(build_model(RUN.model, RUN.seed))
WINDOW, LEAD = 3, 9
START = fingerprint(build_model(RUN.model, RUN.seed))
CUTOFF = manifest_cutoff_block(RUN, WINDOW)

ALL = Admission(frozenset(range(100)))  # the lead admits every update that passed


@pytest.fixture(autouse=True)
def _fast_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(consensus, "MANIFEST_POLL_S", 0.0)
    monkeypatch.setattr(consensus, "MANIFEST_POLL_MAX_S", 0.0)


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


def _clock(first: int, on: dict[int, Callable[[], None]] | None = None) -> Callable[[], int]:
    """A chain that moves one block per look, from `first`; `on[b]` runs when block b is seen."""
    seen = iter(range(first, 1 << 30))
    hooks = dict(on or {})

    def block_now() -> int:
        b = next(seen)
        if b in hooks:
            hooks.pop(b)()
        return b

    return block_now


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
        publish_manifest(store, _manifest(keys), keys[LEAD])  # type: ignore[arg-type]

    gather = CUTOFF - 40
    prompt = wait_for_manifest(roster, RUN, WINDOW, _clock(gather, {publish_at: publish}))
    loaded = wait_for_manifest(roster, RUN, WINDOW, _clock(CUTOFF + 500))
    assert prompt == loaded == _manifest(keys)


def test_without_a_manifest_a_node_reads_until_the_cutoff_then_applies_nothing(
    tmp_path: Path, keys: dict[int, Keypair]
) -> None:
    store = open_store(f"file://{tmp_path}?bucket=lead")
    roster = _roster(keys, store)
    looked: list[int] = []
    clock = _clock(CUTOFF - 5)

    def block_now() -> int:
        looked.append(clock())
        return looked[-1]

    assert wait_for_manifest(roster, RUN, WINDOW, block_now) is None
    assert looked[-1] == CUTOFF  # not a block less
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
    agreed = lead_decision(
        store, RUN, SPEC, keys[LEAD], roster, checks, uploads, START, scratch, lambda: late, ALL  # type: ignore[arg-type]
    )  # fmt: skip
    assert agreed.updates == {} and agreed.manifest is None
    assert not store.exists(applied_key(RUN.run_id, WINDOW, LEAD, keys[LEAD].ss58_address))
    history = read_aggregate_bytes(store, RUN, SPEC, WINDOW, LEAD, keys[LEAD].ss58_address)  # type: ignore[arg-type]
    assert history == {}
    on_time = lead_decision(
        store, RUN, SPEC, keys[LEAD], roster, checks, uploads, START, scratch, lambda: late - 10, ALL  # type: ignore[arg-type]
    )  # fmt: skip
    assert on_time.manifest is not None and sorted(on_time.updates) == [0, 1]


def test_a_lead_whose_manifest_cannot_be_stored_applies_nothing(
    tmp_path: Path, keys: dict[int, Keypair], lead_view: tuple
) -> None:
    store, roster, uploads, checks, scratch = lead_view
    key = applied_key(RUN.run_id, WINDOW, LEAD, keys[LEAD].ss58_address)
    (tmp_path / "lead" / key / "blocker").mkdir(parents=True)  # its PUT fails
    agreed = lead_decision(
        store, RUN, SPEC, keys[LEAD], roster, checks, uploads, START, scratch, lambda: 0, ALL  # type: ignore[arg-type]
    )  # fmt: skip
    assert agreed.updates == {} and agreed.manifest is None
    history = read_aggregate_bytes(store, RUN, SPEC, WINDOW, LEAD, keys[LEAD].ss58_address)  # type: ignore[arg-type]
    assert history == {}  # not the set the manifest would have applied


def test_a_run_without_validators_does_not_wait_for_a_manifest(keys: dict[int, Keypair]) -> None:
    """Nobody publishes one: the node applies its own verified copies at once."""
    roster = _roster(keys, None)
    roster = Roster(WINDOW, roster.block, roster.metagraph, {}, {}, [0, 1], None)
    assert wait_for_manifest(roster, RUN, WINDOW, lambda: 0) is None  # the chain never moves
    fetched, _, _ = _views(keys)
    agreed = agree(roster, fetched, None, START, RUN, SPEC)
    assert sorted(agreed.updates) == [0, 1] and agreed.note == "no validator: own choice"
