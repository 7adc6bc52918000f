"""`tessera bench codec --quick --json`, run as a real process: the machine-independent targets.

Sizes and errors do not depend on the machine, so they are asserted here; throughput is not (it
belongs to the benchmark). Every limit is recomputed here from its definition, not read back
from the bench's own fields.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 4096


def _limit(c: int, k: int) -> float:
    """log2 C(c, k) / k, the information limit of a k-subset of c positions."""
    return math.log2(math.comb(c, k)) / k


@pytest.fixture(scope="module")
def quick() -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "commands.cli", "bench", "codec", "--quick", "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_index_bits_within_one_percent_of_the_limit(quick: dict[str, Any]) -> None:
    sizes = {row["k"]: row for row in quick["index_sizes"]}
    assert sorted(sizes) == [32, 64, 128, 256]
    for k, row in sizes.items():
        limit = _limit(CHUNK, k)
        for kind in ("random", "clustered"):
            assert row[kind] <= 1.01 * limit, (k, kind, row[kind], limit)
        assert row["random"] >= limit  # no coder beats the limit on uniform subsets


def test_whole_update_bits_per_kept_entry(quick: dict[str, Any]) -> None:
    e = quick["entry_cost"]
    assert e["index_bits"] <= 1.01 * _limit(CHUNK, 64)
    assert e["value_bits"] <= 2.0  # 2-bit codes, zstd only when it saves
    assert e["side_and_header_bits"] <= 0.5  # one side byte per 64 entries + codebooks + header
    assert e["bits_per_entry"] == pytest.approx(
        e["index_bits"] + e["value_bits"] + e["side_and_header_bits"]
    )
    assert e["bits_per_entry"] <= 0.5 * e["reference_bits"]


def test_value_error_beats_the_target_and_the_uniform_quantiser(quick: dict[str, Any]) -> None:
    c = quick["compress"]
    assert 0 < c["value_rel_err"] <= 0.08
    assert c["value_rel_err"] < 0.5 * c["uniform_rel_err"]


def test_size_and_error_checks_reported_as_met(quick: dict[str, Any]) -> None:
    checks = quick["checks"]
    machine_free = [k for k in checks if k.startswith(("index_bits", "bits_per_entry", "value"))]
    assert len(machine_free) == 4
    assert all(checks[k] for k in machine_free), checks


def test_cuda_bench_says_plainly_when_there_is_no_gpu() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the refusal path does not apply")
    proc = subprocess.run(
        [sys.executable, "-m", "commands.cli", "bench", "codec", "--device", "cuda"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr
