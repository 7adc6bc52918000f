"""`fetch_many(on_done=...)`: each transfer is handed to the caller as it ends, on the caller's
thread, while slower ones still run: what a node needs to decode updates as they land."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from lab.sim.slow_store import SlowStore
from protocol.credentials import ReadCredentials
from protocol.stores import S3Store, open_store
from protocol.stores.fetch import FetchRequest, Got, StoreError, fetch_many

READ = ReadCredentials(access_key_id="r", secret_access_key="r")
BUDGET_S = 2.0


def test_transfers_are_reported_as_they_end_the_fast_ones_first(tmp_path: Path) -> None:
    (tmp_path / "fast").mkdir()
    for i in range(4):
        (tmp_path / "fast" / f"{i}.bin").write_bytes(bytes([i]) * 1000)
    fast = open_store(f"file://{tmp_path}?bucket=fast")
    seen: list[tuple[tuple[str, int] | int, Got | StoreError, float, int]] = []

    def on_done(key: tuple[str, int] | int, got: Got | StoreError) -> None:
        seen.append((key, got, time.monotonic(), threading.get_ident()))

    with SlowStore(tmp_path, "hang") as endpoint:
        hung = S3Store("hung", READ, endpoint=endpoint)
        requests: dict[tuple[str, int] | int, FetchRequest] = {
            ("hung", i): FetchRequest(hung, f"x/{i}.bin", 1 << 20) for i in range(2)
        }
        requests |= {i: FetchRequest(fast, f"{i}.bin", 1 << 20) for i in range(4)}
        out = fetch_many(
            requests, budget_s=BUDGET_S, min_rate_bytes_s=1.0, grace_s=BUDGET_S, on_done=on_done
        )
        returned = time.monotonic()
    assert len(seen) == 6 and {key for key, *_ in seen} == set(requests)
    for key, got, at, thread in seen:
        assert got is out[key] and thread == threading.get_ident()
        if isinstance(key, int):  # handed over while the hung transfers still ran
            assert isinstance(got, Got) and got.data == bytes([key]) * 1000
            assert at < returned - BUDGET_S / 2
        else:  # ended by the deadline, with its error
            assert isinstance(got, StoreError)
    assert all(isinstance(key, int) for key, *_ in seen[:4])  # the fast ones first
