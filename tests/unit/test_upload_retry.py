"""An upload that fails for a reason that may pass is tried again until the window's deadline,
and an earlier try that was stored though its answer was lost is not uploaded again.

The store is a real file store behind a wrapper that injects the faults a provider shows: a
throttle for the first tries, an answer lost after the object was stored, a refused key.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from substrateinterface import Keypair

from node.window import exchange
from node.window.exchange import publish
from protocol.naming import update_key
from protocol.runconfig import RunConfig
from protocol.stores import AccessDenied, ObjectStore, ServerBusy, StoreError
from protocol.stores.file import FileStore

RUN = RunConfig.preset("tiny", name="upload-retry", inner_steps=2)
DATA = b"signed update bytes" * 100
HOTKEY = Keypair.create_from_uri("//upload-retry").ss58_address
KEY = update_key(RUN.run_id, 4, 3, HOTKEY)


class Faulty:
    """A real store whose first `fail` puts raise `error` (after storing, if `stored_first`)."""

    def __init__(
        self, inner: ObjectStore, fail: int, error: StoreError, stored_first: bool = False
    ) -> None:
        self.inner, self.fail, self.error, self.stored_first = inner, fail, error, stored_first
        self.puts = 0

    def put(self, key: str, data: bytes) -> None:
        self.puts += 1
        if self.puts <= self.fail:
            if self.stored_first:
                self.inner.put(key, data)
            raise self.error
        self.inner.put(key, data)

    def head(self, key: str):  # noqa: ANN201 - the inner store's ObjectInfo
        return self.inner.head(key)


@pytest.fixture(autouse=True)
def _quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exchange, "UPLOAD_RETRY_S", 0.05)


def _publish(store: Faulty, until: float | None) -> None:
    publish(store, DATA, RUN, 4, 3, HOTKEY, until=until)  # type: ignore[arg-type]


def test_a_throttled_upload_is_tried_again_until_it_lands(tmp_path: Path) -> None:
    store = Faulty(FileStore(tmp_path / "b"), fail=5, error=ServerBusy("HTTP 503"))
    _publish(store, time.time() + 60)
    assert store.puts == 6
    assert store.inner.get(KEY, len(DATA)) == DATA


def test_without_a_deadline_one_failure_is_final(tmp_path: Path) -> None:
    store = Faulty(FileStore(tmp_path / "b"), fail=1, error=ServerBusy("HTTP 503"))
    with pytest.raises(ServerBusy):
        _publish(store, None)
    assert store.puts == 1


def test_a_stored_try_whose_answer_was_lost_is_not_uploaded_again(tmp_path: Path) -> None:
    store = Faulty(FileStore(tmp_path / "b"), fail=1, error=ServerBusy("lost"), stored_first=True)
    _publish(store, time.time() + 60)
    assert store.puts == 1  # a second put would move its Last-Modified
    assert store.inner.get(KEY, len(DATA)) == DATA


def test_a_refused_key_is_not_tried_again(tmp_path: Path) -> None:
    store = Faulty(FileStore(tmp_path / "b"), fail=99, error=AccessDenied("rotated key"))
    with pytest.raises(AccessDenied):
        _publish(store, time.time() + 60)
    assert store.puts == 1


def test_tries_stop_at_the_deadline(tmp_path: Path) -> None:
    store = Faulty(FileStore(tmp_path / "b"), fail=10**6, error=ServerBusy("HTTP 503"))
    begun = time.time()
    with pytest.raises(ServerBusy):
        _publish(store, begun + 1.0)
    assert time.time() - begun >= 1.0 - exchange.UPLOAD_RETRY_S
    assert store.puts > 1
