"""`tessera bench exchange --json`, run as a real process on the tiny preset: the counts follow
from the preset's shapes and codec (recomputed here), every row has the same digest, and bad
options get one line that says how to fix them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from codec.chunking import ChunkLayout
from node.model.shapes import model_spec
from protocol.runconfig import RunConfig
from tests.support.cli import run_cli

ROOT = Path(__file__).resolve().parents[2]


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "commands.cli", "bench", "exchange", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    proc = _bench("--peers", "3", "--layers", "1", "--workers", "1,2", "--repeats", "1", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_counts_follow_from_the_preset(result: dict[str, Any]) -> None:
    run = RunConfig.preset("tiny")
    sent = [t for t in model_spec(run.model).tensors if ".layers.0." in t.name]
    per_update = sum(ChunkLayout.for_shape(t.shape, run.codec).n_values for t in sent)
    assert result["entries"] == 3 * per_update
    assert result["dense_elements"] == sum(t.numel for t in sent)
    assert (result["preset"], result["peers"], result["layers"]) == ("tiny", 3, 1)


def test_every_row_reaches_the_same_mean(result: dict[str, Any]) -> None:
    rows = result["results"]
    assert {(r["workers"], r["arrival"]) for r in rows} == {
        (w, a) for w in (1, 2) for a in ("uid order", "shuffled")
    }
    assert len({r["digest"] for r in rows}) == 1 and result["arrival_orders_equal"] is True
    assert result["checks"]["same digest for every worker count and arrival order"] is True
    for r in rows:
        assert r["entries_per_s"] == pytest.approx(result["entries"] / r["seconds"])
    assert result["reference"]["seconds"] > 0


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--workers", "0"], "--workers 0: give positive worker counts"),
        (["--layers", "9"], "--layers 9: tiny has 4 layers"),
        (["--peers", "0"], "argument --peers: '0': give 1 or more"),
        (["--preset", "huge"], "--preset huge: unknown; choose one of"),
    ],
)
def test_bad_options_get_one_line(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli(["bench", "exchange", *args]) == 2  # an exception would fail the test
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1
