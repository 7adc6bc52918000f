"""The inner loop's memory options (activation checkpointing per decoder layer, the cross-entropy
in chunks of positions) give the plain loop's losses and weights to within float tolerance: the
same maths in other roundings."""

from __future__ import annotations

import pytest
import torch

from miner.train import lm_loss, make_optimizer, train_window
from node.model.llama import build_model
from node.runtime.memory import MemoryOptions
from protocol.runconfig import RunConfig

RUN = RunConfig.preset("tiny", inner_steps=3, optimizer={"warmup_steps": 1})
CPU = torch.device("cpu")


def _batches(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    rows = RUN.batch_size
    return [torch.randint(0, RUN.model.vocab_size, (rows, 65), generator=gen) for _ in range(n)]


def test_the_chunked_loss_is_the_plain_loss_with_the_same_gradients() -> None:
    batch = _batches(1)[0][:4]
    grads = []
    for chunk in (0, 37, 256):  # 37: chunks that do not divide the 256 positions
        model = build_model(RUN.model, RUN.seed)
        loss = lm_loss(model, batch, chunk)
        loss.backward()
        grad = {}
        for n, p in model.named_parameters():
            assert p.grad is not None  # every parameter has a gradient after backward
            grad[n] = p.grad.clone()
        grads.append((float(loss.detach()), grad))
    (plain, g0), *chunked = grads
    for value, g in chunked:
        assert value == pytest.approx(plain, rel=1e-6)
        for name in g0:
            torch.testing.assert_close(g[name], g0[name], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize(
    "memory",
    [MemoryOptions(checkpoint_layers=True), MemoryOptions(loss_chunk_tokens=100),
     MemoryOptions(checkpoint_layers=True, loss_chunk_tokens=64)],
    ids=["checkpointing", "chunked loss", "both"],
)  # fmt: skip
def test_a_window_with_the_memory_options_trains_like_the_plain_loop(
    memory: MemoryOptions,
) -> None:
    results = []
    for options in (MemoryOptions(), memory):
        model = build_model(RUN.model, RUN.seed)
        inner = train_window(
            model, make_optimizer(model, RUN), _batches(RUN.inner_steps), RUN, 0, CPU,
            memory=options,
        )  # fmt: skip
        results.append((inner.losses, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (plain_losses, plain), (losses, weights) = results
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    for name in plain:
        torch.testing.assert_close(weights[name], plain[name], rtol=0, atol=RUN.optimizer.lr)
    assert sum(int((weights[n] - plain[n]).abs().gt(1e-5).sum()) for n in plain) < 1e-3 * sum(
        p.numel() for p in plain.values()
    )
