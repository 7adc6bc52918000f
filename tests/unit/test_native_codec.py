"""The compiled CPU path of the codec (`codec.native`) against the numpy/torch reference it
replaces: the same indices from the same bytes, the same failures from corrupt bytes, no read or
write out of bounds whatever the bytes, and the same float32 sums from the scatter."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from codec import indices
from codec.chunking import ChunkLayout
from codec.compress import SparseGroup, SparseTensor, scatter_add
from codec.errors import DecodeError
from codec.index_decode import decode_body as reference_walk
from codec.native.index_decode import decode_body as native_walk
from codec.quantize import dequantize
from codec.spec import CodecParams
from codec.varint import read_varint
from lab.bench.codec import clustered_subsets, random_subsets

ROOT = Path(__file__).resolve().parents[2]


def _body(data: bytes) -> tuple[bytes, int, int, int]:
    pos = len(indices.MAGIC) + 1
    c, pos = read_varint(data, pos)
    k, pos = read_varint(data, pos)
    n, pos = read_varint(data, pos)
    return data[pos:], c, k, n


def _walks_agree(idx: np.ndarray, c: int) -> None:
    body, c, k, n = _body(indices.encode(idx, c))
    want = reference_walk(body, c, k, n)
    got = native_walk(body, c, k, n)
    assert got.dtype == np.int64
    assert np.array_equal(got, want)
    assert np.array_equal(got, idx)


@settings(max_examples=200, deadline=None)
@given(
    c=st.integers(2, 5000),
    k_share=st.floats(0.0, 1.0),
    n=st.integers(1, 7),
    clustered=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_native_walk_decodes_what_the_reference_walk_decodes(
    c: int, k_share: float, n: int, clustered: bool, seed: int
) -> None:
    k = max(1, min(c - 1, 300, round(k_share * c)))
    rng = np.random.default_rng(seed)
    if clustered and k < c:
        idx = rng.integers(0, c - k + 1, size=n)[:, None] + np.arange(k)
    else:
        idx = random_subsets(rng, n, c, k)
    _walks_agree(idx.astype(np.int64), c)


@pytest.mark.parametrize(
    ("c", "k", "n"),
    [
        (4096, 64, 300),  # the presets' chunks: six grid levels, leaves of 128 at the last
        (4096, 1, 40),  # one position in a power-of-two chunk: all raw bits
        (1000, 1, 40),  # one position in a partial chunk: a tree all the same
        (64, 63, 5),  # the root is a leaf
        (4096, 1024, 4),  # the largest k
        (5000, 200, 9),  # a chunk straddling a power of two
        (2, 1, 7),
        (3, 2, 5),
    ],
)
def test_native_walk_on_grid_levels_leaves_and_partial_chunks(c: int, k: int, n: int) -> None:
    rng = np.random.default_rng(c * 7 + k)
    idx = random_subsets(rng, n, c, k)
    idx[0] = np.arange(k)  # a dense run: full blocks and leaves near the start
    _walks_agree(idx, c)


def test_native_walk_on_row_structured_top_k() -> None:
    _walks_agree(clustered_subsets(np.random.default_rng(5), 40, 4096, 64), 4096)


def _outcome(
    walk: Callable[[bytes, int, int, int], np.ndarray], body: bytes, c: int, k: int, n: int
) -> np.ndarray | str:
    """The positions, or the rule that refused the stream (its message without the counts)."""
    try:
        return walk(body, c, k, n)
    except DecodeError as exc:
        return re.sub(r"\d+ ", "", str(exc).split(": needs")[0])


def test_corrupt_streams_fail_alike_on_both_walks() -> None:
    """Bit flips, byte edits, cuts and padding: the native walk refuses exactly what the
    reference refuses (for the same reason) and decodes the rest to the same positions."""
    rng = np.random.default_rng(9)
    body, c, k, n = _body(indices.encode(random_subsets(rng, 24, 4096, 64), 4096))
    mutants = [body[:-3], body[: len(body) // 2], body + b"\x00", body + b"\x80"]
    mutants.append(b"\xff" * len(body))  # states that collapse
    for _ in range(200):
        buf = bytearray(body)
        for _ in range(int(rng.integers(1, 4))):
            buf[int(rng.integers(0, len(buf)))] ^= 1 << int(rng.integers(0, 8))
        mutants.append(bytes(buf))
    refused = 0
    for m in mutants:
        want, got = _outcome(reference_walk, m, c, k, n), _outcome(native_walk, m, c, k, n)
        if isinstance(want, str):
            refused += 1
            assert got == want
        else:
            assert isinstance(got, np.ndarray) and np.array_equal(got, want)
    assert refused > len(mutants) // 2


def test_padding_bits_must_be_zero_on_both_walks() -> None:
    """Fields are packed from the lowest bit, so the top bit of the last byte is padding unless
    the stream fills it: set there, the stream is refused by both walks."""
    rng = np.random.default_rng(11)
    reasons = []
    for n in range(8, 24):
        body, c, k, n = _body(indices.encode(random_subsets(rng, n, 4096, 64), 4096))
        flipped = body[:-1] + bytes([body[-1] | 0x80])
        want = _outcome(reference_walk, flipped, c, k, n)
        got = _outcome(native_walk, flipped, c, k, n)
        assert isinstance(want, str) == isinstance(got, str)
        if isinstance(want, str):
            assert got == want
            reasons.append(want)
    assert "non-zero padding bits after the index stream" in reasons


FUZZ = textwrap.dedent(
    """
    import numpy as np
    from codec import indices
    from codec.errors import DecodeError
    from lab.bench.codec import random_subsets
    rng = np.random.default_rng(4)
    for c, k, n in ((4096, 64, 16), (1000, 17, 12), (128, 40, 6)):
        good = indices.encode(random_subsets(rng, n, c, k), c)
        for _ in range(300):
            data = bytearray(good)
            for _ in range(int(rng.integers(1, 6))):
                at = int(rng.integers(7, len(data)))
                data[at] = int(rng.integers(0, 256))
            try:
                indices.decode(bytes(data), expect=(c, k, n))
            except DecodeError:
                pass
    print("in bounds")
    """
)


def test_hostile_streams_never_read_or_write_out_of_bounds(tmp_path: Path) -> None:
    """Compiled with bounds checks (an out-of-bounds access then raises IndexError instead of
    reading or corrupting memory), the walk meets random byte edits of real streams."""
    env = {**os.environ, "NUMBA_BOUNDSCHECK": "1", "NUMBA_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", FUZZ], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "in bounds" in done.stdout


def _random_piece(shape: tuple[int, ...], params: CodecParams, seed: int) -> SparseTensor:
    rng = np.random.default_rng(seed)
    layout = ChunkLayout.for_shape(shape, params)
    groups = []
    for g in layout.groups:
        idx = random_subsets(rng, g.n_chunks, g.chunk_size, g.k)
        groups.append(
            SparseGroup(
                torch.from_numpy(idx),
                torch.from_numpy(rng.integers(0, 4, (g.n_chunks, g.k), dtype=np.uint8)),
                torch.from_numpy(rng.integers(0, 256, g.n_chunks, dtype=np.uint8) & 0xFD),
            )
        )
    book = torch.from_numpy(rng.random((2, 2), dtype=np.float32))
    return SparseTensor("t", shape, groups, book)


def _index_add(out: torch.Tensor, piece: SparseTensor, params: CodecParams, factor: float) -> None:
    """The reference: flat positions, dequantised values times the float32 factor, index_add_."""
    layout = piece.layout(params)
    scale = torch.tensor(factor, dtype=torch.float32)
    for gi, g in enumerate(piece.groups):
        flat = layout.flat_positions(gi, g.idx).view(-1)
        values = dequantize(g.codes, g.scales, piece.codebook).view(-1)
        out.view(-1).index_add_(0, flat, values * scale)


@pytest.mark.parametrize("shape", [(300, 200), (64, 4096), (1000,), (130, 70)])
@pytest.mark.parametrize("narrow", [False, True])
def test_native_scatter_adds_what_index_add_adds(shape: tuple[int, ...], narrow: bool) -> None:
    """Tiles of every shape the layout makes (edge tiles are not powers of two), int64 and the
    pool's int16 positions, factors that round: every float32 product and sum as index_add_."""
    params = CodecParams(tile=16, k=8)
    base = torch.randn(shape)
    want, got = base.clone(), base.clone()
    for seed, factor in enumerate((1.0, 0.3712, 1e-3, 0.9999)):
        piece = _random_piece(shape, params, seed)
        if narrow:
            piece = SparseTensor(
                piece.name,
                piece.shape,
                [SparseGroup(g.idx.to(torch.int16), g.codes, g.scales) for g in piece.groups],
                piece.codebook,
            )
        _index_add(want, piece, params, factor)
        scatter_add(got, piece, params, factor)
    assert torch.equal(got, want)


