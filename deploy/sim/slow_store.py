"""A hostile S3-compatible server: serves a folder's objects, politely or not at all.

What a bucket owner who controls its own endpoint can do to its readers, for tests and for the
simulation's ``slowdrip`` adversary. Objects are the files under ``root/<bucket>/<key>``, served at
path-style URLs (``GET``/``HEAD /<bucket>/<key>``); authentication is ignored. Modes:

* ``normal``: a plain S3 answer (ETag, Last-Modified, Content-Length);
* ``drip_headers``: the status line, then one header line per second, forever;
* ``drip_body``: honest headers, then one body byte per second;
* ``hang``: accepts the connection and never answers;
* ``redirect``: ``307`` to the same object with ``?followed=1`` appended, where it is served
  (a reader that follows redirects gets the object; ours must refuse);
* ``oversize``: announces an honest Content-Length, then sends more bytes than it announced;
* ``no_length``: announces no length and streams 4 MiB until it closes the connection.

Use `SlowStore` as a context manager in tests (a thread running its own event loop, stopped on
exit) or `serve(root, port, mode)` as a blocking call in an adversary process.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from email.utils import formatdate
from pathlib import Path
from types import TracebackType

MODES = ("normal", "drip_headers", "drip_body", "hang", "redirect", "oversize", "no_length")
DRIP_S = 1.0


class _Handler:
    def __init__(self, root: Path, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.root, self.mode = root, mode

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await reader.readuntil(b"\r\n\r\n")
            method, path = request.split(b" ", 2)[:2]
            target = path.decode()
            followed = target.endswith("?followed=1")
            await self._answer(writer, method.decode(), target.split("?")[0], followed)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    def _file(self, path: str) -> Path | None:
        from urllib.parse import unquote

        target = (self.root / unquote(path).lstrip("/")).resolve()
        inside = target.is_relative_to(self.root.resolve())
        return target if inside and target.is_file() else None

    async def _answer(
        self, writer: asyncio.StreamWriter, method: str, path: str, followed: bool = False
    ) -> None:
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "redirect":
            writer.write(
                b"HTTP/1.1 307 Temporary Redirect\r\nLocation: http://169.254.169.254/\r\n"
            )
            writer.write(b"Content-Length: 0\r\n\r\n")
            return await writer.drain()
        found = self._file(path)
        if found is None:
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            return await writer.drain()
        data = found.read_bytes()
        headers = [
            b"HTTP/1.1 200 OK",
            f"Content-Length: {len(data)}".encode(),
            f'ETag: "{hashlib.md5(data).hexdigest()}"'.encode(),
            f"Last-Modified: {formatdate(found.stat().st_mtime, usegmt=True)}".encode(),
            b"Content-Type: application/octet-stream",
        ]
        if self.mode == "drip_headers":
            for line in headers:
                writer.write(line + b"\r\n")
                await writer.drain()
                await asyncio.sleep(DRIP_S)
            while True:
                writer.write(b"X-Drip: 1\r\n")
                await writer.drain()
                await asyncio.sleep(DRIP_S)
        if self.mode == "no_length":
            headers = [h for h in headers if not h.startswith(b"Content-Length")]
            headers.append(b"Connection: close")
            data = data + b"\0" * (4 << 20)
        writer.write(b"\r\n".join(headers) + b"\r\n\r\n")
        if method == "HEAD":
            return await writer.drain()
        if self.mode == "drip_body":
            for i in range(len(data)):
                writer.write(data[i : i + 1])
                await writer.drain()
                await asyncio.sleep(DRIP_S)
        elif self.mode == "oversize":
            writer.write(data + b"\0" * (4 << 20))
        else:
            writer.write(data)
        await writer.drain()


async def _start(root: Path, port: int, mode: str) -> asyncio.Server:
    return await asyncio.start_server(_Handler(root, mode), "127.0.0.1", port)


def serve(root: Path, port: int, mode: str) -> None:
    """Serve `root` on 127.0.0.1:`port` in `mode` until the process is killed."""

    async def main() -> None:
        server = await _start(root, port, mode)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


class SlowStore:
    """`with SlowStore(root, mode) as endpoint:` — a server on a free port for the block."""

    def __init__(self, root: Path, mode: str = "normal") -> None:
        self.root, self.mode = root, mode
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None

    def __enter__(self) -> str:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(_start(self.root, 0, self.mode), self._loop)
        self._server = fut.result(10)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        async def stop() -> None:
            assert self._server is not None
            self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
