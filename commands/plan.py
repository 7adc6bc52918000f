"""`tessera plan`: how much of each window a run keeps its accelerators busy (`node.runtime.plan`),
the memory per GPU a peer needs under DDP and FSDP2, and what a validator holds on its one GPU
and its host (`node.runtime.memory`).

    tessera plan                                   # every preset on its reference box
    tessera plan --preset 8B --gpus 8 --gpu h100 --link-gbps 1
    tessera plan --preset 1B --measure --suggest   # this host's exchange rate; blocks and H to fit

Prints compute time, communication time (upload, gather wait, download, decode) and each one's
share of the window, then the memory per GPU of the box's GPUs (``--gpu-memory``, default the
accelerator's own); ``--json`` prints the same figures as JSON. Options left out take the
preset's reference box (`node.runtime.plan.REFERENCE`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from rich.console import Console
from rich.table import Table

from commands.arg_types import fraction, positive_int
from commands.node_args import exchange_workers
from node.runtime.memory import (
    GIB,
    pick_recipe,
    pick_sharding,
    plan_memory,
    plan_validator_memory,
    step_time,
)
from node.runtime.plan import (
    CPU_PROBE_FORWARD_MFU,
    HARDWARE,
    PROBE_FORWARD_MFU,
    REFERENCE,
    TARGET_BUSY,
    Box,
    Plan,
    measure_decode_rate,
    plan,
    suggest,
)
from protocol.runconfig import PRESETS, RunConfig


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset", default=None, help="a preset name or run config file (default: every preset)"
    )
    parser.add_argument(
        "--gpus",
        type=positive_int,
        default=None,
        help="accelerators in the box (default: the reference box's)",
    )
    parser.add_argument(
        "--gpu",
        choices=sorted(HARDWARE),
        default=None,
        help="accelerator kind (default: the reference box's)",
    )
    parser.add_argument(
        "--link-gbps",
        type=_positive,
        default=None,
        help="link, up and down, Gbit/s (default: the reference box's)",
    )
    parser.add_argument(
        "--mfu",
        type=fraction,
        default=None,
        help="model-FLOPs utilisation (default: the reference box's)",
    )
    parser.add_argument(
        "--decode-m-per-s",
        type=_positive,
        default=None,
        help="the host's exchange rate, M entries/s decoded and summed (default: the reference "
        "box's, measured)",
    )
    parser.add_argument(
        "--measure",
        action="store_true",
        help="measure the exchange rate on this machine instead, with --exchange-workers",
    )
    parser.add_argument(
        "--exchange-workers",
        type=exchange_workers,
        default="auto",
        help="decode workers for --measure (0: one thread; auto: as `tessera miner` picks)",
    )
    parser.add_argument(
        "--suggest",
        action="store_true",
        help=f"also print the blocks per window and inner steps that reach {TARGET_BUSY * 100:.0f}%% busy",
    )
    parser.add_argument(
        "--gpu-memory", type=_positive, default=None, help="GiB per GPU (default: the GPU's)"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def box_for(run: RunConfig, args: argparse.Namespace) -> Box:
    """The preset's reference box with the options given on the command line."""
    box = REFERENCE.get(run.preset_name, REFERENCE["8B"])
    changes = {"gpu": args.gpu, "devices": args.gpus, "link_gbps": args.link_gbps, "mfu": args.mfu}
    if args.gpu is not None and args.gpu != box.gpu:  # another kind: its measured probe rate
        changes["probe_mfu"] = CPU_PROBE_FORWARD_MFU if args.gpu == "cpu" else PROBE_FORWARD_MFU
    return replace(box, **{k: v for k, v in changes.items() if v is not None})


def figures(run: RunConfig, box: Box, p: Plan) -> dict[str, Any]:
    return {
        "preset": run.preset_name,
        "run_id": run.run_id,
        "box": box.describe(),
        "params": p.params,
        "tokens_per_window": p.tokens,
        "flops_per_window": p.flops,
        "inner_steps": run.inner_steps,
        "blocks_per_window": run.timing.blocks_per_window,
        "outer_delay": run.outer.delay,
        "window_s": p.window_s,
        "compute_s": p.compute_s,
        "update_bytes": p.update.bytes,
        "bits_per_entry": p.update.bits_per_entry,
        "upload_s": p.upload_s,
        "gather_wait_s": p.grace_s,
        "download_s": p.download_s,
        "decode_s": p.decode_s,
        "validator_probes_s": p.probes_s,
        "manifest_wait_s": p.manifest_wait_s,
        "comm_s": p.comm_s,
        "exchange_s": p.exchange_s,
        "busy": p.busy,
        "comm_share": p.comm_share,
        "fits": p.fits,
        "budgets_fit": p.budgets_fit,
        "fits_with_delay_1": p.fits_overlapped,
    }


