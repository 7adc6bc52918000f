"""`tessera plan`: the GPU memory per GPU a peer needs under DDP and FSDP2, for every preset or one
run, from the code's own accounting (`node.runtime.memory`)."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from node.runtime.memory import GIB, plan_memory
from protocol.runconfig import PRESETS, RunConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", action="append", help="preset or run config (default: all)")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs of one peer")
    parser.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU")
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from node.runtime.node_args import load_run

    runs = [load_run(r) for r in args.run] if args.run else [RunConfig.preset(p) for p in PRESETS]
    rows = []
    for cfg in runs:
        for strategy in ("ddp", "fsdp2"):
            plan = plan_memory(cfg, args.gpus, strategy)
            rows.append({
                "run": cfg.name, "params": cfg.param_count(), "strategy": strategy,
                "gpus": args.gpus, "state_gib": plan.state / GIB,
                "transient_gib": plan.transient / GIB, "activations_gib": plan.activations / GIB,
                "total_gib": plan.total / GIB, "fits": plan.fits(int(args.gpu_memory * GIB)),
            })  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title=f"memory per GPU, {args.gpus} GPUs of {args.gpu_memory:g} GiB per peer")
    for col in ("run", "params", "strategy", "state", "transient", "activations*", "total", "fits"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["run"], f"{r['params'] / 1e9:.2f} B", r["strategy"], f"{r['state_gib']:.1f} GiB",
            f"{r['transient_gib']:.1f} GiB", f"{r['activations_gib']:.1f} GiB",
            f"{r['total_gib']:.1f} GiB", "yes" if r["fits"] else "no",
        )  # fmt: skip
    console = Console()
    console.print(table)
    console.print("* activations: an estimate for one micro-batch (node/runtime/memory.py)")
    return 0
