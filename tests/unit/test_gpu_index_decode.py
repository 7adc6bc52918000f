"""The index decoder's walk on the device (`codec.gpu.index_decode`), its torch ops and Triton
kernels run on CPU tensors under Triton's interpreter: the same indices from the same bytes as
the CPU path (the compiled walk) and the encoder's input, bit for bit, over chunk sizes from 2 to
2**20 (powers of two or not), k from 1 to the coder's limit and to C - 1 (grid and sparse levels,
leaf-heavy trees, lone positions only), 1 to 3000 chunks, uniform and clustered positions. Its
schedules match the host's; every check of the stream (states that collapse, reads past the end,
lane states that do not end where they began, a truncated raw section, trailing bytes, non-zero
padding) is made on the device path, each by a test that fails without it (a stream it alone
refuses; a collapse, which no stream can cause, on a round given a collapsed state); and random
edits of real streams are refused for the same reason as on the CPU path."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from codec import indices
from codec.bitio import BitReader
from codec.errors import DecodeError
from codec.index_model import split_tables
from codec.rans import STATE_BITS, STATE_LOW, Round
from codec.varint import read_varint
from lab.bench.codec import clustered_subsets, random_subsets
from tests.support.triton_interpreter import require_interpreter

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def interpreter() -> None:
    require_interpreter()


@pytest.fixture
def lanes_per_program(monkeypatch: pytest.MonkeyPatch) -> None:
    """8 lanes per program: a step's lanes span many programs."""
    from codec.gpu import rans

    monkeypatch.setattr(rans, "BLOCK", 8)


def _subsets(rng: np.random.Generator, n: int, c: int, k: int, clustered: bool) -> np.ndarray:
    square = math.isqrt(c) ** 2  # clustered sets come from square tiles: the first ones of C
    if clustered and 2 * k <= square:
        return clustered_subsets(rng, n, square, k)
    if clustered:  # a run of k positions at a random offset
        return rng.integers(0, c - k + 1, size=n)[:, None] + np.arange(k)
    return random_subsets(rng, n, c, k)


def _round_trip(idx: np.ndarray, c: int) -> None:
    data = indices.encode(idx, c)
    want = indices.decode(data, triton=False)
    got = indices.decode(data, triton=True)
    assert got.dtype == torch.int64 and got.shape == want.shape
    assert torch.equal(got, want)
    assert torch.equal(got, torch.from_numpy(idx.astype(np.int64)))


CASES = [
    (4096, 64, 2000, False),  # the presets' chunks, many of them: six grid levels, leaves below
    (4096, 64, 24, True),
    (4096, 1, 3000, False),  # one position in a power-of-two chunk: raw bits only
    (1000, 1, 500, False),  # one position in a partial chunk: a tree all the same
    (2, 1, 50, False),
    (3, 1, 2000, False),
    (3, 2, 100, False),
    (5, 4, 30, True),
    (7, 3, 1000, False),
    (16, 8, 300, False),  # leaves of 16: two runs of leaf counts
    (64, 63, 100, False),  # the root is a leaf
    (128, 2, 200, False),  # every root's child a leaf of 128
    (100, 50, 300, True),
    (256, 200, 20, False),
    (5000, 300, 8, True),  # a chunk straddling a power of two
    (4095, 2, 12, False),
    (1000, 999, 2, False),  # k = C - 1
    (2048, 1024, 1, False),  # the largest k
    (1 << 20, 5, 20, True),  # the largest chunk
]


@pytest.mark.parametrize(("c", "k", "n", "clustered"), CASES)
def test_device_walk_decodes_what_the_cpu_path_decodes(
    c: int, k: int, n: int, clustered: bool
) -> None:
    rng = np.random.default_rng(c * 7919 + k * 31 + n)
    idx = _subsets(rng, n, c, k, clustered)
    if n > 1 and k < c:
        idx[0] = np.arange(k)  # a dense run: full blocks and leaves near the start
        idx[-1] = np.arange(c - k, c)  # and one against the chunk's end
    _round_trip(idx, c)


