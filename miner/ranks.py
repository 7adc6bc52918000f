"""The ranks of one peer on every device of a box: `torchrun --nproc_per_node N -m commands.cli miner …`.

Under `torchrun` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` in the environment) the N processes
form ONE peer: one uid, one upload per window, one bucket. `init_ranks` joins the process group
(NCCL on CUDA, gloo on CPU), pins each process to ``cuda:LOCAL_RANK`` and seeds every rank
identically; `Ranks` is what `miner.peer.Peer` asks at the few points where ranks differ:

- inner steps: the model is wrapped in DDP (`wrap`) and every inner step's batch is split into
  N contiguous, equal row slices (`local_rows`), so the gradient DDP averages is the 1-device
  batch gradient (same math, another summation order);
- encoding: each rank keeps the strategy's local state (SparseLoCo's error feedback) and encodes
  only its share of the tensors (`shard_of`, balanced by element count, deterministic);
- `gather_pieces` brings the encoded shares to rank 0, which alone encodes, signs, uploads,
  fetches and decodes the other peers' updates and aggregates them; `broadcast_aggregate` sends
  the dense mean to every rank so they all take the identical outer step;
- rank 0 alone publishes the fingerprint and writes ``state.pt``; every other rank saves its EF
  shard next to it (`node.runtime.state.save_ef_shard`).

Without ``torchrun`` (or with ``WORLD_SIZE=1``) `Ranks` itself is the single-process no-op.

DDP keeps every GPU a whole replica: the fp32 weights, gradients, both AdamW moments and the
window's start copy (20 B/param) plus this rank's EF shard; what that costs per preset, and when
FSDP2 (`miner.fsdp`: the same peer with everything per parameter sharded) is needed, is
`node.runtime.memory`'s accounting (`tessera plan`). Bf16 autocast on CUDA is done by
`miner.train.train_window`.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from codec.compress import SparseGroup, SparseTensor
from codec.dense import DenseTensor
from codec.spec import ModelSpec
from miner.train import InnerResult
from protocol.runconfig import RunConfig

__all__ = ["DistributedRanks", "Ranks", "init_ranks", "shard_tensors"]

log = logging.getLogger(f"tessera.{__name__}")


def shard_tensors(spec: ModelSpec, world: int) -> list[tuple[str, ...]]:
    """Tensor names per rank, balanced by element count; the same on every rank.

    Largest tensors first (ties in spec order), each to the least-loaded rank (ties: lowest
    rank). Each rank's names come back in spec order.
    """
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    order = sorted(range(len(spec.tensors)), key=lambda i: (-spec.tensors[i].numel, i))
    load = [0] * world
    owner = [0] * len(spec.tensors)
    for i in order:
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += spec.tensors[i].numel
    return [
        tuple(t.name for t, o in zip(spec.tensors, owner, strict=True) if o == r)
        for r in range(world)
    ]


class Ranks:
    """The single-process peer: every method is the identity or a no-op."""

    rank = 0
    world = 1
    sharded = False  # FSDP2 (`miner.fsdp.ShardedRanks`): weights are dim-0 shards

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module the inner steps train (DDP across ranks)."""
        return model

    def local_rows(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous slice of an inner step's batch (the union is the batch)."""
        return batch

    def shard_of(self, spec: ModelSpec) -> ModelSpec:
        """The tensors whose error feedback and compression this rank owns."""
        return spec

    def reduce_inner(self, result: InnerResult) -> InnerResult:
        """The whole peer's inner result: mean losses, all tokens, the slowest rank's time."""
        return result

    def gather_pieces(self, local: list[Any], spec: ModelSpec) -> list[Any]:
        """Every rank's encoded tensors on rank 0, in spec order; [] on the other ranks."""
        return local

    def broadcast_aggregate(
        self, mean: dict[str, torch.Tensor] | None, spec: ModelSpec, device: torch.device
    ) -> dict[str, torch.Tensor]:
        """Rank 0's dense aggregate on every rank."""
        if mean is None:
            raise ValueError("a single process must compute the aggregate itself")
        return mean

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's value of a small picklable object, on every rank."""
        return obj

    def scatter_object(self, objs: list[Any] | None) -> Any:
        """Rank 0's ``objs[r]`` on rank ``r`` (picklable; ``objs`` is read on rank 0 only)."""
        if objs is None:
            raise ValueError("a single process must give its own object")
        return objs[0]

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


class DistributedRanks(Ranks):
    """One rank of a peer spread over a `torch.distributed` process group."""

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank, self.world, self.device = rank, world, device

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)  # the model has no buffers

    def local_rows(self, batch: torch.Tensor) -> torch.Tensor:
        rows = batch.shape[0]
        if rows % self.world:
            raise ValueError(f"batch of {rows} rows does not split over {self.world} ranks")
        per = rows // self.world
        return batch[self.rank * per : (self.rank + 1) * per]

    def shard_of(self, spec: ModelSpec) -> ModelSpec:
        mine = set(shard_tensors(spec, self.world)[self.rank])
        return ModelSpec(tensors=tuple(t for t in spec.tensors if t.name in mine))

    def reduce_inner(self, result: InnerResult) -> InnerResult:
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, (result.losses, result.tokens, result.seconds))
        losses = [math.fsum(step) / self.world for step in zip(*(p[0] for p in parts), strict=True)]
        return InnerResult(
            losses=losses, tokens=sum(p[1] for p in parts), seconds=max(p[2] for p in parts)
        )

    def gather_pieces(self, local: list[Any], spec: ModelSpec) -> list[Any]:
        parts: list[Any] = [None] * self.world if self.is_main else []
        dist.gather_object([_to_cpu(s) for s in local], parts if self.is_main else None, dst=0)
        if not self.is_main:
            return []
        position = {t.name: i for i, t in enumerate(spec.tensors)}
        return sorted((s for part in parts for s in part), key=lambda s: position[s.name])

    def broadcast_aggregate(
        self, mean: dict[str, torch.Tensor] | None, spec: ModelSpec, device: torch.device
    ) -> dict[str, torch.Tensor]:
        if mean is None:
            mean = {
                t.name: torch.empty(t.shape, dtype=torch.float32, device=device)
                for t in spec.tensors
            }
        for t in spec.tensors:  # spec order on every rank
            dist.broadcast(mean[t.name], src=0)
        return mean

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def scatter_object(self, objs: list[Any] | None) -> Any:
        out: list[Any] = [None]
        dist.scatter_object_list(out, objs if self.is_main else None, src=0)
        return out[0]

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _to_cpu(piece: Any) -> Any:
    if isinstance(piece, DenseTensor):
        return replace(piece, values=piece.values.cpu())
    if not isinstance(piece, SparseTensor):
        raise TypeError(f"cannot move a {type(piece).__name__} between ranks")
    groups = [SparseGroup(g.idx.cpu(), g.codes.cpu(), g.scales.cpu()) for g in piece.groups]
    return replace(piece, groups=groups, codebook=piece.codebook.cpu())


def init_ranks(device: str, run: RunConfig) -> tuple[Ranks, torch.device]:
    """This process's `Ranks` and device; joins the process group when run under torchrun.

    ``device`` is the --device option: under torchrun any ``cuda`` means ``cuda:LOCAL_RANK``
    (NCCL), anything else the CPU (gloo). Every collective may wait three windows (at least
    30 minutes): the other ranks wait in one while rank 0 waits for the upload deadline.
    """
    torch.manual_seed(run.seed)  # the model init is seeded per tensor; this covers the rest
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Ranks(), torch.device(device)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if torch.device(device).type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
        backend = "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    window_s = run.timing.blocks_per_window * run.timing.block_time_s
    dist.init_process_group(backend, timeout=timedelta(seconds=max(1800.0, 3 * window_s)))
    log.info("rank %d of %d on %s (%s)", rank, world, dev, backend)
    return DistributedRanks(rank, world, dev), dev
