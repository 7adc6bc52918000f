"""A node's exchange decoded by worker processes as its updates land (`codec.pool`).

With `PooledExchange`, the gather (`node.window.gather.gather`) verifies each update's header
and signature on its own thread and hands the bytes to the pool, whose workers decode their
share of the tensors at once; an update that does not decode is dropped as ``malformed`` when
the gather ends, as the strict decode would drop it. The window's mean is then the pool's, bit
for bit the strategy's own (`node.strategy.aggregator.Aggregator.mean`), when every agreed update
is one the pool holds for that window; otherwise (the lead's copy of an update replaced ours, or the pool has moved on
to a later window) the caller computes it the usual way.

Only runs whose updates travel in the sparse wire container take this path (`supports`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from codec.errors import DecodeError
from codec.pool import AggregatePool
from codec.spec import ModelSpec
from codec.wire import SPARSE
from node.strategy import make_format
from node.strategy.format import Decoded
from node.strategy.sparseloco import SparseFormat
from node.window.exchange import decode_verified, verified_header
from protocol.runconfig import RunConfig

__all__ = ["Handed", "PooledExchange", "auto_workers", "mean_of_stored", "open_pool", "supports"]

log = logging.getLogger(f"tessera.{__name__}")

AUTO_MIN_CORES = 8
AUTO_MAX_WORKERS = 16


def auto_workers(cores: int | None = None) -> int:
    """Decode workers for a machine of ``cores`` cores (default: this one's): half of them, at
    most `AUTO_MAX_WORKERS`, and none (decode on the node's own thread) below `AUTO_MIN_CORES`,
    where the training and the node's threads need what few there are."""
    cores = cores if cores is not None else (os.cpu_count() or 1)
    return 0 if cores < AUTO_MIN_CORES else min(AUTO_MAX_WORKERS, cores // 2)


@dataclass(eq=False)
class Handed:
    """A verified update whose bytes went to the pool; `tensors` decodes them when asked."""

    header: Any
    signed_digest: bytes
    data: bytes = field(repr=False)
    run: RunConfig = field(repr=False)
    spec: ModelSpec = field(repr=False)
    epoch: int = 0

    @property
    def digest(self) -> bytes:
        return bytes(self.header.digest)

    @property
    def tensors(self) -> Any:
        return decode_verified(self.data, self.run, self.spec).tensors


class PooledExchange:
    """One pool per node, used by one window's gather and mean at a time (a lock keeps the
    flight thread's gather and the main thread's mean apart)."""

    def __init__(self, run: RunConfig, spec: ModelSpec, pool: AggregatePool) -> None:
        self.run, self.spec, self.pool = run, spec, pool
        self._format = make_format(run, spec)  # the signed digest of each header
        self._lock = threading.Lock()
        self._epoch = 0
        self._window: int | None = None

    @classmethod
    def start(cls, run: RunConfig, spec: ModelSpec, workers: int) -> PooledExchange | None:
        """The exchange on ``workers`` decode workers (`open_pool`), or None."""
        pool = open_pool(run, spec, workers)
        return cls(run, spec, pool) if pool is not None else None

    def begin(self, window: int) -> None:
        """A new window's gather: forget the last one's updates."""
        with self._lock:
            self.pool.reset()
            self._epoch += 1
            self._window = window

    def check(self, data: bytes, uid: int, hotkey: str, window: int) -> Handed:
        """Verify the header and signature (`SignatureError`/`DecodeError` if not) and start
        the decode in the workers."""
        header = verified_header(data, uid, hotkey, self.run, self.spec, window)
        signed = self._format.signed_digest(header)
        with self._lock:
            if window != self._window:
                raise RuntimeError(f"the pool is gathering window {self._window}, not {window}")
            self.pool.add(uid, data)
            epoch = self._epoch
        return Handed(header, signed, data, self.run, self.spec, epoch)

    def rejected(self) -> dict[int, DecodeError]:
        """The handed updates of this window that do not decode (waits for the workers)."""
        with self._lock:
            return self.pool.rejected()

    def mean(
        self, updates: Mapping[int, Decoded], device: torch.device
    ) -> dict[str, torch.Tensor] | None:
        """The window's mean of ``updates`` on ``device`` (a copy: the pool's buffers are
        reused), or None when the pool does not hold exactly these updates."""
        with self._lock:
            held = all(isinstance(u, Handed) and u.epoch == self._epoch for u in updates.values())
            if not held:
                return None
            return _summed(self.pool, updates.keys(), device, f"window {self._window}: mean")

    def close(self) -> None:
        with self._lock:
            self.pool.close()


def supports(run: RunConfig, spec: ModelSpec) -> bool:
    """Whether the run's updates travel in the sparse wire container the workers decode."""
    fmt = make_format(run, spec)
    return isinstance(fmt, SparseFormat) and fmt.wire == SPARSE


def open_pool(run: RunConfig, spec: ModelSpec, workers: int) -> AggregatePool | None:
    """``workers`` decode workers for the run's updates; None with none asked for, for a run
    they cannot decode, or when they cannot start (too little shared memory, say: logged, and the
    node decodes on its own thread)."""
    if workers <= 0 or not supports(run, spec):
        return None
    try:
        cap = make_format(run, spec).max_update_bytes()
        return AggregatePool(spec, run.codec, workers, cap, run.outer.min_support)
    except (OSError, RuntimeError) as exc:
        log.warning("%d decode workers could not start (%s): decoding on this thread", workers, exc)
        return None


def mean_of_stored(
    pool: AggregatePool, updates: Mapping[int, Any], device: torch.device
) -> dict[str, torch.Tensor] | None:
    """The mean of verified updates kept as bytes (`node.window.gather.StoredUpdate`, a
    validator's spooled updates) summed by ``pool``, on ``device``; None when one of them has no
    bytes to hand over (a lead's copy decoded in place) or does not decode."""
    bodies = {uid: getattr(u, "body", None) for uid, u in updates.items()}
    if any(body is None for body in bodies.values()):
        return None
    pool.reset()
    for uid, body in bodies.items():
        pool.add(uid, body.read())  # type: ignore[union-attr]
    return _summed(pool, bodies.keys(), device, "stored updates: mean")


def _summed(
    pool: AggregatePool, keys: Collection[int], device: torch.device, what: str
) -> dict[str, torch.Tensor] | None:
    """The pool's mean of ``keys`` on ``device`` (a copy: its buffers are reused), logged; None
    when one of them does not decode (the usual path then says why)."""
    begun = time.perf_counter()
    mean, rejected = pool.mean(keys)
    if rejected:
        return None
    out = {name: t.to(device, copy=True) for name, t in mean.items()}
    log.info(
        "%s of %d updates summed by %d decode workers in %.2f s",
        what, len(keys), len(pool.shares), time.perf_counter() - begun,
    )  # fmt: skip
    return out
