"""Embedded corpus and tokenizer (cache behaviour), shard prep via the CLI, shard sources."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import node.data.tokenizer as tokenizer_module
from commands.cli import main as tessera
from node.data.batches import open_run_dataset
from node.data.corpus import load_corpus
from node.data.dataset import Dataset
from node.data.shards import INDEX_NAME, DataError, ShardIndex, StoreShardSource
from node.data.tokenizer import EOS_TOKEN, eos_token_id, load_tokenizer, tokenizer_sha256
from node.runtime.cache import CACHE_ENV, cache_root
from protocol.stores import FileStore
from tests.support.embedded_data import TINY, shared_cache, tiny_dataset

# -- embedded corpus and tokenizer -----------------------------------------------------------


def test_embedded_corpus_is_megabytes_of_real_english() -> None:
    corpus = load_corpus(shared_cache())
    assert corpus.n_bytes > 1_000_000
    text = " ".join(corpus.documents[:200]).lower()
    words = text.split()
    common = sum(w in {"the", "of", "a", "to", "is", "and", "in"} for w in words)
    assert common / len(words) > 0.08  # English prose, not code or random bytes
    assert load_corpus(shared_cache()).sha256 == corpus.sha256  # reloaded from the cache


def test_cache_root_honours_argument_env_and_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(CACHE_ENV, raising=False)
    assert cache_root() == Path("~/.cache/tessera").expanduser()
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert cache_root(tmp_path / "arg") == tmp_path / "arg"


def test_embedded_tokenizer_is_trained_once_then_loaded_from_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    tiny_dataset()  # the corpus is extracted into the shared cache (once per process)
    shutil.copytree(shared_cache() / "corpus", tmp_path / "corpus")  # skip re-extraction
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    calls: list[int] = []
    real_train = tokenizer_module.train_bpe

    def counting_train(documents: tuple[str, ...], vocab_size: int) -> object:
        calls.append(vocab_size)
        return real_train(documents, vocab_size)

    monkeypatch.setattr(tokenizer_module, "train_bpe", counting_train)
    first = load_tokenizer("embedded://tiny-bpe-512")
    cached = list((tmp_path / "tokenizers").glob("tiny-bpe-512.*.json"))
    assert calls == [512] and len(cached) == 1
    assert not [p for p in cached[0].parent.iterdir() if p.name.startswith(".tessera-tmp-")]
    second = load_tokenizer("embedded://tiny-bpe-512")
    assert calls == [512]  # loaded, not retrained
    assert tokenizer_sha256(first) == tokenizer_sha256(second)
    assert first.get_vocab_size() == 512 and eos_token_id(first) == 0
    # deterministic: training again from scratch gives the byte-identical tokenizer
    assert real_train(load_corpus().documents, 512).to_str() == first.to_str()


def test_embedded_tokenizer_round_trips_text() -> None:
    tok = load_tokenizer(TINY.tokenizer, cache_dir=shared_cache())
    assert tok.get_vocab_size() == TINY.model.vocab_size
    for text in ("Ünïcödé → ok!\n\tand\x00bytes", "Return the number of items in a container."):
        assert tok.decode(tok.encode(text).ids) == text
    assert len(tok.encode(text).ids) < len(text) / 4  # merges learned from English text
    assert tok.token_to_id(EOS_TOKEN) == 0


def test_unknown_references_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        load_tokenizer("embedded://no-such-tokenizer", cache_dir=tmp_path)
    with pytest.raises(ValueError):
        load_tokenizer(str(tmp_path / "missing.json"))
    tok = load_tokenizer(TINY.tokenizer, cache_dir=shared_cache())
    with pytest.raises(DataError):
        Dataset.open("embedded://no-such-corpus", tok, 16, cache_dir=shared_cache())
    with pytest.raises(DataError):
        Dataset.open("s3://tessera-data/x", tok, 16, cache_dir=shared_cache())


def test_open_run_dataset_for_the_tiny_preset() -> None:
    tokenizer, dataset = open_run_dataset(TINY, cache_dir=shared_cache())
    assert dataset.fingerprint == tiny_dataset().fingerprint
    assert dataset.vocab_size == TINY.model.vocab_size and dataset.eos_id == 0
    assert dataset.n_heldout_slots == pytest.approx(0.02 * dataset.n_slots, abs=1)
    sample = dataset.read_slot(0)
    assert sample.shape == (TINY.seq_len + 1,)
    assert np.array_equal(dataset.read_slot(1)[0], sample[-1])  # slots overlap by one token
    decoded = tokenizer.decode(sample.tolist())
    assert sum(c.isalpha() or c.isspace() for c in decoded) / len(decoded) > 0.7


# -- shard prep through the CLI --------------------------------------------------------------


def write_inputs(folder: Path) -> list[str]:
    """Real text: a few corpus documents as .txt files and as a gzipped JSON-lines file."""
    docs = list(load_corpus(shared_cache()).documents[:40])
    folder.mkdir()
    for i, doc in enumerate(docs[:20]):
        (folder / f"doc{i:02d}.txt").write_text(doc, encoding="utf-8")
    with gzip.open(folder / "more.jsonl.gz", "wt", encoding="utf-8") as f:
        for doc in docs[20:]:
            f.write(json.dumps({"text": doc, "id": 1}) + "\n")
    return [*docs[:20], *docs[20:]]  # file order: doc00..doc19.txt, then more.jsonl.gz


def test_prep_via_cli_round_trips_the_tokens(tmp_path: Path) -> None:
    docs = write_inputs(tmp_path / "in")
    out = tmp_path / "shards"
    argv = [
        "data",
        "prep",
        "--input",
        str(tmp_path / "in" / "doc*.txt"),
        str(tmp_path / "in" / "more.jsonl.gz"),
        "--tokenizer",
        TINY.tokenizer,
        "--out",
        str(out),
        "--shard-tokens",
        "3000",
        "--cache-dir",
        str(shared_cache()),
    ]
    assert tessera(argv) == 0
    index = ShardIndex.parse((out / INDEX_NAME).read_bytes())
    tok = load_tokenizer(TINY.tokenizer, cache_dir=shared_cache())
    assert index.dtype == "uint16" and index.tokenizer_sha256 == tokenizer_sha256(tok)
    assert all(s.tokens == 3000 for s in index.shards[:-1]) and len(index.shards) > 2
    stored = np.concatenate([np.load(out / s.name) for s in index.shards])
    expected = np.concatenate([[*tok.encode(d).ids, 0] for d in docs])
    assert stored.dtype == np.uint16 and np.array_equal(stored, expected)

    dataset = Dataset.open(f"file://{out}", TINY.tokenizer, 32, cache_dir=shared_cache())
    assert dataset.n_slots == sum((s.tokens - 1) // 32 for s in index.shards)
    assert np.array_equal(dataset.read_slot(0), expected[:33])
    assert tessera(["data", "info", str(out), "--verify"]) == 0
    assert tessera(argv) == 1  # refuses a non-empty --out
    assert tessera([*argv, "--force"]) == 0


def test_prep_refuses_missing_inputs_and_detects_corrupt_shards(tmp_path: Path) -> None:
    common = ["--tokenizer", TINY.tokenizer, "--cache-dir", str(shared_cache())]
    missing = [
        "data",
        "prep",
        "--input",
        str(tmp_path / "nothing-*.txt"),
        "--out",
        str(tmp_path / "o"),
    ]
    assert tessera([*missing, *common]) == 1
    write_inputs(tmp_path / "in")
    out = tmp_path / "shards"
    prep = ["data", "prep", "--input", str(tmp_path / "in" / "*.txt"), "--out", str(out)]
    assert tessera([*prep, *common, "--shard-tokens", "2000"]) == 0
    shard = out / "shard-000001.npy"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert tessera(["data", "info", str(out), "--verify"]) == 1
    other = load_tokenizer("embedded://tiny-bpe-512", cache_dir=shared_cache())
    with pytest.raises(DataError, match="tokenized with"):
        Dataset.open(str(out), other, 32)


def test_store_source_downloads_verified_shards(tmp_path: Path) -> None:
    write_inputs(tmp_path / "in")
    out = tmp_path / "shards"
    prep = ["data", "prep", "--input", str(tmp_path / "in" / "*.txt"), "--out", str(out)]
    common = ["--tokenizer", TINY.tokenizer, "--cache-dir", str(shared_cache())]
    assert tessera([*prep, *common, "--shard-tokens", "2500"]) == 0
    store = FileStore(tmp_path / "bucket")
    for path in sorted(out.iterdir()):
        store.put(f"datasets/tiny/{path.name}", path.read_bytes())
    local = Dataset.open(str(out), TINY.tokenizer, 32, cache_dir=shared_cache())
    source = StoreShardSource(store, "datasets/tiny", cache_dir=tmp_path / "cache")
    remote = Dataset.open(
        "s3://bucket/datasets/tiny", TINY.tokenizer, 32, source=source, cache_dir=shared_cache()
    )
    assert remote.fingerprint == local.fingerprint
    assert not (tmp_path / "cache").exists()  # shards are fetched lazily, on first read
    for slot in range(local.n_slots):
        assert np.array_equal(remote.read_slot(slot), local.read_slot(slot))
    assert len(list((tmp_path / "cache" / "shards").glob("*.npy"))) == len(local.index.shards)

    key = f"datasets/tiny/{local.index.shards[-1].name}"
    tampered = bytearray(store.get(key, 1 << 20))
    tampered[-1] ^= 1
    store.put(key, bytes(tampered))
    fresh = StoreShardSource(store, "datasets/tiny", cache_dir=tmp_path / "cache2")
    victim = Dataset.open("s3://x", TINY.tokenizer, 32, source=fresh, cache_dir=shared_cache())
    with pytest.raises(DataError, match="sha256"):
        victim.read_slot(victim.n_slots - 1)
    assert list((tmp_path / "cache2" / "shards").iterdir()) == []  # nothing kept, no temps
