"""`tessera bench step`: the inner loop's step time, throughput and memory per training recipe.

Each of `node.runtime.memory.RECIPES` (activations kept; the loss in chunks; layers recomputed
and the loss in chunks) trains ``steps`` inner steps of ``rows`` random sequences with the
miner's own loop (`miner.train.train_window`: AdamW, gradient accumulation over micro-batches,
bf16 autocast on a GPU), after one warm-up step. On a GPU each row also has the peak of allocated
memory above the weights and AdamW moments, less the gradients (what the micro-batch's
activations and the loss really took), beside the memory plan's `activation_bytes`, and the
model FLOPs utilisation (``6 · parameters · tokens/s`` over the GPU's peak bf16 rate,
`node.runtime.plan.HARDWARE`). The reference is the plain recipe's step time, measured in the
same run: each recipe's ratio to it is what `node.runtime.memory.step_time` assumes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from miner.train import make_optimizer, train_window
from node.model.llama import build_model
from node.runtime.memory import FP32, RECIPES, MemoryOptions, activation_bytes, step_time
from node.runtime.plan import HARDWARE
from protocol.runconfig import RunConfig

__all__ = ["step_cost"]


def _peak_flops(device: torch.device) -> float | None:
    """The GPU's peak bf16 rate where `HARDWARE` knows its kind (None elsewhere)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    return next((h.peak_flops for key, h in HARDWARE.items() if key in name), None)


def step_cost(
    preset: str,
    device: str,
    rows: int,
    steps: int,
    log: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    """The bench's result (see `tessera bench step --json`)."""
    run = RunConfig.preset(preset)
    dev = torch.device(device)
    log(f"building the {preset} model on {device}…")
    model = build_model(run.model, run.seed).to(dev)
    optimizer = make_optimizer(model, run)
    params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(0)
    shape = (rows, run.seq_len + 1)
    batches = [torch.randint(0, run.model.vocab_size, shape, generator=gen) for _ in range(steps)]
    peak = _peak_flops(dev)
    results = []
    for options in reversed(RECIPES):  # the smallest first: the largest leaves the most slack
        log(f"{options.describe()}: {steps} steps of {rows} × {run.seq_len} tokens…")
        results.append(_one_recipe(model, optimizer, batches, run, dev, options, params, peak))
    results.reverse()
    plain = results[0].get("s_per_step")
    for row in results:
        if plain and "s_per_step" in row:
            row["step_time"] = row["s_per_step"] / plain
    return {
        "preset": preset,
        "device": device,
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "parameters": params,
        "rows": rows,
        "seq_len": run.seq_len,
        "micro_batch_size": run.micro_batch_size,
        "steps": steps,
        "peak_flops": peak,
        "recipes": results,
    }


def _one_recipe(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[torch.Tensor],
    run: RunConfig,
    dev: torch.device,
    options: MemoryOptions,
    params: int,
    peak: float | None,
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "recipe": options.describe(),
        "checkpoint_layers": options.checkpoint_layers,
        "loss_chunk_tokens": options.loss_chunk_tokens,
        "planned_activation_bytes": activation_bytes(run, options),
        "planned_step_time": step_time(options),
    }
    cuda = dev.type == "cuda"
    try:
        train_window(model, optimizer, batches[:1], run, 0, dev, memory=options)  # warm-up
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev) if cuda else 0
        begun = time.perf_counter()
        result = train_window(model, optimizer, batches, run, 0, dev, memory=options)
        if cuda:
            torch.cuda.synchronize(dev)
        seconds = time.perf_counter() - begun
    except torch.OutOfMemoryError:
        row["out_of_memory"] = True
        return row
    finally:
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.empty_cache()
    row["s_per_step"] = seconds / len(batches)
    row["tokens_per_s"] = result.tokens / seconds
    if cuda:
        grads = FP32 * params  # accumulated over the micro-batches, live at the peak
        row["measured_activation_bytes"] = torch.cuda.max_memory_allocated(dev) - base - grads
    if peak:
        row["mfu"] = 6 * params * row["tokens_per_s"] / peak
    return row
