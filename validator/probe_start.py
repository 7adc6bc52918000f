"""What a window's probe measures at the window's start, before any update of it is known.

The own-data test (`validator.scoring`) compares losses at the window's start with losses after
each update's step. Half of its forward passes need no update: the losses of the random samples
``R`` and of each selected peer's own samples ``O_i`` at the start, and, while no two peers earn,
their gains under the previous window's outer step (the launch covariate). `ProbeStart` takes
those passes, and the validator runs it while it waits for the window's gather block
(`ProbeStart.prepare`), so the passes between the gather and the lead's manifest are only the
ones each update needs. Whatever is not taken by then is taken when first asked for: every value
is the same pass on the same weights and samples either way, bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from codec.compress import SparseTensor
from codec.spec import ModelSpec
from node.data.dataset import Dataset
from node.model.losses import OutOfTime, row_losses
from node.strategy import make_format
from node.strategy.format import UpdateFormat
from protocol.runconfig import RunConfig
from validator.config import ValidatorConfig
from validator.probe_state import copy_to, probe_keep
from validator.reveal import SampleReveal, own_slots

Update = Sequence[SparseTensor]
Step = Mapping[str, torch.Tensor]


class ProbeStart:
    """The window's start, as the probe reads it: the weights (a copy to restore after each
    probed step), the samples, and their losses and covariate gains, each taken once.

    `fingerprint` names the weights it was taken on: a caller whose model has moved since (a
    resync) takes a new one."""

    def __init__(
        self,
        model: torch.nn.Module,
        run: RunConfig,
        dataset: Dataset,
        window: int,
        reveal: SampleReveal,
        cfg: ValidatorConfig,
        device: torch.device,
        fmt: UpdateFormat | None = None,
        fingerprint: str | None = None,
    ) -> None:
        self.model, self.run, self.dataset, self.window = model, run, dataset, window
        self.reveal, self.cfg, self.device, self.fingerprint = reveal, cfg, device, fingerprint
        self.stop: Callable[[], bool] | None = None  # asked before each forward pass
        self.keep = probe_keep(cfg.probe_state, run, device)  # the copies below live there
        # the validator's own strategy's format: a shared-support one needs the window's support
        self.format = fmt or make_format(run, ModelSpec.from_module(model))
        self.start = {k: copy_to(p, self.keep) for k, p in model.named_parameters()}
        model.eval()
        self.random = dataset.read_slots(np.asarray(reveal.random_slots, dtype=np.int64))
        self._before_random: np.ndarray | None = None
        self.pass_s = 0.0  # how long the random samples' pass took (0: not taken yet)
        self.prev: dict[str, torch.Tensor] | None = None
        self._previous: Step | None = None
        self._prev_random: np.ndarray | None = None
        self._own: dict[int, tuple[tuple[int, ...], torch.Tensor, np.ndarray]] = {}
        self._prev_own: dict[int, np.ndarray | None] = {}

    # -- what it holds -----------------------------------------------------------------------

    def random_losses(self) -> np.ndarray:
        """The random samples' losses at the start."""
        if self._before_random is None:
            begun = time.monotonic()
            self._before_random = self.rows(self.random)
            self.pass_s = time.monotonic() - begun
        return self._before_random

    def use_previous(self, previous: Step | None) -> None:
        """The previous window's outer step (weights before it less weights after) as the launch
        covariate, or none (None)."""
        if previous is self._previous:
            return
        self._previous, self._prev_random, self._prev_own = previous, None, {}
        self.prev = None
        if previous is not None:
            self.prev = {
                k: previous[k].to(device=self.keep, dtype=p.dtype) * self.cfg.score_scale
                for k, p in self.model.named_parameters()
            }

    def prev_random(self) -> np.ndarray | None:
        """The random samples' gains under the previous step (None without one)."""
        if self.prev is not None and self._prev_random is None:
            self._prev_random = self.step_gain(self.prev, self.random_losses(), self.random)
        return self._prev_random

    def own(self, uid: int) -> tuple[tuple[int, ...], torch.Tensor, np.ndarray]:
        """`uid`'s own samples of the window: their slots, the samples, their losses at the
        start."""
        if uid not in self._own:
            slots = own_slots(
                self.dataset, self.run, uid, self.window, self.reveal.seed, self.cfg.n_own
            )
            samples = self.dataset.read_slots(slots)
            self._own[uid] = (tuple(int(s) for s in slots), samples, self.rows(samples))
        return self._own[uid]

    def prev_own(self, uid: int) -> np.ndarray | None:
        """`uid`'s own samples' gains under the previous step (None without one)."""
        if self.prev is None:
            return None
        if uid not in self._prev_own:
            _, samples, before = self.own(uid)
            self._prev_own[uid] = self.step_gain(self.prev, before, samples)
        return self._prev_own[uid]

    def prepare(self, uids: Iterable[int], until: Callable[[], bool]) -> int:
        """Take every start-of-window pass for `uids` (the random samples' first) until `until`
        says stop (before a forward pass); the number of peers done."""
        done = 0
        self.stop = until
        try:
            self.random_losses()
            self.prev_random()
            for uid in uids:
                self.own(uid)
                self.prev_own(uid)
                done += 1
        except OutOfTime:
            pass
        finally:
            self.stop = None
        return done

    # -- forward passes ----------------------------------------------------------------------

    def rows(self, batch: torch.Tensor) -> np.ndarray:
        """Per-sample losses of `batch` at the model's weights."""
        return row_losses(self.model, batch, self.run.micro_batch_size, self.device, stop=self.stop)

    @staticmethod
    def gain(before: np.ndarray, after: np.ndarray) -> np.ndarray:
        return (before - after) / before.mean() if before.size else before

    def step_gain(
        self, step: Step | None, before: np.ndarray, batch: torch.Tensor
    ) -> np.ndarray | None:
        """Per-sample gains of `batch` (losses `before` at the start) under a covariate's `step`
        (None when there is no such step)."""
        return None if step is None else self.gain(before, self.stepped(step, [batch])[0])

    def stepped(
        self, step: Step | Update | None, batches: list[torch.Tensor], factor: float = 1.0
    ) -> list[np.ndarray]:
        """Per-sample losses of `batches` at ``θ - factor * step``, then ``θ`` restored exactly."""
        params = dict(self.model.named_parameters())
        try:
            with torch.no_grad():
                if isinstance(step, Mapping):
                    for name, delta in step.items():
                        params[name].sub_(delta.to(params[name].device))
                elif step is not None:
                    for piece in step:
                        self.format.add_into(params[piece.name].data, piece, -factor)
            return [self.rows(b) for b in batches]
        finally:
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(self.start[name])