def memory(run: RunConfig, box: Box, gpu_gib: float | None) -> dict[str, Any]:
    """Memory per GPU of one peer under DDP and FSDP2 on the box's GPUs, with the fastest
    training recipe that fits (the smallest where none does); ``sharding`` is what a miner
    picks there (``--sharding auto``) and ``fits`` whether the peer then fits."""
    gib = gpu_gib if gpu_gib is not None else box.hardware.memory_gib
    gpu = None if box.gpu == "cpu" else int(gib * GIB)
    picked = pick_sharding("auto", run, box.devices, gpu) if box.devices > 1 else "ddp"
    out: dict[str, Any] = {"gpus": box.devices, "gpu_gib": gib, "sharding": picked}
    for strategy in ("ddp", "fsdp2"):
        recipe = pick_recipe(run, box.devices, strategy, int(gib * GIB))
        m = plan_memory(run, box.devices, strategy, recipe)
        out[strategy] = {
            "recipe": recipe.describe(),
            "step_time": step_time(recipe),
            "state_gib": m.state / GIB, "transient_gib": m.transient / GIB,
            "activations_gib": m.activations / GIB, "total_gib": m.total / GIB,
            "host_gib": m.host / GIB, "exchange_host_gib": m.exchange_host / GIB,
            "fits": m.fits(int(gib * GIB)),
        }  # fmt: skip
    out["fits"] = out[picked]["fits"]
    return out


