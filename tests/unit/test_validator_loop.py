"""The validator on a real SQLite chain with file buckets: started mid-run it rebuilds the model from
published history instead of starting from the initial weights; its scoring keeps to its time."""

from __future__ import annotations

import itertools
import logging
import math
import os
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from substrateinterface import Keypair

from codec import wire
from codec.aggregate import update_norm
from codec.compress import Compressor
from codec.spec import ModelSpec
from node.model.fingerprint import fingerprint
from node.model.llama import build_model
from node.runtime.commit import commitment_for
from node.strategy import make_strategy
from node.window.buckets import PeerBucket
from node.window.consensus import Agreement, roster_block
from node.window.exchange import check_update, encode_signed
from node.window.gather import Fetched, StoredUpdate
from node.window.history import Source, catch_up, publish_aggregate
from node.window.manifest import read_manifest
from protocol.chain import BlockPruned
from protocol.chain.local import LocalChain
from protocol.chain.local_db import LocalChainDB, create_local_chain
from protocol.commitment import render_commitment
from protocol.naming import update_key
from protocol.runconfig import RunConfig
from protocol.stores import open_store
from protocol.stores.spool import Sink, SpoolError
from tests.support.chain_clock import Clock
from tests.support.small_disk import small_tmpfs
from validator import probe_start, window_scores
from validator.checks import Verdict
from validator.classify import PeerCheck, check_window, measure
from validator.config import ValidatorConfig
from validator.fetching import SPOOL, Upload
from validator.loop import EARLY_ROSTER_BLOCKS, Validator
from validator.probe_start import ProbeStart
from validator.reveal import window_reveal
from validator.startup import ValidatorError

NETUID = 3
BLOCK_TIME = 12.0
GENESIS = time.time() + 3600.0
"""The chain's clock runs an hour ahead of the buckets' (it does not tick by itself): a manifest
stored now is on time by any block's timestamp."""
RUN = RunConfig.preset(
    "tiny",
    name="validator-catch-up",
    timing={
        "block_time_s": BLOCK_TIME,
        "blocks_per_window": 10,
        "upload_deadline_blocks": 2,
        "start_block": 0,
    },
)
KEYS = [Keypair.create_from_uri(f"//vcatch{i}") for i in range(4)]  # 0, 1: validators; 2, 3: peers
PUBLISHED = 3  # validator 0 published the aggregates of windows 0, 1, 2


def _history(root: Path) -> dict[int, str]:
    """Validator 0's published aggregates of the first windows; the fingerprint after each."""
    store = open_store(f"file://{root}?bucket=bucket0")
    model = build_model(RUN.model, RUN.seed)
    spec = ModelSpec.from_module(model)
    comps = {uid: Compressor(spec, RUN.codec) for uid in (2, 3)}
    hotkeys = {i: k.ss58_address for i, k in enumerate(KEYS)}
    source = Source(0, hotkeys[0], store)
    strategy = make_strategy(RUN, spec)
    gen = torch.Generator().manual_seed(0)
    fps = {0: fingerprint(model)}
    for w in range(PUBLISHED):
        raw = {}
        for uid, comp in comps.items():
            sparse = [
                comp.compress(n, torch.randn(p.shape, generator=gen) * 1e-3, 0.95)
                for n, p in model.named_parameters()
            ]
            raw[uid] = encode_signed(sparse, RUN, spec, w, uid, KEYS[uid])
        publish_aggregate(store, RUN, w, 0, KEYS[0], raw, {u: KEYS[u].ss58_address for u in raw})
        catch_up(model, strategy.aggregator, strategy.outer, source, w, w + 1)
        fps[w + 1] = fingerprint(model)
    return fps


def _chain(root: Path, validators: int) -> tuple[Clock, LocalChainDB, LocalChain]:
    """A subnet of `KEYS`: the first `validators` with permits (more stake first), at block 1."""
    clock = Clock(GENESIS, BLOCK_TIME)
    path = root / "chain.db"
    create_local_chain(path, NETUID, block_time=BLOCK_TIME, clock=clock)
    admin = LocalChainDB(path, clock=clock)
    for i, key in enumerate(KEYS):
        stake = 100.0 - 50 * i if i < validators else 0.0
        admin.register(NETUID, key.ss58_address, validator=i < validators, stake=stake)
    clock.at(1)
    return clock, admin, LocalChain(path, NETUID, clock=clock)


