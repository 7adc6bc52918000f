"""Datasets for every preset: a Hugging Face dataset streamed through `datasets` (from local files:
no hub here), token shards in an S3 bucket (moto on loopback), and the run config pinning its
dataset, the embedded corpus included, by digest."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import numpy as np
import pytest

from commands.cli import main as tessera
from node.data.batches import open_run_dataset
from node.data.dataset import Dataset
from node.data.shards import INDEX_NAME, DataError, ShardIndex
from node.data.tokenizer import load_tokenizer
from protocol.runconfig import RunConfig
from tests.support.embedded_data import TINY, shared_cache
from tests.support.servers import TEST_ACCESS_KEY_ID, TEST_SECRET

pytest.importorskip("datasets", reason="the `data` extra (datasets) is not installed")

DOCS = [
    f"Document {i}: the quick brown fox number {i} jumps over {i % 7} lazy dogs."
    for i in range(300)
]


def _jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    return path


def _index(folder: Path) -> ShardIndex:
    return ShardIndex.parse((folder / INDEX_NAME).read_bytes())


def _prep(*argv: str) -> None:
    args = ["data", "prep", "--tokenizer", TINY.tokenizer, "--shard-tokens", "2000"]
    assert tessera([*args, "--cache-dir", str(shared_cache()), *argv]) == 0


def test_streaming_a_hf_dataset_gives_the_tokens_of_the_same_files(tmp_path: Path) -> None:
    source = _jsonl(tmp_path)
    _prep("--hf", "json", "--hf-data-files", str(source), "--out", str(tmp_path / "hf"))
    _prep("--input", str(source), "--out", str(tmp_path / "files"))
    hf, files = _index(tmp_path / "hf"), _index(tmp_path / "files")
    assert hf.total_tokens > 4000 and len(hf.shards) > 1
    assert hf.digest == files.digest  # same documents in the same order: the same tokens
    _prep("--hf", "json", "--hf-data-files", str(source), "--max-documents", "10",
          "--out", str(tmp_path / "ten"))  # fmt: skip
    assert _index(tmp_path / "ten").total_tokens < hf.total_tokens / 20


def test_a_hf_row_without_the_text_field_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"body": "no text field"}) + "\n")
    args = ["data", "prep", "--tokenizer", TINY.tokenizer, "--cache-dir", str(shared_cache())]
    rc = tessera([*args, "--hf", "json", "--hf-data-files", str(bad), "--out", str(tmp_path / "o")])
    assert rc == 1
    assert not (tmp_path / "o" / INDEX_NAME).exists()


def test_token_shards_in_s3_read_like_the_local_folder(
    tmp_path: Path, s3_server: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TESSERA_S3_ACCESS_KEY_ID", TEST_ACCESS_KEY_ID)
    monkeypatch.setenv("TESSERA_S3_SECRET_ACCESS_KEY", TEST_SECRET)
    _prep("--input", str(_jsonl(tmp_path)), "--out", str(tmp_path / "shards"))
    ref = f"s3://{s3_bucket}/corpus/v1?endpoint={s3_server}&region=us-east-1"
    assert tessera(["data", "upload", str(tmp_path / "shards"), ref]) == 0
    tok = load_tokenizer(TINY.tokenizer, cache_dir=shared_cache())
    local = Dataset.open(str(tmp_path / "shards"), tok, 32, cache_dir=tmp_path / "c1")
    remote = Dataset.open(ref, tok, 32, cache_dir=tmp_path / "c2")
    assert remote.index.digest == local.index.digest
    slots = list(range(0, local.n_slots, 7))
    assert np.array_equal(remote.read_slots(slots).numpy(), local.read_slots(slots).numpy())
    # a shard replaced in the bucket is refused (its sha256 is in the index)
    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1",
                      aws_access_key_id=TEST_ACCESS_KEY_ID, aws_secret_access_key=TEST_SECRET)  # fmt: skip
    first = local.index.shards[0].name
    body = s3.get_object(Bucket=s3_bucket, Key=f"corpus/v1/{first}")["Body"].read()
    s3.put_object(Bucket=s3_bucket, Key=f"corpus/v1/{first}", Body=body[:-2] + b"\x01\x00")
    fresh = Dataset.open(ref, tok, 32, cache_dir=tmp_path / "c3")
    with pytest.raises(DataError, match="sha256"):
        fresh.read_slot(0)


def test_the_run_config_pins_its_dataset_by_digest(tmp_path: Path) -> None:
    _prep("--input", str(_jsonl(tmp_path)), "--out", str(tmp_path / "shards"))
    digest = _index(tmp_path / "shards").digest
    base = {"dataset": f"file://{tmp_path / 'shards'}", "seq_len": 32}
    pinned = RunConfig.preset("tiny", **base, dataset_digest=digest)
    unpinned = RunConfig.preset("tiny", **base)
    assert pinned.run_id != unpinned.run_id  # peers agree on the digest through the run id
    assert b"dataset_digest" not in unpinned.canonical_json()  # old run ids are unchanged
    assert RunConfig.from_toml(pinned.to_toml()) == pinned
    _, dataset = open_run_dataset(pinned, cache_dir=shared_cache())
    assert dataset.index.digest == digest
    other = RunConfig.preset("tiny", **base, dataset_digest="sha256:" + "0" * 64)
    with pytest.raises(DataError, match="other tokens than the run pins"):
        open_run_dataset(other, cache_dir=shared_cache())


def test_the_embedded_corpus_is_pinned_by_the_digest_data_digest_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    assert tessera(["data", "digest", "--run", "tiny", "--cache-dir", str(shared_cache())]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("dataset_digest"))
    digest = line.split('"')[1]
    pinned = RunConfig.preset("tiny", dataset_digest=digest)
    _, dataset = open_run_dataset(pinned, cache_dir=shared_cache())
    assert dataset.ref == "embedded://tiny-corpus" and dataset.index.digest == digest
    # a peer whose Python builds another corpus (other tokens) refuses the run
    elsewhere = RunConfig.preset("tiny", dataset_digest="sha256:" + "1" * 64)
    with pytest.raises(DataError, match="Python build"):
        open_run_dataset(elsewhere, cache_dir=shared_cache())
