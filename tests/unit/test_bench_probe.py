"""`tessera bench probe --json`, run as a real process on the tiny preset: the shapes are the
preset's, the figures are consistent with each other (what they are is the bench's to say, not a
test's), and bad options get one line that says how to fix them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from protocol.runconfig import RunConfig
from tests.support.cli import run_cli

ROOT = Path(__file__).resolve().parents[2]


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "commands.cli", "bench", "probe", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_the_figures_follow_from_the_preset() -> None:
    proc = _bench("--samples", "16", "--repeats", "3", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    run = RunConfig.preset("tiny")
    assert (r["preset"], r["samples"], r["seq_len"]) == ("tiny", 16, run.seq_len)
    assert r["layers"] == run.model.n_layers and r["micro_batch_size"] == run.micro_batch_size
    assert r["forward_s"] > 0 and r["probe_s"] > 0
    assert r["probe_vs_forward"] == pytest.approx(r["probe_s"] / r["forward_s"])
    assert set(r["checks"]) == {"probe <= 6 forward passes"}
    assert r["tokens_per_s"] * r["probe_s"] == pytest.approx(4 * 16 * run.seq_len)


def test_bad_options_get_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for args, words in (
        (("--preset", "9T"), "unknown"),
        (("--samples", "1"), "at least two"),
        (("--layers", "99"), "layers"),
    ):
        assert run_cli(["bench", "probe", *args]) == 2  # an exception would fail the test
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("tessera bench probe:") and words in lines[0]
