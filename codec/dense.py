"""Dense updates: every value of every tensor, in bf16 or float32 (DiLoCo's pseudo-gradients).

    MAGIC "TSRD" | format version (u8) | header length (u32 LE) | header (msgpack) | payload

The frame and the signed digest are `codec.frame`'s, as for sparse updates. The header
(`DenseHeader`) names the codec version, the value type, the model spec digest, the tensor table
(name, shape), the payload length and its BLAKE2b-256 digest, and `meta`/`sig` for `protocol`.
The payload is every tensor's values in spec order, row-major, little-endian: bf16 as the upper
16 bits of the float32 value (round to nearest even), float32 as is.

`decode_dense` treats its input as hostile like `codec.wire.decode_update`: the size is checked
against a cap before anything is read, the header is parsed with bounds, validated strictly and
must be canonical, the tensor table must equal the expected spec, the value type the run's, the
payload length exactly ``numel * itemsize``, the digest must match, and every value must be finite
and at most ``max_abs`` in magnitude.

Norms are exact and order-free (`dense_norm`): each float32 square is split into three integer
parts per binary exponent and summed exactly, so every node derives the same clip factors on any
machine, whatever its thread count or SIMD width.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from codec.errors import DecodeError
from codec.frame import Frame, pack_header, payload_digest, unpack_header
from codec.spec import CODEC_VERSION, ModelSpec

__all__ = [
    "DecodedDense",
    "DenseHeader",
    "DenseTensor",
    "DenseType",
    "add_dense",
    "decode_dense",
    "dense_bytes",
    "dense_header_digest",
    "dense_norm",
    "encode_dense",
    "exact_norm",
    "read_dense_header",
    "to_wire_precision",
]

FRAME = Frame(b"TSRD", 1, "Tessera dense update")
DenseType = Literal["bf16", "fp32"]
ITEMSIZE: dict[str, int] = {"bf16": 2, "fp32": 4}
_TABLE_SLACK = 1 << 16
"""Header bytes allowed beyond the tensor table's names (shapes, digests, meta, signature)."""
_NORM_BLOCK = 1 << 26
"""Elements per exact-norm block: 2**26 squares of at most 2**25 each sum below 2**53."""


@dataclass
class DenseTensor:
    """One tensor's dense update: float32 values of the tensor's shape (already at wire precision
    when produced by `to_wire_precision` or decoded)."""

    name: str
    shape: tuple[int, ...]
    values: torch.Tensor


class DenseHeader(BaseModel):
    """Everything needed to check and decode a dense payload, plus what `protocol` signs."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    codec_version: int
    dtype: DenseType
    spec_digest: str = Field(max_length=64)
    tensors: tuple[tuple[str, tuple[int, ...]], ...] = Field(max_length=1 << 16)
    payload_bytes: int = Field(ge=0)
    digest: bytes = Field(min_length=32, max_length=32)
    meta: dict[str, str | int] = Field(default_factory=dict, max_length=16)
    sig: bytes = Field(default=b"", max_length=128)


@dataclass
class DecodedDense:
    """A decoded dense update: its header and one `DenseTensor` per tensor of the spec."""

    header: DenseHeader
    tensors: list[DenseTensor]

    @property
    def digest(self) -> bytes:
        return self.header.digest

    @property
    def signed_digest(self) -> bytes:
        return dense_header_digest(self.header)


def dense_bytes(spec: ModelSpec, dtype: DenseType) -> int:
    """The most bytes a legitimate dense update of ``spec`` can take (payload + header slack)."""
    names = sum(len(t.name.encode()) + 8 * len(t.shape) + 8 for t in spec.tensors)
    return ITEMSIZE[dtype] * spec.numel + names + _TABLE_SLACK


def to_wire_precision(values: torch.Tensor, dtype: DenseType, max_abs: float) -> torch.Tensor:
    """``values`` clamped to ``[-max_abs, max_abs]`` and rounded to what the wire carries (float32).

    The sender keeps exactly this as what it sent, so sent and decoded values agree bit for bit.
    """
    v = values.detach().to(torch.float32).clamp(-max_abs, max_abs)
    return v.to(torch.bfloat16).to(torch.float32) if dtype == "bf16" else v.clone()


def _payload_part(t: torch.Tensor, dtype: DenseType) -> bytes:
    flat = t.detach().to("cpu", torch.float32).contiguous().view(-1)
    if dtype == "fp32":
        return flat.numpy().astype("<f4").tobytes()
    return flat.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()


def _pack(header: DenseHeader) -> bytes:
    obj = header.model_dump(mode="python")
    obj["tensors"] = [[n, list(s)] for n, s in obj["tensors"]]
    return pack_header(obj)


def dense_header_digest(header: DenseHeader) -> bytes:
    """What a dense update's signature covers (its framed header with ``sig`` empty)."""
    return FRAME.digest(_pack(header.model_copy(update={"sig": b""})))


def encode_dense(
    tensors: Sequence[DenseTensor],
    dtype: DenseType,
    spec: ModelSpec,
    *,
    meta: Mapping[str, str | int] | None = None,
    sign: Callable[[bytes], bytes] | None = None,
) -> bytes:
    """Serialise one dense update (every tensor of ``spec``, in its order)."""
    if [t.name for t in tensors] != [t.name for t in spec.tensors]:
        raise ValueError("a dense update must carry every tensor of the spec, in the spec's order")
    for t, ts in zip(tensors, spec.tensors, strict=True):
        if tuple(t.values.shape) != tuple(ts.shape):
            raise ValueError(f"{ts.name}: shape {tuple(t.values.shape)} != spec {ts.shape}")
    payload = b"".join(_payload_part(t.values, dtype) for t in tensors)
    header = DenseHeader(
        codec_version=CODEC_VERSION,
        dtype=dtype,
        spec_digest=spec.digest(),
        tensors=tuple((ts.name, tuple(ts.shape)) for ts in spec.tensors),
        payload_bytes=len(payload),
        digest=payload_digest(payload),
        meta=dict(meta or {}),
    )
    if sign is not None:
        header = header.model_copy(update={"sig": sign(dense_header_digest(header))})
    return FRAME.pack(_pack(header), payload)


