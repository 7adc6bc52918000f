"""FSDP2: one peer on N ranks with sharded parameters, gradients and AdamW state, for the presets
whose DDP replica does not fit a GPU (`node.runtime.memory` says which).

`ShardedRanks` is `miner.ranks.DistributedRanks` with the model sharded by
`torch.distributed.fsdp.fully_shard`: every decoder layer is one FSDP unit, the root (embeddings,
final norm, LM head; tied weights stay one parameter) another. Parameters become DTensors sharded
on dim 0, so a rank holds 1/N of the fp32 weights, gradients and both AdamW moments; each forward
and backward gathers one layer at a time. The batch split, the sharded compression (each rank
compresses the tensors it owns, `shard_tensors`) and `gather_pieces` are DDP's. What the peer
does with its weights outside the inner steps (the start copy, the pseudo-gradient, the outer
step, the fingerprint, the state file) goes through `miner.sharded_weights.ShardedWeights`.

`miner.multigpu.init_peer_ranks` makes these ranks when ``--sharding`` picks FSDP2
(`node.runtime.memory.pick_sharding`). A single process stays unsharded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from miner.ranks import DistributedRanks

__all__ = ["ShardedRanks", "shard_model"]


class ShardedRanks(DistributedRanks):
    """One rank of a peer whose model is sharded with FSDP2 (see the module docstring)."""

    sharded = True

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        super().__init__(rank, world, device)
        self.mesh = init_device_mesh(device.type, (world,))

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Shard `model` in place (idempotent) and return it: FSDP2 trains the module itself."""
        if not isinstance(next(model.parameters()), DTensor):
            shard_model(model, self.mesh)
        return model


def shard_model(model: torch.nn.Module, mesh: Any) -> None:
    """`fully_shard` each decoder layer, then the root module."""
    for layer in getattr(getattr(model, "model", model), "layers", []):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
