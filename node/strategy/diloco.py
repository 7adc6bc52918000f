"""`diloco`: dense pseudo-gradients (bf16 or float32, ``run.dense.dtype``) on the wire as
`codec.dense` updates, no error feedback, and the outer optimizer of ``run.outer`` (Nesterov
momentum for DiLoCo proper, or SGD: with ``α = 1`` that is dense local SGD, the mean of the
replicas' models).

A run picks it when its peers have the bandwidth: an update is ``2 · params`` bytes in bf16 (the
`tiny` model: 2.6 MB; `1B`: 2.5 GB). Everything else is the same pipeline as SparseLoCo's:
signed, fetched under the deadline, decoded strictly (`codec.dense.decode_dense`), clipped to
the median norm, averaged in uid order, replayed from history.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from codec.chunking import ChunkLayout
from codec.compress import topk_rows
from codec.dense import (
    DenseTensor,
    add_dense,
    decode_dense,
    dense_bytes,
    dense_header_digest,
    dense_norm,
    encode_dense,
    read_dense_header,
    to_wire_precision,
)
from codec.errors import DecodeError
from codec.spec import ModelSpec
from node.strategy.aggregator import Aggregator
from node.strategy.base import Strategy
from node.strategy.encoder import Encoder
from node.strategy.format import Decoded, Factor, Header, Meta, Signer, UpdateFormat, whole
from node.strategy.outer import OuterOptimizer
from protocol.runconfig import RunConfig


class DenseFormat(UpdateFormat):
    """`codec.dense` updates: whole pseudo-gradients in the run's dtype (module docstring)."""

    name = "diloco"
    dense = True

    def max_update_bytes(self) -> int:
        return dense_bytes(self.spec, self.run.dense.dtype)

    def to_bytes(self, update: Sequence[Any], meta: Meta | None, sign: Signer | None) -> bytes:
        return encode_dense(update, self.run.dense.dtype, self.spec, meta=meta, sign=sign)

    def read_header(self, data: bytes | memoryview, max_bytes: int) -> Header:
        return read_dense_header(data, max_bytes)[0]

    def signed_digest(self, header: Any) -> bytes:
        return dense_header_digest(header)

    def decode(self, data: bytes | memoryview, max_bytes: int) -> Decoded:
        run = self.run
        return decode_dense(data, self.spec, run.dense.dtype, run.codec.max_abs_value, max_bytes)

    def validate(self, piece: Any) -> None:
        if not isinstance(piece, DenseTensor):
            raise DecodeError(f"a {self.name} update holds dense tensors, not {type(piece)}")
        v = piece.values
        if v.dtype != torch.float32 or tuple(v.shape) != tuple(piece.shape):
            raise DecodeError(f"{piece.name}: values must be float32 {piece.shape}")
        if not bool(torch.isfinite(v).all()):
            raise DecodeError(f"{piece.name}: non-finite value")
        if v.numel() and float(v.abs().max()) > self.run.codec.max_abs_value:
            raise DecodeError(f"{piece.name}: a value exceeds the run's cap")

    def norm(self, update: Sequence[Any]) -> float:
        return dense_norm(update)

    def add_into(self, out: torch.Tensor, piece: Any, factor: Factor = 1.0) -> None:
        add_dense(out, piece, whole(factor))

    def entries(self, piece: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions SparseLoCo would keep of this update (Top-k of |values| per chunk), with
        their values: sketches of dense updates stay the size of sparse ones."""
        values = piece.values.detach().to("cpu", torch.float32)
        layout = ChunkLayout.for_shape(piece.shape, self.run.codec)
        mags = layout.split(values.abs())
        parts = [
            layout.flat_positions(gi, topk_rows(m.contiguous(), g.k)[0]).reshape(-1)
            for gi, (g, m) in enumerate(zip(layout.groups, mags, strict=True))
        ]
        pos = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        return pos, values.reshape(-1)[pos]


class DenseEncoder(Encoder):
    """The pseudo-gradient itself at wire precision; no local state."""

    def encode(self, deltas: Mapping[str, torch.Tensor], window: int) -> list[Any]:
        dtype, cap = self.run.dense.dtype, self.run.codec.max_abs_value
        out = []
        for n in self.owned_order(deltas):
            d = deltas[n].detach().to(self.device)
            if not bool(torch.isfinite(d).all()):
                raise ValueError(f"{n}: delta has non-finite entries")
            out.append(DenseTensor(n, tuple(d.shape), to_wire_precision(d, dtype, cap)))
        return out


def make_diloco(
    run: RunConfig, spec: ModelSpec, device: torch.device | str, owned: ModelSpec | None
) -> Strategy:
    """DiLoCo's parts: dense updates, their clipped mean, the run's outer step."""
    fmt = DenseFormat(run, spec)
    return Strategy(
        fmt,
        DenseEncoder(run, spec, device, owned),
        Aggregator(fmt, device),
        OuterOptimizer(run, spec, device),
    )
