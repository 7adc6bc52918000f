"""A hostile S3 endpoint (a peer may publish any endpoint) cannot make us download unbounded data."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from protocol.credentials import ReadCredentials
from protocol.stores import (
    ObjectTooLarge,
    RetryPolicy,
    S3Config,
    S3Store,
    StoreError,
    StoreUnavailable,
    open_store,
)
from tests.support.servers import http_server

MIB = 1 << 20
SERVER_LIMIT = 256 * MIB  # the fake server gives up after this much, whatever happens


class _Hostile(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    mode = "endless-chunked"
    sent = 0
    lock = threading.Lock()

    def log_message(self, *args: object) -> None:  # keep test output quiet
        pass

    def _endless_chunks(self) -> None:
        chunk = b"\xab" * (256 << 10)
        frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
        try:
            while _Hostile.sent < SERVER_LIMIT:
                self.wfile.write(frame)
                with _Hostile.lock:
                    _Hostile.sent += len(chunk)
        except OSError:
            pass  # the client hung up: good
        self.close_connection = True

    def do_GET(self) -> None:
        if self.mode == "huge-length":
            self.send_response(200)
            self.send_header("Content-Length", str(50 * 1024**3))  # "50 GB"
            self.send_header("ETag", '"x"')
            self.end_headers()
            self._endless_chunks()  # raw bytes; the client must not read them
            return
        self.send_response(206 if self.mode == "lying-range" else 200)
        if self.mode == "lying-range":
            self.send_header("Content-Range", "bytes 0-99/100")
            self.send_header("Content-Length", "100")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("ETag", '"x"')
        self.end_headers()
        self._endless_chunks()


@pytest.fixture
def hostile_endpoint() -> Iterator[str]:
    with http_server(_Hostile) as url:
        yield url


def _store(endpoint: str) -> S3Store:
    store = open_store(
        f"s3://victim-bucket?endpoint={endpoint}",
        ReadCredentials(access_key_id="peer-read-key", secret_access_key="peer-read-secret"),
        s3_config=S3Config(
            download_part_size=1 * MIB,
            read_timeout=5,
            botocore_max_attempts=1,
            retry=RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.02),
        ),
    )
    assert isinstance(store, S3Store)
    return store


@pytest.mark.parametrize(
    ("mode", "error"),
    [
        ("endless-chunked", StoreError),  # no length at all: refused before reading
        ("lying-range", StoreError),  # announces 100 bytes, streams forever
        ("huge-length", ObjectTooLarge),  # announces 50 GB: refused by the cap
    ],
)
def test_hostile_endpoint_is_bounded(
    hostile_endpoint: str, mode: str, error: type[Exception], tmp_path: Path
) -> None:
    _Hostile.mode, _Hostile.sent = mode, 0
    store = _store(hostile_endpoint)
    with pytest.raises(error) as info:
        store.get("update.bin", max_bytes=10 * MIB)
    assert not isinstance(info.value, StoreUnavailable)  # refused, not retried as an outage
    with pytest.raises(error):
        store.get_to_file("update.bin", tmp_path / "u.bin", max_bytes=10 * MIB)
    assert list(tmp_path.iterdir()) == []
    assert store.stats.bytes_downloaded <= 200  # at most the 100 announced bytes, twice
    # What the server pushed is bounded by socket buffers, far below its endless stream.
    assert _Hostile.sent < 64 * MIB
