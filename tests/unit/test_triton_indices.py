"""Triton rANS steps of the index coder (`codec.gpu.rans`) under the interpreter: the same bytes
from the encoder and the same indices from the decoder as the CPU path, on grid and sparse
levels, leaves, chunks straddling a non-power-of-two size, clustered sets; corrupt streams fail
with `DecodeError` on both paths alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from codec import indices
from codec.errors import DecodeError
from lab.bench.codec import clustered_subsets, random_subsets
from tests.support.triton_interpreter import require_interpreter


@pytest.fixture(autouse=True)
def interpreter() -> None:
    require_interpreter()


@pytest.fixture
def lanes_per_program(monkeypatch: pytest.MonkeyPatch) -> None:
    """8 lanes per program: many programs, so the bit offsets of a step's fields must come from
    the prefix sum across programs, not from within one."""
    from codec.gpu import rans

    monkeypatch.setattr(rans, "BLOCK", 8)


CASES = [(4096, 64, 24), (4096, 3, 20), (1000, 17, 20), (4095, 2, 12), (256, 40, 10), (100, 1, 9)]


@pytest.mark.parametrize(("c", "k", "n"), CASES)
def test_same_bytes_and_indices_as_the_cpu_path(c: int, k: int, n: int) -> None:
    rng = np.random.default_rng(c * 1000 + k)
    idx = random_subsets(rng, n, c, k)
    idx[0] = np.arange(k)  # a dense run: full blocks and leaves near the start
    data = indices.encode(idx, c, triton=False)
    assert indices.encode(torch.from_numpy(idx), c, triton=True) == data
    assert torch.equal(indices.decode(data, triton=True), torch.from_numpy(idx))


@pytest.mark.usefixtures("lanes_per_program")
@pytest.mark.parametrize(("c", "k", "n"), [CASES[0], CASES[2]])
def test_same_bytes_with_many_programs_per_step(c: int, k: int, n: int) -> None:
    test_same_bytes_and_indices_as_the_cpu_path(c, k, n)


def test_clustered_sets_round_trip_identically() -> None:
    idx = clustered_subsets(np.random.default_rng(5), 12, 4096, 128)
    data = indices.encode(idx, 4096, triton=False)
    assert indices.encode(idx, 4096, triton=True) == data
    assert torch.equal(indices.decode(data, triton=True), torch.from_numpy(idx))


def _outcome(data: bytes, triton: bool) -> torch.Tensor | None:
    try:
        return indices.decode(data, triton=triton)
    except DecodeError:
        return None


@pytest.mark.usefixtures("lanes_per_program")
def test_corrupt_streams_fail_alike_on_both_paths() -> None:
    rng = np.random.default_rng(9)
    data = indices.encode(random_subsets(rng, 8, 512, 12), 512)
    header = 7
    mutants = [data[:-3], data[: header + 20], data + b"\x00"]
    for _ in range(12):
        buf = bytearray(data)
        at = int(rng.integers(header, len(buf)))
        buf[at] ^= 1 << int(rng.integers(0, 8))
        mutants.append(bytes(buf))
    mutants.append(data[:header] + b"\xff" * (len(data) - header))  # states that collapse
    failures = 0
    for m in mutants:
        want, got = _outcome(m, False), _outcome(m, True)
        assert (want is None) == (got is None)
        if want is None:
            failures += 1
        else:
            assert got is not None and torch.equal(want, got)
    assert failures >= 3
