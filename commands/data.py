"""`tessera data`: prepare, inspect, upload and pin pre-tokenized training shards.

    tessera data prep --input 'corpus/**/*.jsonl.gz' --tokenizer embedded://tiny-bpe-4096 \\
        --out /data/tiny-shards --shard-tokens 50000000
    tessera data info /data/tiny-shards

`prep` reads text documents, tokenizes them (all cores), appends the end-of-text token to each
and writes `shard-NNNNNN.npy` files of `--shard-tokens` tokens plus `index.json` (format in
`node.data.shards`). Inputs are files or glob patterns (``**`` recurses), taken in sorted order:

- ``*.txt`` (or any other suffix): the whole file is one document;
- ``*.jsonl``: one JSON object per line, its ``--text-field`` (default ``text``) is a document;
- either may be gzip-compressed (``*.gz``).

``--hf DATASET`` instead streams a Hugging Face dataset through `datasets` (`node.data.hub`), and
``--recipe FILE`` builds a pinned corpus recipe (e.g. ``lab/corpora/pypi-text.toml``: published
archives checked by sha256, the text files selected from them, the resulting digest checked;
`node.data.recipe_build`).
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
import logging
from pathlib import Path

from rich.console import Console
from rich.table import Table

from node.data.prep import DEFAULT_SHARD_TOKENS, expand_inputs, prepare_documents, prepare_shards
from node.data.shards import (
    INDEX_NAME,
    DataError,
    LocalShardSource,
    ShardIndex,
    split_store_ref,
    upload_shards,
)
from node.data.tokenizer import TokenizerError

__all__ = ["add_arguments", "run"]


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
    source.add_argument(
        "--recipe",
        type=Path,
        metavar="TOML",
        help="build a pinned corpus recipe (e.g. lab/corpora/pypi-text.toml): download its "
        "archives, check their sha256, tokenize, check the pinned digest",
    )
    prep.add_argument("--hf-config", default=None, help="the dataset's configuration name")
    prep.add_argument("--hf-split", default="train")
    prep.add_argument("--hf-data-files", nargs="+", default=None, metavar="FILE_OR_URL")
    prep.add_argument("--max-documents", type=int, default=None, help="stop after N documents")
    prep.add_argument(
        "--tokenizer",
        help="embedded://tiny-bpe-N, a tokenizer.json path/file:// URL, or hf://ORG/NAME "
        "(required with --input and --hf; a --recipe names its own)",
    )
    prep.add_argument("--out", required=True, type=Path, help="output folder (empty or new)")
    prep.add_argument(
        "--shard-tokens",
        type=int,
        default=None,
        help=f"tokens per shard (default {DEFAULT_SHARD_TOKENS:,}; a --recipe names its own)",
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
    try:
        return int(args._data_run(args))
    except (DataError, TokenizerError, OSError) as e:  # one line, `tessera data: …` (commands.cli)
        raise SystemExit(str(e)) from None


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
    if args.recipe:
        return _run_recipe(args)
    if args.tokenizer is None:
        raise DataError(
            "--tokenizer is required with --input and --hf (e.g. embedded://tiny-bpe-4096)"
        )
    if args.shard_tokens is None:
        args.shard_tokens = DEFAULT_SHARD_TOKENS
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


def _run_recipe(args: argparse.Namespace) -> int:
    from node.data.recipe import load_recipe
    from node.data.recipe_build import build_corpus
    from node.runtime.logs import setup_logging

    given = [f"--{n.replace('_', '-')}" for n in ("tokenizer", "shard_tokens") if getattr(args, n)]
    if given:
        raise DataError(f"{' and '.join(given)}: a --recipe names its own; drop the option")
    recipe = load_recipe(args.recipe)
    _prepare_out(args.out, args.force)
    if not logging.getLogger().handlers:  # a host program (or a test runner) keeps its own
        setup_logging("info")
    built = build_corpus(recipe, args.out, cache_dir=args.cache_dir)
    Console().print(_summary(built.index, args.out))
    if recipe.digest is None or recipe.tokens is None or recipe.text_sha256 is None:
        print(f"# {args.recipe} pins no result yet; these lines pin this one:\n{built.pins()}")
    return 0


def _run_info(args: argparse.Namespace) -> int:
    source = LocalShardSource(args.directory, verify=args.verify)
    index = ShardIndex.parse(source.read_index())
    if args.verify:
        for entry in index.shards:
            source.fetch(entry)
    Console().print(_summary(index, args.directory))
    return 0


def _run_upload(args: argparse.Namespace) -> int:
    from protocol.stores import open_store

    store_url, prefix = split_store_ref(args.dest)
    index = upload_shards(args.directory, open_store(store_url), prefix)
    Console().print(_summary(index, args.directory))
    print(f'dataset = "{args.dest}"\ndataset_digest = "{index.digest}"')
    return 0


def _run_digest(args: argparse.Namespace) -> int:
    from commands.node_args import load_run
    from node.data.batches import open_run_dataset

    run = load_run(args.run)
    unpinned = run.model_copy(update={"dataset_digest": None})
    _, dataset = open_run_dataset(unpinned, cache_dir=args.cache_dir)
    print(f'dataset = "{run.dataset}"\ndataset_digest = "{dataset.index.digest}"')
    return 0