def read_dense_header(data: bytes | memoryview, max_bytes: int) -> tuple[DenseHeader, memoryview]:
    """Parse and check the frame and header (no payload decoding). Returns the payload too."""
    raw, payload = FRAME.split(data, max_bytes)
    try:
        obj = unpack_header(raw)
        table = obj.get("tensors")
        if not isinstance(table, tuple) or not all(
            isinstance(row, tuple) and len(row) == 2 for row in table
        ):
            raise ValueError("malformed tensor table")
        header = DenseHeader.model_validate(obj)
    except (ValueError, TypeError, ValidationError) as exc:
        raise DecodeError(f"malformed dense update header: {str(exc)[:300]}") from exc
    if bytes(raw) != _pack(header):
        raise DecodeError("dense update header is not in canonical form")
    if len(payload) != header.payload_bytes:
        raise DecodeError(f"payload is {len(payload)} bytes, header says {header.payload_bytes}")
    return header, payload


def decode_dense(
    data: bytes | memoryview,
    spec: ModelSpec,
    dtype: DenseType,
    max_abs: float,
    max_bytes: int,
) -> DecodedDense:
    """Decode untrusted bytes into one `DenseTensor` per tensor of ``spec`` (`DecodeError` if not
    exactly a well-formed dense update of this spec and value type, with finite values of
    magnitude at most ``max_abs``)."""
    header, payload = read_dense_header(data, max_bytes)
    if header.codec_version != CODEC_VERSION:
        raise DecodeError(f"codec version {header.codec_version}, expected {CODEC_VERSION}")
    if header.dtype != dtype:
        raise DecodeError(f"dense values are {header.dtype}, the run sends {dtype}")
    if header.spec_digest != spec.digest():
        raise DecodeError("update was made for another model spec")
    expected = tuple((t.name, tuple(t.shape)) for t in spec.tensors)
    if header.tensors != expected:
        raise DecodeError("tensor table does not match the model spec")
    if len(payload) != ITEMSIZE[dtype] * spec.numel:
        raise DecodeError(f"payload is {len(payload)} bytes, the spec needs {dtype} values")
    if payload_digest(payload) != header.digest:
        raise DecodeError("dense payload digest mismatch")
    raw = np.frombuffer(payload, dtype="<f4" if dtype == "fp32" else "<u2")
    if dtype == "fp32":
        flat = torch.from_numpy(raw.astype(np.float32))
    else:
        flat = torch.from_numpy((raw.astype(np.uint32) << 16).view(np.float32))
    if not bool(torch.isfinite(flat).all()):
        raise DecodeError("dense update has a non-finite value")
    if flat.numel() and float(flat.abs().max()) > max_abs:
        raise DecodeError(f"a value exceeds the run's cap of {max_abs:g}")
    tensors, pos = [], 0
    for t in spec.tensors:
        tensors.append(DenseTensor(t.name, tuple(t.shape), flat[pos : pos + t.numel].view(t.shape)))
        pos += t.numel
    return DecodedDense(header=header, tensors=tensors)


def _exact_square_sum(x: np.ndarray) -> int:
    """``sum(x**2) * 2**300`` as an exact integer, for float32 ``x`` (any length, any order)."""
    bits = x.view(np.uint32)
    exp = ((bits >> 23) & 0xFF).astype(np.int64)
    mant = (bits & 0x7FFFFF).astype(np.int64) | ((exp > 0).astype(np.int64) << 23)
    exp = np.maximum(exp, 1)  # |x| = mant * 2**(exp - 150), subnormals included
    hi, lo = mant >> 12, mant & 0xFFF
    total = 0
    for part, shift in ((hi * hi, 24), (2 * hi * lo, 12), (lo * lo, 0)):
        sums = np.bincount(exp, weights=part.astype(np.float64), minlength=256)
        for e in np.flatnonzero(sums):
            total += int(sums[e]) << (2 * int(e) + shift)
    return total


def dense_norm(update: Sequence[DenseTensor]) -> float:
    """L2 norm of a dense update, exactly rounded from the exact sum of squares (order-free)."""
    return exact_norm(t.values for t in update)


def exact_norm(tensors: Iterable[torch.Tensor]) -> float:
    """L2 norm of float32 values, from their exact sum of squares (order-free, any machine)."""
    total = 0
    for t in tensors:
        flat = t.detach().to("cpu", torch.float32).contiguous().view(-1).numpy()
        for start in range(0, flat.size, _NORM_BLOCK):
            total += _exact_square_sum(flat[start : start + _NORM_BLOCK])
    return math.sqrt(math.ldexp(float(total), -300)) if total else 0.0


def add_dense(out: torch.Tensor, t: DenseTensor, factor: float = 1.0) -> None:
    """``out += float32(factor) * values``: one rounding for the product and one for the sum per
    position (two separate elementwise operations, never fused), so a fixed order of calls is
    bit-reproducible on any device."""
    if tuple(out.shape) != tuple(t.shape) or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 {t.shape}, got {out.dtype} {tuple(out.shape)}")
    v = t.values.to(out.device, torch.float32)
    if factor != 1.0:
        v = v * torch.tensor(factor, dtype=torch.float32, device=out.device)
    out.add_(v)
