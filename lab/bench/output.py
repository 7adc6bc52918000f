"""What the benches share: their result printed the way it was asked for (JSON or tables), their
targets, and the checks of their common options."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table


def emit(result: dict[str, Any], as_json: bool, tables: Callable[[dict[str, Any]], None]) -> int:
    """Print ``result`` as indented JSON or through ``tables``; the command's exit status (0)."""
    if as_json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        tables(result)
    return 0


def targets_table(console: Console, checks: dict[str, bool]) -> None:
    """The bench's targets, each met or not."""
    t = Table(title="Targets")
    t.add_column("check")
    t.add_column("met")
    for name, ok in checks.items():
        t.add_row(name, "[green]yes[/]" if ok else "[red]no[/]")
    console.print(t)


def preset_problem(args: Any) -> str | None:
    """What is wrong with a bench's `--preset`, `--repeats`, `--layers` and `--device` (one line
    that says how to fix it), or None."""
    from protocol.presets import PRESETS

    if args.preset not in PRESETS:
        return f"--preset {args.preset}: unknown; choose one of {', '.join(PRESETS)}"
    if args.repeats < 1:
        return f"--repeats {args.repeats}: time at least one run, e.g. --repeats 5"
    n_layers = PRESETS[args.preset]["model"]["n_layers"]
    if not 0 <= args.layers <= n_layers:
        return f"--layers {args.layers}: {args.preset} has {n_layers} layers (0: all of them)"
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "--device cuda: no CUDA device is available here; leave --device out"
    return None
