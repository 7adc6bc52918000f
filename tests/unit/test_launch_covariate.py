"""The own-data test at launch, while no two peers have earned: it regresses on the previous
window's outer step too, which a crowd uploading beside the honest peers has no share in.

The attack: a crowd of hotkeys, registered at launch, uploads tiny updates. Without earning peers,
the covariate is the mean direction of the window's accepted updates, the crowd's among them:
their tiny norms set its step's length, its gain is float rounding, the honest own-data
statistic falls to Welch's, towards the admission bar, and the lead may leave honest work out.

Real updates: three peers of the tiny preset train window 0 from the run's seed, the window's
outer step is taken (`OuterOptimizer.step`) and kept, each peer trains window 1 from there; a
crowd of four uploads random updates of norm ~1e-9 through the real compressor. The window-1 probe is the
validator's own (`validator.window_scores.WindowScorer`), with and without the kept step.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from codec.aggregate import update_norm
from codec.compress import SparseTensor
from lab.sim.forgeries import noise_update
from node.strategy import make_strategy
from node.window.gather import Fetched
from protocol.runconfig import RunConfig
from tests.support.honest_updates import HonestWorld, train_update
from validator.checks import Verdict
from validator.classify import PeerCheck
from validator.config import ValidatorConfig
from validator.fetching import Upload
from validator.ratings import Book, PeerRecord
from validator.reveal import reveal_for
from validator.scoring import OwnTest
from validator.window_scores import WindowScorer

RUN = RunConfig.preset(
    "tiny", name="launch-covariate", inner_steps=4, optimizer={"warmup_steps": 4}
)  # fmt: skip
CFG = ValidatorConfig(n_random=32, n_own=32)
CPU = torch.device("cpu")
HONEST = (0, 1, 2)
CROWD = (100, 101, 102, 103)


@dataclass(frozen=True)
class Held:
    """A decoded update as a validator holds it (`node.window.gather`)."""

    tensors: list[SparseTensor]
    header: Any = None
    digest: bytes = b""
    signed_digest: bytes = b""


class Launch:
    """Window 0 stepped, its step kept; window 1's honest and crowd updates, checked OK."""

    def __init__(self) -> None:
        world = HonestWorld(RUN, HONEST)
        self.dataset, spec = world.dataset, world.spec
        self.model = copy.deepcopy(world.model)
        self.strategy = make_strategy(RUN, spec)
        self.strategy.outer.step(self.model, self.strategy.aggregator.mean(world.updates), 0)
        self.step = {
            k: p.detach() - q.detach()
            for (k, p), q in zip(
                world.model.named_parameters(), self.model.parameters(), strict=True
            )
        }
        updates = {u: train_update(RUN, self.dataset, self.model, u, 1) for u in HONEST}
        gen = torch.Generator().manual_seed(11)
        updates |= {u: noise_update(spec, RUN, 1e-9, gen) for u in CROWD}
        self.checks = {u: _ok(u, x) for u, x in updates.items()}

    def own_tests(self, key: int, previous: dict[str, torch.Tensor] | None) -> dict[int, OwnTest]:
        """Every update's own-data test at its own norm, as the lead takes it before deciding."""
        secret = hashlib.blake2b(f"launch {key}".encode(), digest_size=32).digest()
        reveal = reveal_for(self.dataset, RUN.run_id, 1, secret, CFG.n_random, CFG.n_own)
        scorer = WindowScorer(
            self.model, RUN, self.dataset, 1, reveal, self.checks, Book(CFG), CFG, CPU,
            self.strategy.format, previous,
        )  # fmt: skip
        out = {}
        for uid in self.checks:
            score = scorer.own_norm_score(uid)
            assert score is not None
            out[uid] = score.own
        return out


def _ok(uid: int, update: list[SparseTensor]) -> PeerCheck:
    fetched = Fetched(uid, Held(update), "")
    upload = Upload(uid, f"hotkey{uid}", fetched, None)
    return PeerCheck(uid, f"hotkey{uid}", upload, Verdict.OK, "", norm=update_norm(update))


@pytest.fixture(scope="module")
def launch() -> Launch:
    return Launch()


def test_the_previous_step_explains_what_a_crowd_dilutes(launch: Launch) -> None:
    diluted = launch.own_tests(1, None)  # the mean of every accepted update, the crowd's too
    kept = launch.own_tests(1, launch.step)
    # the crowd's tiny norms set the consensus step's length: its gain is float rounding and
    # explains nothing; the previous step explains a share of every honest update's gains
    assert all(kept[u].method == "ancova" for u in launch.checks)
    for uid in HONEST:
        assert kept[uid].z >= CFG.admit_z, (uid, kept[uid], diluted[uid])
        assert kept[uid].se < diluted[uid].se, (uid, kept[uid], diluted[uid])
    mean_kept, mean_diluted = (sum(t[u].z for u in HONEST) / 3 for t in (kept, diluted))
    assert mean_kept > mean_diluted + 1.0, (kept, diluted)
    # the crowd trained nothing on its samples: its statistics stay those of nulls, N(0, 1)
    assert abs(sum(kept[u].z for u in CROWD) / len(CROWD)) < 1.0, kept


def test_once_two_peers_earn_their_consensus_is_the_covariate(launch: Launch) -> None:
    """The kept step serves only until two peers earn: then the earning peers' mean direction
    (leave-one-out for a member) is the one covariate, whatever step the validator still holds."""
    book = Book(CFG)
    for uid in HONEST:  # earning: a pooled own-data statistic at full
        book.records[uid] = PeerRecord(hotkey=f"hotkey{uid}", own_z=[CFG.own_z_full])
    assert book.earning({u: f"hotkey{u}" for u in HONEST}) == set(HONEST)
    secret = hashlib.blake2b(b"launch 3", digest_size=32).digest()
    reveal = reveal_for(launch.dataset, RUN.run_id, 1, secret, CFG.n_random, CFG.n_own)
    scorer = WindowScorer(
        launch.model, RUN, launch.dataset, 1, reveal, launch.checks, book, CFG, CPU,
        launch.strategy.format, launch.step,
    )  # fmt: skip
    assert scorer.probe.members == list(HONEST) and scorer.probe.prev is None
