"""Pay for work done, once: pay scales with the size of an update's own-data effect relative to
an honest one's (`validator.ratings`), so one training spread over several hotkeys is paid about
once, and training on garbage is not paid like training.

Real updates of the tiny preset, window 0, probed by the validator's `LossProbe` under three
secrets: three honest peers; one training over three hotkeys' assignments (one peer's compute,
batches taken in turn from each) uploaded as three updates of disjoint supports (whole chunks);
a peer that trained on its own batches with the tokens reversed. Each secret's scores feed one
window of a `Book`, cycled over eight windows.
"""

from __future__ import annotations

import hashlib
import itertools

import pytest
import torch

from codec.aggregate import update_norm
from codec.compress import SparseTensor
from lab.sim.forgeries import split_by_chunks
from node.data.batches import assigned_batches, open_run_dataset
from node.data.dataset import Dataset
from node.model.llama import build_model
from protocol.runconfig import RunConfig
from tests.support.honest_updates import train_on, train_update
from validator.checks import Verdict
from validator.config import ValidatorConfig
from validator.ratings import Book, WindowOutcome
from validator.reveal import reveal_for
from validator.scoring import LossProbe, LossScore, reference_norm

RUN = RunConfig.preset(
    "tiny", name="pay", inner_steps=4, outer={"total_windows": 10}, optimizer={"warmup_steps": 4}
)
N = 32
CFG = ValidatorConfig(n_random=N, n_own=N)
HONEST, SPLIT, REVERSED = (0, 1, 2), (4, 5, 6), 11


def _batches(dataset: Dataset, uid: int) -> list[torch.Tensor]:
    return list(assigned_batches(dataset, RUN.run_id, uid, 0, RUN.inner_steps, RUN.batch_size))


@pytest.fixture(scope="module")
def scores() -> list[dict[int, LossScore]]:
    torch.manual_seed(0)
    _, dataset = open_run_dataset(RUN)
    model = build_model(RUN.model, RUN.seed)
    updates: dict[int, list[SparseTensor]] = {
        u: train_update(RUN, dataset, model, u, 0) for u in HONEST
    }
    turns = zip(*(_batches(dataset, u) for u in SPLIT), strict=True)
    mixed = list(itertools.islice(itertools.chain.from_iterable(turns), RUN.inner_steps))
    for uid, piece in zip(
        SPLIT, split_by_chunks(RUN, train_on(RUN, model, mixed, 0), 3), strict=True
    ):
        updates[uid] = piece
    reversed_tokens = [b.flip(1) for b in _batches(dataset, REVERSED)]
    updates[REVERSED] = train_on(RUN, model, reversed_tokens, 0)
    norms = {u: update_norm(x) for u, x in updates.items()}
    target = reference_norm({u: norms[u] for u in HONEST})
    out = []
    for key in range(3):
        secret = hashlib.blake2b(f"pay {key}".encode(), digest_size=32).digest()
        reveal = reveal_for(dataset, RUN.run_id, 0, secret, N, N)
        honest = {u: updates[u] for u in HONEST}
        probe = LossProbe(model, RUN, dataset, 0, reveal, honest, norms, CFG, torch.device("cpu"))
        out.append({u: probe.score(u, x, norms[u], target) for u, x in updates.items()})
    return out


def _pay(scores: list[dict[int, LossScore]], cfg: ValidatorConfig) -> dict[int, float]:
    book = Book(cfg)
    for window in range(8):
        book.update(
            {
                u: WindowOutcome(
                    hotkey=f"hk{u}",
                    verdict=Verdict.OK,
                    in_sync=True,
                    score=s.score,
                    own_z=s.own.z,
                    own_effect=s.own.diff,
                    applied=u in HONEST,
                )
                for u, s in scores[window % len(scores)].items()
            }
        )
    final = book.final_scores()
    honest = sum(final[u] for u in HONEST) / len(HONEST)
    return {u: v / honest for u, v in final.items()}


def test_one_training_over_three_hotkeys_is_paid_about_once(
    scores: list[dict[int, LossScore]],
) -> None:
    pay = _pay(scores, CFG)
    assert all(pay[u] > 0.85 for u in HONEST), pay  # honest work is paid in full
    assert sum(pay[u] for u in SPLIT) <= 1.2 * 1.0, pay
    # the significance ramp alone (every effect counted as full) pays the pieces more than once
    alone = _pay(scores, CFG.model_copy(update={"effect_full": 1e-9}))
    assert sum(alone[u] for u in SPLIT) > 1.2, alone


def test_training_on_reversed_tokens_is_paid_less_than_training(
    scores: list[dict[int, LossScore]],
) -> None:
    pay = _pay(scores, CFG)
    assert pay[REVERSED] < 0.75, pay
