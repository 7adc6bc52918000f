"""End to end: real peer, adversary and validator processes on the embedded chain and storage.

Two honest miners, a noise uploader, a copier (downloads uid 1's update, perturbs it, re-signs it
with its own key) and a registered peer that never uploads. The validator mirrors the honest
peers' model bit for bit, and its weights, read back from the chain, go to the honest peers only.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from node.runtime.commit import commitment_for, ensure_commitment
from protocol.chain import open_chain
from protocol.naming import ObjectKind, parse_key
from tests.support.local_run import NETUID, LocalRun, stop

WINDOWS = 5
STARTUP_BLOCKS = 60
"""Window 0 opens 30 s after the chain starts, or as soon as every process has started (imported
torch, posted its commitment), whichever is first."""


@pytest.mark.slow
def test_validator_weights_honest_peers_only(tmp_path: Path) -> None:
    local = LocalRun(tmp_path)
    local.write_config(
        name="val-e2e", inner_steps=2, optimizer={"warmup_steps": 2},
        timing={"block_time_s": 0.5, "blocks_per_window": 30, "upload_deadline_blocks": 6,
                "clock_skew_tolerance_s": 0.5, "start_block": STARTUP_BLOCKS},
        retention={"windows": 2},  # the latecomer still replays from the newest checkpoint
    )  # fmt: skip
    local.create_chain()
    names = ["val", "peer0", "peer1", "noise", "copier", "ghost", "latecomer"]
    uids = {n: local.register(n, validator=n == "val") for n in names}
    chain = open_chain(local.chain_url, netuid=NETUID)
    ensure_commitment(chain, local.keypair("ghost"), commitment_for(local.store_url("ghost")),
                      post=True)  # fmt: skip

    running = {
        "val": local.start("validator", "val", "--samples", "16", "--checkpoint-every", "2",
                           "--probe-state", "host", windows=WINDOWS),
        **{p: local.start("miner", p, windows=WINDOWS + 1) for p in ("peer0", "peer1")},
        "noise": local.start("sim-adversary", "noise", "--kind", "noise", windows=WINDOWS + 1),
        "copier": local.start("sim-adversary", "copier", "--kind", "copier",
                              "--victim", str(uids["peer0"]), windows=WINDOWS + 1),
    }  # fmt: skip
    local.open_when_up(["ghost", *running])
    deadline = time.time() + 240
    # a peer that joins after two windows must catch up from the validator's published history
    while len(local.reports("val")) < 2 and time.time() < deadline:
        time.sleep(0.5)
    running["latecomer"] = local.start("miner", "latecomer", windows=2)
    try:
        local.wait({"val": running["val"]}, timeout=deadline - time.time(), tail=4000)
    finally:
        stop(running.values())

    reports = local.reports("val")
    assert len(reports) == WINDOWS
    # windows processed live set weights on chain, though scoring runs into the next window
    assert all(r["weights_status"].startswith("set ") for r in reports[1:]), [
        r["weights_status"] for r in reports
    ]
    verdicts = {u: [r_["verdict"] for r in reports for r_ in r["peers"] if r_["uid"] == u]
                for u in uids.values()}  # fmt: skip
    assert all(v == "missing" for v in verdicts[uids["ghost"]])
    assert "copy" in verdicts[uids["copier"]], verdicts
    # the validator mirrors the honest peers' outer step bit for bit
    peer_fps = {r["window"]: r["fingerprint"] for r in local.reports("peer0")}
    common = [r for r in reports if r["window"] in peer_fps]
    assert common, (peer_fps, [r["window"] for r in reports])
    for r in common:
        assert r["fingerprint_end"] == peer_fps[r["window"]], r["window"]

    late_fps = {r["window"]: r["fingerprint"] for r in local.reports("latecomer")}
    assert late_fps and min(late_fps) >= 2, late_fps
    for w, fp in late_fps.items():
        if w in peer_fps:
            assert fp == peer_fps[w], (w, local.log("latecomer")[-3000:])

    published: dict[ObjectKind, set[int]] = {}
    for path in local.bucket("val").rglob("w*/*/*.*"):
        key = parse_key(path.relative_to(local.bucket("val")).as_posix())
        published.setdefault(key.kind, set()).add(key.window)
    newest = max(published[ObjectKind.MANIFEST])
    floor = min(newest, reports[-1]["window"] - 1)  # retention kept the replay chain only
    assert floor > 0 and min(published[ObjectKind.AGGREGATE]) >= floor, published

    weights = chain.read_weights(uids["val"])
    assert weights.get(uids["peer0"], 0) > 0 and weights.get(uids["peer1"], 0) > 0, reports[-1]
    for bad in ("noise", "copier", "ghost"):
        assert weights.get(uids[bad], 0.0) == 0.0, (bad, weights)
