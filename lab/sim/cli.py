"""`tessera sim`: chain, storage, N honest peers, adversaries and a validator on one machine.

The whole run, top to bottom: build the world (run config, embedded chain, wallets, buckets),
start one process per member and supervise them (injecting the ``--faults``, `lab.sim.faults`)
while a DDP baseline trains on the same tokens in the background, replay the validator's
published history to score its synchronised model on held-out data, then write
`report.json` and `report.html` and print a summary. Exits non-zero when an honest model
becomes non-finite, when honest peers (or the validator) end up with different models, or when
the validator or an honest peer fails.
"""

from __future__ import annotations

import argparse
import shutil
import time
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, get_args

from rich.console import Console
from rich.table import Table

from commands.arg_types import port, positive_float, positive_int
from lab.sim.collect import SimReport, WindowRow
from lab.sim.layout import ADVERSARY_KINDS, World
from protocol.runconfig import RunConfig

if TYPE_CHECKING:
    from lab.sim.baseline import BaselineInBackground


def storage(text: str) -> str:
    """``file``, or an ``s3://PREFIX?endpoint=URL`` whose buckets are PREFIX-<member>."""
    if text != "file" and not text.startswith("s3://"):
        raise argparse.ArgumentTypeError(f"{text!r}: use file, or s3://PREFIX?endpoint=URL")
    return text


