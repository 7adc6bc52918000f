"""Shared by the Triton tests: the kernels run on CPU tensors under Triton's interpreter.

Importing this module sets ``TRITON_INTERPRET=1`` before `triton` is first imported (the
variable is read when a kernel is decorated). `require_interpreter` skips, with the reason, when
triton is not importable here or its kernels were already built for a device.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from codec import gpu


def require_interpreter() -> None:
    reason = gpu.missing()
    if reason is not None:
        pytest.skip(reason)
    from codec.gpu import scatter

    if type(scatter._scatter_add_kernel).__name__ != "InterpretedFunction":
        pytest.skip("the Triton kernels were built for a device before TRITON_INTERPRET was set")
