"""The validator streams a window's updates: its peak memory is flat in the number of peers.

A real `Validator.run_window` (SQLite chain, file buckets, checks, agreement, outer step and
scoring) processes the window of 64 registered peers twice, each time in a fresh process: once
with 8 of them uploading, once with all 64, and the growth of the process's peak RSS over the
window is compared. The updates' bytes go to the window's spool directory as they arrive and are
read back one at a time, so what a validator keeps per peer is its sketch (`sketch_size` entries
of 12 bytes); the extra peers may cost at most that each. A validator that kept every update's
bytes in memory grows by about their size per peer (three times the bound here), one that kept
the decoded updates by ten times that.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from substrateinterface import Keypair

from codec.compress import Compressor
from codec.spec import ModelSpec
from lab.bench.codec import one_thread
from node.model.llama import build_model
from node.runtime.commit import commitment_for
from node.strategy import make_strategy
from node.window.exchange import encode_signed
from protocol.chain.local import LocalChain
from protocol.chain.local_db import LocalChainDB, create_local_chain
from protocol.commitment import render_commitment
from protocol.naming import update_key
from protocol.runconfig import RunConfig
from protocol.stores import open_store
from tests.support.chain_clock import Clock
from validator.fetching import SPOOL

NETUID = 5
BLOCK_TIME = 12.0
RUN = RunConfig.preset(
    "tiny",
    name="validator-memory",
    timing={"block_time_s": BLOCK_TIME, "blocks_per_window": 100, "upload_deadline_blocks": 2},
    gather_size=64,
    model={"n_layers": 1},  # fewer tensors, faster decoding; the embedding keeps updates large
)
PEERS = 64
SKETCH = 1024
"""`ValidatorConfig.sketch_size`: sketches (`validator.copies`) are the validator's per-peer
memory by design, a fixed number of 12-byte entries (uint64 position, float32 value) each."""
TESTS = Path(__file__).resolve().parent


def key(i: int) -> Keypair:
    return Keypair.create_from_uri(f"//vmem{i}")


def make_world(root: Path, peers: int, genesis: float) -> int:
    """Validator uid 0 and `peers` peers, each with a signed update of window 0 in its bucket;
    returns the largest update's size in bytes."""
    with one_thread():  # far faster on a box busy with other work
        return _make_world(root, peers, genesis)


def _make_world(root: Path, peers: int, genesis: float) -> int:
    clock = Clock(genesis, BLOCK_TIME)
    create_local_chain(root / "chain.db", NETUID, block_time=BLOCK_TIME, clock=clock)
    admin = LocalChainDB(root / "chain.db", clock=clock)
    chain = LocalChain(root / "chain.db", NETUID, clock=clock)
    spec = ModelSpec.from_module(build_model(RUN.model, RUN.seed))
    gen = torch.Generator().manual_seed(peers)
    largest = 0
    for uid in range(peers + 1):
        admin.register(NETUID, key(uid).ss58_address, validator=uid == 0, stake=100.0 * (uid == 0))
        url = f"file://{root}?bucket=bucket{uid}"
        chain.commit(key(uid), render_commitment(commitment_for(url)))
        if uid == 0:
            continue
        comp = Compressor(spec, RUN.codec)
        sparse = [
            comp.compress(t.name, torch.randn(t.shape, generator=gen) * 1e-3, 0.95)
            for t in spec.tensors
        ]
        data = encode_signed(sparse, RUN, spec, 0, uid, key(uid))
        open_store(url).put(update_key(RUN.run_id, 0, uid, key(uid).ss58_address), data)
        largest = max(largest, len(data))
    chain.close()
    admin.close()
    return largest


def window_peak_growth(root: Path, genesis: float) -> dict:
    """Run in a fresh process: the validator's window 0, how far it raised the process's peak
    resident memory (run with malloc returning large blocks to the system at once, so the peak
    is what was live at one time), and what is left in its spool (a crash's leftovers planted
    before the start included)."""
    import resource

    from validator.config import ValidatorConfig
    from validator.loop import Validator

    clock = Clock(genesis, BLOCK_TIME)
    chain = LocalChain(root / "chain.db", NETUID, clock=clock)
    store = open_store(f"file://{root}?bucket=bucket0")
    crashed = root / "state" / SPOOL / "window-9"
    crashed.mkdir(parents=True)
    (crashed / "update-3").write_bytes(b"left by a crash")
    cfg = ValidatorConfig(  # random updates show no training: admitted all the same here
        n_random=8,
        n_own=8,
        max_scored=2,
        sketch_size=SKETCH,
        admit_z=-math.inf,
        admit_min_effect=-math.inf,
    )
    validator = Validator(RUN, key(0), chain, store, root / "state", cfg, local_root=root)
    make_strategy(RUN, validator.spec)  # warm every lazy import and table before measuring
    clock.at(validator.clock.gather_block(0))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report = validator.run_window(0)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    chain.close()
    left = sorted(str(p.relative_to(root)) for p in (root / "state" / SPOOL).rglob("*"))
    return {"growth": after - before, "aggregated": len(report.aggregated), "spool": left}


def measure(root: Path, genesis: float) -> dict:
    code = (
        "import json, sys; from pathlib import Path; from test_validator_memory import "
        "window_peak_growth as g; print(json.dumps(g(Path(sys.argv[1]), float(sys.argv[2]))))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parents[1])])}
    env.update(OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536", MALLOC_ARENA_MAX="1")
    done = subprocess.run(
        [sys.executable, "-c", code, str(root), repr(genesis)],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_peak_memory_is_flat_in_the_number_of_peers(tmp_path: Path) -> None:
    genesis = time.time() - 5 * BLOCK_TIME  # the uploads land inside window 0 (20 min long)
    many_root, few_root = tmp_path / "all", tmp_path / "few"
    largest = make_world(many_root, PEERS, genesis)
    shutil.copytree(many_root, few_root)
    for uid in range(9, PEERS + 1):  # only peers 1..8 uploaded
        shutil.rmtree(few_root / f"bucket{uid}")
    few, many = measure(few_root, genesis), measure(many_root, genesis)
    assert (few["aggregated"], many["aggregated"]) == (8, PEERS)  # every upload went through
    assert few["spool"] == many["spool"] == []  # the window's files, and a crash's, are gone
    per_peer = (many["growth"] - few["growth"]) / (PEERS - 8)
    bound = SKETCH * 12  # one sketch per extra peer
    # keeping each update's bytes costs `largest` per peer: the measurement can tell
    assert largest > 3 * bound
    assert per_peer < bound, (few, many, per_peer, largest)
