"""`tessera bench exchange`: its options checked, its table or JSON, its targets."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from lab.bench.output import emit, preset_problem, targets_table

ONE_WORKER_M_PER_S = 25.0
"""Entries per second one worker must decode and aggregate (millions)."""
VS_REFERENCE = 0.3
"""One worker against a plain one-thread `index_add_` of the same entries."""
TWO_WORKERS_SPEEDUP = 1.7


def _workers(text: str | None) -> list[int]:
    if text is None:
        cores = os.cpu_count() or 1
        return [1] if cores == 1 else [1, cores]
    try:
        counts = sorted({int(w) for w in text.split(",")})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        raise ValueError(f"--workers {text}: give positive worker counts, e.g. --workers 1,2")
    return counts


def run(args: argparse.Namespace) -> int:
    try:
        workers = _workers(args.workers)
    except ValueError as exc:
        print(f"tessera bench exchange: {exc}", file=sys.stderr)
        return 2
    if (problem := preset_problem(args)) is not None:
        print(f"tessera bench exchange: {problem}", file=sys.stderr)
        return 2
    from lab.bench.exchange import bench_exchange

    err = Console(stderr=True)
    result = bench_exchange(
        args.preset, args.peers, args.layers, workers, args.repeats, args.device, log=err.log
    )
    result["checks"] = checks(result)
    return emit(result, args.json, _print)


def checks(r: dict[str, Any]) -> dict[str, bool]:
    cpu = [row for row in r["results"] if row["device"] == "cpu"]
    one = max((row["entries_per_s"] for row in cpu if row["workers"] == 1), default=0.0)
    two = max((row["entries_per_s"] for row in cpu if row["workers"] == 2), default=None)
    out = {
        f"one worker >= {ONE_WORKER_M_PER_S:g} M entries/s": one >= ONE_WORKER_M_PER_S * 1e6,
        f"one worker >= {VS_REFERENCE:g} x index_add_": one
        >= VS_REFERENCE * r["reference"]["entries_per_s"],
        "same digest for every worker count and arrival order": r["arrival_orders_equal"],
    }
    if two is not None:
        out[f"two workers >= {TWO_WORKERS_SPEEDUP:g} x one"] = two >= TWO_WORKERS_SPEEDUP * one
    return out


def _print(r: dict[str, Any]) -> None:
    console = Console()
    ref = r["reference"]
    title = (
        f"{r['preset']}: {r['peers']} updates of {r['layers']} layers "
        f"({r['model_share']:.0%} of the model, {r['entries'] / 1e6:.1f} M entries, "
        f"{r['bytes_per_update'] / 1e6:.1f} MB each), best of runs, wall time"
    )
    t = Table(title=title)
    for col in (
        "workers",
        "device",
        "arrival",
        "seconds",
        "M entries/s",
        "vs index_add_",
        "digest",
    ):
        t.add_column(col, justify="right")
    t.add_row(
        "1", "cpu", "reference: index_add_", f"{ref['seconds']:.3f}",
        f"{ref['entries_per_s'] / 1e6:.1f}", "1.00×", "",
    )  # fmt: skip
    for row in r["results"]:
        t.add_row(
            str(row["workers"]), _where(row), row["arrival"], f"{row['seconds']:.3f}",
            f"{row['entries_per_s'] / 1e6:.1f}", f"{row['vs_reference']:.2f}×",
            row["digest"][:12],
        )  # fmt: skip
    console.print(t)
    targets_table(console, r["checks"])


def _where(row: dict) -> str:
    """The row's device, and where a GPU row decoded (the host or the GPU)."""
    on = row.get("decode_on")
    return row["device"] if on is None else f"{row['device']}, decode on {on}"
