"""GreedyLore updates on the wire: projected matrices beside a SparseLoCo part.

    MAGIC "TSRL" | format version (u8) | header length (u32 LE) | header (msgpack) | payload

The payload is two complete, unsigned containers back to back: the *sparse part*, a `codec.wire`
``TSRU`` update of the tensors that are not projected (1-D tensors and embeddings, the
`node.strategy.greedylore` fallback), then the *dense part*, a `codec.dense` ``TSRD`` update of
the projected matrices' values. Each matrix is seen in its working orientation ``(m, n)`` with
``m <= n`` (`working_shape`: a taller matrix is sent transposed), and the dense part holds:

* a *projected* round (``full`` false): ``<name>#R`` of shape ``(rank, n)``, the matrix in the
  window's shared rank-``rank`` basis, and ``<name>#L`` of shape ``(m,)``, the sketch from which
  the next window's basis columns are chosen;
* a *full* round (``full`` true): ``<name>`` of shape ``(m, n)``, the whole matrix.

The header (`LowRankHeader`) names the codec version, the model spec digest, the round kind, the
rank, both parts' lengths, the BLAKE2b-256 digest of the payload, and ``meta``/``sig``; the
signature covers the framed header with ``sig`` empty (`lowrank_header_digest`), hence the
payload through its digest. `decode_lowrank` is strict like the containers it nests: sizes and
the digest before anything else, a bounded canonical header, then each part by its own strict
decoder against the exact spec it must have (and no meta or signature inside either part).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from codec import dense, wire
from codec.compress import SparseTensor
from codec.errors import DecodeError
from codec.frame import Frame, pack_header, payload_digest, unpack_header
from codec.spec import CODEC_VERSION, CodecParams, ModelSpec

__all__ = [
    "FRAME",
    "DecodedLowRank",
    "LowRankHeader",
    "Projected",
    "decode_lowrank",
    "encode_lowrank",
    "lowrank_header_digest",
    "read_lowrank_header",
    "working_shape",
]

FRAME = Frame(b"TSRL", 1, "Tessera low-rank update")
Meta = Mapping[str, str | int]


def working_shape(shape: Sequence[int]) -> tuple[int, int, bool]:
    """(m, n, transposed): a tensor as a matrix ``rows x rest`` with ``m <= n``."""
    rows, cols = int(shape[0]), math.prod(int(d) for d in shape[1:])
    return (rows, cols, False) if rows <= cols else (cols, rows, True)


@dataclass
class Projected:
    """One projected matrix's part of an update, float32 at wire precision, working orientation.

    ``values``: (rank, n) in the window's basis, or (m, n) the whole matrix when ``full``;
    ``sketch``: (m,) for the next window's selection (empty when ``full``)."""

    name: str
    shape: tuple[int, ...]
    full: bool
    values: torch.Tensor
    sketch: torch.Tensor


class LowRankHeader(BaseModel):
    """Everything needed to check and decode a low-rank payload, plus what `protocol` signs."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    codec_version: int
    spec_digest: str = Field(max_length=64)
    full: bool
    rank: int = Field(ge=1, le=1 << 16)
    sparse_bytes: int = Field(ge=0)
    dense_bytes: int = Field(ge=0)
    digest: bytes = Field(min_length=32, max_length=32)
    meta: dict[str, str | int] = Field(default_factory=dict, max_length=16)
    sig: bytes = Field(default=b"", max_length=128)


@dataclass
class DecodedLowRank:
    """A decoded update: its header and one piece per tensor of the spec (spec order)."""

    header: LowRankHeader
    tensors: list[Projected | SparseTensor]

    @property
    def digest(self) -> bytes:
        return self.header.digest

    @property
    def signed_digest(self) -> bytes:
        return lowrank_header_digest(self.header)


def _parts_spec(matrices: ModelSpec, rank: int, full: bool) -> ModelSpec:
    shapes: dict[str, tuple[int, ...]] = {}
    for t in matrices.tensors:
        m, n, _ = working_shape(t.shape)
        if full:
            shapes[t.name] = (m, n)
        else:
            shapes[t.name + "#R"] = (min(rank, m), n)
            shapes[t.name + "#L"] = (m,)
    return ModelSpec.from_shapes(shapes)


def _split(spec: ModelSpec, matrices: set[str]) -> tuple[ModelSpec, ModelSpec]:
    pick = lambda keep: ModelSpec(tensors=tuple(t for t in spec.tensors if keep(t.name)))  # noqa: E731
    return pick(lambda n: n in matrices), pick(lambda n: n not in matrices)


def _pack(header: LowRankHeader) -> bytes:
    return pack_header(header.model_dump(mode="python"))


def lowrank_header_digest(header: LowRankHeader) -> bytes:
    """What a low-rank update's signature covers (its framed header with ``sig`` empty)."""
    return FRAME.digest(_pack(header.model_copy(update={"sig": b""})))


