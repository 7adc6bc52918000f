"""The training runs of `tessera bench train`: R replicas in one process, no chain, no buckets.

Every method sees the same token stream: replica ``r`` trains window ``w`` on the batches the run
assigns to uid ``r`` (`node.data.sampling`, keyed by the base run's id, so the stream does not
depend on the method's hyper-parameters), and DDP trains each inner step on the union of the R
replicas' batches of that step.

A **local** method (every `node.strategy`) runs, per window: each replica starts from the
synchronised weights, takes H AdamW steps (its own optimizer state, as a real peer keeps), and
encodes ``origin − θ_r`` with its own strategy's encoder; the update goes through the real wire
(the format's `to_bytes`, then `decode` of those bytes), and one consensus strategy's aggregator
and outer step hold the window's mean and take the step (`OuterOptimizer.receive`,
`OuterOptimizer.next_weights`) as peers and validators do; every replica then takes the
consensus' outer state (what its own identical step would give it: momentum, a shared support, a
basis). Without delay the origin is the window's
start and the step follows the window. With ``outer.delay = 1`` (docs/training.md) the origin is
the start moved by the previous window's step, which every replica also takes on its live weights
after ``land`` of its inner steps, when that window's exchange would land on a real peer. **DDP** is one model whose every inner step averages the
gradients of R replicas (the same as one step on their union).

The models train on ``Setup.device`` (`--device cuda`: the GPU, in bf16 autocast as a miner
trains); everything a peer does between two windows (encode, the wire, the mean, the outer step)
runs on the CPU, as on a peer's host, so the consensus is the same on every device.

Scored after every window: the held-out loss of the synchronised model on a fixed set of held-out
samples; also the bytes one replica sent and the wall time. With ``outer.delay = 1`` the last
window's mean is still held at the end; the loss once it is applied is kept too (`applied_loss`).
The final model's loss on each held-out sample (`final_rows`) gives the held-out set's own noise
(`lab.bench.train.report`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch

from codec.spec import ModelSpec
from lab.bench.train.specs import MethodSpec
from lab.strategies.exact import ExactFormat, make_exact
from lab.strategies.greedylore_variants import NowBasis, RandomBasis, greedylore_variant
from miner.train import lm_loss, make_optimizer, train_window
from node.data.batches import assigned_batch, eval_batch
from node.data.dataset import Dataset
from node.model.llama import build_model
from node.model.losses import row_losses
from node.strategy import Strategy, make_strategy
from node.strategy.format import UpdateFormat
from node.strategy.greedylore import LowRankEncoder, LowRankFormat
from node.strategy.outer import land_by_step
from protocol.runconfig import RunConfig

Tick = Callable[[int, float], None]
EVAL_MICRO = 16


@dataclass
class Curve:
    """One method's result, window by window."""

    method: MethodSpec
    loss: list[float] = field(default_factory=list)  # held-out loss after each window
    bytes_sent: list[int] = field(default_factory=list)  # one replica, each window
    wall_s: list[float] = field(default_factory=list)
    initial_loss: float = float("nan")
    weights: dict[str, torch.Tensor] = field(default_factory=dict)  # the synchronised model's
    applied_loss: float | None = None  # outer.delay = 1: once the last window's mean is applied
    final_rows: list[float] = field(default_factory=list)  # the last window's, per held-out sample


@dataclass(frozen=True)
class Setup:
    """What every method of one bench shares."""

    base: RunConfig  # the run the token stream is keyed by
    dataset: Dataset
    uids: tuple[int, ...]  # replica r trains on uid uids[r]'s samples
    windows: int
    heldout: torch.Tensor
    data_run_id: str
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def replicas(self) -> int:
        return len(self.uids)

    def batch(self, replica: int, window: int, step: int) -> torch.Tensor:
        run = self.base
        return assigned_batch(
            self.dataset, self.data_run_id, self.uids[replica], window, step,
            n_steps=run.inner_steps, batch_size=run.batch_size,
        )  # fmt: skip


def heldout_set(dataset: Dataset, run_id: str, n: int) -> torch.Tensor:
    """A fixed set of ``n`` held-out samples (all of them when there are fewer)."""
    return eval_batch(dataset, run_id, 0, "bench-train", min(n, dataset.n_heldout_slots))


