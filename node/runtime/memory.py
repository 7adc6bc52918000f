"""Memory a peer needs per GPU (and on rank 0's host), from the run config: DDP against FSDP2
(`tessera plan`).

Per parameter, in fp32 (what `miner.peer` keeps; bf16 autocast only touches activations), for
the whole window: weights 4 B, gradients 4 B, AdamW's two moments 8 B, the window's start copy
4 B, the outer state (Nesterov momentum 4 B with ``outer.optimizer = nesterov``, the mean held
for the next window 4 B with ``outer.delay = 1``), and error feedback 4 B for the tensors a rank
compresses (1/N of them, `shard_tensors`).

- DDP (`miner.multigpu`): all of it on every GPU but the EF, ``20 + outer + 4/N`` B/param.
- FSDP2 (`miner.fsdp`, `miner.sharded_weights`): all of it sharded,
  ``(24 + outer)/N`` B/param.

Two moments add to that, and the larger counts (`MemoryPlan.transient`):

- while the inner steps train: the activations and, under FSDP2, the largest FSDP unit's whole
  weights and gradients (its weights twice: FSDP2 prefetches the next unit);
- after them, while the window is exchanged: the pseudo-gradients of the tensors the rank
  compresses (4 B/param / N) and, with ``delay = 0``, the window's mean (4 B/param on every GPU
  under DDP, its rows, 4 B/param / N, under FSDP2, plus one whole tensor while a
  pseudo-gradient is gathered; each FSDP2 rank builds its own rows on its host,
  `miner.sharded_mean`).

Rank 0's host memory peaks when it writes ``state.pt`` (`MemoryPlan.host`): the whole weights,
AdamW moments and outer state (``12 + outer`` B/param) and, while they are serialised, a second
copy of them (DDP serialises the moments from the GPU, so only the weights are copied to the
host first). FSDP2's other host copies are smaller: a history replay (two copies of the weights
and of the outer state).

With decode workers (`--exchange-workers`, `codec.pool`) rank 0's host also holds the exchange
(`MemoryPlan.exchange_host`): the workers' shared float32 sum (4 B/param), every gathered update
decoded until the sum (3 B per kept entry: int16 position, code, `codec.pool`), its bytes in
shared memory until decoded (`WIRE_BYTES_PER_ENTRY`), and each worker's index-decoder buffer for
the largest stream (`codec.native.index_decode.scratch_bytes`; 16 workers, the most `auto` picks).
FSDP2 ranks use no workers (`exchange_host_sharded`): rank 0 holds the gathered updates on the
wire and one of them decoded, and each rank its band of the mean (4 B/param / N) and its band's
chunks of every agreed update (`SPARSE_BYTES_PER_ENTRY` each, 1/N of the entries).

A validator (`plan_validator_memory`) probes on one device, in bf16 autocast over fp32 weights
(`validator.scoring.LossProbe`): the model and its outer state (``4 + outer`` B/param), and while
it probes the window's start (every probe restores the weights from it exactly) and the
consensus step (``8`` B/param more), plus one micro-batch's logits (`PROBE_LOGIT_BYTES`); in
the run's first windows, until two peers earn, the previous window's outer step too (4 B/param
on the device, and kept on the host between windows). The outer step afterwards holds the mean
(4 B/param) and one tensor at a time. Its host holds the exchange on decode workers (as a
peer's) and, while it saves its state, the weights and outer state twice. Where the device
cannot hold the probe's copies (``--probe-state``), they and the mean stay on the host and
each tensor comes over when it is used.

Activations follow the training recipe (`MemoryOptions`), from constants measured on a GPU
(`tessera bench step --preset 1B --device cuda`: the peak of allocated memory above the weights,
gradients and AdamW moments, one H100, bf16 autocast over fp32 weights, micro-batch 8 × 2,048):
``ACTIVATION_BYTES`` per hidden unit per layer per token kept for the backward pass (the fp32
residual stream and RMSNorm inputs, the bf16 matmul inputs, SwiGLU's three intermediates), the
logits' ``LOGIT_BYTES`` per vocabulary entry per token (bf16 logits, their fp32 copy, the fp32
softmax and its gradient) for all positions at once or, with a chunked loss, one chunk's; with
activation checkpointing only each layer's fp32 input is kept, plus one layer recomputed at a
time. A CUDA context and allocator slack add ``OVERHEAD`` per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Literal

from codec.spec import CodecParams
from protocol.runconfig import ModelConfig, RunConfig

__all__ = [
    "OVERHEAD",
    "PLAIN",
    "RECIPES",
    "SHARDINGS",
    "MemoryOptions",
    "MemoryPlan",
    "ValidatorMemoryPlan",
    "pick_recipe",
    "pick_sharding",
    "plan_memory",
    "plan_validator_memory",
    "step_time",
]

GIB = 1 << 30
OVERHEAD = 2 * GIB
"""CUDA context, NCCL buffers and allocator slack per GPU."""
STATE_BYTES = 20  # weights, gradients, two AdamW moments, start copy
EF_BYTES = 4
FP32 = 4  # a pseudo-gradient, a mean, a momentum
SAVED_BYTES = 12  # what state.pt holds per parameter besides the outer state: weights, moments
DECODED_BYTES_PER_ENTRY = 3  # a decode worker's kept entry: int16 position and its code byte
SPARSE_BYTES_PER_ENTRY = 9  # a decoded `SparseTensor`'s entry: int64 position and its code byte
ACTIVATION_BYTES = 75  # per hidden unit, layer and token, kept for the backward pass (measured)
LOGIT_BYTES = 11  # per vocabulary entry and token of the loss (measured)
CHECKPOINT_BYTES = 4  # per hidden unit, layer and token with checkpointing: the fp32 layer input
WIRE_BYTES_PER_ENTRY = 1.2  # an update on the wire: about 9.3 bits per kept entry
PROBE_LOGIT_BYTES = 10
"""Per vocabulary entry and position of a probe's forward pass (`node.model.losses.row_losses`):
the bf16 logits, their fp32 copy and the cross-entropy's fp32 log-softmax (counted from the
code)."""


@dataclass(frozen=True)
class MemoryOptions:
    """How the inner loop trades compute for memory: the same maths in other roundings (float
    tolerance, `tests/unit/test_train_memory.py`), so each peer picks its own."""

    checkpoint_layers: bool = False  # recompute each decoder layer's activations in backward
    loss_chunk_tokens: int = 0  # cross-entropy over this many positions at a time (0: all)

    def describe(self) -> str:
        parts = ["layers recomputed"] if self.checkpoint_layers else []
        if self.loss_chunk_tokens:
            parts.append(f"loss in chunks of {self.loss_chunk_tokens:,}")
        return ", ".join(parts) or "activations kept"


PLAIN = MemoryOptions()
"""Activations kept, the loss over all positions at once."""
LOSS_CHUNK = 4096
RECIPES = (PLAIN, MemoryOptions(False, LOSS_CHUNK), MemoryOptions(True, LOSS_CHUNK))
"""From the fastest to the smallest."""
STEP_TIME = (1.0, 1.08, 1.30)
"""Each recipe's inner-step time against `PLAIN`'s (measured: one H100 at 1B)."""


def step_time(options: MemoryOptions) -> float:
    """The inner-step time of one of `RECIPES` against `PLAIN`'s."""
    return STEP_TIME[RECIPES.index(options)]


