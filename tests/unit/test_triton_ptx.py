"""The Triton kernels compiled for a real GPU target (sm_90) without a GPU: every kernel builds,
and the aggregation kernels' launch options keep ``out + v * factor`` as the CPU path's two
roundings (no FMA in their PTX), while the EF update is the one FMA it is meant to be.

The interpreter cannot show this (it never contracts), so the kernels are compiled ahead of time
in a fresh process (the test suite's interpreter setting would turn them into interpreted
functions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from codec import gpu

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from codec.gpu import rans, scatter, select

F, I, U = "*fp32", "*i64", "*u8"
GEOM = dict(grid_cols="i32", tile_rows="i32", tile_cols="i32", origin="i64", cols="i64")
KERNELS = {
    "select": (select._select_kernel, dict(delta_ptr=F, ef_ptr=F, idx_ptr=I, vals_ptr=F,
        beta="fp32", chunk="i32", k="i32", **GEOM), dict(FREEZE=False, BLOCK=4096), {}),
    "scatter_add": (scatter._scatter_add_kernel, dict(out_ptr=F, idx_ptr=I, codes_ptr=U,
        scales_ptr=U, book_ptr=F, lut_ptr=F, factor_ptr=F, total="i64", k="i32", **GEOM),
        dict(BLOCK=scatter.BLOCK), scatter.LAUNCH_OPTIONS),
    "feedback": (scatter._feedback_kernel, dict(ef_ptr=F, idx_ptr=I, vals_ptr=F, codes_ptr=U,
        scales_ptr=U, book_ptr=F, lut_ptr=F, total="i64", k="i32", chunk="i32"),
        dict(BLOCK=scatter.BLOCK), scatter.LAUNCH_OPTIONS),
    "decode_step": (rans._decode_step, dict(x_ptr=I, t_ptr=I, val_ptr=I, nbits_ptr=I,
        coarse_ptr=I, packed_ptr=I, end_ptr=I, cbase_ptr=I, cshift_ptr=I, vbase_ptr=I,
        busy="i32", r0="i32", sym_off="i32"), dict(M=15, R=30, BLOCK=rans.BLOCK), {}),
    "read_step": (rans._read_step, dict(x_ptr=I, nbits_ptr=I, ends_ptr=I, cursor_ptr=I,
        pairs_ptr=I, n_pairs="i64", busy="i32"), dict(BLOCK=rans.BLOCK), {}),
    "encode_round": (rans._encode_round, dict(x_ptr=I, freq_ptr=I, cum_ptr=I, busy_ptr=I,
        readers_ptr=I, offsets_ptr=I, field_off_ptr=I, fval_ptr=I, fwid_ptr=I, n_lanes="i32",
        n_steps="i32"), dict(M=15, R=30, G=2, BLOCK=rans.BLOCK), {}),
}
out = {}
for name, (fn, sig, consts, options) in KERNELS.items():
    names = fn.arg_names
    src = ASTSource(fn=fn, signature={n: sig.get(n, "constexpr") for n in names},
                    constexprs={(names.index(c),): v for c, v in consts.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(options)).asm["ptx"]
    out[name] = ptx.count("fma.rn.f32")
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def fma_counts() -> dict[str, int]:
    reason = gpu.missing()
    if reason is not None:
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    if proc.returncode != 0 and "ptxas" in proc.stderr:
        pytest.skip(f"no CUDA toolchain in the triton install: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_kernel_compiles_for_a_gpu(fma_counts: dict[str, int]) -> None:
    assert set(fma_counts) == {
        "select", "scatter_add", "feedback", "decode_step", "read_step", "encode_round"
    }  # fmt: skip


def test_aggregation_kernels_round_the_product_and_the_sum_separately(
    fma_counts: dict[str, int],
) -> None:
    assert fma_counts["scatter_add"] == 0
    assert fma_counts["feedback"] == 0


def test_the_ef_update_is_one_fma_like_the_cpu_path(fma_counts: dict[str, int]) -> None:
    assert fma_counts["select"] >= 1
