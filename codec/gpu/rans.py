"""The rANS steps of the index coder on the device: one program per block of lanes.

Drop-in replacements for `codec.rans.decode_round` / `encode_round` (the same arguments plus
the device; the same results and bits). The split-tree walk that decides which table each symbol uses stays on the
host (`codec.index_walk`, `codec.index_decode`): it hands a whole round (one tree level) to
these functions, which run its steps on the device.

Decoding, per step: `_decode_step` decodes one symbol of every busy lane (coarse lookup, short
forward scan, state update) and the number of bits each renormalising lane reads; a prefix sum
over those counts (torch.cumsum on the device) gives every lane its field's bit offset, since a
step's fields are laid out lane after lane; `_read_step` reads the fields. The stream cursor stays
on the device between steps; a collapsed state or a read past the end is reported when the round
ends, as the CPU path's `DecodeError` (in between, corrupt counts are clamped so that no read
leaves the stream).

Encoding needs no prefix sum inside a round: every lane runs all its steps in reverse in one
program (`_encode_round`), writing each renormalisation field into its slot of the round's
decoding-order field list, which the host packs.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from codec.bitio import BitReader
from codec.errors import DecodeError
from codec.index_model import PRECISION_BITS, SplitTables
from codec.rans import GROUP, STATE_BITS, Round

__all__ = ["decode_round", "encode_round"]

BLOCK = 1024
_TABLES: dict[tuple[int, str], tuple[SplitTables, dict[str, torch.Tensor]]] = {}
_CACHE = 64


@triton.jit
def _bitlen(x):
    """Bit length of int64 0 < x < 2**53, from the exponent field of its exact float64 value."""
    return ((x.to(tl.float64).to(tl.int64, bitcast=True) >> 52) - 1022).to(tl.int64)


@triton.jit
def _decode_step(
    x_ptr, t_ptr, val_ptr, nbits_ptr, coarse_ptr, packed_ptr, end_ptr, cbase_ptr, cshift_ptr,
    vbase_ptr, busy, r0, sym_off,
    M: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    lane = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = lane < busy
    x = tl.load(x_ptr + lane, mask=live, other=1 << R)
    t = tl.load(t_ptr + sym_off + lane, mask=live, other=0)
    slot = x & ((1 << M) - 1)
    e = tl.load(coarse_ptr + tl.load(cbase_ptr + t) + (slot >> tl.load(cshift_ptr + t)))
    behind = live & (slot >= tl.load(end_ptr + e))
    while tl.sum(behind.to(tl.int32), 0) > 0:  # the few slots past their bucket's candidate
        e = tl.where(behind, e + 1, e)
        behind = behind & (slot >= tl.load(end_ptr + e))
    tl.store(val_ptr + sym_off + lane, e - tl.load(vbase_ptr + t), mask=live)
    p = tl.load(packed_ptr + e)  # freq << 32 | cum
    x = (x >> M) * (p >> 32) + slot - (p & 0xFFFFFFFF)
    nbits = tl.where(lane >= r0, R + 1 - _bitlen(x), 0)
    tl.store(x_ptr + lane, x, mask=live)
    tl.store(nbits_ptr + lane, nbits, mask=live)


@triton.jit
def _read_step(
    x_ptr, nbits_ptr, ends_ptr, cursor_ptr, pairs_ptr, n_pairs, busy, BLOCK: tl.constexpr
):
    lane = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = lane < busy
    # a corrupt stream can ask for any count: clamp it, and every read, inside the stream (the
    # round then fails as a DecodeError); ends[] hold the unclamped counts' running sum
    nbits = tl.load(nbits_ptr + lane, mask=live, other=0)
    pos = tl.load(cursor_ptr) + tl.load(ends_ptr + lane, mask=live, other=0) - nbits
    nbits = tl.minimum(tl.maximum(nbits, 0), 32)
    word = tl.load(pairs_ptr + tl.minimum(tl.maximum(pos >> 5, 0), n_pairs - 1), mask=live)
    field = (word >> (pos & 31)) & ((tl.full([BLOCK], 1, tl.int64) << nbits) - 1)
    x = tl.load(x_ptr + lane, mask=live, other=0)
    tl.store(x_ptr + lane, (x << nbits) | field, mask=live & (nbits > 0))


@triton.jit
def _encode_round(
    x_ptr, freq_ptr, cum_ptr, busy_ptr, readers_ptr, offsets_ptr, field_off_ptr, fval_ptr,
    fwid_ptr, n_lanes, n_steps,
    M: tl.constexpr, R: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    lane = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + lane, mask=lane < n_lanes, other=1 << R)
    for i in range(n_steps):
        s = n_steps - 1 - i
        busy = tl.load(busy_ptr + s)
        live = lane < busy
        r0 = tl.load(readers_ptr + s)
        off = tl.load(offsets_ptr + s)
        f = tl.load(freq_ptr + off + lane, mask=live, other=1 << M)
        first = s - s % G
        lower = f
        for g in tl.static_range(1, G):  # the group's earlier steps, for lanes still busy here
            if s - g >= first:
                prev = tl.load(offsets_ptr + s - g)
                lower *= tl.load(freq_ptr + prev + lane, mask=live, other=1 << M)
        lower = lower << (R - (s - first + 1) * M)
        reads = live & (lane >= r0)
        nbits = _bitlen(x) - _bitlen(lower)
        nbits -= ((x >> nbits) < lower).to(tl.int64)
        nbits = tl.where(reads, nbits, 0)
        slot = tl.load(field_off_ptr + s) + lane - r0
        tl.store(fval_ptr + slot, x & ((tl.full([BLOCK], 1, tl.int64) << nbits) - 1), mask=reads)
        tl.store(fwid_ptr + slot, nbits, mask=reads)
        x = x >> nbits
        c = tl.load(cum_ptr + off + lane, mask=live, other=0)
        x = tl.where(live, ((x // f) << M) + x % f + c, x)
    tl.store(x_ptr + lane, x, mask=lane < n_lanes)


def _device_tables(tables: SplitTables, device: torch.device) -> dict[str, torch.Tensor]:
    key = (id(tables), str(device))
    if key not in _TABLES:
        if len(_TABLES) >= _CACHE:
            _TABLES.pop(next(iter(_TABLES)))
        names = ("coarse", "packed", "end", "coarse_base", "coarse_shift", "value_base")
        _TABLES[key] = (
            tables,
            {n: torch.from_numpy(getattr(tables, n)).to(device) for n in names},
        )
    return _TABLES[key][1]


def _device_pairs(reader: BitReader, device: torch.device) -> torch.Tensor:
    """The reader's word pairs on `device`, copied once per stream."""
    key = str(device)
    if key not in reader.copies:
        reader.copies[key] = torch.from_numpy(reader.pairs).to(device)
    pairs = reader.copies[key]
    assert isinstance(pairs, torch.Tensor)
    return pairs