def test_random_shapes_decode_alike() -> None:
    rng = np.random.default_rng(2024)
    for _ in range(9):
        c = int(rng.choice([int(rng.integers(2, 300)), int(rng.integers(300, 5000))]))
        k = int(rng.integers(1, min(c, 160) + 1))
        n = int(rng.integers(1, max(2, min(3000, 40_000 // k))))
        _round_trip(_subsets(rng, n, c, k, bool(rng.integers(0, 2))), c)


@pytest.mark.usefixtures("lanes_per_program")
@pytest.mark.parametrize(("c", "k", "n", "clustered"), [CASES[1], CASES[7], CASES[9]])
def test_many_programs_per_step(c: int, k: int, n: int, clustered: bool) -> None:
    test_device_walk_decodes_what_the_cpu_path_decodes(c, k, n, clustered)


def test_device_schedule_is_the_host_schedule() -> None:
    from codec.gpu.rans import DeviceRound

    rng = np.random.default_rng(3)
    for trial in range(200):
        n = int(rng.integers(1, 60))
        counts = rng.integers(0, 6, size=n) * (rng.random(n) < 0.7)
        if trial % 5 == 0:
            counts[:] = int(rng.integers(1, 4))  # every lane as busy
        if counts.sum() == 0:
            counts[int(rng.integers(0, n))] = 1
        lanes = np.repeat(np.arange(n), counts)
        want = Round.build(lanes, n)
        got = DeviceRound.build(torch.from_numpy(lanes), n)
        assert got.steps.busy == want.busy and got.steps.offsets == list(want.offsets)
        if want.order is None:
            assert got.order is None
        else:
            assert got.order is not None
            assert np.array_equal(got.order.numpy(), want.order[: want.busy[0]])
        assert want.perm is not None and got.perm is not None
        assert np.array_equal(got.perm.numpy(), want.perm)


def _header_size(data: bytes) -> int:
    pos = len(indices.MAGIC) + 1
    for _ in range(3):
        _, pos = read_varint(data, pos)
    return pos


REASONS = (
    "collapsed",
    "bit stream truncated",
    "do not end where they began",
    "truncated in its raw section",
    "trailing bytes",
    "non-zero padding",
)


def _reason(data: bytes, triton: bool) -> str | None:
    try:
        indices.decode(data, triton=triton)
    except DecodeError as exc:
        return next((r for r in REASONS if r in str(exc)), str(exc))
    return None


def _stream(c: int, k: int, n: int, seed: int) -> bytes:
    return indices.encode(random_subsets(np.random.default_rng(seed), n, c, k), c)


def _refused_for(data: bytes, reason: str) -> None:
    """The CPU path and the device path refuse `data` for `reason`: the device path's check of
    it is needed (a stream that only it refuses, as each below is)."""
    assert _reason(data, False) == reason
    assert _reason(data, True) == reason


def test_reads_past_the_end_are_refused() -> None:
    data = _stream(512, 12, 8, 9)
    _refused_for(data[: _header_size(data) + 40], "bit stream truncated")


def test_lane_states_must_end_where_they_began() -> None:
    data = bytearray(_stream(4096, 1, 16, 1))  # no rANS symbols: the states carry raw bits only
    data[_header_size(bytes(data)) + 3] ^= 0x10  # bit 28 of lane 0's state: not a raw bit
    _refused_for(bytes(data), "do not end where they began")


def test_a_truncated_raw_section_is_refused() -> None:
    _refused_for(_stream(4096, 64, 24, 0)[:-1], "truncated in its raw section")


def test_trailing_bytes_are_refused() -> None:
    _refused_for(_stream(4096, 64, 24, 0) + b"\x00", "trailing bytes")


def test_non_zero_padding_is_refused() -> None:
    data = bytearray(_stream(4096, 64, 24, 0))
    data[-1] |= 0x80
    _refused_for(bytes(data), "non-zero padding")


def test_a_collapsed_lane_state_is_reported() -> None:
    """No stream can make a sound state collapse (each group of symbols leaves it >= 1), so the
    check is shown on a round given a collapsed state: the stream then refuses to end."""
    from codec.gpu.rans import DeviceRound, DeviceStream, decode_round

    tables = split_tables(4096, 64)
    stream = DeviceStream.of(BitReader(bytes(64)), CPU)
    tids = torch.full((2,), 2 * (tables.k + 1) + 9, dtype=torch.int64)  # level 1, m = 9
    sound = torch.full((1,), STATE_LOW, dtype=torch.int64)
    decode_round(sound, DeviceRound.grid(1, 2), tids, tables, stream)
    stream.check(int(stream.worst), int(stream.cursor[0]))
    decode_round(torch.zeros(1, dtype=torch.int64), DeviceRound.grid(1, 2), tids, tables, stream)
    assert int(stream.worst) > STATE_BITS // 2
    with pytest.raises(DecodeError, match="collapsed"):
        stream.check(int(stream.worst), int(stream.cursor[0]))


def test_a_body_too_short_for_the_states_is_refused() -> None:
    from codec.gpu.index_decode import decode_body

    with pytest.raises(DecodeError, match="needs 120 bits, has 24"):
        decode_body(bytes(3), 4096, 64, 4, CPU)


@pytest.mark.usefixtures("lanes_per_program")
def test_edited_streams_are_refused_for_the_cpu_path_s_reason() -> None:
    rng = np.random.default_rng(11)
    reasons: set[str | None] = set()
    for c, k, n in ((512, 12, 8), (4096, 64, 6), (1000, 1, 24)):
        data = _stream(c, k, n, int(rng.integers(0, 1 << 30)))
        header = _header_size(data)
        mutants = [data[:-1], data[:-3], data[: (header + len(data)) // 2], data + b"\x01"]
        for _ in range(5):
            buf = bytearray(data)
            at = int(rng.integers(header, len(buf)))
            if rng.integers(0, 2):
                buf[at] ^= 1 << int(rng.integers(0, 8))
            else:
                buf[at:] = rng.integers(0, 256, len(buf) - at, dtype=np.uint8).tobytes()
            mutants.append(bytes(buf))
        for m in mutants:
            want = _reason(m, False)
            assert _reason(m, True) == want
            reasons.add(want)
            if want is None:
                assert torch.equal(indices.decode(m, triton=True), indices.decode(m, triton=False))
    assert {None, "bit stream truncated", "do not end where they began"} <= reasons
