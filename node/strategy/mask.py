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

Error feedback, quantisation, clip and mean are SparseLoCo's. Decoding needs no state (a
`codec.masked.MaskedTensor` keeps its shared values by slot); whoever holds the support
(`validate`, `add_into`, `entries`) checks that the update names it (its digest) and that no
fresh entry lies on it. Copy detection by index sets uses the fresh positions only (`support`):
the shared ones are everybody's by construction; `entries` gives every position and value.
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
from codec.spec import CodecParams
from codec.wire import MASKED, decode_update, encode_update
from node.strategy.base import Decoded, Factor, Meta, Signer
from node.strategy.sparseloco import SparseLoCo, sparse_entries

LAST = "last."


class SparseLoCoMask(SparseLoCo):
    """SparseLoCo whose chunks share most of their support (see the module docstring)."""

    name = "sparseloco-mask"
    wire = MASKED

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._last: dict[str, torch.Tensor] | None = None  # the previous window's aggregate
        self._cache: tuple[bytes, dict[str, list[torch.Tensor]]] | None = None

    @property
    def params(self) -> CodecParams:
        """The run's codec with ``k`` the fresh Top-k (``run.mask.fresh_k``)."""
        return self.run.codec.model_copy(update={"k": self.run.mask.fresh_k})

    def _new_encoder(self) -> Any:
        return MaskCompressor(self.owned, self.params, device=self.device)

    # -- the shared support ------------------------------------------------------------------

    def supports(self) -> tuple[bytes, dict[str, list[torch.Tensor]]]:
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
            raise DecodeError(f"a {self.name} update holds masked tensors, not {type(piece)}")
        digest, supports = self.supports()
        if piece.digest != digest:
            raise DecodeError(f"{piece.name}: update was made for another shared support")
        return piece.resolve(supports[piece.name])

    # -- the peer's side ---------------------------------------------------------------------

    def encode(self, deltas: Mapping[str, torch.Tensor], window: int) -> list[Any]:
        names = self._owned_order(deltas)
        freeze = window < self.run.outer.ef_freeze_windows
        comp, beta = self._compressor(), self.run.outer.beta
        digest, supports = self.supports()
        with torch.no_grad():
            return [
                comp.compress_masked(n, deltas[n], beta, freeze, supports[n], digest) for n in names
            ]

    # -- the wire ----------------------------------------------------------------------------

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

    # -- one update --------------------------------------------------------------------------

    def validate(self, piece: Any) -> None:
        if not isinstance(piece, MaskedTensor):
            raise DecodeError(f"a {self.name} update holds masked tensors, not {type(piece)}")
        piece.validate(self.params)
        self.resolve(piece)

    def add_into(self, out: torch.Tensor, piece: Any, factor: Factor = 1.0) -> None:
        scatter_add(out, self.resolve(piece), self.params, factor)

    def entries(self, piece: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return sparse_entries(self.resolve(piece), self.params)

    # -- the window's consensus --------------------------------------------------------------

    def receive(self, mean: Mapping[str, torch.Tensor]) -> None:
        """Hold the window's mean, which becomes the next window's support source."""
        super().receive(mean)
        self._last = {t.name: mean[t.name].detach().to("cpu", torch.float32).clone()
                      for t in self.spec.tensors}  # fmt: skip
        self._cache = None

    def outer_state_dict(self) -> dict[str, torch.Tensor]:
        out = super().outer_state_dict()
        if self._last is not None:
            out.update({LAST + n: t.clone() for n, t in self._last.items()})
        return out

    def load_outer_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        last = {k[len(LAST) :]: v for k, v in state.items() if k.startswith(LAST)}
        super().load_outer_state_dict({k: v for k, v in state.items() if not k.startswith(LAST)})
        if last and set(last) != set(self._shapes):
            raise ValueError("the previous aggregate must cover exactly the model's tensors")
        for name, t in last.items():
            if tuple(t.shape) != self._shapes[name] or not t.is_floating_point():
                raise ValueError(f"{name}: previous aggregate has the wrong shape or type")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name}: previous aggregate is not finite")
        self._last = {n: t.to("cpu", torch.float32).clone() for n, t in last.items()} or None
        self._cache = None

    def outer_shapes(self) -> dict[str, tuple[int, ...]]:
        return {**super().outer_shapes(), **{LAST + n: s for n, s in self._shapes.items()}}
