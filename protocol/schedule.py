"""The run's two learning-rate schedules, each a pure function of the run config:

* the inner learning rate of each optimizer step: linear warmup to ``optimizer.lr``, then cosine
  decay to ``optimizer.min_lr`` over the run's inner steps (`learning_rate`);
* the outer learning rate of each window (`outer_alpha`): ``outer.alpha``, or, with
  ``outer.alpha_at_peak`` set, ``min(alpha, alpha_at_peak * lr / mean lr of the window's inner
  steps)``. A window's pseudo-gradient grows with the inner learning rate of its steps, so this
  bounds the product of the two rates: while the inner rate is near its peak (just after warmup,
  where a run is moving fastest) the outer step is ``alpha_at_peak``, and it rises back to
  ``alpha`` as the inner rate decays (docs/training.md).

The outer rate is part of the consensus: every node must take the same step. Both schedules are
therefore computed exactly, in rational arithmetic, with the cosine from its Taylor series, and
rounded once to a float: no platform's `libm` enters, so every machine gets the same bits.
"""

from __future__ import annotations

import math
from fractions import Fraction

from protocol.runconfig import RunConfig

__all__ = ["learning_rate", "outer_alpha"]

_PI = Fraction(math.pi)  # the float constant, exactly: the same on every machine
_COS_TERMS = 16  # the series' remainder on [0, pi] is below 1e-19 (pi**32 / 32!)


def _cos_pi(p: Fraction) -> Fraction:
    """cos(pi p) for 0 <= p <= 1, exactly from the series' first terms (error < 1e-19)."""
    y2 = (_PI * p) ** 2
    term = total = Fraction(1)
    for n in range(1, _COS_TERMS):
        term *= -y2 / ((2 * n - 1) * (2 * n))
        total += term
    return total


def _exact_rate(run: RunConfig, step: int) -> Fraction:
    opt = run.optimizer
    lr, min_lr = Fraction(opt.lr), Fraction(opt.min_lr)
    if step < opt.warmup_steps:
        return lr * (step + 1) / opt.warmup_steps
    horizon = max(1, run.total_inner_steps - opt.warmup_steps)
    progress = min(Fraction(1), Fraction(step - opt.warmup_steps, horizon))
    return min_lr + (lr - min_lr) * (1 + _cos_pi(progress)) / 2


def learning_rate(run: RunConfig, step: int) -> float:
    """The inner learning rate of optimizer step ``step`` (counted over the whole run)."""
    return float(_exact_rate(run, step))


def outer_alpha(run: RunConfig, window: int) -> float:
    """The outer learning rate that applies window ``window``'s mean (module docstring)."""
    alpha, at_peak = run.outer.alpha, run.outer.alpha_at_peak
    if at_peak is None:
        return alpha
    h = run.inner_steps
    mean = sum(_exact_rate(run, window * h + i) for i in range(h)) / h
    if mean == 0:  # past a schedule that decays to zero: no step to bound
        return alpha
    return float(min(Fraction(alpha), Fraction(at_peak) * Fraction(run.optimizer.lr) / mean))
