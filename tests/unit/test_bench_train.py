"""`tessera bench train --quick` (the CI size) through the real command: bench.json keeps its
schema, every method trained, the compressed method sends a small fraction of the dense bytes."""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path
from statistics import fmean

import pytest
import torch

from lab.bench.train.report import heldout_se, summarise
from lab.bench.train.specs import SpecError, parse_methods, split_items
from protocol.runconfig import RunConfig

ROOT = Path(__file__).resolve().parents[2]


def test_quick_bench_writes_the_stable_schema(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "commands.cli", "bench", "train", "--quick", "--threads", "1",
           "--jobs", "1", "--out", str(tmp_path), "--json"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    body = json.loads((tmp_path / "bench.json").read_text())
    assert json.loads(done.stdout) == body
    rows = {r["strategy"]: r for r in body["results"]}
    assert set(rows) == {"ddp", "diloco", "sparseloco"}
    for r in body["results"]:
        assert {
            "strategy",
            "label",
            "dense",
            "final_loss",
            "bytes_per_window",
            "loss_curve",
        } <= set(r)
        assert len(r["loss_curve"]) == body["setup"]["windows"]
        assert r["final_loss"] == r["loss_curve"][-1] < r["initial_loss"]  # every method trained
    assert rows["ddp"]["dense"] and rows["diloco"]["dense"] and not rows["sparseloco"]["dense"]
    dense = body["summary"]["dense_fp32_bytes"]
    assert rows["diloco"]["bytes_per_window"] == pytest.approx(dense, rel=0.01)  # fp32 values
    assert rows["sparseloco"]["bytes_per_window"] < 0.03 * dense
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    assert "× best DDP" in (tmp_path / "bench.md").read_text()
    # the held-out set's own noise: every final loss is the mean of its per-sample losses
    samples = body["setup"]["heldout_samples"]
    for r in body["results"]:
        assert len(r["final_row_losses"]) == samples
        assert statistics.fmean(r["final_row_losses"]) == pytest.approx(r["final_loss"], rel=1e-5)
        assert 0 < r["final_loss_se"] < r["final_loss"]
    assert rows["ddp"]["vs_ddp_se"] == 0.0  # itself, sample by sample
    assert rows["sparseloco"]["vs_ddp_se"] > 0
    assert " ±" in (tmp_path / "bench.md").read_text()


def test_seeds_give_each_method_a_mean_and_a_spread(tmp_path: Path) -> None:
    """``--seeds 2``: each method trains from two run seeds (other initial weights and data)
    scored on one held-out set; its row is their mean, with both losses and their spread."""
    cmd = [sys.executable, "-m", "commands.cli", "bench", "train", "--quick", "--threads", "1",
           "--jobs", "1", "--out", str(tmp_path), "--json", "--seeds", "2", "--seed", "5",
           "--windows", "1", "--heldout", "32", "--strategies", "ddp", "sparseloco"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    body = json.loads(done.stdout)
    assert body["setup"]["seeds"] == [5, 6]
    for r in body["results"]:
        a, b = r["final_loss_by_seed"]
        assert a != b  # the seed changes the training
        assert r["final_loss"] == pytest.approx((a + b) / 2, rel=1e-12)
        assert r["final_loss_spread"] == pytest.approx(abs(a - b), rel=1e-12)
        assert len(set(r["run_id"])) == 2
        # per held-out sample, the mean over the seeds: their mean is the mean final loss
        assert statistics.fmean(r["final_row_losses"]) == pytest.approx(r["final_loss"], rel=1e-5)
    sparse = next(r for r in body["results"] if r["strategy"] == "sparseloco")
    assert isinstance(sparse["vs_ddp_beyond_spread"], bool)
    assert "seed spread" in (tmp_path / "bench.md").read_text()


def test_held_out_noise_of_a_comparison_is_taken_sample_by_sample() -> None:
    """Two methods scored on the same held-out samples: what the samples share (some are
    harder than others) cancels in their difference, so the comparison's standard error is far
    below either loss's own; both shrink as one over the square root of the samples."""
    gen = random.Random(3)
    hardness = [gen.uniform(4.0, 8.0) for _ in range(400)]
    ddp = [h + gen.gauss(0, 0.02) for h in hardness]
    sparse = [h + 0.1 + gen.gauss(0, 0.02) for h in hardness]
    own = heldout_se(sparse)
    paired = heldout_se(sparse, ddp)
    assert own is not None and paired is not None
    assert own == pytest.approx(statistics.stdev(sparse) / 20)  # 400 samples
    assert paired < own / 20
    assert heldout_se(sparse[:100], ddp[:100]) == pytest.approx(2 * paired, rel=0.3)
    assert heldout_se([5.0]) is None
    rows = [
        {"label": n, "strategy": n, "family": n, "dense": n == "ddp", "final_loss": fmean(x),
         "final_row_losses": x, "bytes_per_window": 1.0}
        for n, x in (("ddp", ddp), ("sparseloco", sparse))
    ]  # fmt: skip
    summarise(rows, 4)
    assert rows[1]["vs_ddp_se"] == pytest.approx(paired / fmean(ddp))
    assert rows[0]["vs_ddp_se"] == 0.0


def test_strategy_lists_parse_with_their_options() -> None:
    base = RunConfig.preset("tiny")
    assert split_items("ddp,diloco:outer=sgd,alpha=1,sparseloco:k=128,alpha=1.6") == [
        "ddp", "diloco:outer=sgd,alpha=1", "sparseloco:k=128,alpha=1.6",
    ]  # fmt: skip
    assert split_items(["ddp", "sparseloco:k=32", "beta=0.9"]) == [
        "ddp",
        "sparseloco:k=32,beta=0.9",
    ]
    ddp, dl, sl = parse_methods(
        "ddp,diloco:outer=nesterov,alpha=0.5,dtype=fp32,sparseloco:k=128,beta=0.9,lr=0.002", base
    )
    assert (ddp.dense, dl.dense, sl.dense) == (True, True, False)
    assert dl.run.outer.optimizer == "nesterov" and dl.run.outer.alpha == 0.5
    assert dl.run.dense.dtype == "fp32"
    assert sl.run.codec.k == 128 and sl.run.outer.beta == 0.9 and sl.run.optimizer.lr == 0.002
    assert sl.run.model == base.model and sl.run.inner_steps == base.inner_steps
    assert sl.run.outer.delay == 0
    (late,) = parse_methods("sparseloco:delay=1,label=late", base)
    assert late.run.outer.delay == 1 and late.label == "late"
    for bad in (
        "adamw",
        "ddp:k=3",
        "sparseloco:k=5000",
        "diloco:dtype=fp8",
        "k=3",
        "sparseloco,sparseloco",
        "sparseloco:delay=2",
        "ddp:delay=1",
    ):
        with pytest.raises(SpecError):
            parse_methods(bad, base)


def test_methods_in_worker_processes_train_exactly_as_one_after_another() -> None:
    from lab.bench.train.engine import Setup, heldout_set
    from lab.bench.train.parallel import run_all
    from node.data.batches import open_run_dataset

    base = RunConfig.preset("tiny", name="jobs", inner_steps=1, outer={"total_windows": 2})
    methods = parse_methods("ddp,diloco:alpha=1,sparseloco", base)
    _, dataset = open_run_dataset(base)
    setup = Setup(base, dataset, (0, 1), 2, heldout_set(dataset, base.run_id, 4), base.run_id)
    seen: list[tuple[int, int]] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' count: the same kernels, the same roundings
    try:
        serial = run_all([(m, setup) for m in methods], 1, 1, lambda i, w, loss: None)
    finally:
        torch.set_num_threads(threads)
    parallel = run_all([(m, setup) for m in methods], 2, 1, lambda i, w, loss: seen.append((i, w)))
    assert sorted(seen) == [(i, w) for i in range(3) for w in range(2)]  # every window reported
    for a, b in zip(serial, parallel, strict=True):
        assert (
            a.method.label == b.method.label and a.loss == b.loss and a.bytes_sent == b.bytes_sent
        )


PAPER = ROOT / "lab" / "configs" / "paper-regime.toml"


def test_the_paper_regime_config_is_the_papers_regime_at_the_tiny_size() -> None:
    """H = 15, 3.1 % density, a replica batch 8 × tiny's, about 20 tokens per parameter over the
    27 windows of 8 replicas its header gives."""
    run, tiny = RunConfig.load(PAPER), RunConfig.preset("tiny")
    assert run.inner_steps == 15
    assert run.codec.k / run.codec.chunk_size == pytest.approx(0.03125)
    assert run.batch_size >= 8 * tiny.batch_size and run.seq_len == tiny.seq_len
    assert run.outer.beta == 0.95 and run.outer.alpha == 1.0
    tokens = 8 * 27 * run.inner_steps * run.batch_size * run.seq_len
    assert 18 <= tokens / run.param_count() <= 22
    assert "--replicas 8 --windows 27" in PAPER.read_text()


def test_the_paper_regime_trains_end_to_end_at_reduced_length(tmp_path: Path) -> None:
    """The run config file through `--preset`, its batch and density kept, H and R and the
    windows cut to CI size, on the CPU; both densities train and the lower sends fewer bytes."""
    cmd = [sys.executable, "-m", "commands.cli", "bench", "train", "--preset", str(PAPER),
           "--replicas", "2", "--windows", "1", "--inner-steps", "2", "--heldout", "8",
           "--strategies", "sparseloco:k=128", "sparseloco:k=64", "--device", "cpu",
           "--threads", "1", "--jobs", "1", "--out", str(tmp_path), "--json"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    body = json.loads(done.stdout)
    setup = body["setup"]
    assert (setup["batch_size"], setup["inner_steps"], setup["device"]) == (64, 2, "cpu")
    rows = {r["label"]: r for r in body["results"]}
    for r in rows.values():
        assert r["final_loss"] < r["initial_loss"]
    assert (
        rows["sparseloco k=64"]["bytes_per_window"] < rows["sparseloco k=128"]["bytes_per_window"]
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present here")
def test_a_missing_gpu_is_one_line_before_any_training(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "commands.cli", "bench", "train", "--quick", "--device", "cuda",
           "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode != 0
    assert done.stderr.strip().count("\n") == 0 and "no CUDA device" in done.stderr
    assert not (tmp_path / "bench.json").exists()
