"""The throughput row: time a few inner steps of the run on this machine, and what that means for
its windows (`node.runtime.plan`): tokens/s, the share of a window spent training, and whether the
update would make the upload deadline."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from commands.doctor.machine import CPU_PRACTICAL_PARAMS, Gpu, ddp_bytes_per_gpu
from commands.doctor.report import Check, ok, skip, warn
from miner.train import make_optimizer, train_window
from node.model.llama import build_model
from node.runtime.plan import REFERENCE, Plan, plan
from protocol.runconfig import RunConfig

NAME = "throughput"


def measure_tokens_per_s(run: RunConfig, device: torch.device, steps: int) -> float:
    """Tokens per second of ``steps`` inner steps (random tokens, the run's batch and sequence
    length) on one device, after one untimed step (allocations, kernels, caches)."""
    model = build_model(run.model, run.seed).to(device)
    optimizer = make_optimizer(model, run)
    gen = torch.Generator().manual_seed(0)

    def batches(n: int) -> list[torch.Tensor]:
        shape = (run.batch_size, run.seq_len + 1)
        return [torch.randint(run.model.vocab_size, shape, generator=gen) for _ in range(n)]

    train_window(model, optimizer, batches(1), run, 0, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return train_window(model, optimizer, batches(steps), run, 0, device).tokens_per_s


def _skip_reason(run: RunConfig, device: str, gpus: Sequence[Gpu]) -> str | None:
    params = run.param_count()
    if device.startswith("cuda"):
        if not gpus:
            return "needs a GPU (see the gpu row)"
        if ddp_bytes_per_gpu(params) > min(g.memory for g in gpus):
            return f"{run.preset_name} does not fit one GPU here (see the gpu row)"
    elif params > CPU_PRACTICAL_PARAMS:
        return f"{run.preset_name} is not practical on a CPU (see the gpu row)"
    return None


def verdict(run: RunConfig, p: Plan, measured: str) -> Check:
    """The row for a plan built from a measured training rate."""
    busy = f"{p.busy:.0%} busy" + ("" if p.busy <= 1 else ": longer than the window")
    detail = (
        f"{measured}: a window's {p.tokens:,} tokens train in {p.compute_s:,.1f} s of its "
        f"{p.window_s:,.0f} s ({busy}); the exchange takes {p.exchange_s:,.1f} s "
        f"(upload {p.upload_s:,.1f} s, gather wait {p.grace_s:,.0f} s, download "
        f"{p.download_s:,.1f} s, decode {p.decode_s:,.1f} s, the lead's probes "
        f"{p.probes_s:,.1f} s)"
    )
    if not p.fits:
        return warn(
            NAME,
            detail + f": {p.compute_s + p.exchange_s:,.0f} s > {p.window_s:,.0f} s, so this box "
            "would miss the upload deadline",
            "use more or faster GPUs or a faster link, or a run with longer windows "
            "(tessera plan --suggest)",
        )
    return ok(NAME, detail)


def throughput_check(
    run: RunConfig, device: str, gpus: Sequence[Gpu], steps: int, link_gbps: float
) -> Check:
    if steps <= 0:
        return skip(NAME, "--train-steps 0: not measured")
    reason = _skip_reason(run, device, gpus)
    if reason:
        return skip(NAME, reason)
    dev = torch.device("cuda:0" if device.startswith("cuda") else device)
    rate = measure_tokens_per_s(run, dev, steps)
    devices = len(gpus) if dev.type == "cuda" else 1
    reference = REFERENCE.get(run.preset_name, REFERENCE["8B"])  # the FLOP model is not used
    box = replace(reference, devices=devices, link_gbps=link_gbps)
    measured = f"{rate:,.0f} tokens/s on {dev}"
    if devices > 1:
        measured += f" (× {devices} GPUs, assuming DDP scales linearly)"
    return verdict(run, plan(run, box, tokens_per_s=rate * devices), measured)