def test_a_validator_started_mid_run_catches_up_from_published_history(tmp_path: Path) -> None:
    clock, admin, chain = _chain(tmp_path, validators=2)
    for i, key in enumerate(KEYS):
        chain.commit(key, render_commitment(commitment_for(f"file://{tmp_path}?bucket=bucket{i}")))
    fps = _history(tmp_path)
    clock.at(PUBLISHED * RUN.timing.blocks_per_window + 5)  # in the middle of window 3

    store = open_store(f"file://{tmp_path}?bucket=bucket1")
    crashed = tmp_path / "state1" / SPOOL / "window-2"  # a crash's leftovers: cleared at start
    crashed.mkdir(parents=True)
    (crashed / "update-3").write_bytes(b"x")
    late = Validator(RUN, KEYS[1], chain, store, tmp_path / "state1", local_root=tmp_path)
    assert not (tmp_path / "state1" / SPOOL).exists()
    assert late.next_window == PUBLISHED
    assert late.fingerprint == fps[PUBLISHED] != fps[0]

    # a restart resumes from its own saved state, at the same place
    again = Validator(RUN, KEYS[1], chain, store, tmp_path / "state1", local_root=tmp_path)
    assert (again.next_window, again.fingerprint) == (PUBLISHED, fps[PUBLISHED])
    chain.close()
    admin.close()


def _scorable(v: Validator, spool: Path) -> dict[int, PeerCheck]:
    """Passed checks of two peers' (uids 2, 3) updates of window 0, each kept as a spool file in
    `spool`, as a validator keeps them."""
    gen = torch.Generator().manual_seed(1)
    checks = {}
    for uid in (2, 3):
        sparse = [
            Compressor(v.spec, RUN.codec).compress(
                n, torch.randn(p.shape, generator=gen) * 1e-3, 0.95
            )
            for n, p in v.model.named_parameters()
        ]
        data = encode_signed(sparse, RUN, v.spec, 0, uid, KEYS[uid])
        update = check_update(data, uid, KEYS[uid].ss58_address, RUN, v.spec, 0)
        norm = update_norm(update.tensors)
        with Sink(spool / str(uid)) as sink:
            sink.write(data)
            body = sink.finish()
        update = StoredUpdate.of(update, body, RUN, v.spec)
        upload = Upload(uid, KEYS[uid].ss58_address, Fetched(uid, update, "ok", body), None)
        checks[uid] = PeerCheck(uid, KEYS[uid].ss58_address, upload, Verdict.OK, "ok", norm=norm)
    return checks


