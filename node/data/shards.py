"""Pre-tokenized shards: the on-disk dataset format, its writer and where shards come from.

Layout of a dataset folder (or store prefix)::

    index.json            ShardIndex: format, tokenizer ref + sha256, vocab size, eos id, dtype,
                          and per shard: name, token count, sha256 of the .npy file
    shard-000000.npy      1-D numpy array of token ids (uint16 if vocab ≤ 65536, else uint32)
    shard-000001.npy      ...

Documents are tokenized, each followed by the end-of-text token, and concatenated; shards hold
`shard_tokens` tokens each (the last one fewer). The index is written last: a folder without
`index.json` is incomplete and never read.

A `ShardSource` supplies the index bytes and a local path per shard. `LocalShardSource` reads a
folder in place (memory-mapped by `node.data.dataset`); `StoreShardSource` downloads shards from any
`protocol.stores.ReadableStore` into a content-addressed local cache
(`<cache>/shards/<sha256>.npy`), verifying each one's SHA-256 before it is used.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Final, Literal, Protocol
from urllib.parse import urlsplit, urlunsplit

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from tokenizers import Tokenizer

from codec.errors import TesseraError
from node.data.tokenizer import tokenizer_sha256
from node.runtime.atomic_files import atomic_path, write_json_atomic
from node.runtime.cache import cache_root
from protocol.stores import ObjectStore, ReadableStore, StoreError

__all__ = [
    "INDEX_NAME",
    "SHARD_FORMAT",
    "DataError",
    "LocalShardSource",
    "ShardEntry",
    "ShardIndex",
    "ShardSource",
    "ShardWriter",
    "StoreShardSource",
    "file_sha256",
    "split_store_ref",
    "store_source",
    "token_dtype",
    "tokenize_documents",
    "upload_shards",
]

INDEX_NAME = "index.json"
SHARD_FORMAT: Final = "tessera-shards/v1"
MAX_INDEX_BYTES = 64 << 20
_NPY_HEADER_SLACK = 4096
_SHARD_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}\.npy$"
_SHA256 = r"^[0-9a-f]{64}$"


class DataError(TesseraError, ValueError):
    """A dataset, shard or index that is missing, corrupt or inconsistent."""


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ShardEntry(_Strict):
    name: str = Field(pattern=_SHARD_NAME)
    tokens: int = Field(ge=0)
    sha256: str = Field(pattern=_SHA256)


class ShardIndex(_Strict):
    format: Literal["tessera-shards/v1"] = SHARD_FORMAT
    tokenizer: str = Field(min_length=1, max_length=512)
    tokenizer_sha256: str = Field(pattern=_SHA256)
    vocab_size: int = Field(ge=2, le=1 << 32)
    eos_id: int | None = Field(None, ge=0)
    dtype: Literal["uint16", "uint32"]
    shards: tuple[ShardEntry, ...]

    @property
    def total_tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def digest(self) -> str:
        """``sha256:<hex>`` of the tokens: format, tokenizer sha256, vocabulary, eos, dtype and
        every shard's name, size and sha256 (not the tokenizer's reference string). A run config
        pins its dataset by this value (`RunConfig.dataset_digest`)."""
        body = self.model_dump_json(exclude={"tokenizer"}).encode("utf-8")
        return "sha256:" + hashlib.sha256(b"tessera/shards/v1\x00" + body).hexdigest()

    @classmethod
    def parse(cls, raw: bytes) -> ShardIndex:
        """Validate untrusted index bytes (names unique, dtype wide enough for the vocab)."""
        try:
            index = cls.model_validate_json(raw)
        except ValidationError as e:
            raise DataError(f"invalid shard index: {e}") from e
        if len({s.name for s in index.shards}) != len(index.shards):
            raise DataError("shard index lists a shard name twice")
        if index.dtype != token_dtype(index.vocab_size).name:
            raise DataError(f"dtype {index.dtype} does not fit vocab size {index.vocab_size}")
        return index


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits in 16 bits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def tokenize_documents(
    tokenizer: Tokenizer, documents: Iterable[str], eos_id: int | None, batch_docs: int = 256
) -> Iterator[np.ndarray]:
    """Token arrays (int64), one per document, each followed by `eos_id` when it is not None.

    Documents are encoded in batches (`encode_batch` runs on all cores).
    """
    tail = [] if eos_id is None else [eos_id]
    batch: list[str] = []

    def flush() -> Iterator[np.ndarray]:
        for enc in tokenizer.encode_batch(batch, add_special_tokens=False):
            yield np.asarray(enc.ids + tail, dtype=np.int64)
        batch.clear()

    for doc in documents:
        batch.append(doc)
        if len(batch) >= batch_docs:
            yield from flush()
    yield from flush()


class ShardWriter:
    """Packs token arrays into fixed-size `.npy` shards in `out_dir`; `close()` writes the index."""

    def __init__(
        self,
        out_dir: Path,
        *,
        tokenizer_ref: str,
        tokenizer: Tokenizer,
        shard_tokens: int,
        eos_id: int | None,
    ) -> None:
        if shard_tokens < 1:
            raise ValueError("shard_tokens must be positive")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.shard_tokens = shard_tokens
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.dtype = token_dtype(self.vocab_size)
        self._tokenizer_ref = tokenizer_ref
        self._tokenizer_sha = tokenizer_sha256(tokenizer)
        self._eos_id = eos_id
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        self._entries: list[ShardEntry] = []

    @property
    def tokens_written(self) -> int:
        return sum(e.tokens for e in self._entries)

    def add(self, tokens: np.ndarray) -> None:
        """Append one document's tokens; full shards are written as they fill up."""
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            raise DataError("token id outside the tokenizer's vocabulary")
        self._pending.append(tokens.astype(self.dtype, copy=False))
        self._pending_tokens += tokens.size
        while self._pending_tokens >= self.shard_tokens:
            self._write_shard(self._take(self.shard_tokens))

    def _take(self, n: int) -> np.ndarray:
        joined = np.concatenate(self._pending) if self._pending else np.empty(0, self.dtype)
        head, rest = joined[:n], joined[n:]
        self._pending = [rest] if rest.size else []
        self._pending_tokens = int(rest.size)
        return head

    def _write_shard(self, tokens: np.ndarray) -> None:
        name = f"shard-{len(self._entries):06d}.npy"
        dest = self.out_dir / name
        with atomic_path(dest) as tmp, tmp.open("wb") as f:
            np.save(f, np.ascontiguousarray(tokens), allow_pickle=False)
        self._entries.append(
            ShardEntry(name=name, tokens=int(tokens.size), sha256=file_sha256(dest))
        )

    def close(self) -> ShardIndex:
        """Write the last partial shard and then `index.json`; returns the index."""
        if self._pending_tokens:
            self._write_shard(self._take(self._pending_tokens))
        index = ShardIndex(
            tokenizer=self._tokenizer_ref,
            tokenizer_sha256=self._tokenizer_sha,
            vocab_size=self.vocab_size,
            eos_id=self._eos_id,
            dtype=self.dtype.name,
            shards=tuple(self._entries),
        )
        write_json_atomic(self.out_dir / INDEX_NAME, index.model_dump(mode="json"))
        return index


