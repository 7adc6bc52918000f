"""Timing of one compression step (EF update + Top-k + 2-bit quantization) against a memory pass.

`bench_compress` is what ``tessera bench codec`` calls. The reference is ``x.abs().sum()`` over
a tensor of the same size, timed in the same process and interleaved with the compression runs,
so that the ratio says something on any machine (the target is ``ratio <= 3``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import partial

import torch

from codec.compress import Compressor
from codec.quantize import relative_error, side_info_bits, uniform_baseline
from codec.spec import CodecParams, ModelSpec

__all__ = ["bench_compress", "bench_params", "compress_model", "student_t3", "timed"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_params(tile: int = 64, k: int = 64) -> CodecParams:
    """Codec parameters for unit-scale synthetic values: the value cap set where it never binds."""
    return CodecParams(tile=tile, k=k, max_abs_value=2.0**64)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of one call of `fn`, the device synchronised before and after."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _square_shape(numel: int) -> tuple[int, int]:
    side = math.isqrt(numel)
    return (side, numel // side)


def student_t3(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Student-t(3) samples on the generator's device, built in place: normal / sqrt(chi2_3 / 3)."""
    dev = gen.device
    chi2 = torch.randn(shape, generator=gen, device=dev).square_()
    for _ in range(2):
        chi2.add_(torch.randn(shape, generator=gen, device=dev).square_())
    return torch.randn(shape, generator=gen, device=dev).div_(chi2.div_(3).sqrt_())


def bench_compress(
    numel: int = 100_000_000,
    shape: tuple[int, ...] | None = None,
    tile: int = 64,
    k: int = 64,
    beta: float = 0.95,
    repeats: int = 3,
    seed: int = 0,
    device: str = "cpu",
    threads: int | None = None,
) -> dict[str, float]:
    """Best-of-``repeats`` seconds for ``x.abs().sum()`` and for one `Compressor.compress` step.

    The tensor is ``shape`` (default: the most nearly square 2-D shape of ``numel`` elements,
    10000 x 10000 for 1e8, which has ragged edges for tile 64) of Student-t(3) values; a
    warm-up step leaves a residual in the EF buffer first. The two timings alternate. Returns
    ``abs_sum_s``, ``compress_s``, ``ratio`` (compress / abs-sum; target <= 3), the phases of
    the fastest compression (``select_s``: EF update and Top-k; ``quantize_s``;
    ``feedback_s``: subtracting the decoded values), on a GPU ``copy_s`` (a device-to-device copy of
    the tensor, the memory-bound reference), the relative squared error of the 2-bit
    values of the first step (``value_rel_err``, Top-k survivors of Student-t(3) chunks) and of
    the uniform 4-level baseline on the same values (``uniform_rel_err``), side information per kept value (``side_bits_per_value``) and the
    number of CPU threads torch used (``threads``, default: torch's current setting).
    """
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _bench(numel, shape, tile, k, beta, repeats, seed, torch.device(device))
    finally:
        torch.set_num_threads(previous)


def _bench(
    numel: int,
    shape: tuple[int, ...] | None,
    tile: int,
    k: int,
    beta: float,
    repeats: int,
    seed: int,
    dev: torch.device,
) -> dict[str, float]:
    shape = tuple(shape) if shape is not None else _square_shape(numel)
    params = bench_params(tile=tile, k=k)
    delta = student_t3(shape, torch.Generator(device=dev).manual_seed(seed))
    comp = Compressor(ModelSpec.from_shapes({"w": shape}), params, device=dev)
    # warm-up on the zero buffer (e == delta): these are the values whose error is reported
    sparse = comp.compress("w", delta, beta)
    layout = sparse.layout(params)
    values = torch.cat([v.reshape(-1) for v in sparse.values()])
    originals = torch.cat(
        [
            delta.view(-1)[layout.flat_positions(gi, g.idx).view(-1)]
            for gi, g in enumerate(sparse.groups)
        ]
    )

    abs_sum = compress = math.inf
    phases: dict[str, float] = {}
    for _ in range(repeats):
        abs_sum = min(abs_sum, timed(lambda: delta.abs().sum(), dev))
        step: dict[str, float] = {}
        elapsed = timed(partial(comp.compress, "w", delta, beta, timings=step), dev)
        if elapsed < compress:
            compress, phases = elapsed, step
    out: dict[str, float] = {}
    if dev.type == "cuda":  # the memory-bound reference on a GPU: a copy of the same bytes
        out["copy_s"] = min(timed(delta.clone, dev) for _ in range(repeats))
    return out | {
        "numel": float(layout.numel),
        "abs_sum_s": abs_sum,
        "compress_s": compress,
        "ratio": compress / abs_sum,
        "select_s": phases.get("select", 0.0),
        "quantize_s": phases.get("quantize", 0.0),
        "feedback_s": phases.get("feedback", 0.0),
        "value_rel_err": relative_error(originals, values),
        "uniform_rel_err": relative_error(originals, uniform_baseline(originals)),
        "side_bits_per_value": side_info_bits(
            layout.n_chunks, layout.n_values, sparse.codebook.shape[0]
        ),
        "threads": float(torch.get_num_threads()),
    }


def compress_model(
    spec: ModelSpec, repeats: int = 3, device: str = "cpu", k: int = 64, beta: float = 0.95
) -> dict[str, float]:
    """Best-of-``repeats`` seconds to compress every tensor of ``spec`` (normal pseudo-gradients,
    after a warm-up step) and, separately, to serialise the result with `codec.wire`."""
    from codec import wire  # wire builds on compress; imported here to keep this module light

    dev = torch.device(device)
    params = bench_params(k=k)
    gen = torch.Generator(device=dev).manual_seed(0)
    deltas = {t.name: torch.randn(t.shape, generator=gen, device=dev) for t in spec.tensors}
    comp = Compressor(spec, params, device=dev)
    sparse = comp.compress_all(deltas, beta)
    compress_s = encode_s = math.inf
    for _ in range(repeats):
        compress_s = min(compress_s, timed(partial(comp.compress_all, deltas, beta), dev))
        encode_s = min(encode_s, timed(partial(wire.encode_update, sparse, params, spec), dev))
    return {
        "numel": float(spec.numel),
        "tensors": float(len(spec.tensors)),
        "compress_s": compress_s,
        "encode_s": encode_s,
    }
