"""`sparseloco-mask`: SparseLoCo on a shared support (SCAPE's idea, `seeds/scape.txt`, in this
protocol).

SparseLoCo's peers pick their own Top-k, so their supports barely overlap and the mean divides
each sent value by the number of peers. Here every chunk of every peer sends values on one
*shared* support, ``run.mask.shared_k`` positions per full chunk that need no index, plus a
small *fresh* Top-k of its own outside it (``run.mask.fresh_k`` entries, with indices) so the
support can move. The support of a window is derived from what every honest node holds bit for bit
(`codec.masked.shared_support`): the positions of largest magnitude in the previous window's
aggregate (SCAPE's mask, used one step late), plus an exploration share
(``run.mask.explore``) drawn by a hash of the run and of that aggregate. The aggregate and the
digest seeding the draw are outer state: checkpoints carry them and catch-up restores them.

Error feedback, quantisation, clip and mean are SparseLoCo's. One `SharedSupport` per node holds
the previous aggregate: the outer step (`MaskOuter`) moves it, the encoder sends on it, and the
format (`MaskFormat`) reads it. Decoding needs no state (a `codec.masked.MaskedTensor` keeps its
shared values by slot); whoever holds the support (`validate`, `add_into`, `entries`) checks that
the update names it (its digest) and that no fresh entry lies on it. `entries` gives every
position and value, the shared ones (everybody's by construction) and the fresh ones.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from codec.chunking import ChunkLayout
from codec.compress import SparseTensor, scatter_add
from codec.errors import DecodeError
from codec.masked import (
    MaskCompressor,
    MaskedTensor,
    shared_counts,
    shared_support,
    support_digest,
)
from codec.spec import CodecParams, ModelSpec
from codec.wire import MASKED, decode_update, encode_update
from node.strategy.aggregator import Aggregator
from node.strategy.base import Strategy
from node.strategy.format import Decoded, Factor, Meta, Signer
from node.strategy.outer import OuterOptimizer
from node.strategy.sparseloco import SparseEncoder, SparseFormat, sparse_entries
from protocol.runconfig import RunConfig

NAME = "sparseloco-mask"
LAST = "last."


def mask_params(run: RunConfig) -> CodecParams:
    """The run's codec with ``k`` the fresh Top-k (``run.mask.fresh_k``)."""
    return run.codec.model_copy(update={"k": run.mask.fresh_k})


class SharedSupport:
    """The window's shared support, from the previous window's aggregate (module docstring)."""

    def __init__(self, run: RunConfig, spec: ModelSpec) -> None:
        self.run, self.spec, self.params = run, spec, mask_params(run)
        self.shapes = {t.name: tuple(t.shape) for t in spec.tensors}
        self._last: dict[str, torch.Tensor] | None = None  # the previous window's aggregate
        self._cache: tuple[bytes, dict[str, list[torch.Tensor]]] | None = None

    def current(self) -> tuple[bytes, dict[str, list[torch.Tensor]]]:
        """(digest, shared positions per group of every tensor) of the current window."""
        if self._cache is None:
            seed = hashlib.blake2b(self.run.run_id.encode(), digest_size=32)
            for t in self.spec.tensors:
                if self._last is not None:
                    seed.update(self._last[t.name].numpy().astype("<f4").tobytes())
            root = seed.digest()
            out = {}
            for t in self.spec.tensors:
                layout = ChunkLayout.for_shape(t.shape, self.params)
                last = self._last[t.name] if self._last is not None else torch.zeros(t.shape)
                counts = shared_counts(layout, self.params, self.run.mask.shared_k)
                tseed = int.from_bytes(
                    hashlib.blake2b(root + t.name.encode()).digest()[:8], "little"
                )
                out[t.name] = shared_support(last, layout, counts, self.run.mask.explore, tseed)
            self._cache = (support_digest([out[t.name] for t in self.spec.tensors]), out)
        return self._cache

    def resolve(self, piece: Any) -> SparseTensor:
        """A validated piece of this window with its shared positions in (`DecodeError` if it
        was made for another support or a fresh entry lies on it)."""
        if not isinstance(piece, MaskedTensor):
            raise DecodeError(f"a {NAME} update holds masked tensors, not {type(piece)}")
        digest, supports = self.current()
        if piece.digest != digest:
            raise DecodeError(f"{piece.name}: update was made for another shared support")
        return piece.resolve(supports[piece.name])

    def follow(self, mean: Mapping[str, torch.Tensor]) -> None:
        """The window's mean becomes the next window's support source."""
        self._last = {t.name: mean[t.name].detach().to("cpu", torch.float32).clone()
                      for t in self.spec.tensors}  # fmt: skip
        self._cache = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{"last.<tensor>": aggregate}`` once a mean was received; empty before."""
        return {LAST + n: t.clone() for n, t in (self._last or {}).items()}

    def load_state_dict(self, last: Mapping[str, torch.Tensor]) -> None:
        """Restore the previous aggregate (by tensor name; empty: none). ValueError unless it
        covers exactly the model's tensors, finite floats of their shapes."""
        if last and set(last) != set(self.shapes):
            raise ValueError("the previous aggregate must cover exactly the model's tensors")
        for name, t in last.items():
            if tuple(t.shape) != self.shapes[name] or not t.is_floating_point():
                raise ValueError(f"{name}: previous aggregate has the wrong shape or type")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name}: previous aggregate is not finite")
        self._last = {n: t.to("cpu", torch.float32).clone() for n, t in last.items()} or None
        self._cache = None