def test_scoring_stops_when_its_time_is_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scoring a window never delays the next window's agreement: it stops at the next gather
    block, leaving the rest unscored (in an order drawn per window, not always the same uids).
    Our spool losing a scored update is our fault: scoring raises `SpoolError` rather than
    leaving the peer unscored (which would cost it pay)."""
    _, admin, chain = _chain(tmp_path, validators=1)
    store = open_store(f"file://{tmp_path}?bucket=bucket0")
    v = Validator(RUN, KEYS[0], chain, store, tmp_path / "state0", local_root=tmp_path)
    checks = _scorable(v, tmp_path)  # kept as spool files, as the validator keeps them
    scorer = v._scorer(0, checks)
    assert scorer is not None
    assert set(scorer.rest(time.monotonic() + 600, [2, 3])) == {2, 3}
    assert scorer.rest(time.monotonic() - 1, [2, 3]) == {}
    # a probe still running when the time is up stops before its next forward pass, the model
    # as it was: a clock that ticks once per look, the time up after five looks
    before = fingerprint(v.model)
    ticks = itertools.count()
    monkeypatch.setattr(window_scores, "time", SimpleNamespace(monotonic=lambda: next(ticks)))
    assert scorer.rest(5.0, [2, 3]) == {}
    assert 2 < next(ticks) < 10 and fingerprint(v.model) == before
    monkeypatch.undo()
    # the lead's probe past its time: stopped, and nothing kept (a later probe runs in full)
    assert scorer.own_norm_score(2, until=time.monotonic() - 1) is None
    assert 2 not in scorer.evidence
    # the lead's probe of an update at its own norm stands for its score at T when the norms
    # agree (here T is its own): no forward pass, so it is scored however late
    assert scorer.own_norm_score(2) is not None
    assert set(scorer.rest(time.monotonic() - 1, [2])) == {2}
    # the deadline is the next window's gather block, less room for the work after scoring
    # (the first time: manifest_wait_s; then twice what it took last time)
    left = (v.clock.gather_block(1) - chain.block()) * BLOCK_TIME
    wait = RUN.consensus.manifest_wait_s
    assert v._scoring_deadline(0) - time.monotonic() == pytest.approx(left - wait, abs=5)
    v._wrap_up_s = 40.0
    assert v._scoring_deadline(0) - time.monotonic() == pytest.approx(left - 80.0, abs=5)
    checks[3].verdict = Verdict.COPY  # scored, but outside the reference direction
    (tmp_path / "3").unlink()
    with pytest.raises(SpoolError):
        scorer = v._scorer(0, checks)
        assert scorer is not None
        scorer.rest(time.monotonic() + 600, [2])
    chain.close()
    admin.close()


def test_until_two_peers_earn_the_next_probe_regresses_on_the_step_just_taken(
    tmp_path: Path,
) -> None:
    """While no two peers earn, the validator keeps the outer step it took (on the host) and the
    next window's own-data test regresses on that step's gain (`validator.scoring`) beside the
    window's accepted updates, which a crowd could dilute; weights it did not reach by that step
    (a resync) leave it unused."""
    _, admin, chain = _chain(tmp_path, validators=1)
    store = open_store(f"file://{tmp_path}?bucket=bucket0")
    v = Validator(RUN, KEYS[0], chain, store, tmp_path / "state0", local_root=tmp_path)
    checks = _scorable(v, tmp_path)
    updates = {u: c.upload.fetched.update for u, c in checks.items() if c.upload is not None}
    before = {k: p.detach().clone() for k, p in v.model.named_parameters()}
    v._outer_step(0, Agreement(updates, None, False, "test"), keep=True)  # type: ignore[arg-type]
    scorer = v._scorer(1, checks)
    assert scorer is not None and scorer.probe.members == [2, 3]
    assert scorer.probe.prev is not None
    for name, p in v.model.named_parameters():
        step = (before[name] - p.detach()) * v.cfg.score_scale
        assert torch.equal(scorer.probe.prev[name], step), name
    with torch.no_grad():  # weights from elsewhere: the kept step did not lead to them
        next(v.model.parameters()).add_(1e-3)
    v.fingerprint = fingerprint(v.model)
    scorer = v._scorer(1, checks)
    assert scorer is not None and scorer.probe.prev is None
    chain.close()
    admin.close()


def test_the_lead_decodes_each_update_once_before_its_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest every peer waits for comes after the fetch and the checks. The checks take
    each update's norm and sketch while the fetch has it decoded (`validator.classify.measure`)
    instead of reading it back and decoding it again: under load, the second decode put the
    lead's manifest past the peers' wait and the simulation forked."""
    import node.strategy.sparseloco as sparseloco

    clock = Clock(time.time() - 60, BLOCK_TIME)  # window 0's deadline is still ahead
    create_local_chain(tmp_path / "chain.db", NETUID, block_time=BLOCK_TIME, clock=clock)
    admin = LocalChainDB(tmp_path / "chain.db", clock=clock)
    for i, key in enumerate(KEYS):
        admin.register(NETUID, key.ss58_address, validator=i == 0, stake=100.0 if i == 0 else 0.0)
    chain = LocalChain(tmp_path / "chain.db", NETUID, clock=clock)
    v = Validator(RUN, KEYS[0], chain, open_store(f"file://{tmp_path}?bucket=lead"), tmp_path / "s")
    peers = []
    for uid, check in _scorable(v, tmp_path).items():  # two peers' updates, in their buckets
        store = open_store(f"file://{tmp_path}?bucket=peer{uid}")
        assert check.upload is not None and check.upload.body is not None
        store.put(update_key(RUN.run_id, 0, uid, check.hotkey), check.upload.body.read())
        peers.append(PeerBucket(uid, check.hotkey, store))
    decodes: list[int] = []
    real = sparseloco.decode_update

    def counted(*a: Any, **k: Any) -> wire.DecodedUpdate:
        decodes.append(1)
        return real(*a, **k)

    monkeypatch.setattr(sparseloco, "decode_update", counted)
    spool = tmp_path / "spool"
    spool.mkdir()
    uploads = v._fetch(0, peers, spool, [p.uid for p in peers])
    assert uploads is not None  # our spool is fine
    checks = check_window(
        0, {p.uid: p.hotkey for p in peers}, uploads, {}, None, v.history, RUN, v.spec, v.cfg,
        v.salt, v.strategy.format,
    )  # fmt: skip
    assert len(decodes) == len(peers), decodes  # once each, for its check
    assert all(c.verdict is Verdict.OK and c.sketch is not None for c in checks.values()), checks
    again = {}
    for u, up in uploads.items():
        assert up.fetched.update is not None  # every check above was OK
        again[u] = measure(u, up.fetched.update, 0, v.spec, RUN, v.cfg, v.salt, v.strategy.format)
    assert {u: c.norm for u, c in checks.items()} == {u: m.norm for u, m in again.items()}
    chain.close()
    admin.close()


