"""The embedded corpus: real English text that every Python installation already ships.

`embedded://tiny-corpus` is built, without any download, from three sources of the running
interpreter's standard library, in this order of extraction:

1. `pydoc_data.topics.topics` — the Python Language Reference / library topics that `help()`
   shows (≈ 0.46 MB of prose on CPython 3.11), one document per topic;
2. the stdlib's `LICENSE.txt` and the plain-text documents of `idlelib` (README, NEWS, HISTORY,
   CREDITS, ...), one document per file;
3. the docstrings of every stdlib module, class and function, read with `ast` (nothing is
   imported), one document per module (≈ 1.8 MB). Packages installed into the stdlib tree
   (`site-packages`, `dist-packages`) and test directories are left out.

About 2.4 MB of text on CPython 3.11.7. Documents are then put in a pseudo-random but fixed order
(sorted by their BLAKE2b digest), so that any contiguous tail (the held-out split) is a fair
sample of the whole. The result depends only on the interpreter's stdlib files: the same Python
version from the same distribution gives the same corpus and `corpus_sha256`. Different versions
or distributions (e.g. Debian splits `idlelib` out) give a different digest, which then shows up
in the tokenizer and dataset fingerprints rather than silently mixing data.

The extracted documents are cached as JSON under the cache root (`node.runtime.cache`).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from node.runtime.atomic_files import write_json_atomic
from node.runtime.cache import build_once, cache_root
from node.runtime.progress import tracked

__all__ = ["CORPUS_NAME", "CORPUS_VERSION", "EmbeddedCorpus", "extract_documents", "load_corpus"]

CORPUS_NAME = "tiny-corpus"
CORPUS_VERSION = 1
"""Bump when the extraction rules change (it is part of the cache key)."""

_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
_MIN_DOCSTRING_CHARS = 24


@dataclass(frozen=True)
class EmbeddedCorpus:
    """The documents of the embedded corpus and their digest."""

    documents: tuple[str, ...]
    sha256: str
    python: str

    @property
    def n_chars(self) -> int:
        return sum(len(d) for d in self.documents)

    @property
    def n_bytes(self) -> int:
        return sum(len(d.encode("utf-8")) for d in self.documents)


def corpus_digest(documents: tuple[str, ...] | list[str]) -> str:
    """SHA-256 over the documents, each length-prefixed (unambiguous)."""
    h = hashlib.sha256(b"tessera/corpus/v1\x00")
    for doc in documents:
        data = doc.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def _clean(text: str) -> str:
    return text.replace("\x00", "").replace("\r\n", "\n").strip()


def _stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _included(path: Path, root: Path) -> bool:
    return not (_EXCLUDED_DIRS & set(path.relative_to(root).parts[:-1]))


def _topic_documents() -> list[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        return []
    return [_clean(topics[name]) for name in sorted(topics)]


def _text_file_documents(root: Path) -> list[str]:
    paths = [root / "LICENSE.txt", *sorted((root / "idlelib").glob("*.txt"))]
    return [_clean(p.read_text(encoding="utf-8", errors="replace")) for p in paths if p.is_file()]


def _module_docstrings(path: Path) -> str:
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, OSError):
        return ""
    parts: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= _MIN_DOCSTRING_CHARS:
                parts.append(_clean(doc))
    return "\n\n".join(parts)


def _docstring_documents(root: Path) -> list[str]:
    files = sorted(
        (p for p in root.rglob("*.py") if p.is_file() and _included(p, root)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    docs = (_module_docstrings(p) for p in tracked(files, "extracting stdlib docstrings"))
    return [d for d in docs if d]


def _shuffle_key(doc: str) -> bytes:
    return hashlib.blake2b(doc.encode("utf-8"), digest_size=16).digest()


def extract_documents() -> list[str]:
    """Extract the corpus documents from the running interpreter (a few seconds; uncached)."""
    root = _stdlib_dir()
    docs = _topic_documents() + _text_file_documents(root) + _docstring_documents(root)
    unique = {d for d in docs if d}
    return sorted(unique, key=_shuffle_key)


def _python_tag() -> str:
    impl = platform.python_implementation().lower()
    v = sys.version_info
    return f"{impl}-{v.major}.{v.minor}.{v.micro}"


def _cache_entry(cache_dir: str | os.PathLike[str] | None) -> Path:
    name = f"{CORPUS_NAME}.v{CORPUS_VERSION}.{_python_tag()}.json"
    return cache_root(cache_dir) / "corpus" / name


def _build(entry: Path) -> None:
    docs = extract_documents()
    body = {
        "name": CORPUS_NAME,
        "version": CORPUS_VERSION,
        "python": _python_tag(),
        "sha256": corpus_digest(docs),
        "documents": docs,
    }
    write_json_atomic(entry, body)


def load_corpus(cache_dir: str | os.PathLike[str] | None = None) -> EmbeddedCorpus:
    """The embedded corpus, extracted on first use and then read from the cache."""
    entry = build_once(_cache_entry(cache_dir), _build)
    body = json.loads(entry.read_text(encoding="utf-8"))
    docs = tuple(body["documents"])
    digest = corpus_digest(docs)
    if digest != body["sha256"]:
        raise RuntimeError(f"cached corpus {entry} is corrupt (digest mismatch); delete it")
    return EmbeddedCorpus(documents=docs, sha256=digest, python=body["python"])
