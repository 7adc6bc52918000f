"""A hostile S3-compatible server: serves a folder's objects, politely or not at all.

What a bucket owner who runs its own endpoint can do to its readers, for tests and for the
simulation's ``slowdrip`` adversary. The object ``<bucket>/<key>`` is the file
``root/<bucket>/<key>``, served at path-style URLs: ``GET``/``HEAD /<bucket>/<key>``, and a minimal
ListObjectsV2 at ``GET /<bucket>?list-type=2&prefix=...`` (one page, no continuation).
Authentication is ignored. Every answer carries ``Connection: close``. Modes:

* ``normal``: a plain S3 answer (ETag = quoted MD5, Last-Modified, Content-Length);
* ``drip_headers``: the status line, then one header line per `DRIP_S`, forever;
* ``drip_body``: honest headers (with Content-Length), then one body byte per `DRIP_S` on average;
* ``hang``: accepts the connection, reads the request, never answers;
* ``redirect``: ``307`` to the same object with ``?followed=1`` appended, where it is served
  (a reader that follows redirects gets the object; ours must refuse);
* ``oversize``: an honest Content-Length, then 4 MiB more than it announced;
* ``no_length``: no Content-Length; the object and then 4 MiB of zeros until it closes;
* ``deny``: ``403 AccessDenied`` for everything;
* ``no_time``: a plain answer without Last-Modified (a self-hosted server hiding its clock);
* ``busy_once``: ``503 SlowDown`` to the first request for each object, then plain answers.

Two ways to run it:

* in a test, a background thread with its own event loop, stopped (connections included) on exit::

      with SlowStore(root, "hang") as endpoint:   # "http://127.0.0.1:PORT"
          store = S3Store("bucket", read_credentials, endpoint=endpoint)

  `SlowStore.requests` lists every request it received (method, raw target, headers);
* in an adversary process, blocking until the process is killed::

      serve(root, port, "drip_body")               # or host="0.0.0.0" to be reachable from outside

Implemented on plain asyncio streams rather than aiohttp's web server on purpose: a web framework
writes a response head in one piece, and dripping it line by line needs byte-level control.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from dataclasses import dataclass, field
from email.utils import formatdate
from pathlib import Path
from types import TracebackType
from urllib.parse import parse_qs, unquote, urlsplit
from xml.sax.saxutils import escape

__all__ = ["DRIP_S", "MODES", "SeenRequest", "SlowStore", "serve"]

MODES = (
    "normal", "drip_headers", "drip_body", "hang", "redirect", "oversize", "no_length", "deny",
    "no_time", "busy_once",
)  # fmt: skip
DRIP_S = 1.0
"""Seconds between two dripped header lines or body bytes."""
_EXTRA = 4 << 20  # bytes beyond the object in oversize/no_length modes
_BODY_MODES = ("drip_body", "oversize", "no_length")  # applied to 200 answers only


@dataclass(frozen=True)
class SeenRequest:
    """One request as received: the raw (still percent-encoded) target, lower-case headers."""

    method: str
    target: str
    headers: dict[str, str]


@dataclass
class _Answer:
    status: str
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""


class _Handler:
    """Answers one connection (one request) in the server's mode."""

    def __init__(self, root: Path, mode: str, drip_s: float) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.root, self.mode, self.drip_s = root.resolve(), mode, drip_s
        self.answered: set[str] = set()  # busy_once: the targets already refused once
        self.requests: list[SeenRequest] = []
        self.tasks: set[asyncio.Task[None]] = set()

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            seen = _parse_request(await reader.readuntil(b"\r\n\r\n"))
            self.requests.append(seen)
            if self.mode == "hang":
                await asyncio.Event().wait()
            await self._send(writer, self._answer(seen), seen.method == "HEAD")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        except asyncio.CancelledError:  # the server is stopping: end quietly (3.11 logs it)
            pass
        except (ValueError, UnicodeDecodeError):
            writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        finally:
            self.tasks.discard(task)
            writer.close()

    def _answer(self, seen: SeenRequest) -> _Answer:
        parts = urlsplit(seen.target)
        query = parse_qs(parts.query)
        if self.mode == "deny":
            return _error("403 Forbidden", "AccessDenied")
        if self.mode == "busy_once" and parts.path not in self.answered:
            self.answered.add(parts.path)
            return _error("503 Service Unavailable", "SlowDown")
        if self.mode == "redirect" and "followed" not in query:
            host = seen.headers.get("host", "127.0.0.1")
            sep = "&" if parts.query else "?"
            where = f"http://{host}{seen.target}{sep}followed=1"
            return _Answer("307 Temporary Redirect", [("Location", where)])
        bucket, _, key = unquote(parts.path).lstrip("/").partition("/")
        if not key:
            return self._listing(bucket, query.get("prefix", [""])[-1])
        found = self._file(bucket, key)
        if found is None:
            return _error("404 Not Found", "NoSuchKey")
        return _object_answer(found)

    def _file(self, bucket: str, key: str) -> Path | None:
        target = (self.root / bucket / key).resolve()
        inside = target.is_relative_to(self.root / bucket) and bool(bucket)
        return target if inside and target.is_file() else None

    def _listing(self, bucket: str, prefix: str) -> _Answer:
        base = (self.root / bucket).resolve()
        if not bucket or not base.is_relative_to(self.root) or not base.is_dir():
            return _error("404 Not Found", "NoSuchBucket")
        files = sorted(p for p in base.rglob("*") if p.is_file())
        entries = [(p.relative_to(base).as_posix(), p) for p in files]
        contents = "".join(
            f"<Contents><Key>{escape(key)}</Key><Size>{p.stat().st_size}</Size>"
            f"<LastModified>{_iso(p)}</LastModified><ETag>&quot;{_md5(p)}&quot;</ETag></Contents>"
            for key, p in entries
            if key.startswith(prefix)
        )
        xml = (
            '<?xml version="1.0" encoding="UTF-8"?>'
            '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix>"
            f"<KeyCount>{contents.count('<Contents>')}</KeyCount><MaxKeys>1000</MaxKeys>"
            f"<IsTruncated>false</IsTruncated>{contents}</ListBucketResult>"
        ).encode()
        return _Answer("200 OK", [("Content-Type", "application/xml")], xml)

    async def _send(self, writer: asyncio.StreamWriter, answer: _Answer, head_only: bool) -> None:
        body = b"" if head_only else answer.body
        headers = [("Content-Length", str(len(answer.body))), *answer.headers]
        mode = self.mode if answer.status.startswith("200") or self.mode == "drip_headers" else ""
        if mode == "no_length":
            headers, body = headers[1:], body + b"\0" * _EXTRA
        if mode == "no_time":
            headers = [(k, v) for k, v in headers if k != "Last-Modified"]
        lines = [f"HTTP/1.1 {answer.status}", *(f"{k}: {v}" for k, v in headers)]
        lines.append("Connection: close")
        if mode == "drip_headers":
            await self._drip_lines(writer, lines)
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        if mode == "drip_body":
            await self._drip_bytes(writer, body)
        elif mode == "oversize" and not head_only:
            writer.write(body + b"\0" * _EXTRA)
        else:
            writer.write(body)
        await writer.drain()

    async def _drip_lines(self, writer: asyncio.StreamWriter, lines: list[str]) -> None:
        for line in lines:
            writer.write(line.encode() + b"\r\n")
            await writer.drain()
            await asyncio.sleep(self.drip_s)
        while True:
            writer.write(b"X-Drip: 1\r\n")
            await writer.drain()
            await asyncio.sleep(self.drip_s)

    async def _drip_bytes(self, writer: asyncio.StreamWriter, body: bytes) -> None:
        """One byte per `drip_s` on average: each wake-up sends the bytes due by then, so a
        loaded machine that wakes the server late does not slow the drip below its rate."""
        loop = asyncio.get_running_loop()
        begun, sent = loop.time(), 0
        while sent < len(body):
            due = max(sent + 1, int((loop.time() - begun) / self.drip_s) + 1)
            writer.write(body[sent:due])
            await writer.drain()
            sent = min(due, len(body))
            await asyncio.sleep(self.drip_s)


