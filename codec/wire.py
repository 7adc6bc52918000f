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
of value codes (2-bit codes four per byte, or 1-bit signs eight per byte when
``CodecParams.value_bits`` is 1; zstd-compressed only when that saves at least `ZSTD_MIN_GAIN`),
one section of per-chunk side bytes, and one section of float32 codebooks. Index streams are
already at entropy and side bytes are near-random, so zstd is only tried where it has something
to find.

Three containers share this layout (`WireFormat`), each with its own magic: ``TSRU`` (SparseLoCo:
values at the indexed positions), ``TSRC`` (DeMo: the same, over per-chunk DCT coefficients,
`codec.dct`) and ``TSRM`` (`sparseloco-mask`: each chunk's codes start with ``s_g`` index-free
values on the window's shared support, `codec.masked`). The header fields ``value_bits``,
``shared_k`` and ``support_digest`` are written only when they differ from their defaults (2,
0, empty), so a 2-bit ``TSRU`` header is byte for byte what it always was.

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

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

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
from codec.masked import MaskedTensor, shared_counts
from codec.quantize import MAX_ROWS
from codec.spec import CODEC_VERSION, CodecParams, ModelSpec

MAGIC = b"TSRU"
FORMAT_VERSION = 2  # 2: the signature covers the header
FRAME = Frame(MAGIC, FORMAT_VERSION, "Tessera update")
DEFAULT_MAX_UPDATE_BYTES = 1 << 32
ZSTD_MIN_GAIN = 0.02

MetaValue = str | int
Piece = SparseTensor | MaskedTensor


@dataclass(frozen=True)
class WireFormat:
    """One sparse container: its frame, and whether chunks start with shared values."""

    frame: Frame
    masked: bool = False


SPARSE = WireFormat(FRAME)
DCT = WireFormat(Frame(b"TSRC", 1, "Tessera DCT update"))
MASKED = WireFormat(Frame(b"TSRM", 1, "Tessera masked update"), masked=True)
_OPTIONAL = {"value_bits": 2, "shared_k": 0, "support_digest": b""}


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
    value_bits: int = Field(2, ge=1, le=2)
    shared_k: int = Field(0, ge=0, le=1 << 20)
    support_digest: bytes = Field(b"", max_length=32)

    def params(self) -> CodecParams:
        return CodecParams(tile=self.tile, k=self.k, value_bits=self.value_bits)


@dataclass
class DecodedUpdate:
    """A decoded update: its header (meta, signature, digest) and one `SparseTensor` per tensor."""

    header: WireHeader
    tensors: list[Piece]
    frame: Frame = FRAME

    @property
    def digest(self) -> bytes:
        """The payload digest (what the values are)."""
        return self.header.digest

    @property
    def signed_digest(self) -> bytes:
        """The digest the sender's signature covers (`header_digest`)."""
        return header_digest(self.header, self.frame)


def _pack_codes(codes: torch.Tensor, bits: int) -> bytes:
    """``bits``-bit codes packed little-end first, ``8 // bits`` per byte, zero-padded."""
    per = 8 // bits
    flat = codes.reshape(-1).to("cpu", torch.uint8).numpy()
    pad = (-flat.size) % per
    if pad:
        flat = np.concatenate([flat, np.zeros(pad, np.uint8)])
    q = flat.reshape(-1, per).astype(np.uint8)
    out = np.zeros(q.shape[0], np.uint8)
    for j in range(per):
        out |= q[:, j] << np.uint8(bits * j)
    return out.tobytes()


class _Codes:
    """The packed value codes of an update (``count`` codes of ``bits`` bits, low bits first),
    unpacked a range at a time on ``device``: a worker that decodes a share of the tensors
    unpacks only theirs. The padding after the last code is checked at once (it must be zero)."""

    def __init__(self, data: bytes, count: int, bits: int, device: torch.device) -> None:
        packed = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.bits, self.per_byte = bits, 8 // bits
        used = count % self.per_byte
        if used and packed.numel() and int(packed[-1]) >> (bits * used):
            raise DecodeError("non-zero padding after the value codes")
        self.packed = packed.to(device)

    def take(self, start: int, n: int) -> torch.Tensor:
        """Codes ``start`` to ``start + n`` (uint8)."""
        first, last = start // self.per_byte, -(-(start + n) // self.per_byte)
        b = self.packed[first:last]
        mask = (1 << self.bits) - 1
        q = torch.stack([(b >> (self.bits * j)) & mask for j in range(self.per_byte)], 1)
        at = start - first * self.per_byte
        return q.reshape(-1)[at : at + n].contiguous()


def encode_update(
    tensors: Sequence[Piece],
    params: CodecParams,
    spec: ModelSpec,
    *,
    meta: Mapping[str, MetaValue] | None = None,
    sign: Callable[[bytes], bytes] | None = None,
    fmt: WireFormat = SPARSE,
    shared_k: int = 0,
) -> bytes:
    """Serialise one update (all tensors of `spec`, in its order) in container ``fmt``.

    ``shared_k``: shared values per full chunk (``MASKED`` only; its pieces are `MaskedTensor`s
    made for one support, whose digest the header names). `sign`, if given, receives
    `header_digest` of the finished header and returns the signature stored in it.
    """
    by_name = {t.name: t for t in tensors}
    if [t.name for t in spec.tensors] != [t.name for t in tensors]:
        raise ValueError("an update must carry every tensor of the spec, in the spec's order")
    if {isinstance(t, MaskedTensor) for t in tensors} - {fmt.masked} or (
        not fmt.masked and shared_k
    ):
        raise ValueError(f"{fmt.frame.name}: wrong kind of pieces for this container")
    digests = {t.digest for t in tensors if isinstance(t, MaskedTensor)}
    if len(digests) > 1:
        raise ValueError("every piece of a masked update must be made for the same support")
    entries, idx_parts, codes, scales, books = [], [], [], [], []
    for ts in spec.tensors:
        sparse = by_name[ts.name]
        if tuple(sparse.shape) != tuple(ts.shape):
            raise ValueError(f"{ts.name}: shape {sparse.shape} != spec {ts.shape}")
        layout = ChunkLayout.for_shape(ts.shape, params)
        if isinstance(sparse, MaskedTensor) and sparse.shared != tuple(
            shared_counts(layout, params, shared_k)
        ):
            raise ValueError(f"{ts.name}: shared values per chunk do not match shared_k")
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
    packed = _pack_codes(torch.cat(codes), params.value_bits) if codes else b""
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
        value_bits=params.value_bits,
        shared_k=shared_k,
        support_digest=next(iter(digests), b""),
    )
    if sign is not None:
        header = header.model_copy(update={"sig": sign(header_digest(header, fmt.frame))})
    return _frame(header, payload, fmt.frame)


