"""`tessera bench step --json`, run as a real process on the tiny preset: one row per training
recipe, trained with the miner's loop, whose figures are consistent with each other and with the
memory plan (what they are is the bench's to say, not a test's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from node.runtime.memory import RECIPES, STEP_TIME, activation_bytes
from protocol.runconfig import RunConfig

ROOT = Path(__file__).resolve().parents[2]


def test_every_recipe_trains_and_its_figures_add_up() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "commands.cli", "bench", "step", "--rows", "16", "--repeats", "2",
         "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    run = RunConfig.preset("tiny")
    assert (r["preset"], r["rows"], r["steps"], r["seq_len"]) == ("tiny", 16, 2, run.seq_len)
    assert r["gpu"] is None and r["peak_flops"] is None  # no MFU without a GPU's peak rate
    assert len(r["recipes"]) == len(RECIPES)
    for row, recipe, planned in zip(r["recipes"], RECIPES, STEP_TIME, strict=True):
        assert row["checkpoint_layers"] == recipe.checkpoint_layers
        assert row["loss_chunk_tokens"] == recipe.loss_chunk_tokens
        assert row["planned_activation_bytes"] == activation_bytes(run, recipe)
        assert row["planned_step_time"] == planned
        assert row["tokens_per_s"] * row["s_per_step"] == pytest.approx(16 * run.seq_len)
        assert "measured_activation_bytes" not in row and "mfu" not in row
    assert r["recipes"][0]["step_time"] == pytest.approx(1.0)
    assert set(r["checks"]) == {"step time <= 1.15 x the plan's"}
