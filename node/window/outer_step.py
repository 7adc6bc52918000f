"""The one outer step every role takes: peers, validators and history replay alike.

The rule (stated once, here; the reasoning is in docs/consensus.md):

1. every update is validated strictly (shapes, codec parameters, finite values, each value's
   magnitude at most ``run.codec`` allows) — a bad update is an error, never a partial step;
2. each update is scaled to at most the **median norm** of the window's updates (exact, order-free
   norms: `codec.aggregate.update_norm`), so no single update moves the model further than the
   typical one does;
3. the clipped updates are averaged in ascending uid order (`codec.aggregate.aggregate`);
4. ``θ ← θ_start − α · mean``.

Hence one update's share of the step is at most ``α · median / N`` in L2 norm, where ``N`` is the
number of updates applied; with ``N = 1`` the update is its own median, and its norm is still
bounded by ``max_abs_value · sqrt(kept entries)`` through step 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from codec.aggregate import aggregate
from codec.compress import SparseTensor
from codec.spec import ModelSpec
from protocol.runconfig import RunConfig

Updates = Mapping[int, Sequence[SparseTensor]]


def window_mean(
    updates: Updates, run: RunConfig, spec: ModelSpec, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """The validated, median-clipped mean of a window's updates (zeros when there are none)."""
    return aggregate(updates, spec, run.codec, clip_to_median=True, device=device, validate=True)


def apply_mean(
    model: torch.nn.Module,
    mean: Mapping[str, torch.Tensor],
    run: RunConfig,
    start: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """``θ ← start − α · mean`` (``start`` defaults to the model's current weights)."""
    alpha = run.outer.alpha
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = start[name] if start is not None else p.detach().clone()
            p.copy_(base.sub(mean[name], alpha=alpha))


def apply_updates(
    model: torch.nn.Module,
    updates: Updates,
    run: RunConfig,
    spec: ModelSpec,
    device: torch.device | str = "cpu",
) -> None:
    """One whole outer step from the model's current weights."""
    apply_mean(model, window_mean(updates, run, spec, device), run)
