"""`tessera bench probe`: its options checked, its table or JSON."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from lab.bench.output import emit, preset_problem, targets_table

MAX_PROBE_VS_FORWARD = 6.0
"""A probe runs four forward passes and two steps: more than six forward passes' time means the
steps or restores cost more than the forward passes they serve."""


def _problem(args: argparse.Namespace) -> str | None:
    if args.samples < 2:
        return f"--samples {args.samples}: probe at least two samples, e.g. --samples 64"
    return preset_problem(args)


def run(args: argparse.Namespace) -> int:
    if (problem := _problem(args)) is not None:
        print(f"tessera bench probe: {problem}", file=sys.stderr)
        return 2
    from lab.bench.probe import probe_cost

    with Console(stderr=True).status(f"probing one update of {args.preset}…"):
        result = probe_cost(args.preset, args.samples, args.layers, args.device, args.repeats)
    result["checks"] = {
        f"probe <= {MAX_PROBE_VS_FORWARD:g} forward passes": result["probe_vs_forward"]
        <= MAX_PROBE_VS_FORWARD
    }
    return emit(result, args.json, _print)


def _print(r: dict[str, Any]) -> None:
    console = Console()
    t = Table(
        title=f"{r['preset']} ({r['layers']} layers, {r['parameters'] / 1e6:,.1f} M parameters) "
        f"on {r['device']} ({r['precision']}): {r['samples']} samples of {r['seq_len']} tokens, "
        "best of runs"
    )
    for col in ("what", "seconds", "× forward", "tokens/s"):
        t.add_column(col, justify="right")
    tokens = r["samples"] * r["seq_len"]
    t.add_row("reference: one forward pass", f"{r['forward_s']:.3f}", "1.00×",
              f"{tokens / r['forward_s']:,.0f}")  # fmt: skip
    t.add_row("one probe", f"{r['probe_s']:.3f}", f"{r['probe_vs_forward']:.2f}×",
              f"{r['tokens_per_s']:,.0f}")  # fmt: skip
    if "forward_fp32_s" in r:
        t.add_row("reference: one forward pass in fp32", f"{r['forward_fp32_s']:.3f}",
                  f"{r['forward_fp32_s'] / r['forward_s']:.2f}×",
                  f"{tokens / r['forward_fp32_s']:,.0f}")  # fmt: skip
    console.print(t)
    if "loss_gap" in r:
        console.print(
            f"bf16 against fp32: largest per-sample loss gap {r['loss_gap']:.2e}; the update's "
            f"mean gain on its own samples {r['gain_bf16']:.3e} (bf16) / {r['gain_fp32']:.3e} (fp32)"
        )
    targets_table(console, r["checks"])