def test_a_stream_too_large_for_int32_slots_is_refused_before_decoding() -> None:
    """2**31 indices in one stream (what `indices.decode`'s default bound still lets through)
    would overflow the walk's int32 output slots: refused before a bit is read."""
    n, k = 1 << 21, 1024
    with pytest.raises(DecodeError, match="more than the decoder holds"):
        native_walk(bytes(n * 30 // 8), 4096, k, n)


def _rows_status(idx: np.ndarray, chunk_size: int) -> str | None:
    """What a piece with these index rows is refused for: the compiled check on the CPU, the
    torch checks elsewhere (a non-contiguous copy takes them), both through `validate`."""
    n, k = idx.shape
    params = CodecParams(tile=int(chunk_size**0.5), k=k, max_abs_value=4.0)
    reasons: list[str | None] = []
    for rows in (torch.from_numpy(idx), torch.from_numpy(np.asfortranarray(idx))):
        group = SparseGroup(
            idx=rows,
            codes=torch.zeros(n, k, dtype=torch.uint8),
            scales=torch.zeros(n, dtype=torch.uint8),
        )
        piece = SparseTensor("w", (n * chunk_size,), [group], torch.ones(1, 2))
        try:
            piece.validate(params)
            reasons.append(None)
        except DecodeError as exc:
            reasons.append(str(exc))
    assert reasons[0] == reasons[1]
    return reasons[0]


def test_the_compiled_row_check_refuses_what_the_torch_checks_refuse() -> None:
    """Rows inside the chunk and strictly ascending pass; a position outside it (at either end,
    in any row, with other rows unsorted too) is refused as outside, a repeat or a descent in
    any row as unsorted: the compiled check (contiguous CPU rows) and the torch checks agree."""
    rng = np.random.default_rng(5)
    c, k, n = 64, 5, 40
    good = np.stack([np.sort(rng.choice(c, k, replace=False)) for _ in range(n)]).astype(np.int64)
    assert _rows_status(good, c) is None
    for r in (0, 17, n - 1):
        low, high, repeat, descent = (good.copy() for _ in range(4))
        low[r, 0] = -1
        high[r, -1] = c
        repeat[r, 2] = repeat[r, 1]
        descent[r, 1:3] = descent[r, 2:0:-1]
        assert "outside the chunk" in str(_rows_status(low, c))
        assert "outside the chunk" in str(_rows_status(high, c))
        assert "strictly ascending" in str(_rows_status(repeat, c))
        assert "strictly ascending" in str(_rows_status(descent, c))
        both = descent.copy()
        both[n - 1 - r // 2, -1] = c + 3  # outside wins over unsorted, whichever row comes first
        assert "outside the chunk" in str(_rows_status(both, c))
