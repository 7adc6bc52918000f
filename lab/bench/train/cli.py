"""`tessera bench train`: compare training strategies on the run's own model and data.

    tessera bench train --preset tiny --replicas 4 --windows 40 \\
        --strategies ddp,diloco:outer=sgd,alpha=1,dtype=fp32,sparseloco:k=128,alpha=1.6

Writes ``bench.json``, ``bench.png`` and ``bench.md`` (the table) into ``--out`` and prints the
table; ``--json`` prints ``bench.json`` instead. ``--quick`` is the CI size (2 replicas, 3
windows of 2 inner steps, 3 methods; well under a minute). The run's schedule ends with the bench:
``outer.total_windows`` is set to ``--windows``. ``--seeds N`` trains every method from ``N`` run
seeds (initial weights and data assignment: ``--seed``, ``--seed`` + 1, …) on one held-out set;
each method's row is the mean over the seeds with the spread between them
(`lab.bench.train.report.combine_seeds`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from commands.arg_types import positive_int
from commands.node_args import load_run
from lab.bench.train.specs import DEFAULT_STRATEGIES, QUICK_STRATEGIES, SpecError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("train (tessera bench train)")
    g.add_argument(
        "--preset",
        default="tiny",
        help="run preset or run config file whose model, data and settings are used",
    )
    g.add_argument("--replicas", type=positive_int, default=None, help="R (default 4; --quick: 2)")
    g.add_argument(
        "--windows", type=positive_int, default=None, help="outer steps (default 40; --quick: 3)"
    )
    g.add_argument(
        "--inner-steps",
        type=positive_int,
        default=None,
        help="H (default: the preset's; --quick: 2)",
    )
    g.add_argument(
        "--strategies",
        nargs="+",
        default=None,
        help=f"methods to compare, NAME[:KEY=VALUE,...] (default: {DEFAULT_STRATEGIES})",
    )
    g.add_argument(
        "--tune",
        action="store_true",
        help="every baseline over a grid (DDP: three learning rates; dense local SGD: three "
        "outer learning rates; DiLoCo: two outer learning rates x two momenta) beside the "
        "methods of --strategies (default: sparseloco), ratios against each family's best",
    )
    g.add_argument(
        "--heldout", type=positive_int, default=None, help="held-out samples scored (128)"
    )
    g.add_argument("--seed", type=int, default=None, help="the first run seed (the preset's)")
    g.add_argument(
        "--seeds", type=positive_int, default=1, help="run seeds per method: mean and spread"
    )
    g.add_argument("--out", type=Path, default=Path("runs/bench-train"), help="output folder")
    g.add_argument(
        "--jobs",
        type=positive_int,
        default=None,
        help="methods trained at a time, in worker processes (default: one per CPU core)",
    )
    g.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch CPU threads per job (default: 1 with several jobs, else torch's; 1 is far "
        "faster on a box busy with other work)",
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from lab.bench.train import report
    from lab.bench.train.engine import Setup, heldout_set
    from lab.bench.train.parallel import run_all
    from lab.bench.train.specs import MethodSpec, parse_methods, tuned_strategies
    from node.data.batches import open_run_dataset
    from node.model.llama import build_model

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available here; train on --device cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    quick = args.quick
    replicas = args.replicas or (2 if quick else 4)
    windows = args.windows or (3 if quick else 40)
    overrides: dict = {"outer": {"total_windows": windows}}
    if args.inner_steps or quick:
        overrides["inner_steps"] = args.inner_steps or 2
    if args.seeds < 1:
        raise SystemExit(f"--seeds {args.seeds}: train from at least one seed")
    first = load_run(args.preset, "--preset").with_overrides(**overrides)
    start = first.seed if args.seed is None else args.seed
    bases = [first.with_overrides(seed=start + i) for i in range(args.seeds)]
    base = bases[0]
    try:
        methods_by_seed = [
            parse_methods(
                tuned_strategies(b, args.strategies or "sparseloco")
                if args.tune
                else args.strategies or (QUICK_STRATEGIES if quick else DEFAULT_STRATEGIES),
                b,
            )
            for b in bases
        ]
    except SpecError as exc:
        raise SystemExit(f"--strategies: {exc}") from None
    _, dataset = open_run_dataset(base)
    heldout = heldout_set(dataset, base.run_id, args.heldout or (16 if quick else 128))
    console = Console(stderr=True)
    jobs = args.jobs or min(len(methods_by_seed[0]) * args.seeds, os.cpu_count() or 1)
    threads = args.threads or (1 if jobs > 1 else 0)
    tasks: list[tuple[MethodSpec, Setup]] = []
    names: list[str] = []
    for b, methods in zip(bases, methods_by_seed, strict=True):
        setup = Setup(
            b,
            dataset,
            tuple(range(replicas)),
            windows,
            heldout,
            b.run_id,
            torch.device(args.device),
        )
        tasks += [(m, setup) for m in methods]
        names += [m.label + (f" (seed {b.seed})" if args.seeds > 1 else "") for m in methods]
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[loss]}"), TimeElapsedColumn(), TimeRemainingColumn(),
        console=console,
    ) as progress:  # fmt: skip
        bars = [progress.add_task(n, total=windows, loss="") for n in names]

        def show(i: int, w: int, loss: float) -> None:
            progress.update(bars[i], completed=w + 1, loss=f"loss {loss:.4f}")
            if not console.is_terminal:  # a log file gets one line per window, with an ETA
                left = progress.tasks[bars[i]].time_remaining
                eta = f", about {left:.0f} s left" if left is not None else ""
                console.print(f"{names[i]}: window {w + 1}/{windows} held-out loss {loss:.4f}{eta}")

        curves = run_all(tasks, jobs, threads, show)
    per_seed = len(methods_by_seed[0])
    curves_by_seed = [curves[i : i + per_seed] for i in range(0, len(curves), per_seed)]
    tokens = replicas * base.inner_steps * base.batch_size * base.seq_len
    by_seed = [[report.result_row(c, tokens) for c in curves] for curves in curves_by_seed]
    rows = report.combine_seeds(by_seed, [b.seed for b in bases])
    numel = sum(p.numel() for p in build_model(base.model, base.seed).parameters())
    summary = report.summarise(rows, 4 * numel)
    body = {
        "results": rows,
        "summary": summary,
        "setup": {
            "preset": args.preset, "replicas": replicas, "windows": windows,
            "inner_steps": base.inner_steps, "batch_size": base.batch_size,
            "seq_len": base.seq_len, "params": numel, "heldout_samples": int(heldout.shape[0]),
            "data_run_id": base.run_id, "seeds": [b.seed for b in bases], "device": args.device,
        },
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(body, indent=2))
    (args.out / "bench.md").write_text(report.markdown(rows, summary))
    title = f"{args.preset}: R = {replicas}, H = {base.inner_steps}, {windows} windows"
    report.plot(rows, args.out / "bench.png", title)
    if args.json:
        json.dump(body, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print(rows, summary, args.out)
    return 0


def _print(rows: list[dict], summary: dict, out: Path) -> None:
    from lab.bench.train.report import COLUMNS, HELDOUT_NOTE, WITHIN_SPREAD, table_rows

    console = Console()
    t = Table(title="tessera bench train: held-out loss of the synchronised model")
    for i, col in enumerate(COLUMNS):
        t.add_column(col, justify="left" if i == 0 else "right")
    for cells in table_rows(rows):
        t.add_row(*cells)
    console.print(t)
    console.print(f"best DDP: {summary['best_ddp'] or '–'}")
    console.print(f"best dense local method: {summary['best_dense'] or '–'}")
    tuned = {f: b for f, b in summary["best_of_family"].items() if f != b}
    if tuned:
        console.print(
            "best of each tuned family: " + "; ".join(f"{f}: {b}" for f, b in tuned.items())
        )
    console.print(WITHIN_SPREAD)
    console.print(HELDOUT_NOTE)
    for name, ok in summary["checks"].items():
        console.print(f"  {name}: " + ("[green]met[/]" if ok else "[red]missed[/]"))
    console.print(f"written: {out / 'bench.json'}, {out / 'bench.png'}, {out / 'bench.md'}")
