"""Training strategies, chosen by ``run.strategy``: ``sparseloco`` (the default), ``diloco``,
``demo``, ``sparseloco-mask`` and ``greedylore``. Each is four parts
(`node.strategy.base.Strategy`): its update format, the peer's encoder, the window's aggregator
and the outer step. Peers, validators and history replay all take the window's outer step
through them, so there is exactly one."""

from __future__ import annotations

from collections.abc import Callable

import torch

from codec.spec import ModelSpec
from node.strategy.base import Strategy
from node.strategy.demo import make_demo
from node.strategy.diloco import make_diloco
from node.strategy.format import UpdateFormat
from node.strategy.greedylore import make_greedylore
from node.strategy.mask import make_mask
from node.strategy.sparseloco import make_sparseloco
from protocol.runconfig import RunConfig

__all__ = ["STRATEGIES", "Strategy", "make_format", "make_strategy"]

Build = Callable[[RunConfig, ModelSpec, torch.device | str, ModelSpec | None], Strategy]

STRATEGIES: dict[str, Build] = {
    "sparseloco": make_sparseloco,
    "diloco": make_diloco,
    "demo": make_demo,
    "sparseloco-mask": make_mask,
    "greedylore": make_greedylore,
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


def make_format(run: RunConfig, spec: ModelSpec) -> UpdateFormat:
    """The update format of ``run`` for a model of ``spec``, for reading and writing updates
    (the wire, norms, entries). The shared mask's and GreedyLore's formats read the window's
    consensus state: where that matters, take the format of the node's own strategy."""
    return make_strategy(run, spec).format
