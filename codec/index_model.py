"""The probability model of the index coder: exact hypergeometric splits, quantised for rANS.

A sorted k-subset of a chunk of C positions is described by a binary split tree over the chunk
padded to P = 2**L positions (L = ceil(log2 C)); positions >= C do not exist, so a node's
*effective size* e is the number of real positions it covers. A node holding m of the subset's
positions sends how many, j, fall in its left half. Under a uniformly random subset,

    P(j | e, m) = C(a, j) * C(b, m - j) / C(e, m),   a = min(e, half), b = e - a,

and the product of these probabilities along the tree is exactly 1 / C(C, k): coding every split
with its true probability reaches the information-theoretic limit log2 C(C, k) for *every*
subset, clustered or not. A node whose split is forced costs nothing; a node holding a single
position in a full power-of-two block sends that position's low bits raw (exact again); and a
small full node (e <= MAX_LEAF_BLOCK, C(e, m) <= 2**LEAF_BITS) sends its whole subset as one
uniform symbol, its colex rank, which is exact too and saves the many tiny split symbols deep in
the tree.

Probabilities are quantised to `PRECISION_BITS` for rANS with every possible value kept at a
frequency >= 1. A table that sends nothing codes a certain symbol (frequency 2**PRECISION_BITS):
a forced split has its own such entry, standing for its only value; every other one (m = 0,
or a count no node of its class can hold) points at entry 0 of the flat arrays, standing for 0:
so every entry stands for one value.
Tables are indexed by (class, m), the class being (level, full | partial): at each level every
node but the one straddling C is full. Decoding a slot uses a coarse lookup table
(256 buckets per split table, a direct table per leaf table) and a short forward scan.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

PRECISION_BITS = 15
TOTAL_FREQ = 1 << PRECISION_BITS
COARSE_BITS = 8
LEAF_BITS = 13
MAX_LEAF_BLOCK = 128  # leaves are blocks of at most this many positions (see `binomials`)
MAX_CHUNK_BITS = 20
MAX_K = 1024


@dataclass(frozen=True)
class SplitTables:
    """Quantised distributions for one (chunk_size, k) pair, flattened for vectorised gathers."""

    chunk_size: int
    k: int
    levels: int  # L: the padded chunk has 2**L positions
    # per table (id = (2 * level + partial) * (k + 1) + m)
    is_leaf: np.ndarray  # bool: a uniform rank over the node's whole subset
    sends: np.ndarray  # bool: the node sends a symbol (a leaf, or a split that is not forced)
    split_lo: np.ndarray  # int64: the smallest possible left count (the only one if forced)
    value_base: np.ndarray  # int64: first entry - its value (entry - value_base = value)
    coarse_base: np.ndarray  # int64: where the table's coarse lookup starts
    coarse_shift: np.ndarray  # int64: slot >> shift indexes the coarse lookup
    coarse_key: np.ndarray  # int64: coarse_base << KEY_BITS | coarse_shift, one gather for both
    # per entry (int64)
    freq: np.ndarray
    cum: np.ndarray
    end: np.ndarray  # cum + freq
    coarse: np.ndarray  # int64: first candidate entry per (table, bucket)
    packed: np.ndarray  # int64: freq << 32 | cum, one gather for both
    # the CPU decoder's records (see `record`): per entry, and per coarse bucket (its candidate's)
    entry_record: np.ndarray
    coarse_record: np.ndarray

    def table_id(self, level: int, partial: np.ndarray, m: np.ndarray) -> np.ndarray:
        return (2 * level + partial) * (self.k + 1) + m


KEY_BITS = 4  # coarse shifts are at most PRECISION_BITS
RECORD_BITS = 16  # each field of a record: cum < 2**15, freq <= 2**15, value < 2**LEAF_BITS
RECORD_MASK = (1 << RECORD_BITS) - 1


def record(freq: np.ndarray, value: np.ndarray, cum: np.ndarray) -> np.ndarray:
    """An entry's freq, cum and value (j or leaf rank) in one int64, freq << 32 | value << 16 |
    cum, so that one gather per symbol fetches all three."""
    return (freq << (2 * RECORD_BITS)) | (value << RECORD_BITS) | cum


def padded_levels(chunk_size: int) -> int:
    return max(0, (chunk_size - 1).bit_length())


def is_leaf_size(e: int, m: int) -> bool:
    return (
        2 <= m < e <= MAX_LEAF_BLOCK and (e & (e - 1)) == 0 and math.comb(e, m) <= (1 << LEAF_BITS)
    )


class _Builder:
    def __init__(self, n_tables: int) -> None:
        self.starts = np.zeros(n_tables, dtype=np.int64)
        self.los = np.zeros(n_tables, dtype=np.int64)
        self.leaf = np.zeros(n_tables, dtype=bool)
        self.sends = np.zeros(n_tables, dtype=bool)
        self.split_lo = np.zeros(n_tables, dtype=np.int64)
        self.cbase = np.zeros(n_tables, dtype=np.int64)
        # Entry 0 (and coarse slot 0) is the certain symbol: frequency TOTAL_FREQ, so coding it
        # leaves the state as it is. Every table that sends nothing and has no certain entry of
        # its own (a forced split's, see `add`) points there (slot >> M = 0): its value is 0.
        self.cshift = np.full(n_tables, PRECISION_BITS, dtype=np.int64)
        self.freqs: list[np.ndarray] = [np.array([TOTAL_FREQ], dtype=np.int64)]
        self.values: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]  # what each entry stands for
        self.coarse: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]
        self.n_entries = 1
        self.n_coarse = 1

    def add(self, tid: int, lo: int, f: np.ndarray, leaf: bool) -> None:
        """A table: values lo, lo + 1, ... with frequencies `f` (a single TOTAL_FREQ: a forced
        split, which sends nothing but has its own certain entry, standing for its value lo)."""
        cum = np.cumsum(f) - f
        shift = PRECISION_BITS if f.size == 1 else 0 if leaf else PRECISION_BITS - COARSE_BITS
        buckets = np.arange(TOTAL_FREQ >> shift, dtype=np.int64) << shift
        self.starts[tid], self.los[tid], self.leaf[tid] = self.n_entries, lo, leaf
        self.sends[tid] = f.size > 1
        self.cbase[tid], self.cshift[tid] = self.n_coarse, shift
        self.values.append(lo + np.arange(f.size, dtype=np.int64))
        self.coarse.append(self.n_entries + np.searchsorted(cum + f, buckets, side="right"))
        self.freqs.append(f)
        self.n_entries += f.size
        self.n_coarse += buckets.size


@lru_cache(maxsize=64)
def split_tables(chunk_size: int, k: int) -> SplitTables:
    """Build (once per process and pair) the quantised tables of a (chunk_size, k) coder."""
    if not 1 <= chunk_size <= (1 << MAX_CHUNK_BITS):
        raise ValueError(f"chunk size {chunk_size} out of range")
    if not 0 <= k <= min(chunk_size, MAX_K):
        raise ValueError(f"k={k} out of range for chunk size {chunk_size}")
    levels = padded_levels(chunk_size)
    lf = np.concatenate([[0.0], np.cumsum(np.log2(np.arange(1, chunk_size + 1, dtype=np.float64)))])
    bld = _Builder(2 * max(levels, 1) * (k + 1))
    for level in range(levels):
        half = 1 << (levels - level - 1)
        size = 2 * half
        full_start = (chunk_size // size) * size
        for partial, e in ((0, size if chunk_size >= size else 0), (1, chunk_size - full_start)):
            if e <= 1 or (partial == 1 and e == size):
                continue
            a, b = min(e, half), e - min(e, half)
            for m in range(1, min(k, e - 1) + 1):
                tid = (2 * level + partial) * (k + 1) + m
                if not partial and is_leaf_size(e, m):
                    n_sym = math.comb(e, m)
                    bld.add(tid, 0, np.diff((np.arange(n_sym + 1) * TOTAL_FREQ) // n_sym), True)
                    continue
                lo, hi = max(0, m - b), min(m, a)
                bld.split_lo[tid] = lo
                if hi == lo:  # forced split: no symbol
                    bld.add(tid, lo, np.array([TOTAL_FREQ], dtype=np.int64), False)
                    continue
                j = np.arange(lo, hi + 1)
                logp = (lf[a] - lf[j] - lf[a - j]) + (lf[b] - lf[m - j] - lf[b - m + j])
                logp -= lf[e] - lf[m] - lf[e - m]
                bld.add(tid, lo, _quantise(np.exp2(logp)), False)
    freq = np.concatenate(bld.freqs)
    cum = np.concatenate([np.cumsum(f) - f for f in bld.freqs])
    coarse = np.concatenate(bld.coarse)
    entry_record = record(freq, np.concatenate(bld.values), cum)
    return SplitTables(
        chunk_size=chunk_size,
        k=k,
        levels=levels,
        is_leaf=bld.leaf,
        sends=bld.sends,
        split_lo=bld.split_lo,
        value_base=bld.starts - bld.los,
        coarse_base=bld.cbase,
        coarse_shift=bld.cshift,
        coarse_key=(bld.cbase << KEY_BITS) | bld.cshift,
        freq=freq,
        cum=cum,
        end=cum + freq,
        coarse=coarse,
        packed=(freq << 32) | cum,
        entry_record=entry_record,
        coarse_record=entry_record.take(coarse),
    )


def _quantise(p: np.ndarray) -> np.ndarray:
    """Integer frequencies summing to TOTAL_FREQ, each >= 1, close to p * TOTAL_FREQ."""
    f = np.maximum(1, np.floor(p * TOTAL_FREQ + 0.5)).astype(np.int64)
    f[np.argmax(f)] += TOTAL_FREQ - int(f.sum())
    if f.min() < 1:  # pragma: no cover - impossible for <= 1025 symbols at 16 bits
        raise AssertionError("quantisation left a zero frequency")
    return f


@lru_cache(maxsize=1)
def binomials() -> np.ndarray:
    """binomials()[n, r] = C(n, r) for n, r <= 128, clipped at 2**62 (leaf ranks stay < 2**13)."""
    size = 129
    table = np.zeros((size, size), dtype=np.int64)
    for n in range(size):
        for r in range(n + 1):
            table[n, r] = min(math.comb(n, r), 1 << 62)
    return table


@lru_cache(maxsize=128)
def leaf_subsets(e: int, m: int) -> np.ndarray:
    """All m-subsets of range(e) as rows, in colex order: row r has colex rank r."""
    combos = np.array(list(itertools.combinations(range(e), m)), dtype=np.int64)
    ranks = binomials()[combos, np.arange(1, m + 1)].sum(axis=1)
    out = np.empty_like(combos)
    out[ranks] = combos
    return out


@lru_cache(maxsize=128)
def leaf_columns(e: int, m: int) -> np.ndarray:
    """`leaf_subsets(e, m)` transposed (int16: e <= MAX_LEAF_BLOCK): column r holds the subset
    of colex rank r."""
    return np.ascontiguousarray(leaf_subsets(e, m).T, dtype=np.int16)
