"""The rANS steps of the index coder on the device: one program per block of lanes.

Device twins of `codec.rans.decode_round` / `encode_round` (the same steps, the same results and
bits). Decoding takes and returns device tensors: the device walk (`codec.gpu.index_decode`)
decides which table each symbol uses and hands a whole round (one tree level) to
`decode_round`, with its schedule built on the device (`DeviceRound`); the stream's words, its
cursor and the tables (`device_tables`, copied once per tables and device) live there too.
Encoding takes the host walk's rounds (`codec.index_walk`) as numpy arrays and returns the
fields for the host to pack.

Decoding, per step: `_decode_step` decodes one symbol of every busy lane (coarse lookup, short
forward scan, state update) and the number of bits each renormalising lane reads; a prefix sum
over those counts (torch.cumsum on the device) gives every lane its field's bit offset, since a
step's fields are laid out lane after lane; `_read_step` reads the fields. The stream cursor stays
on the device between steps and rounds; a collapsed state or a read past the end is reported
when the caller checks the stream after its last round (`DeviceStream.check`), as the CPU path's
`DecodeError` (in between, corrupt counts are clamped so that no read leaves the stream, and
every symbol still comes from its table).

Encoding needs no prefix sum inside a round: every lane runs all its steps in reverse in one
program (`_encode_round`), writing each renormalisation field into its slot of the round's
decoding-order field list, which the host packs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from codec.bitio import BitReader
from codec.errors import DecodeError
from codec.index_model import PRECISION_BITS, SplitTables
from codec.rans import GROUP, STATE_BITS, Round

__all__ = ["DeviceRound", "DeviceStream", "decode_round", "device_tables", "encode_round"]

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


def device_tables(tables: SplitTables, device: torch.device) -> dict[str, torch.Tensor]:
    """The tables' arrays that the device decoder reads, copied to `device` once per (tables,
    device); callers may add arrays of their own under other names (`codec.gpu.index_decode`)."""
    key = (id(tables), str(device))
    if key not in _TABLES:
        if len(_TABLES) >= _CACHE:
            _TABLES.pop(next(iter(_TABLES)))
        names = (
            "coarse", "packed", "end", "coarse_base", "coarse_shift", "value_base",
            "is_leaf", "sends", "split_lo",
        )  # fmt: skip
        _TABLES[key] = (
            tables,
            {n: torch.from_numpy(getattr(tables, n)).to(device) for n in names},
        )
    return _TABLES[key][1]


@dataclass
class DeviceStream:
    """A bit stream on the device: its word pairs (`codec.bitio.BitReader.pairs`), the cursor, and
    the worst renormalisation seen, both device scalars that the rounds update without a host
    sync. A round never raises: `decode_round` clamps every read inside the stream, and the
    caller checks `worst` and `cursor` once it has run them all (`check`)."""

    pairs: torch.Tensor
    total_bits: int
    cursor: torch.Tensor  # int64 (1,): the next bit to read
    worst: torch.Tensor  # int64 (): the largest |bits read - R/2| of any renormalisation

    @classmethod
    def of(cls, reader: BitReader, device: torch.device) -> DeviceStream:
        return cls(
            pairs=torch.from_numpy(reader.pairs).to(device),
            total_bits=reader.total_bits,
            cursor=torch.full((1,), reader.cursor, dtype=torch.int64, device=device),
            worst=torch.zeros((), dtype=torch.int64, device=device),
        )

    def gather(self, pos: torch.Tensor, widths: torch.Tensor | int) -> torch.Tensor:
        """Fields (int64, 0..32 bits each) at bit positions inside the stream."""
        return (self.pairs[pos >> 5] >> (pos & 31)) & ((1 << widths) - 1)

    def check(self, worst: int, end: int) -> None:
        """Raise `DecodeError` if the rounds failed, given `worst` and `cursor` read back once
        they have all run."""
        if worst > STATE_BITS // 2:  # a sound state reads 0..R bits; a collapsed one anything else
            raise DecodeError("index stream is corrupt: a lane state collapsed")
        if end > self.total_bits:
            raise DecodeError(f"bit stream truncated: needs {end} bits, has {self.total_bits}")


@dataclass(frozen=True)
class DeviceRound:
    """`codec.rans.Round` with its lane order and symbol permutation on the device; `steps` holds
    the per-step lane counts and offsets (on the host: they size the launches)."""

    steps: Round  # its order and perm are None
    order: torch.Tensor | None  # the busy lanes, busiest first (None: every lane, in lane order)
    perm: torch.Tensor | None  # step-major position -> symbol index (None: step-major already)

    @classmethod
    def grid(cls, n_lanes: int, n_steps: int) -> DeviceRound:
        return cls(Round.grid(n_lanes, n_steps), None, None)

    @classmethod
    def build(cls, lanes_of_symbols: torch.Tensor, n_lanes: int) -> DeviceRound:
        """`codec.rans.Round.build` on the device (`lanes_of_symbols` sorted, not empty); the
        step sizes come back to the host, the order and permutation stay on the device."""
        dev = lanes_of_symbols.device
        counts = torch.bincount(lanes_of_symbols, minlength=n_lanes)
        busy = n_lanes - torch.cumsum(torch.bincount(counts), 0)[:-1]  # lanes with > s symbols
        sizes = busy.tolist()
        n_steps, total = len(sizes), int(lanes_of_symbols.numel())
        offsets = [0, *itertools.accumulate(sizes)]
        steps = Round(order=None, busy=[*sizes, 0], offsets=offsets, perm=None)
        if sizes[-1] == n_lanes:  # every lane as busy: a transpose
            perm = torch.arange(total, device=dev).view(n_lanes, n_steps).t().reshape(-1)
            return cls(steps, None, perm)
        order = torch.argsort(-counts, stable=True)[: sizes[0]]
        first = (torch.cumsum(counts, 0) - counts)[order]  # each lane's first symbol
        step = torch.repeat_interleave(torch.arange(n_steps, device=dev), busy, output_size=total)
        lane = torch.arange(total, device=dev) - (torch.cumsum(busy, 0) - busy)[step]
        return cls(steps, order, first[lane] + step)


def decode_round(
    x: torch.Tensor,
    rnd: DeviceRound,
    tids: torch.Tensor,
    tables: SplitTables,
    stream: DeviceStream,
) -> torch.Tensor:
    """`codec.rans.decode_round` on the device: lane states `x` (int64, updated in place), table
    ids and the values returned (int64) are device tensors. Nothing comes back to the host: the
    stream's cursor and worst renormalisation are updated for the caller to check."""
    tab = device_tables(tables, x.device)
    steps = rnd.steps
    t = tids if rnd.perm is None else tids[rnd.perm]
    xo = x if rnd.order is None else x[rnd.order]
    values = torch.empty(t.numel(), dtype=torch.int64, device=x.device)
    nbits = torch.zeros(xo.numel(), dtype=torch.int64, device=x.device)
    for s in range(steps.n_steps):
        busy = steps.busy[s]
        grid = (triton.cdiv(busy, BLOCK),)
        r0 = steps.readers(s)
        _decode_step[grid](
            xo, t, values, nbits, tab["coarse"], tab["packed"], tab["end"],
            tab["coarse_base"], tab["coarse_shift"], tab["value_base"], busy, r0,
            steps.offsets[s], M=PRECISION_BITS, R=STATE_BITS, BLOCK=BLOCK,
        )  # fmt: skip
        if r0 < busy:
            ends = torch.cumsum(nbits[:busy], 0)
            torch.maximum(
                stream.worst, (nbits[:busy] - STATE_BITS // 2).abs().max(), out=stream.worst
            )
            _read_step[grid](
                xo, nbits, ends, stream.cursor, stream.pairs, stream.pairs.numel(), busy,
                BLOCK=BLOCK,
            )  # fmt: skip
            stream.cursor += ends[-1]
    if rnd.order is not None:
        x[rnd.order] = xo
    if rnd.perm is None:
        return values
    out = torch.empty_like(values)
    out[rnd.perm] = values
    return out


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