_ENTRY_FIELDS = tuple(TensorEntry.model_fields)


def _pack_header(header: WireHeader) -> bytes:
    obj = header.model_dump(mode="python")
    obj["tensors"] = [[e[f] for f in _ENTRY_FIELDS] for e in obj["tensors"]]  # positional: compact
    for name, default in _OPTIONAL.items():  # absent at their defaults (see module docstring)
        if obj[name] == default:
            del obj[name]
    return pack_header(obj)


def header_digest(header: WireHeader, frame: Frame = FRAME) -> bytes:
    """What an update's signature covers: BLAKE2b-256 of its framed header with ``sig`` empty."""
    return frame.digest(_pack_header(header.model_copy(update={"sig": b""})))


def _frame(header: WireHeader, payload: bytes | memoryview, frame: Frame = FRAME) -> bytes:
    return frame.pack(_pack_header(header), payload)


def with_signature(
    data: bytes,
    sig: bytes,
    meta: Mapping[str, MetaValue] | None = None,
    frame: Frame = FRAME,
) -> bytes:
    """The same update with its signature (and optionally meta) replaced; payload untouched."""
    header, payload = read_header(data, max_bytes=len(data), frame=frame)
    changes: dict[str, object] = {"sig": sig}
    if meta is not None:
        changes["meta"] = dict(meta)
    return _frame(WireHeader.model_validate({**header.model_dump(), **changes}), payload, frame)


