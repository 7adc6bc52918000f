"""Training strategies behind one boundary (`node.strategy.base.Strategy`), chosen by
``run.strategy``: ``sparseloco`` (the default), ``diloco``, ``demo``, ``sparseloco-mask`` and
``greedylore``. Peers, validators and history
replay all take the window's outer step through the strategy, so there is exactly one."""

from __future__ import annotations

import torch

from codec.spec import ModelSpec
from node.strategy.base import Strategy
from node.strategy.demo import DeMo
from node.strategy.diloco import DiLoCo
from node.strategy.greedylore import GreedyLore
from node.strategy.mask import SparseLoCoMask
from node.strategy.sparseloco import SparseLoCo
from protocol.runconfig import RunConfig

__all__ = ["STRATEGIES", "Strategy", "make_strategy"]

STRATEGIES: dict[str, type[Strategy]] = {
    "sparseloco": SparseLoCo,
    "diloco": DiLoCo,
    "demo": DeMo,
    "sparseloco-mask": SparseLoCoMask,
    "greedylore": GreedyLore,
}


def make_strategy(
    run: RunConfig,
    spec: ModelSpec,
    device: torch.device | str = "cpu",
    owned: ModelSpec | None = None,
) -> Strategy:
    """The strategy of ``run`` for a model of ``spec`` (``owned``: the tensors this process
    encodes, all by default)."""
    return STRATEGIES[run.strategy](run, spec, device, owned)
