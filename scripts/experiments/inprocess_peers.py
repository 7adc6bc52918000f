"""Honest SparseLoCo peers in one process, for the measurement scripts: each window every peer
loads the shared model, trains its own assignment with the real inner loop and compresses its
pseudo-gradient with its own error feedback (the tiny preset as `tessera sim` runs it)."""

from __future__ import annotations

import torch

from codec.compress import Compressor, SparseTensor
from codec.spec import ModelSpec
from miner.train import make_optimizer, train_window
from node.data.batches import assigned_batches
from node.model.llama import build_model
from protocol.runconfig import RunConfig

Update = list[SparseTensor]


class Peers:
    """Honest peers training from the shared model, one `train_window` per window each."""

    def __init__(self, run: RunConfig, n: int, first_uid: int = 0) -> None:
        self.run, self.uids = run, list(range(first_uid, first_uid + n))
        self.models = [build_model(run.model, run.seed) for _ in self.uids]
        self.opts = [make_optimizer(m, run) for m in self.models]
        spec = ModelSpec.from_module(self.models[0])
        self.comps = [Compressor(spec, run.codec) for _ in self.uids]
        self.spec = spec

    def train(self, glob: torch.nn.Module, dataset: object, window: int) -> dict[int, Update]:
        run, cpu = self.run, torch.device("cpu")
        start = {k: v.detach().clone() for k, v in glob.named_parameters()}
        out = {}
        for uid, m, opt, comp in zip(self.uids, self.models, self.opts, self.comps, strict=True):
            m.load_state_dict(glob.state_dict())
            batches = assigned_batches(
                dataset, run.run_id, uid, window, run.inner_steps, run.batch_size
            )  # type: ignore[arg-type]
            train_window(m, opt, batches, run, window, cpu)
            params = dict(m.named_parameters())
            freeze = window < run.outer.ef_freeze_windows
            out[uid] = [
                comp.compress(
                    t.name, start[t.name] - params[t.name].detach(), run.outer.beta, freeze
                )
                for t in self.spec.tensors
            ]
        return out
