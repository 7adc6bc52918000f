"""The peer's local state, saved atomically after every window and restored after any crash.

One file, `state.pt`, holds the model, the inner optimizer, the strategy's local state (error
feedback) and outer-optimizer state (`node.strategy`), the next window to train and, with
``outer.delay = 1``, the exchange still in the air (our signed update of the previous window, so
a restarted peer resumes it). It is written to a temporary file, fsynced and renamed over the old
one, so a `kill -9` at any moment leaves either the previous window's state or the new one, never
a torn file. The previous file is kept as `state.prev.pt` in case the newest is ever unreadable.

Each file has a checksum beside it (`<file>.b2`, BLAKE2b-256 of its bytes, written after it): a
file whose bytes no longer match (a flipped bit on disk, which `torch.load` may still accept) is
refused and the previous one loaded instead, and the log says so. A file without its checksum (a
kill between the two writes) is loaded unverified.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from codec.errors import TesseraError
from node.runtime.atomic_files import write_bytes_atomic, write_text_atomic
from node.runtime.shutdown import deferred_stop

log = logging.getLogger(f"tessera.{__name__}")

STATE_FILE = "state.pt"
PREVIOUS_FILE = "state.prev.pt"
FORMAT = 1


class StateError(TesseraError, RuntimeError):
    """The local state exists but cannot be used (another run, unreadable, wrong format)."""


@dataclass
class PeerState:
    run_id: str
    window: int  # the next window to train; the model is at the start of this window
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    error_feedback: dict[str, torch.Tensor]
    fingerprint: str
    outer: dict[str, torch.Tensor] = field(default_factory=dict)  # e.g. Nesterov momentum
    inflight: dict[str, Any] = field(default_factory=dict)  # `miner.flight.Flight.record`

    def without_weights(self) -> PeerState:
        """This state without its model, optimizer and outer tensors (what the other ranks of
        a sharded peer get from rank 0, `miner.sharded_weights`)."""
        return replace(self, model={}, optimizer={}, outer={})


_FIX = "pass another --state-dir to start afresh (or move this folder away)"


@contextmanager
def restoring(directory: Path) -> Iterator[None]:
    """Loading a saved state into the node's model and optimizers: a state it cannot take (one
    written for another model or by another version: torch's missing-key and shape errors)
    becomes one `StateError` that says what to do."""
    try:
        yield
    except (StateError, torch.OutOfMemoryError):  # not the state's fault: as they are
        raise
    except (RuntimeError, ValueError, KeyError) as exc:
        what = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise StateError(
            f"the state in {directory} does not fit this node's model ({what}): it was written "
            f"for another model or by another version; {_FIX}"
        ) from exc


def check_restored(directory: Path, restored: str, saved: str) -> None:
    """`StateError` unless the restored model's fingerprint is the one saved with it."""
    if restored != saved:
        raise StateError(
            f"the model restored from {directory} has fingerprint {restored[:12]}, not the "
            f"{saved[:12]} saved with it: the state was written by another version; {_FIX}"
        )


def save_rotating(current: Path, previous: Path, body: dict[str, Any]) -> Path:
    """Write `body` (torch-serialised) to `current` atomically, keeping the old file as
    `previous`: a crash at any moment leaves at least one complete file, and a SIGTERM waits
    until the save is done (`node.runtime.shutdown`)."""
    with deferred_stop():  # a SIGTERM now stops the node once this save is complete
        current.parent.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        torch.save(body, buf)
        if current.exists():
            os.replace(current, previous)
            if _checksum(current).exists():
                os.replace(_checksum(current), _checksum(previous))
            else:
                _checksum(previous).unlink(missing_ok=True)
        written = write_bytes_atomic(current, buf.getbuffer())
        write_text_atomic(
            _checksum(current), hashlib.blake2b(buf.getbuffer(), digest_size=32).hexdigest()
        )
        return written


def _checksum(path: Path) -> Path:
    return path.with_name(path.name + ".b2")


def _read_checked(path: Path) -> Any:
    """`torch.load` of `path` once its bytes match the checksum beside it (if there is one);
    `StateError` when they do not."""
    expected = _checksum(path).read_text().strip() if _checksum(path).exists() else None
    if expected is not None:
        digest = hashlib.blake2b(digest_size=32)
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
        if digest.hexdigest() != expected:
            raise StateError(f"{path} does not match its checksum: its bytes changed on disk")
    return torch.load(path, map_location="cpu", weights_only=True)


def load_rotating(current: Path, previous: Path, run_id: str) -> dict[str, Any] | None:
    """The newest complete, intact file of this format, or None; `StateError` if it is another
    run's. A file that is torn, corrupt or not ours is skipped for the previous one, and said."""
    for path in (current, previous):
        if not path.exists():
            continue
        try:
            raw = _read_checked(path)
        except Exception as exc:  # a torn, corrupt or foreign file: fall back to the previous one
            log.warning("%s unusable (%s): trying the previous state", path, str(exc)[:200])
            continue
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            log.warning("%s is not a state file of this version: trying the previous one", path)
            continue
        if raw.get("run_id") != run_id:
            raise StateError(
                f"{path} belongs to run {raw.get('run_id')}, not {run_id}: use another --state-dir"
            )
        raw.pop("format")
        return raw
    return None


def save_state(directory: Path, state: PeerState) -> Path:
    body = {"format": FORMAT, **state.__dict__}
    return save_rotating(directory / STATE_FILE, directory / PREVIOUS_FILE, body)


def load_state(directory: Path, run_id: str) -> PeerState | None:
    """The newest readable state of this run, or None when there is none."""
    raw = load_rotating(directory / STATE_FILE, directory / PREVIOUS_FILE, run_id)
    return PeerState(**raw) if raw is not None else None


# -- error-feedback shards of a multi-device peer (see `miner.ranks`) ------------------------------
#
# Rank 0 keeps its share of the EF buffers in `state.pt`; rank r > 0 keeps its share in
# `ef-rank{r}.pt` (previous one: `ef-rank{r}.prev.pt`), tagged with the window it belongs to.
# The shards are written before rank 0 writes `state.pt`, so whichever `state.pt` is loaded,
# every shard of its window is on disk (the current or the previous file).


def _shard_paths(directory: Path, rank: int) -> tuple[Path, Path]:
    return directory / f"ef-rank{rank}.pt", directory / f"ef-rank{rank}.prev.pt"


def save_ef_shard(
    directory: Path, run_id: str, window: int, rank: int, error_feedback: dict[str, torch.Tensor]
) -> Path:
    """Atomically save rank `rank`'s EF buffers for the state at the start of `window`."""
    body = {"format": FORMAT, "run_id": run_id, "window": window, "error_feedback": error_feedback}
    return save_rotating(*_shard_paths(directory, rank), body)


def load_error_feedback(directory: Path, state: PeerState) -> dict[str, torch.Tensor]:
    """Every EF buffer saved for `state`'s window: its own plus all ranks' shard files.

    A single-device state holds them all; a multi-device one is completed from the shards
    (files of another run or window are ignored), so a peer can resume on any number of ranks.
    """
    merged = dict(state.error_feedback)
    for path in sorted(directory.glob("ef-rank*.pt")):
        try:
            raw = _read_checked(path)
        except Exception:  # torn, corrupt or foreign: the other file of this rank may still match
            continue
        if (raw.get("format"), raw.get("run_id"), raw.get("window")) == (
            FORMAT,
            state.run_id,
            state.window,
        ):
            merged.update(raw["error_feedback"])
    return merged
