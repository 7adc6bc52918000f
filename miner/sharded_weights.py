"""FSDP2's layout of a peer's weights (`miner.weights`): every rank holds dim-0 shards.

`miner.fsdp.ShardedRanks` shards the model with ``fully_shard``; its parameters are
DTensors and a rank's local tensor is 1/N of the rows. `ShardedWeights` keeps everything else
that is per parameter in that same layout, so memory per GPU stays what `node.runtime.memory`
accounts for:

- the window's start copy and the outer state (Nesterov momentum, the mean held with
  ``outer.delay = 1``) are local shards; the outer step is elementwise (`node.strategy.outer`),
  so it runs shard by shard and gives the same bits as on whole tensors. Strategies whose outer
  state is more than that (`sparseloco-mask`, `greedylore`) are refused;
- the pseudo-gradient of a tensor is ``start − θ`` on the shards, gathered whole on every rank
  one tensor at a time and kept by the rank that compresses it (`shard_tensors`);
- each rank builds its own rows of a window's mean from the updates cut to its band
  (`miner.sharded_mean`): rank 0 decodes, checks and cuts each update once; a format that clips
  whole updates (DiLoCo) is summed on rank 0's host instead, each tensor sent to every rank;
- the fingerprint hashes the whole tensors one at a time as they are gathered;
- the state file holds whole tensors in torch's own optimizer layout, gathered to rank 0's host
  memory: the same ``state.pt`` as a single process or DDP writes, so a peer resumes on any
  number of ranks and in any layout;
- a history replay runs on rank 0 on a whole CPU replica, then is scattered back.

Every method is a collective: all ranks call it in the same order (tensors in spec order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from codec.spec import ModelSpec, TensorSpec
from miner.ranks import Ranks
from miner.sharded_mean import banded_mean
from miner.weights import FullState, Replay, T, Tensors, Weights
from node.model.fingerprint import fingerprint_tensors
from node.model.llama import CausalLM
from node.runtime.state import PeerState
from node.strategy import Strategy
from node.strategy.aggregator import Aggregator
from node.strategy.outer import OuterOptimizer
from node.window.pooled import PooledExchange

__all__ = [
    "ShardedWeights",
    "full_state",
    "full_tensors",
    "gather",
    "load_full",
    "load_state",
    "scatter",
]

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
_FULL_BROADCAST = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


class ShardedWeights(Weights):
    """A peer's weights as FSDP2 shards (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        strategy: Strategy,
        ranks: Ranks,
        spec: ModelSpec,
    ) -> None:
        super().__init__(model, optimizer, strategy, ranks, spec)
        self.params: dict[str, Any] = dict(model.named_parameters())
        strategy.outer.keep_rows(self._local_spec())
        self._aggregator = strategy.aggregator.on("cpu")

    def _local_spec(self) -> ModelSpec:
        shapes = {n: tuple(p.to_local().shape) for n, p in self.params.items()}
        empty = [n for n, s in shapes.items() if 0 in s]
        if empty:
            raise ValueError(
                f"FSDP2 over {self.ranks.world} ranks leaves rank {self.ranks.rank} no rows of "
                f"{empty[:3]}: use fewer ranks or --sharding ddp"
            )
        return ModelSpec(tensors=tuple(TensorSpec(name=n, shape=shapes[n]) for n in self._names()))

    def _names(self) -> list[str]:
        return [t.name for t in self.spec.tensors]

    def _local(self) -> Tensors:
        return {n: self.params[n].to_local() for n in self._names()}

    # -- the window --------------------------------------------------------------------------

    def start(self) -> Tensors:
        return {n: t.detach().clone() for n, t in self._local().items()}

    def deltas(self, start: Mapping[str, torch.Tensor]) -> Tensors:
        owned = {t.name for t in self.strategy.encoder.owned.tensors}
        out = {}
        with torch.no_grad():
            for name, local in self._local().items():
                whole = gather(start[name] - local, self.params[name])
                if name in owned:
                    out[name] = whole
        return out

    @property
    def aggregator(self) -> Aggregator:
        """The strategy's aggregator on the CPU: rank 0's whole mean lives in host memory."""
        return self._aggregator

    def _whole_outer(self) -> OuterOptimizer:
        """The outer step of whole tensors in host memory (the strategies FSDP2 runs keep only
        the elementwise outer state: `OuterOptimizer.keep_rows`)."""
        return OuterOptimizer(self.strategy.outer.run, self.spec)

    def mean(self, agreed: Mapping[int, Any] | None, pooled: PooledExchange | None) -> Tensors:
        """This rank's rows of the window's mean. A chunk-clipped format's: built on this rank
        from the updates cut to its band (`miner.sharded_mean`), no whole tensor anywhere.
        Another's (DiLoCo's whole-update clip; its updates are whole tensors anyway): summed
        on rank 0's host, each tensor sent to every rank in turn, each keeping its rows."""
        if self.strategy.format.clips_chunks:
            rows = banded_mean(
                agreed, self.ranks, self.strategy.outer.run, self.spec, self.aggregator
            )
            local = self._local()
            for n in self._names():  # FSDP2 cuts the first dimension as `shard_rows` says
                if rows[n].shape != local[n].shape:
                    raise RuntimeError(
                        f"{n}: rows {tuple(rows[n].shape)} != shard {local[n].shape}"
                    )
            return {n: rows[n].to(self.params[n].device) for n in self._names()}
        mean = self._whole_mean(agreed, pooled)
        out = {}
        for name in self._names():
            out[name] = scatter(mean.pop(name) if mean is not None else None, self.params[name])
        return out

    def move(self, new: Mapping[str, torch.Tensor], old: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, local in self._local().items():
                local.add_(new[name] - old[name])

    def advance(self, start: Mapping[str, torch.Tensor] | None = None) -> None:
        local = self._local()
        new = self.strategy.outer.next_weights(local if start is None else start)
        with torch.no_grad():
            for name, t in local.items():
                t.copy_(new[name])

    def fingerprint(self) -> str:
        state = sorted(self.model.state_dict().items())
        whole: Iterator[tuple[str, torch.Tensor]] = ((n, _whole(v.detach())) for n, v in state)
        if not self.ranks.is_main:
            for _ in whole:  # the other ranks take part in every gather
                pass
            return ""
        return fingerprint_tensors(whole, sum(v.numel() for _, v in state))

    # -- the state file ----------------------------------------------------------------------

    def state(self) -> FullState | None:
        model, optimizer = full_state(self.model, self.optimizer)
        outer = self._gather_outer()
        if not self.ranks.is_main:
            return None
        return FullState(model, by_index(optimizer), outer)

    def read(self, load: Callable[[], PeerState | None]) -> PeerState | None:
        """Rank 0 reads the file; the other ranks get all of it but the whole tensors."""
        state = load() if self.ranks.is_main else None
        shared = self.ranks.broadcast_object(None if state is None else state.without_weights())
        return state if self.ranks.is_main else shared

    def load(self, state: PeerState) -> None:
        """Rank 0's `state` into every rank's shards. Rank 0 checks it first: an error there
        ends the torchrun group."""
        main = self.ranks.is_main
        if main:  # the whole-tensor check of the outer state (ValueError if it does not fit)
            self._whole_outer().load_state_dict(state.outer)
        optimizer = by_name(state.optimizer, self.optimizer, self.model) if main else None
        load_state(self.model, self.optimizer, state.model if main else None, optimizer)
        self._scatter_outer(state.outer if main else None)

    def _gather_outer(self) -> Tensors:
        out = {}
        for key, local in sorted(self.strategy.outer.state_dict().items()):
            p = self.params[_tensor_of(key)]
            whole = gather(local.to(p.device), p)
            if self.ranks.is_main:
                out[key] = whole.cpu()
        return out

    def _scatter_outer(self, whole: Mapping[str, torch.Tensor] | None) -> None:
        keys = self.ranks.broadcast_object(sorted(whole) if whole is not None else None)
        self.strategy.outer.load_state_dict({
            k: scatter(whole[k] if whole is not None else None, self.params[_tensor_of(k)])
            for k in keys
        })  # fmt: skip

    # -- history replay ----------------------------------------------------------------------

    def replay(self, fn: Replay[T]) -> T:
        """``fn`` on rank 0 on a whole CPU replica of the model and outer state (host memory:
        the weights and outer state once more), then scattered back to every rank."""
        main = self.ranks.is_main
        weights = full_tensors(self.model, keep=lambda _: main)
        outer = self._gather_outer()
        result = None
        if main:
            with torch.device("meta"):
                replica = CausalLM(self.strategy.outer.run.model)
            replica.to_empty(device="cpu")
            replica.tie_weights()
            with torch.no_grad():
                for name, p in replica.named_parameters():
                    p.copy_(weights[name])
            whole = self._whole_outer()
            whole.load_state_dict(outer)
            result = fn(replica, self.aggregator, whole)
            weights = {n: p.detach() for n, p in replica.named_parameters()}
            outer = whole.state_dict()
        load_full(self.model, weights if main else None)
        self._scatter_outer(outer if main else None)
        return self.ranks.broadcast_object(result)


# -- whole tensors from shards and back ---------------------------------------------------------


def _tensor_of(outer_key: str) -> str:
    """The parameter of an outer-state key (``momentum.<name>``, ``held.<name>``)."""
    return outer_key.split(".", 1)[1]


def _whole(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p


def gather(local: torch.Tensor, like: DTensor) -> torch.Tensor:
    """The whole tensor whose rows on this rank are `local`, laid out as `like` (collective)."""
    shard = DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
        stride=like.stride(),
    )  # fmt: skip
    return shard.full_tensor()


def scatter(whole: torch.Tensor | None, like: DTensor) -> torch.Tensor:
    """This rank's rows of rank 0's `whole` (None on the other ranks), laid out as `like`."""
    if whole is not None:
        value = whole.to(device=like.device, dtype=like.dtype, copy=True)
    else:
        value = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    dist.broadcast(value, src=0)
    shard = distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)
    return shard.to_local().clone()


