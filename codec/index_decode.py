"""The index decoder's walk: rebuild every chunk's positions from the bit stream.

It mirrors `codec.index_walk`: near the root, levels are cell-major (cell x chunk) grids where
nearly every cell is busy, so children's counts and output slots are grid arithmetic and each cell
is one rANS step of every lane; deeper down, only the busy nodes are carried as lists. Lone
positions are collected with their output slot and filled in at the end, once the lanes' final
states have given back the raw bits they carried.

It is the reference the other two walks are tested against: the compiled one of the CPU path
(`codec.native.index_decode`) and the device one of the GPU path (`codec.gpu.index_decode`)."""

from __future__ import annotations

import numpy as np

from codec.bitio import BitReader, pack_fields
from codec.errors import DecodeError
from codec.index_model import MAX_LEAF_BLOCK, SplitTables, leaf_columns, split_tables
from codec.index_nodes import (
    Nodes,
    Split,
    dense_depth,
    grid_busy_t,
    grid_eff,
    grid_leaves,
    grid_tids,
    transposed,
)
from codec.rans import STATE_BITS, STATE_LOW, Round, decode_round

_EMPTY = np.zeros(0, np.int64)
_Lone = tuple[np.ndarray, np.ndarray, int]  # (output slot, block start, raw width)


def decode_body(body: bytes, chunk_size: int, k: int, n: int) -> np.ndarray:
    """Positions (n, k) from the bit stream of `n` chunks (header already parsed and checked)."""
    tables = split_tables(chunk_size, k)
    levels = tables.levels
    reader = BitReader(body)
    x = reader.read_uniform(n, STATE_BITS) | STATE_LOW
    # positions are written in scattered order: the narrowest type keeps the array in cache
    out = np.empty(n * k, dtype=np.int16 if chunk_size <= 1 << 15 else np.int32)
    lone: list[_Lone] = []
    if k == 1 and chunk_size == 1 << levels:
        lone.append((np.arange(n, dtype=np.int64), np.zeros(n, np.int64), levels))
    else:
        dense = dense_depth(k, levels)
        nodes = _dense_phase(x, tables, reader, n, dense, out, lone)
        _sparse_phase(x, tables, reader, n, dense, nodes, out, lone)
    raw = _read_raw(reader, x, [(p.size, w) for p, _, w in lone], n)
    slots = np.concatenate([p for p, _, _ in lone])
    raw += np.concatenate([s for _, s, _ in lone])
    out[slots] = raw.astype(out.dtype)
    return out.astype(np.int64).reshape(n, k)


