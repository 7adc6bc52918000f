"""Start-up checks with actionable errors: our bucket is writable and readable, disk has room."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import time
from pathlib import Path

from codec.errors import TesseraError
from protocol.stores import AccessDenied, ObjectStore, StoreError, StoreUnavailable

PROBE_KEY = "tessera-probe/write-check"
RATE_KEY = "tessera-probe/write-rate"
RATE_PROBE_BYTES = 4 << 20
MIN_FREE_BYTES = 1 << 30


class PreflightError(TesseraError, RuntimeError):
    """Something the operator must fix before the node can run; the message says how."""


def check_bucket(store: ObjectStore) -> None:
    """Write, read back and delete a probe object in our own bucket."""
    try:
        store.put(PROBE_KEY, b"ok")
        if store.get(PROBE_KEY, 16) != b"ok":
            raise PreflightError(f"bucket {store.location} returned other bytes than we wrote")
        store.delete(PROBE_KEY)
    except AccessDenied as exc:
        raise PreflightError(
            f"cannot write to our bucket {store.location}: the write key was refused ({exc}). "
            "Set TESSERA_S3_ACCESS_KEY_ID / TESSERA_S3_SECRET_ACCESS_KEY to a key with write "
            "access to this bucket (the read-only key goes in the commitment, not here)."
        ) from exc
    except StoreUnavailable as exc:
        raise PreflightError(
            f"our bucket {store.location} is unreachable ({exc}); check the endpoint URL and network"
        ) from exc
    except StoreError as exc:
        raise PreflightError(f"our bucket {store.location} is not usable: {exc}") from exc


def write_rate(store: ObjectStore, size: int = RATE_PROBE_BYTES) -> float | None:
    """Bytes per second one put of ``size`` random bytes to our own bucket reached, its
    round trip included (so it errs slow), the object deleted after; None when the store
    refused. A lead's first publish is sized with it (`validator.admission.publish_reserve`)."""
    data = os.urandom(size)
    try:
        begun = time.monotonic()
        store.put(RATE_KEY, data)
        seconds = time.monotonic() - begun
        store.delete(RATE_KEY)
    except StoreError:
        return None
    return size / max(seconds, 1e-6)


def check_disk(directory: Path, needed: int = MIN_FREE_BYTES) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise PreflightError(
            f"only {free / 2**20:.0f} MiB free under {directory}; the node needs at least "
            f"{needed / 2**20:.0f} MiB for its state: free space or point --state-dir elsewhere"
        )


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    """The metrics port can be bound on `host` (as the metrics server will), so a busy port stops
    the node before it touches its bucket or the chain."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise PreflightError(
                f"--metrics-port {port} is in use ({exc.strerror}): pick a free port, or 0 for off"
            ) from None


def explain_os_error(exc: OSError, where: Path) -> PreflightError:
    if exc.errno == errno.ENOSPC:
        return PreflightError(f"disk full while writing {where}: free space or move --state-dir")
    return PreflightError(f"cannot write {where}: {exc}")
