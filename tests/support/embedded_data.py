"""One embedded-data cache per test process, shared by the data, sampling and model tests.

Extracting the embedded corpus takes a few seconds; doing it once per process (in a temporary
cache root, removed at exit) keeps the suite fast without touching the user's ~/.cache.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

from node.data.dataset import Dataset
from node.data.tokenizer import load_tokenizer
from protocol.runconfig import RunConfig

TINY = RunConfig.preset("tiny")


@functools.cache
def shared_cache() -> Path:
    root = Path(tempfile.mkdtemp(prefix="tessera-test-cache-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@functools.cache
def tiny_dataset(seq_len: int = TINY.seq_len) -> Dataset:
    """The tiny preset's embedded dataset, tokenized with its embedded BPE."""
    tokenizer = load_tokenizer(TINY.tokenizer, cache_dir=shared_cache())
    return Dataset.open(TINY.dataset, tokenizer, seq_len, cache_dir=shared_cache())
