"""Measurements behind `tessera bench exchange`: a window's gathered updates decoded and
aggregated the way a node does it, at a preset's real tensor shapes.

``peers`` updates of the preset's first ``layers`` decoder layers (all of them with ``layers=0``)
are encoded the way peers encode them (the run's strategy: error feedback, Top-k, 2-bit values,
the wire container), from heavy-tailed pseudo-gradients of a different scale per peer (so that
float32 sums in another order would round differently). Each row then decodes and sums them with
`codec.pool.AggregatePool` — 1 and N workers, the updates arriving in uid order and in a shuffled
order — timed from the first update handed over to the mean returned, best of ``repeats`` in wall
time. The digest (SHA-256 of the mean's bytes in spec order) must be the same in every row.

The reference, measured in the same run: one plain `index_add_` per tensor and peer of the same
number of chunk-local entries (flat positions and float32 values already in memory), on one
thread. With ``device="cuda"`` two more rows sum on the GPU (the Triton scatter): one decodes on
the host, one decodes on the GPU as well (the index coder's walk and rANS steps, the value codes),
each with its own digest.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch

from codec import wire
from codec.aggregate import aggregate
from codec.pool import AggregatePool
from codec.spec import ModelSpec
from lab.bench.codec import one_thread
from lab.bench.compress import student_t3
from node.model.shapes import layers_spec, model_spec
from node.strategy import make_format, make_strategy
from node.strategy.format import Meta
from protocol.runconfig import RunConfig

__all__ = ["bench_exchange", "encode_updates"]


def encode_updates(run: RunConfig, spec: ModelSpec, peers: int, seed: int = 0) -> dict[int, bytes]:
    """uid -> the signed-shape wire bytes of one update per peer (see the module docstring)."""
    out = {}
    for uid in range(peers):
        strategy = make_strategy(run, spec)
        gen = torch.Generator().manual_seed(seed * 1000 + uid)
        scale = 1e-4 * 2.0 ** (uid % 5)
        deltas = {t.name: student_t3(t.shape, gen).mul_(scale) for t in spec.tensors}
        with torch.no_grad():
            pieces = strategy.encoder.encode(deltas, window=10**6)  # past the error-feedback freeze
        meta: Meta = {"run_id": run.run_id, "window": 0, "uid": uid, "hotkey": "5" * 48}
        out[uid] = strategy.format.to_bytes(pieces, meta, lambda _d: bytes(64))
        del deltas, pieces
    return out


def digest(mean: Mapping[str, torch.Tensor], spec: ModelSpec) -> str:
    h = hashlib.sha256()
    for t in spec.tensors:
        h.update(mean[t.name].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _best(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeats):
        begun = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - begun)
    return best, result


def _pool_rows(
    run: RunConfig, spec: ModelSpec, datas: Mapping[int, bytes], workers: int, repeats: int
) -> list[dict[str, Any]]:
    cap = make_format(run, spec).max_update_bytes()
    shuffled = list(datas)
    random.Random(7).shuffle(shuffled)
    rows = []
    with AggregatePool(spec, run.codec, workers, cap) as pool:
        for label, order in (("uid order", sorted(datas)), ("shuffled", shuffled)):

            def once(order: list[int] = order) -> dict[str, torch.Tensor]:
                pool.reset()
                for uid in order:
                    pool.add(uid, datas[uid])
                mean, rejected = pool.mean()
                if rejected:
                    raise RuntimeError(f"updates rejected: {rejected}")
                return mean

            once()  # the workers' imports and first allocations
            seconds, mean = _best(once, repeats)
            rows.append(
                {"workers": workers, "device": "cpu", "arrival": label, "seconds": seconds,
                 "digest": digest(mean, spec)}
            )  # fmt: skip
    return rows


def _decoded(
    run: RunConfig, spec: ModelSpec, datas: Mapping[int, bytes], device: str = "cpu"
) -> dict[int, list]:
    cap = make_format(run, spec).max_update_bytes()
    return {
        uid: list(wire.decode_update(d, spec, run.codec, cap, device=device).tensors)
        for uid, d in datas.items()
    }


def reference_seconds(
    run: RunConfig, spec: ModelSpec, datas: Mapping[int, bytes], repeats: int
) -> float:
    """One thread: a plain `index_add_` per tensor and peer of the same chunk-local entries."""
    from node.strategy.sparseloco import sparse_entries

    entries = [
        (piece.name, *sparse_entries(piece, run.codec))
        for pieces in _decoded(run, spec, datas).values()
        for piece in pieces
    ]
    out = {t.name: torch.zeros(t.shape).view(-1) for t in spec.tensors}

    def once() -> None:
        for name, pos, vals in entries:
            out[name].index_add_(0, pos, vals)

    with one_thread():
        once()
        return _best(once, repeats)[0]


def _gpu_rows(
    run: RunConfig, spec: ModelSpec, datas: Mapping[int, bytes], repeats: int
) -> list[dict[str, Any]]:
    """Two rows: decode on the host (one thread) and sum on the GPU (the Triton scatter); and
    the whole decode on the GPU too (`codec.gpu.index_decode`), from the bytes in host memory."""
    dev = torch.device("cuda")
    with one_thread():
        host_s, pieces = _best(lambda: _decoded(run, spec, datas), repeats)
    on_dev = {uid: [p.to(dev) for p in ps] for uid, ps in pieces.items()}
    gpu_s, gpu_pieces = _best_on_gpu(lambda: _decoded(run, spec, datas, "cuda"), repeats, dev)
    rows = []
    for where, decode_s, decoded in (("host", host_s, on_dev), ("cuda", gpu_s, gpu_pieces)):
        mean_of = partial(aggregate, decoded, spec, run.codec, clip_to_median=True, device=dev)
        sum_s, mean = _best_on_gpu(mean_of, repeats, dev)
        rows.append(
            {"workers": 1, "device": "cuda", "decode_on": where, "arrival": "uid order",
             "seconds": decode_s + sum_s, "decode_s": decode_s, "sum_s": sum_s,
             "digest": digest(mean, spec)}
        )  # fmt: skip
    return rows


def _best_on_gpu(fn: Callable[[], Any], repeats: int, dev: torch.device) -> tuple[float, Any]:
    """`_best` of ``fn`` with the device synchronised after each call, after one call that
    compiles the kernels and makes the first allocations."""

    def synced() -> Any:
        out = fn()
        torch.cuda.synchronize(dev)
        return out

    synced()
    return _best(synced, repeats)


def bench_exchange(
    preset: str,
    peers: int,
    layers: int,
    workers: list[int],
    repeats: int,
    device: str = "cpu",
    log: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    """The bench's result (see `tessera bench exchange --json`)."""
    run = RunConfig.preset(preset)
    spec = layers_spec(run.model, layers)
    full = model_spec(run.model)
    log(f"encoding {peers} updates of {len(spec.tensors)} tensors ({spec.numel:,} elements)…")
    datas = encode_updates(run, spec, peers)
    entries = peers * _entries(run, spec)
    log("one thread: index_add_ of the same entries (the reference)…")
    ref_s = reference_seconds(run, spec, datas, repeats)
    rows: list[dict[str, Any]] = []
    for w in workers:
        log(f"{w} worker{'s' if w > 1 else ''}: decode and aggregate, two arrival orders…")
        rows += _pool_rows(run, spec, datas, w, repeats)
    if device == "cuda":
        log("GPU: decode on the host or on the GPU, sum with the Triton scatter…")
        rows += _gpu_rows(run, spec, datas, repeats)
    for row in rows:
        row["entries_per_s"] = entries / row["seconds"]
        row["vs_reference"] = ref_s / row["seconds"]
    return {
        "preset": preset,
        "peers": peers,
        "layers": layers or run.model.n_layers,
        "entries": entries,
        "dense_elements": spec.numel,
        "model_share": spec.numel / full.numel,
        "bytes_per_update": sum(len(d) for d in datas.values()) / peers,
        "arrival_orders_equal": len({r["digest"] for r in rows}) == 1,
        "reference": {"what": "index_add_, one thread", "seconds": ref_s,
                      "entries_per_s": entries / ref_s},
        "results": rows,
    }  # fmt: skip


def _entries(run: RunConfig, spec: ModelSpec) -> int:
    from codec.chunking import ChunkLayout

    return sum(ChunkLayout.for_shape(t.shape, run.codec).n_values for t in spec.tensors)