def full_tensors(
    model: torch.nn.Module, keep: Callable[[str], bool] = lambda name: True
) -> dict[str, torch.Tensor]:
    """Every parameter's whole value (collective), on the CPU for the names `keep` accepts."""
    out = {}
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            value = _whole(p.detach())
            if keep(name):
                out[name] = value.to("cpu", copy=True)
            del value
    return out


def load_full(model: torch.nn.Module, full: Mapping[str, torch.Tensor] | None) -> None:
    """Set every (sharded) parameter from rank 0's `full` values (collective; others pass None)."""
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            shard = cast(DTensor, p)  # FSDP2 made every parameter a DTensor
            shard.to_local().copy_(scatter(full[name] if full is not None else None, shard))


def full_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The model's and the optimizer's whole state dicts on the CPU (collective; the
    optimizer's keyed by parameter name)."""
    return (
        cast(dict[str, torch.Tensor], get_model_state_dict(model, options=_FULL)),
        cast(dict[str, Any], get_optimizer_state_dict(model, optimizer, options=_FULL)),
    )


def load_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: Mapping[str, torch.Tensor] | None,
    optimizer_state: Mapping[str, Any] | None,
) -> None:
    """Rank 0's whole state dicts into every rank's shards (collective; others pass None)."""
    set_model_state_dict(model, dict(model_state or {}), options=_FULL_BROADCAST)
    set_optimizer_state_dict(model, optimizer, dict(optimizer_state or {}), options=_FULL_BROADCAST)


def by_index(named: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name (`full_state`) in torch's own layout,
    parameters numbered in param-group order (what ``optimizer.state_dict()`` gives)."""
    order = [n for group in named["param_groups"] for n in group["params"]]
    index = {n: i for i, n in enumerate(order)}
    return {
        "state": {index[n]: s for n, s in named["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                         for g in named["param_groups"]],
    }  # fmt: skip


def by_name(
    state: Mapping[str, Any], optimizer: torch.optim.Optimizer, model: torch.nn.Module
) -> dict[str, Any]:
    """`by_index` undone for `optimizer`, whose parameters are `model`'s."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {
        "state": {order[i]: s for i, s in state["state"].items()},
        "param_groups": [{**g, "params": [order[i] for i in g["params"]]}
                         for g in state["param_groups"]],
    }  # fmt: skip
