"""DiLoCo through the whole pipeline: real validator and peer processes on the embedded chain and
storage, dense bf16 updates, outer Nesterov. The validator mirrors the peers bit for bit, judges
their dense updates like sparse ones, and a peer that joins late restores the momentum from the
validator's checkpoint and lands on the same weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from protocol.chain.local_db import LocalChainDB, create_local_chain
from protocol.keys import create_hotkey
from protocol.runconfig import RunConfig

NETUID = 1
WINDOWS = 4
START_BLOCK = 70  # window 0 opens once every process has imported torch and loaded the data
ROOT = Path(__file__).resolve().parents[2]


def _start(tmp: Path, name: str, role: str, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "commands.cli", role, "--hotkey", name, "--wallet", "sim",
        "--run", str(tmp / "run.json"), "--chain", f"local://{tmp / 'chain.db'}",
        "--local-root", str(tmp / "buckets"), "--wallet-path", str(tmp / "wallets"),
        "--store", f"file://{tmp / 'buckets'}?bucket={name}", "--state-dir", str(tmp / name),
        "--commit", *extra,
    ]  # fmt: skip
    (tmp / "buckets" / name).mkdir(parents=True, exist_ok=True)
    log = (tmp / f"{name}.log").open("ab")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def _reports(tmp: Path, name: str) -> list[dict]:
    path = tmp / name / "reports.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_diloco_peers_validator_and_a_latecomer_stay_identical(tmp_path: Path) -> None:
    """With outer.delay = 1 (delay 0 is the other end-to-end tests' schedule): the validator's
    schedule, its checkpoint (momentum and the held mean) and the latecomer's replay of it match
    the peers' weights bit for bit."""
    delay = 1
    tmp = tmp_path
    RunConfig.preset(
        "tiny", name="diloco-e2e", strategy="diloco", inner_steps=2,
        optimizer={"warmup_steps": 2},
        outer={"optimizer": "nesterov", "alpha": 0.7, "delay": delay},
        timing={"block_time_s": 0.5, "blocks_per_window": 30, "upload_deadline_blocks": 8,
                "clock_skew_tolerance_s": 0.5, "start_block": START_BLOCK},
    ).dump(tmp / "run.json")  # fmt: skip
    create_local_chain(tmp / "chain.db", NETUID, block_time=0.5)
    db = LocalChainDB(tmp / "chain.db")
    uids = {
        n: db.register(NETUID, create_hotkey("sim", n, root=tmp / "wallets").ss58_address,
                       validator=n == "val")
        for n in ("val", "peer0", "peer1", "latecomer")
    }  # fmt: skip
    running = {
        "val": _start(tmp, "val", "validator", "--windows", str(WINDOWS), "--samples", "16",
                      "--checkpoint-every", "2"),
        **{p: _start(tmp, p, "miner", "--windows", str(WINDOWS + 1)) for p in ("peer0", "peer1")},
    }  # fmt: skip
    deadline = time.time() + 420
    while len(_reports(tmp, "val")) < 2 and time.time() < deadline:
        time.sleep(0.5)
    running["latecomer"] = _start(tmp, "latecomer", "miner", "--windows", "2")
    try:
        running["val"].wait(timeout=max(1, deadline - time.time()))
        running["latecomer"].wait(timeout=max(1, deadline - time.time()))
    finally:
        for p in running.values():
            if p.poll() is None:
                p.terminate()
                p.wait(10)
    assert running["val"].returncode == 0, (tmp / "val.log").read_text()[-4000:]
    assert running["latecomer"].returncode == 0, (tmp / "latecomer.log").read_text()[-4000:]

    reports = _reports(tmp, "val")
    assert len(reports) == WINDOWS
    peers = {n: {r["window"]: r for r in _reports(tmp, n)} for n in ("peer0", "peer1", "latecomer")}
    for r in reports:  # the validator's model after each window is the peers'
        for n in ("peer0", "peer1"):
            if r["window"] in peers[n]:
                assert r["fingerprint_end"] == peers[n][r["window"]]["fingerprint"], (
                    n,
                    r["window"],
                )
    honest = (uids["peer0"], uids["peer1"])
    judged = [p for r in reports[1:] for p in r["peers"] if p["uid"] in honest]
    assert judged and all(p["verdict"] == "ok" for p in judged), judged
    sizes = [r["upload_bytes"] for r in peers["peer0"].values() if r["exchanged"] is not None]
    assert min(sizes) > 2 * 1_300_000  # 1.3 M parameters in bf16: a dense update
    late = peers["latecomer"]
    assert late and min(late) >= 2, late
    common = sorted(set(late) & set(peers["peer0"]))  # a slow latecomer may outlive the peers
    assert common, (late, peers["peer0"])
    for w in common:  # restored from the checkpoint: weights and momentum
        assert late[w]["fingerprint"] == peers["peer0"][w]["fingerprint"], (
            tmp / "latecomer.log"
        ).read_text()[-3000:]
    last = max(peers["peer0"])  # the peers may still be in their extra window
    assert last >= WINDOWS - 1 and peers["peer0"][last]["loss"] < peers["peer0"][0]["loss"]
