"""The index decoder's walk on the device: `codec.index_decode` in torch ops on device tensors.

It reads exactly the stream `codec.indices.encode` writes and returns exactly what
`codec.index_decode.decode_body` returns, as an int64 tensor on the stream's device. Everything
the walk keeps lives there: the stream's words and cursor, the lane states, the tables (copied
once per tables and device, `codec.gpu.rans.device_tables`), every level's counts, table ids and
output slots, the leaves' subsets, the full blocks, the lone positions and the raw section. What
runs where:

* the rANS steps of each round (one tree level): the Triton kernels of `codec.gpu.rans`, fed and
  returning device tensors; below the grid levels, a round's schedule (lane order, symbol
  permutation) is built on the device too (`codec.gpu.rans.DeviceRound`);
* grid levels (near the root, `codec.index_nodes.dense_depth`): cell-major (cells, n) grids of
  counts and output slots, each level's busy cells, table ids, children, leaves, lone positions
  and full blocks as elementwise torch ops over the grid;
* levels below: the busy nodes as lists in (chunk, position) order, picked with `nonzero`;
* a leaf's positions: one gather from a flat table of every leaf subset of its block size (in
  colex order, on the device), a full block's by arithmetic, both expanded with
  `repeat_interleave`; the lone positions' raw fields: the raw section (the stream's explicit
  part, then the bits the lanes' final states carried) joined into words on the device and read
  with one gather.

What comes back to the host: the sizes of what `nonzero` and `repeat_interleave` select (a sync
each, a few per level), each round's lane counts per step below the grid levels (they size the
kernel launches), and once at the end the stream's cursor, its worst renormalisation and whether
the lanes' states ended where they began (three integers): a round never raises, the stream is
checked once after the last one (`codec.gpu.rans.DeviceStream`), in the numpy walk's order, and
before the raw section is read. The padding after the stream is checked on the host's copy of the
bytes. Every count a symbol implies is consistent whatever the bytes (every symbol comes from its
table), so a corrupt stream cannot make the walk allocate more than a sound one of its shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from codec.bitio import BitReader
from codec.errors import DecodeError
from codec.gpu.rans import DeviceRound, DeviceStream, decode_round, device_tables
from codec.index_model import MAX_LEAF_BLOCK, SplitTables, leaf_subsets, split_tables
from codec.index_nodes import dense_depth
from codec.rans import STATE_BITS, STATE_LOW

__all__ = ["decode_body"]

_I64 = torch.int64
_Lone = tuple[torch.Tensor, torch.Tensor, int]  # (output slot, block start, raw width)


@dataclass
class _Walk:
    """What every level of the walk reads and updates."""

    tables: SplitTables
    tab: dict[str, torch.Tensor]  # the tables on the device
    stream: DeviceStream
    x: torch.Tensor  # the lane states, int64 (n,)
    n: int
    out: torch.Tensor  # the positions, int64 (n * k,), row after row
    lone: list[_Lone]  # the lone positions of each level, in the order of their raw fields


@dataclass
class _Nodes:
    """Pending nodes of one level below the grid, in (chunk, position) order (int64 each)."""

    row: torch.Tensor
    start: torch.Tensor
    eff: torch.Tensor
    m: torch.Tensor
    rank: torch.Tensor  # rank of the node's first position within its row


def decode_body(body: bytes, chunk_size: int, k: int, n: int, device: torch.device) -> torch.Tensor:
    """Positions (n, k), int64 on `device`, from the bit stream of `n` chunks (header already
    parsed and checked)."""
    tables = split_tables(chunk_size, k)
    levels = tables.levels
    reader = BitReader(body)
    if n * STATE_BITS > reader.total_bits:  # the states' reads would leave the stream
        raise DecodeError(
            f"bit stream truncated: needs {n * STATE_BITS} bits, has {reader.total_bits}"
        )
    stream = DeviceStream.of(reader, device)
    x = stream.gather(torch.arange(n, dtype=_I64, device=device) * STATE_BITS, STATE_BITS)
    x |= STATE_LOW
    stream.cursor += n * STATE_BITS
    out = torch.empty(n * k, dtype=_I64, device=device)
    walk = _Walk(tables, device_tables(tables, device), stream, x, n, out, [])
    if k == 1 and chunk_size == 1 << levels:
        walk.lone.append((torch.arange(n, dtype=_I64, device=device), torch.zeros_like(x), levels))
    else:
        dense = dense_depth(k, levels)
        nodes = _grid_levels(walk, dense)
        _sparse_levels(walk, dense, nodes)
    _fill_lone(walk, reader)
    return out.view(n, k)


def _grid_eff(tables: SplitTables, level: int, device: torch.device) -> torch.Tensor:
    """`codec.index_nodes.grid_eff` as a (2**level, 1) column on the device."""
    size = 1 << (tables.levels - level)
    cells = torch.arange(1 << level, dtype=_I64, device=device)
    return (tables.chunk_size - cells * size).clamp(0, size)[:, None]


def _grid_busy(m: torch.Tensor, eff: torch.Tensor, size: int) -> torch.Tensor:
    """`codec.index_nodes.grid_busy` of a cell-major grid: not empty, not full, not a lone
    position in a full block."""
    return (m >= 1) & (m < eff) & ~((m == 1) & (eff == size))


def _grid_levels(walk: _Walk, dense: int) -> _Nodes:
    """Grid levels: (cells, n) grids, cell-major, the order a grid round decodes them in, so a
    cell's row is one rANS step. Returns the busy cells of the level below as nodes."""
    tables, n = walk.tables, walk.n
    k, levels = tables.k, tables.levels
    dev = walk.x.device
    m = torch.full((1, n), k, dtype=_I64, device=dev)
    dst = (torch.arange(n, dtype=_I64, device=dev) * k)[None, :]  # each cell's first slot
    for level in range(dense):
        size, half = 1 << (levels - level), 1 << (levels - level - 1)
        cells = 1 << level
        eff = _grid_eff(tables, level, dev)
        busy = _grid_busy(m, eff, size)
        # the count where the cell codes one, else 0: its table then sends the certain symbol
        tid = m * busy + (2 * level + (eff != size)) * (k + 1)
        left = decode_round(walk.x, DeviceRound.grid(n, cells), tid.view(-1), tables, walk.stream)
        left = left.view(cells, n)
        if size <= MAX_LEAF_BLOCK:
            leaf = walk.tab["is_leaf"][tid]  # a leaf's value is its rank: it has no children
            at = _where(leaf)
            if at.numel():
                cell = at // n
                _write_leaves(
                    walk,
                    dst.view(-1)[at],
                    cell * size,
                    m.view(-1)[at],
                    left.view(-1)[at],
                    level,
                )
                busy &= ~leaf
                left = left * busy
        m = torch.stack([left, (m - left) * busy], dim=1).view(2 * cells, n)
        dst = torch.stack([dst, dst + left], dim=1).view(2 * cells, n)
        child_eff = _grid_eff(tables, level + 1, dev)
        # a lone position must fill a whole power-of-two block
        at = _where((m == 1) & (child_eff == half))
        walk.lone.append((dst.view(-1)[at], (at // n) * half, levels - level - 1))
        at = _where((m == child_eff) & (m > 0))
        if at.numel():
            cell = at // n
            _write_full(walk, dst.view(-1)[at], cell * half, child_eff.view(-1)[cell])
    size = 1 << (levels - dense)
    eff = _grid_eff(tables, dense, dev)
    # nodes go in (chunk, position) order: the busy mask transposed
    at = _where(_grid_busy(m, eff, size).t())
    row, cell = at >> dense, at & ((1 << dense) - 1)
    at = cell * n + row
    rank = dst.view(-1)[at] - row * k
    return _Nodes(row, cell * size, eff.view(-1)[cell], m.view(-1)[at], rank)


def _sparse_levels(walk: _Walk, start_level: int, nodes: _Nodes) -> None:
    """Levels below the grid: `codec.index_nodes.Split` over the busy nodes, level by level."""
    tables, tab = walk.tables, walk.tab
    k, levels = tables.k, tables.levels
    for level in range(start_level, levels):
        if nodes.row.numel() == 0:
            break
        half = 1 << (levels - level - 1)
        tid = nodes.m + (2 * level + (nodes.eff != 2 * half)) * (k + 1)
        leaf = tab["is_leaf"][tid]
        value = tab["split_lo"][tid]  # j for a split (forced ones keep their only value)
        sym = _where(tab["sends"][tid])
        if sym.numel():
            rnd = DeviceRound.build(nodes.row[sym], walk.n)
            value[sym] = decode_round(walk.x, rnd, tid[sym], tables, walk.stream)
        sel = _where(leaf)
        if sel.numel():  # a leaf's value is its rank
            dst = nodes.row[sel] * k + nodes.rank[sel]
            _write_leaves(walk, dst, nodes.start[sel], nodes.m[sel], value[sel], level)
        keep = ~leaf  # a leaf sends its whole subset and has no children
        counts = torch.stack([value * keep, (nodes.m - value) * keep], dim=1).view(-1)
        left_eff = nodes.eff.clamp(max=half)
        child_eff = torch.stack([left_eff, nodes.eff - left_eff], dim=1).view(-1)
        # the children, left and right interleaved
        full = (counts == child_eff) & (counts > 0)
        single = (counts == 1) & (child_eff == half)
        active = (counts > 0) & (counts < child_eff)
        if half > 1:  # then every single child is among those (1 < half = e)
            active ^= single
        at = _where(full)
        if at.numel():
            row, start, rank = _children(nodes, value, at, half)
            _write_full(walk, row * k + rank, start, child_eff[at])
        at = _where(single)
        row, start, rank = _children(nodes, value, at, half)
        walk.lone.append((row * k + rank, start, levels - level - 1))
        at = _where(active)
        row, start, rank = _children(nodes, value, at, half)
        nodes = _Nodes(row, start, child_eff[at], counts[at], rank)


def _children(
    nodes: _Nodes, j: torch.Tensor, at: torch.Tensor, half: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, block start, rank of the first position) of the children `at` (indices into the
    interleaved left and right children of `nodes`, whose left counts are `j`)."""
    parent, side = at >> 1, at & 1
    rank = nodes.rank[parent] + side * j[parent]
    return nodes.row[parent], nodes.start[parent] + side * half, rank


def _where(mask: torch.Tensor) -> torch.Tensor:
    """Flat indices of the true items of `mask`, in row-major order (a host sync: the count)."""
    return torch.nonzero(mask.reshape(-1)).view(-1)


def _expand(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(owner, offset within it) of every one of the counts' sum items (a host sync: the sum)."""
    owner = torch.repeat_interleave(counts)
    within = torch.arange(owner.numel(), dtype=_I64, device=counts.device)
    within -= (torch.cumsum(counts, 0) - counts)[owner]
    return owner, within


def _leaf_table(walk: _Walk, level: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(subsets, base) of the leaves of a level: base[m] + rank * m is where the positions of the
    m-subset of colex rank `rank` start in the flat `subsets`. Cached with the device tables."""
    key = f"leaf_subsets/{level}"
    if key not in walk.tab:
        tables = walk.tables
        k, size = tables.k, 1 << (tables.levels - level)
        first = 2 * level * (k + 1)  # the level's full-size tables
        counts = np.flatnonzero(tables.is_leaf[first : first + k + 1]).tolist()
        parts = [leaf_subsets(size, mm).reshape(-1) for mm in counts]
        base = np.zeros(k + 1, dtype=np.int64)
        base[counts] = np.cumsum([0, *[p.size for p in parts]])[:-1]
        walk.tab[key] = torch.from_numpy(np.concatenate(parts)).to(walk.x.device)
        walk.tab[f"leaf_base/{level}"] = torch.from_numpy(base).to(walk.x.device)
    return walk.tab[key], walk.tab[f"leaf_base/{level}"]


def _write_leaves(
    walk: _Walk,
    dst: torch.Tensor,
    start: torch.Tensor,
    m: torch.Tensor,
    rank: torch.Tensor,
    level: int,
) -> None:
    """Expand each leaf's colex rank into its `m` positions, from `start` on, into out[dst:]."""
    subsets, base = _leaf_table(walk, level)
    owner, within = _expand(m)
    m = m[owner]
    at = base[m] + rank[owner] * m + within
    walk.out[dst[owner] + within] = subsets[at] + start[owner]


def _write_full(walk: _Walk, dst: torch.Tensor, start: torch.Tensor, eff: torch.Tensor) -> None:
    """Full blocks: `eff` consecutive positions from `start` on, into out[dst:]."""
    owner, within = _expand(eff)
    walk.out[dst[owner] + within] = start[owner] + within


def _fill_lone(walk: _Walk, reader: BitReader) -> None:
    """Check the stream, then fill in the lone positions from the raw fields: the explicit part
    from the stream, the rest from the lanes' final states (`codec.index_decode._read_raw`)."""
    n, stream = walk.n, walk.stream
    total = sum(slots.numel() * width for slots, _, width in walk.lone)
    back = min(STATE_BITS, total // n)
    tail = walk.x - STATE_LOW
    drift = (tail >> back).ne(0).any()
    worst, end, drifted = torch.stack([stream.worst, stream.cursor[0], drift.long()]).tolist()
    stream.check(worst, end)
    if drifted:
        raise DecodeError("index stream is corrupt: lane states do not end where they began")
    explicit = total - n * back
    if explicit > stream.total_bits - end:
        raise DecodeError("index stream truncated in its raw section")
    reader.cursor = end + explicit
    reader.check_padding()
    if total == 0:
        return
    # the raw section as 32-bit words: the explicit part, then each lane's `back` bits
    dev = walk.x.device
    words = torch.zeros((total + 31) // 32 + 2, dtype=_I64, device=dev)
    whole = explicit // 32
    pos = end + 32 * torch.arange(whole + 1, dtype=_I64, device=dev)
    words[: whole + 1] = stream.gather(pos, 32)
    words[whole] &= (1 << (explicit % 32)) - 1
    if back:
        pos = explicit + torch.arange(n, dtype=_I64, device=dev) * back
        shifted = tail << (pos & 31)  # < 2**61: fields and words never overlap, adding is OR-ing
        words.index_add_(0, pos >> 5, shifted & 0xFFFFFFFF)
        words.index_add_(0, (pos >> 5) + 1, shifted >> 32)
    pairs = words[:-1] | (words[1:] << 32)
    offsets = np.cumsum([0, *[slots.numel() * width for slots, _, width in walk.lone]])
    pos = torch.cat(
        [
            int(at) + torch.arange(slots.numel(), dtype=_I64, device=dev) * width
            for at, (slots, _, width) in zip(offsets, walk.lone, strict=False)
        ]
    )
    widths = torch.cat([torch.full_like(slots, width) for slots, _, width in walk.lone])
    raw = (pairs[pos >> 5] >> (pos & 31)) & ((1 << widths) - 1)
    slots = torch.cat([slots for slots, _, _ in walk.lone])
    walk.out[slots] = raw + torch.cat([start for _, start, _ in walk.lone])