class ShardSource(Protocol):
    """Where a dataset's index and shards come from."""

    @property
    def description(self) -> str: ...

    def read_index(self) -> bytes:
        """The raw bytes of `index.json` (untrusted; parsed by `ShardIndex.parse`)."""
        ...

    def fetch(self, entry: ShardEntry) -> Path:
        """A local path holding exactly the shard `entry` describes."""
        ...


class LocalShardSource:
    """Shards in a local folder, read in place; `verify=True` checks each SHA-256 on first use."""

    def __init__(self, directory: str | os.PathLike[str], *, verify: bool = False) -> None:
        self.directory = Path(directory).expanduser().absolute()
        self.verify = verify
        self._verified: set[str] = set()

    @property
    def description(self) -> str:
        return f"file://{self.directory}"

    def read_index(self) -> bytes:
        path = self.directory / INDEX_NAME
        if not path.is_file():
            raise DataError(
                f"no {INDEX_NAME} in {self.directory}: not a prepared dataset; build it with "
                f"`tessera data prep --out {self.directory}` and its --input, --hf or --recipe "
                "(a run config's header names the command)"
            )
        if path.stat().st_size > MAX_INDEX_BYTES:
            raise DataError(f"{path} is larger than {MAX_INDEX_BYTES} bytes")
        return path.read_bytes()

    def fetch(self, entry: ShardEntry) -> Path:
        path = self.directory / entry.name
        if not path.is_file():
            raise DataError(f"shard {entry.name} missing from {self.directory}")
        if self.verify and entry.name not in self._verified:
            if file_sha256(path) != entry.sha256:
                raise DataError(f"shard {path} does not match the sha256 in the index")
            self._verified.add(entry.name)
        return path


