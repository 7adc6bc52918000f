"""How the peer is laid over this box's ranks: DDP or FSDP2, and the weights layout that goes with it.

`init_peer_ranks` joins the process group (`miner.ranks.init_ranks`) and, under torchrun, picks
DDP or FSDP2 (`miner.fsdp`) by `node.runtime.memory.pick_sharding`; `training_recipe` picks how
the inner loop trades compute for memory on those ranks; `peer_weights` is the weights
accessor of those ranks: whole tensors (`miner.weights.Weights`) or dim-0 shards
(`miner.sharded_weights.ShardedWeights`).
"""

from __future__ import annotations

import logging

import torch

from codec.spec import ModelSpec
from miner.ranks import DistributedRanks, Ranks, init_ranks
from miner.weights import Weights
from node.runtime.memory import PLAIN, MemoryOptions, Sharding, pick_recipe, pick_sharding
from node.strategy import Strategy
from protocol.runconfig import RunConfig

__all__ = ["init_peer_ranks", "peer_weights", "training_recipe"]

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


def training_recipe(
    run: RunConfig,
    ranks: Ranks,
    device: torch.device,
    checkpoint_layers: bool | None,
    loss_chunk_tokens: int | None,
) -> MemoryOptions:
    """The operator's recipe where either option is given; otherwise, on a GPU, the fastest one
    whose memory plan fits it (`node.runtime.memory.pick_recipe`), and on the CPU activations
    kept."""
    if checkpoint_layers is not None or loss_chunk_tokens is not None:
        return MemoryOptions(bool(checkpoint_layers), loss_chunk_tokens or 0)
    if device.type != "cuda":
        return PLAIN
    memory = torch.cuda.get_device_properties(device).total_memory
    picked = pick_recipe(run, ranks.world, "fsdp2" if ranks.sharded else "ddp", memory)
    if ranks.is_main:
        log.info("training recipe: %s (the fastest the memory plan fits)", picked.describe())
    return picked
