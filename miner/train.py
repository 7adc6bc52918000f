"""The H inner steps of one window (AdamW or SGD; warmup + cosine, gradient clipping, bf16 on GPU)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from node.runtime.memory import PLAIN, MemoryOptions
from protocol.runconfig import RunConfig
from protocol.schedule import learning_rate


@dataclass
class InnerResult:
    """What one window of local training did."""

    losses: list[float]
    tokens: int
    seconds: float

    @property
    def mean_loss(self) -> float:
        return sum(self.losses) / len(self.losses) if self.losses else math.nan

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def make_optimizer(model: torch.nn.Module, run: RunConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (norms and embeddings' 1-D params excluded);
    ``optimizer.name = "sgd"``: plain SGD on the raw (clipped) gradients, nothing else."""
    opt = run.optimizer
    if opt.name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=opt.lr, foreach=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": opt.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=opt.lr,
        betas=opt.betas,
        eps=opt.eps,
        foreach=True,
    )


def lm_loss(model: torch.nn.Module, batch: torch.Tensor, chunk_tokens: int = 0) -> torch.Tensor:
    """Mean next-token cross-entropy of a (B, T+1) token batch; with `chunk_tokens`, computed
    inside the model's forward over that many positions at a time (`CausalLM.forward`)."""
    if chunk_tokens > 0:
        return model(batch[:, :-1], targets=batch[:, 1:], loss_chunk_tokens=chunk_tokens)
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def _causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DDP wrapper (FSDP2 trains the module itself)."""
    return getattr(model, "module", model)


def micro_steps(rows: int, micro_batch_size: int) -> int:
    """Micro-batches for `rows` rows: the fewest equal ones of at most `micro_batch_size` rows.

    Equal micro-batches make the mean of their mean losses the batch's mean loss. For a full
    batch this is `RunConfig.grad_accum_steps`; a rank's slice of it (see `miner.multigpu`) may
    need another count.
    """
    n = math.ceil(rows / micro_batch_size)
    while rows % n:
        n += 1
    return n


def _grad_sync(model: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager[object]:
    """Under DDP, all-reduce the gradients only on the last micro-batch of a step."""
    no_sync = getattr(model, "no_sync", None)
    return no_sync() if callable(no_sync) and not sync else contextlib.nullcontext()


def train_window(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[torch.Tensor],
    run: RunConfig,
    window: int,
    device: torch.device,
    on_step: object = None,
    memory: MemoryOptions = PLAIN,
) -> InnerResult:
    """Run the inner steps of `window` on `batches`; `on_step(step, loss)` reports progress. The
    losses stay on the device until the step is done (one host sync per step)."""
    model.train()
    setattr(_causal_lm(model), "checkpoint_layers", memory.checkpoint_layers)  # noqa: B010
    losses: list[float] = []
    tokens = 0
    start = time.perf_counter()
    use_bf16 = device.type == "cuda"
    for h, batch in enumerate(batches):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(run, window * run.inner_steps + h)
        parts: list[torch.Tensor] = []
        accum = micro_steps(batch.shape[0], run.micro_batch_size)
        for i, micro in enumerate(batch.to(device).chunk(accum)):
            with _grad_sync(model, i == accum - 1):
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                    loss = lm_loss(model, micro, memory.loss_chunk_tokens) / accum
                loss.backward()
            parts.append(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), run.optimizer.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = sum(torch.stack(parts).tolist(), 0.0)  # one host sync per step, summed in order
        losses.append(total)
        tokens += batch.shape[0] * (batch.shape[1] - 1)
        if callable(on_step):
            on_step(h, total)
    return InnerResult(losses=losses, tokens=tokens, seconds=time.perf_counter() - start)
