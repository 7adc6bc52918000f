"""Decode and aggregate a window's updates over worker processes, each owning a share of the
model's tensors, with the same mean bit for bit for any number of workers and any arrival order.

`AggregatePool.add` hands an update to every worker as soon as it lands; each decodes its own
tensors of it at once (`codec.wire.decode_update` with ``only``), so the gather ends about one
decode after its last byte. At `AggregatePool.mean` every worker clips its tensors chunk by chunk
(`codec.aggregate.sum_clipped`: the bound of a chunk depends only on that chunk's parts, which
the worker owning the tensor holds), adds the updates **in ascending uid order** and divides
them, in shared float32 buffers that are reused from window to window. Until then a worker holds
its share of every update decoded, 3 bytes per kept entry (int16 positions, 2-bit codes in a
byte): about 3 × G × E bytes over all workers for G updates of E entries. A tensor's sum never
depends on which worker owns it nor on when its updates arrived: the result is
`codec.aggregate.aggregate` (``clip_to_median=True``) bit for bit.

Tensors are dealt to workers largest first onto the least loaded (by kept entries), so the
workers' shares of the decode and scatter are even. What concerns a whole update is done once:
one worker in turn checks its payload digest (any worker's error rejects the update), and each
unpacks the value codes of its own tensors only. Every worker runs one torch thread; workers
come from a fork server that imported this module once (`_workers_context`).
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection as mpc
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as tmp

from codec.aggregate import sum_clipped
from codec.chunking import ChunkLayout
from codec.compress import SparseGroup, SparseTensor
from codec.errors import DecodeError
from codec.spec import CodecParams, ModelSpec
from codec.wire import decode_update

__all__ = ["AggregatePool", "deal"]


def deal(spec: ModelSpec, params: CodecParams, workers: int) -> list[list[str]]:
    """The tensors of each worker: largest (kept entries) first, onto the least loaded."""
    load = [0] * workers
    shares: list[list[str]] = [[] for _ in range(workers)]
    sizes = {t.name: ChunkLayout.for_shape(t.shape, params).n_values for t in spec.tensors}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        w = load.index(min(load))
        shares[w].append(name)
        load[w] += sizes[name]
    return shares


class AggregatePool:
    """``workers`` processes that decode and sum their share of every update (module docstring).

    Use: `add` each update as it arrives, `rejected` to learn which do not decode, `mean` of all
    or some of them (its tensors stay valid until the next `mean` or `reset`), `reset` before
    the next window, `close` at the end (or use the pool as a context manager). Not thread-safe:
    one caller at a time."""

    def __init__(
        self,
        spec: ModelSpec,
        params: CodecParams,
        workers: int,
        max_update_bytes: int,
        min_support: int = 1,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.spec, self.params = spec, params
        self.shares = deal(spec, params, workers)
        self._out = {
            t.name: torch.zeros(t.shape, dtype=torch.float32).share_memory_() for t in spec.tensors
        }
        ctx = _workers_context()
        self._conns: list[mpc.Connection] = []
        self._procs = []
        for share in self.shares:
            here, there = ctx.Pipe()
            buffers = {name: self._out[name] for name in share}
            proc = ctx.Process(
                target=_serve,
                args=(there, spec, params, share, buffers, max_update_bytes, min_support),
                daemon=True,
            )
            proc.start()
            there.close()
            self._conns.append(here)
            self._procs.append(proc)
        self._uids: list[int] = []
        self._rejected: dict[int, DecodeError] | None = None  # asked of the workers once

    def add(self, uid: int, data: bytes) -> None:
        """Start decoding ``uid``'s update in every worker (returns at once)."""
        if uid in self._uids:
            raise ValueError(f"uid {uid} was already added this window")
        self._uids.append(uid)
        self._rejected = None
        shared = torch.empty(len(data), dtype=torch.uint8).share_memory_()
        shared.numpy()[:] = np.frombuffer(data, dtype=np.uint8)  # one copy, read by every worker
        checker = len(self._uids) % len(self._conns)  # the payload digest: one worker, in turn
        for w, conn in enumerate(self._conns):
            conn.send(("add", uid, shared, w == checker))

    def rejected(self) -> dict[int, DecodeError]:
        """The updates added this window that do not decode, and why (waits for the decodes)."""
        if self._rejected is None:
            self._rejected = {}
            for conn in self._conns:
                conn.send(("errors",))
            for conn in self._conns:
                errors = _reply(conn)
                self._rejected.update({uid: DecodeError(msg) for uid, msg in errors.items()})
        return dict(self._rejected)

    def mean(
        self, keys: Collection[int] | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[int, DecodeError]]:
        """The median-clipped mean of the updates added this window (or of those in ``keys``,
        each added) that decode, and why the others did not (those count as not sent)."""
        rejected = self.rejected()
        wanted = set(self._uids) if keys is None else set(keys)
        if not wanted <= set(self._uids):
            raise ValueError(f"uids {sorted(wanted - set(self._uids))} were not added")
        keys = sorted(uid for uid in wanted if uid not in rejected)
        for conn in self._conns:
            conn.send(("sum", keys))
        for conn in self._conns:
            _reply(conn)
        return self._out, {u: e for u, e in rejected.items() if u in wanted}

    def reset(self) -> None:
        """Forget this window's updates (the buffers are zeroed by the next `mean`)."""
        self._uids, self._rejected = [], None
        for conn in self._conns:
            conn.send(("reset",))

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(("stop",))
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()

    def __enter__(self) -> AggregatePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _workers_context() -> Any:
    """Workers come from a fork server that has imported this module (and torch) once per
    process: a pool starts in milliseconds after the first, never forked from a parent whose
    torch thread pools would not survive the fork."""
    ctx = tmp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def _reply(conn: mpc.Connection) -> Any:
    kind, payload = conn.recv()
    if kind == "error":
        raise RuntimeError(f"an aggregation worker failed: {payload}")
    return payload