Strategy = Literal["ddp", "fsdp2"]
Sharding = Literal["ddp", "fsdp2", "auto"]
SHARDINGS: tuple[Sharding, ...] = ("ddp", "fsdp2", "auto")
"""`tessera miner --sharding` under torchrun: ``auto`` is FSDP2 where DDP does not fit."""


@dataclass(frozen=True)
class MemoryPlan:
    strategy: Strategy
    gpus: int
    state: int  # bytes on one GPU for the whole window
    transient: int  # the larger moment besides the activations: see the module docstring
    activations: int  # estimate for one micro-batch
    host: int  # rank 0's host memory while it writes state.pt
    exchange_host: int = 0  # rank 0's host memory for the exchange (DDP: on decode workers)
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


def activation_bytes(run: RunConfig, options: MemoryOptions = PLAIN) -> int:
    """Bytes one micro-batch keeps for its backward pass under `options` (module docstring)."""
    m = run.model
    tokens = run.micro_batch_size * run.seq_len
    if options.checkpoint_layers:
        layers = CHECKPOINT_BYTES * m.hidden_size * m.n_layers + ACTIVATION_BYTES * m.hidden_size
    else:
        layers = ACTIVATION_BYTES * m.hidden_size * m.n_layers
    loss_tokens = min(options.loss_chunk_tokens or tokens, tokens)
    return tokens * layers + loss_tokens * LOGIT_BYTES * m.vocab_size


def outer_bytes(run: RunConfig) -> int:
    """Bytes per parameter of outer state kept through the window."""
    o = run.outer
    return FP32 * ((o.optimizer == "nesterov") + (o.delay == 1))


def plan_memory(
    run: RunConfig, gpus: int, strategy: Strategy, options: MemoryOptions = PLAIN
) -> MemoryPlan:
    """Bytes per GPU of one peer of `run` on `gpus` GPUs training with `options` (see the
    module docstring)."""
    if gpus < 1:
        raise ValueError("gpus must be at least 1")
    params = run.param_count()
    outer, activations = outer_bytes(run), activation_bytes(run, options)
    deltas = FP32 * params // gpus  # the owned tensors' pseudo-gradients
    mean = 0 if run.outer.delay else FP32 * params  # delay 1: held, so part of `outer`
    saved = (SAVED_BYTES + outer) * params
    if strategy == "ddp":
        state = (STATE_BYTES + outer) * params + EF_BYTES * params // gpus
        training, exchange = activations, deltas + mean
        host = FP32 * params + saved
    else:
        unit, tensor = _unit_params(run.model)
        state = (STATE_BYTES + outer + EF_BYTES) * params // gpus
        training = activations + FP32 * (3 * unit)  # unit weights (+ prefetched next), grads
        exchange = deltas + mean // gpus + FP32 * tensor
        host = 2 * saved
    transient = max(training, exchange) - activations
    on_host = exchange_host(run) if strategy == "ddp" else exchange_host_sharded(run, gpus)
    return MemoryPlan(strategy, gpus, state, transient, activations, host, on_host)


