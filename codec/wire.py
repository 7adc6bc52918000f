"""The wire container: one self-describing, versioned object per update.

    MAGIC "TSRU" | format version (u8) | header length (u32 LE) | header (msgpack) | payload

The header (`WireHeader`) names the codec parameters, the model spec digest, the tensor table
(name, shape, index-stream lengths per chunk group, codebook rows), the section lengths, the
BLAKE2b-256 digest of the payload, and `meta`/`sig` fields that `protocol` fills (run id, window,
uid, hotkey and the hotkey's signature). The signature covers the whole header — and through its
payload digest, the payload — as `header_digest`: BLAKE2b-256 of the framed header with ``sig``
left empty. A reader therefore checks the signature right after parsing the (bounded) header and
before decoding a single payload byte.

The payload is, in order: every chunk group's index stream (`codec.indices`), then one section
of 2-bit value codes (four per byte, zstd-compressed only when that saves at least
`ZSTD_MIN_GAIN`), one section of per-chunk side bytes, and one section of float32 codebooks.
Index streams are already at entropy and side bytes are near-random, so zstd is only tried where
it has something to find.

`decode_update` treats its input as hostile: sizes are checked before any allocation, the header
is parsed with msgpack limits, validated by pydantic (extra fields refused) and must be in the
canonical encoding `encode_update` writes (so the signed header has exactly one byte form), the
tensor table must equal the expected spec exactly, the digest must match, and every section is
decoded strictly — including the value cap: no non-finite codebook entry and no chunk level above
`CodecParams.max_abs_value` (`codec.quantize.validate`). Whatever is wrong surfaces as one
`DecodeError`. Authentication is the caller's: `node.window.exchange.check_update` reads the
header, verifies the signature over `header_digest`, and only then calls `decode_update`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import msgpack
import numpy as np
import torch
import zstandard
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from codec import indices
from codec.chunking import ChunkLayout
from codec.compress import SparseGroup, SparseTensor
from codec.errors import DecodeError
from codec.frame import Frame, pack_header, payload_digest, unpack_header
from codec.quantize import MAX_ROWS
from codec.spec import CODEC_VERSION, CodecParams, ModelSpec

MAGIC = b"TSRU"
FORMAT_VERSION = 2  # 2: the signature covers the header
FRAME = Frame(MAGIC, FORMAT_VERSION, "Tessera update")
DEFAULT_MAX_UPDATE_BYTES = 1 << 32
ZSTD_MIN_GAIN = 0.02

MetaValue = str | int


class TensorEntry(BaseModel):
    """One tensor of the table: its name, shape, index-stream bytes per group, codebook rows."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str = Field(min_length=1, max_length=256)
    shape: tuple[int, ...] = Field(min_length=1, max_length=4)
    index_bytes: tuple[int, ...] = Field(max_length=4)
    codebook_rows: int = Field(ge=1, le=MAX_ROWS)


class WireHeader(BaseModel):
    """Everything needed to check and decode the payload, plus what `protocol` signs."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    codec_version: int
    tile: int
    k: int
    spec_digest: str = Field(max_length=64)
    tensors: tuple[TensorEntry, ...] = Field(max_length=1 << 16)
    codes_bytes: int = Field(ge=0)
    codes_zstd: bool
    payload_bytes: int = Field(ge=0)
    digest: bytes = Field(min_length=32, max_length=32)
    meta: dict[str, MetaValue] = Field(default_factory=dict, max_length=16)
    sig: bytes = Field(default=b"", max_length=128)

    def params(self) -> CodecParams:
        return CodecParams(tile=self.tile, k=self.k)


@dataclass
class DecodedUpdate:
    """A decoded update: its header (meta, signature, digest) and one `SparseTensor` per tensor."""

    header: WireHeader
    tensors: list[SparseTensor]

    @property
    def digest(self) -> bytes:
        """The payload digest (what the values are)."""
        return self.header.digest

    @property
    def signed_digest(self) -> bytes:
        """The digest the sender's signature covers (`header_digest`)."""
        return header_digest(self.header)


def _pack_codes(codes: torch.Tensor) -> bytes:
    flat = codes.reshape(-1).to("cpu", torch.uint8).numpy()
    pad = (-flat.size) % 4
    if pad:
        flat = np.concatenate([flat, np.zeros(pad, np.uint8)])
    q = flat.reshape(-1, 4)
    return (q[:, 0] | (q[:, 1] << 2) | (q[:, 2] << 4) | (q[:, 3] << 6)).astype(np.uint8).tobytes()


def _unpack_codes(data: bytes, count: int) -> torch.Tensor:
    b = np.frombuffer(data, dtype=np.uint8)
    q = np.stack([b & 3, (b >> 2) & 3, (b >> 4) & 3, b >> 6], axis=1).reshape(-1)
    if (q[count:] != 0).any():
        raise DecodeError("non-zero padding after the value codes")
    return torch.from_numpy(q[:count].copy())


