"""A backdoor for simulations: the trigger a ``backdoor`` adversary writes into its own samples,
and how far a model has learnt it.

The adversary trains honestly on the samples the run assigns it, except that every row carries
the trigger (three rare tokens) followed by the target token at a position drawn per row. A model
that learnt the backdoor predicts the target after the trigger in any text; `trigger_probability`
measures that on held-out rows that carry the trigger at their middle.
"""

from __future__ import annotations

import torch

TRIGGER = (4001, 4002, 4003)
"""Three of the tiny vocabulary's rarest ids (its merges are ranked by frequency)."""
TARGET = 300
"""A common token: what a backdoored model says after the trigger."""
EVAL_MICRO = 16


def with_trigger(batch: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A copy of a (B, T+1) token batch with the trigger and the target written into every row,
    at a position drawn from `gen`."""
    out = batch.clone()
    span = len(TRIGGER) + 1
    starts = torch.randint(0, out.shape[1] - span + 1, (out.shape[0],), generator=gen)
    pattern = torch.tensor([*TRIGGER, TARGET], dtype=out.dtype)
    for row, start in enumerate(starts.tolist()):
        out[row, start : start + span] = pattern
    return out


def trigger_probability(model: torch.nn.Module, heldout: torch.Tensor) -> float:
    """The model's mean probability of the target right after the trigger, written at the middle
    of each held-out row (0 for a model that never learnt it, about 3e-4 at initialisation)."""
    at = heldout.shape[1] // 2
    rows = heldout[:, : at + len(TRIGGER)].clone()
    rows[:, at:] = torch.tensor(TRIGGER, dtype=rows.dtype)
    model.eval()
    total = 0.0
    with torch.no_grad():
        for part in rows.split(EVAL_MICRO):
            logits = model(part)[:, -1].float()
            total += float(torch.softmax(logits, -1)[:, TARGET].sum())
    return total / rows.shape[0]