def read_header(
    data: bytes | memoryview,
    max_bytes: int = DEFAULT_MAX_UPDATE_BYTES,
    frame: Frame = FRAME,
    max_tensors: int | None = None,
) -> tuple[WireHeader, memoryview]:
    """Parse and check the frame and header (cheap; no payload decoding). Returns the payload.

    ``max_tensors`` (the model's tensor count, when the caller knows it) refuses a longer tensor
    table before any of its rows is checked: a table of tens of thousands of rows costs nothing."""
    raw, payload = frame.split(data, max_bytes)
    header = _parse_header(raw, max_tensors)
    if len(payload) != header.payload_bytes:
        raise DecodeError(f"payload is {len(payload)} bytes, header says {header.payload_bytes}")
    return header, payload


def _parse_header(raw: memoryview, max_tensors: int | None = None) -> WireHeader:
    """The header from its msgpack bytes: bounded parse, strict validation, canonical form only."""
    try:
        obj = unpack_header(raw)
        if not isinstance(obj.get("tensors"), tuple):
            raise ValueError("header is not a map with a tensor table")
        table = obj["tensors"]
        if max_tensors is not None and len(table) > max_tensors:
            raise ValueError(f"{len(table)} tensor rows, the model has {max_tensors}")
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
    fmt: WireFormat = SPARSE,
    shared_k: int = 0,
    only: Collection[str] | None = None,
    check_digest: bool = True,
    device: torch.device | str | None = None,
    triton: bool | None = None,
) -> DecodedUpdate:
    """Decode untrusted bytes in container ``fmt`` into one piece per tensor of `expected_spec`
    (`SparseTensor`, or `MaskedTensor` for ``MASKED`` with ``shared_k`` shared values per full
    chunk). Raises `DecodeError` for anything malformed, oversized or not made for this spec,
    codec and container. A masked update's support is checked later, by whoever holds it.
    With ``only``, just the named tensors are decoded and returned (the header, digest and
    section lengths are checked all the same): workers that own a share of the tensors each
    decode their share (`codec.pool`). ``check_digest=False`` leaves out the payload digest, for
    a worker whose pool has another worker check it on the same bytes.

    The pieces are made on ``device`` (default: the CPU). On a CUDA device the whole decode runs
    there (`codec.indices.decode`: the index streams' walk and rANS steps; the value codes
    unpacked by torch ops), and so do the checks; ``triton`` is passed on to the index decoder.
    """
    on = torch.device(device or "cpu")
    header, payload = read_header(data, max_bytes, fmt.frame, len(expected_spec.tensors))
    _check_against(header, expected_spec, expected_params)
    if header.shared_k != (shared_k if fmt.masked else 0):
        raise DecodeError(f"{header.shared_k} shared values per chunk, the run sends {shared_k}")
    if fmt.masked != bool(header.support_digest) or len(header.support_digest) not in (0, 32):
        raise DecodeError("support digest missing, misplaced or malformed")
    if check_digest and payload_digest(payload) != header.digest:
        raise DecodeError("payload digest mismatch")
    layouts = [ChunkLayout.for_shape(t.shape, expected_params) for t in expected_spec.tensors]
    shared = [shared_counts(lay, expected_params, header.shared_k) for lay in layouts]
    n_values = sum(
        g.n_chunks * (g.k + s)
        for lay, sh in zip(layouts, shared, strict=True)
        for g, s in zip(lay.groups, sh, strict=True)
    )
    n_chunks = sum(g.n_chunks for lay in layouts for g in lay.groups)
    n_rows = sum(e.codebook_rows for e in header.tensors)
    idx_total = sum(sum(e.index_bytes) for e in header.tensors)
    expected = idx_total + header.codes_bytes + n_chunks + 8 * n_rows
    if expected != len(payload):
        raise DecodeError(f"section lengths add up to {expected}, payload has {len(payload)}")
    pos = idx_total
    codes_raw = bytes(payload[pos : pos + header.codes_bytes])
    pos += header.codes_bytes
    per_byte = 8 // header.value_bits
    packed_len = (n_values + per_byte - 1) // per_byte
    if header.codes_zstd:
        codes_raw = _unzstd(codes_raw, packed_len)
    if len(codes_raw) != packed_len:
        raise DecodeError(f"value codes are {len(codes_raw)} bytes, expected {packed_len}")
    codes = _Codes(codes_raw, n_values, header.value_bits, on)
    scales = torch.frombuffer(bytearray(payload[pos : pos + n_chunks]), dtype=torch.uint8).to(on)
    pos += n_chunks
    books = np.frombuffer(bytes(payload[pos:]), dtype="<f4").astype(np.float32)
    index = partial(indices.decode, device=on, triton=triton)
    tensors = _assemble(header, payload, layouts, shared, codes, scales, books, index, only)
    for t in tensors:
        t.validate(expected_params)
    return DecodedUpdate(header=header, tensors=tensors, frame=fmt.frame)


