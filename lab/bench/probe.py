"""`tessera bench probe`: what the validator's loss probe of one update costs at a preset's shapes.

The lead probes every selected update before it decides (`validator.admission`), so a window's
manifest waits for ``G`` probes; every validator then scores the rest. One probe is what
`validator.scoring.LossProbe.score` runs: the losses of the peer's own samples at the start
model, the update stepped in, the random and own samples' losses, the model restored, the
consensus direction stepped in, the own samples' losses, the model restored (four forward passes
of ``samples`` sequences, two steps, two restores; the lead's second probe of a peer, at ``T``
after the one at its own norm, reuses the first and the last), in the validator's precision (bf16
autocast on a GPU, fp32 elsewhere: `node.model.losses`). The reference, measured in the same run,
is one forward pass of the same samples in that precision, and on a GPU one in fp32 as well, with
how far bf16 moves a probe's readings: the largest per-sample loss gap and the gap in the update's
mean gain on its own samples. Random tokens and a random sparse update of the run's codec: the
cost does not depend on the values.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from codec.compress import Compressor
from codec.spec import ModelSpec
from node.model.llama import build_model
from node.model.losses import bf16_by_default, row_losses
from node.strategy import make_format
from protocol.runconfig import RunConfig


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def probe_cost(preset: str, samples: int, layers: int, device: str, repeats: int) -> dict[str, Any]:
    """Seconds for one forward pass of `samples` sequences and for one probe (best of
    `repeats`), on the preset's model cut to `layers` decoder layers (0: all)."""
    run = RunConfig.preset(preset)
    if layers:
        run = run.model_copy(update={"model": run.model.model_copy(update={"n_layers": layers})})
    dev = torch.device(device)
    model = build_model(run.model, run.seed).to(dev).eval()
    spec = ModelSpec.from_module(model)
    fmt = make_format(run, spec)
    gen = torch.Generator().manual_seed(0)
    comp = Compressor(spec, run.codec)
    update = [
        comp.compress(t.name, torch.randn(t.shape, generator=gen) * 1e-3, 0.0, freeze=True).to(dev)
        for t in spec.tensors
    ]
    params = dict(model.named_parameters())
    start = {k: p.detach().clone() for k, p in params.items()}
    ref = {k: torch.randn(p.shape, generator=gen).to(dev) * 1e-6 for k, p in params.items()}
    shape = (samples, run.seq_len + 1)
    own = torch.randint(0, run.model.vocab_size, shape, generator=gen)
    rand = torch.randint(0, run.model.vocab_size, shape, generator=gen)
    micro = run.micro_batch_size

    def restore() -> None:
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(start[k])

    def forward() -> None:
        row_losses(model, own, micro, dev)

    def forward_fp32() -> None:
        row_losses(model, own, micro, dev, bf16=False)

    def gain(bf16: bool) -> tuple[np.ndarray, float]:
        before = row_losses(model, own, micro, dev, bf16=bf16)
        with torch.no_grad():
            for piece in update:
                fmt.add_into(params[piece.name].data, piece, -1e-3)
        after = row_losses(model, own, micro, dev, bf16=bf16)
        restore()
        return before, float((before - after).mean())

    def probe() -> None:
        row_losses(model, own, micro, dev)
        with torch.no_grad():
            for piece in update:
                fmt.add_into(params[piece.name].data, piece, -1e-3)
        row_losses(model, rand, micro, dev)
        row_losses(model, own, micro, dev)
        restore()
        with torch.no_grad():
            for k, delta in ref.items():
                params[k].sub_(delta)
        row_losses(model, own, micro, dev)
        restore()

    out: dict[str, Any] = {
        "preset": preset,
        "device": device,
        "layers": run.model.n_layers,
        "parameters": sum(p.numel() for p in params.values()),
        "samples": samples,
        "seq_len": run.seq_len,
        "micro_batch_size": micro,
    }
    timed = [("forward_s", forward), ("probe_s", probe)]
    if bf16_by_default(dev):
        timed.append(("forward_fp32_s", forward_fp32))
        (loss16, gain16), (loss32, gain32) = gain(True), gain(False)
        out["loss_gap"] = float(np.abs(loss16 - loss32).max())
        out["gain_bf16"], out["gain_fp32"] = gain16, gain32
    out["precision"] = "bf16 autocast" if bf16_by_default(dev) else "fp32"
    for name, fn in timed:
        fn()  # warm-up: kernels, allocator
        best = float("inf")
        for _ in range(repeats):
            _sync(dev)
            begun = time.perf_counter()
            fn()
            _sync(dev)
            best = min(best, time.perf_counter() - begun)
        out[name] = best
    out["probe_vs_forward"] = out["probe_s"] / out["forward_s"]
    out["tokens_per_s"] = 4 * samples * run.seq_len / out["probe_s"]
    return out