def decode_round(
    x: np.ndarray,
    rnd: Round,
    tids: np.ndarray,
    tables: SplitTables,
    reader: BitReader,
    device: torch.device,
) -> np.ndarray:
    """`codec.rans.decode_round` with the steps run by Triton kernels on `device`."""
    tab = _device_tables(tables, device)
    pairs = _device_pairs(reader, device)
    t = tids if rnd.perm is None else tids.take(rnd.perm)
    td = torch.from_numpy(np.ascontiguousarray(t)).to(device)
    xo = torch.from_numpy(x if rnd.order is None else x.take(rnd.order)).to(device)
    values = torch.empty(t.size, dtype=torch.int64, device=device)
    nbits = torch.zeros(x.size, dtype=torch.int64, device=device)
    cursor = torch.tensor([reader.cursor], dtype=torch.int64, device=device)
    worst = torch.zeros((), dtype=torch.float64, device=device)
    for s in range(rnd.n_steps):
        busy = rnd.busy[s]
        grid = (triton.cdiv(busy, BLOCK),)
        r0 = rnd.readers(s)
        _decode_step[grid](
            xo, td, values, nbits, tab["coarse"], tab["packed"], tab["end"],
            tab["coarse_base"], tab["coarse_shift"], tab["value_base"], busy, r0,
            rnd.offsets[s], M=PRECISION_BITS, R=STATE_BITS, BLOCK=BLOCK,
        )  # fmt: skip
        if r0 < busy:
            ends = torch.cumsum(nbits[:busy], 0)
            # a sound state reads 0..R bits; a collapsed or corrupt one anything else
            torch.maximum(worst, (nbits[:busy] - STATE_BITS / 2).abs().max(), out=worst)
            _read_step[grid](xo, nbits, ends, cursor, pairs, pairs.numel(), busy, BLOCK=BLOCK)
            cursor += ends[-1]
    if float(worst) > STATE_BITS / 2:
        raise DecodeError("index stream is corrupt: a lane state collapsed")
    end = int(cursor[0])
    if end > reader.total_bits:
        raise DecodeError(f"bit stream truncated: needs {end} bits, has {reader.total_bits}")
    reader.cursor = end
    xh = xo.cpu().numpy()
    if rnd.order is None:
        x[:] = xh
    else:
        x[rnd.order] = xh
    out = values.cpu().numpy()
    if rnd.perm is None:
        return out
    back = np.empty_like(out)
    back[rnd.perm] = out
    return back


def encode_round(
    x: np.ndarray, rnd: Round, entries: np.ndarray, tables: SplitTables, device: torch.device
) -> list[tuple[np.ndarray, np.ndarray]]:
    """`codec.rans.encode_round` with every lane's steps run by one Triton program on `device`."""
    e = entries if rnd.perm is None else entries.take(rnd.perm)
    n_steps = rnd.n_steps
    readers = np.array([rnd.readers(s) for s in range(n_steps)], dtype=np.int64)
    busy = np.array(rnd.busy[:n_steps], dtype=np.int64)
    counts = np.maximum(busy - readers, 0)
    field_off = np.cumsum(counts) - counts
    total = int(counts.sum())
    dev = device
    freq = torch.from_numpy(tables.freq.take(e)).to(dev)
    cum = torch.from_numpy(tables.cum.take(e)).to(dev)
    xo = torch.from_numpy(x if rnd.order is None else x.take(rnd.order)).to(dev)
    fval = torch.empty(total, dtype=torch.int64, device=dev)
    fwid = torch.empty(total, dtype=torch.int64, device=dev)
    n_lanes = int(busy[0]) if n_steps else 0
    if n_lanes:
        _encode_round[(triton.cdiv(n_lanes, BLOCK),)](
            xo, freq, cum, torch.from_numpy(busy).to(dev), torch.from_numpy(readers).to(dev),
            torch.tensor(rnd.offsets, dtype=torch.int64, device=dev),
            torch.from_numpy(field_off).to(dev), fval, fwid, n_lanes, n_steps,
            M=PRECISION_BITS, R=STATE_BITS, G=GROUP, BLOCK=BLOCK,
        )  # fmt: skip
    xh = xo.cpu().numpy()
    if rnd.order is None:
        x[:] = xh
    else:
        x[rnd.order] = xh
    vals, wids = fval.cpu().numpy(), fwid.cpu().numpy()
    return [
        (vals[o : o + c], wids[o : o + c])
        for o, c in zip(field_off.tolist(), counts.tolist(), strict=True)
        if c
    ]
