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
    nodes, item_val, item_node = _dense_phase(arr, tables, dense, out)
    _item_phase(nodes, item_val, item_node, tables, dense, out)
    return out


def _dense_phase(
    arr: np.ndarray, tables: SplitTables, dense: int, out: Walk
) -> tuple[Nodes, np.ndarray, np.ndarray]:
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
        out.rounds.append(
            (nodes.row[sym], tables.table_start[split.tid[sym]] + j[sym] - split.lo[sym])
        )
        child_m, child_eff = hist[level + 1], grid_eff(tables, level + 1)
        lone = (child_m == 1) & (child_eff == half) & np.repeat(busy, 2, axis=1)
        cells = np.flatnonzero(lone)
        rank = (np.cumsum(child_m, axis=1) - child_m).reshape(-1)[cells]
        out.add_raw(flat[(cells >> (level + 1)) * k + rank] & (half - 1), levels - level - 1)
    size = 1 << (levels - dense)
    m, eff = hist[dense], grid_eff(tables, dense)
    busy = grid_busy(m, eff, size)
    nodes = grid_cells(busy, m, eff, dense, size)
    first = (np.cumsum(m, axis=1) - m).reshape(-1)[np.flatnonzero(busy)] + nodes.row * k
    item_node = np.repeat(np.arange(nodes.m.size, dtype=np.int64), nodes.m)
    within = np.arange(item_node.size) - np.repeat(np.cumsum(nodes.m) - nodes.m, nodes.m)
    return nodes, flat[first[item_node] + within], item_node


def _item_phase(
    nodes: Nodes,
    item_val: np.ndarray,
    item_node: np.ndarray,
    tables: SplitTables,
    start_level: int,
    out: Walk,
) -> None:
    levels = tables.levels
    binom = binomials()
    for level in range(start_level, levels):
        if nodes.row.size == 0:
            break
        split = Split.of(nodes, level, tables)
        first = np.cumsum(nodes.m) - nodes.m
        bit = (item_val >> (levels - level - 1)) & 1
        j = nodes.m - np.add.reduceat(bit, first)
        value = j - split.lo
        if split.leaf.any():
            in_leaf = np.flatnonzero(split.leaf[item_node])
            owner = item_node[in_leaf]
            contrib = binom[item_val[in_leaf] - nodes.start[owner], in_leaf - first[owner] + 1]
            leaf_m = nodes.m[split.leaf]
            value[split.leaf] = np.add.reduceat(contrib, np.cumsum(leaf_m) - leaf_m)
        tid = split.tid[split.sym]
        out.rounds.append((nodes.row[split.sym], tables.table_start[tid] + value[split.sym]))
        counts = split.child_counts(nodes, j)
        _, single, active = split.kinds(counts)
        child = 2 * item_node + bit
        out.add_raw(item_val[single[child]] & (split.half - 1), levels - level - 1)
        keep = active[child]
        item_val, item_node = item_val[keep], (np.cumsum(active) - 1)[child[keep]]
        nodes = split.pick(nodes, counts, j, active)
