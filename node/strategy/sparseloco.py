"""`sparseloco` (the default): error feedback, chunked Top-k and 2-bit values (SparseLoCo,
Algorithm 1), on the wire as `codec.wire` updates.

Per tensor and window (`codec.compress.Compressor`): ``e ← β e + Δ``, ``Δ̂ = Q(TopK(e))``,
``e ← e − Δ̂``; during the first ``ef_freeze_fraction`` of the run ``Δ`` is compressed alone and
``e`` is left untouched. The window applies ``θ ← θ_start − α · mean(Δ̂)``
(`node.strategy.aggregator`, `node.strategy.outer`).

**What was sent is spent.** When the window's applied set does not hold our own update (not
selected, upload failed, dropped as late or for any other reason), the ``Δ̂`` taken out of ``e``
stays out, as in DeMo: put back, it came back in a later window beside that window's own
pseudo-gradient, a step measured from weights the run had left, and the model overshot
(docs/training.md, "What was sent is spent"; docs/results.md, "An update left out").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from codec.aggregate import chunk_norms, update_norm
from codec.compress import Compressor, SparseTensor, scatter_add
from codec.errors import DecodeError
from codec.spec import CodecParams, ModelSpec
from codec.wire import SPARSE, WireFormat, decode_update, encode_update, header_digest, read_header
from node.strategy.aggregator import Aggregator
from node.strategy.base import Strategy
from node.strategy.encoder import Encoder
from node.strategy.format import Decoded, Factor, Header, Meta, Signer, UpdateFormat
from node.strategy.outer import OuterOptimizer
from protocol.runconfig import RunConfig


class SparseFormat(UpdateFormat):
    """`codec.wire` updates: chunked Top-k entries with 2-bit values (module docstring)."""

    name = "sparseloco"
    clips_chunks = True
    dense = False
    wire: WireFormat = SPARSE

    @property
    def params(self) -> CodecParams:
        """The codec parameters of this strategy's updates (the run's)."""
        return self.run.codec

    # -- the wire ----------------------------------------------------------------------------

    def max_update_bytes(self) -> int:
        """32 bits per kept entry (an entry costs about 10), plus 1 MiB for headers."""
        c = self.params
        kept = self.spec.numel * c.k // c.chunk_size + len(self.spec.tensors) * c.k
        return 4 * kept + (1 << 20)

    def to_bytes(self, update: Sequence[Any], meta: Meta | None, sign: Signer | None) -> bytes:
        return encode_update(update, self.params, self.spec, meta=meta, sign=sign, fmt=self.wire)

    def read_header(self, data: bytes | memoryview, max_bytes: int) -> Header:
        return read_header(data, max_bytes, self.wire.frame, len(self.spec.tensors))[0]

    def signed_digest(self, header: Any) -> bytes:
        return header_digest(header, self.wire.frame)

    def decode(self, data: bytes | memoryview, max_bytes: int) -> Decoded:
        return decode_update(data, self.spec, self.params, max_bytes, self.wire)

    # -- one update --------------------------------------------------------------------------

    def validate(self, piece: Any) -> None:
        if not isinstance(piece, SparseTensor):
            raise DecodeError(f"a {self.name} update holds sparse tensors, not {type(piece)}")
        piece.validate(self.params)

    def norm(self, update: Sequence[Any]) -> float:
        return update_norm(update)

    def chunk_norms(self, piece: Any) -> list[torch.Tensor]:
        return chunk_norms(piece)

    def add_into(self, out: torch.Tensor, piece: Any, factor: Factor = 1.0) -> None:
        scatter_add(out, piece, self.params, factor)

    def entries(self, piece: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return sparse_entries(piece, self.params)


class SparseEncoder(Encoder):
    """Error feedback and Top-k with 2-bit values (`codec.compress.Compressor`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._encoder: Any = None  # built on first use

    @property
    def params(self) -> CodecParams:
        """The codec parameters of the pieces this encoder makes (the run's)."""
        return self.run.codec

    def _compressor(self) -> Any:
        if self._encoder is None:
            self._encoder = self._new_encoder()
        return self._encoder

    def _new_encoder(self) -> Any:
        return Compressor(self.owned, self.params, device=self.device)

    def encode(self, deltas: Mapping[str, torch.Tensor], window: int) -> list[Any]:
        names = self.owned_order(deltas)
        freeze = window < self.run.outer.ef_freeze_windows
        comp, beta = self._compressor(), self.run.outer.beta
        with torch.no_grad():
            return [comp.compress(n, deltas[n], beta, freeze=freeze) for n in names]

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        return self._compressor().state_dict()

    def load_local_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self._compressor().load_state_dict(state)


def make_sparseloco(
    run: RunConfig, spec: ModelSpec, device: torch.device | str, owned: ModelSpec | None
) -> Strategy:
    """SparseLoCo's parts: the sparse format and encoder, the chunk-clipped mean, the outer step."""
    fmt = SparseFormat(run, spec)
    return Strategy(
        fmt,
        SparseEncoder(run, spec, device, owned),
        Aggregator(fmt, device),
        OuterOptimizer(run, spec, device),
    )


def sparse_entries(piece: SparseTensor, params: CodecParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat positions, decoded values) of every entry of a sparse piece, in group order."""
    layout = piece.layout(params)
    pos = [layout.flat_positions(gi, g.idx).reshape(-1) for gi, g in enumerate(piece.groups)]
    vals = [v.reshape(-1) for v in piece.values()]
    if not pos:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0)
    return torch.cat(pos), torch.cat(vals)
