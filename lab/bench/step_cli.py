"""`tessera bench step`: its options checked, its table or JSON."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from lab.bench.output import emit, preset_problem, targets_table

MEMORY_SLACK = 1.10
"""A recipe's measured activations may exceed the plan's by this factor before the plan is wrong."""
STEP_SLACK = 1.15
"""A recipe's step time (against the plain one) may exceed the plan's by this factor."""


def run(args: argparse.Namespace) -> int:
    problem = preset_problem(args)
    if problem is None and args.rows is not None and args.rows < 1:
        problem = f"--rows {args.rows}: train at least one sequence per step, e.g. --rows 32"
    if problem is not None:
        print(f"tessera bench step: {problem}", file=sys.stderr)
        return 2
    from lab.bench.step import step_cost
    from protocol.runconfig import RunConfig

    log = logging.getLogger("tessera.bench.step")
    rows = args.rows or 4 * RunConfig.preset(args.preset).micro_batch_size
    with Console(stderr=True).status(f"training steps of {args.preset}…"):
        result = step_cost(args.preset, args.device, rows, args.repeats, log.info)
    result["checks"] = _checks(result)
    return emit(result, args.json, _print)


def _checks(r: dict[str, Any]) -> dict[str, bool]:
    ran = [row for row in r["recipes"] if "s_per_step" in row]
    checks = {
        f"step time <= {STEP_SLACK:g} x the plan's": all(
            row.get("step_time", 1.0) <= STEP_SLACK * row["planned_step_time"] for row in ran
        )
    }
    if r["device"] == "cuda":
        checks[f"activations <= {MEMORY_SLACK:g} x the plan's"] = all(
            row["measured_activation_bytes"] <= MEMORY_SLACK * row["planned_activation_bytes"]
            for row in ran
        )
    return checks


def _print(r: dict[str, Any]) -> None:
    console = Console()
    t = Table(
        title=f"{r['preset']} ({r['parameters'] / 1e6:,.1f} M parameters) on "
        f"{r['gpu'] or r['device']}: {r['steps']} steps of {r['rows']} × {r['seq_len']} tokens "
        f"(micro-batch {r['micro_batch_size']})"
    )
    for col in ("recipe", "s/step", "× plain (plan)", "tokens/s", "MFU", "activations (plan)"):
        t.add_column(col, justify="right")
    for row in r["recipes"]:
        if "s_per_step" not in row:
            t.add_row(row["recipe"], "out of memory", "", "", "", "")
            continue
        measured = row.get("measured_activation_bytes")
        memory = f"{measured / 2**30:,.1f} GiB" if measured is not None else "–"
        mfu = f"{row['mfu']:.1%}" if "mfu" in row else "–"
        t.add_row(
            row["recipe"],
            f"{row['s_per_step']:.3f}",
            f"{row.get('step_time', float('nan')):.2f}× ({row['planned_step_time']:.2f}×)",
            f"{row['tokens_per_s']:,.0f}",
            mfu,
            f"{memory} ({row['planned_activation_bytes'] / 2**30:,.1f} GiB)",
        )
    console.print(t)
    targets_table(console, r["checks"])
