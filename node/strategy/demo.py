"""`demo`: DeMo (decoupled momentum, `seeds/demo-decoupled-momentum.txt`) in this protocol.

Per tensor and window, the pseudo-gradient is transformed chunk by chunk with an orthonormal DCT
(`codec.dct`: the chunk layout of `codec.chunking`, 64x64 tiles and 4096-element blocks for 1-D
tensors by default), and SparseLoCo's machinery then runs in the DCT domain:

* ``e ← β e + DCT(Δ)``: the error feedback is DeMo's decoupled momentum, kept in the DCT domain
  (the transform is linear, so this is the DCT of the momentum of the pseudo-gradients); taking
  out what was sent is DeMo's momentum subtraction with coefficient 1;
* Top-k coefficients per chunk through the index coder, values in 2 bits or as signs (1 bit)
  with a per-chunk magnitude (``run.codec.value_bits``);
* on the wire as `codec.wire`'s ``TSRC`` container (the sparse layout, its own magic).

The window's aggregate is the median-clipped mean of the peers' coefficients (clipped in the
DCT domain: the transform is orthonormal, so the norms are the parameters' norms), then the
inverse DCT of that mean (`codec.dct.inverse`, the same bits on every node), then the run's
outer step. Everything else (the freeze, an update spent once sent) is SparseLoCo's.

DeMo's own optimizer step is ``θ ← θ − η φ(IDCT(mean))`` after every gradient; here a window's
``H`` inner steps make the pseudo-gradient and ``φ`` is the identity (DeMo's SGD variant) under
the outer SGD or Nesterov step. ``H = 1`` with an inner SGD is the paper's momentum-SGD setting
(the bench runs it as ``demo:h=1,inner=sgd``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from codec import dct
from codec.chunking import ChunkLayout
from codec.compress import densify, scatter_add
from codec.spec import CodecParams, ModelSpec
from codec.wire import DCT
from node.strategy.aggregator import Aggregator
from node.strategy.base import Strategy
from node.strategy.format import Factor
from node.strategy.outer import OuterOptimizer
from node.strategy.sparseloco import SparseEncoder, SparseFormat
from protocol.runconfig import RunConfig


def _layout(shape: tuple[int, ...], params: CodecParams) -> ChunkLayout:
    return ChunkLayout.for_shape(shape, params)


class DctFormat(SparseFormat):
    """SparseLoCo's format over per-chunk DCT coefficients (``TSRC``)."""

    name = "demo"
    wire = DCT

    def add_coefficients(self, out: torch.Tensor, piece: Any, factor: Factor = 1.0) -> None:
        """``out += factor · piece`` in the DCT domain (the aggregate sums coefficients)."""
        scatter_add(out, piece, self.params, factor)

    def add_into(self, out: torch.Tensor, piece: Any, factor: Factor = 1.0) -> None:
        """``out += factor · IDCT(piece)`` (parameter domain, e.g. the validator's probe); per-chunk
        factors scale the coefficients (the transform is per chunk and linear)."""
        layout = _layout(self.shapes[piece.name], self.params)
        if not isinstance(factor, (int, float)):
            coef = torch.zeros(piece.shape, dtype=torch.float32, device=out.device)
            self.add_coefficients(coef, piece, factor)
            out.add_(dct.inverse(coef, layout))
            return
        x = dct.inverse(densify(piece, self.params, out.device), layout)
        if factor != 1.0:
            x = x * torch.tensor(factor, dtype=torch.float32, device=out.device)
        out.add_(x)


class DctEncoder(SparseEncoder):
    """SparseLoCo's encoder on each chunk's DCT coefficients of the pseudo-gradient."""

    def encode(self, deltas: Mapping[str, torch.Tensor], window: int) -> list[Any]:
        self.owned_order(deltas)
        shapes = {t.name: tuple(t.shape) for t in self.spec.tensors}
        coef = {
            n: dct.forward(d.to(self.device), _layout(shapes[n], self.params))
            for n, d in deltas.items()
        }
        return super().encode(coef, window)


class DctAggregator(Aggregator):
    """The chunk-clipped mean of the coefficients, then its inverse DCT."""

    format: DctFormat

    def _accumulate(
        self, sums: dict[str, torch.Tensor], name: str, piece: Any, factor: Factor
    ) -> None:
        self.format.add_coefficients(sums[name], piece, factor)  # a mean over coefficients

    def _finish_mean(self, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        fmt = self.format
        return {n: dct.inverse(t, _layout(fmt.shapes[n], fmt.params)) for n, t in out.items()}


def make_demo(
    run: RunConfig, spec: ModelSpec, device: torch.device | str, owned: ModelSpec | None
) -> Strategy:
    """DeMo's parts: SparseLoCo's in the DCT domain, the mean inverted at the end."""
    fmt = DctFormat(run, spec)
    return Strategy(
        fmt,
        DctEncoder(run, spec, device, owned),
        DctAggregator(fmt, device),
        OuterOptimizer(run, spec, device),
    )