def split_store_ref(ref: str) -> tuple[str, str]:
    """``s3://BUCKET/PREFIX?QUERY`` → (``s3://BUCKET?QUERY``, ``PREFIX``): the store URL (as in
    `protocol.stores.open_store`) and the key prefix of the dataset in it."""
    parts = urlsplit(ref)
    if parts.scheme != "s3" or not parts.netloc:
        raise DataError(f"not an s3://BUCKET/PREFIX dataset reference: {ref!r}")
    return urlunsplit(("s3", parts.netloc, "", parts.query, "")), parts.path.strip("/")


def store_source(ref: str, cache_dir: str | os.PathLike[str] | None = None) -> StoreShardSource:
    """The shards at ``s3://BUCKET/PREFIX?endpoint=…`` (credentials from TESSERA_S3_* or AWS_*)."""
    from protocol.stores import open_store

    store_url, prefix = split_store_ref(ref)
    try:
        store = open_store(store_url)
    except StoreError as exc:
        raise DataError(f"cannot open the dataset bucket of {ref!r}: {exc}") from exc
    return StoreShardSource(store, prefix, cache_dir=cache_dir)


def upload_shards(directory: Path, store: ObjectStore, prefix: str) -> ShardIndex:
    """Copy a prepared shard folder under `prefix` of `store`: every shard (checked against its
    sha256 first), then the index, so readers never see an index without its shards."""
    source = LocalShardSource(directory, verify=True)
    raw = source.read_index()
    index = ShardIndex.parse(raw)
    key = prefix.strip("/")
    for entry in index.shards:
        path = source.fetch(entry)
        store.put(f"{key}/{entry.name}" if key else entry.name, path.read_bytes())
    store.put(f"{key}/{INDEX_NAME}" if key else INDEX_NAME, raw)
    return index


class StoreShardSource:
    """Shards in an object store under `prefix`, downloaded once into a verified local cache."""

    def __init__(
        self,
        store: ReadableStore,
        prefix: str = "",
        *,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.store = store
        self.prefix = prefix.strip("/")
        self.cache = cache_root(cache_dir) / "shards"

    @property
    def description(self) -> str:
        where = f"/{self.prefix}" if self.prefix else ""
        return f"{self.store.location}{where}"

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def read_index(self) -> bytes:

        try:
            return self.store.get(self._key(INDEX_NAME), max_bytes=MAX_INDEX_BYTES)
        except StoreError as exc:
            raise DataError(f"cannot read the index of {self.description}: {exc}") from exc

    def fetch(self, entry: ShardEntry) -> Path:
        dest = self.cache / f"{entry.sha256}.npy"
        if dest.is_file():
            return dest  # content-addressed and verified before it was renamed into place
        max_bytes = entry.tokens * 4 + _NPY_HEADER_SLACK
        with atomic_path(dest) as tmp:
            self.store.get_to_file(self._key(entry.name), tmp, max_bytes=max_bytes)
            if file_sha256(tmp) != entry.sha256:
                raise DataError(f"shard {entry.name} from {self.description} fails its sha256")
        return dest
