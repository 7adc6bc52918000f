"""The index decoder's walk compiled for the CPU: what `codec.index_decode` does with numpy passes
per tree level and rANS step, done here in compiled loops over one chunk group.

It reads exactly the stream `codec.indices.encode` writes and returns exactly what
`codec.index_decode.decode_body` returns. The order of work follows the stream's layout (see
`codec.rans` and `codec.indices`): level by level; on a grid level every lane codes one symbol
per cell, cell by cell; below, step s codes the s-th pending symbol of every lane that has one,
lanes visited busiest first (ties in lane order). Renormalisation fields are read lane after lane
in that same order, after a group of `GROUP` steps or a lane's last symbol of the level. Lone
positions are collected in the order their raw fields were written (cell-major on grid levels,
node order below) and filled in at the end from the raw section and the lanes' final states.

Two things differ from the numpy walk, neither in what is decoded. A leaf's symbol (a uniform
rank over C(e, m) subsets) is computed from its slot with integer arithmetic, exactly as its
table was built, instead of through its 256 KiB slot table; and a leaf's positions are read from
one flat table of every leaf subset.

How the loops are shaped (each measured on the presets' streams): a renormalisation group of a
lane (its one or two symbols and its field) is one iteration; a level's symbols are laid out
step-major once, in one pass, rather than gathered step by step; what only some lanes or nodes
do (a lone position, a busy child, a leaf) is written unconditionally where the next one goes
and counted by the condition, or (a leaf's positions) listed and written in a pass of its own,
instead of behind a branch the processor cannot predict; indices known to be >= 0 are
unsigned, which spares numba's negative-index code; a leaf's divisions are multiplications.

Malformed input cannot make it read outside the stream or write outside the output: every field
read is bounds-checked (a group's reads are clamped to the stream and the group refused once
over if it ran past the end), every symbol comes from its table (so every count it implies is
consistent), and what the numpy decoder rejects is rejected here, with the same reasons.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import lru_cache

import numba
import numpy as np
from numba.cpython.unsafe.numbers import leading_zeros
from numba.extending import overload

from codec.errors import DecodeError
from codec.index_model import (
    KEY_BITS,
    MAX_LEAF_BLOCK,
    PRECISION_BITS,
    RECORD_BITS,
    RECORD_MASK,
    SplitTables,
    binomials,
    leaf_subsets,
    split_tables,
)
from codec.index_nodes import dense_depth
from codec.rans import GROUP, STATE_BITS, STATE_LOW

__all__ = ["MAX_KEPT_SCRATCH_BYTES", "decode_body", "scratch_bytes"]

_SLOT_MASK = (1 << PRECISION_BITS) - 1
_KEY_MASK = (1 << KEY_BITS) - 1
_U = np.uint64  # an index known to be >= 0: numba then leaves out its negative-index code
_PAD = 16  # int32s between arrays and rows of a grid: none a multiple of 4 KiB from another

OK, TRUNCATED, TAIL, RAW_TRUNCATED, PADDING_BYTES, PADDING_BITS = range(6)
_ERRORS = {
    TRUNCATED: "bit stream truncated",
    TAIL: "index stream is corrupt: lane states do not end where they began",
    RAW_TRUNCATED: "index stream truncated in its raw section",
    PADDING_BYTES: "trailing bytes after the index stream",
    PADDING_BITS: "non-zero padding bits after the index stream",
}


def decode_body(body: bytes, chunk_size: int, k: int, n: int) -> np.ndarray:
    """Positions (n, k), int64, rows ascending, from the bit stream of ``n`` chunks (the header
    already parsed and checked, ``0 < k < chunk_size``, ``n * 30 <= 8 * len(body)``)."""
    if n * k >= 1 << 31:  # output slots are int32 inside the walk
        raise DecodeError(f"{n} x {k} indices in one stream: more than the decoder holds")
    words = np.zeros((len(body) + 3) // 4 + 2, dtype="<u4")
    words.view(np.uint8)[: len(body)] = np.frombuffer(body, dtype=np.uint8)
    pairs = words[:-1].astype(np.int64)
    pairs |= words[1:].astype(np.int64) << 32  # pairs[i]: words i and i + 1, any 32-bit field
    out = np.empty(n * k, dtype=np.int64)
    levels = split_tables(chunk_size, k).levels
    lone_only = k == 1 and chunk_size == 1 << levels
    dense = -1 if lone_only else dense_depth(k, levels)
    tables = _tables(chunk_size, k)
    status = _decode(
        pairs, 8 * len(body), n, k, chunk_size, levels, dense, tables, out, _scratch(n, k, dense)
    )
    if status != OK:
        raise DecodeError(_ERRORS[status])
    return out.reshape(n, k)


_THREAD = threading.local()
MAX_KEPT_SCRATCH_BYTES = 256 << 20
"""Largest working buffer a thread keeps between calls (the 1B preset's largest stream, its
embedding, needs 200 MiB); a larger one (8B: 400 MiB, 70B: about 800 MiB) gets its own, freed
when the stream is decoded."""


def _sizes(n: int, k: int, dense: int) -> tuple[int, ...]:
    grid = (1 << max(dense, 0)) * (n + _PAD)
    nodes = n * k // 2 + n + 1
    return (2 * (n * k + 1), grid, grid, grid, grid, 6 * nodes, 6 * nodes, nodes,
            2 * (n + _PAD), 2 * (n + _PAD), n, n)  # fmt: skip


def scratch_bytes(chunk_size: int, k: int, n: int) -> int:
    """Bytes of the working buffer the walk needs for a stream of n chunks of k in chunk_size."""
    sizes = _sizes(n, k, dense_depth(k, split_tables(chunk_size, k).levels))
    return 4 * (sum(sizes) + _PAD * len(sizes))


def _scratch(n: int, k: int, dense: int) -> tuple[np.ndarray, ...]:
    """Working arrays of the walk (int32: every count, position and output slot fits), views of
    one buffer kept per thread and reused from call to call: fresh pages would cost the kernel
    more time than the decode itself. Sized by what a group of n chunks of k can hold: lone
    positions <= n k, busy nodes of a level <= n k / 2 + n (each holds two positions or more,
    but for one partial node per chunk; one more slot, written but not kept), grid cells <=
    2**dense n; about 50 bytes per index, kept up to `MAX_KEPT_SCRATCH_BYTES`."""
    sizes = _sizes(n, k, dense)
    nodes = n * k // 2 + n + 1
    buf: np.ndarray | None = getattr(_THREAD, "buf", None)
    if buf is None or buf.size < sum(sizes) + _PAD * len(sizes):
        buf = np.empty(sum(sizes) + _PAD * len(sizes), np.int32)
        if buf.nbytes <= MAX_KEPT_SCRATCH_BYTES:
            _THREAD.buf = buf
    views = []
    at = 0
    for size in sizes:
        views.append(buf[at : at + size])
        at += size + _PAD
    views[0] = views[0].reshape(2, n * k + 1)
    views[5] = views[5].reshape(6, nodes)
    views[6] = views[6].reshape(6, nodes)
    views[8] = views[8].reshape(2, n + _PAD)
    views[9] = views[9].reshape(2, n + _PAD)
    return tuple(views)


@lru_cache(maxsize=64)
def _tables(chunk_size: int, k: int) -> tuple[np.ndarray, ...]:
    """The arrays the compiled walk reads: per table its ``info`` (a split's coarse lookup key,
    or minus the number of subsets of a leaf), `SplitTables`' split and lookup arrays, and where
    a leaf's subsets start in one flat int16 array of every leaf subset, each the m positions of
    its colex rank."""
    t: SplitTables = split_tables(chunk_size, k)
    info = t.coarse_key.copy()
    leaf_at = np.zeros(t.is_leaf.size, np.int64)
    leaf_mul = np.zeros(t.is_leaf.size, np.int64)
    subsets: list[np.ndarray] = []
    at = 0
    for tid in np.flatnonzero(t.is_leaf).tolist():
        kind, m = divmod(tid, k + 1)  # kind = 2 * level (+ 1 where partial: never a leaf)
        e = 1 << (t.levels - kind // 2)
        syms = int(binomials()[e, m])
        info[tid] = -syms
        # division by syms (< 2**13) as a multiplication, exact for numerators below 2**29
        # (Granlund and Montgomery): shift 29 + ceil(log2 syms), multiplier rounded up
        shift = 29 + (syms - 1).bit_length()
        leaf_mul[tid] = -(-(1 << shift) // syms) << 6 | shift
        leaf_at[tid] = at
        subsets.append(leaf_subsets(e, m).astype(np.int16).reshape(-1))
        at += subsets[-1].size
    leaf_pos = np.concatenate(subsets) if subsets else np.zeros(0, np.int16)
    return (
        info, t.split_lo, t.sends, t.value_base, t.coarse_record, t.entry_record, leaf_at,
        leaf_pos, leaf_mul,
    )  # fmt: skip


def _bit_length(x: int) -> int:
    """The bit length of 0 <= x < 2**63 (compiled: one count-leading-zeros instruction)."""
    return int(x).bit_length()


@overload(_bit_length, inline="always")
def _bit_length_compiled(x: object) -> Callable[[object], int]:
    def compiled(x: object) -> int:  # the same signature as the typing function's, for numba
        return 64 - leading_zeros(x)  # type: ignore[call-arg]  # an intrinsic, typed by numba

    return compiled


@numba.njit(cache=True, nogil=True)
def _field(pairs: np.ndarray, pos: int, width: int) -> int:
    return (pairs[pos >> 5] >> (pos & 31)) & ((1 << width) - 1)


@numba.njit(cache=True, nogil=True)
def _group(
    x: np.ndarray, lanes: np.ndarray, start: int, stop: int, two: int, tids: np.ndarray,
    values: np.ndarray, at0: int, at1: int, pairs: np.ndarray, cursor: int,
    tables: tuple[np.ndarray, ...],
) -> int:  # fmt: skip
    """One renormalisation group of lanes ``lanes[start:stop]``: the i-th decodes one symbol
    (table ``tids[at0 + i]``, value into ``values[at0 + i]``), a second one (``tids[at1 + i]``)
    where i < two, then reads its field. The new cursor. (Everything inline: this is where the
    decoder spends most of its time.)

    A field is at most R bits whatever the stream holds: a state starts a group at 2**R or more
    and each symbol divides it by at most 2**M (x >> M, times a frequency of 1 or more), so after
    the group's last symbol (R = GROUP * M) it is still 1 or more. Past the stream's end the
    word read is clamped to the last one: the caller refuses a cursor past the end once the
    group is over (until then, states stay in range and symbols in their tables whatever is
    read)."""
    info, _, _, value_base, coarse_record, entry_record, _, _, leaf_mul = tables
    last = pairs.size - 1
    for i in range(start, stop):
        r = _U(lanes[_U(i)])
        xr = x[r]
        for g in range(1 + (i < two)):
            at = _U((at1 if g else at0) + i)
            tid = _U(tids[at])
            slot = xr & _SLOT_MASK
            key = info[tid]
            if key < 0:  # a leaf, uniform over -key subsets: i covers [i T // n, (i + 1) T // n)
                syms = -key
                value = (((slot + 1) * syms + _SLOT_MASK) >> PRECISION_BITS) - 1
                mul = leaf_mul[tid]  # a // syms = a * (mul >> 6) >> (mul & 63), for a <= 2**28
                cum = ((value << PRECISION_BITS) * (mul >> 6)) >> (mul & 63)
                freq = ((((value + 1) << PRECISION_BITS) * (mul >> 6)) >> (mul & 63)) - cum
                d = slot - cum
            else:
                rec = coarse_record[_U((key >> KEY_BITS) + (slot >> (key & _KEY_MASK)))]
                freq = rec >> (2 * RECORD_BITS)
                d = slot - (rec & RECORD_MASK)
                if d >= freq:  # the candidate entry lies before the slot's: scan forward
                    e = value_base[tid] + ((rec >> RECORD_BITS) & RECORD_MASK)
                    while d >= freq:
                        e += 1
                        d -= freq
                        rec = entry_record[_U(e)]
                        freq = rec >> (2 * RECORD_BITS)
                value = (rec >> RECORD_BITS) & RECORD_MASK
            values[at] = value
            xr = (xr >> PRECISION_BITS) * freq + d
        width = STATE_BITS + 1 - _bit_length(xr)
        word = pairs[_U(min(cursor >> 5, last))]
        x[r] = (xr << width) | ((word >> (cursor & 31)) & ((1 << width) - 1))
        cursor += width
    return cursor


@numba.njit(cache=True, nogil=True)
def _decode(
    pairs: np.ndarray, total_bits: int, n: int, k: int, chunk_size: int, levels: int, dense: int,
    tables: tuple[np.ndarray, ...], out: np.ndarray, scratch: tuple[np.ndarray, ...],
) -> int:  # fmt: skip
    x = np.empty(n, np.int64)
    cursor = n * STATE_BITS
    for r in range(n):
        x[r] = _field(pairs, r * STATE_BITS, STATE_BITS) | STATE_LOW
    lone = scratch[0]  # (output slot, block start) per lone position
    # runs of lone positions: (first, block start (-1: each its own), raw width)
    runs = np.empty((3, 2 * (1 << max(dense, 0)) + levels + 1), np.int64)
    if dense < 0:  # k == 1 in a power-of-two chunk: every position is raw
        for r in range(n):
            lone[0, r] = r
        runs[0, 0], runs[1, 0], runs[2, 0] = 0, 0, levels
        n_lone, n_runs = n, 1
    else:
        status, cursor, n_lone, n_runs = _walk(
            pairs, total_bits, cursor, x, n, k, chunk_size, levels, dense, tables, out, scratch,
            runs,
        )  # fmt: skip
        if status != OK:
            return status
    return _fill_lone(pairs, total_bits, cursor, x, n, out, lone, n_lone, runs, n_runs)


@numba.njit(cache=True, nogil=True)
def _walk(
    pairs: np.ndarray, total_bits: int, cursor: int, x: np.ndarray, n: int, k: int, chunk_size: int,
    levels: int, dense: int, tables: tuple[np.ndarray, ...], out: np.ndarray, scratch: tuple[np.ndarray, ...],
    runs: np.ndarray,
) -> tuple[int, int, int, int]:  # fmt: skip
    """Every level of every chunk's tree: (status, cursor, number of lone positions, number of
    their runs)."""
    info, split_lo, sends, _, _, _, leaf_at, leaf_pos, _ = tables
    (
        lone,
        m,
        dst,
        child_m,
        child_dst,
        nodes,
        children,
        senders,
        row_tid,
        row_value,
        queue,
        leaves,
    ) = scratch
    n_lone = n_runs = 0
    lone0, lone1 = lone[0], lone[1]
    # grid levels: cell-major (cells, n) counts and output slots; a group of cells (the stream's
    # renormalisation group) is one pass over the lanes
    lanes = np.arange(n)
    ns = n + _PAD  # a grid row's stride
    for r in range(n):
        m[r], dst[r] = k, r * k
    for level in range(dense):
        size = 1 << (levels - level)
        half = size >> 1
        cells = 1 << level
        for c0 in range(0, cells, GROUP):
            group = min(GROUP, cells - c0)
            for g in range(group):  # each cell's table: the certain symbol's unless it is busy
                c = c0 + g
                eff = min(max(chunk_size - c * size, 0), size)
                base = (2 * level + (eff != size)) * (k + 1)
                lo, hi = (1, eff) if eff != size else (2, size)
                cell, cell_tid = m[c * ns : c * ns + n], row_tid[g]
                for r in range(n):
                    mm = cell[_U(r)]
                    cell_tid[_U(r)] = base + mm * ((mm >= lo) & (mm < hi))
            # the group's symbols of each lane, then its field: one pass over the lanes
            two = n if group == 2 else 0
            cursor = _group(
                x, lanes, 0, n, two, row_tid.ravel(), row_value.ravel(), 0, ns, pairs, cursor,
                tables,
            )  # fmt: skip
            if cursor > total_bits:
                return TRUNCATED, 0, 0, 0
            for g in range(group):  # each cell's children, their full blocks, lone positions
                c = c0 + g
                base = (2 * level + (min(max(chunk_size - c * size, 0), size) != size)) * (k + 1)
                width = levels - level - 1
                start_l, start_r = 2 * c * half, (2 * c + 1) * half
                eff_l = min(max(chunk_size - start_l, 0), half)
                eff_r = min(max(chunk_size - start_r, 0), half)
                queued = 0  # the right children's lone positions follow all the left ones'
                runs[0, n_runs], runs[1, n_runs], runs[2, n_runs] = n_lone, start_l, width
                n_runs += 1
                tids, values = row_tid[g], row_value[g]
                leafy = size <= MAX_LEAF_BLOCK  # (else no cell is a leaf)
                n_leaves = 0
                m_l, m_r = child_m[2 * c * ns :], child_m[(2 * c + 1) * ns :]
                d_l, d_r = child_dst[2 * c * ns :], child_dst[(2 * c + 1) * ns :]
                dsts = dst[c * ns :]
                for r in range(n):
                    ur = _U(r)
                    tid, d0, left = tids[ur], dsts[ur], values[ur]
                    mm = tid - base  # 0 unless busy
                    if leafy:  # a leaf has no children (its positions are written below)
                        leaf = info[_U(tid)] < 0
                        leaves[_U(n_leaves)] = r
                        n_leaves += leaf
                        mm *= 1 - leaf
                        left *= 1 - leaf
                    right = mm - left
                    m_l[ur], m_r[ur], d_l[ur], d_r[ur] = left, right, d0, d0 + left
                    # lone: one position in a full-size child (half >= 2 here, so never full)
                    lone0[_U(n_lone)] = d0
                    n_lone += (left == 1) & (eff_l == half)
                    queue[_U(queued)] = d0 + left
                    queued += (right == 1) & (eff_r == half)
                    if ((left == eff_l) & (left > 0)) | ((right == eff_r) & (right > 0)):
                        if left == eff_l and left > 0:
                            for i in range(left):
                                out[_U(d0 + i)] = start_l + i
                        if right == eff_r and right > 0:
                            for i in range(right):
                                out[_U(d0 + left + i)] = start_r + i
                for i in range(n_leaves):  # a leaf's rank names its positions
                    lane = _U(leaves[_U(i)])
                    tid, d0 = tids[lane], dsts[lane]
                    mm = tid - base
                    subset = leaf_at[_U(tid)] + values[lane] * mm
                    for p in range(mm):
                        out[_U(d0 + p)] = c * size + leaf_pos[_U(subset + p)]
                runs[0, n_runs], runs[1, n_runs], runs[2, n_runs] = n_lone, start_r, width
                n_runs += 1
                for i in range(queued):
                    lone0[n_lone] = queue[i]
                    n_lone += 1
        m, dst, child_m, child_dst = child_m, child_dst, m, dst
    # the busy cells of the first level below the grid, in (chunk, position) order: counted per
    # chunk, then placed, both passes reading the grid cell by cell as it lies in memory
    size = 1 << (levels - dense)
    lane_count = np.zeros(n, np.int64)
    place = np.zeros(n, np.int64)  # first the busy cells per chunk, then where the next one goes
    for c in range(1 << dense):
        eff = min(max(chunk_size - c * size, 0), size)
        lo, hi = (1, eff) if eff != size else (2, size)
        cell = m[c * ns : c * ns + n]
        for r in range(n):
            mm = cell[_U(r)]
            place[_U(r)] += (mm >= lo) & (mm < hi)
    n_nodes = 0
    for r in range(n):
        n_nodes += place[r]
        place[r] = n_nodes - place[r]
    rows, starts, ms, ranks, tids, values = nodes
    for c in range(1 << dense):
        eff = min(max(chunk_size - c * size, 0), size)
        lo, hi = (1, eff) if eff != size else (2, size)
        base = (2 * dense + (eff != size)) * (k + 1)
        cell, cell_dst = m[c * ns : c * ns + n], dst[c * ns : c * ns + n]
        for r in range(n):
            mm = cell[_U(r)]
            if (mm >= lo) & (mm < hi):
                at = _U(place[_U(r)])
                place[_U(r)] += 1
                t = base + mm
                rows[at], starts[at], ms[at] = r, c * size, mm
                ranks[at], tids[at] = cell_dst[_U(r)] - r * k, t
    n_send = 0
    for i in range(n_nodes):
        t = _U(tids[_U(i)])
        values[_U(i)] = split_lo[t]
        send = sends[t]
        senders[_U(n_send)] = i
        n_send += send
        lane_count[_U(rows[_U(i)])] = n_send  # (see `_round`)
    # levels below: only the busy nodes, and only those that send a symbol are in a round
    first = np.empty(n, np.int64)
    order = np.empty(n, np.int64)
    counts = np.empty((4, k + 2), np.int64)
    for level in range(dense, levels):
        if n_nodes == 0:
            break
        half = 1 << (levels - level - 1)
        if n_send:
            cursor = _round(
                x, n, nodes, senders, lane_count, first, order, counts, children[4], children[5],
                pairs, total_bits, cursor, tables,
            )  # fmt: skip
            if cursor > total_bits:
                return TRUNCATED, 0, 0, 0
        # each node's children, and the next level's tables, senders and symbols per lane;
        # lone positions and busy children are written where the next one goes
        lane_count[:] = 0
        n_send = 0
        n_next = 0
        base = (2 * level + 2) * (k + 1)
        width = levels - level - 1
        runs[0, n_runs], runs[1, n_runs], runs[2, n_runs] = n_lone, -1, width
        n_runs += 1
        rows, starts, ms, ranks, tids, values = nodes
        c_rows, c_starts, c_ms, c_ranks, c_tids, c_values = children
        for i in range(n_nodes):
            ui = _U(i)
            r, start, mm, rank, t, j = rows[ui], starts[ui], ms[ui], ranks[ui], tids[ui], values[ui]
            if info[_U(t)] < 0:
                subset = leaf_at[_U(t)] + j * mm
                for p in range(mm):
                    out[_U(r * k + rank + p)] = start + leaf_pos[_U(subset + p)]
                continue
            eff = min(chunk_size - start, 2 * half)
            e0 = min(eff, half)
            for side in range(2):
                c = mm - j if side else j
                e = eff - e0 if side else e0
                c_start = start + side * half
                c_rank = rank + side * j
                if c == e and c > 0:
                    for p in range(e):
                        out[_U(r * k + c_rank + p)] = c_start + p
                single = (c == 1) & (e == half) & (half > 1)  # (else a full block)
                at = _U(n_lone)
                lone0[at], lone1[at] = r * k + c_rank, c_start
                n_lone += single
                busy = (c > 0) & (c < e) & ~single  # then level + 1 < levels (e >= 2)
                t = (base + (e != half) * (k + 1) + c) * busy  # table 0: a certain symbol
                at = _U(n_next)
                c_rows[at], c_starts[at], c_ms[at] = r, c_start, c
                c_ranks[at], c_tids[at], c_values[at] = c_rank, t, split_lo[_U(t)]
                send = sends[_U(t)]
                senders[_U(n_send)] = n_next
                n_send += send
                lane_count[_U(r)] = n_send  # (see `_round`)
                n_next += busy
        nodes, children = children, nodes
        n_nodes = n_next
    return OK, cursor, n_lone, n_runs


@numba.njit(cache=True, nogil=True)
def _round(
    x: np.ndarray, n: int, nodes: np.ndarray, senders: np.ndarray, lane_count: np.ndarray,
    first: np.ndarray, order: np.ndarray, counts: np.ndarray, step_tid: np.ndarray,
    step_value: np.ndarray, pairs: np.ndarray, total_bits: int, cursor: int,
    tables: tuple[np.ndarray, ...],
) -> int:  # fmt: skip
    """One level's symbols (nodes ``senders``, in (chunk, position) order, so each lane's are a
    run): step s decodes the s-th symbol of every lane with more than s, busiest lanes first,
    ties in lane order; a group of steps is one pass over its lanes. The cursor (past the end
    of the stream: truncated)."""
    with_count, busy, at, steps = counts[0], counts[1], counts[2], counts[3]
    rows, tids, values = nodes[0], nodes[4], nodes[5]
    most = 0
    ahead = 0
    for r in range(n):  # lane_count holds where each lane's symbols end (but stale where it
        # has none: less than the previous lane's end): written in the walk without a load
        end = max(lane_count[r], ahead)
        first[r] = ahead
        lane_count[r] = end - ahead
        most = max(most, end - ahead)
        ahead = end
    with_count[: most + 1] = 0
    for r in range(n):
        with_count[lane_count[r]] += 1
    busy[most] = 0  # busy[s]: lanes with more than s symbols
    ahead = 0
    for c in range(most, -1, -1):
        at[c] = ahead
        ahead += with_count[c]
        if c:
            busy[c - 1] = ahead
    for r in range(n):
        order[at[lane_count[r]]] = r
        at[lane_count[r]] += 1
    ahead = 0
    for c in range(most):  # where each step starts in step-major order
        steps[c] = ahead
        ahead += busy[c]
    place = lane_count  # (no longer needed) each lane's place in the order
    for i in range(n):
        place[order[i]] = i
    for q in range(ahead):  # the symbols' tables, step-major
        j = _U(senders[_U(q)])
        lane = _U(rows[j])
        step_tid[_U(steps[_U(q - first[lane])] + place[lane])] = tids[j]
    for s in range(0, most, GROUP):
        two = busy[s + 1]
        # lanes whose last symbol is step s read their field after it, before the others end
        # the group: the stream's field order
        s0, s1 = steps[s], steps[s + 1] if s + 1 < most else 0
        cursor = _group(
            x, order, two, busy[s], 0, step_tid, step_value, s0, s1, pairs, cursor, tables
        )
        cursor = _group(x, order, 0, two, two, step_tid, step_value, s0, s1, pairs, cursor, tables)
        if cursor > total_bits:
            return cursor
    for q in range(ahead):  # the values, back to their nodes
        j = _U(senders[_U(q)])
        lane = _U(rows[j])
        values[j] = step_value[_U(steps[_U(q - first[lane])] + place[lane])]
    return cursor


@numba.njit(cache=True, nogil=True)
def _fill_lone(
    pairs: np.ndarray, total_bits: int, cursor: int, x: np.ndarray, n: int, out: np.ndarray,
    lone: np.ndarray, n_lone: int, runs: np.ndarray, n_runs: int,
) -> int:  # fmt: skip
    """Raw fields of the lone positions: the explicit part from the stream, the rest from the
    lanes' final states (each carries ``back`` bits), read as one joined bit string. Lone
    positions come in runs of one raw width and, but in the levels below the grid, one block
    start."""
    total = 0
    for g in range(n_runs):
        end = runs[0, g + 1] if g + 1 < n_runs else n_lone
        total += (end - runs[0, g]) * runs[2, g]
    back = min(STATE_BITS, total // n)
    for r in range(n):
        if (x[r] - STATE_LOW) >> back:
            return TAIL
    explicit = total - n * back
    if explicit > total_bits - cursor:
        return RAW_TRUNCATED
    end = cursor + explicit
    rest = total_bits - end
    if rest >= 8:
        return PADDING_BYTES
    if rest and _field(pairs, end, rest):
        return PADDING_BITS
    # the lanes' tails, packed as the stream is (pairs of 32-bit words)
    words = np.zeros((n * back + 31) // 32 + 2, np.int64)
    for r in range(n):
        p = r * back
        v = (x[r] - STATE_LOW) << (p & 31)  # < 2**61
        words[p >> 5] |= v & 0xFFFFFFFF
        words[(p >> 5) + 1] |= v >> 32
    tail = words[:-1] | (words[1:] << 32)
    p = 0  # offset in the joined string
    for g in range(n_runs):
        start, width = runs[1, g], runs[2, g]
        for i in range(runs[0, g], runs[0, g + 1] if g + 1 < n_runs else n_lone):
            if p + width <= explicit:
                raw = _field(pairs, cursor + p, width)
            elif p >= explicit:
                raw = _field(tail, p - explicit, width)
            else:  # the one field that straddles the two parts
                got = explicit - p
                raw = _field(pairs, cursor + p, got) | (_field(tail, 0, width - got) << got)
            out[_U(lone[0, _U(i)])] = (lone[1, _U(i)] if start < 0 else start) + raw
            p += width
    return OK
