"""One peer on several ranks (`node.multigpu`): sharding, batch split, EF shards, and a real
2-rank gloo run under torchrun that must end where the 1-rank run of the same windows ends."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_peers_e2e import reports, wait

from codec.spec import ModelSpec
from node.model import build_model
from node.multigpu import DistributedRanks, shard_tensors
from node.state import PeerState, load_error_feedback, load_state, save_ef_shard
from node.train import micro_steps
from protocol.chain.local_db import LocalChainDB, create_local_chain
from protocol.keys import create_hotkey
from protocol.runconfig import RunConfig

NETUID = 1


def tiny_spec() -> ModelSpec:
    return ModelSpec.from_module(build_model(RunConfig.preset("tiny").model, 0))


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_shard_tensors_partition_balanced_deterministic(world: int) -> None:
    spec = tiny_spec()
    shards = shard_tensors(spec, world)
    assert shards == shard_tensors(spec, world)
    names = [n for shard in shards for n in shard]
    assert sorted(names) == sorted(t.name for t in spec.tensors)  # each tensor exactly once
    order = [t.name for t in spec.tensors]
    for shard in shards:
        assert list(shard) == sorted(shard, key=order.index)
    numel = {t.name: t.numel for t in spec.tensors}
    loads = [sum(numel[n] for n in shard) for shard in shards]
    assert max(loads) - min(loads) <= max(numel.values())


def test_shard_of_keeps_only_own_tensors() -> None:
    spec = tiny_spec()
    mine = [DistributedRanks(r, 2, torch.device("cpu")).shard_of(spec) for r in range(2)]
    assert [t.name for t in mine[0].tensors] == list(shard_tensors(spec, 2)[0])
    assert mine[0].numel + mine[1].numel == spec.numel


def test_batch_rows_split_into_equal_slices_whose_union_is_the_batch() -> None:
    batch = torch.arange(8 * 5).view(8, 5)
    parts = [DistributedRanks(r, 4, torch.device("cpu")).local_rows(batch) for r in range(4)]
    assert torch.equal(torch.cat(parts), batch)
    with pytest.raises(ValueError, match="does not split"):
        DistributedRanks(0, 3, torch.device("cpu")).local_rows(batch)
    assert [micro_steps(rows, 8) for rows in (8, 64, 4, 12, 11)] == [1, 8, 1, 2, 11]


def test_ef_of_a_state_is_merged_from_the_shards_of_its_window(tmp_path: Path) -> None:
    state = PeerState("run", 4, {}, {}, {"a": torch.zeros(2)}, "fp")
    save_ef_shard(tmp_path, "run", 4, 1, {"b": torch.ones(3)})
    save_ef_shard(tmp_path, "run", 5, 1, {"b": torch.full((3,), 2.0)})  # written, no state.pt yet
    save_ef_shard(tmp_path, "other-run", 4, 2, {"c": torch.ones(1)})
    merged = load_error_feedback(tmp_path, state)
    assert sorted(merged) == ["a", "b"]
    assert torch.equal(merged["b"], torch.ones(3))  # the previous file: the state's window


# -- 2 ranks vs 1 rank, real processes on the embedded chain and storage -----------------------


def fast_run(tmp: Path) -> Path:
    run = RunConfig.preset(
        "tiny",
        name="multigpu",
        inner_steps=4,
        optimizer={"warmup_steps": 4},
        outer={"ef_freeze_fraction": 0.0},  # error feedback from the first window
        timing={"block_time_s": 0.5, "blocks_per_window": 16, "upload_deadline_blocks": 4,
                "clock_skew_tolerance_s": 0.5},
    )  # fmt: skip
    return run.dump(tmp / "run.json")


def start_miner(tmp: Path, nproc: int, windows: int, genesis_in_s: float) -> subprocess.Popen:
    """One peer (uid 0, alone on its own chain) on `nproc` ranks; its log is `tmp/peer0.log`."""
    tmp.mkdir()
    fast_run(tmp)
    create_local_chain(tmp / "chain.db", NETUID, block_time=0.5, clock=lambda: time.time() + genesis_in_s)  # fmt: skip
    kp = create_hotkey("sim", "peer0", root=tmp / "wallets")
    LocalChainDB(tmp / "chain.db").register(NETUID, kp.ss58_address)
    launcher = [sys.executable, "-m", "deploy.cli"]
    if nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node", str(nproc), "-m", "deploy.cli"]  # fmt: skip
    cmd = [
        *launcher, "miner", "--run-config", str(tmp / "run.json"), "--device", "cpu",
        "--chain", f"local://{tmp / 'chain.db'}", "--netuid", str(NETUID),
        "--store", f"file://{tmp / 'buckets'}?bucket=peer-0", "--local-root", str(tmp / "buckets"),
        "--wallet", "sim", "--hotkey", "peer0", "--wallet-path", str(tmp / "wallets"),
        "--state-dir", str(tmp / "state0"), "--windows", str(windows), "--commit",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = (tmp / "peer0.log").open("ab")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def relative_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-12)) for k in a)


@pytest.mark.slow
def test_two_ranks_end_where_one_rank_ends(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    # both chains start in 10 s, so both peers, however slow to start, train windows 0 and 1
    procs = [start_miner(one, 1, 2, 10.0), start_miner(two, 2, 2, 10.0)]
    for p, d in zip(procs, (one, two), strict=True):
        wait([p], d, timeout=150)
    r1, r2 = reports(one, 0), reports(two, 0)
    assert [r["window"] for r in r1] == [r["window"] for r in r2] == [0, 1]
    assert [r["gathered"] for r in r2] == [[0], [0]]
    for a, b in zip(r1, r2, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert b["upload_bytes"] > 0

    run_id = RunConfig.load(one / "run.json").run_id  # the same config in both
    s1, s2 = load_state(one / "state0", run_id), load_state(two / "state0", run_id)
    assert s1 is not None and s2 is not None and s1.window == s2.window == 2
    assert relative_diff(s1.model, s2.model) < 1e-5
    assert (two / "state0" / "ef-rank1.pt").exists()
    assert set(s2.error_feedback) < set(s1.error_feedback)  # rank 0 keeps only its shard
    assert relative_diff(s1.error_feedback, load_error_feedback(two / "state0", s2)) < 1e-4
