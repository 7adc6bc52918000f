"""Training data for a run: the one import the rest of the node needs.

    from node.data.batches import open_run_dataset, assigned_batches, eval_batch

    tokenizer, dataset = open_run_dataset(cfg)                      # cfg: RunConfig
    batches = assigned_batches(dataset, cfg.run_id, uid, window, cfg.inner_steps, cfg.batch_size)
    for batch in batches:                                           # (batch_size, seq_len + 1)
        loss = model.window_loss(batch)
    probe = eval_batch(dataset, cfg.run_id, window, "loss-before-after", 32)

The pieces live in small modules: `node.data.corpus` (embedded text), `node.data.tokenizer` (references,
embedded BPE), `node.data.shards` (format, writer, sources), `node.data.dataset` (slots and split),
`node.data.sampling` (who trains on what), `node.data.prep` (the ``tessera data prep`` command).
"""

from __future__ import annotations

import os

from tokenizers import Tokenizer

from node.data.dataset import DEFAULT_HELDOUT_FRACTION, EMBEDDED_DATASET, Dataset
from node.data.sampling import (
    SlotPermutation,
    assigned_batch,
    assigned_batches,
    assigned_slots,
    eval_batch,
    eval_slots,
)
from node.data.shards import DataError, LocalShardSource, ShardSource, StoreShardSource
from node.data.tokenizer import load_tokenizer
from protocol.runconfig import RunConfig

__all__ = [
    "DEFAULT_HELDOUT_FRACTION",
    "EMBEDDED_DATASET",
    "DataError",
    "Dataset",
    "LocalShardSource",
    "ShardSource",
    "SlotPermutation",
    "StoreShardSource",
    "assigned_batch",
    "assigned_batches",
    "assigned_slots",
    "eval_batch",
    "eval_slots",
    "load_tokenizer",
    "open_run_dataset",
]


def open_run_dataset(
    cfg: RunConfig,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    source: ShardSource | None = None,
) -> tuple[Tokenizer, Dataset]:
    """The tokenizer and dataset of a run, checked against the model's vocabulary size."""
    tokenizer = load_tokenizer(cfg.tokenizer, cache_dir=cache_dir)
    dataset = Dataset.open(cfg.dataset, tokenizer, cfg.seq_len, cache_dir=cache_dir, source=source)
    if cfg.dataset_digest is not None and dataset.index.digest != cfg.dataset_digest:
        raise DataError(
            f"dataset {cfg.dataset} holds other tokens than the run pins: digest "
            f"{dataset.index.digest}, run config {cfg.dataset_digest} (another corpus, tokenizer "
            "or Python build for embedded://; fetch the run's dataset)"
        )
    if dataset.vocab_size > cfg.model.vocab_size:
        raise DataError(
            f"dataset vocabulary ({dataset.vocab_size}) exceeds the model's "
            f"({cfg.model.vocab_size})"
        )
    return tokenizer, dataset
