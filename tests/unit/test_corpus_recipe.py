"""Corpus recipes: pinned downloads over loopback HTTP, hostile archives, pins, the CLI."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import tarfile
import threading
import urllib.request
import zipfile
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from commands.cli import main as tessera
from node.data.archives import read_members
from node.data.dataset import Dataset
from node.data.download import download_path, fetch_pinned
from node.data.recipe import Artifact, CorpusRecipe, load_recipe
from node.data.recipe_build import build_corpus
from node.data.shards import INDEX_NAME, DataError, ShardIndex
from tests.support.embedded_data import TINY, shared_cache

REPO = Path(__file__).resolve().parents[2]

DOCS = {
    "pkg-1.0/docs/intro.txt": "An introduction to the package, in plain words.\n",
    "pkg-1.0/docs/guide.rst": "Guide\n=====\n\nHow to use the package, step by step.\n",
    "pkg-1.0/pkg/core.py": '"""Core helpers."""\n\n\ndef add(a, b):\n    """Sum."""\n    return a + b\n',
    "pkg-1.0/tests/test_core.py": "def test_add():\n    assert True\n",
    "pkg-1.0/pkg/data.bin": "not selected",
}
WHEEL = {
    "other/__init__.py": '"""The other package: small, documented."""\n',
    "other-2.0.dist-info/METADATA": "Name: other\nVersion: 2.0\n",
}


# -- archives and a loopback server ----------------------------------------------------------


def write_tar(path: Path, files: dict[str, str], extra: tuple[tarfile.TarInfo, ...] = ()) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
        for info in extra:
            tar.addfile(info)
    return path


def write_zip(path: Path, files: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return path


class _RangeHandler(SimpleHTTPRequestHandler):
    """Serves the test's folder; answers a ``Range: bytes=N-`` request with 206 and the rest."""

    ranges: ClassVar[list[str | None]] = []

    def do_GET(self) -> None:
        wanted = self.headers.get("Range")
        type(self).ranges.append(wanted)
        path = Path(self.translate_path(self.path))
        if not wanted or not path.is_file():
            return super().do_GET()
        data = path.read_bytes()[int(wanted.removeprefix("bytes=").rstrip("-")) :]
        self.send_response(206)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A folder and the http://127.0.0.1:PORT URL serving it."""
    root = tmp_path / "www"
    root.mkdir()
    _RangeHandler.ranges = []
    handler = lambda *a, **k: _RangeHandler(*a, directory=str(root), **k)  # noqa: E731
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def artifact(path: Path, base_url: str, **kw: Any) -> Artifact:
    data = path.read_bytes()
    fields: dict[str, Any] = {
        "name": path.name.split("-")[0],
        "version": "1.0",
        "filename": path.name,
        "url": f"{base_url}/{path.name}",
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "include": ("*.py", "*.txt", "*.rst"),
        "exclude": ("*/tests/*",),
    }
    return Artifact(**{**fields, **kw})


def recipe(*arts: Artifact, **kw: Any) -> CorpusRecipe:
    fields: dict[str, Any] = {
        "name": "test-corpus",
        "tokenizer": TINY.tokenizer,
        "shard_tokens": 64,
        "max_member_bytes": 10_000,
        "max_archive_text_bytes": 100_000,
        "artifact": arts,
    }
    return CorpusRecipe(**{**fields, **kw})


def two_archives(root: Path, base_url: str) -> CorpusRecipe:
    tar = write_tar(root / "pkg-1.0.tar.gz", DOCS)
    whl = write_zip(root / "other-2.0-py3-none-any.whl", WHEEL)
    return recipe(artifact(tar, base_url), artifact(whl, base_url))


def pinned(r: CorpusRecipe, out: Path, cache: Path) -> CorpusRecipe:
    built = build_corpus(r, out, cache_dir=cache)
    return r.model_copy(
        update={
            "text_sha256": built.text_sha256,
            "tokens": built.index.total_tokens,
            "digest": built.index.digest,
        }
    )


# -- building ---------------------------------------------------------------------------------


