"""A subtensor endpoint that accepts the websocket and then says nothing fails the call within the
client's timeout (`ChainUnavailable`), instead of blocking the node forever with the chain lock
held."""

from __future__ import annotations

import base64
import hashlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from protocol.chain import subtensor
from protocol.chain.errors import ChainUnavailable

WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455's fixed handshake suffix


def _serve_silently(server: socket.socket, stop: threading.Event, answer: bool) -> None:
    server.settimeout(0.1)
    held = []
    while not stop.is_set():
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        held.append(conn)
        if not answer:
            continue  # accept, never complete the handshake
        request = b""
        while b"\r\n\r\n" not in request:
            request += conn.recv(4096)
        key = next(
            line.split(b":", 1)[1].strip()
            for line in request.split(b"\r\n")
            if line.lower().startswith(b"sec-websocket-key:")
        )
        accept = base64.b64encode(hashlib.sha1(key + WS_GUID.encode()).digest())
        conn.sendall(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n\r\n"
        )  # then silence: no frame ever comes
    for conn in held:
        conn.close()


@pytest.fixture(params=[False, True], ids=["silent-handshake", "silent-after-handshake"])
def silent_node(request: pytest.FixtureRequest) -> Iterator[str]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    stop = threading.Event()
    thread = threading.Thread(target=_serve_silently, args=(server, stop, request.param))
    thread.start()
    try:
        yield f"ws://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        server.close()


def test_a_silent_node_fails_the_call_within_the_timeout(
    silent_node: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(subtensor, "CALL_TIMEOUT_S", 0.5)
    t0 = time.monotonic()
    with pytest.raises(ChainUnavailable, match="cannot reach"):
        chain = subtensor.SubtensorChain(silent_node, 1)
        chain.block()
    assert time.monotonic() - t0 < 10  # a few timeouts at most, never forever
