"""The outer optimizer: what turns a window's aggregate into the step every node takes.

``run.outer.optimizer``:

* ``sgd`` (SparseLoCo, Algorithm 1; DiLoCo with outer SGD): ``θ ← θ_start − α · mean``;
* ``nesterov`` (DiLoCo): ``m ← μ m + mean``, ``θ ← θ_start − α (mean + μ m)``, with ``m = 0``
  before the first window (PyTorch's SGD with ``nesterov=True`` and no dampening).

The momentum ``m`` is state every honest node holds identically (it is a function of the applied
aggregates only); it is saved with a node's state and published in checkpoints, so catch-up
restores it (`node.window.history`). Every operation is elementwise, so the result is the same
bit for bit on every node.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from codec.spec import ModelSpec
from protocol.runconfig import OuterConfig

MOMENTUM = "momentum"


class OuterOptimizer:
    """The outer step of one run, with its (possibly empty) state."""

    def __init__(self, cfg: OuterConfig, spec: ModelSpec, device: torch.device) -> None:
        self.cfg, self.spec, self.device = cfg, spec, device
        self._momentum: dict[str, torch.Tensor] | None = None

    def apply(
        self,
        model: torch.nn.Module,
        mean: Mapping[str, torch.Tensor],
        start: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """``θ ← start − α · step(mean)`` (``start`` defaults to the model's current weights)."""
        alpha = self.cfg.alpha
        with torch.no_grad():
            for name, p in model.named_parameters():
                base = start[name] if start is not None else p.detach().clone()
                p.copy_(base.sub(self._direction(name, mean[name]), alpha=alpha))

    def _direction(self, name: str, mean: torch.Tensor) -> torch.Tensor:
        if self.cfg.optimizer == "sgd":
            return mean
        if self._momentum is None:
            self._momentum = {
                t.name: torch.zeros(t.shape, dtype=torch.float32, device=self.device)
                for t in self.spec.tensors
            }
        mu = torch.tensor(self.cfg.momentum, dtype=torch.float32, device=mean.device)
        m = self._momentum[name]
        m.copy_(m * mu + mean)  # separate products and sums: never fused, the same everywhere
        return mean + m * mu

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{"momentum.<tensor>": m}`` under Nesterov once a step was taken; otherwise empty."""
        if self._momentum is None:
            return {}
        return {f"{MOMENTUM}.{n}": t.detach().cpu().clone() for n, t in self._momentum.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore `state_dict` (empty means: no momentum yet). ValueError if it does not fit."""
        if not state:
            self._momentum = None
            return
        if self.cfg.optimizer != "nesterov":
            raise ValueError(f"outer state {sorted(state)[:3]} for an outer {self.cfg.optimizer}")
        want = {f"{MOMENTUM}.{t.name}": tuple(t.shape) for t in self.spec.tensors}
        got = {k: tuple(v.shape) for k, v in state.items()}
        if got != want:
            raise ValueError("outer state does not match the model's tensors")
        if any(
            not v.is_floating_point() or not bool(torch.isfinite(v).all()) for v in state.values()
        ):
            raise ValueError("outer state must be finite floating tensors")
        self._momentum = {
            t.name: state[f"{MOMENTUM}.{t.name}"].to(self.device, torch.float32).clone()
            for t in self.spec.tensors
        }

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The names and shapes `state_dict` may hold (what a checkpoint may carry)."""
        if self.cfg.optimizer != "nesterov":
            return {}
        return {f"{MOMENTUM}.{t.name}": tuple(t.shape) for t in self.spec.tensors}
