"""Prepare pre-tokenized training shards from text documents (`tessera data prep`).

`prepare_shards` reads text documents, tokenizes them (all cores), appends the end-of-text token
to each and writes `shard-NNNNNN.npy` files plus `index.json` (format in `node.data.shards`);
`prepare_documents` does the same for any iterable of documents (e.g. a Hugging Face dataset
streamed by `node.data.hub`). Inputs are files or glob patterns (``**`` recurses), taken in
sorted order:

- ``*.txt`` (or any other suffix): the whole file is one document;
- ``*.jsonl``: one JSON object per line, its ``--text-field`` (default ``text``) is a document;
- either may be gzip-compressed (``*.gz``).

Shards are written atomically and the index last, so an interrupted prep leaves a folder that
readers refuse, never a truncated dataset.
"""

from __future__ import annotations

import glob
import gzip
import json
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import IO

from tokenizers import Tokenizer

from node.data.shards import (
    DataError,
    ShardIndex,
    ShardWriter,
    tokenize_documents,
)
from node.data.tokenizer import eos_token_id, load_tokenizer
from node.runtime.progress import make_progress, tracked

__all__ = [
    "expand_inputs",
    "iter_documents",
    "prepare_documents",
    "prepare_shards",
]

DEFAULT_SHARD_TOKENS = 100_000_000


def expand_inputs(patterns: list[str]) -> list[Path]:
    """Files named by `patterns` (paths or globs), deduplicated, in sorted order."""
    files: set[Path] = set()
    for pattern in patterns:
        matches = glob.glob(pattern, recursive=True) if glob.has_magic(pattern) else [pattern]
        for match in matches:
            path = Path(match)
            if path.is_file():
                files.add(path.absolute())
            elif not glob.has_magic(pattern):
                raise DataError(f"input not found: {pattern}")
    if not files:
        raise DataError(f"no input files match {patterns}")
    return sorted(files)


def _open_text(raw: IO[bytes], path: Path) -> IO[bytes]:
    return gzip.open(raw) if path.suffix == ".gz" else raw  # type: ignore[return-value]


def iter_documents(
    files: list[Path], text_field: str, on_bytes: Callable[[int], None] = lambda n: None
) -> Iterator[str]:
    """The documents of `files` in order; `on_bytes` gets each file's raw bytes read so far."""
    for path in files:
        is_jsonl = path.name.removesuffix(".gz").endswith(".jsonl")
        with ExitStack() as stack:
            raw = stack.enter_context(path.open("rb"))
            stream = stack.enter_context(_open_text(raw, path))
            if not is_jsonl:
                text = stream.read().decode("utf-8", errors="replace")
                on_bytes(raw.tell())
                if text.strip():
                    yield text
                continue
            for line_no, line in enumerate(stream, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)[text_field]
                except (ValueError, KeyError, TypeError) as e:
                    raise DataError(f"{path}:{line_no}: no string field {text_field!r}") from e
                if not isinstance(text, str):
                    raise DataError(f"{path}:{line_no}: field {text_field!r} is not a string")
                if line_no % 256 == 0:
                    on_bytes(raw.tell())
                if text:
                    yield text
            on_bytes(raw.tell())


def _writer(
    tokenizer_ref: str, out: Path, shard_tokens: int, cache_dir: Path | None
) -> tuple[Tokenizer, int | None, ShardWriter]:
    tokenizer = load_tokenizer(tokenizer_ref, cache_dir=cache_dir)
    eos = eos_token_id(tokenizer)
    writer = ShardWriter(
        out, tokenizer_ref=tokenizer_ref, tokenizer=tokenizer, shard_tokens=shard_tokens, eos_id=eos
    )
    return tokenizer, eos, writer


def prepare_documents(
    documents: Iterable[str],
    tokenizer_ref: str,
    out: Path,
    shard_tokens: int,
    *,
    cache_dir: Path | None = None,
) -> ShardIndex:
    """Tokenize a stream of documents (e.g. `node.data.hub.iter_hf_documents`) into shards."""
    tokenizer, eos, writer = _writer(tokenizer_ref, out, shard_tokens, cache_dir)
    for tokens in tracked(tokenize_documents(tokenizer, documents, eos), "tokenizing documents"):
        writer.add(tokens)
    return writer.close()


def prepare_shards(
    files: list[Path],
    tokenizer_ref: str,
    out: Path,
    shard_tokens: int,
    *,
    text_field: str = "text",
    cache_dir: Path | None = None,
    show_progress: bool | None = None,
) -> ShardIndex:
    """Tokenize `files` into shards in `out` (see the module docstring); returns the index."""
    tokenizer, eos, writer = _writer(tokenizer_ref, out, shard_tokens, cache_dir)
    sizes = [f.stat().st_size for f in files]
    with make_progress(enabled=show_progress, in_bytes=True) as progress:
        task = progress.add_task("tokenizing", total=sum(sizes))
        done_before = 0

        def advance(file_bytes: int) -> None:
            progress.update(task, completed=done_before + file_bytes)

        for path, size in zip(files, sizes, strict=True):
            for tokens in tokenize_documents(
                tokenizer, iter_documents([path], text_field, advance), eos
            ):
                writer.add(tokens)
            done_before += size
            progress.update(
                task, completed=done_before, description=f"{writer.tokens_written:,} tokens"
            )
        return writer.close()