def _decode_splits(
    x: np.ndarray,
    nodes: Nodes,
    split: Split,
    tables: SplitTables,
    reader: BitReader,
    n: int,
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
    """Grid levels. Grids are cell-major, (cells, n), the order the round decodes them in, so a
    cell's row is one rANS step and the one cell per level that straddles C is one row to fix.
    Counts (<= k <= 1024) and values are int16, table ids and output slots int32 (while n * k
    fits): the grids are the bulk of the work, and narrow integers cut its memory traffic."""
    k = tables.k
    levels = tables.levels
    m = np.full((1, n), k, dtype=np.int16)
    slots = np.int32 if n * k <= np.iinfo(np.int32).max else np.int64
    dst = (np.arange(n, dtype=np.int64) * k).astype(slots)[None, :]  # each cell's first slot
    for level in range(dense):
        size, half = 1 << (levels - level), 1 << (levels - level - 1)
        cells = 1 << level
        eff = grid_eff(tables, level)
        busy = grid_busy_t(m, eff, size)
        mb = m * busy  # the count where the cell codes one, else 0
        tid = mb.astype(np.int32)  # table ids < 2**31, as rounds read them
        tid += grid_tids(tables, level, np.zeros(1, np.int32), eff)[:, None]
        left = decode_round(x, Round.grid(n, cells), tid.reshape(-1), tables, reader)
        left = left.astype(np.int16, copy=False).reshape(cells, n)
        if size <= MAX_LEAF_BLOCK and (leaf := grid_leaves(tables, level, mb, eff)).any():
            # a leaf's value is its rank: it writes its positions and has no children. Taken in
            # (chunk, position) order (transposing the one-byte mask), leaves write `out` in order
            at = np.flatnonzero(transposed(leaf))
            cell = at & (cells - 1)
            at >>= level
            at += cell * n
            _write_leaves(
                out,
                dst.reshape(-1).take(at),
                cell * size,
                m.reshape(-1).take(at),
                left.reshape(-1).take(at),
                size,
            )
            busy &= ~leaf
            left *= busy
        child = np.empty((cells, 2, n), np.int16)
        child[:, 0] = left  # 0 where the cell coded nothing
        np.subtract(m, left, out=child[:, 1])
        child[:, 1] *= busy
        m = child.reshape(2 * cells, n)
        child_dst = np.empty((cells, 2, n), slots)
        child_dst[:, 0] = dst
        np.add(dst, left, out=child_dst[:, 1])
        dst = child_dst.reshape(2 * cells, n)
        child_eff = grid_eff(tables, level + 1)
        odd = np.flatnonzero(child_eff != half)  # the child straddling C, and those past it
        single = m == 1
        single[odd] = False  # a lone position must fill a whole power-of-two block
        at = np.flatnonzero(single)
        lone.append((dst.reshape(-1).take(at), (at // n) * half, levels - level - 1))
        sizes = child_eff[child_eff > 0]
        if sizes.min() <= min(k, int(m.max())):  # else no child can be full
            full = m == half
            full[odd] = (m[odd] == child_eff[odd, None]) & (m[odd] > 0)
            if full.any():
                at = np.flatnonzero(full)
                cell = at // n
                _write_full(out, dst.reshape(-1).take(at), cell * half, child_eff.take(cell))
    size = 1 << (levels - dense)
    eff = grid_eff(tables, dense)
    # nodes go in (chunk, position) order: transpose the (one byte) busy mask, not the grids
    at = np.flatnonzero(transposed(grid_busy_t(m, eff, size)))
    row, cell = at >> dense, at & ((1 << dense) - 1)
    at = cell * n + row
    rank = dst.reshape(-1).take(at).astype(np.int64)
    rank -= row * k
    return Nodes(row, cell * size, eff.take(cell), m.reshape(-1).take(at).astype(np.int64), rank)


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
            sel = np.flatnonzero(split.leaf)
            dst = nodes.row.take(sel) * k + nodes.rank.take(sel)
            start, m = nodes.start.take(sel), nodes.m.take(sel)
            _write_leaves(out, dst, start, m, value.take(sel), 2 * split.half)
        counts = split.child_counts(nodes, value)
        full, single, active = split.kinds(counts)
        if full.any():
            fulls = split.pick(nodes, counts, value, full)
            _write_full(out, fulls.row * k + fulls.rank, fulls.start, fulls.eff)
        lone.append((*split.pick_lone(nodes, value, single, k), levels - level - 1))
        nodes = split.pick(nodes, counts, value, active)


def _write_leaves(
    out: np.ndarray,
    dst: np.ndarray,
    start: np.ndarray,
    m: np.ndarray,
    rank: np.ndarray,
    size: int,
) -> None:
    """Expand each leaf's colex rank into its `m` positions, from `start` on, into out[dst:]."""
    for mm in range(int(m.min()), int(m.max()) + 1):
        group = np.flatnonzero(m == mm)
        if group.size:
            rows = leaf_columns(size, mm).take(rank.take(group), axis=1)  # (mm, leaves)
            rows = rows.astype(out.dtype, copy=False)
            rows += start.take(group).astype(out.dtype)
            out[dst.take(group) + np.arange(mm)[:, None]] = rows


def _write_full(out: np.ndarray, dst: np.ndarray, start: np.ndarray, eff: np.ndarray) -> None:
    """Full blocks: `eff` consecutive positions from `start` on, into out[dst:]."""
    within = np.arange(int(eff.sum())) - np.repeat(np.cumsum(eff) - eff, eff)
    out[np.repeat(dst, eff) + within] = np.repeat(start, eff) + within


def _read_raw(reader: BitReader, x: np.ndarray, runs: list[tuple[int, int]], n: int) -> np.ndarray:
    """Raw fields, given as runs of (count, width): the explicit part from the stream, the rest
    from the lanes' final states."""
    total = sum(count * width for count, width in runs)
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
    joined = BitReader(pack_fields(vals, wids)[0])
    return np.concatenate([joined.read_uniform(count, width) for count, width in runs])
