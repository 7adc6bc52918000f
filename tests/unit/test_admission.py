"""A crowd of hotkeys that holds most of a window's slots at launch (selection is a hash draw
before any weights exist) and uploads tiny or null updates: the lead admits only updates that show
training on their peer's own samples (`validator.admission`), so the crowd neither sets the clip
bound (training would stop) nor the pay reference (honest pay would stop).

Real updates: three peers of the tiny preset trained on their own assignments of window 0, the
crowd's updates through the real compressor; the probe, the outer step and the held-out loss are
the product's. Sets of 7 (4 of them the crowd's) and 8 (5) updates.
"""

from __future__ import annotations

import copy
import hashlib
import math

import numpy as np
import pytest
import torch

from codec.aggregate import update_norm
from codec.compress import SparseTensor
from lab.sim.forgeries import noise_update, zero_update
from node.data.sampling import eval_slots
from node.model.losses import OutOfTime, row_losses
from node.strategy import make_strategy
from protocol.runconfig import RunConfig
from tests.support.honest_updates import HonestWorld
from validator.admission import admit, probe_order
from validator.checks import Verdict
from validator.config import ValidatorConfig
from validator.ratings import Book, WindowOutcome
from validator.reveal import reveal_for
from validator.scoring import LossProbe, LossScore, OwnTest, reference_norm

RUN = RunConfig.preset(
    "tiny",
    name="admission",
    inner_steps=4,
    outer={"total_windows": 10},
    optimizer={"warmup_steps": 4},
)
CFG = ValidatorConfig(n_random=32, n_own=32)
CPU = torch.device("cpu")
HONEST = (0, 1, 2)


class World(HonestWorld):
    def __init__(self) -> None:
        super().__init__(RUN, HONEST)
        self.heldout = self.dataset.read_slots(eval_slots(self.dataset, RUN.run_id, 0, "adm", 32))

    def crowd(self, size: int, kind: str) -> dict[int, list[SparseTensor]]:
        gen = torch.Generator().manual_seed(size)
        if kind == "zero":
            return {100 + i: zero_update(self.spec, RUN) for i in range(size)}
        return {100 + i: noise_update(self.spec, RUN, 1e-9, gen) for i in range(size)}

    def loss_after(self, applied: dict[int, list[SparseTensor]]) -> float:
        """Held-out loss after the window's outer step over `applied`."""
        model = copy.deepcopy(self.model)
        strategy = make_strategy(RUN, self.spec)
        strategy.outer.step(model, strategy.aggregator.mean(applied), 0)
        return float(row_losses(model, self.heldout, RUN.micro_batch_size, CPU).mean())


@pytest.fixture(scope="module")
def world() -> World:
    return World()


def _lead_admits(world: World, updates: dict[int, list[SparseTensor]], key: int) -> set[int]:
    """What the lead applies of `updates` (all selected, all checks passed), at bootstrap: no
    peer has evidence yet, so the consensus direction is every accepted update."""
    secret = hashlib.blake2b(f"admission {key}".encode(), digest_size=32).digest()
    reveal = reveal_for(world.dataset, RUN.run_id, 0, secret, CFG.n_random, CFG.n_own)
    norms = {u: update_norm(x) for u, x in updates.items()}
    probe = LossProbe(world.model, RUN, world.dataset, 0, reveal, updates, norms, CFG, CPU)

    def own_norm(uid: int) -> LossScore:
        return probe.score(uid, updates[uid], norms[uid], norms[uid])

    order = sorted(updates)
    return set(
        admit(
            order,
            own_norm,
            norms,
            set(),
            math.inf,
            CFG.admit_z,
            CFG.admit_min_effect,
            CFG.norm_ratio,
        ).admitted
    )


@pytest.mark.parametrize(("crowd", "kind"), [(4, "tiny"), (5, "tiny"), (4, "zero")])
def test_a_bootstrap_crowd_neither_stops_nor_slows_training(
    world: World, crowd: int, kind: str
) -> None:
    start = float(row_losses(world.model, world.heldout, RUN.micro_batch_size, CPU).mean())
    honest_only = world.loss_after(world.updates)
    assert honest_only < start - 0.2  # one honest step is large at launch
    updates = {**world.updates, **world.crowd(crowd, kind)}
    if kind == "tiny":  # applied as it is, the crowd sets the clip bound: training stops
        assert world.loss_after(updates) > start - 0.02 * (start - honest_only)
    for key in (1, 2):
        admitted = _lead_admits(world, updates, key)
        assert admitted & set(HONEST), admitted
        assert world.loss_after({u: updates[u] for u in admitted}) <= 1.02 * honest_only


