"""Documents from a Hugging Face dataset, streamed through `datasets` (never downloaded whole).

``tessera data prep --hf NAME`` reads NAME with ``datasets.load_dataset(NAME, CONFIG,
split=SPLIT, data_files=FILES, streaming=True)``: NAME is a hub dataset (for example
``HuggingFaceFW/fineweb-edu`` with config ``sample-10BT``; gated ones need ``HF_TOKEN``) or one of
the builders for local or remote files (``json``, ``parquet``, ``text``, ``csv``) together with
``--hf-data-files``. Rows are taken in the dataset's order; each row's text field is a document.
The hub's metadata cache is ``HF_HOME`` (in the image: the cache volume, /data/cache/huggingface).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from node.data.shards import DataError

__all__ = ["iter_hf_documents"]


def iter_hf_documents(
    name: str,
    *,
    config: str | None = None,
    split: str = "train",
    data_files: Sequence[str] | None = None,
    text_field: str = "text",
    limit: int | None = None,
) -> Iterator[str]:
    """The text of each row of a streamed dataset, in order; at most `limit` documents."""
    try:
        import datasets
    except ImportError as exc:
        raise DataError(
            "--hf needs the `datasets` package: pip install 'tessera-train[data]'"
        ) from exc
    try:
        rows = datasets.load_dataset(
            name, config, split=split, data_files=list(data_files) if data_files else None,
            streaming=True,
        )  # fmt: skip
    except (FileNotFoundError, ValueError, ConnectionError) as exc:
        raise DataError(f"cannot open dataset {name!r} (split {split!r}): {exc}") from exc
    for count, row in enumerate(rows):
        if limit is not None and count >= limit:
            return
        text = row.get(text_field) if isinstance(row, dict) else None
        if not isinstance(text, str):
            raise DataError(f"row {count} of {name!r} has no string field {text_field!r}")
        if text:
            yield text
