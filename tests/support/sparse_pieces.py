"""The pieces of a decoded update in the sparse format, typed as what they are: a decode of
`codec.wire.SPARSE` gives one `SparseTensor` per tensor (`MaskedTensor`s come only from
`codec.wire.MASKED`)."""

from __future__ import annotations

from collections.abc import Iterable

from codec.compress import SparseTensor
from codec.wire import Piece


def as_sparse(pieces: Iterable[Piece]) -> list[SparseTensor]:
    """`pieces`, each checked to be a `SparseTensor`."""
    out = []
    for piece in pieces:
        assert isinstance(piece, SparseTensor), type(piece)
        out.append(piece)
    return out
