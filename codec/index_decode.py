"""The index decoder's walk: rebuild every chunk's positions from the bit stream.

It mirrors `codec.index_walk`: near the root, levels are (chunk x cell) grids where nearly every
cell is busy, so children's counts and ranks are grid arithmetic; deeper down, only the busy nodes
are carried as lists. Lone positions are collected with their output slot and filled in at the
end, once the lanes' final states have given back the raw bits they carried.
"""

from __future__ import annotations

import numpy as np

from codec.bitio import BitReader, pack_fields
from codec.errors import DecodeError
from codec.index_model import SplitTables, leaf_columns, split_tables
from codec.index_nodes import Nodes, Split, dense_depth, grid_busy, grid_cells, grid_eff
from codec.rans import STATE_BITS, STATE_LOW, Round, decode_round

_EMPTY = np.zeros(0, np.int64)
_Lone = tuple[np.ndarray, np.ndarray, int]  # (output slot, block start, raw width)


def decode_body(body: bytes, chunk_size: int, k: int, n: int) -> np.ndarray:
    """Positions (n, k) from the bit stream of `n` chunks (header already parsed and checked)."""
    tables = split_tables(chunk_size, k)
    levels = tables.levels
    reader = BitReader(body)
    x = reader.read_uniform(n, STATE_BITS) | STATE_LOW
    out = np.empty(n * k, dtype=np.int64)
    lone: list[_Lone] = []
    if k == 1 and chunk_size == 1 << levels:
        lone.append((np.arange(n, dtype=np.int64), np.zeros(n, np.int64), levels))
    else:
        dense = dense_depth(k, levels)
        nodes = _dense_phase(x, tables, reader, n, dense, out, lone)
        _sparse_phase(x, tables, reader, n, dense, nodes, out, lone)
    widths = np.concatenate([np.full(p.size, w, np.int64) for p, _, w in lone])
    raw = _read_raw(reader, x, widths, n)
    slots = np.concatenate([p for p, _, _ in lone])
    out[slots] = np.concatenate([s for _, s, _ in lone]) + raw
    return out.reshape(n, k)


def _decode_splits(
    x: np.ndarray, nodes: Nodes, split: Split, tables: SplitTables, reader: BitReader, n: int
) -> np.ndarray:
    """Each node's value: j for a split (forced ones keep their only value), rank for a leaf."""
    value = split.lo.copy()
    if split.sym.any():
        sym = split.sym
        value[sym] = decode_round(x, Round.build(nodes.row[sym], n), split.tid[sym], tables, reader)
    return value


def _dense_phase(
    x: np.ndarray,
    tables: SplitTables,
    reader: BitReader,
    n: int,
    dense: int,
    out: np.ndarray,
    lone: list[_Lone],
) -> Nodes:
    k = tables.k
    levels = tables.levels
    m = np.full((n, 1), k, dtype=np.int64)
    rank = np.zeros((n, 1), dtype=np.int64)
    for level in range(dense):
        size, half = 1 << (levels - level), 1 << (levels - level - 1)
        busy = grid_busy(m, grid_eff(tables, level), size)
        nodes = grid_cells(busy, m, grid_eff(tables, level), level, size)
        j = _decode_splits(x, nodes, Split.of(nodes, level, tables), tables, reader, n)
        left = np.zeros(busy.size, np.int64)
        left[np.flatnonzero(busy)] = j
        left = left.reshape(busy.shape)
        child = np.empty((n, busy.shape[1], 2), np.int64)
        child[:, :, 0] = left
        np.subtract(m, left, out=child[:, :, 1])
        child[:, :, 1] *= busy
        child_m = child.reshape(n, -1)
        child_rank = np.empty_like(child)
        child_rank[:, :, 0] = rank
        np.add(rank, left, out=child_rank[:, :, 1])
        rank = child_rank.reshape(n, -1)
        child_eff = grid_eff(tables, level + 1)
        cells = np.flatnonzero((child_m == 1) & (child_eff == half))
        q = cells & ((2 << level) - 1)
        at = (cells >> (level + 1)) * k + rank.reshape(-1).take(cells)
        lone.append((at, q * half, levels - level - 1))
        full = (child_m == child_eff) & (child_m > 0)
        if full.any():
            _write_full(out, grid_cells(full, child_m, child_eff, level + 1, half, rank), k)
        m = child_m
    size = 1 << (levels - dense)
    eff = grid_eff(tables, dense)
    return grid_cells(grid_busy(m, eff, size), m, eff, dense, size, rank)


def _sparse_phase(
    x: np.ndarray,
    tables: SplitTables,
    reader: BitReader,
    n: int,
    start_level: int,
    nodes: Nodes,
    out: np.ndarray,
    lone: list[_Lone],
) -> None:
    k = tables.k
    levels = tables.levels
    for level in range(start_level, levels):
        if nodes.row.size == 0:
            break
        split = Split.of(nodes, level, tables)
        value = _decode_splits(x, nodes, split, tables, reader, n)
        if split.leaf.any():
            _write_leaves(out, nodes, split, value, k, 2 * split.half)
        counts = split.child_counts(nodes, value)
        full, single, active = split.kinds(counts)
        if full.any():
            _write_full(out, split.pick(nodes, counts, value, full), k)
        lone.append((*split.pick_lone(nodes, value, single, k), levels - level - 1))
        nodes = split.pick(nodes, counts, value, active)


def _write_leaves(
    out: np.ndarray, nodes: Nodes, split: Split, value: np.ndarray, k: int, size: int
) -> None:
    """Expand each leaf's colex rank into its positions (one lookup table per block size)."""
    sel = np.flatnonzero(split.leaf)
    m = nodes.m.take(sel)
    rank = value.take(sel)
    start = nodes.start.take(sel)
    dst = nodes.row.take(sel) * k + nodes.rank.take(sel)
    for mm in range(int(m.min()), int(m.max()) + 1):
        group = np.flatnonzero(m == mm)
        if group.size:
            rows = leaf_columns(size, mm).take(rank.take(group), axis=1)  # (mm, leaves)
            rows += start.take(group)
            out[dst.take(group) + np.arange(mm)[:, None]] = rows


def _write_full(out: np.ndarray, fulls: Nodes, k: int) -> None:
    within = np.arange(int(fulls.eff.sum())) - np.repeat(
        np.cumsum(fulls.eff) - fulls.eff, fulls.eff
    )
    out[np.repeat(fulls.row * k + fulls.rank, fulls.eff) + within] = (
        np.repeat(fulls.start, fulls.eff) + within
    )


def _read_raw(reader: BitReader, x: np.ndarray, widths: np.ndarray, n: int) -> np.ndarray:
    """Raw fields: the explicit part from the stream, the rest from the lanes' final states."""
    total = int(widths.sum())
    back = min(STATE_BITS, total // n)
    tail = x - STATE_LOW
    if (tail >> back).any():
        raise DecodeError("index stream is corrupt: lane states do not end where they began")
    explicit = total - n * back
    if explicit > reader.total_bits - reader.cursor:
        raise DecodeError("index stream truncated in its raw section")
    pieces = np.full(explicit // 32, 32, np.int64)
    if explicit % 32:
        pieces = np.append(pieces, explicit % 32)
    head = reader.read(pieces)
    reader.check_padding()
    vals = np.concatenate([head, tail]) if back else head
    wids = np.concatenate([pieces, np.full(n, back, np.int64)]) if back else pieces
    joined, _ = pack_fields(vals, wids)
    return BitReader(joined).read(widths)
