"""The `Strategy` boundary: what a peer sends for its pseudo-gradient, and how a window applies it.

One object per node and run (`node.strategy.make_strategy`), chosen by ``run.strategy``. It does
four jobs, each in one place:

* **encode** (peer only): a tensor's pseudo-gradient, folded into the strategy's local state
  (SparseLoCo's error feedback), becomes the update piece to send; what was sent is spent, in
  the applied set or not (`node.strategy.sparseloco`);
* **wire**: pieces to signed bytes and untrusted bytes back to pieces, strictly (`to_bytes`,
  `read_header`, `signed_digest`, `decode`, capped at `max_update_bytes`);
* **aggregate** (`mean`): the consensus rule of docs/consensus.md: every update validated
  strictly, clipped to the lower median of the window's norms, summed in ascending uid order and
  divided by the updates' count in which each counts ``min(norm, B) / B`` (a null update counts
  0 and dilutes nothing). Chunked sparse strategies (SparseLoCo, DeMo, the shared mask:
  `clips_chunks`) apply it **chunk by chunk** (`codec.aggregate.chunk_clip`): in every chunk
  each update's part is scaled to at most the lower median ``B_c`` of the parts' norms there,
  and the chunk divided by its own count. The others (DiLoCo, GreedyLore) apply it to whole
  updates (`codec.aggregate.clip_factors`, `mean_divisor`). Norms are exact and order-free;
* **outer step** (`receive`, `next_weights`, `advance`): ``run.outer``'s optimizer
  (`node.strategy.outer`) on that mean, with its state (Nesterov momentum, and with
  ``outer.delay = 1`` the mean held for the next window) saved by `outer_state_dict` and
  restored by catch-up. `step` is the consensus schedule (validators, history replay); a peer,
  whose aggregate of window ``w`` lands while it trains ``w + 1``, drives the same schedule with
  `receive` and `next_weights` (`miner.peer`).

Hence one update's share of the step is at most ``α · B / N'`` in L2 norm (times the Nesterov
amplification ``1 / (1 − μ)`` in the limit), where ``N' > N / 2`` is the divisor (more than half
the ``N`` updates applied count fully); per chunk, at most ``α · B_c / N'_c`` in every chunk, so
an update cannot put its whole norm into the few chunks a targeted change needs. With ``N = 1``
the update is its own bound and is still bounded by the value cap. Raising a bound above every
honest norm takes a strict majority.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol

import torch

from codec.aggregate import (
    add_support,
    chunk_clip,
    clip_factors,
    divide_chunks,
    divide_exactly,
    keep_supported,
    mean_divisor,
)
from codec.chunking import ChunkLayout
from codec.errors import DecodeError
from codec.spec import ModelSpec
from node.strategy.outer import OuterOptimizer
from protocol.runconfig import RunConfig

Meta = Mapping[str, str | int]
Signer = Callable[[bytes], bytes]


class Piece(Protocol):
    """One tensor's part of an update (`codec.compress.SparseTensor`, `codec.dense.DenseTensor`)."""

    name: str
    shape: tuple[int, ...]


class Header(Protocol):
    """The signed header of an update on the wire."""

    @property
    def meta(self) -> Mapping[str, str | int]: ...

    @property
    def sig(self) -> bytes: ...


class Decoded(Protocol):
    """A strictly decoded update: its header and one piece per tensor of the spec."""

    @property
    def header(self) -> Any: ...

    @property
    def tensors(self) -> Any: ...

    @property
    def digest(self) -> bytes: ...

    @property
    def signed_digest(self) -> bytes: ...


Update = Sequence[Any]
Factor = float | Sequence[torch.Tensor]
"""What `Strategy.add_into` scales a piece by: one number, or per chunk group one per chunk."""


def whole(factor: Factor) -> float:
    """The one number a strategy that clips whole updates scales a piece by."""
    if not isinstance(factor, (int, float)):
        raise TypeError("per-chunk factors for a strategy that clips whole updates")
    return float(factor)


