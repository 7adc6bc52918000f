"""The GPU path of the codec: Triton kernels (the `triton` package, used directly).

Dispatch: a codec step takes this path when its tensors are on a CUDA device and `triton`
imports; otherwise the numpy/torch CPU path. Both produce the same bytes and the same tensors
bit for bit (see docs/codec.md for what runs where):

* `codec.gpu.select` — error feedback and exact per-chunk Top-k of a chunk group, one program
  per chunk, reading the pseudo-gradient through the group's tile view;
* `codec.gpu.scatter` — dequantisation fused with the scatter-add of an update into a dense
  tensor (aggregation, densify) and with the error-feedback write-back;
* `codec.gpu.rans` — the rANS steps of the index coder, one program per block of lanes, with the
  renormalisation fields' bit offsets from a prefix sum over the lanes;
* `codec.gpu.index_decode` — the index decoder's split-tree walk as torch ops on the device,
  feeding those steps device tensors: the whole decode stays on the device.

The kernel modules (and `codec.gpu.index_decode`, through `codec.gpu.rans`) import `triton` at
import time; import them only through `enabled`.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch

__all__ = ["enabled", "missing"]


@lru_cache(maxsize=1)
def missing() -> str | None:
    """Why the Triton path cannot run in this process (None when it can). ``TESSERA_TRITON=0``
    in the environment switches it off (the CPU path's torch ops then run on the device)."""
    if os.environ.get("TESSERA_TRITON", "1") == "0":
        return "the Triton path is switched off (TESSERA_TRITON=0)"
    try:
        import triton
        import triton.language  # noqa: F401
    except ImportError as exc:  # no wheel for this platform, or not installed
        return f"triton is not importable: {exc}"
    return None


def enabled(*tensors: torch.Tensor) -> bool:
    """Whether a step on these tensors takes the Triton path: all on CUDA, triton importable."""
    return bool(tensors) and all(t.is_cuda for t in tensors) and missing() is None
