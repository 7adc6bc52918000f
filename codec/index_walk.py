"""The encoder's walk over the split trees of all chunks (see `codec.index_model`).

It produces, level by level and in (chunk, position) order, what the decoder will ask for: the
table entries of the split and leaf symbols, and the raw low bits of lone positions.

Two phases keep it cheap. Near the root almost every node is busy, so the counts of all nodes of
a level come from one histogram per chunk (summed pairwise upwards), without touching the items
again. Deeper down, only the items still inside busy nodes are followed, so the work shrinks as
positions settle.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from codec.index_model import SplitTables, binomials
from codec.index_nodes import Nodes, Split, dense_depth, grid_busy, grid_cells, grid_eff


@dataclass
class Walk:
    """Everything the encoder sends, before entropy coding."""

    rounds: list[tuple[np.ndarray, np.ndarray]]  # per level: (lane of each symbol, table entry)
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
    rows = np.repeat(np.arange(n, dtype=np.int64), k)
    hist = [
        np.bincount((rows << dense) + (flat >> (levels - dense)), minlength=n << dense).reshape(
            n, 1 << dense
        )
    ]
    for _ in range(dense):
        hist.insert(0, hist[0].reshape(n, -1, 2).sum(axis=2))
    for level in range(dense):
        size, half = 1 << (levels - level), 1 << (levels - level - 1)
        m, eff = hist[level], grid_eff(tables, level)
        busy = grid_busy(m, eff, size)
        nodes = grid_cells(busy, m, eff, level, size)
        split = Split.of(nodes, level, tables)
        j = hist[level + 1][:, 0::2].reshape(-1)[np.flatnonzero(busy)]
        sym = split.sym
        out.rounds.append((nodes.row[sym], tables.value_base[split.tid[sym]] + j[sym]))
        child_m, child_eff = hist[level + 1], grid_eff(tables, level + 1)
        lone = (child_m == 1) & (child_eff == half) & np.repeat(busy, 2, axis=1)
        cells = np.flatnonzero(lone)
        rank = (np.cumsum(child_m, axis=1) - child_m).reshape(-1)[cells]
        out.add_raw(flat[(cells >> (level + 1)) * k + rank] & (half - 1), levels - level - 1)
    size = 1 << (levels - dense)
    m, eff = hist[dense], grid_eff(tables, dense)
    busy = grid_busy(m, eff, size)
    nodes = grid_cells(busy, m, eff, dense, size)
    return nodes, flat[np.repeat(busy.reshape(-1), m.reshape(-1))]


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
    binom = binomials().reshape(-1)
    width = binomials().shape[1]
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
            leaf_m = nodes.m[leaf]
            starts = np.cumsum(leaf_m) - leaf_m
            owner = np.repeat(np.arange(leaf.size), leaf_m)
            rank = np.arange(owner.size) - starts[owner]
            local = item_val[first[leaf][owner] + rank] & (2 * split.half - 1)
            value[leaf] = np.add.reduceat(binom[local * width + rank + 1], starts)
        sym = split.sym
        out.rounds.append((nodes.row[sym], tables.value_base[split.tid[sym]] + value[sym]))
        counts = split.child_counts(nodes, j)
        _, single, active = split.kinds(counts)
        lone = np.flatnonzero(single)
        parent = lone >> 1
        lone_at = first[parent] + (lone & 1) * j[parent]
        out.add_raw(item_val[lone_at] & (split.half - 1), levels - level - 1)
        flat = np.empty(2 * j.size, dtype=np.int64)  # items per child, leaves' ones included
        flat[0::2] = j
        np.subtract(nodes.m, j, out=flat[1::2])
        item_val = item_val[np.repeat(active, flat)]
        nodes = split.pick(nodes, counts, j, active)
