"""How a peer reads and writes its weights (`miner.peer.Peer`): one small interface, two layouts.

`Weights` is the layout of a single process and of DDP: every rank holds whole tensors, so each
method is a plain tensor operation. `miner.sharded_weights.ShardedWeights` is FSDP2's:
each rank holds dim-0 shards and whole tensors exist only transiently. The peer's window flow
calls the same methods either way, every rank in the same order (under FSDP2 they are
collectives):

- `start` — this rank's copy of the window's starting weights (the origin of the pseudo-gradient
  and of the outer step), in the layout `move` and `advance` take;
- `deltas` — ``start − θ`` of the tensors this rank compresses (whole tensors, on the device);
- `aggregator` — the strategy's aggregator (a history replay's), and `mean` — the window's mean
  of rank 0's agreed updates, as this rank holds it for the outer step (under FSDP2 each rank
  builds its own rows, `miner.sharded_mean`);
- `move` / `advance` — the live weights moved by ``new − old``, or set to the outer step's next
  weights from a start;
- `fingerprint` — rank 0's fingerprint of the whole model ("" on the other ranks);
- `state` / `read` / `load` — the model, inner-optimizer and outer state as whole tensors on
  rank 0 (what ``state.pt`` holds, the same file for every layout), and back;
- `replay` — a history replay (`node.window.history`) run by rank 0 on whole weights with an
  aggregator and a whole-state outer step, its result shared with every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from codec.spec import ModelSpec
from miner.ranks import Ranks
from node.model.fingerprint import fingerprint
from node.runtime.state import PeerState
from node.strategy import Strategy
from node.strategy.aggregator import Aggregator
from node.strategy.outer import OuterOptimizer
from node.window.gather import Pieces
from node.window.pooled import PooledExchange

__all__ = ["FullState", "Weights"]

T = TypeVar("T")
Tensors = dict[str, torch.Tensor]
Replay = Callable[[torch.nn.Module, Aggregator, OuterOptimizer], T]


@dataclass
class FullState:
    """What ``state.pt`` holds of the weights: whole tensors, torch's optimizer layout."""

    model: Tensors
    optimizer: dict[str, Any]
    outer: Tensors


class Weights:
    """Whole tensors on every rank: one process, or DDP (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        strategy: Strategy,
        ranks: Ranks,
        spec: ModelSpec,
    ) -> None:
        self.model, self.optimizer, self.strategy = model, optimizer, strategy
        self.ranks, self.spec = ranks, spec

    # -- the window --------------------------------------------------------------------------

    def start(self) -> Tensors:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def deltas(self, start: Mapping[str, torch.Tensor]) -> Tensors:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            owned = self.strategy.encoder.owned.tensors
            return {t.name: start[t.name] - params[t.name] for t in owned}

    @property
    def aggregator(self) -> Aggregator:
        return self.strategy.aggregator

    def mean(self, agreed: Mapping[int, Any] | None, pooled: PooledExchange | None) -> Tensors:
        """The window's mean of rank 0's `agreed` updates (None on the other ranks) on every
        rank: rank 0 sums it, then sends it."""
        mean = self._whole_mean(agreed, pooled)
        return self.ranks.broadcast_aggregate(mean, self.spec, self.strategy.outer.device)

    def _whole_mean(
        self, agreed: Mapping[int, Any] | None, pooled: PooledExchange | None
    ) -> Tensors | None:
        """Rank 0's whole mean of its `agreed` updates (on its decode workers where it has them);
        None on the other ranks."""
        if agreed is None:
            return None
        mean = pooled.mean(agreed, self.aggregator.device) if pooled is not None else None
        return mean if mean is not None else self.aggregator.mean(Pieces(agreed))

    def move(self, new: Mapping[str, torch.Tensor], old: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.add_(new[name] - old[name])

    def advance(self, start: Mapping[str, torch.Tensor] | None = None) -> None:
        self.strategy.outer.advance(self.model, start)

    def fingerprint(self) -> str:
        return fingerprint(self.model) if self.ranks.is_main else ""

    # -- the state file ----------------------------------------------------------------------

    def state(self) -> FullState | None:
        if not self.ranks.is_main:
            return None
        return FullState(
            {k: v.cpu() for k, v in self.model.state_dict().items()},
            self.optimizer.state_dict(),
            self.strategy.outer.state_dict(),
        )

    def read(self, load: Callable[[], PeerState | None]) -> PeerState | None:
        """The saved state as this rank needs it (here: every rank reads the file itself)."""
        return load()

    def load(self, state: PeerState) -> None:
        self.model.load_state_dict(state.model)
        self.optimizer.load_state_dict(state.optimizer)
        self.strategy.outer.load_state_dict(state.outer)

    # -- history replay ----------------------------------------------------------------------

    def replay(self, fn: Replay[T]) -> T:
        """``fn(model, aggregator, outer)`` on rank 0; its result, weights and outer state on every
        rank."""
        step = self.strategy.outer
        result = fn(self.model, self.aggregator, step) if self.ranks.is_main else None
        if self.ranks.world > 1:
            outer = step.state_dict() if self.ranks.is_main else None
            step.load_state_dict(self.ranks.broadcast_object(outer))
            params = {n: p.data for n, p in self.model.named_parameters()}
            self.ranks.broadcast_aggregate(params, self.spec, step.device)  # in place
        return self.ranks.broadcast_object(result)
