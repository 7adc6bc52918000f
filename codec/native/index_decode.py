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

Malformed input cannot make it read outside the stream or write outside the output: every field
read is bounds-checked, every symbol comes from its table (so every count it implies is
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
embedding, needs 215 MiB); a larger one (8B: 430 MiB, 70B: 860 MiB) gets its own, freed when the
stream is decoded."""


def _sizes(n: int, k: int, dense: int) -> tuple[int, ...]:
    grid = (1 << max(dense, 0)) * n
    nodes = n * k // 2 + n
    return (3 * (n * k + 1), grid, grid, grid, grid, 5 * nodes, 5 * nodes, nodes, nodes, nodes,
            n, n, n)  # fmt: skip


def scratch_bytes(chunk_size: int, k: int, n: int) -> int:
    """Bytes of the working buffer the walk needs for a stream of n chunks of k in chunk_size."""
    return 4 * sum(_sizes(n, k, dense_depth(k, split_tables(chunk_size, k).levels)))


def _scratch(n: int, k: int, dense: int) -> tuple[np.ndarray, ...]:
    """Working arrays of the walk (int32: every count, position and output slot fits), views of
    one buffer kept per thread and reused from call to call: fresh pages would cost the kernel
    more time than the decode itself. Sized by what a group of n chunks of k can hold: lone
    positions <= n k, busy nodes of a level <= n k / 2 + n (each holds two positions or more,
    but for one partial node per chunk), grid cells <= 2**dense n; about 50 bytes per index, kept
    up to `MAX_KEPT_SCRATCH_BYTES`."""
    sizes = _sizes(n, k, dense)
    nodes = n * k // 2 + n
    buf: np.ndarray | None = getattr(_THREAD, "buf", None)
    if buf is None or buf.size < sum(sizes):
        buf = np.empty(sum(sizes), np.int32)
        if buf.nbytes <= MAX_KEPT_SCRATCH_BYTES:
            _THREAD.buf = buf
    views = []
    at = 0
    for size in sizes:
        views.append(buf[at : at + size])
        at += size
    views[0] = views[0].reshape(3, n * k + 1)
    views[5] = views[5].reshape(5, nodes)
    views[6] = views[6].reshape(5, nodes)
    return tuple(views)


@lru_cache(maxsize=64)
def _tables(chunk_size: int, k: int) -> tuple[np.ndarray, ...]:
    """The arrays the compiled walk reads: `SplitTables`' split and lookup arrays, plus per
    table the number of subsets of a leaf (0: not a leaf) and where its subsets start in one
    flat int16 array of every leaf subset, each the m positions of its colex rank."""
    t: SplitTables = split_tables(chunk_size, k)
    leaf_count = np.zeros(t.is_leaf.size, np.int64)
    leaf_at = np.zeros(t.is_leaf.size, np.int64)
    subsets: list[np.ndarray] = []
    at = 0
    for tid in np.flatnonzero(t.is_leaf).tolist():
        kind, m = divmod(tid, k + 1)  # kind = 2 * level (+ 1 where partial: never a leaf)
        e = 1 << (t.levels - kind // 2)
        leaf_count[tid] = int(binomials()[e, m])
        leaf_at[tid] = at
        subsets.append(leaf_subsets(e, m).astype(np.int16).reshape(-1))
        at += subsets[-1].size
    leaf_pos = np.concatenate(subsets) if subsets else np.zeros(0, np.int16)
    return (
        t.sends, t.split_lo, t.value_base, t.coarse_key, t.coarse_record, t.entry_record,
        leaf_count, leaf_at, leaf_pos,
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
def _decode(
    pairs: np.ndarray, total_bits: int, n: int, k: int, chunk_size: int, levels: int, dense: int,
    tables: tuple[np.ndarray, ...], out: np.ndarray, scratch: tuple[np.ndarray, ...],
) -> int:  # fmt: skip
    x = np.empty(n, np.int64)
    cursor = n * STATE_BITS
    for r in range(n):
        x[r] = _field(pairs, r * STATE_BITS, STATE_BITS) | STATE_LOW
    lone = scratch[0]  # (output slot, block start, raw width) per lone position
    if dense < 0:  # k == 1 in a power-of-two chunk: every position is raw
        for r in range(n):
            lone[0, r], lone[1, r], lone[2, r] = r, 0, levels
        n_lone = n
    else:
        status, cursor, n_lone = _walk(
            pairs, total_bits, cursor, x, n, k, chunk_size, levels, dense, tables, out, scratch
        )
        if status != OK:
            return status
    return _fill_lone(pairs, total_bits, cursor, x, n, out, lone, n_lone)


@numba.njit(cache=True, nogil=True)
def _step(
    x: np.ndarray, lanes: np.ndarray, count: int, readers: int, tids: np.ndarray,
    values: np.ndarray, widths: np.ndarray, pairs: np.ndarray, total_bits: int, cursor: int,
    tables: tuple[np.ndarray, ...],
) -> int:  # fmt: skip
    """One rANS step: lanes ``lanes[:count]`` each decode one symbol (table ``tids[i]``, value
    into ``values[i]``), then lanes from ``readers`` on read their renormalisation field. The
    new cursor, or -1 when the stream ends first. (Everything inline: this is where the decoder
    spends most of its time.)

    A field is at most R bits whatever the stream holds: a state starts a group at 2**R or more
    and each symbol divides it by at most 2**M (x >> M, times a frequency of 1 or more), so after
    the group's last symbol (R = GROUP * M) it is still 1 or more: no state collapses to 0."""
    _, _, value_base, coarse_key, coarse_record, entry_record, leaf_count, _, _ = tables
    for i in range(count):  # lanes are independent here: their loads overlap
        r = lanes[i]
        tid = tids[i]
        xr = x[r]
        slot = xr & _SLOT_MASK
        syms = leaf_count[tid]
        if syms:  # uniform: symbol i covers [i * T // syms, (i + 1) * T // syms)
            value = (((slot + 1) * syms + _SLOT_MASK) >> PRECISION_BITS) - 1
            cum = (value << PRECISION_BITS) // syms
            freq = ((value + 1) << PRECISION_BITS) // syms - cum
            d = slot - cum
        else:
            key = coarse_key[tid]
            rec = coarse_record[(key >> KEY_BITS) + (slot >> (key & _KEY_MASK))]
            freq = rec >> (2 * RECORD_BITS)
            d = slot - (rec & RECORD_MASK)
            if d >= freq:  # the candidate entry lies before the slot's: scan forward
                e = value_base[tid] + ((rec >> RECORD_BITS) & RECORD_MASK)
                while d >= freq:
                    e += 1
                    d -= freq
                    rec = entry_record[e]
                    freq = rec >> (2 * RECORD_BITS)
            value = (rec >> RECORD_BITS) & RECORD_MASK
        values[i] = value
        xr = (xr >> PRECISION_BITS) * freq + d
        x[r] = xr
        widths[i] = STATE_BITS + 1 - _bit_length(xr)
    # the fields that bring states back into [2**R, 2**(R+1)), lane after lane: only the running
    # cursor links one lane to the next
    for i in range(readers, count):
        width = widths[i]
        if cursor + width > total_bits:
            return -1
        r = lanes[i]
        x[r] = (x[r] << width) | ((pairs[cursor >> 5] >> (cursor & 31)) & ((1 << width) - 1))
        cursor += width
    return cursor