def heldout_loss(model: torch.nn.Module, heldout: torch.Tensor) -> float:
    """Mean next-token loss over ``heldout`` (rows weighted equally)."""
    model.eval()
    total = 0.0
    device = next(model.parameters()).device
    with torch.no_grad():
        for part in heldout.split(EVAL_MICRO):
            total += float(lm_loss(model, part.to(device))) * part.shape[0]
    return total / heldout.shape[0]


def _strategy(m: MethodSpec, spec: ModelSpec) -> Strategy:
    """The method's strategy, or its bench-only variant (float32 values, GreedyLore's)."""
    if m.exact_values:
        return make_exact(m.run, spec)
    if m.options.get("select") == "now":
        return greedylore_variant(m.run, spec, NowBasis)
    if m.options.get("basis") == "random":
        return greedylore_variant(m.run, spec, RandomBasis)
    return make_strategy(m.run, spec)


def heldout_rows(model: torch.nn.Module, heldout: torch.Tensor) -> list[float]:
    """Each held-out sample's mean next-token loss, in float32 on every device (the spread of
    these is the noise of `heldout_loss`, which is their mean)."""
    model.eval()
    device = next(model.parameters()).device
    return row_losses(model, heldout, EVAL_MICRO, device, bf16=False).tolist()


def transmit(fmt: UpdateFormat, update: list, window: int, replica: int) -> tuple[int, list]:
    """(bytes on the wire, the pieces decoded back from them): the real codec both ways."""
    if isinstance(fmt, ExactFormat):
        return fmt.wire_bytes(update), update
    meta = {"window": window, "uid": replica}
    data = fmt.to_bytes(update, meta, None)
    return len(data), fmt.decode(data, fmt.max_update_bytes()).tensors


def run_local(m: MethodSpec, setup: Setup, tick: Tick) -> Curve:
    """A method of `node.strategy` (see the module docstring)."""
    run = m.run
    sync = build_model(run.model, run.seed).to(setup.device)
    spec = ModelSpec.from_module(sync)
    worker = build_model(run.model, run.seed).to(setup.device)
    optimizers = [make_optimizer(worker, run) for _ in range(setup.replicas)]
    peers = [_strategy(m, spec) for _ in range(setup.replicas)]
    consensus = _strategy(m, spec)
    curve = Curve(m, initial_loss=heldout_loss(sync, setup.heldout))
    syncs = setup.base.inner_steps // run.inner_steps  # outer steps per bench window (option h)
    for w in range(setup.windows):
        began = time.perf_counter()
        sent_bytes = sum(
            _outer_step(setup, m, sync, worker, optimizers, peers, consensus, w, s)
            for s in range(syncs)
        )
        curve.loss.append(heldout_loss(sync, setup.heldout))
        curve.bytes_sent.append(sent_bytes)
        curve.wall_s.append(time.perf_counter() - began)
        tick(w, curve.loss[-1])
    curve.weights = {n: p.detach().cpu().clone() for n, p in sync.named_parameters()}
    curve.final_rows = heldout_rows(sync, setup.heldout)
    if consensus.outer.holding:  # every window's tokens in the model: apply the held mean
        consensus.outer.advance(sync, {n: p.detach().cpu() for n, p in sync.named_parameters()})
        curve.applied_loss = heldout_loss(sync, setup.heldout)
    return curve