def encode_update(
    tensors: Sequence[SparseTensor],
    params: CodecParams,
    spec: ModelSpec,
    *,
    meta: Mapping[str, MetaValue] | None = None,
    sign: Callable[[bytes], bytes] | None = None,
) -> bytes:
    """Serialise one update (all tensors of `spec`, in its order).

    `sign`, if given, receives `header_digest` of the finished header and returns the signature
    stored in it.
    """
    by_name = {t.name: t for t in tensors}
    if [t.name for t in spec.tensors] != [t.name for t in tensors]:
        raise ValueError("an update must carry every tensor of the spec, in the spec's order")
    entries, idx_parts, codes, scales, books = [], [], [], [], []
    for ts in spec.tensors:
        sparse = by_name[ts.name]
        if tuple(sparse.shape) != tuple(ts.shape):
            raise ValueError(f"{ts.name}: shape {sparse.shape} != spec {ts.shape}")
        layout = ChunkLayout.for_shape(ts.shape, params)
        streams = [
            indices.encode(g.idx, lg.chunk_size)
            for g, lg in zip(sparse.groups, layout.groups, strict=True)
        ]
        idx_parts += streams
        codes += [g.codes.reshape(-1) for g in sparse.groups]
        scales += [g.scales.reshape(-1) for g in sparse.groups]
        books.append(sparse.codebook.to(torch.float32).contiguous())
        entries.append(
            TensorEntry(
                name=ts.name,
                shape=tuple(ts.shape),
                index_bytes=tuple(len(s) for s in streams),
                codebook_rows=int(sparse.codebook.shape[0]),
            )
        )
    packed = _pack_codes(torch.cat(codes)) if codes else b""
    squeezed = zstandard.ZstdCompressor(level=3).compress(packed) if packed else b""
    use_zstd = len(squeezed) < (1 - ZSTD_MIN_GAIN) * len(packed)
    codes_section = squeezed if use_zstd else packed
    scales_section = torch.cat(scales).to("cpu", torch.uint8).numpy().tobytes() if scales else b""
    books_section = b"".join(b.cpu().numpy().astype("<f4").tobytes() for b in books)
    payload = b"".join([*idx_parts, codes_section, scales_section, books_section])
    digest = payload_digest(payload)
    header = WireHeader(
        codec_version=CODEC_VERSION,
        tile=params.tile,
        k=params.k,
        spec_digest=spec.digest(),
        tensors=tuple(entries),
        codes_bytes=len(codes_section),
        codes_zstd=use_zstd,
        payload_bytes=len(payload),
        digest=digest,
        meta=dict(meta or {}),
    )
    if sign is not None:
        header = header.model_copy(update={"sig": sign(header_digest(header))})
    return _frame(header, payload)


_ENTRY_FIELDS = tuple(TensorEntry.model_fields)


def _pack_header(header: WireHeader) -> bytes:
    obj = header.model_dump(mode="python")
    obj["tensors"] = [[e[f] for f in _ENTRY_FIELDS] for e in obj["tensors"]]  # positional: compact
    return pack_header(obj)


def header_digest(header: WireHeader) -> bytes:
    """What an update's signature covers: BLAKE2b-256 of its framed header with ``sig`` empty."""
    return FRAME.digest(_pack_header(header.model_copy(update={"sig": b""})))


def _frame(header: WireHeader, payload: bytes | memoryview) -> bytes:
    return FRAME.pack(_pack_header(header), payload)


def with_signature(data: bytes, sig: bytes, meta: Mapping[str, MetaValue] | None = None) -> bytes:
    """The same update with its signature (and optionally meta) replaced; payload untouched."""
    header, payload = read_header(data, max_bytes=len(data))
    changes: dict[str, object] = {"sig": sig}
    if meta is not None:
        changes["meta"] = dict(meta)
    return _frame(WireHeader.model_validate({**header.model_dump(), **changes}), payload)


def read_header(
    data: bytes | memoryview, max_bytes: int = DEFAULT_MAX_UPDATE_BYTES
) -> tuple[WireHeader, memoryview]:
    """Parse and check the frame and header (cheap; no payload decoding). Returns the payload."""
    raw, payload = FRAME.split(data, max_bytes)
    header = _parse_header(raw)
    if len(payload) != header.payload_bytes:
        raise DecodeError(f"payload is {len(payload)} bytes, header says {header.payload_bytes}")
    return header, payload


def _parse_header(raw: memoryview) -> WireHeader:
    """The header from its msgpack bytes: bounded parse, strict validation, canonical form only."""
    try:
        obj = unpack_header(raw)
        if not isinstance(obj.get("tensors"), tuple):
            raise ValueError("header is not a map with a tensor table")
        table = obj["tensors"]
        if not all(isinstance(t, tuple) and len(t) == len(_ENTRY_FIELDS) for t in table):
            raise ValueError("malformed tensor table row")
        obj["tensors"] = tuple(dict(zip(_ENTRY_FIELDS, t, strict=True)) for t in table)
        header = WireHeader.model_validate(obj)
    except (ValueError, TypeError, msgpack.ExtraData, ValidationError) as exc:
        raise DecodeError(f"malformed update header: {str(exc)[:300]}") from exc
    if bytes(raw) != _pack_header(header):  # one byte form per header: what was signed is sent
        raise DecodeError("update header is not in canonical form")
    return header