def test_recipe_builds_the_same_corpus_twice_and_logs_progress(
    served: tuple[Path, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root, url = served
    r = two_archives(root, url)
    caplog.set_level(logging.INFO, logger="tessera")
    first = build_corpus(r, tmp_path / "a", cache_dir=shared_cache())
    second = build_corpus(r, tmp_path / "b", cache_dir=shared_cache())
    assert first.index.digest == second.index.digest and first.text_sha256 == second.text_sha256
    assert first.documents == 4  # intro, guide, core.py, other/__init__.py; not tests/, not .bin
    dataset = Dataset.open(str(tmp_path / "a"), TINY.tokenizer, 16, cache_dir=shared_cache())
    assert dataset.total_tokens == first.index.total_tokens > 64  # several shards
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "downloaded pkg-1.0.tar.gz" in text and "pkg 1.0: 3 files" in text
    assert "other 1.0: 1 files" in text and "digest sha256:" in text


def test_pins_are_checked_text_first_then_tokens(served: tuple[Path, str], tmp_path: Path) -> None:
    root, url = served
    cache = shared_cache()
    r = pinned(two_archives(root, url), tmp_path / "first", cache)
    assert build_corpus(r, tmp_path / "again", cache_dir=cache).index.digest == r.digest

    changed = write_tar(root / "pkg-1.0.tar.gz", {**DOCS, "pkg-1.0/docs/intro.txt": "Other.\n"})
    moved = r.model_copy(update={"artifact": (artifact(changed, url), r.artifact[1])})
    with pytest.raises(
        DataError, match=r"other text than it pins .text_sha256 [0-9a-f]{64}, recipe"
    ):
        build_corpus(moved, tmp_path / "changed", cache_dir=cache)
    assert not (tmp_path / "changed" / INDEX_NAME).exists()

    wrong = r.model_copy(update={"digest": "sha256:" + "0" * 64})
    with pytest.raises(DataError, match=f"digest {r.digest}, recipe sha256:0000"):
        build_corpus(wrong, tmp_path / "wrong", cache_dir=cache)
    assert not (tmp_path / "wrong" / INDEX_NAME).exists()  # never taken for the pinned corpus


def test_a_wrong_sha256_is_refused_before_any_archive_is_read(
    served: tuple[Path, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root, url = served
    good = two_archives(root, url)
    bad = good.artifact[1].model_copy(update={"sha256": "ab" * 32})
    caplog.set_level(logging.INFO, logger="tessera")
    with pytest.raises(DataError, match=r"other-2.0-py3-none-any.whl has sha256 [0-9a-f]{64}, not"):
        build_corpus(recipe(good.artifact[0], bad), tmp_path / "out", cache_dir=shared_cache())
    assert not any("files (" in rec.getMessage() for rec in caplog.records)  # nothing was read
    assert not (tmp_path / "out").exists()
    kept = download_path(bad.filename, bad.sha256, shared_cache())
    assert not kept.exists() and not kept.with_name(kept.name + ".part").exists()


def test_a_tampered_cached_download_is_fetched_again(
    served: tuple[Path, str], tmp_path: Path
) -> None:
    root, url = served
    art = artifact(write_tar(root / "pkg-1.0.tar.gz", DOCS), url)
    path = fetch_pinned(art.url, art.filename, art.size, art.sha256, cache_dir=tmp_path)
    path.write_bytes(
        write_tar(tmp_path / "evil.tar.gz", {"pkg-1.0/docs/x.txt": "evil"}).read_bytes()
    )
    again = fetch_pinned(art.url, art.filename, art.size, art.sha256, cache_dir=tmp_path)
    assert hashlib.sha256(again.read_bytes()).hexdigest() == art.sha256


def test_an_interrupted_download_resumes_where_it_stopped(
    served: tuple[Path, str], tmp_path: Path
) -> None:
    root, url = served
    art = artifact(write_tar(root / "pkg-1.0.tar.gz", DOCS), url)
    dest = download_path(art.filename, art.sha256, tmp_path)
    dest.parent.mkdir(parents=True)
    half = art.size // 2
    dest.with_name(dest.name + ".part").write_bytes((root / art.filename).read_bytes()[:half])
    seen: list[int] = []
    fetch_pinned(
        art.url, art.filename, art.size, art.sha256, cache_dir=tmp_path, on_bytes=seen.append
    )
    assert _RangeHandler.ranges == [f"bytes={half}-"] and seen[0] == half
    assert dest.read_bytes() == (root / art.filename).read_bytes()


def test_a_server_sending_more_than_the_pinned_size_is_cut_off(
    served: tuple[Path, str], tmp_path: Path
) -> None:
    root, url = served
    art = artifact(write_tar(root / "pkg-1.0.tar.gz", DOCS), url)
    small = art.model_copy(update={"size": art.size - 10})
    with pytest.raises(DataError, match="sends more than"):
        fetch_pinned(small.url, small.filename, small.size, small.sha256, cache_dir=tmp_path)


# -- hostile archives -------------------------------------------------------------------------


def _link(name: str, target: str, kind: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


def test_links_and_climbing_names_are_skipped(tmp_path: Path) -> None:
    extra = (
        _link("pkg-1.0/docs/sym.txt", "intro.txt", tarfile.SYMTYPE),
        _link("pkg-1.0/docs/hard.txt", "pkg-1.0/docs/intro.txt", tarfile.LNKTYPE),
    )
    files = {**DOCS, "../escape.txt": "climbs out", "/abs/root.txt": "absolute"}
    tar = write_tar(tmp_path / "t.tar.gz", files, extra)
    members, stats = read_members(
        tar, include=("*.txt",), max_member_bytes=1000, max_total_bytes=10_000
    )
    assert [m.name for m in members] == ["pkg-1.0/docs/intro.txt"]
    assert sorted(stats.unsafe) == sorted(
        ["pkg-1.0/docs/sym.txt", "pkg-1.0/docs/hard.txt", "../escape.txt", "/abs/root.txt"]
    )
    assert not (tmp_path.parent / "escape.txt").exists()

    zpath = tmp_path / "z.whl"
    with zipfile.ZipFile(zpath, "w") as archive:
        archive.writestr("a/real.txt", "real text")
        link = zipfile.ZipInfo("a/link.txt")
        link.external_attr = 0o120777 << 16  # a symbolic link whose body is its target
        archive.writestr(link, "/etc/passwd")
        archive.writestr("a/../../up.txt", "climbs")
    members, stats = read_members(
        zpath, include=("*.txt",), max_member_bytes=99, max_total_bytes=999
    )
    assert [(m.name, m.data) for m in members] == [("a/real.txt", b"real text")]
    assert sorted(stats.unsafe) == ["a/../../up.txt", "a/link.txt"]


def test_member_and_archive_size_caps(tmp_path: Path) -> None:
    files = {"p/small.txt": "x" * 100, "p/big.txt": "y" * 5000}
    for path in (write_tar(tmp_path / "t.tar.gz", files), write_zip(tmp_path / "t.zip", files)):
        members, stats = read_members(
            path, include=("*.txt",), max_member_bytes=1000, max_total_bytes=10_000
        )
        assert [m.name for m in members] == ["p/small.txt"] and stats.too_large == ["p/big.txt"]
        with pytest.raises(DataError, match="more than 50 bytes of selected files"):
            read_members(path, include=("*.txt",), max_member_bytes=1000, max_total_bytes=50)


# -- recipe files and the CLI -----------------------------------------------------------------


def _toml(r: CorpusRecipe) -> str:
    lines = [
        f"{k} = {json.dumps(v)}"
        for k, v in r.model_dump(exclude={"artifact"}).items()
        if v is not None
    ]
    for art in r.artifact:
        lines.append("[[artifact]]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in art.model_dump().items()]
    return "\n".join(lines) + "\n"


def test_cli_builds_a_recipe_then_info_shows_it_and_errors_are_one_line(
    served: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, url = served
    r = two_archives(root, url)
    path = tmp_path / "r.toml"
    path.write_text(_toml(r))
    assert load_recipe(path) == r
    out = tmp_path / "out"
    argv = [
        "data",
        "prep",
        "--recipe",
        str(path),
        "--out",
        str(out),
        "--cache-dir",
        str(shared_cache()),
    ]
    assert tessera(argv) == 0
    printed = capsys.readouterr().out
    index = ShardIndex.parse((out / INDEX_NAME).read_bytes())
    assert f'digest = "{index.digest}"' in printed and f"tokens = {index.total_tokens}" in printed
    assert tessera(["data", "info", str(out), "--verify"]) == 0
    assert index.digest[:32] in capsys.readouterr().out  # the table may cut it short

    path.write_text(_toml(r.model_copy(update={"digest": "sha256:" + "1" * 64})))
    assert tessera([*argv, "--force"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "recipe sha256:1111" in err and index.digest in err
    assert tessera([*argv, "--force", "--tokenizer", TINY.tokenizer]) == 1
    assert "a --recipe names its own" in capsys.readouterr().err
    path.write_text(_toml(r).replace("max_member_bytes", "max_member_byte"))
    assert tessera([*argv, "--force"]) == 1
    assert "max_member_bytes: Field required" in capsys.readouterr().err


def test_a_missing_prepared_folder_says_how_to_build_it(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"`tessera data prep --out .*absent` .*--recipe"):
        Dataset.open(str(tmp_path / "absent"), TINY.tokenizer, 16, cache_dir=shared_cache())


def test_the_pinned_recipe_loads_and_its_first_archive_matches_pypi() -> None:
    r = load_recipe(REPO / "lab" / "corpora" / "pypi-text.toml")
    assert r.digest is not None and r.tokens is not None and r.tokens >= 30_000_000
    if os.environ.get("TESSERA_NETWORK_TESTS") != "1":
        pytest.skip("set TESSERA_NETWORK_TESTS=1 to check the pinned sha256 against PyPI")
    first = r.artifact[0]
    with urllib.request.urlopen(f"https://pypi.org/pypi/{first.name}/json", timeout=30) as response:
        files = json.load(response)["releases"][first.version]
    match = [f for f in files if f["filename"] == first.filename]
    assert match and match[0]["digests"]["sha256"] == first.sha256
    assert match[0]["size"] == first.size
