"""GreedyLore as the bench compares it (`tessera bench train` only; no wire of their own):

* `GreedyLoreNow` (``greedylore:select=now``): Algorithm 3 as written, the window's columns chosen
  from the sketches of this window's matrices, both communication phases in-process (the bench
  calls `GreedyLore.sketches` on every replica, averages them and `select`s before encoding);
* `GreedyLoreRandom` (``greedylore:basis=random``): the same error feedback, rank, full rounds and
  bytes, but ``P`` a random orthonormal basis drawn afresh every window (the same on every
  replica): random-subspace low-rank compression, the baseline the paper's claim is about.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch

from node.strategy.greedylore import GreedyLore

DRAWS = "draws"


class GreedyLoreNow(GreedyLore):
    """Algorithm 3's selection in the same window (bench only)."""

    lagged = False


class GreedyLoreRandom(GreedyLore):
    """A random rank-r basis every window instead of the greedy one (bench only)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._windows = 0

    def projector(self, name: str) -> torch.Tensor:
        m = self.matrices[name][0]
        key = f"{self.run.run_id}|{name}|{self._windows}".encode()
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
        gauss = torch.randn(m, min(self.rank, m), generator=torch.Generator().manual_seed(seed))
        return torch.linalg.qr(gauss.double()).Q.to(torch.float32)

    def receive(self, mean: Mapping[str, torch.Tensor]) -> None:
        super().receive(mean)
        self._windows += 1

    def outer_state_dict(self) -> dict[str, torch.Tensor]:
        return {**super().outer_state_dict(), DRAWS: torch.tensor([float(self._windows)])}

    def load_outer_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        super().load_outer_state_dict({k: v for k, v in state.items() if k != DRAWS})
        self._windows = int(state[DRAWS][0]) if DRAWS in state else 0
