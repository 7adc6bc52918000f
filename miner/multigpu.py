"""How the peer is laid over this box's ranks: DDP or FSDP2, and the weights layout that goes with it.

`init_peer_ranks` joins the process group (`miner.ranks.init_ranks`) and, under torchrun, picks
DDP or FSDP2 (`miner.fsdp`) by `node.runtime.memory.pick_sharding`; `peer_weights` is the weights
accessor of those ranks: whole tensors (`miner.weights.Weights`) or dim-0 shards
(`miner.sharded_weights.ShardedWeights`).
"""

from __future__ import annotations

import logging

import torch

from codec.spec import ModelSpec
from miner.ranks import DistributedRanks, Ranks, init_ranks
from miner.weights import Weights
from node.runtime.memory import Sharding, pick_sharding
from node.strategy import Strategy
from protocol.runconfig import RunConfig

__all__ = ["init_peer_ranks", "peer_weights"]

log = logging.getLogger(f"tessera.{__name__}")


def peer_weights(
    ranks: Ranks,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    strategy: Strategy,
    spec: ModelSpec,
) -> Weights:
    """How the peer reads and writes `model`'s weights on `ranks` (call after `ranks.wrap`)."""
    if not ranks.sharded:
        return Weights(model, optimizer, strategy, ranks, spec)
    from miner.sharded_weights import ShardedWeights  # torch.distributed.checkpoint: only if used

    return ShardedWeights(model, optimizer, strategy, ranks, spec)


def init_peer_ranks(device: str, run: RunConfig, sharding: Sharding) -> tuple[Ranks, torch.device]:
    """`init_ranks`, sharded with FSDP2 (`miner.fsdp`) under torchrun when
    `pick_sharding` says so; a single process stays unsharded."""
    ranks, dev = init_ranks(device, run)
    if not isinstance(ranks, DistributedRanks):
        return ranks, dev
    memory = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else None
    picked = pick_sharding(sharding, run, ranks.world, memory)
    if ranks.is_main:
        log.info("%d ranks: %s (--sharding %s)", ranks.world, picked.upper(), sharding)
    if picked == "ddp":
        return ranks, dev
    from miner.fsdp import ShardedRanks  # imports torch._dynamo (seconds): only if used

    return ShardedRanks(ranks.rank, ranks.world, dev), dev
