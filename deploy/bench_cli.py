"""`tessera bench …`: benchmarks printed as tables (rich) or as JSON, reference beside each figure."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

TARGETS = {"decode_M_per_s": 20.0, "encode_M_per_s": 10.0, "total_ratio": 4.0, "value_err": 0.08}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from deploy.bench_train import cli as train

    parser.add_argument(
        "what",
        choices=["codec", "train"],
        help="codec: index coder, values, compression speed; train: strategies' held-out loss",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument(
        "--quick", action="store_true", help="smaller sizes (seconds, for smoke tests)"
    )
    parser.add_argument(
        "--numel", type=int, default=None, help="elements of the compression tensor (default 1e8)"
    )
    train.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.what == "train":
        from deploy.bench_train import cli as train

        return train.run(args)
    from codec import bench

    quick = args.quick
    console = Console(stderr=True)
    with console.status("index sizes…"):
        sizes = bench.index_sizes(n_chunks=1024 if quick else 4096)
    with console.status("index speed…"):
        speed = bench.index_speed(n_chunks=2048 if quick else 16384, repeats=1 if quick else 5)
    with console.status("bits per kept entry…"):
        entry = bench.entry_cost()
    numel = args.numel or (2_000_000 if quick else 100_000_000)
    with console.status(f"compressing a {numel:.0e}-element tensor…"):
        comp = bench.compress_time(numel, repeats=1 if quick else 5)
    result = {"index_sizes": sizes, "index_speed": speed, "entry_cost": entry, "compress": comp}
    result["checks"] = _checks(result)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print(result)
    return 0


def _checks(r: dict[str, Any]) -> dict[str, bool]:
    sizes, speed, comp = r["index_sizes"], r["index_speed"], r["compress"]
    return {
        "index_bits_random<=1.01*limit": all(s["random"] <= s["target"] for s in sizes),
        "index_bits_clustered<=1.01*limit": all(s["clustered"] <= s["target"] for s in sizes),
        "decode>=20M/s": all(s["decode_M_per_s"] >= TARGETS["decode_M_per_s"] for s in speed),
        "encode>=10M/s": all(s["encode_M_per_s"] >= TARGETS["encode_M_per_s"] for s in speed),
        "value_err<=0.08": comp["value_rel_err"] <= TARGETS["value_err"],
        "compress<=4x_abs_sum": comp["total_ratio"] <= TARGETS["total_ratio"],
    }


def _print(r: dict[str, Any]) -> None:
    console = Console()
    t = Table(title="Index coder: bits per index (all bytes counted), C = 4096")
    for col in ("k", "random", "clustered", "limit", "1.01×limit", "paper", "12-bit"):
        t.add_column(col, justify="right")
    for s in r["index_sizes"]:
        t.add_row(
            str(s["k"]),
            f"{s['random']:.4f}",
            f"{s['clustered']:.4f}",
            f"{s['limit']:.4f}",
            f"{s['target']:.4f}",
            f"{s['paper']:.1f}",
            "12",
        )
    console.print(t)
    t = Table(title="Index coder throughput (one thread, CPU time)")
    for col in ("k", "encode M idx/s", "decode M idx/s", "target enc/dec"):
        t.add_column(col, justify="right")
    for s in r["index_speed"]:
        t.add_row(
            str(s["k"]), f"{s['encode_M_per_s']:.1f}", f"{s['decode_M_per_s']:.1f}", "10 / 20"
        )
    console.print(t)
    e, c = r["entry_cost"], r["compress"]
    t = Table(title=f"Whole update, k = {e['k']} of 4096")
    for col in ("bits/entry", "index", "value", "side+header", "reference"):
        t.add_column(col, justify="right")
    t.add_row(
        f"{e['bits_per_entry']:.3f}",
        f"{e['index_bits']:.3f}",
        f"{e['value_bits']:.3f}",
        f"{e['side_and_header_bits']:.3f}",
        f"{e['reference_bits']:.0f}",
    )
    console.print(t)
    t = Table(title=f"Compressing {c['numel']:.0e} elements ({c['threads']:.0f} threads)")
    for col in ("abs().sum()", "EF+TopK+Q", "encode", "total", "ratio", "value err", "uniform err"):
        t.add_column(col, justify="right")
    t.add_row(
        f"{c['abs_sum_s'] * 1e3:.0f} ms",
        f"{c['compress_s'] * 1e3:.0f} ms",
        f"{c['encode_s'] * 1e3:.0f} ms",
        f"{c['total_s'] * 1e3:.0f} ms",
        f"{c['total_ratio']:.2f}× (≤ 4)",
        f"{c['value_rel_err']:.4f} (≤ 0.08)",
        f"{c['uniform_rel_err']:.4f}",
    )
    console.print(t)
    t = Table(title="Targets")
    t.add_column("check")
    t.add_column("met")
    for name, ok in r["checks"].items():
        t.add_row(name, "[green]yes[/]" if ok else "[red]no[/]")
    console.print(t)