@numba.njit(cache=True, nogil=True)
def _walk(
    pairs: np.ndarray, total_bits: int, cursor: int, x: np.ndarray, n: int, k: int, chunk_size: int,
    levels: int, dense: int, tables: tuple[np.ndarray, ...], out: np.ndarray, scratch: tuple[np.ndarray, ...],
) -> tuple[int, int, int]:  # fmt: skip
    """Every level of every chunk's tree: (status, cursor, number of lone positions)."""
    sends, split_lo, _, _, _, _, leaf_count, leaf_at, leaf_pos = tables
    lone, m, dst, child_m, child_dst, nodes, children = scratch[:7]
    node_tid, node_value, senders, row_tid, row_value, widths = scratch[7:]
    n_lone = 0
    lane_count = np.zeros(n, np.int64)
    # grid levels: cell-major (cells, n) counts and output slots
    lanes = np.arange(n)
    for r in range(n):
        m[r], dst[r] = k, r * k
    for level in range(dense):
        size = 1 << (levels - level)
        half = size >> 1
        cells = 1 << level
        width = levels - level - 1
        for c in range(cells):  # the cell's step for every lane, then its two children
            eff = min(max(chunk_size - c * size, 0), size)
            base = (2 * level + (eff != size)) * (k + 1)
            for r in range(n):
                mm = m[c * n + r]
                busy = (1 <= mm < eff) if eff != size else (2 <= mm < size)
                row_tid[r] = base + mm * busy  # else the certain symbol
            readers = 0 if c % GROUP == GROUP - 1 or c == cells - 1 else n
            cursor = _step(
                x, lanes, n, readers, row_tid, row_value, widths, pairs, total_bits, cursor, tables
            )
            if cursor < 0:
                return TRUNCATED, 0, 0
            for r in range(n):
                at = c * n + r
                tid, d0, left = row_tid[r], dst[at], row_value[r]
                mm = tid - base  # 0 unless busy
                if leaf_count[tid]:
                    subset = leaf_at[tid] + left * mm
                    for i in range(mm):
                        out[d0 + i] = c * size + leaf_pos[subset + i]
                    mm = left = 0
                child_m[2 * c * n + r] = left
                child_m[(2 * c + 1) * n + r] = mm - left
                child_dst[2 * c * n + r] = d0
                child_dst[(2 * c + 1) * n + r] = d0 + left
            for cc in range(2 * c, 2 * c + 2):  # lone positions go cell by cell
                c_eff = min(max(chunk_size - cc * half, 0), half)
                for r in range(n):
                    at = cc * n + r
                    mm = child_m[at]
                    if mm == 1 and c_eff == half:
                        lone[0, n_lone], lone[1, n_lone] = child_dst[at], cc * half
                        lone[2, n_lone] = width
                        n_lone += 1
                    elif mm == c_eff and mm > 0:
                        for i in range(c_eff):
                            out[child_dst[at] + i] = cc * half + i
        m, dst, child_m, child_dst = child_m, child_dst, m, dst
    # the busy cells of the first level below the grid, in (chunk, position) order: counted per
    # chunk, then placed, both passes reading the grid cell by cell as it lies in memory
    size = 1 << (levels - dense)
    place = lane_count  # first the busy cells per chunk, then where the next one goes
    place[:] = 0
    for c in range(1 << dense):
        eff = min(max(chunk_size - c * size, 0), size)
        for r in range(n):
            mm = m[c * n + r]
            place[r] += (1 <= mm < eff) if eff != size else (2 <= mm < size)
    n_nodes = 0
    for r in range(n):
        n_nodes += place[r]
        place[r] = n_nodes - place[r]
    for c in range(1 << dense):
        eff = min(max(chunk_size - c * size, 0), size)
        for r in range(n):
            mm = m[c * n + r]
            if (1 <= mm < eff) if eff != size else (2 <= mm < size):
                at = place[r]
                nodes[0, at], nodes[1, at], nodes[2, at] = r, c * size, eff
                nodes[3, at], nodes[4, at] = mm, dst[c * n + r] - r * k
                place[r] += 1
    # levels below: only the busy nodes, and only those that send a symbol are in a round
    for level in range(dense, levels):
        if n_nodes == 0:
            break
        half = 1 << (levels - level - 1)
        lane_count[:] = 0
        n_send = 0
        for i in range(n_nodes):
            t = nodes[3, i] + (2 * level + (nodes[2, i] != 2 * half)) * (k + 1)
            node_tid[i] = t
            node_value[i] = split_lo[t]
            if sends[t]:
                senders[n_send] = i
                n_send += 1
                lane_count[nodes[0, i]] += 1
        if n_send:
            cursor = _round(
                x, n, senders[:n_send], node_tid, node_value, lane_count, row_tid, row_value,
                widths, pairs, total_bits, cursor, tables,
            )  # fmt: skip
            if cursor < 0:
                return TRUNCATED, 0, 0
        n_next = 0
        width = levels - level - 1
        for i in range(n_nodes):
            r, start, eff, mm, rank = (
                nodes[0, i],
                nodes[1, i],
                nodes[2, i],
                nodes[3, i],
                nodes[4, i],
            )
            j, t = node_value[i], node_tid[i]
            if leaf_count[t]:
                subset = leaf_at[t] + j * mm
                for p in range(mm):
                    out[r * k + rank + p] = start + leaf_pos[subset + p]
                continue
            e0 = min(eff, half)
            for side in range(2):
                c = mm - j if side else j
                e = eff - e0 if side else e0
                c_start = start + side * half
                c_rank = rank + side * j
                if c == e and c > 0:
                    for p in range(e):
                        out[r * k + c_rank + p] = c_start + p
                elif c == 1 and e == half:
                    lone[0, n_lone], lone[1, n_lone] = r * k + c_rank, c_start
                    lone[2, n_lone] = width
                    n_lone += 1
                elif 0 < c < e:
                    children[0, n_next], children[1, n_next], children[2, n_next] = r, c_start, e
                    children[3, n_next], children[4, n_next] = c, c_rank
                    n_next += 1
        nodes, children = children, nodes
        n_nodes = n_next
    return OK, cursor, n_lone


