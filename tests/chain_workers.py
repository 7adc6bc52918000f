"""Worker processes for the local-chain concurrency test (imported by spawned children).

Kept apart from the test module so that a child process imports only what it needs.
"""

from __future__ import annotations

import traceback
from typing import Any

from substrateinterface import Keypair

from protocol.chain.local import LocalChain


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
