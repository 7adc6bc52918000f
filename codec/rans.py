"""Lane-parallel rANS with bit-granular renormalisation, one lane per chunk.

All lanes share one bit stream. Symbols are grouped into *rounds* (one tree level of the index
coder); within a round, lane i has c_i symbols and step s codes the s-th symbol of every lane with
more than s. Lanes are visited busiest first, so the lanes busy at a step are a prefix of that
order and every step works on array slices. A grid round (`Round.grid`) has every lane code the
same number of symbols, given step-major: no order, no permutation.

States live in [2**R, 2**(R+1)) between groups of GROUP symbols. Decoding a symbol of frequency
f (out of 2**M) is x <- f * (x >> M) + slot - cum; after each group (and after a lane's last
symbol of a round) the decoder reads the bits that bring the state back into range. The encoder
mirrors it: before a group (in reverse), it shifts out the fewest low bits that put the state in
[F * 2**(R - g*M), 2 * F * 2**(R - g*M)), F the product of the group's g frequencies, then encodes
x <- (x // f) * 2**M + x % f + cum for each. Because R >= GROUP * M, those intervals are dyadic
and the bit count is unique, so encoder and decoder agree exactly. Reading once per group instead
of once per symbol halves the renormalisation work. A step's fields are laid out lane after lane.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from codec.bitio import BitReader
from codec.errors import DecodeError
from codec.index_model import KEY_BITS, PRECISION_BITS, RECORD_BITS, RECORD_MASK, SplitTables

GROUP = 2
STATE_BITS = GROUP * PRECISION_BITS  # R: 30, so every renormalisation field fits 32 bits
STATE_LOW = 1 << STATE_BITS
_M = PRECISION_BITS
_SLOT_MASK = (1 << PRECISION_BITS) - 1
_KEY_MASK = (1 << KEY_BITS) - 1
# a record's value field (bits 16..31, < 2**15) is one of the int16s of its int64
_VALUE_AT = RECORD_BITS // 16 if sys.byteorder == "little" else 3 - RECORD_BITS // 16


def _exponent(x: np.ndarray) -> np.ndarray:
    """The float64 exponent field of each int64 0 <= x < 2**53 (exact in float64): the bit
    length plus 1022 for x > 0, 0 for x = 0."""
    e = x.astype(np.float64).view(np.int64)
    e >>= 52
    return e


@dataclass(frozen=True)
class Round:
    """The step schedule of one round: which symbol each busy lane codes at each step."""

    order: np.ndarray | None  # lanes, busiest first (None: in lane order)
    busy: list[int]  # number of busy lanes at each step, then a final 0
    offsets: list[int]  # where each step starts in step-major symbol order
    perm: np.ndarray | None  # step-major position -> symbol index (None: symbols are step-major)

    @classmethod
    def grid(cls, n_lanes: int, n_steps: int) -> Round:
        """Every lane codes `n_steps` symbols, given step-major (symbol s * n_lanes + lane)."""
        return cls(
            order=None,
            busy=[n_lanes] * n_steps + [0],
            offsets=list(range(0, (n_steps + 1) * n_lanes, n_lanes)),
            perm=None,
        )

    @classmethod
    def build(cls, lanes_of_symbols: np.ndarray, n_lanes: int) -> Round:
        """`lanes_of_symbols` must be sorted: a lane's symbols are contiguous and in order."""
        counts = np.bincount(lanes_of_symbols, minlength=n_lanes)
        n_steps = int(counts.max(initial=0))
        if counts.size and int(counts.min()) == n_steps:  # every lane as busy: a transpose
            return cls(
                order=None,
                busy=[n_lanes] * n_steps + [0],
                offsets=list(range(0, (n_steps + 1) * n_lanes, n_lanes)),
                perm=np.arange(lanes_of_symbols.size).reshape(n_lanes, n_steps).T.reshape(-1),
            )
        order = np.argsort(-counts.astype(np.int16), kind="stable")  # radix sort
        busy = n_lanes - np.cumsum(np.bincount(counts, minlength=n_steps + 1))[:n_steps]
        offsets = np.concatenate([[0], np.cumsum(busy)])
        first = (np.cumsum(counts) - counts).take(order)  # each lane's first symbol, busiest first
        busy_list = busy.tolist()
        perm = (
            np.concatenate([first[:b] + s for s, b in enumerate(busy_list)])
            if busy_list
            else first[:0]
        )
        return cls(order=order, busy=[*busy_list, 0], offsets=offsets.tolist(), perm=perm)

    @property
    def n_steps(self) -> int:
        return len(self.busy) - 1

    def readers(self, s: int) -> int:
        """Lanes [readers(s), busy[s]) renormalise after step s: a group ends or they finish."""
        return 0 if s % GROUP == GROUP - 1 else self.busy[s + 1]

    def step(self, s: int) -> slice:
        return slice(self.offsets[s], self.offsets[s + 1])


