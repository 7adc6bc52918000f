"""Tree nodes of the index coder, shared by its encoder walk and its decoder."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from codec.index_model import SplitTables

_EMPTY = np.zeros(0, np.int64)


@dataclass
class Nodes:
    """Pending nodes of one tree level, in (chunk, position) order."""

    row: np.ndarray
    start: np.ndarray
    eff: np.ndarray
    m: np.ndarray
    rank: np.ndarray  # decoder only: rank of the node's first position within its row

    @classmethod
    def roots(cls, n: int, chunk_size: int, k: int) -> Nodes:
        zeros = np.zeros(n, np.int64)
        return cls(np.arange(n, dtype=np.int64), zeros, zeros + chunk_size, zeros + k, zeros)


@dataclass
class Split:
    """What every node of a level does: its table, whether it sends a symbol, its children."""

    half: int
    tid: np.ndarray
    leaf: np.ndarray
    sym: np.ndarray
    lo: np.ndarray
    child_eff: np.ndarray | None  # (n, 2), or None when every child is a full `half` block

    @classmethod
    def of(cls, nodes: Nodes, level: int, tables: SplitTables) -> Split:
        half = 1 << (tables.levels - level - 1)
        partial = nodes.eff != 2 * half
        child_eff = None
        tid = nodes.m + 2 * level * (tables.k + 1)
        if partial.any():  # at most one node per chunk straddles the chunk's end
            tid += partial * (tables.k + 1)
            child_eff = np.empty((nodes.eff.size, 2), dtype=np.int64)
            np.minimum(nodes.eff, half, out=child_eff[:, 0])
            np.subtract(nodes.eff, child_eff[:, 0], out=child_eff[:, 1])
        return cls(
            half,
            tid,
            tables.is_leaf.take(tid),
            tables.sends.take(tid),
            tables.split_lo.take(tid),
            child_eff,
        )

    def child_counts(self, nodes: Nodes, j: np.ndarray) -> np.ndarray:
        counts = np.empty((j.size, 2), dtype=np.int64)
        keep = ~self.leaf  # a leaf sends its whole subset and has no children
        np.multiply(j, keep, out=counts[:, 0])
        np.subtract(nodes.m, j, out=counts[:, 1])
        counts[:, 1] *= keep
        return counts

    def kinds(self, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Flat (full, single, active) masks over the children, left and right interleaved."""
        c = counts.reshape(-1)
        e = self.half if self.child_eff is None else self.child_eff.reshape(-1)
        full = c == e
        if self.child_eff is not None:
            full &= c > 0
        single = c == 1
        if self.child_eff is not None:
            single &= e == self.half
        active = c > 0
        active &= c < e
        if self.half > 1:  # then every single child is among those (1 < half = e)
            active ^= single
        return full, single, active

    def pick_lone(
        self, nodes: Nodes, j: np.ndarray, mask: np.ndarray, k: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(output position, block start) of the lone positions picked by `mask`."""
        idx = np.flatnonzero(mask)
        parent, side = idx >> 1, idx & 1
        rank = nodes.rank.take(parent) + side * j.take(parent)
        return nodes.row.take(parent) * k + rank, nodes.start.take(parent) + side * self.half

    def pick(self, nodes: Nodes, counts: np.ndarray, j: np.ndarray, mask: np.ndarray) -> Nodes:
        idx = np.flatnonzero(mask)
        parent, side = idx >> 1, idx & 1
        if self.child_eff is None:
            eff = np.full(idx.size, self.half, dtype=np.int64)
        else:
            eff = self.child_eff.reshape(-1).take(idx)
        return Nodes(
            row=nodes.row.take(parent),
            start=nodes.start.take(parent) + side * self.half,
            eff=eff,
            m=counts.reshape(-1).take(idx),
            rank=nodes.rank.take(parent) + side * j.take(parent) if nodes.rank.size else _EMPTY,
        )


def transposed(a: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of the transpose of a 2-D array of 1- or 2-byte items. (torch's
    blocked copy: numpy's copy of a transposed view strides through memory, several times
    slower on the (n, cells) <-> (cells, n) grids here.)"""
    return torch.from_numpy(np.ascontiguousarray(a)).t().contiguous().numpy()


GRID_ITEMS_PER_CELL = 2  # grid levels go down to cells holding about this many positions


def dense_depth(k: int, levels: int) -> int:
    """Levels walked as full grids of cells, every cell coding a symbol: near the root nearly
    every cell is busy, and such a level needs no schedule, permutation or node list."""
    return max(0, min(k.bit_length() - GRID_ITEMS_PER_CELL.bit_length() + 1, levels - 1))


def grid_eff(tables: SplitTables, level: int) -> np.ndarray:
    """Effective size of each of the 2**level cells of a level (only the last may be partial)."""
    size = 1 << (tables.levels - level)
    return np.clip(tables.chunk_size - np.arange(1 << level) * size, 0, size)


def grid_busy(m: np.ndarray, eff: np.ndarray, size: int) -> np.ndarray:
    """Cells that still need work: not empty, not full, not a lone position in a full block."""
    return (m >= 1) & (m < eff) & ~((m == 1) & (eff == size))


def grid_tids(tables: SplitTables, level: int, m: np.ndarray, eff: np.ndarray) -> np.ndarray:
    """Table of each cell of an (n, 2**level) grid; `m` is 0 in cells that code nothing, whose
    table then sends the certain symbol (state unchanged, no bits), like a forced split's."""
    partial = eff != (1 << (tables.levels - level))
    return m + ((2 * level + partial) * (tables.k + 1))


def grid_leaves(tables: SplitTables, level: int, mb: np.ndarray, eff: np.ndarray) -> np.ndarray:
    """Cells of a cell-major (2**level, n) grid whose table is a leaf, from `mb` (int16: the
    count where the cell codes a symbol, else 0). Leaves are full-size cells whose count lies in
    the runs of leaf counts of the level's table (C(size, m) is unimodal in m: at most two runs),
    tested with compares instead of a gather by table id."""
    k = tables.k
    first = 2 * level * (k + 1)  # the level's full-size tables
    counts = np.flatnonzero(tables.is_leaf[first : first + k + 1])
    leaf = np.zeros(mb.shape, dtype=bool)
    if counts.size == 0:
        return leaf
    ends = np.flatnonzero(np.diff(counts) != 1)
    runs = zip(counts[np.r_[0, ends + 1]].tolist(), counts[np.r_[ends, -1]].tolist(), strict=True)
    for lo, hi in runs:
        leaf |= (mb - lo).view(np.uint16) <= hi - lo  # lo <= mb <= hi (lo >= 2 > 0)
    leaf[np.flatnonzero(eff != 1 << (tables.levels - level))] = False  # partial: never a leaf
    return leaf


def grid_busy_t(m: np.ndarray, eff: np.ndarray, size: int) -> np.ndarray:
    """`grid_busy` of a cell-major (2**level, n) grid: 2 <= m < size, but 1 <= m < e in the cell
    straddling C (where a lone position is no full block) and none in the cells past it. `m` is
    any signed integer type; counts never exceed its range."""
    if size - 2 <= np.iinfo(m.dtype).max:  # one unsigned comparison tests 2 <= m < size
        busy = (m - 2).view(np.dtype(f"u{m.itemsize}")) < size - 2
    else:  # m < size holds for every count of this type
        busy = m >= 2
    odd = np.flatnonzero(eff != size)
    busy[odd] = grid_busy(m[odd], eff[odd, None], size)
    return busy


def items_before(m: np.ndarray) -> np.ndarray:
    """Exclusive running sum down the cells of a cell-major grid: how many positions of its chunk
    lie before each cell. (A row loop: numpy's cumsum along axis 0 is many times slower.)"""
    out = np.empty_like(m)
    out[0] = 0
    for c in range(1, m.shape[0]):
        np.add(out[c - 1], m[c - 1], out=out[c])
    return out


def grid_cells(
    busy: np.ndarray,
    m: np.ndarray,
    eff: np.ndarray,
    level: int,
    size: int,
    rank: np.ndarray | None = None,
) -> Nodes:
    """The busy cells of an (n, 2**level) grid as a node list in (chunk, position) order."""
    cells = np.flatnonzero(busy)
    q = cells & ((1 << level) - 1)
    return Nodes(
        row=cells >> level,
        start=q * size,
        eff=eff.take(q),
        m=m.reshape(-1).take(cells),
        rank=rank.reshape(-1).take(cells) if rank is not None else _EMPTY,
    )