def encode_lowrank(
    update: Sequence[Projected | SparseTensor],
    spec: ModelSpec,
    params: CodecParams,
    dtype: dense.DenseType,
    rank: int,
    *,
    meta: Meta | None = None,
    sign: Callable[[bytes], bytes] | None = None,
) -> bytes:
    """Serialise one update: every tensor of ``spec`` in its order, a `Projected` piece for each
    projected matrix (all of one round kind) and a `SparseTensor` for every other tensor."""
    if [p.name for p in update] != [t.name for t in spec.tensors]:
        raise ValueError("an update must carry every tensor of the spec, in the spec's order")
    projected = [p for p in update if isinstance(p, Projected)]
    kinds = {p.full for p in projected}
    if len(kinds) > 1:
        raise ValueError("every projected matrix of an update must be of one round kind")
    full = kinds.pop() if kinds else False
    matrices, rest = _split(spec, {p.name for p in projected})
    sparse = [p for p in update if not isinstance(p, Projected)]
    sparse_part = wire.encode_update(sparse, params, rest) if rest.tensors else b""
    values = []
    for p in projected:
        values.append(
            dense.DenseTensor(p.name + ("" if full else "#R"), tuple(p.values.shape), p.values)
        )
        if not full:
            values.append(dense.DenseTensor(p.name + "#L", tuple(p.sketch.shape), p.sketch))
    parts = _parts_spec(matrices, rank, full)
    dense_part = dense.encode_dense(values, dtype, parts) if parts.tensors else b""
    payload = sparse_part + dense_part
    header = LowRankHeader(
        codec_version=CODEC_VERSION, spec_digest=spec.digest(), full=full, rank=rank,
        sparse_bytes=len(sparse_part), dense_bytes=len(dense_part),
        digest=payload_digest(payload), meta=dict(meta or {}),
    )  # fmt: skip
    if sign is not None:
        header = header.model_copy(update={"sig": sign(lowrank_header_digest(header))})
    return FRAME.pack(_pack(header), payload)


def read_lowrank_header(
    data: bytes | memoryview, max_bytes: int
) -> tuple[LowRankHeader, memoryview]:
    """Parse and check the frame and header (no payload decoding). Returns the payload too."""
    raw, payload = FRAME.split(data, max_bytes)
    try:
        header = LowRankHeader.model_validate(unpack_header(raw))
    except (ValueError, TypeError, ValidationError) as exc:
        raise DecodeError(f"malformed low-rank update header: {str(exc)[:300]}") from exc
    if bytes(raw) != _pack(header):
        raise DecodeError("low-rank update header is not in canonical form")
    if len(payload) != header.sparse_bytes + header.dense_bytes:
        raise DecodeError(f"payload is {len(payload)} bytes, the header's parts disagree")
    return header, payload


def decode_lowrank(
    data: bytes | memoryview,
    spec: ModelSpec,
    matrices: set[str],
    params: CodecParams,
    dtype: dense.DenseType,
    rank: int,
    max_bytes: int,
) -> DecodedLowRank:
    """Decode untrusted bytes into one piece per tensor of ``spec`` (``matrices``: the names sent
    projected); `DecodeError` unless exactly a well-formed update of this spec and run."""
    header, payload = read_lowrank_header(data, max_bytes)
    if header.codec_version != CODEC_VERSION:
        raise DecodeError(f"codec version {header.codec_version}, expected {CODEC_VERSION}")
    if header.spec_digest != spec.digest():
        raise DecodeError("update was made for another model spec")
    if header.rank != rank:
        raise DecodeError(f"rank {header.rank}, the run sends rank {rank}")
    if payload_digest(payload) != header.digest:
        raise DecodeError("low-rank payload digest mismatch")
    mats, rest = _split(spec, matrices)
    sparse_raw, dense_raw = payload[: header.sparse_bytes], payload[header.sparse_bytes :]
    pieces: dict[str, Projected | SparseTensor] = {}
    if rest.tensors or sparse_raw:
        sub = wire.decode_update(sparse_raw, rest, params, len(sparse_raw))
        _no_meta(sub.header.meta, sub.header.sig)
        # the SPARSE container (the default `fmt`) decodes SparseTensors only
        pieces.update({p.name: cast(SparseTensor, p) for p in sub.tensors})
    parts = _parts_spec(mats, rank, header.full)
    if parts.tensors or dense_raw:
        sub_d = dense.decode_dense(dense_raw, parts, dtype, params.max_abs_value, len(dense_raw))
        _no_meta(sub_d.header.meta, sub_d.header.sig)
        got = {t.name: t.values for t in sub_d.tensors}
        for t in mats.tensors:
            full = header.full
            values = got[t.name] if full else got[t.name + "#R"]
            sketch = torch.zeros(0) if full else got[t.name + "#L"]
            pieces[t.name] = Projected(t.name, tuple(t.shape), full, values, sketch)
    return DecodedLowRank(header, [pieces[t.name] for t in spec.tensors])


def _no_meta(meta: Mapping[str, object], sig: bytes) -> None:
    if meta or sig:
        raise DecodeError("a part of a low-rank update carries its own meta or signature")
