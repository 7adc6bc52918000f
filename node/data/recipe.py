"""Corpus recipes: a pinned list of published archives and the text files to take from each.

A recipe is a TOML file (an example: ``lab/corpora/pypi-text.toml``)::

    name = "pypi-text"
    tokenizer = "embedded://tiny-bpe-4096"
    shard_tokens = 50000000
    max_member_bytes = 1000000        # larger members are skipped (generated tables, data)
    max_archive_text_bytes = 100000000  # more selected text than this in one archive: refused
    text_sha256 = "…"                 # pins: the documents, then the tokens (optional until pinned)
    tokens = 12345
    digest = "sha256:…"

    [[artifact]]
    name = "Django"
    version = "6.1.3"
    filename = "django-6.1.3.tar.gz"
    url = "https://…/django-6.1.3.tar.gz"
    size = 11306257
    sha256 = "…"
    include = ["*/docs/*.txt", "*.py"]
    exclude = ["*/tests/*"]

`include` / `exclude` are `fnmatch` patterns over the member's path inside the archive, where
``*`` also matches ``/``. Artifacts are read in the listed order and members in sorted order; the
build (`node.data.recipe_build`) turns every selected file into one document.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from node.data.shards import DataError

__all__ = ["Artifact", "CorpusRecipe", "load_recipe"]

_SHA256 = r"^[0-9a-f]{64}$"
_Pattern = Annotated[str, Field(min_length=1, max_length=200)]


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Artifact(_Strict):
    """One published archive (a source distribution or a wheel), pinned by size and sha256."""

    name: str = Field(min_length=1, max_length=100)
    version: str = Field(min_length=1, max_length=50)
    filename: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,200}\.(tar\.gz|tgz|zip|whl)$")
    url: str = Field(pattern=r"^(https?|file)://\S+$", max_length=1000)
    size: int = Field(gt=0, le=1 << 31, description="the archive's size in bytes")
    sha256: str = Field(pattern=_SHA256)
    include: tuple[_Pattern, ...] = Field(min_length=1)
    exclude: tuple[_Pattern, ...] = ()

    @property
    def label(self) -> str:
        return f"{self.name} {self.version}"


class CorpusRecipe(_Strict):
    """A corpus: its tokenizer, shard size, size caps, artifacts, and the pins of its result."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$")
    tokenizer: str = Field(min_length=1, max_length=512)
    shard_tokens: int = Field(gt=0)
    max_member_bytes: int = Field(gt=0, le=1 << 30)
    max_archive_text_bytes: int = Field(gt=0, le=1 << 34)
    text_sha256: str | None = Field(None, pattern=_SHA256)
    tokens: int | None = Field(None, ge=0)
    digest: str | None = Field(None, pattern=r"^sha256:[0-9a-f]{64}$")
    artifact: tuple[Artifact, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_files(self) -> CorpusRecipe:
        names = [a.filename for a in self.artifact]
        if len(set(names)) != len(names):
            raise ValueError("an artifact filename is listed twice")
        return self


def load_recipe(path: Path) -> CorpusRecipe:
    """Read and validate a recipe file; any problem is one `DataError` line."""
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"recipe {path} not found") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise DataError(f"recipe {path} is not readable TOML: {e}") from None
    try:
        return CorpusRecipe.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise DataError(
            f"recipe {path}: {where}: {first['msg']} ({e.error_count()} problem(s); "
            "see node/data/recipe.py for the fields)"
        ) from None