@numba.njit(cache=True, nogil=True)
def _round(
    x: np.ndarray, n: int, senders: np.ndarray, tid: np.ndarray, value: np.ndarray,
    lane_count: np.ndarray, step_tid: np.ndarray, step_value: np.ndarray, widths: np.ndarray,
    pairs: np.ndarray, total_bits: int, cursor: int, tables: tuple[np.ndarray, ...],
) -> int:  # fmt: skip
    """One level's symbols (nodes ``senders``, in (chunk, position) order, so each lane's are a
    run): step s decodes the s-th symbol of every lane with more than s, busiest lanes first,
    ties in lane order."""
    first = np.empty(n, np.int64)
    most = 0
    ahead = 0
    for r in range(n):
        first[r] = ahead
        ahead += lane_count[r]
        most = max(most, lane_count[r])
    with_count = np.zeros(most + 1, np.int64)
    for r in range(n):
        with_count[lane_count[r]] += 1
    busy = np.zeros(most + 1, np.int64)  # busy[s]: lanes with more than s symbols; busy[most] = 0
    at = np.zeros(most + 1, np.int64)  # where each count's lanes start in the order
    ahead = 0
    for c in range(most, -1, -1):
        at[c] = ahead
        ahead += with_count[c]
        if c:
            busy[c - 1] = ahead
    order = np.empty(n, np.int64)
    for r in range(n):
        order[at[lane_count[r]]] = r
        at[lane_count[r]] += 1
    for s in range(most):
        for i in range(busy[s]):
            step_tid[i] = tid[senders[first[order[i]] + s]]
        readers = 0 if s % GROUP == GROUP - 1 else busy[s + 1]
        cursor = _step(
            x, order, busy[s], readers, step_tid, step_value, widths, pairs, total_bits, cursor,
            tables,
        )  # fmt: skip
        if cursor < 0:
            return cursor
        for i in range(busy[s]):
            value[senders[first[order[i]] + s]] = step_value[i]
    return cursor


@numba.njit(cache=True, nogil=True)
def _fill_lone(
    pairs: np.ndarray,
    total_bits: int,
    cursor: int,
    x: np.ndarray,
    n: int,
    out: np.ndarray,
    lone: np.ndarray,
    n_lone: int,
) -> int:
    """Raw fields of the lone positions: the explicit part from the stream, the rest from the
    lanes' final states (each carries ``back`` bits), read as one joined bit string."""
    total = 0
    for i in range(n_lone):
        total += lone[2, i]
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
    p = 0  # offset in the joined string
    for i in range(n_lone):
        width = lone[2, i]
        raw = 0
        got = 0
        while got < width:
            if p < explicit:
                take = min(width - got, explicit - p)
                bits = _field(pairs, cursor + p, take)
            else:
                q = p - explicit
                off = q % back
                take = min(width - got, back - off)
                bits = ((x[q // back] - STATE_LOW) >> off) & ((1 << take) - 1)
            raw |= bits << got
            got += take
            p += take
        out[lone[0, i]] = lone[1, i] + raw
    return OK
