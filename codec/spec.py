"""What both ends of an update agree on before any byte moves: the model's tensors and the codec."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

CODEC_VERSION = 2
"""Bump when the bytes an encoder produces change meaning. Part of every run id.

2: a 1-D tensor shorter than one chunk keeps ``min(k, N)`` entries (`codec.chunking`)."""


class CodecParams(BaseModel):
    """Codec parameters shared by every peer of a run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tile: int = Field(64, ge=1, le=1024, description="side of the square tile for 2-D tensors")
    k: int = Field(64, ge=1, description="entries kept per full chunk of tile*tile elements")
    value_bits: int = Field(
        2, ge=1, le=2, description="bits per transmitted value: 2 (sign + magnitude) or 1 (sign)"
    )
    max_abs_value: float = Field(
        1.0, gt=0, le=2.0**64, allow_inf_nan=False,
        description="largest magnitude a transmitted value may decode to (encoders clamp to it, "
        "decoders refuse anything above it)",
    )  # fmt: skip
    # Honest values sit far below 1.0: a whole `tiny` run (100 windows, 2 peers, real data,
    # error feedback on) sent at most 0.286; AdamW moves a weight by about lr * H per window, so
    # even a never-selected entry's error feedback tops out near lr * H / (1 - beta) = 0.6 there.
    # The larger presets train hundreds of inner steps a window (`node.runtime.plan`), where that
    # worst case exceeds 1.0. Clamped excess is not lost: it stays in error feedback.

    @property
    def chunk_size(self) -> int:
        """Elements per full chunk (C): tile*tile for matrices, also the 1-D chunk length."""
        return self.tile * self.tile

    @field_validator("k")
    @classmethod
    def _k_fits(cls, k: int, info: ValidationInfo) -> int:
        tile = info.data.get("tile", 64)
        if k > tile * tile:
            raise ValueError(f"k={k} exceeds the chunk size {tile * tile}")
        return k

    @property
    def density(self) -> float:
        return self.k / self.chunk_size


class TensorSpec(BaseModel):
    """One parameter tensor: its name and shape."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=256)
    shape: tuple[int, ...]

    @field_validator("shape")
    @classmethod
    def _positive(cls, shape: tuple[int, ...]) -> tuple[int, ...]:
        if not shape or len(shape) > 4 or any(d <= 0 for d in shape):
            raise ValueError(f"shape must have 1-4 positive dimensions, got {shape}")
        return shape

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class ModelSpec(BaseModel):
    """The ordered list of tensors an update may carry."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tensors: tuple[TensorSpec, ...]

    @field_validator("tensors")
    @classmethod
    def _unique(cls, tensors: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
        names = [t.name for t in tensors]
        if len(set(names)) != len(names):
            raise ValueError("tensor names must be unique")
        return tensors

    @classmethod
    def from_shapes(cls, shapes: Mapping[str, Iterable[int]]) -> ModelSpec:
        return cls(tensors=tuple(TensorSpec(name=n, shape=tuple(s)) for n, s in shapes.items()))

    @classmethod
    def from_module(cls, module: torch.nn.Module) -> ModelSpec:
        return cls.from_shapes({n: p.shape for n, p in module.named_parameters()})

    def by_name(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.tensors}

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    def digest(self) -> str:
        """Stable hex digest of names and shapes (order matters)."""
        h = hashlib.blake2b(digest_size=16)
        for t in self.tensors:
            h.update(f"{t.name}:{','.join(map(str, t.shape))};".encode())
        return h.hexdigest()