def _serve(
    conn: mpc.Connection,
    spec: ModelSpec,
    params: CodecParams,
    share: list[str],
    out: Mapping[str, torch.Tensor],
    max_bytes: int,
    min_support: int,
) -> None:
    """A worker: decode its tensors of each update as it comes, sum them when asked."""
    torch.set_num_threads(1)
    only = frozenset(share)
    pieces: dict[int, list[SparseTensor]] = {}
    errors: dict[int, str] = {}
    while True:
        msg = conn.recv()
        try:
            if msg[0] == "add":
                _, uid, shared, check_digest = msg
                try:
                    view = memoryview(shared.numpy())
                    decoded = decode_update(
                        view, spec, params, max_bytes, only=only, check_digest=check_digest
                    )
                    pieces[uid] = [
                        _compact(t, params) for t in decoded.tensors if isinstance(t, SparseTensor)
                    ]
                except DecodeError as exc:
                    errors[uid] = str(exc)
            elif msg[0] == "errors":
                conn.send(("ok", errors))
            elif msg[0] == "sum":
                _sum_into(out, pieces, msg[1], params, min_support)
                conn.send(("ok", None))
            elif msg[0] == "reset":
                pieces, errors = {}, {}
            else:
                return
        except Exception as exc:  # reported to the pool, which raises it
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _compact(piece: SparseTensor, params: CodecParams) -> SparseTensor:
    """A decoded (and validated) piece with its chunk-local positions in the narrowest integer
    type that holds them: a worker keeps 3 bytes per entry of every update of the window until
    the sum, not 9 (`scatter_add` widens them again)."""
    narrow = torch.int16 if params.chunk_size <= 1 << 15 else torch.int32
    groups = [SparseGroup(g.idx.to(narrow), g.codes, g.scales) for g in piece.groups]
    return SparseTensor(piece.name, piece.shape, groups, piece.codebook)


def _sum_into(
    out: Mapping[str, torch.Tensor],
    pieces: Mapping[int, list[SparseTensor]],
    keys: list[int],
    params: CodecParams,
    min_support: int,
) -> None:
    """This worker's tensors of the clipped mean of the updates of ``keys`` (ascending)."""
    named = [{p.name: p for p in pieces[uid]} for uid in keys]
    for name, dense in out.items():
        sum_clipped(dense, [by_name.get(name) for by_name in named], params, None, min_support)
