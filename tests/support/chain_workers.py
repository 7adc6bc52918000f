"""Worker processes for the local-chain concurrency tests (imported by spawned children).

Kept apart from the test module so that a child process imports only what it needs.
"""

from __future__ import annotations

import hashlib
import time
import traceback
from typing import Any

from substrateinterface import Keypair

from protocol.chain.errors import ChainUnavailable
from protocol.chain.local import LocalChain
from protocol.chain.local_db import LocalChainDB
from protocol.chain.local_history import FINALITY_DEPTH
from protocol.chain.models import ChainSnapshot


def run_worker(spec: dict[str, Any], results: Any, barrier: Any) -> None:
    """Commit (and, for validators, set weights) `spec["rounds"]` times, reading in between.

    Puts one dict on `results`: what it wrote last, the blocks it saw, and any consistency
    violation it observed (read-your-writes, monotonic blocks, well-formed snapshots).
    """
    out: dict[str, Any] = {"uri": spec["uri"], "problems": [], "blocks": []}
    try:
        chain = LocalChain(spec["db"], spec["netuid"])
        keypair = Keypair.create_from_uri(spec["uri"])
        barrier.wait(timeout=60)
        last_block = -1
        for i in range(spec["rounds"]):
            data = f"{spec['uri']}#{i}".encode()
            committed = chain.commit(keypair, data)
            if committed.block < last_block:
                out["problems"].append(f"block went back: {committed.block} < {last_block}")
            last_block = committed.block
            out["blocks"].append(committed.block)
            mine = chain.read_commitment(keypair.ss58_address)
            if mine is None or mine.data != data:
                out["problems"].append(f"round {i}: did not read back own commitment")
            if spec["validator"]:
                uids = spec["miner_uids"]
                weights = [float((i + j) % 4 + 1) for j in range(len(uids))]
                chain.set_weights(keypair, uids, weights, version_key=i)
                out["last_weights"] = dict(zip(uids, weights, strict=True))
                seen = chain.read_weights(keypair.ss58_address)
                total = sum(weights)
                expected = {u: w / total for u, w in zip(uids, weights, strict=True)}
                if any(abs(seen.get(u, -1.0) - w) > 1e-12 for u, w in expected.items()):
                    out["problems"].append(f"round {i}: weights read back differ")
            snapshot = chain.read_all_commitments()
            if any(c.hotkey != hk or len(c.data) > 128 for hk, c in snapshot.items()):
                out["problems"].append(f"round {i}: malformed snapshot")
            if chain.metagraph().n != spec["n"]:
                out["problems"].append(f"round {i}: metagraph size changed")
        out["last_data"] = f"{spec['uri']}#{spec['rounds'] - 1}"
        chain.close()
    except Exception:
        out["problems"].append(traceback.format_exc())
    results.put(out)


# -- snapshots: two readers and one writer (tests/unit/test_chain_snapshot.py) -------------------------


def snapshot_digest(snapshot: ChainSnapshot) -> str:
    """A fingerprint of everything in a snapshot (equal snapshots, equal digests)."""
    return hashlib.sha256(repr(snapshot.model_dump()).encode()).hexdigest()


def run_history_writer(spec: dict[str, Any], results: Any, barrier: Any) -> None:
    """For `spec["seconds"]`, cycle through every kind of write: commitment, weights, stake,
    validator permit, a new registration and a uid replacement."""
    out: dict[str, Any] = {"role": "writer", "problems": [], "writes": 0, "refused": 0}
    try:
        chain = LocalChain(spec["db"], spec["netuid"])
        admin = LocalChainDB(spec["db"])
        validator = Keypair.create_from_uri(spec["validator_uri"])
        miners = [Keypair.create_from_uri(uri) for uri in spec["miner_uris"]]
        newcomers: list[int] = []
        barrier.wait(timeout=60)
        deadline = time.monotonic() + spec["seconds"]
        step = 0
        while time.monotonic() < deadline:
            try:
                _write_one(step, spec, chain, admin, validator, miners, newcomers)
                out["writes"] += 1
            except ChainUnavailable:
                out["refused"] += 1  # a clock anomaly met the seal: refused, never misplaced
            step += 1
            time.sleep(0.004)
        chain.close()
        admin.close()
    except Exception:
        out["problems"].append(traceback.format_exc())
    results.put(out)


def _write_one(
    step: int,
    spec: dict[str, Any],
    chain: LocalChain,
    admin: LocalChainDB,
    validator: Keypair,
    miners: list[Keypair],
    newcomers: list[int],
) -> None:
    netuid = spec["netuid"]
    miner = miners[step % len(miners)]
    kind = step % 6
    if kind == 0:
        chain.commit(miner, f"step {step}".encode())
    elif kind == 1:
        weights = [float((step + j) % 3 + 1) for j in range(len(spec["miner_uids"]))]
        chain.set_weights(validator, spec["miner_uids"], weights, version_key=0)
    elif kind == 2:
        admin.add_stake(netuid, miner.ss58_address, 0.25)
    elif kind == 3:
        admin.set_validator_permit(netuid, miner.ss58_address, step % 4 == 3)
    elif kind == 4:
        hotkey = Keypair.create_from_seed(hashlib.sha256(f"new {step}".encode()).hexdigest())
        newcomers.append(admin.register(netuid, hotkey.ss58_address, stake=1.0))
    elif newcomers:
        hotkey = Keypair.create_from_seed(hashlib.sha256(f"swap {step}".encode()).hexdigest())
        admin.register(netuid, hotkey.ss58_address, replace_uid=newcomers[0])


def run_snapshot_reader(spec: dict[str, Any], results: Any, barrier: Any) -> None:
    """Snapshot every block from `spec["first_block"]` as soon as it is final, for
    `spec["seconds"]`, re-reading earlier ones; report each block's digest and any block whose
    snapshot changed between two reads."""
    out: dict[str, Any] = {"role": "reader", "problems": [], "digests": {}, "rereads": 0}
    try:
        chain = LocalChain(spec["db"], spec["netuid"])
        digests: dict[int, str] = out["digests"]
        barrier.wait(timeout=60)
        deadline = time.monotonic() + spec["seconds"]
        block = spec["first_block"]
        while time.monotonic() < deadline:
            while block <= chain.block() - FINALITY_DEPTH:
                digests[block] = snapshot_digest(chain.snapshot(block))
                block += 1
            for earlier in list(digests)[-3:]:
                out["rereads"] += 1
                if snapshot_digest(chain.snapshot(earlier)) != digests[earlier]:
                    out["problems"].append(f"snapshot of block {earlier} changed")
            time.sleep(0.01)
        chain.close()
    except Exception:
        out["problems"].append(traceback.format_exc())
    results.put(out)