class PrunedBelow:
    """The real chain as a non-archive subtensor node shows it: the state of blocks below
    `first_kept` is gone."""

    def __init__(self, chain: LocalChain, first_kept: int) -> None:
        self._chain, self.first_kept = chain, first_kept

    def snapshot(self, block: int):  # noqa: ANN201 - the real chain's snapshot
        if block < self.first_kept:
            raise BlockPruned(f"state of block {block} already discarded")
        return self._chain.snapshot(block)

    def __getattr__(self, name: str):  # noqa: ANN204 - everything else is the real chain's
        return getattr(self._chain, name)


def test_a_validator_down_past_the_pruning_horizon_catches_up_instead_of_crash_looping(
    tmp_path: Path,
) -> None:
    """Its next window's roster block is pruned on the chain node: it replays the windows since
    from the other validator's history and goes on from there, where it used to raise on every
    restart."""
    clock, admin, chain = _chain(tmp_path, validators=2)
    for i, key in enumerate(KEYS):
        chain.commit(key, render_commitment(commitment_for(f"file://{tmp_path}?bucket=bucket{i}")))
    store = open_store(f"file://{tmp_path}?bucket=bucket1")
    down = Validator(RUN, KEYS[1], chain, store, tmp_path / "state1", local_root=tmp_path)
    assert down.next_window == 0  # saved at window 0, then down
    fps = _history(tmp_path)
    clock.at(PUBLISHED * RUN.timing.blocks_per_window + 5)  # in the middle of window 3
    pruned = PrunedBelow(chain, first_kept=PUBLISHED * RUN.timing.blocks_per_window)
    back = Validator(RUN, KEYS[1], pruned, store, tmp_path / "state1", local_root=tmp_path)  # type: ignore[arg-type]
    assert back.next_window == 0
    assert back.run_windows(1) == []  # no window processed: it caught up instead
    assert (back.next_window, back.fingerprint) == (PUBLISHED, fps[PUBLISHED])
    again = Validator(RUN, KEYS[1], pruned, store, tmp_path / "state1", local_root=tmp_path)  # type: ignore[arg-type]
    assert again.next_window == PUBLISHED  # saved: a restart goes on from there
    chain.close()
    admin.close()


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs: smaller than one update of the `tiny` model."""
    with small_tmpfs(tmp_path / "small") as where:
        yield where


def test_a_lead_whose_spool_disk_is_full_decides_nothing_and_rates_nobody(
    tmp_path: Path, full_disk: Path
) -> None:
    """The lead cannot keep the window's updates (its spool is on a full disk): it publishes a
    manifest that applies nothing before the cutoff, rates nobody on a window it could not see,
    and carries on, where it used to stop before its manifest."""
    clock, admin, chain = _chain(tmp_path, validators=1)
    for i, key in enumerate(KEYS):
        chain.commit(key, render_commitment(commitment_for(f"file://{tmp_path}?bucket=bucket{i}")))
    store = open_store(f"file://{tmp_path}?bucket=bucket0")
    state = tmp_path / "state0"
    v = Validator(RUN, KEYS[0], chain, store, state, local_root=tmp_path)
    window = 1  # its roster (block 10) has every bucket commitment
    for uid, check in _scorable(v, tmp_path).items():  # two peers' uploads, in their buckets
        assert check.upload is not None and check.upload.body is not None
        peer = open_store(f"file://{tmp_path}?bucket=bucket{uid}")
        peer.put(update_key(RUN.run_id, window, uid, check.hotkey), check.upload.body.read())
    (state / SPOOL).symlink_to(full_disk)  # the spool's disk is full
    clock.at(v.clock.gather_block(window) + 1)
    before = v.book.final_scores()
    report = v.run_window(window)
    assert report.aggregated == []
    lead = KEYS[0].ss58_address
    manifest = read_manifest(store, RUN.run_id, window, 0, lead, 1 << 20)
    assert manifest.entries == ()  # published in time: every node applies nothing, alike
    assert v.book.final_scores() == before and v.next_window == window + 1
    chain.close()
    admin.close()


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        body = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


def test_the_metrics_say_what_the_window_decided(tmp_path: Path) -> None:
    """A lead validator decides window 1 with two peers' updates; its Prometheus endpoint (on
    127.0.0.1) then serves who it is, the window, its phases, the verdicts, rules and weights
    of the published report."""
    clock, admin, chain = _chain(tmp_path, validators=1)
    for i, key in enumerate(KEYS):
        chain.commit(key, render_commitment(commitment_for(f"file://{tmp_path}?bucket=bucket{i}")))
    store = open_store(f"file://{tmp_path}?bucket=bucket0")
    v = Validator(RUN, KEYS[0], chain, store, tmp_path / "state0", local_root=tmp_path)
    window = 1
    gen = torch.Generator().manual_seed(1)
    for uid in (2, 3):  # two peers' updates of window 1, in their buckets
        comp = Compressor(v.spec, RUN.codec)
        sparse = [
            comp.compress(n, torch.randn(p.shape, generator=gen) * 1e-3, 0.95)
            for n, p in v.model.named_parameters()
        ]
        peer = open_store(f"file://{tmp_path}?bucket=bucket{uid}")
        key = update_key(RUN.run_id, window, uid, KEYS[uid].ss58_address)
        peer.put(key, encode_signed(sparse, RUN, v.spec, window, uid, KEYS[uid]))
        stored = GENESIS + (v.clock.schedule.first_block(window) + 1) * BLOCK_TIME  # chain time
        [path] = tmp_path.glob(f"bucket{uid}/**/{key.rsplit('/', 1)[-1]}")
        os.utime(path, (stored, stored))
    clock.at(v.clock.gather_block(window) + 1)
    v.next_window = window
    port = _free_port()
    v.metrics.serve(port)
    [report] = v.run_windows(1)
    got = _scrape(port)
    info = (("hotkey", KEYS[0].ss58_address), ("role", "validator"), ("run_id", RUN.run_id),
            ("uid", "0"))  # fmt: skip
    assert got[("tessera_node_info", info)] == 1
    assert got[("tessera_window", ())] == window
    assert got[("tessera_phase_seconds", (("phase", "window"),))] > 0
    assert time.time() - got[("tessera_last_progress_timestamp_seconds", ())] < 60
    verdicts = {
        dict(k)["verdict"]: n for (name, k), n in got.items() if name == "tessera_validator_peers"
    }
    assert set(verdicts) == {v.value for v in Verdict}  # every verdict has a series, 0 or more
    assert sum(verdicts.values()) == len(report.peers)
    for p in report.peers:
        assert verdicts[p.verdict.value] >= 1
        assert got[("tessera_validator_rule_peers", (("rule", p.rule),))] >= 1
    weights = {
        int(dict(k)["uid"]): w for (name, k), w in got.items() if name == "tessera_validator_weight"
    }
    assert weights == pytest.approx(report.weights)  # none yet after one window: no series
    assert got[("tessera_validator_selected_updates", ())] == len(report.selected) == 3
    assert got[("tessera_validator_applied_updates", ())] == len(report.aggregated)
    assert (
        got[("tessera_validator_fetched_bytes_total", ())]
        == sum(p.n_bytes for p in report.peers)
        > 0
    )
    chain.close()
    admin.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_restarted_validator_clears_the_spool_a_crash_left(tmp_path: Path) -> None:
    """Killed mid-window, a validator leaves that window's spooled updates on disk: the next
    start removes them (a crash loop would otherwise fill the disk)."""
    _, admin, chain = _chain(tmp_path, validators=1)
    store = open_store(f"file://{tmp_path}?bucket=bucket0")
    state = tmp_path / "state0"
    left = state / SPOOL / "window-7"
    left.mkdir(parents=True)
    (left / "2").write_bytes(b"x" * 4096)
    Validator(RUN, KEYS[0], chain, store, state, local_root=tmp_path)
    assert not (state / SPOOL).exists() or not any((state / SPOOL).iterdir())
    chain.close()
    admin.close()


def test_a_validator_down_past_the_pruning_horizon_without_history_says_to_use_an_archive(
    tmp_path: Path,
) -> None:
    """Nobody published the windows it missed: it stops with one error naming the fix (an archive
    node), and its saved position is left as it was."""
    clock, admin, chain = _chain(tmp_path, validators=2)
    for i, key in enumerate(KEYS):
        chain.commit(key, render_commitment(commitment_for(f"file://{tmp_path}?bucket=bucket{i}")))
    store = open_store(f"file://{tmp_path}?bucket=bucket1")
    Validator(RUN, KEYS[1], chain, store, tmp_path / "state1", local_root=tmp_path)
    clock.at(PUBLISHED * RUN.timing.blocks_per_window + 5)  # no validator published anything
    pruned = PrunedBelow(chain, first_kept=PUBLISHED * RUN.timing.blocks_per_window)
    back = Validator(RUN, KEYS[1], pruned, store, tmp_path / "state1", local_root=tmp_path)  # type: ignore[arg-type]
    with pytest.raises(ValidatorError, match="archive"):
        back.run_windows(1)
    assert back.next_window == 0
    chain.close()
    admin.close()


RESYNC_RUN = RunConfig.preset(
    "tiny",
    name="validator-resync",
    timing={"block_time_s": BLOCK_TIME, "blocks_per_window": 10,
            "upload_deadline_blocks": 2, "start_block": 2},
)  # fmt: skip
EVERY_UPDATE = ValidatorConfig(n_random=8, n_own=8, admit_z=-math.inf, admit_min_effect=-math.inf)
"""Every update admitted, on few samples: these tests check the model, not the evidence."""


def _window_zero(root: Path, validators: int) -> tuple[Clock, LocalChainDB, list[Validator]]:
    """Validators 0 (the lead) and 1 (the standby) of `validators`, peers 2 and 3 with an update
    of window 0 each in their buckets, norms apart (so each is probed again at ``T``); the chain
    in window 0 (from block 2), its roster block final."""
    run = RESYNC_RUN
    clock = Clock(time.time() - 60, BLOCK_TIME)  # window 0 is open now
    create_local_chain(root / "chain.db", NETUID, block_time=BLOCK_TIME, clock=clock)
    admin = LocalChainDB(root / "chain.db", clock=clock)
    for i, key in enumerate(KEYS):
        stake = 100.0 - 50 * i if i < validators else 0.0
        admin.register(NETUID, key.ss58_address, validator=i < validators, stake=stake)
    clock.at(1)
    chain = LocalChain(root / "chain.db", NETUID, clock=clock)
    for i, key in enumerate(KEYS):
        chain.commit(key, render_commitment(commitment_for(f"file://{root}?bucket=bucket{i}")))
    made = [
        Validator(run, KEYS[i], chain, open_store(f"file://{root}?bucket=bucket{i}"),
                  root / f"state{i}", EVERY_UPDATE, local_root=root)
        for i in range(validators)
    ]  # fmt: skip
    spec, gen = made[0].spec, torch.Generator().manual_seed(2)
    for uid, scale in ((2, 1e-3), (3, 3e-3)):
        sparse = [
            Compressor(spec, run.codec).compress(
                n, torch.randn(p.shape, generator=gen) * scale, 0.95
            )
            for n, p in made[0].model.named_parameters()
        ]
        data = encode_signed(sparse, run, spec, 0, uid, KEYS[uid])
        store = open_store(f"file://{root}?bucket=bucket{uid}")
        store.put(update_key(run.run_id, 0, uid, KEYS[uid].ss58_address), data)
    clock.at(roster_block(run, 0) + EARLY_ROSTER_BLOCKS)
    return clock, admin, made


def test_a_standby_that_resyncs_in_a_window_ends_it_on_the_leads_model(tmp_path: Path) -> None:
    """A validator whose model differs from the lead's at a window's start (forked) rebuilds it
    from the lead's published history when it agrees on the window, and then scores the updates
    against the rebuilt model: a probe set up before the resync would restore its own (forked)
    start after each forward pass, and the window's outer step would then fork it again."""
    clock, admin, (lead, standby) = _window_zero(tmp_path, validators=2)
    with torch.no_grad():  # the standby's start differs from the lead's
        next(standby.model.parameters()).add_(1e-3)
    standby.fingerprint = fingerprint(standby.model)
    clock.at(lead.clock.gather_block(0))
    led = lead.run_window(0)
    assert led.aggregated == [2, 3]
    followed = standby.run_window(0)
    assert followed.aggregated == [2, 3]
    assert followed.fingerprint_start == led.fingerprint_start  # the resynced start
    assert standby.fingerprint == lead.fingerprint == led.fingerprint_end
    lead.chain.close()
    admin.close()


