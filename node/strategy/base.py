"""A run's strategy: what a peer sends for its pseudo-gradient, and how a window applies it.

`Strategy` is a plain bundle of four parts (`node.strategy.make_strategy`), chosen by
``run.strategy``, each doing one job in one place:

* `format` (`node.strategy.format`): the wire and one update: pieces to signed bytes and
  untrusted bytes back to pieces, strictly, and what a decoded piece holds (norms, entries);
* `encoder` (`node.strategy.encoder`, peers only): the pseudo-gradient folded into the
  strategy's local state (SparseLoCo's error feedback) and compressed into pieces to send;
* `aggregator` (`node.strategy.aggregator`): the window's validated, median-clipped mean, the
  consensus rule of docs/consensus.md;
* `outer` (`node.strategy.outer`): ``run.outer``'s step on that mean, with its state (Nesterov
  momentum, the mean held with ``outer.delay = 1``, a strategy's own consensus state) saved in
  checkpoints and restored by catch-up.

Every caller takes the part it needs: the gather, fetch and decode path and copy detection the
format; validators and history replay the aggregator and the outer step; a peer all four. The
shared mask and GreedyLore's parts share the consensus state their outer step moves (the
window's support, the basis), so one bundle's parts belong together.
"""

from __future__ import annotations

from dataclasses import dataclass

from node.strategy.aggregator import Aggregator
from node.strategy.encoder import Encoder
from node.strategy.format import UpdateFormat
from node.strategy.outer import OuterOptimizer


@dataclass(frozen=True)
class Strategy:
    """One run's strategy on one node, as its four parts (see the module docstring)."""

    format: UpdateFormat
    encoder: Encoder
    aggregator: Aggregator
    outer: OuterOptimizer
