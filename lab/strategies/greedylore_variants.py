"""GreedyLore as the bench compares it (`tessera bench train` only; no wire of their own):

* `NowBasis` (``greedylore:select=now``): Algorithm 3 as written, the window's columns chosen
  from the sketches of this window's matrices, both communication phases in-process (the bench
  calls `LowRankEncoder.sketches` on every replica, averages them and `select`s before encoding);
* `RandomBasis` (``greedylore:basis=random``): the same error feedback, rank, full rounds and
  bytes, but ``P`` a random orthonormal basis drawn afresh every window (the same on every
  replica): random-subspace low-rank compression, the baseline the paper's claim is about.

`greedylore_variant` makes GreedyLore's parts around either basis.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

from codec.spec import ModelSpec
from node.strategy.base import Strategy
from node.strategy.greedylore import LowRankBasis, make_greedylore
from protocol.runconfig import RunConfig

DRAWS = "draws"


class NowBasis(LowRankBasis):
    """Algorithm 3's selection in the same window (bench only)."""

    lagged = False


class RandomBasis(LowRankBasis):
    """A random rank-r basis every window instead of the greedy one (bench only)."""

    def __init__(self, run: RunConfig, spec: ModelSpec) -> None:
        super().__init__(run, spec)
        self._windows = 0

    def projector(self, name: str) -> torch.Tensor:
        m = self.matrices[name][0]
        key = f"{self.run.run_id}|{name}|{self._windows}".encode()
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
        gauss = torch.randn(m, min(self.rank, m), generator=torch.Generator().manual_seed(seed))
        return torch.linalg.qr(gauss.double()).Q.to(torch.float32)

    def commit(self) -> None:
        super().commit()
        self._windows += 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**super().state_dict(), DRAWS: torch.tensor([float(self._windows)])}

    def load_state_dict(self, mine: Mapping[str, torch.Tensor]) -> None:
        super().load_state_dict({k: v for k, v in mine.items() if k != DRAWS})
        self._windows = int(mine[DRAWS][0]) if DRAWS in mine else 0

    def is_state(self, key: str) -> bool:
        return key == DRAWS or super().is_state(key)


def greedylore_variant(run: RunConfig, spec: ModelSpec, basis: type[LowRankBasis]) -> Strategy:
    """GreedyLore's parts around a bench variant's ``basis`` (`NowBasis`, `RandomBasis`)."""
    return make_greedylore(run, spec, "cpu", None, basis(run, spec))