def encode_round(
    x: np.ndarray, rnd: Round, entries: np.ndarray, tables: SplitTables
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Encode one round (in reverse); updates lane states `x`; returns fields in decoding order."""
    e = entries if rnd.perm is None else entries.take(rnd.perm)
    freq, cum = tables.freq.take(e), tables.cum.take(e)
    xo = x if rnd.order is None else x.take(rnd.order)
    fields: list[tuple[np.ndarray, np.ndarray]] = []
    for s in range(rnd.n_steps - 1, -1, -1):
        busy, r0 = rnd.busy[s], rnd.readers(s)
        if r0 < busy:
            first = s - s % GROUP
            lower = freq[rnd.step(s)][r0:busy].copy()
            for t in range(first, s):
                lower *= freq[rnd.step(t)][r0:busy]
            lower <<= STATE_BITS - (s - first + 1) * _M
            xs = xo[r0:busy]
            nbits = _exponent(xs) - _exponent(lower)  # bit length difference (both > 0)
            nbits -= (xs >> nbits) < lower
            fields.append((xs & ((1 << nbits) - 1), nbits))
            xo[r0:busy] = xs >> nbits
        sl = rnd.step(s)
        xs, f = xo[:busy], freq[sl]
        # x < 2**31 and f < 2**16: the float64 quotient truncates to the exact one (it lies at
        # least 1/f below the next integer, far more than its rounding error)
        q = np.divide(xs, f).astype(np.int64)
        xs += q * ((1 << _M) - f)  # (q << M) + (x - q * f)
        xs += cum[sl]
    if rnd.order is not None:
        x[rnd.order] = xo
    fields.reverse()
    return fields


def decode_round(
    x: np.ndarray, rnd: Round, tids: np.ndarray, tables: SplitTables, reader: BitReader
) -> np.ndarray:
    """Decode one round; updates lane states `x`; returns each symbol's value (j or leaf rank,
    int16).

    Per step, one gather fetches the record (`codec.index_model.record`) of each symbol's
    candidate entry from the coarse lookup; with d = slot - cum (< freq, else the candidate is
    behind: a short forward scan), the state becomes (x >> M) * freq + d. Everything a step needs
    is gathered per step, into preallocated buffers, so the working set stays in cache."""
    t = tids if rnd.perm is None else tids.take(rnd.perm)
    values = np.empty(t.size, dtype=np.int16)
    coarse, key = tables.coarse_record, tables.coarse_key
    xo = x if rnd.order is None else x.take(rnd.order)
    buf = np.empty((4, rnd.busy[0]), dtype=np.int64)
    bits = np.empty(rnd.busy[0] + 1, dtype=np.int64)  # scratch: [cursor, field widths...]
    for s in range(rnd.n_steps):
        busy, sl = rnd.busy[s], rnd.step(s)
        ts = t[sl]
        xs, d, f, rec, g = xo[:busy], *buf[:, :busy]
        np.bitwise_and(xs, _SLOT_MASK, out=d)  # the slot
        np.take(key, ts, out=g, mode="clip")  # in range; "raise" would copy through a buffer
        np.right_shift(d, np.bitwise_and(g, _KEY_MASK, out=f), out=f)
        g >>= KEY_BITS
        f += g
        np.take(coarse, f, out=rec, mode="clip")
        d -= np.bitwise_and(rec, RECORD_MASK, out=f)  # cum
        np.right_shift(rec, 2 * RECORD_BITS, out=f)  # freq
        behind = np.flatnonzero(d >= f)
        if behind.size:
            _scan(rec, d, f, behind, ts, tables)
        xs >>= _M
        xs *= f
        xs += d
        np.copyto(values[sl], rec.view(np.int16)[_VALUE_AT::4])
        r0 = rnd.readers(s)
        if r0 < busy:
            _renormalise(xs[r0:], bits[: busy - r0 + 1], reader)
    if rnd.order is not None:
        x[rnd.order] = xo
    if rnd.perm is None:
        return values
    out = np.empty_like(values)
    out[rnd.perm] = values
    return out


def _scan(
    rec: np.ndarray,
    d: np.ndarray,
    f: np.ndarray,
    behind: np.ndarray,
    tids: np.ndarray,
    tables: SplitTables,
) -> None:
    """Move the symbols `behind` (slot at or past their entry's end) to the entry holding their
    slot; `rec`, `d` and `f` follow. The next entry's cum is this one's end: d - freq."""
    e = tables.value_base.take(tids.take(behind))  # entry = value_base + value
    e += (rec.take(behind) >> RECORD_BITS) & RECORD_MASK
    while behind.size:
        e += 1
        rb = tables.entry_record.take(e)
        db = d.take(behind) - f.take(behind)
        fb = rb >> (2 * RECORD_BITS)
        rec[behind], d[behind], f[behind] = rb, db, fb
        still = np.flatnonzero(db >= fb)
        behind, e = behind.take(still), e.take(still)


def _renormalise(x: np.ndarray, bits: np.ndarray, reader: BitReader) -> None:
    """Shift each state back into [2**R, 2**(R+1)), reading the bits it lacks (laid out lane
    after lane from the reader's cursor). `bits` is a scratch buffer of x.size + 1."""
    nbits = bits[1:]
    ex = x.astype(np.float64).view(np.int64)
    ex >>= 52  # the exponent field: bit length + 1022 (0 for x = 0)
    np.subtract(STATE_BITS + 1 + 1022, ex, out=nbits)
    if nbits.max(initial=0) > STATE_BITS:  # x == 0 (exponent field 0) lands here too
        raise DecodeError("index stream is corrupt: a lane state collapsed")
    reader.shift_in(x, bits)
