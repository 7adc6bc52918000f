"""The update format of a strategy: what one update is, on the wire and as decoded pieces.

One `UpdateFormat` per strategy (`node.strategy.make_format`): pieces to signed bytes and untrusted
bytes back to pieces, strictly (`to_bytes`, `read_header`, `signed_digest`, `decode`, capped at
`max_update_bytes`), and what a decoded update holds: `validate`, its exact norms (`norm`, and
per chunk `chunk_norms` where the aggregate clips chunk by chunk: `clips_chunks`), `add_into` a
tensor, and `entries` for copy detection. Whoever reads updates takes the format alone: the
gather, fetch and decode path, copy detection, the validator's probe. A format keeps no state of
its own; the shared mask (`node.strategy.mask`) and GreedyLore's basis
(`node.strategy.greedylore`) read the window's consensus state that their outer step moves.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol

import torch

from codec.spec import ModelSpec
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
"""What `UpdateFormat.add_into` scales a piece by: one number, or per chunk group one per chunk."""


def whole(factor: Factor) -> float:
    """The one number a format whose updates are clipped whole scales a piece by."""
    if not isinstance(factor, (int, float)):
        raise TypeError("per-chunk factors for a strategy that clips whole updates")
    return float(factor)


class UpdateFormat(ABC):
    """The wire and one update of a run's strategy, for a model of ``spec`` (module docstring)."""

    name: ClassVar[str]
    dense: ClassVar[bool]
    clips_chunks: ClassVar[bool] = False
    """Whether the aggregate clips chunk by chunk (`chunk_norms`) rather than whole updates."""

    def __init__(self, run: RunConfig, spec: ModelSpec) -> None:
        self.run, self.spec = run, spec
        self.shapes = {t.name: tuple(t.shape) for t in spec.tensors}

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

    def chunk_norms(self, piece: Any) -> list[torch.Tensor]:
        """Each chunk's squared norm of a validated piece, one float64 tensor per chunk group of
        its layout, exact and order-free (`clips_chunks` formats only)."""
        raise NotImplementedError(f"{self.name} clips whole updates")

    @abstractmethod
    def add_into(self, out: torch.Tensor, piece: Any, factor: Factor = 1.0) -> None:
        """``out += factor · decoded(piece)``, one rounding per position and call; ``factor``
        is one number, or per chunk group one per chunk (a chunked format's aggregate)."""

    @abstractmethod
    def entries(self, piece: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat positions int64, float32 values) of a validated piece: what it sends, in the
        strategy's own domain (DeMo: DCT coefficients; GreedyLore: the projected matrix), the
        same domain for every peer of the run, for value-aware copy detection."""
