"""``tessera data``: prepare and inspect pre-tokenized training shards.

    tessera data prep --input 'corpus/**/*.jsonl.gz' --tokenizer embedded://tiny-bpe-4096 \\
        --out /data/tiny-shards --shard-tokens 50000000
    tessera data info /data/tiny-shards

`prep` reads text documents, tokenizes them (all cores), appends the end-of-text token to each
and writes `shard-NNNNNN.npy` files of `--shard-tokens` tokens plus `index.json` (format in
`node.data.shards`). Inputs are files or glob patterns (``**`` recurses), taken in sorted order:

- ``*.txt`` (or any other suffix): the whole file is one document;
- ``*.jsonl``: one JSON object per line, its ``--text-field`` (default ``text``) is a document;
- either may be gzip-compressed (``*.gz``).

``--hf DATASET`` instead streams a Hugging Face dataset through `datasets` (`node.data.hub`).
``tessera data upload DIR s3://BUCKET/PREFIX?endpoint=…`` copies prepared shards to any S3 bucket
(run configs then name ``dataset = "s3://BUCKET/PREFIX?…"``), and ``tessera data digest --run R``
prints the digest that pins a run's dataset (``dataset_digest``; `info` prints it too).

The output folder must be empty or new (``--force`` replaces the index and shards in it). Shards are written atomically
and the index last, so an interrupted prep leaves a folder that readers refuse, never a
truncated dataset. A training run then uses ``dataset = "file:///data/tiny-shards"`` and the
same ``tokenizer`` reference.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import IO

from rich.console import Console
from rich.table import Table
from tokenizers import Tokenizer

from node.data.shards import (
    INDEX_NAME,
    DataError,
    LocalShardSource,
    ShardIndex,
    ShardWriter,
    split_store_ref,
    tokenize_documents,
    upload_shards,
)
from node.data.tokenizer import TokenizerError, eos_token_id, load_tokenizer
from node.runtime.progress import make_progress, tracked

__all__ = [
    "add_arguments",
    "expand_inputs",
    "iter_documents",
    "prepare_documents",
    "prepare_shards",
    "run",
]

DEFAULT_SHARD_TOKENS = 100_000_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION")
    sub.required = True
    prep = sub.add_parser("prep", help="tokenize text files into training shards")
    source = prep.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--input",
        nargs="+",
        action="extend",
        metavar="FILE_OR_GLOB",
        help="text (.txt) or JSON-lines (.jsonl) files, optionally .gz; globs allowed",
    )
    source.add_argument(
        "--hf",
        metavar="DATASET",
        help="stream a Hugging Face dataset (hub name, or json/parquet/text with --hf-data-files)",
    )
    prep.add_argument("--hf-config", default=None, help="the dataset's configuration name")
    prep.add_argument("--hf-split", default="train")
    prep.add_argument("--hf-data-files", nargs="+", default=None, metavar="FILE_OR_URL")
    prep.add_argument("--max-documents", type=int, default=None, help="stop after N documents")
    prep.add_argument(
        "--tokenizer",
        required=True,
        help="embedded://tiny-bpe-N, a tokenizer.json path/file:// URL, or hf://ORG/NAME",
    )
    prep.add_argument("--out", required=True, type=Path, help="output folder (empty or new)")
    prep.add_argument(
        "--shard-tokens",
        type=int,
        default=DEFAULT_SHARD_TOKENS,
        help=f"tokens per shard (default {DEFAULT_SHARD_TOKENS:,})",
    )
    prep.add_argument("--text-field", default="text", help="JSON field holding the text")
    prep.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    prep.add_argument("--cache-dir", type=Path, default=None, help="cache root override")
    prep.set_defaults(_data_run=_run_prep)
    info = sub.add_parser("info", help="summarize a prepared shard folder")
    info.add_argument("directory", type=Path)
    info.add_argument("--verify", action="store_true", help="check every shard's sha256")
    info.set_defaults(_data_run=_run_info)
    upload = sub.add_parser("upload", help="copy a prepared shard folder to s3://BUCKET/PREFIX")
    upload.add_argument("directory", type=Path)
    upload.add_argument("dest", help="s3://BUCKET/PREFIX?endpoint=… (write key from TESSERA_S3_*)")
    upload.set_defaults(_data_run=_run_upload)
    digest = sub.add_parser(
        "digest", help="the digest of a run's dataset, to pin it as dataset_digest in a run config"
    )
    digest.add_argument("--run", default="tiny", help="preset name or run config file")
    digest.add_argument("--cache-dir", type=Path, default=None, help="cache root override")
    digest.set_defaults(_data_run=_run_digest)


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    try:
        return int(args._data_run(args))
    except (DataError, TokenizerError, OSError) as e:
        console.print(f"[red]error:[/red] {e}")
        return 2


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


def _prepare_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise DataError(f"--out {out} is not empty (use --force to overwrite)")
        (out / INDEX_NAME).unlink(missing_ok=True)  # the folder is incomplete until the new index
        for old in out.glob("shard-*.npy"):
            old.unlink()


def _summary(index: ShardIndex, where: Path) -> Table:
    table = Table(title=str(where), show_header=False)
    table.add_row("tokenizer", index.tokenizer)
    table.add_row("tokenizer sha256", index.tokenizer_sha256[:16] + "…")
    table.add_row("vocab size / dtype", f"{index.vocab_size:,} / {index.dtype}")
    table.add_row("eos id", str(index.eos_id))
    table.add_row("shards", f"{len(index.shards):,}")
    table.add_row("tokens", f"{index.total_tokens:,}")
    table.add_row("digest (dataset_digest)", index.digest)
    return table


def _run_prep(args: argparse.Namespace) -> int:
    if args.shard_tokens < 1:
        raise DataError("--shard-tokens must be positive")
    if args.hf:
        from node.data.hub import iter_hf_documents

        _prepare_out(args.out, args.force)
        documents = iter_hf_documents(
            args.hf, config=args.hf_config, split=args.hf_split, data_files=args.hf_data_files,
            text_field=args.text_field, limit=args.max_documents,
        )  # fmt: skip
        index = prepare_documents(
            documents, args.tokenizer, args.out, args.shard_tokens, cache_dir=args.cache_dir
        )
        Console().print(_summary(index, args.out))
        return 0
    files = expand_inputs(args.input)
    _prepare_out(args.out, args.force)
    index = prepare_shards(
        files,
        args.tokenizer,
        args.out,
        args.shard_tokens,
        text_field=args.text_field,
        cache_dir=args.cache_dir,
    )
    Console().print(_summary(index, args.out))
    return 0


def _run_info(args: argparse.Namespace) -> int:
    source = LocalShardSource(args.directory, verify=args.verify)
    index = ShardIndex.parse(source.read_index())
    if args.verify:
        for entry in index.shards:
            source.fetch(entry)
    Console().print(_summary(index, args.directory))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="tessera data")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))


def _run_upload(args: argparse.Namespace) -> int:
    from protocol.stores import open_store

    store_url, prefix = split_store_ref(args.dest)
    index = upload_shards(args.directory, open_store(store_url), prefix)
    Console().print(_summary(index, args.directory))
    print(f'dataset = "{args.dest}"\ndataset_digest = "{index.digest}"')
    return 0


def _run_digest(args: argparse.Namespace) -> int:
    from node.data.batches import open_run_dataset
    from node.runtime.node_args import load_run

    run = load_run(args.run)
    unpinned = run.model_copy(update={"dataset_digest": None})
    _, dataset = open_run_dataset(unpinned, cache_dir=args.cache_dir)
    print(f'dataset = "{run.dataset}"\ndataset_digest = "{dataset.index.digest}"')
    return 0
