"""Measurements behind `tessera bench codec`: each figure next to the reference it must beat.

Every function returns plain dicts (rendered as a table or JSON by the CLI). Throughput is
measured in wall time, best of a few runs: on the CPU on one thread (`torch.set_num_threads(1)`,
numpy's coder is single-threaded anyway), on a CUDA device through the Triton path with the
device synchronised around each run.

The synthetic values are unit-scale, far above a run's value cap (`CodecParams.max_abs_value`,
sized for real pseudo-gradients), so every measurement here uses `bench_params`, whose cap never
binds: the figures are the quantiser's, not the cap's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import numpy as np
import torch

from codec import indices, wire
from codec.compress import Compressor
from codec.spec import ModelSpec
from lab.bench.compress import bench_compress, bench_params, timed

CHUNK = 4096
KS = (32, 64, 128, 256)
PAPER_BITS = {32: 8.9, 128: 6.6, 256: 5.6}  # SparseLoCo, Appendix G
TARGET_RATIO = 1.01


def limit_bits_per_index(c: int, k: int) -> float:
    """log2 C(c, k) / k: no coder of arbitrary k-subsets can do better on average."""
    return (math.lgamma(c + 1) - math.lgamma(k + 1) - math.lgamma(c - k + 1)) / math.log(2) / k


def random_subsets(rng: np.random.Generator, n: int, c: int, k: int) -> np.ndarray:
    return np.sort(rng.random((n, c), dtype=np.float32).argpartition(k - 1, axis=1)[:, :k], axis=1)


def clustered_subsets(rng: np.random.Generator, n: int, c: int, k: int) -> np.ndarray:
    """Top-k of row-structured 64x64 tiles: a few hot rows and columns, heavy-tailed values.

    Pseudo-gradients of linear layers concentrate on rows (output features) and columns (input
    features) that saw large activations; this mimics that so the coder is tested where real
    Top-k sets live, not only on uniform subsets.
    """
    side = math.isqrt(c)
    rows = rng.gamma(0.5, size=(n, side, 1)).astype(np.float32)
    cols = rng.gamma(0.5, size=(n, 1, side)).astype(np.float32)
    vals = rng.standard_t(3, size=(n, side, side)).astype(np.float32) * rows * cols
    flat = np.abs(vals.reshape(n, c))
    return np.sort(np.argpartition(-flat, k - 1, axis=1)[:, :k], axis=1)


@contextmanager
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def best_seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Best wall time of `repeats` runs of `fn` (the device synchronised around each)."""
    return min(timed(fn, device) for _ in range(repeats))


def index_sizes(n_chunks: int = 4096, seed: int = 0) -> list[dict[str, float]]:
    """Bits per index (every byte counted) on random and clustered sets, against the limit."""
    rng = np.random.default_rng(seed)
    rows = []
    for k in KS:
        limit = limit_bits_per_index(CHUNK, k)
        row: dict[str, float] = {"k": k, "limit": limit, "target": TARGET_RATIO * limit}
        for kind, make in (("random", random_subsets), ("clustered", clustered_subsets)):
            idx = make(rng, n_chunks, CHUNK, k)
            data = indices.encode(idx, CHUNK)
            row[kind] = 8 * len(data) / idx.size
        row["paper"] = PAPER_BITS.get(k, float("nan"))
        row["packed_12bit"] = 12.0
        rows.append(row)
    return rows


def index_speed(
    n_chunks: int = 16384, repeats: int = 3, seed: int = 1, device: str = "cpu"
) -> list[dict[str, float]]:
    """Encode and decode throughput (indices per wall second, best of `repeats`) per k, with
    the time of a device-to-device copy of the decoded indices beside it on a GPU and the decode
    with its rANS steps as Triton kernels there (`decode_triton_M_per_s`)."""
    rng = np.random.default_rng(seed)
    dev = torch.device(device)
    rows = []
    with one_thread():
        for k in KS:
            idx = torch.from_numpy(random_subsets(rng, n_chunks, CHUNK, k)).to(dev)
            data = indices.encode(idx, CHUNK)
            indices.decode(data, device=dev)  # warm the tables (and the kernels)
            enc = best_seconds(partial(indices.encode, idx, CHUNK), repeats, dev)
            dec = best_seconds(partial(indices.decode, data, device=dev), repeats, dev)
            row = {
                "k": k,
                "encode_M_per_s": idx.numel() / enc / 1e6,
                "decode_M_per_s": idx.numel() / dec / 1e6,
            }
            if dev.type == "cuda":
                rounds = best_seconds(
                    partial(indices.decode, data, device=dev, triton=True), repeats, dev
                )
                row["decode_triton_M_per_s"] = idx.numel() / rounds / 1e6
                copy = best_seconds(idx.clone, repeats, dev)
                row["decode_vs_copy"] = dec / copy
                row["encode_vs_copy"] = enc / copy
            rows.append(row)
    return rows


def entry_cost(k: int = 64, seed: int = 2, width: int = 2048) -> dict[str, float]:
    """Bits per kept entry of a whole update (index + value + side info + header) of a
    LLaMA-like block of hidden size `width` (2048 by default; `--quick` uses 512)."""
    ff = width * 11 // 4
    spec = ModelSpec.from_shapes(
        {"attn.q": (width, width), "mlp.up": (ff, width), "mlp.down": (width, ff), "norm": (width,)}
    )
    params = bench_params(tile=64, k=k)
    gen = torch.Generator().manual_seed(seed)
    comp = Compressor(spec, params)
    sparse = [
        comp.compress(t.name, torch.randn(t.shape, generator=gen).pow_(3), beta=0.95)
        for t in spec.tensors
    ]
    data = wire.encode_update(sparse, params, spec, sign=lambda _d: bytes(64))
    header, _ = wire.read_header(data)
    kept = sum(g.idx.numel() for t in sparse for g in t.groups)
    index_bytes = sum(sum(e.index_bytes) for e in header.tensors)
    return {
        "k": k,
        "kept": kept,
        "bits_per_entry": 8 * len(data) / kept,
        "index_bits": 8 * index_bytes / kept,
        "value_bits": 8 * header.codes_bytes / kept,
        "side_and_header_bits": 8 * (len(data) - index_bytes - header.codes_bytes) / kept,
        "index_limit_bits": limit_bits_per_index(params.chunk_size, k),
        "reference_bits": 20.0,  # deployed reference: 12-bit indices + 8-bit containers
    }


def compress_time(numel: int, repeats: int = 3, device: str = "cpu") -> dict[str, float]:
    """EF + Top-k + quantize (+ index encode) of one tensor, beside `x.abs().sum()` on it."""
    dev = torch.device(device)
    out = bench_compress(numel=numel, repeats=repeats, device=device)
    shape = (math.isqrt(numel), numel // math.isqrt(numel))
    spec = ModelSpec.from_shapes({"w": shape})
    params = bench_params()
    comp = Compressor(spec, params, device=dev)
    delta = torch.randn(shape, device=dev).pow_(3)
    sparse = comp.compress("w", delta, 0.95)
    out["encode_s"] = best_seconds(lambda: wire.encode_update([sparse], params, spec), repeats, dev)
    out["total_s"] = out["compress_s"] + out["encode_s"]
    out["total_ratio"] = out["total_s"] / out["abs_sum_s"]
    return out
