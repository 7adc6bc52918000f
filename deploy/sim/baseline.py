"""The reference the simulation compares against: one process, plain AdamW, the same tokens.

Each inner step of the baseline trains on the union of the honest peers' batches for that step
(what a data-parallel AdamW run over the same peers would see), with the run's schedule. Its
per-window mean loss is directly comparable with the peers' inner losses.
"""

from __future__ import annotations

import torch

from node.data.batches import assigned_batch, open_run_dataset
from node.model.llama import build_model
from node.model.train import make_optimizer, train_window
from node.runtime.progress import tracked
from protocol.runconfig import RunConfig


def adamw_baseline(run: RunConfig, uids: list[int], windows: list[int]) -> dict[int, float]:
    _, dataset = open_run_dataset(run)
    model = build_model(run.model, run.seed)
    optimizer = make_optimizer(model, run)
    out = {}
    for w in tracked(windows, "AdamW baseline"):
        batches = (
            torch.cat([
                assigned_batch(dataset, run.run_id, uid, w, h, n_steps=run.inner_steps, batch_size=run.batch_size)
                for uid in uids
            ])
            for h in range(run.inner_steps)
        )  # fmt: skip
        out[w] = train_window(model, optimizer, batches, run, w, torch.device("cpu")).mean_loss
    return out