def test_the_pay_reference_is_the_applied_set_while_nobody_has_evidence() -> None:
    """Honest peers scored about 0.01 with a launch's own-data statistic (2.4: no consensus
    covariate yet), a crowd of four at 0 (tiny updates move nothing). With the crowd in the
    window's reference ``m`` (its median, 0), the honest scores would not count until their pooled
    evidence earns; with the applied set as the reference, they count from the first window, and
    the crowd earns nothing."""
    book = Book(ValidatorConfig())
    rng = np.random.default_rng(3)
    for _ in range(6):
        outcomes = {
            u: WindowOutcome(
                hotkey=f"h{u}", verdict=Verdict.OK, in_sync=True,
                score=0.01 * (1 + 0.05 * rng.standard_normal()), own_z=2.4,
                own_effect=1.0 + 0.1 * rng.standard_normal(), applied=True,
            )
            for u in HONEST
        }  # fmt: skip
        for u in range(100, 104):
            outcomes[u] = WindowOutcome(
                hotkey=f"c{u}",
                verdict=Verdict.OK,
                in_sync=True,
                score=0.0,
                own_z=0.0,
                own_effect=0.0,
            )
        book.update(outcomes)
    assert all(book.records[u].gain_windows == 6 for u in HONEST)
    final = book.final_scores()
    assert all(final[u] > 0 for u in HONEST)
    assert all(final[u] == 0 for u in range(100, 104))


def test_a_peer_with_evidence_is_applied_when_the_lead_ran_out_of_time() -> None:
    """Unscored (the lead's time for evidence ran out): applied only when its peer's evidence
    already earns; and the admitted set's norm outliers are refused."""

    def never(uid: int) -> None:
        raise AssertionError("nothing is scored past the deadline")

    norms = {1: 1.0, 2: 1.1, 3: 0.9, 4: 50.0, 5: 1.0}
    got = admit([1, 2, 3, 4, 5], never, norms, {1, 2, 3, 4}, -math.inf, 1.5, 1e-5, 10.0)
    assert got.admitted == {1, 2, 3}
    assert "no own-data evidence" in got.refused[5] and "median" in got.refused[4]
    assert reference_norm({u: norms[u] for u in got.admitted}) == 1.0


def _shown(z: float, effect: float) -> LossScore:
    return LossScore(
        loss_before_random=8.0, loss_after_random=8.0, loss_before_own=8.0, loss_after_own=8.0,
        n_random=32, n_own=32, norm=1.0, target_norm=1.0, norm_band=2.0,
        own=OwnTest(z, effect, effect / z, "welch"), z_pass=2.0,
    )  # fmt: skip


def test_an_effect_within_float_rounding_is_no_evidence() -> None:
    """An update of norm 1e-9 moves the loss by rounding only (effects of 1e-8 in
    `tessera sim`), and rounding patterns can give any statistic: it is refused however large
    its z; a real effect with the same z is applied."""
    shown = {1: _shown(3.0, 1e-8), 2: _shown(3.0, 3e-3), 3: _shown(1.0, 3e-3)}
    norms = dict.fromkeys(shown, 1.0)
    got = admit([1, 2, 3], shown.get, norms, set(), math.inf, 1.5, 1e-5, 10.0)
    assert got.admitted == {2}
    assert "effect" in got.refused[1] and "z 1.00" in got.refused[3]


def test_a_probe_past_the_leads_time_stops_before_its_next_forward_pass(world: World) -> None:
    """The lead's probes end when its time to publish begins: a probe still running then is
    stopped before its next forward pass (whatever the machine's load made it take), the model
    is restored bit for bit, and nothing of it is kept, so the same probe later scores in full."""
    secret = hashlib.blake2b(b"admission stop", digest_size=32).digest()
    reveal = reveal_for(world.dataset, RUN.run_id, 0, secret, CFG.n_random, CFG.n_own)
    norms = {u: update_norm(x) for u, x in world.updates.items()}
    probe = LossProbe(world.model, RUN, world.dataset, 0, reveal, world.updates, norms, CFG, CPU)
    start = {k: p.detach().clone() for k, p in world.model.named_parameters()}
    uid = HONEST[0]
    asked = 0

    def stop() -> bool:  # the time runs out after two forward passes of the probe
        nonlocal asked
        asked += 1
        return asked > 2

    probe.stop = stop
    with pytest.raises(OutOfTime):
        probe.score(uid, world.updates[uid], norms[uid], norms[uid])
    assert asked == 3  # stopped before the third micro-batch, not after the probe
    for k, p in world.model.named_parameters():
        assert torch.equal(p, start[k]), k
    probe.stop = None
    whole = probe.score(uid, world.updates[uid], norms[uid], norms[uid])
    fresh = LossProbe(world.model, RUN, world.dataset, 0, reveal, world.updates, norms, CFG, CPU)
    again = fresh.score(uid, world.updates[uid], norms[uid], norms[uid])
    assert whole.own.z == again.own.z and whole.loss_after_own == again.loss_after_own


def test_the_lead_probes_newcomers_first_in_the_windows_draw() -> None:
    """Peers without earning evidence first (they need it to be applied at all), each group in an
    order drawn per window; the order of part of a set is the set's order with the rest left out,
    so the passes a validator takes before the gather for the selected peers come in the order
    the lead then probes the ones that passed its checks."""
    selected = list(range(20))
    established = {1, 4, 7, 9}
    order = probe_order("run", 3, selected, established)
    assert sorted(order) == selected
    assert set(order[: len(selected) - len(established)]) == set(selected) - established
    assert order[:16] != sorted(order[:16])  # drawn, not by uid
    passed = [u for u in selected if u % 3]
    assert probe_order("run", 3, passed, established) == [u for u in order if u in passed]
    assert probe_order("run", 4, selected, established) != order  # drawn anew each window
