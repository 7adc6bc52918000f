"""Index coder: exact round trips, size against the information-theoretic limit, hostile bytes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from codec import indices
from codec.errors import DecodeError
from tests.support.allocation import peak_allocation


def random_subsets(rng: np.random.Generator, n: int, c: int, k: int) -> np.ndarray:
    if k == 0:
        return np.zeros((n, 0), dtype=np.int64)
    return np.sort(rng.random((n, c)).argpartition(k - 1, axis=1)[:, :k], axis=1)


def limit_bits(c: int, k: int) -> float:
    return (math.lgamma(c + 1) - math.lgamma(k + 1) - math.lgamma(c - k + 1)) / math.log(2)


@st.composite
def subsets(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    c = draw(st.integers(1, 5000))
    k = draw(st.integers(0, min(c, 300)))
    n = draw(st.integers(0, 6))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if draw(st.booleans()) and 0 < k < c:  # clustered: a run plus a few strays
        start = rng.integers(0, c - k + 1, size=n)
        idx = start[:, None] + np.arange(k)
    else:
        idx = random_subsets(rng, n, c, k)
    return idx.astype(np.int64), c


@settings(max_examples=300, deadline=None)
@given(subsets())
def test_round_trip_is_exact(case: tuple[np.ndarray, int]) -> None:
    idx, c = case
    data = indices.encode(torch.from_numpy(idx), c)
    out = indices.decode(data)
    assert out.dtype == torch.long
    assert out.shape == idx.shape
    assert np.array_equal(out.numpy(), idx)


@pytest.mark.parametrize("c", [32768, 32769, 100_000])
def test_positions_past_16_bits_round_trip(c: int) -> None:
    """The decoder writes positions in the narrowest integer type that holds every position of
    the chunk: chunks past 2**15 positions take the wider one."""
    rng = np.random.default_rng(c)
    idx = random_subsets(rng, 4, c, 40)
    idx[0] = np.arange(c - 40, c)  # the last positions of the chunk
    assert np.array_equal(indices.decode(indices.encode(idx, c)).numpy(), idx)


@pytest.mark.parametrize("c", [256, 300, 4096])
def test_dense_blocks_with_gaps_round_trip(c: int) -> None:
    """Near-full blocks: leaves with m = e - 1 inside grid levels, and blocks past a leaf."""
    rng = np.random.default_rng(c)
    rows = [np.delete(np.arange(256), rng.integers(0, 256)) for _ in range(5)]
    rows += [np.sort(rng.choice(c, 255, replace=False))]
    idx = np.stack(rows).astype(np.int64)
    assert np.array_equal(indices.decode(indices.encode(idx, c)).numpy(), idx)


@pytest.mark.parametrize("k", [32, 64, 128, 256])
def test_random_subsets_within_one_percent_of_the_limit(k: int) -> None:
    rng = np.random.default_rng(k)
    n, c = 4096, 4096
    data = indices.encode(random_subsets(rng, n, c, k), c)
    bits_per_index = 8 * len(data) / (n * k)
    assert bits_per_index <= 1.01 * limit_bits(c, k) / k


def test_clustered_rows_cost_no_more_than_random() -> None:
    """Top-k of row-structured tiles clusters by rows; the coder must not pay for it."""
    rng = np.random.default_rng(7)
    n, c, k = 4096, 4096, 64
    tiles = rng.standard_normal((n, 64, 64)) * rng.gamma(0.3, size=(n, 64, 1))  # hot rows
    idx = np.sort(np.argpartition(-np.abs(tiles.reshape(n, c)), k, axis=1)[:, :k], axis=1)
    data = indices.encode(idx, c)
    assert 8 * len(data) / (n * k) <= 1.01 * limit_bits(c, k) / k
    assert np.array_equal(indices.decode(data).numpy(), idx)


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (np.array([[3, 1]]), "increasing"),
        (np.array([[1, 1]]), "increasing"),
        (np.array([[0, 4096]]), "lie in"),
        (np.array([[-1, 2]]), "lie in"),
        (np.array([1, 2]), "2-D"),
    ],
)
def test_encoder_rejects_malformed_rows(bad: np.ndarray, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        indices.encode(bad, 4096)


def test_encoder_rejects_chunk_sizes_and_k_beyond_the_coder() -> None:
    with pytest.raises(ValueError, match="chunk size 0 out of range"):
        indices.encode(np.array([[0]]), 0)
    with pytest.raises(ValueError, match="exceeds the coder's limit"):
        indices.encode(np.arange(indices.MAX_K + 1)[None, :], 4096)


def _valid_stream(n: int = 64, k: int = 64) -> bytes:
    return indices.encode(random_subsets(np.random.default_rng(1), n, 4096, k), 4096)


def test_adversarial_headers_raise_decode_error_cheaply() -> None:
    """Each hostile stream is refused by its own rule (the message), so that deleting any one
    check fails this test even where a later check would have refused the stream too."""
    good = _valid_stream()
    head = len(indices.MAGIC) + 1
    corpus = [
        (b"", "bad magic"),
        (b"TI", "bad magic"),
        (b"XX" + good[2:], "bad magic"),
        (good[:2] + bytes([9]) + good[3:], "version 9"),
        (good[:head] + b"\xff" * 12, "varint too long"),
        (good[:head] + b"\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01", "varint too long"),
        (good[:head] + b"\x80\x20\x40\xff\xff\xff\x7f", "exceed the limit"),  # lying count
        (good[:head] + b"\x00\x01\x01", "chunk size 0 out of range"),
        (good[:head] + b"\x81\x80\x80\x01\x01\x01", "chunk size 2097153 out of range"),
        (good[:head] + b"\x80\x20\x81\x20\x01", "k=4097 out of range"),  # k > C
        (good[:head] + b"\x80\x20\x81\x08\x01", "k=1025 out of range"),  # above the coder's k
        (good[: len(good) // 2], "truncated"),
        (good + b"\x00", "trailing bytes"),
        (good[:head] + b"\x80\x20\x40\x40" + b"\x00" * 10, "10 bytes cannot hold 64 chunks"),
        (good[:head] + b"\x80\x20\x00\x40\x00", "unexpected bytes after a trivial"),  # k = 0
    ]
    indices.decode(good)  # the coder's tables are built once, before anything is measured
    for data, rule in corpus:

        def refuse(data: bytes = data, rule: str = rule) -> None:
            with pytest.raises(DecodeError, match=rule):
                indices.decode(data)

        assert peak_allocation(refuse) < (64 << 10) + 32 * len(data), rule


def test_allocation_bound_is_enforced_before_decoding() -> None:
    with pytest.raises(DecodeError, match="exceed"):
        indices.decode(_valid_stream(), max_indices=100)
    with pytest.raises(DecodeError, match="expected"):
        indices.decode(_valid_stream(), expect=(4096, 64, 63))


def test_fuzzed_mutations_never_escape_decode_error() -> None:
    """Random bit flips, byte edits and truncations: either a DecodeError or a valid result."""
    rng = np.random.default_rng(3)
    good = bytearray(_valid_stream(n=32, k=32))
    for _ in range(400):
        data = bytearray(good)
        for _ in range(int(rng.integers(1, 4))):
            kind = rng.integers(0, 3)
            pos = int(rng.integers(0, len(data)))
            if kind == 0:
                data[pos] ^= 1 << int(rng.integers(0, 8))
            elif kind == 1:
                data[pos] = int(rng.integers(0, 256))
            else:
                del data[pos:]
                if not data:
                    data = bytearray(b"T")
        try:
            out = indices.decode(bytes(data), max_indices=1 << 20)
        except DecodeError:
            continue
        rows = out.numpy()
        assert rows.ndim == 2
        if rows.size:
            assert (np.diff(rows, axis=1) > 0).all()
