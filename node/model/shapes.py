"""A model's tensors from its config alone, built on the meta device (no memory, any size): what
the planners and benches size updates and buffers from."""

from __future__ import annotations

import torch

from codec.spec import ModelSpec
from node.model.llama import CausalLM
from protocol.runconfig import ModelConfig

__all__ = ["layers_spec", "model_spec"]


def model_spec(cfg: ModelConfig) -> ModelSpec:
    """The model's tensors, built on the meta device (no memory, any size)."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.tie_weights()
    return ModelSpec.from_module(model)


def layers_spec(cfg: ModelConfig, layers: int) -> ModelSpec:
    """The model's tensors of its first ``layers`` decoder layers (all of its tensors for 0)."""
    spec = model_spec(cfg)
    if layers <= 0:
        return spec
    keep = tuple(f".layers.{i}." for i in range(layers))
    return ModelSpec(tensors=tuple(t for t in spec.tensors if any(k in t.name for k in keep)))
