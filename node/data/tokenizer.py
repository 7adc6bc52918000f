"""Tokenizers by reference: the embedded BPE, a local `tokenizer.json`, or a Hugging Face repo.

References (the `tokenizer` field of a run config):

``embedded://tiny-bpe-N``
    A byte-level BPE with vocabulary size N (256 ≤ N ≤ 65536), trained with Hugging Face
    `tokenizers` on the embedded corpus (`node.data.corpus`) on first use: ByteLevel pre-tokenizer
    (GPT-2 regex, no prefix space), the 256 byte symbols as initial alphabet so every input is
    encodable, one special token `<|endoftext|>` (id 0) that separates documents, merges with
    frequency ≥ 2 until the vocabulary holds N entries. Training is deterministic (same corpus →
    byte-identical `tokenizer.json`) and takes well under a second on 2 cores. The result is
    cached as `<cache>/tokenizers/tiny-bpe-N.<corpus digest>.vK.json`, written atomically; later
    calls only load that file.
``file:///abs/tokenizer.json`` or a plain path
    A serialized `tokenizers` tokenizer (the `tokenizer.json` of a Hugging Face model).
``hf://ORG/NAME``
    `Tokenizer.from_pretrained("ORG/NAME")` (downloads through the Hugging Face hub and its cache).

`tokenizer_sha256` identifies a tokenizer by its canonical serialization; shard indexes record it
so a dataset is never read with another tokenizer than the one that produced it.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from codec.errors import TesseraError
from node.data.corpus import load_corpus
from node.runtime.atomic_files import write_text_atomic
from node.runtime.cache import build_once, cache_root

__all__ = [
    "EMBEDDED_BPE_RE",
    "EOS_TOKEN",
    "TokenizerError",
    "embedded_tokenizer",
    "eos_token_id",
    "load_tokenizer",
    "tokenizer_sha256",
    "train_bpe",
]

EOS_TOKEN = "<|endoftext|>"
EMBEDDED_BPE_RE = re.compile(r"embedded://tiny-bpe-([0-9]{3,5})")
TOKENIZER_VERSION = 1
"""Bump when the training recipe changes (part of the cache key)."""

_MIN_VOCAB, _MAX_VOCAB = 256 + 1, 1 << 16
_EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>")


class TokenizerError(TesseraError, ValueError):
    """A tokenizer reference that cannot be resolved or loaded."""


def train_bpe(documents: list[str] | tuple[str, ...], vocab_size: int) -> Tokenizer:
    """Train the embedded byte-level BPE recipe (see the module docstring) on `documents`."""
    if not _MIN_VOCAB <= vocab_size <= _MAX_VOCAB:
        raise TokenizerError(f"vocab size must be in [{_MIN_VOCAB}, {_MAX_VOCAB}]")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(documents), trainer, length=len(documents))
    return tok


def embedded_tokenizer(
    vocab_size: int, cache_dir: str | os.PathLike[str] | None = None
) -> Tokenizer:
    """The embedded BPE of `vocab_size` (trained on first use, then loaded from the cache)."""
    corpus = load_corpus(cache_dir)
    name = f"tiny-bpe-{vocab_size}.{corpus.sha256[:16]}.v{TOKENIZER_VERSION}.json"
    entry = cache_root(cache_dir) / "tokenizers" / name

    def build(path: Path) -> None:
        write_text_atomic(path, train_bpe(corpus.documents, vocab_size).to_str())

    return Tokenizer.from_file(str(build_once(entry, build)))


def _local_path(ref: str) -> Path:
    if ref.startswith("file://"):
        parts = urlsplit(ref)
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise TokenizerError(f"file URL must be file:///absolute/path, got {ref!r}")
        return Path(unquote(parts.path))
    return Path(ref).expanduser()


def load_tokenizer(ref: str, *, cache_dir: str | os.PathLike[str] | None = None) -> Tokenizer:
    """Resolve a tokenizer reference (see the module docstring)."""
    match = EMBEDDED_BPE_RE.fullmatch(ref)
    if match:
        return embedded_tokenizer(int(match.group(1)), cache_dir)
    if ref.startswith("embedded://"):
        raise TokenizerError(f"unknown embedded tokenizer {ref!r} (known: embedded://tiny-bpe-N)")
    if ref.startswith("hf://"):
        return Tokenizer.from_pretrained(ref.removeprefix("hf://"))
    path = _local_path(ref)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"tokenizer file not found: {path}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception subclasses
        raise TokenizerError(f"cannot load tokenizer {path}: {e}") from e


def tokenizer_sha256(tokenizer: Tokenizer) -> str:
    """SHA-256 of the tokenizer's canonical JSON serialization."""
    return hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()


def eos_token_id(tokenizer: Tokenizer) -> int | None:
    """The id of the end-of-text token (document separator), if the tokenizer has one."""
    for token in _EOS_CANDIDATES:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return int(token_id)
    return None