def block_time(text: str) -> float:
    """Seconds per block of the simulation's chain: above 0, at most an hour."""
    value = positive_float(text)
    if value > 3600:
        raise argparse.ArgumentTypeError(f"{text!r}: give at most 3600 seconds")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peers", type=positive_int, default=4, help="honest peers")
    parser.add_argument("--windows", type=positive_int, default=10)
    parser.add_argument(
        "--validators",
        type=positive_int,
        default=1,
        help="validators (the first leads; a second decides when the lead does not)",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/demo"))
    parser.add_argument(
        "--storage",
        type=storage,
        default="file",
        help="file (embedded, default) or s3://PREFIX?endpoint=URL",
    )
    parser.add_argument(
        "--adversaries", default="", help=f"comma-separated kinds: {','.join(ADVERSARY_KINDS)}"
    )
    parser.add_argument(
        "--faults",
        default="",
        help="comma-separated ordinary faults to inject: store-errors,lead-restart,lead-down,"
        "peer-restart,chain-stall,load (lab/sim/faults.py)",
    )
    parser.add_argument(
        "--strategy",
        default="sparseloco",
        choices=get_args(RunConfig.model_fields["strategy"].annotation),
        help="the run's strategy (`node.strategy`)",
    )
    parser.add_argument(
        "--block-time", type=block_time, default=1.0, help="seconds per block, at most 3600"
    )
    parser.add_argument(
        "--blocks-per-window",
        type=positive_int,
        default=None,
        help="blocks per window (default 30; with --faults load, longer by the share of the "
        "machine its busy loops take: 60 on two cores)",
    )
    parser.add_argument(
        "--timeout", type=positive_float, default=1800.0, help="seconds before giving up"
    )
    parser.add_argument("--force", action="store_true", help="replace an existing --out folder")
    parser.add_argument("--no-baseline", action="store_true", help="skip the DDP baseline")
    parser.add_argument(
        "--delay",
        type=int,
        choices=(0, 1),
        default=0,
        help="outer.delay: 1 applies each aggregate one window late (docs/training.md)",
    )
    parser.add_argument(
        "--min-support",
        type=positive_int,
        default=1,
        help="outer.min_support: a coordinate moves only where this many applied updates sent "
        "it (2 stops a lone backdoor, docs/consensus.md)",
    )
    parser.add_argument(
        "--start-block",
        type=positive_int,
        default=None,
        help="window 0's first block (default: once every process can have started); runs with "
        "the same settings and start block share the run id and hotkeys, so a run with "
        "adversaries and a clean one train their honest peers on the same samples",
    )
    parser.add_argument(
        "--metrics-port",
        type=port,
        default=0,
        help="every honest peer and validator serves Prometheus metrics on 127.0.0.1 from this "
        "port on, and the run folder gets prometheus.yml to scrape them (0: off)",
    )


def run(args: argparse.Namespace) -> int:
    from lab.sim.baseline import BaselineInBackground
    from lab.sim.buckets import SimKeyError
    from lab.sim.faults import default_blocks_per_window, parse_faults
    from lab.sim.flaky_s3 import flaky_storage
    from lab.sim.layout import build_world, first_block
    from lab.sim.scrape import check_ports, metrics_ports, write_scrape_config

    console = Console()
    args.out = args.out.resolve()  # bucket and chain URLs need absolute paths
    kinds = [k for k in args.adversaries.split(",") if k] if args.adversaries else []
    unknown = set(kinds) - set(ADVERSARY_KINDS)
    if unknown:
        raise SystemExit(f"unknown adversaries: {', '.join(sorted(unknown))}")
    args.faults = parse_faults(args.faults, args.windows)
    if args.blocks_per_window is None:
        args.blocks_per_window = default_blocks_per_window(args.faults)
    if kinds and args.strategy != "sparseloco":  # the forgers write SparseLoCo updates
        raise SystemExit("--adversaries need --strategy sparseloco")
    try:
        first_block(args.peers + len(kinds) + args.validators, args.block_time, args.start_block)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if args.metrics_port:
        check_ports(args.metrics_port, args.peers + args.validators)
    if args.out.exists() and any(args.out.iterdir()):
        if not args.force:
            raise SystemExit(f"{args.out} is not empty: pass --force to replace it")
        shutil.rmtree(args.out)
    with ExitStack() as stack:
        proxy = None
        if "store-errors" in args.faults:
            args.storage, proxy = stack.enter_context(flaky_storage(args.storage))
        try:
            world = build_world(
                args.out,
                args.windows,
                args.block_time,
                args.blocks_per_window,
                args.peers,
                kinds,
                args.storage,
                args.strategy,
                args.delay,
                args.validators,
                args.min_support,
                args.start_block,
            )
        except SimKeyError as exc:
            raise SystemExit(f"error: {exc}") from None
        run_cfg = world.run
        console.print(
            f"run {run_cfg.run_id} ({run_cfg.strategy}): {args.peers} peers, "
            f"adversaries {kinds or 'none'}, faults {args.faults or 'none'}, "
            f"{args.windows} windows of {args.blocks_per_window * args.block_time:.0f}s → {args.out}"
        )
        if args.metrics_port:
            world.metrics_ports = metrics_ports(world, args.metrics_port)
            config = write_scrape_config(world, world.metrics_ports)
            ports = sorted(world.metrics_ports.values())
            console.print(
                f"metrics on 127.0.0.1:{ports[0]}-{ports[-1]}; scrape them with "
                f"prometheus --config.file {config}"
            )
        baseline = None
        if not args.no_baseline:
            baseline = BaselineInBackground(world, args.windows)
            stack.callback(baseline.close)
        exit_codes = _run_processes(world, args, console)
        if proxy is not None:
            injected = ", ".join(f"{kind} ×{n}" for kind, n in sorted(proxy.faults.items()))
            console.print(f"store faults injected: {injected or 'none'}")
        return _report(world, exit_codes, baseline, console, faulty=bool(args.faults))


def _run_processes(
    world: World, args: argparse.Namespace, console: Console
) -> dict[str, int | None]:
    from lab.sim.faults import Injector
    from lab.sim.opening import Opening
    from lab.sim.processes import start, supervise
    from lab.sim.progress import WindowLines

    def say(line: str) -> None:
        console.print(line, soft_wrap=True, markup=False, highlight=False)

    # the validator needs one more window: it scores window w while the peers train w + 1
    running = [start(world, m, args.windows + (m.kind == "validator")) for m in world.members]
    opening = Opening(world)
    faults = Injector(world, args.faults, args.windows + 1)
    lines = WindowLines(world, args.windows + 1, say)
    started = time.monotonic()
    with console.status("simulating…") as status:

        def tick() -> None:
            opened = opening.tick()
            if opened:
                say(opened)
            faults.tick(running)
            lines.tick()
            status.update(f"simulating… {time.monotonic() - started:.0f} s")

        try:
            return supervise(running, args.timeout, tick)
        finally:
            faults.stop()
            opening.close()
            lines.tick()  # the windows finished since the last tick


def _report(
    world: World,
    exit_codes: dict[str, int | None],
    ddp: BaselineInBackground | None,
    console: Console,
    faulty: bool,
) -> int:
    from codec.chunking import ChunkLayout
    from lab.sim.baseline import synced_losses
    from lab.sim.collect import collect
    from lab.sim.html import render
    from node.model.llama import build_model

    run_cfg = world.run
    model = build_model(run_cfg.model, run_cfg.seed)
    dense = 4 * sum(p.numel() for p in model.parameters())
    kept = sum(
        ChunkLayout.for_shape(tuple(p.shape), run_cfg.codec).n_values for p in model.parameters()
    )
    windows = _windows_done(world)
    baseline = {} if ddp is None else ddp.losses(windows)
    report = collect(world, exit_codes, dense, kept, baseline, synced_losses(world, windows))
    (world.out / "report.json").write_text(report.model_dump_json(indent=2))
    summary = _summary(report)
    (world.out / "report.html").write_text(render(report, summary))
    table = Table(title="Simulation summary")
    table.add_column("what")
    table.add_column("value", justify="right")
    for k, v in summary:
        table.add_row(k, v)
    console.print(table)
    console.print(f"report: {world.out / 'report.html'}")
    for hint in (
        report.unscored_hint(run_cfg.timing.blocks_per_window),
        report.spread_hint(run_cfg.timing.blocks_per_window) if faulty else None,
    ):
        if hint:
            console.print(f"[yellow]{hint}[/]")
    failure = verdict(world, report, exit_codes)
    if failure:
        console.print(f"[red]{failure}[/]")
        return 1
    return 0


def verdict(world: World, report: SimReport, exit_codes: dict[str, int | None]) -> str | None:
    """Why the simulation failed, or None: a validator or an honest peer failed, an honest model
    became non-finite, or honest models (or the validators') differ."""
    for validator in (m.name for m in world.of_kind("validator")):
        if exit_codes.get(validator) != 0:
            code = exit_codes.get(validator)
            return f"validator {validator} failed (exit {code}): see {world.out}/logs"
    if report.non_finite:
        return f"honest models became non-finite in windows {report.non_finite}"
    if report.diverged:
        return f"honest peers diverged in windows {report.diverged}"
    failed = [m.name for m in world.of_kind("honest") if exit_codes.get(m.name) != 0]
    if failed:
        return f"honest peers failed: {failed}: see {world.out}/logs"
    return None


def _windows_done(world: World) -> list[int]:
    from node.runtime.report_log import REPORTS, read_json_lines

    return [r["window"] for r in read_json_lines(world.of_kind("honest")[0].state_dir / REPORTS)]


def _loss(x: float | None) -> str:
    return f"{x:.4f}" if x is not None else "–"


def _trigger(first: WindowRow | None, last: WindowRow | None) -> str:
    """How far the validator's model learnt a backdoor's trigger (`lab.sim.backdoor`)."""
    if first is None or last is None or last.trigger_probability is None:
        return ""
    return f"{first.trigger_probability:.4f} → {last.trigger_probability:.4f}"


def _summary(r: SimReport) -> list[tuple[str, str]]:
    weights, rules = r.final_weights, r.final_rules()
    honest = sum(w for n, w in weights.items() if n.startswith("peer"))
    total = sum(weights.values()) or 1.0
    trained = [w for w in r.windows if any(p.kind == "honest" and p.loss for p in w.peers)]
    last = trained[-1] if trained else None
    losses = [p.loss for p in (last.peers if last else []) if p.kind == "honest" and p.loss]
    ups = [
        p.upload_bytes
        for row in r.windows
        for p in row.peers
        if p.kind == "honest" and p.upload_bytes
    ]
    backdoor = any(p.kind == "backdoor" for row in r.windows for p in row.peers)
    trigger = _trigger(r.windows[0] if r.windows else None, last) if backdoor else ""
    rows = [
        ("windows trained", str(len(trained))),
        ("honest weight share", f"{honest / total:.1%}"),
        (
            "adversary weights (rule)",
            ", ".join(
                f"{n}={w:.3f} ({rules.get(n, '–')})"
                for n, w in weights.items()
                if not n.startswith("peer")
            )
            or "–",
        ),
        (
            "honest weight spread, window 3 on",
            f"±{spread:.1%}" if (spread := r.honest_spread()) is not None else "–",
        ),
        ("final honest inner loss (mean)", f"{sum(losses) / len(losses):.4f}" if losses else "–"),
        ("final held-out loss, validator's model", _loss(last.synced_loss if last else None)),
        ("final held-out loss, DDP (same tokens)", _loss(last.ddp_loss if last else None)),
        (
            "validator's model / DDP",
            f"{last.synced_loss / last.ddp_loss:.3f}"
            if last and last.synced_loss and last.ddp_loss
            else "–",
        ),
        *([("backdoor target after its trigger, first → last window", trigger)] if trigger else []),
        ("bytes per update (mean)", f"{sum(ups) / len(ups):,.0f}" if ups else "–"),
        ("dense fp32 update", f"{r.dense_bytes:,}"),
        ("bits per kept entry", f"{8 * sum(ups) / len(ups) / r.kept_entries:.2f}" if ups else "–"),
        (
            "honest models identical (and the validators')",
            "yes" if not r.diverged else f"no: windows {r.diverged}",
        ),
        ("honest models finite", "yes" if not r.non_finite else f"no: windows {r.non_finite}"),
    ]
    return rows