def validator_memory(run: RunConfig, box: Box, gpu_gib: float | None) -> dict[str, Any]:
    """What a validator of the run holds on one GPU of the box's kind and on its host."""
    gib = gpu_gib if gpu_gib is not None else box.hardware.memory_gib
    v, h = plan_validator_memory(run), plan_validator_memory(run, on_host=True)
    return {
        "gpu_gib": gib,
        "device_gib": v.device / GIB, "launch_device_gib": v.launch_device / GIB,
        "host_gib": v.host / GIB, "launch_host_gib": v.launch_host / GIB,
        "fits": v.fits(int(gib * GIB)), "fits_at_launch": v.fits(int(gib * GIB), launching=True),
        "probe_state_host": {
            "device_gib": h.launch_device / GIB, "launch_host_gib": h.launch_host / GIB,
            "fits": h.fits(int(gib * GIB), launching=True),
        },
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from commands.miner import load_run

    runs = (
        [load_run(args.preset, "--preset")]
        if args.preset
        else [RunConfig.preset(n) for n in PRESETS]
    )
    rows = []
    for r in runs:
        box = box_for(r, args)
        rate = args.decode_m_per_s * 1e6 if args.decode_m_per_s else box.exchange_rate
        if args.measure:
            rate = measure_decode_rate(r, args.exchange_workers)
        row = figures(r, box, plan(r, box, rate))
        row["decode_entries_per_s"] = rate
        row["memory"] = memory(r, box, args.gpu_memory)
        row["validator_memory"] = validator_memory(r, box, args.gpu_memory)
        if args.suggest:
            s = suggest(r, box, decode_rate=rate)
            row["suggested"] = {
                "blocks_per_window": s.blocks_per_window,
                "inner_steps": s.inner_steps,
                "busy": s.busy,
            }
        rows.append(row)
    if args.json:
        json.dump({"plans": rows}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print(rows)
    return 0


ROWS: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("box", "box", str),
    ("inner steps (H)", "inner_steps", str),
    ("tokens per window", "tokens_per_window", lambda v: f"{v:,}"),
    ("compute", "compute_s", lambda v: f"{v:,.1f} s"),
    ("upload", "upload_s", lambda v: f"{v:,.2f} s"),
    ("gather wait (skew grace)", "gather_wait_s", lambda v: f"{v:,.0f} s"),
    ("download (gather)", "download_s", lambda v: f"{v:,.1f} s"),
    ("decode and sum", "decode_s", lambda v: f"{v:,.1f} s"),
    ("lead's probes before its manifest", "validator_probes_s", lambda v: f"{v:,.0f} s"),
    ("communication", "comm_s", lambda v: f"{v:,.1f} s"),
    ("exchange to the agreed step (with the probes)", "exchange_s", lambda v: f"{v:,.1f} s"),
    ("window", "window_s", lambda v: f"{v:,.0f} s"),
    ("busy: training", "busy", lambda v: f"{v:.1%}"),
    ("communication share", "comm_share", lambda v: f"{v:.1%}"),
    ("fits (delay 0)", "fits", lambda v: "yes" if v else "[red]no[/]"),
    ("fetch/manifest budgets fit", "budgets_fit", lambda v: "yes" if v else "[red]no[/]"),
    ("fits (delay 1)", "fits_with_delay_1", lambda v: "yes" if v else "[red]no[/]"),
    ("update", "update_bytes", lambda v: f"{v / 1e6:,.2f} MB"),
    ("bits per entry (encoded)", "bits_per_entry", lambda v: f"{v:.2f}"),
    ("exchange rate (decode and sum)", "decode_entries_per_s", lambda v: f"{v / 1e6:.2f} M/s"),
)


def _print(rows: list[dict[str, Any]]) -> None:
    t = Table(title="tessera plan: one window (outer.delay = 0: train, then exchange)")
    t.add_column("")
    for r in rows:
        t.add_column(r["preset"], justify="right")
    for label, key, show in ROWS:
        t.add_row(label, *(show(r[key]) for r in rows))
    if any("suggested" in r for r in rows):
        t.add_row(f"suggested for {TARGET_BUSY:.0%}: blocks per window", *(
            str(r["suggested"]["blocks_per_window"]) for r in rows))  # fmt: skip
        t.add_row("suggested: inner steps", *(str(r["suggested"]["inner_steps"]) for r in rows))
    for strategy in ("ddp", "fsdp2"):
        t.add_row(f"memory per GPU, {strategy.upper()}*", *(_memory_cell(r["memory"], strategy)
                                                        for r in rows))  # fmt: skip
        t.add_row(f"training recipe, {strategy.upper()}", *(_recipe_cell(r["memory"], strategy)
                                                         for r in rows))  # fmt: skip
    t.add_row("validator, one GPU†", *(_validator_cell(r["validator_memory"]) for r in rows))
    console = Console()
    console.print(t)
    console.print(
        "* with the fastest training recipe that fits (node/runtime/memory.py: activations and "
        "step times measured on one H100 at 1B)"
    )
    console.print(
        "† the probe's copies and the window's mean beside the model, or on the host "
        "(tessera validator --probe-state; node/runtime/memory.py, counted from the code)"
    )


def _recipe_cell(m: dict[str, Any], strategy: str) -> str:
    return f"{m[strategy]['recipe']} ({m[strategy]['step_time']:.2f}× step time)"


def _memory_cell(m: dict[str, Any], strategy: str) -> str:
    fit = "fits" if m[strategy]["fits"] else "[red]does not fit[/]"
    where = "on workers " if strategy == "ddp" else ""
    host = (
        f"rank 0 host {m[strategy]['host_gib']:,.0f} GiB (exchange {where}"
        f"{m[strategy]['exchange_host_gib']:,.0f} GiB)"
    )
    return f"{m[strategy]['total_gib']:,.1f} of {m['gpu_gib']:g} GiB, {fit}; {host}"


def _validator_cell(v: dict[str, Any]) -> str:
    def fit(ok: bool) -> str:
        return "fits" if ok else "[red]does not fit[/]"

    h = v["probe_state_host"]
    return (
        f"{v['device_gib']:,.1f} of {v['gpu_gib']:g} GiB, {fit(v['fits'])} (first windows "
        f"{v['launch_device_gib']:,.1f}, {fit(v['fits_at_launch'])}); host "
        f"{v['launch_host_gib']:,.0f} GiB; probe state on the host: {h['device_gib']:,.1f} "
        f"GiB, {fit(h['fits'])}, host {h['launch_host_gib']:,.0f} GiB"
    )
