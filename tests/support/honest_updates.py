"""Real honest updates for tests: peers of the tiny preset train on their own assignment of a
window from the same start and compress with the real compressor (error feedback frozen)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from codec.compress import Compressor, SparseTensor
from codec.spec import ModelSpec
from miner.train import make_optimizer, train_window
from node.data.batches import assigned_batches, open_run_dataset
from node.data.dataset import Dataset
from node.model.llama import build_model
from protocol.runconfig import RunConfig


class HonestWorld:
    """A run's dataset and start model, and the real updates of peers `uids` for `window`."""

    def __init__(self, run: RunConfig, uids: Iterable[int], window: int = 0) -> None:
        torch.manual_seed(0)
        _, self.dataset = open_run_dataset(run)
        self.model = build_model(run.model, run.seed)
        self.spec = ModelSpec.from_module(self.model)
        self.updates = {u: train_update(run, self.dataset, self.model, u, window) for u in uids}


def train_update(
    run: RunConfig, dataset: Dataset, start: torch.nn.Module, uid: int, window: int
) -> list[SparseTensor]:
    """Peer `uid`'s compressed pseudo-gradient of `window`, trained from `start`'s weights."""
    batches = assigned_batches(dataset, run.run_id, uid, window, run.inner_steps, run.batch_size)
    return train_on(run, start, batches, window)


def train_on(
    run: RunConfig, start: torch.nn.Module, batches: Iterable[torch.Tensor], window: int
) -> list[SparseTensor]:
    """The compressed pseudo-gradient of training `start`'s weights on `batches`."""
    peer = build_model(run.model, run.seed)
    peer.load_state_dict(start.state_dict())
    opt = make_optimizer(peer, run)
    train_window(peer, opt, batches, run, window, torch.device("cpu"))
    spec = ModelSpec.from_module(start)
    comp = Compressor(spec, run.codec)
    before, after = dict(start.named_parameters()), dict(peer.named_parameters())
    return [
        comp.compress(t.name, (before[t.name] - after[t.name]).detach(), run.outer.beta, True)
        for t in spec.tensors
    ]
