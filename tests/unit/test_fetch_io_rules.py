"""Each rule of the concurrent fetch's readers (`protocol.stores.fetch_io`), pinned by a case only
it refuses: an HTTP status, a body shorter than its announced length from a real server on
loopback, and a local bucket whose objects are not plain files."""

from __future__ import annotations

import os
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from protocol.credentials import ReadCredentials
from protocol.stores import open_store
from protocol.stores.errors import (
    AccessDenied,
    ObjectNotFound,
    ObjectTooLarge,
    ServerBusy,
    StoreError,
    StoreUnavailable,
)
from protocol.stores.fetch import FetchRequest, fetch_many
from protocol.stores.fetch_io import check_status, read_file
from protocol.stores.fetch_types import Progress
from protocol.stores.file import FileStore
from tests.support.servers import http_server

KEY = "run/w1/update/obj.tsr"


@pytest.mark.parametrize(
    ("status", "error", "rule"),
    [
        (404, ObjectNotFound, "not found"),
        (403, AccessDenied, "access denied"),
        (302, StoreError, "redirect"),
        (429, ServerBusy, "HTTP 429"),  # a blip: asked again within the budget
        (503, ServerBusy, "HTTP 503"),
        (418, StoreError, "unexpected HTTP 418"),
    ],
)
def test_each_status_maps_to_its_error(status: int, error: type[StoreError], rule: str) -> None:
    check_status(200, KEY, "s3://b")
    with pytest.raises(StoreError, match=rule) as info:
        check_status(status, KEY, "s3://b")
    assert type(info.value) is error  # a 418 or a redirect is refused, not retried as an outage


class _Short(BaseHTTPRequestHandler):
    """Announces 100 bytes, sends 40 and closes the connection."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "100")
        self.end_headers()
        self.wfile.write(b"\x01" * 40)
        self.wfile.flush()
        self.close_connection = True


def test_a_body_shorter_than_announced_is_an_outage() -> None:
    with http_server(_Short) as url:
        store = open_store(f"s3://bucket?endpoint={url}", ReadCredentials(
            access_key_id="reader", secret_access_key="reader-secret"))  # fmt: skip
        request = {0: FetchRequest(store, KEY, 1 << 20)}
        got = fetch_many(request, budget_s=3.0, min_rate_bytes_s=1, grace_s=2.0)[0]
    assert isinstance(got, StoreUnavailable), got


def _read(store: FileStore, key: str, max_bytes: int = 1 << 20, cancelled: bool = False) -> None:
    progress = Progress(started=time.monotonic())
    if cancelled:
        progress.cancelled.set()
    read_file(store, key, max_bytes, progress, None)


def test_a_local_object_that_is_not_a_plain_file_is_refused(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}?bucket=bucket")
    assert isinstance(store, FileStore)
    store.put(KEY, b"x" * 10)
    _read(store, KEY)
    with pytest.raises(StoreUnavailable, match="cancelled"):
        _read(store, KEY, cancelled=True)

    folder = store.directory / "run" / "folder"
    folder.mkdir(parents=True)
    with pytest.raises(ObjectNotFound):
        _read(store, "run/folder")

    loop = store.directory / "run" / "loop"
    loop.symlink_to(loop)
    with pytest.raises(StoreError, match="cannot open"):
        _read(store, "run/loop")

    grows = store.directory / "run" / "grows"  # fstat says 0 bytes, reading gives more
    grows.symlink_to(f"/proc/{os.getpid()}/status")
    with pytest.raises(ObjectTooLarge):
        _read(store, "run/grows", max_bytes=100)
