"""The encoder's walk over the split trees of all chunks (see `codec.index_model`).

It produces, level by level and in (chunk, position) order, what the decoder will ask for: the
table entries of the split and leaf symbols, and the raw low bits of lone positions.

Two phases keep it cheap. Near the root almost every node is busy, so the counts of all cells of
a level come from one histogram per chunk (summed pairwise upwards), without touching the items
again; these grid levels are cell-major (cells, n), the order they are coded in, and every cell
codes a symbol (the certain one if it sends nothing). Deeper down, only the items still inside
busy nodes are followed, so the work shrinks as positions settle.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from codec.index_model import MAX_LEAF_BLOCK, SplitTables, binomials
from codec.index_nodes import (
    Nodes,
    Split,
    dense_depth,
    grid_busy_t,
    grid_cells,
    grid_eff,
    grid_tids,
    items_before,
    transposed,
)


@dataclass
class Walk:
    """Everything the encoder sends, before entropy coding."""

    # per level: (lane of each symbol, table entry); lanes None for a grid level, whose entries
    # are step-major: every lane codes one symbol per cell, cell by cell
    rounds: list[tuple[np.ndarray | None, np.ndarray]]
    raw_vals: list[np.ndarray]
    raw_widths: list[np.ndarray]

    def add_raw(self, values: np.ndarray, width: int) -> None:
        self.raw_vals.append(values)
        self.raw_widths.append(np.full(values.size, width, np.int64))


def walk(arr: np.ndarray, tables: SplitTables) -> Walk:
    """Walk the split trees of all rows of `arr` (sorted chunk positions, shape (n, k))."""
    k = arr.shape[1]
    levels = tables.levels
    out = Walk([], [], [])
    if k == 1 and tables.chunk_size == 1 << levels:  # a lone position: all raw
        out.add_raw(arr.reshape(-1), levels)
        return out
    dense = dense_depth(k, levels)
    nodes, item_val = _dense_phase(arr, tables, dense, out)
    _item_phase(nodes, item_val, tables, dense, out)
    return out


def _dense_phase(
    arr: np.ndarray, tables: SplitTables, dense: int, out: Walk
) -> tuple[Nodes, np.ndarray]:
    n, k = arr.shape
    levels = tables.levels
    flat = arr.reshape(-1)
    cell = arr >> (levels - dense)
    cell += np.arange(n, dtype=np.int64)[:, None] << dense
    cell = cell.reshape(-1)  # each item's finest grid cell, (chunk, position) order
    fine = np.bincount(cell, minlength=n << dense).reshape(n, 1 << dense)
    # cell-major grids (cells, n), as they are coded; counts (<= k <= 1024) fit int16
    hist = [transposed(fine.astype(np.int16))]
    for _ in range(dense):
        hist.insert(0, hist[0][0::2] + hist[0][1::2])
    # item index of the first item of each finest cell; a coarser cell starts where its first
    # finest cell does, so one running sum serves every level
    first = (items_before(hist[dense]) + np.arange(n, dtype=np.int64) * k).reshape(-1)
    alive: np.ndarray | None = None  # cells not inside a leaf (None: all of them)
    for level in range(dense):
        size, half = 1 << (levels - level), 1 << (levels - level - 1)
        m, eff = hist[level] if alive is None else hist[level] * alive, grid_eff(tables, level)
        busy = grid_busy_t(m, eff, size)
        tid = grid_tids(tables, level, np.zeros(1, np.int64), eff)[:, None] + m * busy
        value = hist[level + 1][0::2] * busy  # j, or 0 where the cell codes nothing
        if size <= MAX_LEAF_BLOCK and (leaf := tables.is_leaf.take(tid)).any():
            at = np.flatnonzero(leaf)
            items = first.take(_finest(at, n, dense - level))
            value.reshape(-1)[at] = leaf_ranks(flat, items, m.reshape(-1).take(at), size)
            busy &= ~leaf
            alive = ~leaf if alive is None else alive & ~leaf
        entry = tables.value_base.take(tid)
        entry += value
        out.rounds.append((None, entry.reshape(-1)))
        child_m, child_eff = hist[level + 1], grid_eff(tables, level + 1)
        lone = child_m == 1
        lone[np.flatnonzero(child_eff != half)] = False
        lone.reshape(-1, 2, n)[...] &= busy[:, None, :]
        at = np.flatnonzero(lone)
        out.add_raw(
            flat.take(first.take(_finest(at, n, dense - level - 1))) & (half - 1),
            levels - level - 1,
        )
        if alive is not None:
            alive = np.repeat(alive, 2, axis=0)
    size = 1 << (levels - dense)
    eff = grid_eff(tables, dense)
    m = hist[dense] if alive is None else hist[dense] * alive
    busy = transposed(grid_busy_t(m, eff, size))  # (chunk, position) order
    nodes = grid_cells(busy, fine, eff, dense, size)
    return nodes, flat[busy.reshape(-1).take(cell)]


def _finest(at: np.ndarray, n: int, shift: int) -> np.ndarray:
    """Flat index, in the finest cell-major grid, of the first finest cell of each cell `at` of
    a cell-major grid `shift` levels coarser (both grids n lanes wide)."""
    if shift == 0:
        return at
    return at + (at // n) * (n * ((1 << shift) - 1))


def _item_phase(
    nodes: Nodes,
    item_val: np.ndarray,
    tables: SplitTables,
    start_level: int,
    out: Walk,
) -> None:
    """Items stay in (chunk, position) order, so a node's items are a run of `nodes.m` of them
    starting at `first`, and its children's runs follow in left, right order: lone and leaf items
    are found from their nodes, and the items of active children are kept with one mask."""
    levels = tables.levels
    for level in range(start_level, levels):
        if nodes.row.size == 0:
            break
        split = Split.of(nodes, level, tables)
        first = np.cumsum(nodes.m) - nodes.m
        bit = item_val >> (levels - level - 1)
        bit &= 1
        j = nodes.m - np.add.reduceat(bit, first)
        value = j
        if split.leaf.any():
            value = j.copy()
            leaf = np.flatnonzero(split.leaf)
            value[leaf] = leaf_ranks(item_val, first.take(leaf), nodes.m.take(leaf), 2 * split.half)
        sym = np.flatnonzero(split.sym)
        entry = tables.value_base.take(split.tid.take(sym)) + value.take(sym)
        out.rounds.append((nodes.row.take(sym), entry))
        counts = split.child_counts(nodes, j)
        _, single, active = split.kinds(counts)
        lone = np.flatnonzero(single)
        parent = lone >> 1
        lone_at = first.take(parent) + (lone & 1) * j.take(parent)
        out.add_raw(item_val.take(lone_at) & (split.half - 1), levels - level - 1)
        flat = np.empty(2 * j.size, dtype=np.int64)  # items per child, leaves' ones included
        flat[0::2] = j
        np.subtract(nodes.m, j, out=flat[1::2])
        item_val = item_val[np.repeat(active, flat)]
        nodes = split.pick(nodes, counts, j, active)


def leaf_ranks(items: np.ndarray, at: np.ndarray, m: np.ndarray, size: int) -> np.ndarray:
    """Colex rank (sum over its i-th position p of C(p, i + 1)) of each leaf, a block of `size`
    positions whose `m` items are items[at : at + m]."""
    binom = np.ascontiguousarray(binomials().T)  # binom[r, n] = C(n, r)
    ranks = np.empty(at.size, dtype=np.int64)
    for mm in range(int(m.min()), int(m.max()) + 1):
        group = np.flatnonzero(m == mm)
        if group.size:
            local = items.take(at.take(group) + np.arange(mm)[:, None])  # (mm, leaves)
            local &= size - 1
            rank = binom[1].take(local[0])
            for i in range(1, mm):
                rank += binom[i + 1].take(local[i])
            ranks[group] = rank
    return ranks
