"""The peer's side of a strategy: its pseudo-gradients folded into private state and compressed.

One `Encoder` per peer process (`node.strategy.make_strategy`), for the tensors it encodes
(``owned``: a rank's shard on a multi-device peer, all of them by default). `encode` turns each
tensor's pseudo-gradient, folded into the strategy's local state (SparseLoCo's error feedback),
into the piece to send; what was sent is spent, in the applied set or not
(`node.strategy.sparseloco`). `local_state_dict` and `load_local_state_dict` save and restore
that state with the peer's. Only peers encode: validators and history replay never build one's
state (it is allocated on first use).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import torch

from codec.spec import ModelSpec
from protocol.runconfig import RunConfig


class Encoder(ABC):
    """The pseudo-gradient compression of one run's strategy (see the module docstring)."""

    def __init__(
        self,
        run: RunConfig,
        spec: ModelSpec,
        device: torch.device | str = "cpu",
        owned: ModelSpec | None = None,
    ) -> None:
        self.run, self.spec, self.device = run, spec, torch.device(device)
        self.owned = owned or spec

    @abstractmethod
    def encode(self, deltas: Mapping[str, torch.Tensor], window: int) -> list[Any]:
        """The pieces to send for the owned tensors' pseudo-gradients ``start − θ``, in spec
        order, updating the local state. ``deltas`` must cover exactly the owned tensors."""

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This node's private state (error feedback) by tensor name, tensors in their shapes."""
        return {}

    def load_local_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        if state:
            raise ValueError(f"{self.run.strategy} keeps no local state, got {sorted(state)[:3]}")

    def owned_order(self, deltas: Mapping[str, torch.Tensor]) -> list[str]:
        """The owned tensors' names in spec order (ValueError unless ``deltas`` has them all)."""
        names = [t.name for t in self.owned.tensors]
        if set(deltas) != set(names):
            raise ValueError(f"deltas must cover exactly the {len(names)} owned tensors")
        return names
