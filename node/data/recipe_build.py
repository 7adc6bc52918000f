"""Build a corpus recipe (`node.data.recipe`) into a shard folder and check it against its pins.

1. Every artifact is downloaded into the cache and verified against its pinned size and SHA-256
   (`node.data.download`) before any archive is opened.
2. The selected members of each archive are read in memory (`node.data.archives`), artifacts in
   the recipe's order and members sorted by name; each file is one document (UTF-8, undecodable
   bytes replaced, NUL-holding files skipped as binary, line ends normalized, trimmed).
3. Identical documents are kept once and all are put in a fixed pseudo-random order (sorted by
   their BLAKE2b digest, as the embedded corpus is), so that the held-out tail of the dataset is a
   fair sample of every package rather than the last one. The SHA-256 of the documents
   (`node.data.corpus.corpus_digest`) is checked against the recipe's ``text_sha256`` before
   anything is tokenized.
4. `prepare_documents` tokenizes them into shards; the dataset's token count and digest are then
   checked against ``tokens`` and ``digest``. On a mismatch the folder's index is removed, so the
   folder is never taken for the pinned corpus.

The result depends only on the pinned archive bytes, the recipe and the tokenizer.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from rich.progress import Progress, TaskID

from node.data.archives import read_members
from node.data.corpus import corpus_digest
from node.data.download import fetch_pinned
from node.data.prep import prepare_documents
from node.data.recipe import Artifact, CorpusRecipe
from node.data.shards import INDEX_NAME, DataError, ShardIndex
from node.runtime.progress import make_progress

__all__ = ["CorpusBuild", "build_corpus", "collect_documents", "fetch_artifacts"]

log = logging.getLogger(f"tessera.{__name__}")

CacheDir = Path | None


@dataclass(frozen=True)
class CorpusBuild:
    """A built corpus: its shard index, document count and the SHA-256 of its documents."""

    index: ShardIndex
    documents: int
    text_sha256: str

    def pins(self) -> str:
        """The TOML lines that pin this result in a recipe."""
        return (
            f'text_sha256 = "{self.text_sha256}"\n'
            f"tokens = {self.index.total_tokens}\n"
            f'digest = "{self.index.digest}"'
        )


def _advance(progress: Progress, task: TaskID, done: int) -> None:
    progress.update(task, completed=done)


def fetch_artifacts(
    recipe: CorpusRecipe, cache_dir: CacheDir = None, show_progress: bool | None = None
) -> list[Path]:
    """Every artifact's verified local copy, in recipe order (downloads what is not cached)."""
    paths: list[Path] = []
    with make_progress(enabled=show_progress, in_bytes=True) as progress:
        for art in recipe.artifact:
            task = progress.add_task(art.filename, total=art.size)
            paths.append(
                fetch_pinned(
                    art.url,
                    art.filename,
                    art.size,
                    art.sha256,
                    cache_dir=cache_dir,
                    on_bytes=partial(_advance, progress, task),
                )
            )
    return paths


def _clean(data: bytes) -> str:
    text = data.decode("utf-8", errors="replace")
    return text.replace("\r\n", "\n").replace("\r", "\n").strip()


def _artifact_documents(art: Artifact, path: Path, recipe: CorpusRecipe) -> Iterator[str]:
    members, stats = read_members(
        path,
        include=art.include,
        exclude=art.exclude,
        max_member_bytes=recipe.max_member_bytes,
        max_total_bytes=recipe.max_archive_text_bytes,
    )
    binary = 0
    for member in members:
        if b"\x00" in member.data:
            binary += 1
            continue
        if text := _clean(member.data):
            yield text
    log.info(
        "%s: %d files (%.1f MB); skipped %d over %s bytes, %d links or unsafe names, %d binary",
        art.label, stats.members - binary, stats.bytes / 1e6, len(stats.too_large),
        f"{recipe.max_member_bytes:,}", len(stats.unsafe), binary,
    )  # fmt: skip


def _order_key(doc: str) -> bytes:
    return hashlib.blake2b(doc.encode("utf-8"), digest_size=16).digest()


def collect_documents(recipe: CorpusRecipe, paths: list[Path]) -> list[str]:
    """The corpus documents from verified archives `paths` (steps 2 and 3 of the docstring)."""
    unique: set[str] = set()
    for art, path in zip(recipe.artifact, paths, strict=True):
        unique.update(_artifact_documents(art, path, recipe))
    return sorted(unique, key=_order_key)


def _check_text(recipe: CorpusRecipe, text_sha256: str) -> None:
    if recipe.text_sha256 is not None and text_sha256 != recipe.text_sha256:
        raise DataError(
            f"recipe {recipe.name}: the selected files hold other text than it pins (text_sha256 "
            f"{text_sha256}, recipe {recipe.text_sha256}): its include/exclude patterns, caps or "
            "archives changed; re-pin it if that is intended"
        )


def _check_tokens(recipe: CorpusRecipe, index: ShardIndex, out: Path) -> None:
    problems = []
    if recipe.tokens is not None and index.total_tokens != recipe.tokens:
        problems.append(f"{index.total_tokens:,} tokens, recipe {recipe.tokens:,}")
    if recipe.digest is not None and index.digest != recipe.digest:
        problems.append(f"digest {index.digest}, recipe {recipe.digest}")
    if problems:
        (out / INDEX_NAME).unlink(missing_ok=True)
        raise DataError(
            f"recipe {recipe.name} built other tokens than it pins ({'; '.join(problems)}); the "
            f"same text with another tokenizer than {index.tokenizer} (sha256 "
            f"{index.tokenizer_sha256[:12]}…) does this. {out} is left without its index"
        )


def build_corpus(
    recipe: CorpusRecipe,
    out: Path,
    *,
    cache_dir: CacheDir = None,
    show_progress: bool | None = None,
) -> CorpusBuild:
    """Download, select, order, tokenize and check `recipe` into `out` (see the module docstring)."""
    paths = fetch_artifacts(recipe, cache_dir, show_progress)
    documents = collect_documents(recipe, paths)
    if not documents:
        raise DataError(f"recipe {recipe.name} selects no text: check its include patterns")
    text_sha256 = corpus_digest(documents)
    log.info(
        "%d documents, %.1f M characters, text_sha256 %s",
        len(documents), sum(len(d) for d in documents) / 1e6, text_sha256,
    )  # fmt: skip
    _check_text(recipe, text_sha256)
    index = prepare_documents(
        documents, recipe.tokenizer, out, recipe.shard_tokens, cache_dir=cache_dir
    )
    _check_tokens(recipe, index, out)
    log.info(
        "%s tokens in %d shards, digest %s",
        f"{index.total_tokens:,}",
        len(index.shards),
        index.digest,
    )
    return CorpusBuild(index=index, documents=len(documents), text_sha256=text_sha256)