def _outer_step(
    setup: Setup,
    m: MethodSpec,
    sync: torch.nn.Module,
    worker: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    peers: list[Strategy],
    consensus: Strategy,
    w: int,
    s: int,
) -> int:
    """Outer step ``s`` of bench window ``w``: h inner steps per replica (taking the held step
    when it lands, ``outer.delay = 1``), encode, the real wire, the consensus' mean and step, then
    every replica takes the consensus' outer state. Returns the largest update's bytes."""
    run = m.run
    h, window = run.inner_steps, w * (setup.base.inner_steps // run.inner_steps) + s
    params = dict(worker.named_parameters())
    start = {n: p.detach().to("cpu", copy=True) for n, p in sync.named_parameters()}
    origin = consensus.outer.next_weights(start)  # delay 1: the previous step's mean (else `start`)
    jump = {n: (origin[n] - start[n]).to(setup.device) for n in start}
    deltas = []
    for r in range(setup.replicas):
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(start[n])
        landed = (
            _on_landing(params, jump, land_by_step(m.run.inner_steps, m.land))
            if run.outer.delay
            else None
        )
        if landed is not None:
            landed(-1, 0.0)
        batches = (setup.batch(r, w, s * h + i) for i in range(h))
        train_window(worker, optimizers[r], batches, run, window, setup.device, landed)
        with torch.no_grad():
            deltas.append({n: origin[n] - p.detach().cpu() for n, p in params.items()})
    fmt = consensus.format
    now = isinstance(fmt, LowRankFormat) and isinstance(fmt.basis, NowBasis)
    if now and not fmt.basis.full_round:  # type: ignore[attr-defined]
        _select_now(deltas, peers, fmt.basis)  # type: ignore[attr-defined]
    updates, sent, sizes = {}, {}, []
    for r in range(setup.replicas):
        sent[r] = peers[r].encoder.encode(deltas[r], window)
        n_bytes, updates[r] = transmit(peers[r].format, sent[r], window, r)
        sizes.append(n_bytes)
    consensus.outer.receive(consensus.aggregator.mean(updates), window)
    if not run.outer.delay:  # the window's own step, at once
        origin = consensus.outer.next_weights(origin)
    with torch.no_grad():
        for n, p in sync.named_parameters():
            p.copy_(origin[n])
    state = consensus.outer.state_dict()  # what each peer's own step would leave it with
    for r in range(setup.replicas):
        peers[r].outer.load_state_dict(state)
    return max(sizes)


def _select_now(deltas: list[dict], peers: list[Strategy], consensus: NowBasis) -> None:
    """GreedyLore's first communication phase, in-process: the mean of the replicas' sketches
    of this window's matrices chooses this window's columns everywhere (Algorithm 3)."""
    encoders = [cast(LowRankEncoder, p.encoder) for p in peers]
    sketches = [e.sketches(d) for e, d in zip(encoders, deltas, strict=True)]
    mean = {n: cast(torch.Tensor, sum(s[n] for s in sketches)) / len(sketches) for n in sketches[0]}
    for basis in [*(e.basis for e in encoders), consensus]:
        basis.select(mean)


def _on_landing(
    params: dict[str, torch.nn.Parameter], jump: dict[str, torch.Tensor], land: int
) -> Callable[[int, float], None]:
    """`train_window`'s callback: after inner step ``land − 1`` (before the first when ``land``
    is 0) the live weights take the outer step that has just landed."""

    def after(step: int, _loss: float) -> None:
        if step + 1 == land:
            with torch.no_grad():
                for n, p in params.items():
                    p.add_(jump[n])

    return after


def run_ddp(m: MethodSpec, setup: Setup, tick: Tick) -> Curve:
    """Every-step all-reduce: each inner step on the union of the replicas' batches."""
    run = m.run
    model = build_model(run.model, run.seed).to(setup.device)
    optimizer = make_optimizer(model, run)
    curve = Curve(m, initial_loss=heldout_loss(model, setup.heldout))
    gradient_bytes = 4 * sum(p.numel() for p in model.parameters())
    for w in range(setup.windows):
        began = time.perf_counter()
        batches = (
            torch.cat([setup.batch(r, w, h) for r in range(setup.replicas)])
            for h in range(run.inner_steps)
        )
        train_window(model, optimizer, batches, run, w, setup.device)
        curve.loss.append(heldout_loss(model, setup.heldout))
        curve.bytes_sent.append(run.inner_steps * gradient_bytes)  # one fp32 gradient a step
        curve.wall_s.append(time.perf_counter() - began)
        tick(w, curve.loss[-1])
    curve.weights = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    curve.final_rows = heldout_rows(model, setup.heldout)
    return curve


def run_method(m: MethodSpec, setup: Setup, tick: Tick) -> Curve:
    return run_ddp(m, setup, tick) if m.strategy == "ddp" else run_local(m, setup, tick)
