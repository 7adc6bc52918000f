"""Triton compression kernels (`codec.gpu.select`, `codec.gpu.scatter.feedback`) under the
interpreter, bit for bit against the CPU path: positions, codes, side bytes, codebooks and the
error-feedback buffers after every step."""

from __future__ import annotations

import pytest
import torch

from codec.compress import Compressor, topk_rows
from codec.spec import CodecParams, ModelSpec
from lab.bench.compress import student_t3
from tests.support.triton_interpreter import require_interpreter

pytestmark = pytest.mark.usefixtures("interpreter")

# Ragged shapes: full tiles plus right, bottom and corner groups; a 1-D tail; a 3-D tensor.
SPEC = ModelSpec.from_shapes({"w": (40, 37), "b": (300,), "conv": (3, 5, 7)})
PARAMS = CodecParams(tile=16, k=8, max_abs_value=2.0**64)


@pytest.fixture
def interpreter() -> None:
    require_interpreter()


def _same(a: Compressor, b: Compressor, name: str, delta: torch.Tensor, freeze: bool) -> None:
    x = a.compress(name, delta, 0.9, freeze=freeze)
    y = b.compress(name, delta, 0.9, freeze=freeze)
    for gx, gy in zip(x.groups, y.groups, strict=True):
        assert torch.equal(gx.idx, gy.idx)
        assert torch.equal(gx.codes, gy.codes)
        assert torch.equal(gx.scales, gy.scales)
    assert torch.equal(x.codebook, y.codebook)
    assert torch.equal(a.error(name), b.error(name))


def test_compress_steps_match_the_cpu_path_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(0)
    cpu = Compressor(SPEC, PARAMS, triton=False)
    kernels = Compressor(SPEC, PARAMS, triton=True)
    for step in range(3):
        for t in SPEC.tensors:
            delta = student_t3(t.shape, gen)
            if step == 1:  # a run of zeros: ties at the threshold inside some chunks
                delta.view(-1)[: delta.numel() // 3] = 0.0
            _same(cpu, kernels, t.name, delta, freeze=step == 2)


def test_delta_in_half_precision_is_folded_like_the_cpu_path() -> None:
    gen = torch.Generator().manual_seed(1)
    cpu = Compressor(SPEC, PARAMS, triton=False)
    kernels = Compressor(SPEC, PARAMS, triton=True)
    for _ in range(2):
        _same(cpu, kernels, "w", student_t3((40, 37), gen).to(torch.bfloat16), freeze=False)


def test_select_keeps_the_lowest_positions_among_ties() -> None:
    from codec.chunking import ChunkLayout
    from codec.gpu.select import select

    gen = torch.Generator().manual_seed(2)
    # values from a tiny set: most chunks have many entries tied at their k-th largest |e|
    delta = torch.randint(-2, 3, (32, 48), generator=gen).float()
    delta[:16, :16] = 0.0  # an all-zero chunk: its k lowest positions
    params = CodecParams(tile=16, k=16)
    layout = ChunkLayout.for_shape(delta.shape, params)
    ef = layout.split(torch.zeros_like(delta))
    for gi, g in enumerate(layout.groups):
        rows = layout.split(delta)[gi]
        want_pos, want_vals = topk_rows(rows, g.k)
        pos, vals = select(delta, ef[gi], layout, gi, 0.9, freeze=False)
        assert torch.equal(pos, want_pos)
        assert torch.equal(vals, want_vals)
        assert torch.equal(ef[gi], rows)  # EF (zero) folded with delta: e == delta
    assert torch.equal(pos[0], torch.arange(16))
