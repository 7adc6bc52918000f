"""FSDP2: one peer on N ranks with sharded parameters, gradients and AdamW state, for the presets
whose DDP replica does not fit a GPU (`node.runtime.memory` says which).

`ShardedRanks` is `node.runtime.multigpu.DistributedRanks` with the model sharded by
`torch.distributed.fsdp.fully_shard`: every decoder layer is one FSDP unit, the root (embeddings,
final norm, LM head; tied weights stay one parameter) another. Parameters become DTensors sharded
on dim 0, so a rank holds 1/N of the fp32 weights, gradients and both AdamW moments; each forward
and backward gathers one layer at a time. The batch split, the sharded compression (each rank
compresses the tensors it owns, `shard_tensors`), `gather_pieces` and `broadcast_aggregate` are
DDP's. What the peer does with whole tensors goes through the functions below, all collectives
that every rank calls in the same order:

- `full_tensors(model, keep)`: each parameter's full value, one tensor at a time in name order
  (the transient peak is one full tensor), kept on the CPU where `keep` says (a rank's own tensors
  for compression; everything on rank 0 for the fingerprint and the state file);
- `load_full(model, full)`: rank 0's full values into every rank's shards (the outer step, a
  resync, a restore);
- `full_state(model, optimizer)` / `load_state(model, optimizer, state)`: the model and the
  sharded AdamW state as full CPU state dicts (rank 0 writes them into `state.pt` as today, so a
  peer resumes on any number of ranks after `kill -9`).

The optimizer must be made after `shard_model`, since it holds the DTensor parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from node.runtime.multigpu import DistributedRanks, Ranks, init_ranks
from protocol.runconfig import RunConfig

__all__ = [
    "ShardedRanks",
    "full_state",
    "full_tensors",
    "init_sharded_ranks",
    "load_full",
    "load_state",
    "shard_model",
]

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
_FULL_BROADCAST = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


class ShardedRanks(DistributedRanks):
    """One rank of a peer whose model is sharded with FSDP2 (see the module docstring)."""

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        super().__init__(rank, world, device)
        self.mesh = init_device_mesh(device.type, (world,))

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Shard `model` in place (idempotent) and return it: FSDP2 trains the module itself."""
        if not isinstance(next(model.parameters()), DTensor):
            shard_model(model, self.mesh)
        return model


def init_sharded_ranks(device: str, run: RunConfig) -> tuple[Ranks, torch.device]:
    """`init_ranks`, with FSDP2 ranks under torchrun (a single process stays unsharded)."""
    ranks, dev = init_ranks(device, run)
    if isinstance(ranks, DistributedRanks):
        return ShardedRanks(ranks.rank, ranks.world, dev), dev
    return ranks, dev


def shard_model(model: torch.nn.Module, mesh: Any) -> None:
    """`fully_shard` each decoder layer, then the root module."""
    for layer in getattr(getattr(model, "model", model), "layers", []):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p


def full_tensors(
    model: torch.nn.Module, keep: Callable[[str], bool] = lambda name: True
) -> dict[str, torch.Tensor]:
    """Every parameter's full value (collective), on the CPU for the names `keep` accepts."""
    out = {}
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            value = _full(p.detach())
            if keep(name):
                out[name] = value.to("cpu", copy=True)
            del value
    return out


def load_full(model: torch.nn.Module, full: Mapping[str, torch.Tensor] | None) -> None:
    """Set every (sharded) parameter from rank 0's `full` values (collective; others pass None)."""
    main = dist.get_rank() == 0
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if main and full is not None:
                value = full[name].to(device=p.device, dtype=p.dtype, copy=True)
            else:
                value = torch.empty(p.shape, dtype=p.dtype, device=p.device)
            dist.broadcast(value, src=0)
            shard = distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(shard.to_local())


def full_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The model's and the optimizer's full state dicts on the CPU (collective)."""
    return (
        get_model_state_dict(model, options=_FULL),
        get_optimizer_state_dict(model, optimizer, options=_FULL),
    )


def load_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: Mapping[str, torch.Tensor] | None,
    optimizer_state: Mapping[str, Any] | None,
) -> None:
    """Rank 0's full state dicts into every rank's shards (collective; others pass None)."""
    set_model_state_dict(model, dict(model_state or {}), options=_FULL_BROADCAST)
    set_optimizer_state_dict(model, optimizer, dict(optimizer_state or {}), options=_FULL_BROADCAST)