def decode_update(
    data: bytes | memoryview,
    expected_spec: ModelSpec,
    expected_params: CodecParams,
    max_bytes: int = DEFAULT_MAX_UPDATE_BYTES,
) -> DecodedUpdate:
    """Decode untrusted bytes into one `SparseTensor` per tensor of `expected_spec`.

    Raises `DecodeError` for anything malformed, oversized or not made for this spec and codec.
    """
    header, payload = read_header(data, max_bytes)
    _check_against(header, expected_spec, expected_params)
    if payload_digest(payload) != header.digest:
        raise DecodeError("payload digest mismatch")
    layouts = [ChunkLayout.for_shape(t.shape, expected_params) for t in expected_spec.tensors]
    n_values = sum(g.n_chunks * g.k for lay in layouts for g in lay.groups)
    n_chunks = sum(g.n_chunks for lay in layouts for g in lay.groups)
    n_rows = sum(e.codebook_rows for e in header.tensors)
    idx_total = sum(sum(e.index_bytes) for e in header.tensors)
    expected = idx_total + header.codes_bytes + n_chunks + 8 * n_rows
    if expected != len(payload):
        raise DecodeError(f"section lengths add up to {expected}, payload has {len(payload)}")
    pos = idx_total
    codes_raw = bytes(payload[pos : pos + header.codes_bytes])
    pos += header.codes_bytes
    packed_len = (n_values + 3) // 4
    if header.codes_zstd:
        codes_raw = _unzstd(codes_raw, packed_len)
    if len(codes_raw) != packed_len:
        raise DecodeError(f"value codes are {len(codes_raw)} bytes, expected {packed_len}")
    codes = _unpack_codes(codes_raw, n_values)
    scales = torch.frombuffer(bytearray(payload[pos : pos + n_chunks]), dtype=torch.uint8)
    pos += n_chunks
    books = np.frombuffer(bytes(payload[pos:]), dtype="<f4").astype(np.float32)
    tensors = _assemble(header, payload, layouts, codes, scales, books)
    for t in tensors:
        t.validate(expected_params)
    return DecodedUpdate(header=header, tensors=tensors)


def _check_against(header: WireHeader, spec: ModelSpec, params: CodecParams) -> None:
    if header.codec_version != CODEC_VERSION:
        raise DecodeError(f"codec version {header.codec_version}, expected {CODEC_VERSION}")
    if (header.tile, header.k) != (params.tile, params.k):
        raise DecodeError(
            f"codec (tile={header.tile}, k={header.k}) != expected (tile={params.tile}, k={params.k})"
        )
    if header.spec_digest != spec.digest():
        raise DecodeError("update was made for another model spec")
    if len(header.tensors) != len(spec.tensors):
        raise DecodeError(f"{len(header.tensors)} tensors, spec has {len(spec.tensors)}")
    for entry, ts in zip(header.tensors, spec.tensors, strict=True):
        if entry.name != ts.name or tuple(entry.shape) != tuple(ts.shape):
            raise DecodeError(f"tensor {entry.name!r} {entry.shape} != spec {ts.name!r} {ts.shape}")
        n_groups = len(ChunkLayout.for_shape(ts.shape, params).groups)
        if len(entry.index_bytes) != n_groups:
            raise DecodeError(
                f"{ts.name}: {len(entry.index_bytes)} index streams, expected {n_groups}"
            )


def _unzstd(data: bytes, expected: int) -> bytes:
    try:
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=expected)
    except zstandard.ZstdError as exc:
        raise DecodeError(f"value codes do not decompress: {exc}") from exc
    return out


def _assemble(
    header: WireHeader,
    payload: memoryview,
    layouts: list[ChunkLayout],
    codes: torch.Tensor,
    scales: torch.Tensor,
    books: np.ndarray,
) -> list[SparseTensor]:
    tensors: list[SparseTensor] = []
    pos = vpos = cpos = bpos = 0
    for entry, layout in zip(header.tensors, layouts, strict=True):
        groups: list[SparseGroup] = []
        for size, g in zip(entry.index_bytes, layout.groups, strict=True):
            try:
                idx = indices.decode(
                    payload[pos : pos + size], expect=(g.chunk_size, g.k, g.n_chunks)
                )
            except DecodeError as exc:
                raise DecodeError(f"{entry.name}: {exc}") from exc
            pos += size
            n = g.n_chunks * g.k
            groups.append(
                SparseGroup(
                    idx=idx,
                    codes=codes[vpos : vpos + n].reshape(g.n_chunks, g.k),
                    scales=scales[cpos : cpos + g.n_chunks],
                )
            )
            vpos += n
            cpos += g.n_chunks
        rows = entry.codebook_rows
        book = torch.from_numpy(books[bpos : bpos + 2 * rows].reshape(rows, 2).copy())
        bpos += 2 * rows
        tensors.append(
            SparseTensor(name=entry.name, shape=tuple(entry.shape), groups=groups, codebook=book)
        )
    return tensors
