"""Per-sample next-token losses of a batch, without gradients (what the validator's probes and
held-out evaluations read)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def row_losses(
    model: torch.nn.Module, batch: torch.Tensor, micro: int, device: torch.device
) -> np.ndarray:
    """Per-sample mean next-token loss of `batch` (float64), without gradients."""
    out = []
    with torch.no_grad():
        for part in batch.split(micro):
            part = part.to(device)
            logits = model(part[:, :-1]).float()
            loss = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), part[:, 1:].reshape(-1), reduction="none"
            )
            out.append(loss.view(part.shape[0], -1).mean(1).double().cpu())
    return torch.cat(out).numpy() if out else np.zeros(0)