def _parse_request(head: bytes) -> SeenRequest:
    lines = head.decode("latin-1").split("\r\n")
    method, target, _version = lines[0].split(" ", 2)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return SeenRequest(method, target, headers)


def _error(status: str, code: str) -> _Answer:
    xml = f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code></Error>".encode()
    return _Answer(status, [("Content-Type", "application/xml")], xml)


def _object_answer(path: Path) -> _Answer:
    data = path.read_bytes()
    return _Answer(
        "200 OK",
        [
            ("ETag", f'"{hashlib.md5(data, usedforsecurity=False).hexdigest()}"'),
            ("Last-Modified", formatdate(path.stat().st_mtime, usegmt=True)),
            ("Content-Type", "application/octet-stream"),
        ],
        data,
    )


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes(), usedforsecurity=False).hexdigest()


def _iso(path: Path) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(path.stat().st_mtime, UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def serve(root: Path, port: int, mode: str, *, host: str = "127.0.0.1") -> None:
    """Serve `root` on `host`:`port` in `mode`, blocking until the process is killed."""
    handler = _Handler(Path(root), mode, DRIP_S)

    async def main() -> None:
        server = await asyncio.start_server(handler, host, port)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


class SlowStore:
    """``with SlowStore(root, mode) as endpoint:`` a server on a free loopback port for the block.

    `endpoint` is ``http://127.0.0.1:PORT``; `requests` lists what it received. On exit the
    listening socket and every open connection are closed and the server's thread is joined."""

    def __init__(self, root: Path, mode: str = "normal", *, drip_s: float = DRIP_S) -> None:
        self._handler = _Handler(Path(root), mode, drip_s)
        self.mode = mode
        self.endpoint = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"slow-store-{mode}", daemon=True
        )
        self._server: asyncio.Server | None = None

    @property
    def requests(self) -> list[SeenRequest]:
        return list(self._handler.requests)

    def __enter__(self) -> str:
        self._thread.start()
        start = asyncio.start_server(self._handler, "127.0.0.1", 0)
        self._server = asyncio.run_coroutine_threadsafe(start, self._loop).result(10)
        port = self._server.sockets[0].getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{port}"
        return self.endpoint

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        tasks = list(self._handler.tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