class MaskFormat(SparseFormat):
    """SparseLoCo's format on the window's shared support (``TSRM``)."""

    name = NAME
    wire = MASKED

    def __init__(self, run: RunConfig, spec: ModelSpec, support: SharedSupport) -> None:
        super().__init__(run, spec)
        self.support = support

    @property
    def params(self) -> CodecParams:
        """The run's codec with ``k`` the fresh Top-k (``run.mask.fresh_k``)."""
        return mask_params(self.run)

    def max_update_bytes(self) -> int:
        c = self.params
        per_chunk = c.k + self.run.mask.shared_k
        kept = self.spec.numel * per_chunk // c.chunk_size + len(self.spec.tensors) * per_chunk
        return 4 * kept + (1 << 20)

    def to_bytes(self, update: Sequence[Any], meta: Meta | None, sign: Signer | None) -> bytes:
        return encode_update(
            update, self.params, self.spec, meta=meta, sign=sign, fmt=self.wire,
            shared_k=self.run.mask.shared_k,
        )  # fmt: skip

    def decode(self, data: bytes | memoryview, max_bytes: int) -> Decoded:
        return decode_update(
            data, self.spec, self.params, max_bytes, self.wire, self.run.mask.shared_k
        )

    def validate(self, piece: Any) -> None:
        if not isinstance(piece, MaskedTensor):
            raise DecodeError(f"a {self.name} update holds masked tensors, not {type(piece)}")
        piece.validate(self.params)
        self.support.resolve(piece)

    def add_into(self, out: torch.Tensor, piece: Any, factor: Factor = 1.0) -> None:
        scatter_add(out, self.support.resolve(piece), self.params, factor)

    def entries(self, piece: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return sparse_entries(self.support.resolve(piece), self.params)


class MaskEncoder(SparseEncoder):
    """SparseLoCo's error feedback, sending the shared support's values and a fresh Top-k."""

    def __init__(
        self,
        run: RunConfig,
        spec: ModelSpec,
        device: torch.device | str,
        owned: ModelSpec | None,
        support: SharedSupport,
    ) -> None:
        super().__init__(run, spec, device, owned)
        self.support = support

    @property
    def params(self) -> CodecParams:
        return mask_params(self.run)

    def _new_encoder(self) -> Any:
        return MaskCompressor(self.owned, self.params, device=self.device)

    def encode(self, deltas: Mapping[str, torch.Tensor], window: int) -> list[Any]:
        names = self.owned_order(deltas)
        freeze = window < self.run.outer.ef_freeze_windows
        comp, beta = self._compressor(), self.run.outer.beta
        digest, supports = self.support.current()
        with torch.no_grad():
            return [
                comp.compress_masked(n, deltas[n], beta, freeze, supports[n], digest) for n in names
            ]


class MaskOuter(OuterOptimizer):
    """The run's outer step, whose every mean also moves the shared support."""

    def __init__(
        self, run: RunConfig, spec: ModelSpec, device: torch.device | str, support: SharedSupport
    ) -> None:
        super().__init__(run, spec, device)
        self.support = support

    def receive(self, mean: Mapping[str, torch.Tensor], window: int) -> None:
        """Hold the window's mean, which becomes the next window's support source."""
        self.support.follow(mean)  # the aggregate itself, before the outer rate scales it
        super().receive(mean, window)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**super().state_dict(), **self.support.state_dict()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        last = {k[len(LAST) :]: v for k, v in state.items() if k.startswith(LAST)}
        super().load_state_dict({k: v for k, v in state.items() if not k.startswith(LAST)})
        self.support.load_state_dict(last)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {**super().shapes(), **{LAST + n: s for n, s in self.support.shapes.items()}}

    def keep_rows(self, local: ModelSpec) -> None:
        raise ValueError(f"the {NAME} strategy's outer state cannot be sharded")


def make_mask(
    run: RunConfig, spec: ModelSpec, device: torch.device | str, owned: ModelSpec | None
) -> Strategy:
    """The shared mask's parts around one `SharedSupport`, SparseLoCo's mean."""
    support = SharedSupport(run, spec)
    fmt = MaskFormat(run, spec, support)
    return Strategy(
        fmt,
        MaskEncoder(run, spec, device, owned, support),
        Aggregator(fmt, device),
        MaskOuter(run, spec, device, support),
    )
