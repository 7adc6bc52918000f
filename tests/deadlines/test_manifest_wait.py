"""A lead validator slowed down by load still reaches every honest peer: a peer waits for the
manifest by the chain's clock, up to the window's cutoff block (`manifest_cutoff_block`), not by
its own.

The real peer (embedded chain and stores, the `tiny` model) trains window 0 with its bucket
committed, so its own choice would be its own update. The lead validator publishes a manifest
that refuses that update (as it refuses a copy no peer can spot alone) late, after the gather's
fetch budget, but before the cutoff. The peer must apply the manifest, not its own choice.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from miner.peer import Peer
from node.model.fingerprint import fingerprint
from node.model.llama import build_model
from node.runtime.clock import ChainClock
from node.runtime.commit import commitment_for
from node.window.consensus import roster_block
from node.window.history import publish_aggregate
from node.window.manifest import WindowManifest, publish_manifest
from protocol.chain import open_chain
from protocol.chain.local_db import LocalChainDB, create_local_chain
from protocol.commitment import render_commitment
from protocol.keys import create_hotkey
from protocol.runconfig import RunConfig
from protocol.stores import open_store

BLOCK_S = 0.25
# the cutoff: 132 blocks (33 s) after the gather block, room for a loaded machine; the peer waits
# only until the manifest lands
FETCH_S, WAIT_S = 3.0, 30.0
LATE_S = 2.0  # how long the lead publishes after the peer starts waiting for it


class _GatherEnd(logging.Handler):
    """Sets an event when the peer logs the end of its gather: from then on it waits."""

    def __init__(self) -> None:
        super().__init__()
        self.ended = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("exchange of window 0: gather"):
            self.ended.set()


def test_a_peer_waits_for_a_late_lead_until_the_cutoff_block(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    create_local_chain(tmp_path / "chain.db", 1, block_time=BLOCK_S)
    db = LocalChainDB(tmp_path / "chain.db")
    wallets = tmp_path / "wallets"
    peer_key = create_hotkey("sim", "peer", root=wallets)
    lead_key = create_hotkey("sim", "lead", root=wallets)
    db.register(1, peer_key.ss58_address)
    db.register(1, lead_key.ss58_address)
    db.add_stake(1, lead_key.ss58_address, 100.0)
    db.set_validator_permit(1, lead_key.ss58_address, True)
    chain = open_chain(f"local://{tmp_path / 'chain.db'}", netuid=1)
    root = tmp_path / "buckets"
    for key, bucket in ((peer_key, "peer"), (lead_key, "lead")):
        chain.commit(key, render_commitment(commitment_for(f"file://{root}?bucket={bucket}")))
    run = RunConfig.preset(
        "tiny",
        name="late-lead",
        inner_steps=2,
        consensus={"fetch_budget_s": FETCH_S, "manifest_wait_s": WAIT_S},
        timing={"block_time_s": BLOCK_S, "blocks_per_window": 40, "upload_deadline_blocks": 4,
                "clock_skew_tolerance_s": BLOCK_S, "start_block": chain.block() + 16},
    )  # fmt: skip
    store = open_store(f"file://{root}?bucket=peer")
    peer = Peer(run, peer_key, chain, store, tmp_path / "state", local_root=root)
    peer_uid, lead_uid = chain.uid_of(peer_key.ss58_address), chain.uid_of(lead_key.ss58_address)
    assert peer_uid is not None and lead_uid is not None
    start_fp = fingerprint(build_model(run.model, run.seed))
    lead_store = open_store(f"file://{root}?bucket=lead")

    gather_end = _GatherEnd()
    logging.getLogger("tessera.miner.peer").addHandler(gather_end)

    def late_lead() -> None:
        ChainClock(chain, run).wait_for_block(ChainClock(chain, run).gather_block(0))
        gather_end.ended.wait(timeout=60)
        time.sleep(LATE_S)
        publish_aggregate(lead_store, run, 0, lead_uid, lead_key, {}, {})
        manifest = WindowManifest(
            run_id=run.run_id, window=0, roster_block=roster_block(run, 0),
            validator_uid=lead_uid, validator_hotkey=lead_key.ss58_address,
            fingerprint_start=start_fp, entries=(), rejected={str(peer_uid): "copy"},
        )  # fmt: skip
        publish_manifest(lead_store, manifest, lead_key)

    caplog.set_level(logging.INFO, logger="tessera.miner.peer")
    lead = threading.Thread(target=late_lead, daemon=True)
    lead.start()
    try:
        report = peer.run_window(0)
    finally:
        logging.getLogger("tessera.miner.peer").removeHandler(gather_end)
    lead.join(timeout=30)
    assert report.gathered == [peer_uid]  # its own choice would apply its own update
    assert report.agreed_by == f"manifest of validator uid {lead_uid}", report.agreed_by
    assert report.applied == []
    assert report.fingerprint == start_fp  # nothing applied: the lead's model, not a fork
    # the window's phases, each logged with its duration as it ends, and kept in the report
    logged = [r.getMessage() for r in caplog.records if r.name == "tessera.miner.peer"]
    for line in (
        "window 0: train",
        "exchange of window 0: upload",
        "exchange of window 0: gather",
        "exchange of window 0: wait for the manifest",
        "window 0: fingerprint and save",
    ):
        assert any(m.startswith(line) for m in logged), (line, logged)
    waited = report.seconds["wait for the manifest"]
    assert waited >= LATE_S - 0.05 and report.seconds["window"] >= waited  # the late lead wait
