"""A real browser for the tests: headless Chromium driven over the DevTools protocol.

`evaluate(url, expressions, width)` opens `url` in a fresh headless Chromium with a window
`width` pixels wide, waits until the page has loaded, and returns the value of each JavaScript
expression evaluated in it. `CHROMIUM` is the browser found on the PATH (None: tests skip, and
say why; `scripts/test.sh` installs Debian's ``chromium`` where it can).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
START_S = 30.0


def evaluate(url: str, expressions: list[str], width: int = 800, height: int = 1000) -> list[Any]:
    assert CHROMIUM is not None, "no chromium on the PATH"
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             f"--window-size={width},{height}", "--remote-debugging-port=0",
             f"--user-data-dir={profile}", url],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        try:
            port = _port(Path(profile) / "DevToolsActivePort")
            return asyncio.run(_evaluate(port, url, expressions))
        finally:
            _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Kill the browser and every process it started (its renderers write into the profile
    until they exit), and wait until none is left, so the profile can be removed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def _port(path: Path) -> int:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return int(path.read_text().splitlines()[0])
        time.sleep(0.1)
    raise TimeoutError(f"chromium did not open its DevTools port in {START_S:.0f} s")


async def _evaluate(port: int, url: str, expressions: list[str]) -> list[Any]:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/json/list") as answer:
            pages = [t for t in await answer.json() if t["type"] == "page"]
        async with http.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            ids = iter(range(1, 1 << 30))

            async def run(expression: str) -> Any:
                call = next(ids)
                params = {"expression": expression, "returnByValue": True, "awaitPromise": True}
                await ws.send_str(
                    json.dumps({"id": call, "method": "Runtime.evaluate", "params": params})
                )
                while True:
                    message = json.loads((await ws.receive(timeout=START_S)).data)
                    if message.get("id") == call:
                        result = message["result"]
                        if "exceptionDetails" in result:
                            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
                        return result["result"].get("value")

            deadline = time.monotonic() + START_S
            loaded = f"location.href === {json.dumps(url)} && document.readyState === 'complete'"
            while not await run(loaded):
                if time.monotonic() > deadline:
                    raise TimeoutError("the page did not finish loading")
                await asyncio.sleep(0.1)
            return [await run(e) for e in expressions]
