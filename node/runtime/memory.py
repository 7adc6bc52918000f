"""GPU memory a peer needs per GPU, from the run config: DDP against FSDP2 (`tessera plan`).

Model state, per parameter, in fp32 (what `node.peer` keeps; bf16 autocast only touches
activations): weights 4 B, gradients 4 B, AdamW's two moments 8 B, the window's start copy 4 B,
and error feedback 4 B for the tensors a rank compresses (1/N of them, `shard_tensors`).

- DDP (`node.runtime.multigpu`): all of it on every GPU but the EF: ``20 + 4/N`` B/param.
- FSDP2 (`node.runtime.fsdp`): everything sharded, ``24/N`` B/param, plus the transient full
  tensors: the largest FSDP unit's weights and gradients while it computes (its weights twice:
  FSDP2 prefetches the next unit) and one whole tensor while the peer gathers it to compress.

Activations are an estimate, not a measurement: ``34·hidden`` bytes per token per layer (bf16,
attention through SDPA without the score matrix, no recomputation; Korthikanti et al. 2022)
plus the logits, ``6·vocab`` bytes per token (bf16 logits and their fp32 loss copy), for one
micro-batch. A CUDA context and allocator slack add ``OVERHEAD`` per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from protocol.runconfig import ModelConfig, RunConfig

__all__ = ["OVERHEAD", "MemoryPlan", "plan_memory"]

GIB = 1 << 30
OVERHEAD = 2 * GIB
"""CUDA context, NCCL buffers and allocator slack per GPU."""
STATE_BYTES = 20  # weights, gradients, two AdamW moments, start copy
EF_BYTES = 4

Strategy = Literal["ddp", "fsdp2"]


@dataclass(frozen=True)
class MemoryPlan:
    strategy: Strategy
    gpus: int
    state: int  # model state bytes on one GPU
    transient: int  # full tensors gathered for a moment (FSDP2 only)
    activations: int  # estimate for one micro-batch
    overhead: int = OVERHEAD

    @property
    def total(self) -> int:
        return self.state + self.transient + self.activations + self.overhead

    def fits(self, gpu_memory: int) -> bool:
        return self.total <= gpu_memory


def _unit_params(m: ModelConfig) -> tuple[int, int]:
    """Parameters of the largest FSDP unit (a decoder layer or the root) and the largest tensor."""
    d, kv = m.hidden_size, m.n_kv_heads * m.head_dim
    layer = 2 * d * d + 2 * d * kv + 3 * d * m.intermediate_size + 2 * d
    root = m.vocab_size * d * (1 if m.tie_embeddings else 2) + d
    largest_tensor = max(m.vocab_size * d, d * m.intermediate_size)
    return max(layer, root), largest_tensor


def activation_bytes(run: RunConfig) -> int:
    m = run.model
    tokens = run.micro_batch_size * run.seq_len
    return tokens * (34 * m.hidden_size * m.n_layers + 6 * m.vocab_size)


def plan_memory(run: RunConfig, gpus: int, strategy: Strategy) -> MemoryPlan:
    """Bytes per GPU of one peer of `run` on `gpus` GPUs (see the module docstring)."""
    if gpus < 1:
        raise ValueError("gpus must be at least 1")
    params = run.param_count()
    ef = EF_BYTES * params // gpus
    if strategy == "ddp":
        return MemoryPlan("ddp", gpus, STATE_BYTES * params + ef, 0, activation_bytes(run))
    unit, tensor = _unit_params(run.model)
    transient = 4 * (3 * unit + tensor)  # unit weights (+ prefetched next) and grads, one tensor
    state = (STATE_BYTES * params) // gpus + ef
    return MemoryPlan("fsdp2", gpus, state, transient, activation_bytes(run))