def test_the_probes_passes_at_the_windows_start_are_taken_while_it_waits_for_the_gather(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The lead's manifest, which every peer waits for, comes after its probes: the passes that
    need no update (the random samples' and each selected peer's own samples' losses at the
    start) are taken before the gather block, while the validator waits for it anyway."""
    clock, admin, (lead,) = _window_zero(tmp_path, validators=1)
    gathered = threading.Event()
    passes = {"before": 0, "after": 0}
    real = probe_start.row_losses

    def counted(*args: Any, **kwargs: Any) -> Any:
        passes["after" if gathered.is_set() else "before"] += 1
        return real(*args, **kwargs)

    def open_the_gather() -> None:  # once the validator waits for it (its prepare done)
        deadline = time.monotonic() + 60
        while not caplog.text.count("taken before the gather") and time.monotonic() < deadline:
            time.sleep(0.05)
        gathered.set()
        clock.at(lead.clock.gather_block(0))

    monkeypatch.setattr(probe_start, "row_losses", counted)
    opener = threading.Thread(target=open_the_gather, daemon=True)
    with caplog.at_level(logging.INFO, logger="tessera"):
        opener.start()
        report = lead.run_window(0)
    opener.join()
    assert report.aggregated == [2, 3]
    # uid 1 (registered, selected) uploaded nothing: its own samples were taken all the same
    assert "taken before the gather for 3 of 3 selected peers" in caplog.text
    assert passes["before"] == 4  # the random samples, then each selected peer's own
    # after the gather: the consensus step's gains, and each update's two passes, probed at its
    # own norm and (the one far from T) at T: 1 + 2 * (1 + 2) + 2 (with the before: 2 + 2 * 4 + 2)
    assert passes["after"] == 9, passes
    lead.chain.close()
    admin.close()


def test_passes_taken_on_other_weights_are_taken_again(tmp_path: Path) -> None:
    """The passes taken before the gather stand only for the weights they were taken on: once a
    resync has moved the model, the window's probe takes its own."""
    _, admin, chain = _chain(tmp_path, validators=1)
    v = Validator(RUN, KEYS[0], chain, open_store(f"file://{tmp_path}?bucket=bucket0"), tmp_path)
    checks = _scorable(v, tmp_path)
    reveal = window_reveal(v.reveal_key, v.dataset, RUN, 0, v.cfg)
    start = ProbeStart(
        v.model, RUN, v.dataset, 0, reveal, v.cfg, v.device, v.strategy.format, v.fingerprint
    )
    scorer = v._scorer(0, checks, start)
    assert scorer is not None and scorer.probe.base is start
    with torch.no_grad():  # what a resync does to the weights
        next(v.model.parameters()).add_(1e-3)
    v.fingerprint = fingerprint(v.model)
    scorer = v._scorer(0, checks, start)
    assert scorer is not None and scorer.probe.base is not start
    chain.close()
    admin.close()
