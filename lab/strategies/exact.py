"""SparseLoCo with float32 values: the same error feedback and chunked Top-k, no quantisation.

A bench-only ablation (`tessera bench train`, ``sparseloco:values=fp32``): it isolates what the
2-bit values cost, and with ``k = C`` and ``β = 0`` it is dense local SGD exactly (the
equivalence test). It has no wire format: the bench counts its bytes as the real index coder's
streams plus 4 bytes per value (`wire_bytes`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from codec import indices
from codec.chunking import ChunkLayout
from codec.compress import topk_rows
from codec.dense import exact_norm
from codec.errors import DecodeError
from codec.spec import CodecParams, ModelSpec
from node.strategy.aggregator import Aggregator
from node.strategy.base import Strategy
from node.strategy.format import Decoded, Factor, Header, Meta, Signer
from node.strategy.outer import OuterOptimizer
from node.strategy.sparseloco import SparseEncoder, SparseFormat
from protocol.runconfig import RunConfig


@dataclass
class ExactSparse:
    """One tensor's Top-k entries with their float32 values, per chunk group of its layout."""

    name: str
    shape: tuple[int, ...]
    idx: list[torch.Tensor]  # (n_chunks, k_g) int64, ascending per row
    values: list[torch.Tensor]  # (n_chunks, k_g) float32

    def flat(self, params: CodecParams) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat positions, values) of every entry."""
        layout = ChunkLayout.for_shape(self.shape, params)
        pos = [layout.flat_positions(gi, i).reshape(-1) for gi, i in enumerate(self.idx)]
        return torch.cat(pos), torch.cat([v.reshape(-1) for v in self.values])


class ExactTopK:
    """Error-feedback buffers (in the tensors' shapes) and exact Top-k with float32 values."""

    def __init__(self, spec: ModelSpec, params: CodecParams, device: torch.device) -> None:
        self.params, self.device = params, device
        self._ef = {t.name: torch.zeros(t.shape, device=device) for t in spec.tensors}

    def compress(self, name: str, delta: torch.Tensor, beta: float, freeze: bool) -> ExactSparse:
        e = self._ef[name]
        src = delta.detach().to(self.device, torch.float32) if freeze else e.mul_(beta).add_(delta)
        layout = ChunkLayout.for_shape(tuple(e.shape), self.params)
        idx, vals = [], []
        for g, chunks in zip(layout.groups, layout.split(src), strict=True):
            pos, kept = topk_rows(chunks.contiguous(), g.k)
            idx.append(pos)
            vals.append(kept.clone())
        sent = ExactSparse(name, tuple(e.shape), idx, vals)
        if not freeze:
            flat, v = sent.flat(self.params)
            e.view(-1)[flat] -= v
        return sent

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self._ef.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        if set(state) != set(self._ef):
            raise ValueError("EF state does not cover exactly the owned tensors")
        self._ef = {n: state[n].to(self.device, torch.float32).clone() for n in self._ef}


class ExactEncoder(SparseEncoder):
    """SparseLoCo's encoder without quantisation (bench only; see the module docstring)."""

    def _new_encoder(self) -> Any:
        return ExactTopK(self.owned, self.run.codec, self.device)


class ExactFormat(SparseFormat):
    """Float32 Top-k entries: no wire, their bytes counted (bench only; module docstring)."""

    def wire_bytes(self, update: Sequence[ExactSparse]) -> int:
        """Index streams from the real coder plus 4 bytes per value."""
        total = 0
        for piece in update:
            layout = ChunkLayout.for_shape(piece.shape, self.run.codec)
            for g, i in zip(layout.groups, piece.idx, strict=True):
                total += len(indices.encode(i, g.chunk_size)) + 4 * i.numel()
        return total

    def to_bytes(self, update: Sequence[Any], meta: Meta | None, sign: Signer | None) -> bytes:
        raise NotImplementedError("float32 SparseLoCo values are a bench ablation, not a wire")

    def read_header(self, data: bytes | memoryview, max_bytes: int) -> Header:
        raise NotImplementedError("float32 SparseLoCo values are a bench ablation, not a wire")

    def decode(self, data: bytes | memoryview, max_bytes: int) -> Decoded:
        raise NotImplementedError("float32 SparseLoCo values are a bench ablation, not a wire")

    def validate(self, piece: Any) -> None:
        if not isinstance(piece, ExactSparse):
            raise DecodeError(f"expected float32 sparse tensors, got {type(piece)}")
        layout = ChunkLayout.for_shape(piece.shape, self.run.codec)
        for g, i, v in zip(layout.groups, piece.idx, piece.values, strict=True):
            if tuple(i.shape) != (g.n_chunks, g.k) or tuple(v.shape) != (g.n_chunks, g.k):
                raise DecodeError(f"{piece.name}: entries do not match the chunk layout")
            if not bool(torch.isfinite(v).all()):
                raise DecodeError(f"{piece.name}: non-finite value")

    def norm(self, update: Sequence[Any]) -> float:
        return exact_norm(v for p in update for v in p.values)

    def chunk_norms(self, piece: Any) -> list[torch.Tensor]:
        return [v.double().square().sum(1) for v in piece.values]

    def add_into(self, out: torch.Tensor, piece: Any, factor: Factor = 1.0) -> None:
        flat, v = piece.flat(self.run.codec)
        if isinstance(factor, (int, float)):
            v = v if factor == 1.0 else v * torch.tensor(factor, dtype=torch.float32)
        else:  # per chunk: each chunk's k entries by its factor
            v = torch.cat(
                [(x * f[:, None]).reshape(-1) for x, f in zip(piece.values, factor, strict=True)]
            )
        out.view(-1)[flat] = out.view(-1)[flat] + v

    def entries(self, piece: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return piece.flat(self.run.codec)


def make_exact(run: RunConfig, spec: ModelSpec) -> Strategy:
    """SparseLoCo's parts with float32 values (bench only), on the CPU."""
    fmt = ExactFormat(run, spec)
    return Strategy(fmt, ExactEncoder(run, spec), Aggregator(fmt), OuterOptimizer(run, spec))