def _check_against(header: WireHeader, spec: ModelSpec, params: CodecParams) -> None:
    if header.codec_version != CODEC_VERSION:
        raise DecodeError(f"codec version {header.codec_version}, expected {CODEC_VERSION}")
    if (header.tile, header.k) != (params.tile, params.k):
        raise DecodeError(
            f"codec (tile={header.tile}, k={header.k}) != expected (tile={params.tile}, k={params.k})"
        )
    if header.value_bits != params.value_bits:
        raise DecodeError(f"{header.value_bits}-bit values, the run sends {params.value_bits}")
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
    shared: list[list[int]],
    codes: _Codes,
    scales: torch.Tensor,
    books: np.ndarray,
    index: Callable[..., torch.Tensor],
    only: Collection[str] | None = None,
) -> list[Piece]:
    tensors: list[Piece] = []
    pos = vpos = cpos = bpos = 0
    for entry, layout, sh in zip(header.tensors, layouts, shared, strict=True):
        if only is not None and entry.name not in only:
            pos += sum(entry.index_bytes)
            vpos += sum(g.n_chunks * (g.k + s) for g, s in zip(layout.groups, sh, strict=True))
            cpos += sum(g.n_chunks for g in layout.groups)
            bpos += 2 * entry.codebook_rows
            continue
        groups: list[SparseGroup] = []
        for size, g, s in zip(entry.index_bytes, layout.groups, sh, strict=True):
            try:
                idx = index(payload[pos : pos + size], expect=(g.chunk_size, g.k, g.n_chunks))
            except DecodeError as exc:
                raise DecodeError(f"{entry.name}: {exc}") from exc
            pos += size
            n = g.n_chunks * (g.k + s)
            groups.append(
                SparseGroup(
                    idx=idx,
                    codes=codes.take(vpos, n).reshape(g.n_chunks, g.k + s),
                    scales=scales[cpos : cpos + g.n_chunks],
                )
            )
            vpos += n
            cpos += g.n_chunks
        rows = entry.codebook_rows
        book = torch.from_numpy(books[bpos : bpos + 2 * rows].reshape(rows, 2).copy()).to(
            scales.device
        )
        bpos += 2 * rows
        name, shape = entry.name, tuple(entry.shape)
        if header.support_digest:
            tensors.append(
                MaskedTensor(name, shape, groups, book, tuple(sh), header.support_digest)
            )
        else:
            tensors.append(SparseTensor(name=name, shape=shape, groups=groups, codebook=book))
    return tensors
