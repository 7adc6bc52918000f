"""The simulation's held-out curves: the validator's synchronised model and a DDP line.

* **Synchronised model** (`synced_losses`): the validator's published history (its aggregates and
  checkpoints) replayed window by window through the real catch-up code (`node.window.history`),
  scored after each window on a fixed set of held-out samples (its loss, and how far it has
  learnt a ``backdoor`` adversary's trigger: `lab.sim.backdoor`). These are the weights every
  honest peer holds at the start of the next window.
* **DDP** (`ddp_losses`): `tessera bench train`'s every-step all-reduce (`lab.bench.train`):
  each inner step on the union of the honest peers' batches of that step, with the run's
  schedule, scored on the same held-out samples after every window.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from typing import NamedTuple

import torch

from codec.spec import ModelSpec
from lab.bench.train.engine import Setup, heldout_loss, heldout_set, run_ddp
from lab.bench.train.specs import MethodSpec
from lab.sim.backdoor import trigger_probability
from lab.sim.layout import World
from node.data.batches import open_run_dataset
from node.model.llama import build_model
from node.strategy import make_strategy
from node.window.history import Source, catch_up_any
from protocol.stores import open_store

log = logging.getLogger(f"tessera.{__name__}")
HELDOUT_SAMPLES = 128
BASELINE_NICE = 10
"""The DDP baseline's niceness (`_background`)."""


def _heldout(world: World) -> torch.Tensor:
    _, dataset = open_run_dataset(world.run)
    return heldout_set(dataset, world.run.run_id, HELDOUT_SAMPLES)


class BaselineInBackground:
    """`ddp_losses` over the run's planned windows, trained while the simulation runs: in a
    process of low priority on one thread, so that it takes little of the CPU the members need
    and the report is ready soon after the run ends. A window past the plan (a member that
    started late) has it trained again, whole, once the run is over."""

    def __init__(self, world: World, windows: int) -> None:
        self.world = world
        context = multiprocessing.get_context("spawn")  # no fork of a process with threads
        self._pool = ProcessPoolExecutor(1, mp_context=context, initializer=_background)
        self._planned = self._pool.submit(ddp_losses, world, list(range(windows)))

    def losses(self, windows: list[int]) -> dict[int, float]:
        """The baseline's held-out loss after each of `windows`."""
        planned = self._planned.result()
        if any(w not in planned for w in windows):
            planned = ddp_losses(self.world, windows)
        return {w: planned[w] for w in windows}

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)


def _background() -> None:
    """The baseline's process: one thread, as every member of the run, at nice 10. Beside the
    members (each at full weight) it takes about a ninth of what one of them does; at nice 19
    it took nothing from two busy processes at normal priority, so a loaded machine's run
    waited for its baseline until the test's time ran out."""
    os.nice(BASELINE_NICE)
    torch.set_num_threads(1)


def ddp_losses(world: World, windows: list[int]) -> dict[int, float]:
    """Held-out loss of DDP over the honest peers' tokens after each of `windows` (0, 1, ...)."""
    run = world.run
    _, dataset = open_run_dataset(run)
    uids = tuple(m.uid for m in world.of_kind("honest"))
    n = max(windows, default=-1) + 1
    setup = Setup(run, dataset, uids, n, _heldout(world), run.run_id)

    def tick(w: int, loss: float) -> None:
        log.info("DDP baseline: window %d/%d held-out loss %.4f", w + 1, n, loss)

    curve = run_ddp(MethodSpec("ddp", "DDP", {}, run), setup, tick)
    return {w: loss for w, loss in enumerate(curve.loss) if w in windows}


class HeldOut(NamedTuple):
    """A model scored on the held-out samples."""

    loss: float
    trigger: float  # the probability of the backdoor's target after its trigger


def synced_losses(world: World, windows: list[int]) -> dict[int, HeldOut]:
    """The validators' model after each window they published (replayed from their histories,
    the lead's first, as a joining peer does), scored on the held-out samples."""
    run = world.run
    sources = [Source(v.uid, v.hotkey, open_store(v.store_url)) for v in world.of_kind("validator")]
    model = build_model(run.model, run.seed)
    strategy = make_strategy(run, ModelSpec.from_module(model))
    heldout, out = _heldout(world), {}
    for w in sorted(windows):
        if catch_up_any(model, strategy.aggregator, strategy.outer, sources, w, w + 1) != w + 1:
            log.warning("no validator's history replays window %d", w)
            break  # later windows cannot be replayed either
        out[w] = HeldOut(heldout_loss(model, heldout), trigger_probability(model, heldout))
    return out
