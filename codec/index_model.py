"""The probability model of the index coder: exact hypergeometric splits, quantised for rANS.

A sorted k-subset of a chunk of C positions is described by a binary split tree over the chunk
padded to P = 2**L positions (L = ceil(log2 C)); positions >= C do not exist, so a node's
*effective size* e is the number of real positions it covers. A node holding m of the subset's
positions sends how many, j, fall in its left half. Under a uniformly random subset,

    P(j | e, m) = C(a, j) * C(b, m - j) / C(e, m),   a = min(e, half), b = e - a,

and the product of these probabilities along the tree is exactly 1 / C(C, k): coding every split
with its true probability reaches the information-theoretic limit log2 C(C, k) for *every*
subset, clustered or not. A node whose split is forced (j has one possible value) costs nothing,
and a node holding a single position in a full power-of-two block sends that position's low bits
raw, which is again exact.

Split probabilities are quantised to `PRECISION_BITS` for rANS, with every possible value kept
at a frequency >= 1. Tables are indexed by (class, m), where the class is (level, full|partial):
at each level, every node but the one straddling C is full.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

PRECISION_BITS = 16
TOTAL_FREQ = 1 << PRECISION_BITS
COARSE_BITS = 8
MAX_CHUNK_BITS = 20
MAX_K = 1024


@dataclass(frozen=True)
class SplitTables:
    """Quantised split distributions for one (chunk_size, k) pair, flattened for gathers."""

    chunk_size: int
    k: int
    levels: int  # L: the padded chunk has 2**L positions
    # per table (id = class * (k + 1) + m): first entry in the flat arrays and smallest j
    table_start: np.ndarray  # int64 (n_tables,)
    table_lo: np.ndarray  # int64 (n_tables,)
    # per entry: frequency and cumulative start (uint64), and the value of j it stands for
    freq: np.ndarray
    cum: np.ndarray
    end: np.ndarray  # cum + freq
    # coarse[table * 2**COARSE_BITS + (slot >> (PRECISION_BITS - COARSE_BITS))]: first candidate
    coarse: np.ndarray  # int64

    def table_id(self, level: np.ndarray, partial: np.ndarray, m: np.ndarray) -> np.ndarray:
        return ((2 * level + partial) * (self.k + 1) + m).astype(np.int64)


def padded_levels(chunk_size: int) -> int:
    return max(0, (chunk_size - 1).bit_length())


def _log_binom(n: np.ndarray, r: np.ndarray, lf: np.ndarray) -> np.ndarray:
    return lf[n] - lf[r] - lf[n - r]


@lru_cache(maxsize=64)
def split_tables(chunk_size: int, k: int) -> SplitTables:
    """Build (once per process and pair) the quantised split tables of a (chunk_size, k) coder."""
    if not 1 <= chunk_size <= (1 << MAX_CHUNK_BITS):
        raise ValueError(f"chunk size {chunk_size} out of range")
    if not 0 <= k <= min(chunk_size, MAX_K):
        raise ValueError(f"k={k} out of range for chunk size {chunk_size}")
    levels = padded_levels(chunk_size)
    lf = np.concatenate([[0.0], np.cumsum(np.log2(np.arange(1, chunk_size + 1, dtype=np.float64)))])
    n_tables = 2 * max(levels, 1) * (k + 1)
    n_buckets = 1 << COARSE_BITS
    bucket_slots = np.arange(n_buckets, dtype=np.int64) << (PRECISION_BITS - COARSE_BITS)
    starts = np.zeros(n_tables, dtype=np.int64)
    los = np.zeros(n_tables, dtype=np.int64)
    coarse = np.zeros(n_tables * n_buckets, dtype=np.int64)
    freqs: list[np.ndarray] = []
    cums: list[np.ndarray] = []
    offset = 0
    for level in range(levels):
        half = 1 << (levels - level - 1)
        size = 2 * half
        full_start = (chunk_size // size) * size
        for partial, e in ((0, size if chunk_size >= size else 0), (1, chunk_size - full_start)):
            if e <= 1 or (partial == 1 and e == size):
                continue
            a = min(e, half)
            b = e - a
            log_total = lf[e] - lf[e - np.arange(e + 1)] - lf[np.arange(e + 1)]
            for m in range(1, min(k, e - 1) + 1):
                lo, hi = max(0, m - b), min(m, a)
                if hi == lo:
                    continue  # forced split: no symbol
                tid = (2 * level + partial) * (k + 1) + m
                j = np.arange(lo, hi + 1)
                logp = (lf[a] - lf[j] - lf[a - j]) + (lf[b] - lf[m - j] - lf[b - m + j])
                f = _quantise(np.exp2(logp - log_total[m]))
                c = np.cumsum(f) - f
                starts[tid], los[tid] = offset, lo
                sl = slice(tid * n_buckets, (tid + 1) * n_buckets)
                coarse[sl] = offset + np.searchsorted(c + f, bucket_slots, side="right")
                freqs.append(f)
                cums.append(c)
                offset += f.size
    freq = np.concatenate(freqs).astype(np.uint64) if freqs else np.zeros(1, np.uint64)
    cum = np.concatenate(cums).astype(np.uint64) if cums else np.zeros(1, np.uint64)
    return SplitTables(
        chunk_size=chunk_size,
        k=k,
        levels=levels,
        table_start=starts,
        table_lo=los,
        freq=freq,
        cum=cum,
        end=cum + freq,
        coarse=coarse,
    )


def _quantise(p: np.ndarray) -> np.ndarray:
    """Integer frequencies summing to TOTAL_FREQ, each >= 1, close to p * TOTAL_FREQ."""
    f = np.maximum(1, np.floor(p * TOTAL_FREQ + 0.5)).astype(np.int64)
    f[np.argmax(f)] += TOTAL_FREQ - int(f.sum())
    if f.min() < 1:  # pragma: no cover - impossible for <= 1025 symbols at 16 bits
        raise AssertionError("quantisation left a zero frequency")
    return f
