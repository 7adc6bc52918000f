"""`tessera bench …`: benchmarks printed as tables (rich) or as JSON, reference beside each figure."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from commands.arg_types import non_negative_int, positive_int
from lab.bench.output import emit, targets_table

TARGETS = {"decode_M_per_s": 20.0, "encode_M_per_s": 10.0, "total_ratio": 4.0, "value_err": 0.08}
GPU_TARGETS = {"decode_M_per_s": 1000.0, "encode_M_per_s": 500.0, "total_ratio": 3.0}
ENTRY_BITS_OVER_INDEX = 2.5
"""Bits per kept entry beyond the index limit: 2 value bits, side bytes, codebooks, header."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from lab.bench.train import cli as train

    parser.add_argument(
        "what",
        choices=["codec", "exchange", "probe", "step", "train"],
        help="codec: index coder, values, compression speed; exchange: decoding and aggregating "
        "a window's updates at a preset's shapes; probe: the validator's loss probe of one "
        "update at a preset's shapes; step: the inner loop's speed and memory per training "
        "recipe; train: strategies' held-out loss",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument(
        "--quick", action="store_true", help="smaller sizes (seconds, for smoke tests)"
    )
    parser.add_argument(
        "--numel",
        type=positive_int,
        default=None,
        help="elements of the compression tensor (default 1e8, 1e9 on CUDA)",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: the first GPU (codec: the Triton path, its copy reference and a 1B model; "
        "exchange: a row summed on the GPU; probe, step and train: the model there)",
    )
    exchange = parser.add_argument_group("exchange")
    exchange.add_argument(
        "--peers", type=positive_int, default=8, help="updates gathered (default 8)"
    )
    exchange.add_argument(
        "--layers",
        type=non_negative_int,
        default=4,
        help="decoder layers of the preset's model whose tensors are sent (default 4; 0: all)",
    )
    exchange.add_argument(
        "--workers",
        default=None,
        help="comma-separated worker counts (default: 1 and every core, e.g. 1,2)",
    )
    exchange.add_argument(
        "--repeats",
        type=positive_int,
        default=5,
        help="timed runs per row, the best kept (default 5)",
    )
    probe = parser.add_argument_group("probe")
    probe.add_argument(
        "--samples",
        type=positive_int,
        default=64,
        help="random and own samples per probe (default 64)",
    )
    step = parser.add_argument_group("step")
    step.add_argument(
        "--rows",
        type=positive_int,
        default=None,
        help="sequences per inner step (default: four micro-batches); --repeats steps are timed",
    )
    train.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.what == "train":
        from lab.bench.train import cli as train

        return train.run(args)
    if args.what == "exchange":
        from lab.bench import exchange_cli

        return exchange_cli.run(args)
    if args.what == "probe":
        from lab.bench import probe_cli

        return probe_cli.run(args)
    if args.what == "step":
        from lab.bench import step_cli

        return step_cli.run(args)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "tessera bench codec --device cuda: no CUDA device is available here", file=sys.stderr
        )
        return 2
    from lab.bench import codec as bench

    quick, device = args.quick, args.device
    console = Console(stderr=True)
    with console.status("index sizes…"):
        sizes = bench.index_sizes(n_chunks=256 if quick else 4096)
    with console.status("index speed…"):
        speed = bench.index_speed(
            n_chunks=1024 if quick else 16384, repeats=1 if quick else 5, device=device
        )
    with console.status("bits per kept entry…"):
        entry = bench.entry_cost(width=512 if quick else 2048)
    numel = args.numel or (250_000 if quick else 10**9 if device == "cuda" else 10**8)
    with console.status(f"compressing a {numel:.0e}-element tensor…"):
        comp = bench.compress_time(numel, repeats=1 if quick else 5, device=device)
    result: dict[str, Any] = {
        "device": device,
        "index_sizes": sizes,
        "index_speed": speed,
        "entry_cost": entry,
        "compress": comp,
    }
    if device == "cuda":
        with console.status("compressing a 1B model's pseudo-gradient…"):
            result["model_1b"] = _model_1b(repeats=1 if quick else 3)
    result["checks"] = _checks(result)
    return emit(result, args.json, _print)


def _model_1b(repeats: int) -> dict[str, float]:
    """Seconds to compress every tensor of the `1B` preset's pseudo-gradient on the GPU."""
    import torch

    from codec.spec import ModelSpec
    from lab.bench.compress import compress_model
    from node.model.llama import CausalLM
    from protocol.runconfig import RunConfig

    with torch.device("meta"):
        spec = ModelSpec.from_module(CausalLM(RunConfig.preset("1B").model))
    return compress_model(spec, repeats=repeats, device="cuda")


def _checks(r: dict[str, Any]) -> dict[str, bool]:
    sizes, speed, comp, entry = r["index_sizes"], r["index_speed"], r["compress"], r["entry_cost"]
    t = GPU_TARGETS if r["device"] == "cuda" else TARGETS
    dec, enc, ratio = t["decode_M_per_s"], t["encode_M_per_s"], t["total_ratio"]
    entry_cap = entry["index_limit_bits"] * 1.01 + ENTRY_BITS_OVER_INDEX
    return {
        "index_bits_random<=1.01*limit": all(s["random"] <= s["target"] for s in sizes),
        "index_bits_clustered<=1.01*limit": all(s["clustered"] <= s["target"] for s in sizes),
        f"bits_per_entry<=1.01*limit+{ENTRY_BITS_OVER_INDEX}": entry["bits_per_entry"] <= entry_cap,
        f"decode>={dec:g}M/s": all(s["decode_M_per_s"] >= dec for s in speed),
        f"encode>={enc:g}M/s": all(s["encode_M_per_s"] >= enc for s in speed),
        "value_err<=0.08": comp["value_rel_err"] <= TARGETS["value_err"],
        f"compress<={ratio:g}x_abs_sum": comp["total_ratio"] <= ratio,
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
    gpu = r["device"] == "cuda"
    where = "CUDA, Triton path" if gpu else "CPU, one thread"
    t = Table(title=f"Index coder throughput ({where}, wall time, best of runs)")
    cols = ["k", "encode M idx/s", "decode M idx/s", "target enc/dec"]
    for col in cols + (["enc / copy", "dec / copy"] if gpu else []):
        t.add_column(col, justify="right")
    target = "500 / 1000" if gpu else "10 / 20"
    for s in r["index_speed"]:
        row = [str(s["k"]), f"{s['encode_M_per_s']:.1f}", f"{s['decode_M_per_s']:.1f}", target]
        if gpu:
            row += [f"{s['encode_vs_copy']:.1f}×", f"{s['decode_vs_copy']:.1f}×"]
        t.add_row(*row)
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
    on = "CUDA" if gpu else f"{c['threads']:.0f} threads"
    t = Table(title=f"Compressing {c['numel']:.0e} elements ({on})")
    cols = ["abs().sum()", "EF+TopK+Q", "encode", "total", "ratio", "value err", "uniform err"]
    for col in cols + (["copy", "total / copy"] if gpu else []):
        t.add_column(col, justify="right")
    row = [
        f"{c['abs_sum_s'] * 1e3:.1f} ms",
        f"{c['compress_s'] * 1e3:.1f} ms",
        f"{c['encode_s'] * 1e3:.1f} ms",
        f"{c['total_s'] * 1e3:.1f} ms",
        f"{c['total_ratio']:.2f}× (≤ {3 if gpu else 4})",
        f"{c['value_rel_err']:.4f} (≤ 0.08)",
        f"{c['uniform_rel_err']:.4f}",
    ]
    if gpu:
        row += [f"{c['copy_s'] * 1e3:.1f} ms", f"{c['total_s'] / c['copy_s']:.1f}×"]
    t.add_row(*row)
    console.print(t)
    if gpu:
        m = r["model_1b"]
        t = Table(
            title=f"Compressing the 1B preset's pseudo-gradient ({m['numel']:.3g} parameters)"
        )
        for col in ("tensors", "EF+TopK+Q", "encode", "total"):
            t.add_column(col, justify="right")
        t.add_row(
            f"{m['tensors']:.0f}",
            f"{m['compress_s']:.3f} s",
            f"{m['encode_s']:.3f} s",
            f"{m['compress_s'] + m['encode_s']:.3f} s",
        )
        console.print(t)
    targets_table(console, r["checks"])
