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
"""

from codec.errors import DecodeError
from codec.spec import CODEC_VERSION, CodecParams, ModelSpec, TensorSpec

__all__ = ["CODEC_VERSION", "CodecParams", "DecodeError", "ModelSpec", "TensorSpec"]
