"""A tokenized dataset seen as numbered sample slots of `seq_len + 1` tokens.

Slots: within each shard, slot j covers tokens `[j*seq_len, j*seq_len + seq_len + 1)`, so
consecutive slots overlap by one token and every token but a shard's first is a training target
exactly once. Slots never cross shard boundaries; slots are numbered globally in index order.

Split: the last `ceil(heldout_fraction * n_slots)` slots (at least one) form the held-out split,
which `node.data.sampling` never assigns for training; slots `[0, n_train_slots)` are the training
split. Because shards (and the embedded corpus) are in a shuffled document order, the tail is a
fair sample. All this is a pure function of the index, `seq_len` and `heldout_fraction`, which is
what `fingerprint` digests: two nodes with the same fingerprint number every slot alike.

`Dataset.open(ref, tokenizer, seq_len)` accepts ``embedded://tiny-corpus`` (built from
`node.data.corpus` with the given tokenizer on first use and cached as a shard folder), a local folder
(``file:///abs/dir`` or a path) prepared by ``tessera data prep``, token shards in any S3 bucket
(``s3://BUCKET/PREFIX?endpoint=…``, uploaded by ``tessera data upload``; downloaded once into the
verified cache), or any other reference together with an explicit `source`.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import unquote, urlsplit

import numpy as np
import torch
from tokenizers import Tokenizer

from node.data.corpus import CORPUS_NAME, load_corpus
from node.data.shards import (
    DataError,
    LocalShardSource,
    ShardIndex,
    ShardSource,
    ShardWriter,
    store_source,
    tokenize_documents,
)
from node.data.tokenizer import eos_token_id, load_tokenizer, tokenizer_sha256
from node.runtime.atomic_files import atomic_dir
from node.runtime.cache import build_once, cache_root

__all__ = ["DEFAULT_HELDOUT_FRACTION", "EMBEDDED_DATASET", "Dataset", "embedded_dataset_dir"]

EMBEDDED_DATASET = f"embedded://{CORPUS_NAME}"
DEFAULT_HELDOUT_FRACTION = 0.02
_EMBEDDED_SHARD_TOKENS = 1 << 22


def embedded_dataset_dir(
    tokenizer: Tokenizer, tokenizer_ref: str, cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """The embedded corpus tokenized with `tokenizer`, as a cached shard folder (built once)."""
    corpus = load_corpus(cache_dir)
    tok_sha = tokenizer_sha256(tokenizer)
    name = f"{CORPUS_NAME}.{corpus.sha256[:16]}.{tok_sha[:16]}"
    entry = cache_root(cache_dir) / "datasets" / name

    def build(path: Path) -> None:
        eos = eos_token_id(tokenizer)
        with atomic_dir(path) as tmp:
            writer = ShardWriter(
                tmp,
                tokenizer_ref=tokenizer_ref,
                tokenizer=tokenizer,
                shard_tokens=_EMBEDDED_SHARD_TOKENS,
                eos_id=eos,
            )
            for tokens in tokenize_documents(tokenizer, corpus.documents, eos):
                writer.add(tokens)
            writer.close()

    return build_once(entry, build)


def _local_dir(ref: str) -> Path:
    if ref.startswith("file://"):
        parts = urlsplit(ref)
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise DataError(f"file URL must be file:///absolute/path, got {ref!r}")
        return Path(unquote(parts.path))
    return Path(ref).expanduser()


def _is_local_ref(ref: str) -> bool:
    return ref.startswith("file://") or "://" not in ref


class Dataset:
    """Read-only access to a dataset's sample slots (see the module docstring)."""

    def __init__(
        self,
        ref: str,
        index: ShardIndex,
        source: ShardSource,
        seq_len: int,
        heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
    ) -> None:
        if seq_len < 1:
            raise ValueError("seq_len must be positive")
        if not 0.0 <= heldout_fraction < 1.0:
            raise ValueError("heldout_fraction must lie in [0, 1)")
        self.ref = ref
        self.index = index
        self.source = source
        self.seq_len = seq_len
        self.heldout_fraction = heldout_fraction
        per_shard = [max(0, (s.tokens - 1) // seq_len) for s in index.shards]
        self._slot_starts = np.concatenate([[0], np.cumsum(per_shard, dtype=np.int64)])
        self.n_slots = int(self._slot_starts[-1])
        held = math.ceil(heldout_fraction * self.n_slots) if heldout_fraction > 0 else 0
        self.n_heldout_slots = max(held, 1 if heldout_fraction > 0 else 0)
        self.n_train_slots = self.n_slots - self.n_heldout_slots
        if self.n_train_slots < 1:
            raise DataError(
                f"dataset {ref} has {self.n_slots} slots of {seq_len + 1} tokens: "
                "too few for a training split"
            )
        self._arrays: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    @classmethod
    def open(
        cls,
        ref: str,
        tokenizer: Tokenizer | str,
        seq_len: int,
        *,
        heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
        cache_dir: str | os.PathLike[str] | None = None,
        source: ShardSource | None = None,
    ) -> Dataset:
        """Open `ref`; `tokenizer` (object or reference) must be the one that made its shards."""
        if isinstance(tokenizer, str):
            tokenizer_ref, tok = tokenizer, load_tokenizer(tokenizer, cache_dir=cache_dir)
        else:
            tok = tokenizer
            tokenizer_ref = f"sha256:{tokenizer_sha256(tok)}"
        if source is None:
            if ref == EMBEDDED_DATASET:
                source = LocalShardSource(embedded_dataset_dir(tok, tokenizer_ref, cache_dir))
            elif ref.startswith("embedded://"):
                raise DataError(f"unknown embedded dataset {ref!r} (known: {EMBEDDED_DATASET})")
            elif _is_local_ref(ref):
                source = LocalShardSource(_local_dir(ref))
            elif ref.startswith("s3://"):
                source = store_source(ref, cache_dir)
            else:
                raise DataError(
                    f"dataset {ref!r} is neither local nor s3://: pass source= "
                    "(e.g. a StoreShardSource)"
                )
        index = ShardIndex.parse(source.read_index())
        if index.tokenizer_sha256 != tokenizer_sha256(tok):
            raise DataError(
                f"dataset {ref} was tokenized with {index.tokenizer!r} "
                f"(sha256 {index.tokenizer_sha256[:12]}…), not with the given tokenizer"
            )
        return cls(ref, index, source, seq_len, heldout_fraction)

    # -- identity ----------------------------------------------------------------------------

    @property
    def sample_len(self) -> int:
        """Tokens per sample: `seq_len` inputs plus one for the last target."""
        return self.seq_len + 1

    @property
    def vocab_size(self) -> int:
        return self.index.vocab_size

    @property
    def eos_id(self) -> int | None:
        return self.index.eos_id

    @property
    def total_tokens(self) -> int:
        return self.index.total_tokens

    @property
    def fingerprint(self) -> str:
        """32 hex chars identifying the slot layout: index, seq_len and held-out fraction.

        The tokenizer enters by its sha256 only (not by the reference string it was named by).
        """
        h = hashlib.blake2b(b"tessera/dataset/v1\x00", digest_size=16)
        h.update(self.index.model_dump_json(exclude={"tokenizer"}).encode("utf-8"))
        h.update(f"|{self.seq_len}|{self.heldout_fraction!r}".encode("ascii"))
        return h.hexdigest()

    # -- reading -----------------------------------------------------------------------------

    def _array(self, shard: int) -> np.ndarray:
        with self._lock:
            arr = self._arrays.get(shard)
            if arr is not None:
                return arr
            entry = self.index.shards[shard]
            path = self.source.fetch(entry)
            try:
                arr = np.load(path, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError) as e:
                raise DataError(f"cannot read shard {entry.name}: {e}") from e
            if arr.ndim != 1 or arr.dtype.name != self.index.dtype or arr.size != entry.tokens:
                raise DataError(f"shard {entry.name} does not match its index entry")
            self._arrays[shard] = arr
            return arr

    def read_slot(self, slot: int) -> np.ndarray:
        """The `seq_len + 1` tokens of global slot `slot` (int64)."""
        if not 0 <= slot < self.n_slots:
            raise IndexError(f"slot {slot} outside [0, {self.n_slots})")
        shard = int(np.searchsorted(self._slot_starts, slot, side="right")) - 1
        start = (slot - int(self._slot_starts[shard])) * self.seq_len
        tokens = np.asarray(self._array(shard)[start : start + self.sample_len], dtype=np.int64)
        if tokens.size and int(tokens.max()) >= self.vocab_size:
            raise DataError(f"slot {slot} holds a token id outside the vocabulary")
        return tokens

    def read_slots(self, slots: Sequence[int] | np.ndarray) -> torch.Tensor:
        """A LongTensor `(len(slots), seq_len + 1)` of the given global slots, in order."""
        rows = [self.read_slot(int(s)) for s in slots]
        if not rows:
            return torch.empty((0, self.sample_len), dtype=torch.long)
        return torch.from_numpy(np.stack(rows))

    def heldout_slot(self, i: int) -> int:
        """Global slot number of the i-th held-out slot."""
        if not 0 <= i < self.n_heldout_slots:
            raise IndexError(f"held-out slot {i} outside [0, {self.n_heldout_slots})")
        return self.n_train_slots + i

    def is_heldout(self, slot: int) -> bool:
        return slot >= self.n_train_slots

    def __repr__(self) -> str:
        return (
            f"Dataset({self.ref!r}, seq_len={self.seq_len}, slots={self.n_slots} "
            f"(train {self.n_train_slots}, held-out {self.n_heldout_slots}), "
            f"tokens={self.total_tokens})"
        )
