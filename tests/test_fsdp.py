"""FSDP2 (`node.runtime.fsdp`) tested as DDP is (tests/test_multigpu.py): 2 gloo ranks on the CPU
against 1 rank, and `kill -9` followed by a restart; plus the memory plan (`tessera plan`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_multigpu import fraction_off, relative_diff

from codec.aggregate import aggregate
from codec.compress import Compressor, SparseTensor
from codec.spec import ModelSpec
from node.model.llama import build_model
from node.model.train import make_optimizer, train_window
from node.runtime.fsdp import ShardedRanks, full_tensors, load_full
from node.runtime.memory import GIB, plan_memory
from node.runtime.multigpu import Ranks
from protocol.runconfig import RunConfig

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")
RUN = RunConfig.preset("tiny", inner_steps=4, optimizer={"warmup_steps": 4})


def _window(ranks: Ranks) -> dict[str, object]:
    """4 inner steps on fixed tokens, compression of fixed deltas by tensor ownership, then the
    outer step written back into the (sharded) model; on `ranks`."""
    model = build_model(RUN.model, RUN.seed)
    spec = ModelSpec.from_module(model)
    trainer = ranks.wrap(model)
    opt = make_optimizer(model, RUN)  # after sharding: it holds the sharded parameters
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 4096, (8, 65), generator=gen) for _ in range(4)]
    inner = ranks.reduce_inner(
        train_window(trainer, opt, map(ranks.local_rows, batches), RUN, 0, CPU)
    )
    trained = full_tensors(model)
    deltas = {t.name: torch.randn(t.shape, generator=gen) * 1e-3 for t in spec.tensors}
    compressor = Compressor(ranks.shard_of(spec), RUN.codec)
    mine = [compressor.compress(t.name, deltas[t.name], 0.9) for t in compressor.spec.tensors]
    sparse = ranks.gather_pieces(mine, spec)
    new = None
    if ranks.is_main:
        mean = aggregate({0: sparse}, spec, RUN.codec)
        new = {n: trained[n] - RUN.outer.alpha * mean[n] for n in trained}
    if isinstance(ranks, ShardedRanks):
        load_full(model, new)
    else:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(new[n])
    local = (
        {n: p.to_local().clone() for n, p in model.named_parameters()} if ranks.world > 1 else {}
    )
    return {"trained": trained, "loss": inner.mean_loss, "sparse": sparse, "new": new,
            "after": full_tensors(model), "local": local}  # fmt: skip


def _rank_main(rank: int, tmp: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'pg'}", rank=rank, world_size=2)
    ranks = ShardedRanks(rank, 2, CPU)
    torch.save(_window(ranks), tmp / f"{rank}.pt")
    ranks.close()


def test_two_fsdp2_ranks_train_compress_and_step_like_one(tmp_path: Path) -> None:
    mp.spawn(_rank_main, args=(tmp_path,), nprocs=2, join=True)
    one = _window(Ranks())
    r0, r1 = (torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(2))
    # Inner steps: the same math in another summation order (each rank half the rows, gradients
    # reduce-scattered). Tolerance as for DDP: all but 0.1 % of the weights within 1e-5 of
    # their tensor's scale, none further than 1e-3 (AdamW maps noise-level gradients to ±lr).
    assert fraction_off(one["trained"], r0["trained"], 1e-5) < 1e-3
    assert relative_diff(one["trained"], r0["trained"]) < 1e-3
    assert relative_diff(r0["trained"], r1["trained"]) == 0.0  # ranks hold one model
    assert r0["loss"] == pytest.approx(one["loss"], rel=1e-5)
    # each rank really holds only a shard: about half of every 2-D tensor's rows
    for name, full in r0["trained"].items():
        if full.dim() == 2:
            assert r0["local"][name].shape[0] + r1["local"][name].shape[0] == full.shape[0]
    # compression by tensor ownership: bit for bit the 1-rank update
    assert r1["sparse"] == []
    for got, want in zip(r0["sparse"], one["sparse"], strict=True):
        sparse_equal(got, want)
    # the outer step written into the shards reads back exactly on every rank
    for rank in (r0, r1):
        assert all(torch.equal(rank["after"][k], r0["new"][k]) for k in r0["new"])


def sparse_equal(got: SparseTensor, want: SparseTensor) -> None:
    assert got.name == want.name and torch.equal(got.codebook, want.codebook)
    for g, w in zip(got.groups, want.groups, strict=True):
        assert torch.equal(g.idx, w.idx) and torch.equal(g.codes, w.codes)
        assert torch.equal(g.scales, w.scales)


def _torchrun(out: Path, windows: int, hold: int | None = None) -> subprocess.Popen[bytes]:
    out.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "fsdp_worker.py"), str(out), str(windows)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = (out / "log.txt").open("ab")
    return subprocess.Popen(
        [*cmd, *([str(hold)] if hold else [])], env=env, stdout=log, stderr=log,
        start_new_session=True,
    )  # fmt: skip


def _finish(proc: subprocess.Popen[bytes], out: Path, timeout: float = 240) -> None:
    try:
        assert proc.wait(timeout=timeout) == 0, (out / "log.txt").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow
def test_fsdp2_peer_killed_with_sigkill_resumes_where_an_unbroken_run_ends(
    tmp_path: Path,
) -> None:
    unbroken, broken = tmp_path / "unbroken", tmp_path / "broken"
    first, victim = _torchrun(unbroken, 3), _torchrun(broken, 3, hold=2)
    deadline = time.monotonic() + 240
    while not (broken / "held-2").exists():
        assert victim.poll() is None, (broken / "log.txt").read_text()[-3000:]
        assert time.monotonic() < deadline, "the worker never saved window 2"
        time.sleep(0.5)
    os.killpg(victim.pid, signal.SIGKILL)  # torchrun and both ranks, mid-run
    victim.wait()
    assert not (broken / "weights.pt").exists()
    _finish(_torchrun(broken, 3), broken)  # restarts from state.pt (window 2) and trains window 2
    _finish(first, unbroken)
    a = torch.load(unbroken / "weights.pt", weights_only=True)
    b = torch.load(broken / "weights.pt", weights_only=True)
    # the sharded AdamW state survives the restart: the same run, bit for bit
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_memory_plan_puts_8b_on_eight_80gb_gpus_only_with_fsdp2() -> None:
    gpu = 80 * GIB
    one_b, eight_b, seventy_b = (RunConfig.preset(p) for p in ("1B", "8B", "70B"))
    assert plan_memory(one_b, 8, "ddp").fits(gpu)
    assert not plan_memory(eight_b, 8, "ddp").fits(gpu)
    assert plan_memory(eight_b, 8, "fsdp2").fits(gpu)
    # 70B: one micro-batch's activations (~44 GiB, no recomputation) and the largest unit's
    # transient tensors leave little room, so the sharded state must be small: many GPUs
    fits_70b = [
        n for n in (8, 16, 32, 64, 128, 256) if plan_memory(seventy_b, n, "fsdp2").fits(gpu)
    ]
    assert fits_70b and fits_70b[0] > 64
    ddp, fsdp = plan_memory(eight_b, 8, "ddp"), plan_memory(eight_b, 8, "fsdp2")
    params = eight_b.param_count()
    assert ddp.state == 20 * params + 4 * params // 8  # everything but EF on every GPU
    assert fsdp.state == 20 * params // 8 + 4 * params // 8  # everything sharded
    assert fsdp.activations == ddp.activations