@dataclass(frozen=True)
class ValidatorMemoryPlan:
    """Bytes a validator of a run holds (module docstring): on its one device at the peak of a
    window, and on its host; ``launch_*`` in the run's first windows, while it keeps the
    previous window's step."""

    device: int
    launch_device: int
    host: int
    launch_host: int

    def fits(self, gpu_memory: int, launching: bool = False) -> bool:
        return (self.launch_device if launching else self.device) <= gpu_memory


def plan_validator_memory(run: RunConfig, on_host: bool = False) -> ValidatorMemoryPlan:
    """What a validator of `run` holds on its device and its host (see the module docstring);
    `on_host`: the probe's copies and the window's mean kept on the host (``--probe-state
    host``), so the device holds the model, one forward pass and one tensor at a time."""
    params = run.param_count()
    model = (FP32 + outer_bytes(run)) * params
    logits = run.micro_batch_size * run.seq_len * run.model.vocab_size * PROBE_LOGIT_BYTES
    copies = 2 * FP32 * params  # the window's start and the consensus step, then the mean
    host = exchange_host(run) + 2 * model
    launch = FP32 * params  # the previous window's step: a covariate, and kept between windows
    if on_host:
        tensor = FP32 * _unit_params(run.model)[1]  # the largest, on its way to the device
        device = model + logits + tensor + OVERHEAD
        return ValidatorMemoryPlan(device, device, host + copies, host + copies + 2 * launch)
    device = model + copies + logits + OVERHEAD  # the step holds less: the mean, one tensor
    return ValidatorMemoryPlan(device, device + launch, host, host + launch)


def pick_recipe(run: RunConfig, gpus: int, strategy: Strategy, gpu_memory: int) -> MemoryOptions:
    """The fastest of `RECIPES` whose plan fits `gpu_memory` (the smallest when none does)."""
    for options in RECIPES:
        if plan_memory(run, gpus, strategy, options).fits(gpu_memory):
            return options
    return RECIPES[-1]


def exchange_host(run: RunConfig) -> int:
    """Host bytes of the exchange on decode workers: the shared sum, the gathered updates,
    decoded and on the wire, and each worker's index-decoder buffer for the largest stream (see
    the module docstring)."""
    params = run.param_count()
    entries = params * run.codec.density  # per update, about: whole chunks dominate
    held = DECODED_BYTES_PER_ENTRY + WIRE_BYTES_PER_ENTRY
    return int(FP32 * params + run.gather_size * entries * held + decoder_buffers(run))


def exchange_host_sharded(run: RunConfig, gpus: int) -> int:
    """Rank 0's host bytes of an FSDP2 exchange on `gpus` ranks (see the module docstring)."""
    params = run.param_count()
    entries = params * run.codec.density
    wire = run.gather_size * entries * WIRE_BYTES_PER_ENTRY
    band = run.gather_size * entries * SPARSE_BYTES_PER_ENTRY / gpus + FP32 * params / gpus
    return int(wire + entries * SPARSE_BYTES_PER_ENTRY + band)


def decoder_buffers(run: RunConfig) -> int:
    """The index decoders' working buffers at once: one per decode worker (at most
    `AUTO_MAX_WORKERS`), each sized for the model's largest stream (`codec.native`)."""
    from node.window.pooled import AUTO_MAX_WORKERS

    return AUTO_MAX_WORKERS * _largest_stream_buffer(run.model, run.codec)


@cache
def _largest_stream_buffer(model: ModelConfig, codec: CodecParams) -> int:
    """One decoder's buffer for the model's largest stream (computed once per model and codec:
    `tessera plan` asks for each sharding of each preset)."""
    from codec.chunking import ChunkLayout
    from codec.native.index_decode import scratch_bytes
    from node.model.shapes import model_spec

    return max(
        (
            scratch_bytes(g.chunk_size, g.k, g.n_chunks)
            for t in model_spec(model).tensors
            for g in ChunkLayout.for_shape(t.shape, codec).groups
            if 0 < g.k < g.chunk_size
        ),
        default=0,
    )


def pick_sharding(choice: Sharding, run: RunConfig, world: int, gpu_memory: int | None) -> Strategy:
    """``ddp`` or ``fsdp2`` for a peer of `run` on `world` ranks; `gpu_memory` is one GPU's
    bytes (None on the CPU, where ``auto`` means DDP). ``auto`` keeps DDP where some recipe
    (`RECIPES`) fits it."""
    if choice not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {choice!r}")
    if choice != "auto":
        return choice
    if gpu_memory is None:
        return "ddp"
    fits = plan_memory(run, world, "ddp", pick_recipe(run, world, "ddp", gpu_memory))
    return "ddp" if fits.fits(gpu_memory) else "fsdp2"
