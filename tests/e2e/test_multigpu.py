"""One peer on several ranks (`miner.multigpu`): sharding, batch split, EF shards, and a real
2-rank gloo run under torchrun that must end where the 1-rank run of the same windows ends."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from codec.aggregate import aggregate
from codec.compress import Compressor, SparseTensor
from codec.spec import ModelSpec
from miner.ranks import DistributedRanks, Ranks, shard_tensors
from miner.train import make_optimizer, micro_steps, train_window
from node.model.llama import build_model
from node.runtime.state import PeerState, load_error_feedback, load_state, save_ef_shard
from protocol.runconfig import RunConfig
from tests.support.multirank import (
    LR,
    PEER,
    fraction_off,
    max_abs_diff,
    relative_diff,
    setup_peer,
    start_miner,
)

CPU = torch.device("cpu")


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


# -- 2 gloo ranks in-process: inner steps, sharded compression, aggregate broadcast ------------


def _tiny_window(ranks: Ranks) -> tuple[dict[str, torch.Tensor], float, list[SparseTensor]]:
    """4 inner steps on fixed tokens, then compression of fixed deltas; on `ranks`."""
    run = RunConfig.preset("tiny", inner_steps=4, optimizer={"warmup_steps": 4})
    model = build_model(run.model, run.seed)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 4096, (8, 65), generator=gen) for _ in range(4)]
    opt = make_optimizer(model, run)
    rows = map(ranks.local_rows, batches)
    inner = ranks.reduce_inner(train_window(ranks.wrap(model), opt, rows, run, 0, CPU))
    spec = ModelSpec.from_module(model)
    deltas = {t.name: torch.randn(t.shape, generator=gen) * 1e-3 for t in spec.tensors}
    compressor = Compressor(ranks.shard_of(spec), run.codec)
    mine = [compressor.compress(t.name, deltas[t.name], 0.9) for t in compressor.spec.tensors]
    sparse = ranks.gather_pieces(mine, spec)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return weights, inner.mean_loss, sparse


def _rank_main(rank: int, tmp: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'pg'}", rank=rank, world_size=2)
    ranks = DistributedRanks(rank, 2, CPU)
    weights, loss, sparse = _tiny_window(ranks)
    run = RunConfig.preset("tiny")
    spec = ModelSpec.from_module(build_model(run.model, run.seed))
    mean = aggregate({0: sparse}, spec, run.codec) if ranks.is_main else None
    mean = ranks.broadcast_aggregate(mean, spec, CPU)
    torch.save(
        {"weights": weights, "loss": loss, "sparse": sparse, "mean": mean}, tmp / f"{rank}.pt"
    )
    ranks.close()


def test_two_gloo_ranks_train_compress_and_aggregate_like_one(tmp_path: Path) -> None:
    mp.spawn(_rank_main, args=(tmp_path,), nprocs=2, join=True)
    weights, loss, sparse = _tiny_window(Ranks())
    run = RunConfig.preset("tiny")
    spec = ModelSpec.from_module(build_model(run.model, run.seed))
    mean = aggregate({0: sparse}, spec, run.codec)
    r0, r1 = (torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(2))
    # The inner steps: the same math, another summation order (DDP splits the batch). Almost
    # every weight agrees to float32 noise; AdamW's m/sqrt(v) turns a near-zero gradient into
    # ±lr whatever its size, so the few entries whose gradient is noise may move by up to lr.
    assert fraction_off(weights, r0["weights"], 1e-5) < 1e-3
    assert max_abs_diff(weights, r0["weights"]) <= LR
    assert relative_diff(r0["weights"], r1["weights"]) == 0.0  # ranks never drift apart
    assert r0["loss"] == pytest.approx(loss, rel=1e-5)
    # compression of identical deltas, sharded over the ranks: bit for bit the 1-rank update
    assert [s.name for s in r0["sparse"]] == [t.name for t in spec.tensors]
    assert r1["sparse"] == []
    for got, want in zip(r0["sparse"], sparse, strict=True):
        assert torch.equal(got.codebook, want.codebook)
        for g, w in zip(got.groups, want.groups, strict=True):
            assert torch.equal(g.idx, w.idx) and torch.equal(g.codes, w.codes)
            assert torch.equal(g.scales, w.scales)
    for rank in (r0, r1):  # every rank gets rank 0's aggregate
        assert all(torch.equal(rank["mean"][k], mean[k]) for k in mean)


# -- 2 ranks vs 1 rank, real processes on the embedded chain and storage -----------------------


@pytest.mark.slow
def test_two_ranks_end_where_one_rank_ends(tmp_path: Path) -> None:
    # window 0 opens once both peers, however slow to start (torchrun under load: over 10 s),
    # have committed their bucket (`open_when_up`; at the latest 30 s after the chains start), so
    # both train windows 0 and 1
    one = setup_peer(tmp_path / "one", 0.0, start_block=60)
    two = setup_peer(tmp_path / "two", 0.0, start_block=60)
    procs = [start_miner(one, 1, 2), start_miner(two, 2, 2)]
    one.open_when_up([PEER])
    two.open_when_up([PEER])
    for p, local in zip(procs, (one, two), strict=True):
        local.wait({PEER: p}, timeout=150)
    r1, r2 = one.reports(PEER), two.reports(PEER)
    assert [r["window"] for r in r1] == [r["window"] for r in r2] == [0, 1]
    assert [r["gathered"] for r in r2] == [[0], [0]]
    for a, b in zip(r1, r2, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert b["upload_bytes"] > 0

    run_id = RunConfig.load(one.run_file).run_id  # the same config in both
    s1, s2 = load_state(one.state_dir(PEER), run_id), load_state(two.state_dir(PEER), run_id)
    assert s1 is not None and s2 is not None and s1.window == s2.window == 2
    # The update is discrete (Top-k positions, 2-bit codes, scale bytes): a last-bit difference
    # in the pseudo-gradient can move an entry across the Top-k threshold or a chunk's scale
    # byte, and that entry then differs by a quantization step. All others must agree.
    assert fraction_off(s1.model, s2.model, 1e-5) < 0.005
    assert (two.state_dir(PEER) / "ef-rank1.pt").exists()
    assert set(s2.error_feedback) < set(s1.error_feedback)  # rank 0 keeps only its shard
    ef2 = load_error_feedback(two.state_dir(PEER), s2)
    assert fraction_off(s1.error_feedback, ef2, 1e-3) < 0.005

    # both ranks resume from the saved state (rank 1 from its EF shard) and train on
    two.wait({PEER: start_miner(two, 2, 1)}, timeout=90)
    assert "resumed at window 2" in two.log(PEER)
    assert len(two.reports(PEER)) == 3 and two.reports(PEER)[-1]["window"] >= 2
