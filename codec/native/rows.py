"""The index rows' check of `codec.compress.SparseTensor.validate`, compiled for the CPU: every
row's positions inside the chunk and strictly ascending, in one pass over the rows (the torch
checks take four passes and two temporary tensors)."""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["OK", "OUTSIDE", "UNSORTED", "check_rows"]

OK, OUTSIDE, UNSORTED = range(3)


@numba.njit(cache=True, nogil=True)
def check_rows(idx: np.ndarray, chunk_size: int) -> int:
    """`OUTSIDE` if a row of ``idx`` (n, k) has a position outside [0, chunk_size), else
    `UNSORTED` if a row is not strictly ascending, else `OK` (the torch checks' order)."""
    unsorted = False
    for r in range(idx.shape[0]):
        row = idx[r]
        if row[0] < 0 or row[row.shape[0] - 1] >= chunk_size:
            return OUTSIDE
        if not unsorted:
            for j in range(1, row.shape[0]):
                if row[j] <= row[j - 1]:
                    unsorted = True
                    break
    return UNSORTED if unsorted else OK