class Strategy(ABC):
    """One training strategy of one run, bound to the model's tensors (see the module docstring).

    ``owned``: the tensors this process encodes (a rank's shard on a multi-device peer; all of
    them by default). Local state is allocated on first use, so a strategy that only decodes,
    aggregates and steps (a validator, a replay) costs nothing to build.
    """

    name: ClassVar[str]
    dense: ClassVar[bool]
    clips_chunks: ClassVar[bool] = False
    """Whether `mean` clips chunk by chunk (`chunk_norms`) rather than whole updates."""

    def __init__(
        self,
        run: RunConfig,
        spec: ModelSpec,
        device: torch.device | str = "cpu",
        owned: ModelSpec | None = None,
    ) -> None:
        self.run, self.spec, self.device = run, spec, torch.device(device)
        self.owned = owned or spec
        self.outer = OuterOptimizer(run.outer, spec, self.device)
        self._shapes = {t.name: tuple(t.shape) for t in spec.tensors}

    # -- the peer's side ---------------------------------------------------------------------

    @abstractmethod
    def encode(self, deltas: Mapping[str, torch.Tensor], window: int) -> list[Any]:
        """The pieces to send for the owned tensors' pseudo-gradients ``start − θ``, in spec
        order, updating the local state. ``deltas`` must cover exactly the owned tensors."""

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This node's private state (error feedback) by tensor name, tensors in their shapes."""
        return {}

    def load_local_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        if state:
            raise ValueError(f"{self.name} keeps no local state, got {sorted(state)[:3]}")

    # -- the wire ----------------------------------------------------------------------------

    @abstractmethod
    def max_update_bytes(self) -> int:
        """A generous cap on a legitimate update's size (what a fetch may read)."""

    @abstractmethod
    def to_bytes(self, update: Sequence[Any], meta: Meta | None, sign: Signer | None) -> bytes:
        """One update (every tensor of the spec, in spec order) as signed wire bytes."""

    @abstractmethod
    def read_header(self, data: bytes | memoryview, max_bytes: int) -> Header:
        """The checked header of untrusted bytes (no payload decoding): `DecodeError` if bad."""

    @abstractmethod
    def signed_digest(self, header: Any) -> bytes:
        """What the sender's signature covers."""

    @abstractmethod
    def decode(self, data: bytes | memoryview, max_bytes: int) -> Decoded:
        """Strictly decode untrusted bytes (`DecodeError` for anything not exactly right)."""

    # -- one update --------------------------------------------------------------------------

    @abstractmethod
    def validate(self, piece: Any) -> None:
        """`DecodeError` unless ``piece`` is well formed for its tensor under this run."""

    @abstractmethod
    def norm(self, update: Sequence[Any]) -> float:
        """Exact, order-free L2 norm of a validated update (the same on every machine)."""

    @abstractmethod
    def add_into(self, out: torch.Tensor, piece: Any, factor: Factor = 1.0) -> None:
        """``out += factor · decoded(piece)``, one rounding per position and call; ``factor``
        is one number, or per chunk group one per chunk (a chunked strategy's `mean`)."""

    @abstractmethod
    def entries(self, piece: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat positions int64, float32 values) of a validated piece: what it sends, in the
        strategy's own domain (DeMo: DCT coefficients; GreedyLore: the projected matrix), the
        same domain for every peer of the run, for value-aware copy detection."""

    # -- the window's consensus --------------------------------------------------------------

    def chunk_norms(self, piece: Any) -> list[torch.Tensor]:
        """Each chunk's squared norm of a validated piece, one float64 tensor per chunk group of
        its layout, exact and order-free (`clips_chunks` strategies only)."""
        raise NotImplementedError(f"{self.name} clips whole updates")

    def mean(self, updates: Mapping[Any, Update]) -> dict[str, torch.Tensor]:
        """The validated, clipped mean of a window's updates in ascending key order
        (zeros when there are none); a tensor an update leaves out counts as zero for it.

        Two passes that each look at one update at a time (validate and norm, then sum), so a
        lazy mapping (`node.window.gather.Pieces`) never has two decoded at once. Chunked
        strategies clip chunk by chunk, the others whole updates (the module docstring)."""
        keys = sorted(updates)
        norms: list[float] = []
        chunks: list[dict[str, list[torch.Tensor]]] = []
        for key in keys:
            peer = self._by_name(updates[key])
            for piece in peer.values():
                self.validate(piece)
            if self.clips_chunks:
                chunks.append({name: self.chunk_norms(piece) for name, piece in peer.items()})
            else:
                norms.append(self.norm(list(peer.values())))
        sums = self._zeros()
        if self.clips_chunks:
            self._sum_chunk_clipped(sums, keys, updates, chunks)
        else:
            self._sum_clipped(sums, keys, updates, norms)
        return self._finish_mean(sums)

    def _sum_clipped(
        self,
        sums: dict[str, torch.Tensor],
        keys: list[Any],
        updates: Mapping[Any, Update],
        norms: list[float],
    ) -> None:
        """Whole updates clipped to the lower median norm, summed and divided."""
        factors, divisor = clip_factors(norms), mean_divisor(norms)
        for key, factor in zip(keys, factors, strict=True):
            for name, piece in self._by_name(updates[key]).items():
                self._accumulate(sums, name, piece, factor)
        if divisor > 0:
            for t in sums.values():
                divide_exactly(t, divisor)

    def _sum_chunk_clipped(
        self,
        sums: dict[str, torch.Tensor],
        keys: list[Any],
        updates: Mapping[Any, Update],
        chunks: list[dict[str, list[torch.Tensor]]],
    ) -> None:
        """Every chunk clipped to the lower median of its parts' norms, summed and divided; with
        ``outer.min_support`` above 1, zero where fewer updates sent a value (in the domain the
        strategy sums in: DeMo's coefficients)."""
        layouts = {
            t.name: ChunkLayout.for_shape(t.shape, self.run.codec) for t in self.spec.tensors
        }
        clips = {
            name: chunk_clip([u.get(name) for u in chunks], [g.n_chunks for g in layout.groups])
            for name, layout in layouts.items()
        }
        support = self.run.outer.min_support
        counts = (
            {n: torch.zeros(t.shape, dtype=torch.uint8) for n, t in sums.items()}
            if support > 1
            else {}
        )
        for i, key in enumerate(keys):
            for name, piece in self._by_name(updates[key]).items():
                factors = clips[name].factors[i]
                assert factors is not None  # the update sends this tensor
                self._accumulate(sums, name, piece, factors)
                if support > 1:
                    add_support(counts[name], *self.entries(piece))
        for name, t in sums.items():
            divide_chunks(t, layouts[name], clips[name].divisors)
            if support > 1:
                keep_supported(t, counts[name], support)

    def _zeros(self) -> dict[str, torch.Tensor]:
        """The buffers `mean` sums into (by default one float32 zero tensor per tensor)."""
        return {
            t.name: torch.zeros(t.shape, dtype=torch.float32, device=self.device)
            for t in self.spec.tensors
        }

    def _accumulate(
        self, sums: dict[str, torch.Tensor], name: str, piece: Any, factor: Factor
    ) -> None:
        """How `mean` sums a piece (by default `add_into`; a transform domain may differ)."""
        self.add_into(sums[name], piece, factor)

    def _finish_mean(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The mean in the parameters' domain from what `_accumulate` summed and divided."""
        return sums

    def receive(self, mean: Mapping[str, torch.Tensor]) -> None:
        """Hold a window's mean for the next `advance` (``run.outer.delay``, docs/training.md)."""
        self.outer.hold(mean)

    @property
    def holding(self) -> bool:
        """Whether a mean is held for the next step."""
        return self.outer.holding

    def next_weights(self, start: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The outer step with the held mean from ``start``, as new tensors (a copy of ``start``
        when none is held); the held mean is released."""
        return self.outer.next_weights(start)

    def advance(
        self, model: torch.nn.Module, start: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        """The model set to `next_weights` of ``start`` (default: its own weights)."""
        self.outer.advance(model, start)

    def step(self, model: torch.nn.Module, updates: Mapping[Any, Update]) -> None:
        """One window of the consensus schedule from the model's current weights, as validators
        and history replay take it: with ``outer.delay = 0`` this window's mean is applied; with
        ``delay = 1`` the previous window's held mean is, and this window's is held."""
        self.step_mean(model, self.mean(updates))

    def step_mean(self, model: torch.nn.Module, mean: Mapping[str, torch.Tensor]) -> None:
        """`step` with the window's mean computed elsewhere (by decode workers, `codec.pool`)."""
        if self.run.outer.delay:
            self.advance(model)
            self.receive(mean)
        else:
            self.receive(mean)
            self.advance(model)

    def outer_state_dict(self) -> dict[str, torch.Tensor]:
        """The outer optimizer's state: identical on every honest node, part of checkpoints."""
        return self.outer.state_dict()

    def load_outer_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.outer.load_state_dict(state)

    def outer_shapes(self) -> dict[str, tuple[int, ...]]:
        """Names and shapes the outer state may hold (what a checkpoint may carry)."""
        return self.outer.shapes()

    def keep_outer_for(self, local: ModelSpec) -> None:
        """Keep the outer step's state for `local`, a rank's rows of the model's tensors (FSDP2,
        `miner.sharded_weights`): the outer step is elementwise, so `receive`,
        `next_weights` and the outer state dicts then work on those rows alone. Strategies
        with outer state of their own (whole-tensor, e.g. a basis) cannot: ValueError."""
        if set(self.outer_shapes()) - set(self.outer.shapes()):
            raise ValueError(f"the {self.name} strategy's outer state cannot be sharded")
        self.outer = OuterOptimizer(self.run.outer, local, self.device)

    # -- helpers -----------------------------------------------------------------------------

    def _by_name(self, update: Update) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for piece in update:
            name = getattr(piece, "name", None)
            if not isinstance(name, str) or name not in self._shapes:
                raise DecodeError(f"unknown tensor {name!r}")
            if name in out:
                raise DecodeError(f"tensor {name!r} appears twice in one update")
            if tuple(piece.shape) != self._shapes[name]:
                raise DecodeError(f"{name}: shape {piece.shape} != {self._shapes[name]}")
            out[name] = piece
        return out

    def _owned_order(self, deltas: Mapping[str, torch.Tensor]) -> list[str]:
        names = [t.name for t in self.owned.tensors]
        if set(deltas) != set(names):
            raise ValueError(f"deltas must cover exactly the {len(names)} owned tensors")
        return names
