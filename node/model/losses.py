"""Per-sample next-token losses of a batch, without gradients (what the validator's probes and
held-out evaluations read).

On a GPU the forward passes run the training recipe, bf16 autocast over fp32 weights (RMSNorm,
RoPE tables and the loss stay fp32), at about a third of the fp32 cost; elsewhere they run in
fp32. The losses stay on the device until the batch is done (one host sync per call).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F


def bf16_by_default(device: torch.device) -> bool:
    """Whether forward passes on `device` run under bf16 autocast unless told otherwise."""
    return device.type == "cuda"


class OutOfTime(Exception):
    """A forward pass was not started: its caller's time ran out (`row_losses`'s ``stop``)."""


def row_losses(
    model: torch.nn.Module,
    batch: torch.Tensor,
    micro: int,
    device: torch.device,
    bf16: bool | None = None,
    stop: Callable[[], bool] | None = None,
) -> np.ndarray:
    """Per-sample mean next-token loss of `batch` (float64), without gradients; `bf16` forces
    (True) or forbids (False) bf16 autocast, default `bf16_by_default(device)`. ``stop`` is asked
    before each micro-batch: True raises `OutOfTime` (a caller bounded in time overruns by one
    micro-batch's forward pass at most)."""
    autocast = bf16_by_default(device) if bf16 is None else bf16
    out = []
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        for part in batch.split(micro):
            if stop is not None and stop():
                raise OutOfTime
            part = part.to(device, non_blocking=True)
            logits = model(part[:, :-1]).float()
            loss = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), part[:, 1:].reshape(-1), reduction="none"
            )
            out.append(loss.view(part.shape[0], -1).mean(1))
    return torch.cat(out).double().cpu().numpy() if out else np.zeros(0)
