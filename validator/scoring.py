"""LossScore: how much one peer's update helps the validator's current model.

For window ``w`` the validator holds ``θ``, the model at the start of ``w`` (the weights every
peer's update of ``w`` was computed against). For a peer's decoded update ``Δ̂``:

    θ' = θ - η Δ̂,   η = score_scale * α   (0.2 α: a small probe step, in the update's own units)
    s    = (L(θ; R) - L(θ'; R)) / L(θ; R)        R: ``n_random`` random training samples
                                                 (`eval_batch`, split "train", drawn per window,
                                                 the same for every peer)
    own  = (L(θ; O) - L(θ'; O)) / L(θ; O)        O: up to ``n_own`` of the samples assigned to the
                                                 peer for ``w`` (`assigned_slots`, evenly spread)
    indicator = +1 if own > s else -1

``s`` is the score (does the update make the model better on data nobody chose?); the indicator
checks the update was trained on the peer's own assignment: an honest update fits its own data
better than random data, while a copied, stale (replayed from another window) or random update
has no reason to. R comes from the training split, the distribution the peers' own samples come
from: against held-out text (a different slice of the corpus) even a copied update looked better
on "its own" data. ``L`` is `node.model.train.lm_loss`, evaluated without gradients in micro-batches.
The probe runs on a copy of the weights that is restored (bit for bit) after every peer.

How many samples: `scripts/validator_separation.py` measures it. Tiny preset, 3 peers x 4
windows, 64 samples: honest s in [+0.00086, +0.00318] vs noise s in [-0.00010, +0.00005] (12/12
honest above every noise update, margin > 15x); honest indicator +1 in 12/12 (own-random margin
>= +0.0004). A stale (replayed) update still has a positive s and its indicator is +1 in 6/9
(margin -0.00007..+0.00024): at this scale the indicator alone does not catch replays — replay
detection by index overlap does (own previous update: overlap <= 0.34, threshold 0.5).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from codec.compress import SparseTensor, scatter_add
from node.data.dataset import Dataset
from node.data.sampling import assigned_slots, eval_batch
from node.model.train import lm_loss
from protocol.runconfig import RunConfig

RANDOM_PURPOSE = "validator-random"


@dataclass(frozen=True)
class LossScore:
    """Every number that went into one peer's loss score."""

    loss_before_random: float
    loss_after_random: float
    loss_before_own: float
    loss_after_own: float
    n_random: int
    n_own: int

    @property
    def score(self) -> float:
        """Relative improvement on random data (`s`)."""
        return (self.loss_before_random - self.loss_after_random) / self.loss_before_random

    @property
    def own_gain(self) -> float:
        return (self.loss_before_own - self.loss_after_own) / self.loss_before_own

    @property
    def indicator(self) -> int:
        return 1 if self.own_gain > self.score else -1


def mean_loss(
    model: torch.nn.Module, batch: torch.Tensor, micro: int, device: torch.device
) -> float:
    """Mean next-token loss of `batch` (rows weighted equally), without gradients."""
    total, rows = 0.0, 0
    with torch.no_grad():
        for part in batch.split(micro):
            total += float(lm_loss(model, part.to(device))) * part.shape[0]
            rows += part.shape[0]
    return total / rows


def own_batch(dataset: Dataset, run: RunConfig, uid: int, window: int, n: int) -> torch.Tensor:
    """Up to `n` of the samples peer `uid` was assigned in `window`, evenly spread over its steps."""
    m = run.inner_steps * run.batch_size
    slots = assigned_slots(dataset.n_train_slots, run.run_id, uid, window, m)
    pick = np.linspace(0, m - 1, num=min(n, m)).round().astype(np.int64)
    return dataset.read_slots(slots[np.unique(pick)])


def pick_scored(run_id: str, window: int, uids: Sequence[int], limit: int) -> list[int]:
    """The peers scored this window: all of them, or `limit` drawn by a hash of (run, window)."""
    if limit <= 0 or len(uids) <= limit:
        return sorted(uids)

    def draw(uid: int) -> bytes:
        return hashlib.blake2b(f"score/{run_id}/{window}/{uid}".encode(), digest_size=8).digest()

    return sorted(sorted(uids, key=draw)[:limit])


class LossProbe:
    """Scores updates of one window against the model at the start of that window."""

    def __init__(
        self,
        model: torch.nn.Module,
        run: RunConfig,
        dataset: Dataset,
        window: int,
        n_random: int,
        n_own: int,
        scale: float,
        device: torch.device,
    ) -> None:
        self.model, self.run, self.dataset, self.window = model, run, dataset, window
        self.n_own, self.device = n_own, device
        self.step = scale * run.outer.alpha
        n = min(n_random, dataset.n_train_slots)
        self.random = eval_batch(dataset, run.run_id, window, RANDOM_PURPOSE, n, split="train")
        self.start = {k: p.detach().clone() for k, p in model.named_parameters()}
        model.eval()
        self.before_random = self._loss(self.random)

    def _loss(self, batch: torch.Tensor) -> float:
        return mean_loss(self.model, batch, self.run.micro_batch_size, self.device)

    def score(self, uid: int, update: Sequence[SparseTensor]) -> LossScore:
        own = own_batch(self.dataset, self.run, uid, self.window, self.n_own)
        before_own = self._loss(own)
        params = dict(self.model.named_parameters())
        try:
            with torch.no_grad():
                for sparse in update:
                    scatter_add(params[sparse.name].data, sparse, self.run.codec, -self.step)
            after_random, after_own = self._loss(self.random), self._loss(own)
        finally:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(self.start[name])
        return LossScore(
            loss_before_random=self.before_random,
            loss_after_random=after_random,
            loss_before_own=before_own,
            loss_after_own=after_own,
            n_random=int(self.random.shape[0]),
            n_own=int(own.shape[0]),
        )
