"""Tensors to bytes and back: chunking, Top-k with error feedback, 2-bit values, index coder, wire format.

The public surface other layers use:

* `Compressor` — error-feedback buffers and the SparseLoCo compression step per tensor;
* `encode_update` / `decode_update` / `read_header` / `header_digest` — the sparse wire container
  (strict on decode; `header_digest` is what an update's signature covers);
* `dense.encode_dense` / `dense.decode_dense` / `dense.dense_header_digest` — the dense container
  (bf16 or float32 values, DiLoCo), with exact order-free norms (`dense.dense_norm`);
* `frame.Frame` — the framing and signed digest both containers share;
* `aggregate` — the deterministic mean of several peers' decoded updates;
* `DecodeError` — the one exception for bytes that do not decode;
* `indices.encode` / `indices.decode` — the index coder on its own.

Tensors on a CUDA device take the Triton kernels of `codec.gpu` (same bytes, same tensors); see
docs/codec.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from codec.errors import DecodeError

if TYPE_CHECKING:
    from codec.spec import CODEC_VERSION, CodecParams, ModelSpec, TensorSpec

__all__ = ["CODEC_VERSION", "CodecParams", "DecodeError", "ModelSpec", "TensorSpec"]


def __getattr__(name: str) -> Any:
    """The spec's names, imported on first use: `codec.errors` alone (what the `tessera` command
    needs before it knows its subcommand) does not import torch."""
    if name in ("CODEC_VERSION", "CodecParams", "ModelSpec", "TensorSpec"):
        from codec import spec

        return getattr(spec, name)
    raise AttributeError(f"module 'codec' has no attribute {name!r}")
