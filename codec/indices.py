"""Near-entropy coder for the sorted Top-k positions of many chunks at once.

    encode(idx: LongTensor (n_chunks, k), chunk_size) -> bytes
    decode(data) -> LongTensor (n_chunks, k), rows sorted ascending

How it works (see `codec.index_model` for the model): every chunk's subset is a binary split tree;
each node that is not forced sends its left count j with the exact hypergeometric probability,
through rANS; positions left alone in a full power-of-two block are sent as raw low bits. The
cost is log2 C(C, k) bits per chunk for *any* subset, plus the rANS quantisation loss (16-bit
frequencies) which measures at well under 1%.

Vectorisation: one rANS state ("lane") per chunk. The tree is walked level by level for all chunks
at once; within a level, step s decodes the s-th pending node of every lane that has one, so the
Python loop runs over (level, step) pairs, never over chunks. Near the root ("grid" levels, see
`codec.index_nodes.dense_depth`) every lane codes one symbol per cell, cell by cell: cells that send
nothing (empty, full, lone, forced, or inside a leaf) code the certain symbol (frequency
2**PRECISION: state unchanged, no bits), so those levels need no schedule at all. Renormalisation is
bit-granular (states live in [2**R, 2**(R+1))), and each step's bits are laid out lane after lane,
so all lanes share one bit stream.

No per-chunk overhead: each lane's final state costs R bits, but the encoder starts each lane
from a state that already carries R bits of the raw section ("bits back"), which the decoder
recovers when it ends. The per-chunk waste is a fraction of a bit.

Layout: MAGIC, version, varints (chunk_size, k, n_chunks), then one bit stream (LSB first):
[lane states: n_chunks x R bits][renormalisation fields, step by step][raw fields, level by
level: cell by cell on grid levels, chunk by chunk below] with the last n_chunks x R' bits of the
raw part removed (they live in the lane states).
The encoder packs the raw part once: it reads the bits-back tail from it, then appends the rest
of it to the packed lane states and renormalisation fields.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from codec import gpu
from codec.bitio import BitReader, join_bits, pack_fields
from codec.errors import DecodeError
from codec.index_model import MAX_CHUNK_BITS, MAX_K, SplitTables, split_tables
from codec.index_walk import walk
from codec.rans import STATE_BITS, STATE_LOW, Round, encode_round
from codec.varint import read_varint, write_varint

RoundEncoder = Callable[
    [np.ndarray, Round, np.ndarray, SplitTables], list[tuple[np.ndarray, np.ndarray]]
]

MAGIC = b"TI"
VERSION = 2
DEFAULT_MAX_INDICES = 1 << 31

_EMPTY = np.zeros(0, np.int64)


def _header(chunk_size: int, k: int, n_chunks: int) -> bytearray:
    out = bytearray(MAGIC)
    out.append(VERSION)
    for v in (chunk_size, k, n_chunks):
        write_varint(out, v)
    return out


def _as_rows(idx: torch.Tensor | np.ndarray, chunk_size: int) -> np.ndarray:
    arr = idx.detach().cpu().numpy() if isinstance(idx, torch.Tensor) else np.asarray(idx)
    arr = arr.astype(np.int64, copy=False)
    if not 1 <= chunk_size <= (1 << MAX_CHUNK_BITS):
        raise ValueError(f"chunk size {chunk_size} out of range")
    if arr.ndim != 2:
        raise ValueError(f"indices must be 2-D (n_chunks, k), got shape {arr.shape}")
    if arr.shape[1] > MAX_K and arr.shape[1] != chunk_size:
        raise ValueError(f"k={arr.shape[1]} exceeds the coder's limit {MAX_K}")
    if arr.size and (arr.min() < 0 or arr.max() >= chunk_size):
        raise ValueError(f"indices must lie in [0, {chunk_size})")
    if arr.shape[1] > 1 and not (np.diff(arr, axis=1) > 0).all():
        raise ValueError("each row of indices must be strictly increasing")
    return arr


def encode(idx: torch.Tensor | np.ndarray, chunk_size: int, triton: bool | None = None) -> bytes:
    """Encode sorted, unique per-row chunk positions (n_chunks, k) into bytes.

    CUDA indices have their rANS steps run by Triton kernels on their device (`codec.gpu`);
    ``triton`` forces (True) or forbids (False) that. The bytes are the same either way.
    """
    rounds = _round_encoder(idx, triton)
    arr = _as_rows(idx, chunk_size)
    n, k = arr.shape
    out = _header(chunk_size, k, n)
    if n == 0 or k in (0, chunk_size):
        return bytes(out)
    tables = split_tables(chunk_size, k)
    tree = walk(arr, tables)
    raw_v = np.concatenate(tree.raw_vals) if tree.raw_vals else _EMPTY
    raw_w = np.concatenate(tree.raw_widths) if tree.raw_widths else _EMPTY
    raw_bytes, raw_total = pack_fields(raw_v, raw_w)
    back = min(STATE_BITS, raw_total // n)  # raw bits each lane's first state carries
    x = np.full(n, STATE_LOW, dtype=np.int64)
    if back:
        pos = raw_total - n * back + np.arange(n, dtype=np.int64) * back
        x |= BitReader(raw_bytes).gather(pos, np.full(n, back, np.int64))
    fields: list[tuple[np.ndarray, np.ndarray]] = []
    for rows, entries in reversed(tree.rounds):
        rnd = Round.grid(n, entries.size // n) if rows is None else Round.build(rows, n)
        fields[:0] = rounds(x, rnd, entries, tables)
    vals = np.concatenate([x - STATE_LOW, *[v for v, _ in fields]])
    widths = np.concatenate([np.full(n, STATE_BITS, np.int64), *[w for _, w in fields]])
    head, head_bits = pack_fields(vals, widths)
    return bytes(out) + join_bits(head, head_bits, raw_bytes, raw_total - n * back)


def decode(
    data: bytes | memoryview,
    max_indices: int = DEFAULT_MAX_INDICES,
    expect: tuple[int, int, int] | None = None,
    device: torch.device | str | None = None,
    triton: bool | None = None,
) -> torch.Tensor:
    """Decode bytes from `encode` into a LongTensor (n_chunks, k) with sorted rows, on `device`
    (default: the CPU). On a CUDA device with Triton (`codec.gpu.enabled`) the whole decode runs
    there (`codec.gpu.index_decode`): the split-tree walk as torch ops, its rANS steps as Triton
    kernels, and the indices never leave the device. Elsewhere the walk runs compiled on the host
    (`codec.native.index_decode`) and the indices are copied to `device`. ``triton`` forces (True:
    on the CPU, under Triton's interpreter) or forbids (False) the device path. The indices are
    the same either way.

    Every malformed input raises `DecodeError`; allocations are bounded by `max_indices` and by
    what the input's length can possibly describe. `expect` = (chunk_size, k, n_chunks) makes
    any other declared shape an error before anything is allocated.
    """
    data = bytes(data)
    if len(data) < len(MAGIC) + 4 or data[: len(MAGIC)] != MAGIC:
        raise DecodeError("not an index stream (bad magic)")
    if data[len(MAGIC)] != VERSION:
        raise DecodeError(f"unsupported index stream version {data[len(MAGIC)]}")
    pos = len(MAGIC) + 1
    chunk_size, pos = read_varint(data, pos)
    k, pos = read_varint(data, pos)
    n, pos = read_varint(data, pos)
    if not 1 <= chunk_size <= (1 << MAX_CHUNK_BITS):
        raise DecodeError(f"chunk size {chunk_size} out of range")
    if k > chunk_size or (k > MAX_K and k != chunk_size):
        raise DecodeError(f"k={k} out of range for chunk size {chunk_size}")
    if expect is not None and (chunk_size, k, n) != expect:
        raise DecodeError(f"index stream for (C, k, n) = {(chunk_size, k, n)}, expected {expect}")
    if n * k > max_indices:
        raise DecodeError(f"{n} x {k} indices exceed the limit of {max_indices}")
    body = data[pos:]
    if n == 0 or k in (0, chunk_size):
        if body:
            raise DecodeError("unexpected bytes after a trivial index stream")
        return torch.arange(k, dtype=torch.long, device=device).expand(n, k).clone()
    if n * STATE_BITS > 8 * len(body):
        raise DecodeError(f"{len(body)} bytes cannot hold {n} chunks")
    on = torch.device(device or "cpu")
    if not _kernels(on, triton):
        from codec.native import index_decode  # numba, imported where it runs

        return torch.from_numpy(index_decode.decode_body(body, chunk_size, k, n)).to(device)
    from codec.gpu import index_decode as on_device

    return on_device.decode_body(body, chunk_size, k, n, on)


def _kernels(on: torch.device, triton: bool | None) -> bool:
    """Whether the index coder runs its device path (Triton kernels) for tensors on `on`."""
    return gpu.enabled(torch.empty(0, device=on)) if triton is None else triton


def _round_encoder(idx: torch.Tensor | np.ndarray, triton: bool | None) -> RoundEncoder:
    on = torch.device("cpu") if not isinstance(idx, torch.Tensor) else idx.device
    if not _kernels(on, triton):
        return encode_round
    from codec.gpu import rans

    return partial(rans.encode_round, device=on)
