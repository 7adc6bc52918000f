"""The outer step: what turns a window's aggregate into the step every node takes.

One `OuterOptimizer` per node and run (`node.strategy.make_strategy`), the outer part of the
strategy; ``run.outer.optimizer``:

* ``sgd`` (SparseLoCo, Algorithm 1; DiLoCo with outer SGD): ``θ ← θ_start − α · mean``;
* ``nesterov`` (DiLoCo): ``m ← μ m + mean``, ``θ ← θ_start − α (mean + μ m)``, with ``m = 0``
  before the first window (PyTorch's SGD with ``nesterov=True`` and no dampening).

With ``outer.alpha_at_peak`` set, a window's mean is first scaled by ``α_w / α``, its outer rate
over ``alpha`` (`protocol.schedule.outer_alpha`): smaller while the inner rate is near its peak.

``run.outer.delay`` (docs/training.md): an aggregate is first **received** (`receive`: held), then
applied by the next step (`next_weights`, `advance`). `step` is the consensus schedule
(validators, history replay): with ``delay = 0`` every window receives its own mean and advances
at once; with ``delay = 1`` it advances with the previous window's mean, then receives its own,
so ``θ_{w+1} = θ_w − α · step(mean_{w−1})``. A peer, whose aggregate of window ``w`` lands while
it trains ``w + 1``, drives the same schedule with `receive` and `next_weights` (`miner.peer`).

The momentum ``m`` and the held mean are state every honest node has identically (functions of
the applied aggregates only); they are saved with a node's state and published in checkpoints
(`state_dict`), so catch-up restores them (`node.window.history`). Every operation is
elementwise, so the result is the same bit for bit on every node, and a sharded peer keeps the
state of its own rows alone (`keep_rows`). Strategies with consensus state of their own (the
shared mask's previous aggregate, GreedyLore's basis) extend the outer step with it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from codec.spec import ModelSpec
from protocol.runconfig import RunConfig
from protocol.schedule import outer_alpha

MOMENTUM = "momentum"
HELD = "held"

LAND_BY = 0.1
"""With ``outer.delay = 1``: the share of a window's inner steps after which the previous window's
outer step must have been taken. A peer whose exchange has not landed by then waits for it: a
step that lands only after the window's training makes the schedule unstable (docs/training.md).
The presets' exchange takes 7-11 % of their windows (`tessera plan`), so there it rarely waits.
It is each node's own schedule, not part of the consensus (every origin is the same whenever the
step lands), so it is not in the run config."""


def land_by_step(inner_steps: int, land: float = LAND_BY) -> int:
    """The inner steps trained before the delayed outer step is taken: ``land`` of them, rounded
    up (0: before the first)."""
    return math.ceil(land * inner_steps)


class OuterOptimizer:
    """The outer step of one run, with its (possibly empty) state (see the module docstring)."""

    def __init__(self, run: RunConfig, spec: ModelSpec, device: torch.device | str = "cpu") -> None:
        self.run, self.spec, self.device = run, spec, torch.device(device)
        self.cfg = run.outer
        self._momentum: dict[str, torch.Tensor] | None = None
        self._held: dict[str, torch.Tensor] | None = None

    @property
    def holding(self) -> bool:
        return self._held is not None

    def receive(self, mean: Mapping[str, torch.Tensor], window: int) -> None:
        """Hold window ``window``'s ``mean`` (taken over, not copied) for the next step, scaled
        in place by the window's outer rate over ``alpha`` where the run's schedule lowers it
        (`protocol.schedule.outer_alpha`), so that the step is ``alpha_w · mean``."""
        if self._held is not None:
            raise RuntimeError("an aggregate is already held: step before holding another")
        scale = outer_alpha(self.run, window) / self.cfg.alpha
        if scale != 1.0:
            with torch.no_grad():
                for t in mean.values():
                    t.mul_(scale)
        self._held = dict(mean)

    def next_weights(self, start: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``start − α · step(held)``, releasing the held mean; a copy of ``start`` when none is
        held (no step: the momentum stays as it is)."""
        held, self._held = self._held, None
        with torch.no_grad():
            return {name: self._stepped(name, w, held) for name, w in start.items()}

    def advance(
        self, model: torch.nn.Module, start: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        """The model set to `next_weights` of ``start`` (default: its own weights), one tensor
        at a time: the same bits, and never a second copy of the whole model. A held mean may
        live elsewhere (a validator's host): each tensor of it comes over when it is used."""
        held, self._held = self._held, None
        if held is None and start is None:
            return  # no step, and the model is its own start
        with torch.no_grad():
            for name, p in model.named_parameters():
                base = start[name] if start is not None else p
                p.copy_(self._stepped(name, base, held))

    def step(self, model: torch.nn.Module, mean: Mapping[str, torch.Tensor], window: int) -> None:
        """Window ``window`` of the consensus schedule from the model's current weights, as
        validators and history replay take it: with ``outer.delay = 0`` its ``mean`` is applied;
        with ``delay = 1`` the previous window's held mean is, and this window's is held."""
        if self.cfg.delay:
            self.advance(model)
            self.receive(mean, window)
        else:
            self.receive(mean, window)
            self.advance(model)

    def _stepped(
        self, name: str, w: torch.Tensor, held: Mapping[str, torch.Tensor] | None
    ) -> torch.Tensor:
        """One tensor of `next_weights`: ``w − α · step(held)``, a copy of ``w`` without a mean;
        a held mean kept elsewhere (a validator's host) comes over one tensor at a time."""
        if held is None:
            return w.detach().clone()
        mean = held[name].to(self.device)
        return w.detach().sub(self._direction(name, mean), alpha=self.cfg.alpha)

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
        """``{"momentum.<tensor>": m}`` under Nesterov once a step was taken, and
        ``{"held.<tensor>": mean}`` while a mean is held; empty otherwise."""
        out = {}
        for prefix, group in ((MOMENTUM, self._momentum), (HELD, self._held)):
            for n, t in (group or {}).items():
                out[f"{prefix}.{n}"] = t.detach().cpu().clone()
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore `state_dict`: each group absent or complete, finite float tensors of the
        model's shapes, and only the groups this run's config can have. ValueError otherwise."""
        allowed = self.shapes()
        got = {k: tuple(v.shape) for k, v in state.items()}
        if any(allowed.get(k) != s for k, s in got.items()):
            raise ValueError(f"outer state {sorted(got)[:3]} does not fit this run's outer step")
        if any(
            not v.is_floating_point() or not bool(torch.isfinite(v).all()) for v in state.values()
        ):
            raise ValueError("outer state must be finite floating tensors")
        self._momentum = self._group(state, MOMENTUM)
        self._held = self._group(state, HELD)

    def _group(
        self, state: Mapping[str, torch.Tensor], prefix: str
    ) -> dict[str, torch.Tensor] | None:
        names = [f"{prefix}.{t.name}" for t in self.spec.tensors]
        present = [n for n in names if n in state]
        if not present:
            return None
        if len(present) != len(names):
            raise ValueError(
                f"outer state {prefix!r} covers {len(present)} of {len(names)} tensors"
            )
        return {
            t.name: state[f"{prefix}.{t.name}"].to(self.device, torch.float32).clone()
            for t in self.spec.tensors
        }

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The names and shapes `state_dict` may hold (what a checkpoint may carry)."""
        out: dict[str, tuple[int, ...]] = {}
        for prefix, used in ((MOMENTUM, self.cfg.optimizer == "nesterov"), (HELD, self.cfg.delay)):
            if used:
                out |= {f"{prefix}.{t.name}": tuple(t.shape) for t in self.spec.tensors}
        return out

    def keep_rows(self, local: ModelSpec) -> None:
        """Keep the state for `local`, a rank's rows of the model's tensors (FSDP2,
        `miner.sharded_weights`), from a fresh start: the outer step is elementwise, so
        `receive`, `next_weights` and the state dicts then work on those rows alone. An outer
        step with state of its own (whole-tensor, e.g. a basis) cannot: ValueError."""
        self.spec, self._momentum, self._held = local, None, None
