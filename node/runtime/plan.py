"""The throughput model of one window: how much of it a peer's accelerators spend training.

Used by `tessera plan`, `tessera doctor` and the presets' test. Per window (``outer.delay = 0``,
everything in sequence)::

    compute = 6 · P · T · S / (devices · peak · MFU)    P: parameters, T: tokens per window,
                                                         S: the training recipe's step time
    comm    = upload + gather wait + download + decode
    upload  = U / link                                   U: bytes of one update
    gather wait = the gather grace after the deadline    (`WindowSchedule.gather_grace_blocks`)
    download = G · U / link                              G: run.gather_size
    decode  = G · E / exchange rate                      E: entries of one update
    probe   = 4.03 · 2 · P · 64 · seq_len / (peak · 34 %)  one probe of one update by the lead,
              on one GPU in bf16 (`tessera bench probe`)
    probes  = min(G · probe, lead's time − download − decode − publish reserve)
              the lead's probes before its manifest: it probes the selected updates (the
              newcomers' first) until its last block to publish (the gather block plus the
              fetch budget and the manifest wait, less the publish margin), and applies the
              established peers' updates it had no time for unprobed (`validator.admission`)
    exchange = comm + probes                             training's end to the agreed step
    busy    = compute / window;  fits when compute + exchange <= window
    budgets: download <= fetch_budget_s, and the lead's time after the whole fetch budget and
             the decode holds the probes of the probation slots' updates (a newcomer is applied
             only once a probe shows it trains)

A peer starts training window ``w`` once it has gathered ``w − 1`` and the lead's manifest has
said which updates it applies (at the gather point of ``w − 1`` plus download, decode and the
lead's probes), and must have uploaded ``w`` by the deadline of ``w``, one window later: hence
``compute + exchange <= window``. With ``outer.delay = 1`` (docs/training.md) the exchange of
``w − 1`` runs while ``w`` trains, from the deadline of ``w − 1`` on, and must land by `LAND_BY`
of the inner steps or the peer waits there: it fits when training, that wait and the upload
fit in one window (a peer that starts ``w`` at the deadline of ``w − 1``, the latest it can,
waits ``exchange − upload − LAND_BY · compute`` at most).

Stated figures (each a constant below): peak bf16 dense FLOP/s from the vendors' datasheets, the
MFU (33 % on GPUs with activations kept: measured at 1B on one H100, assumed at every size), the
training recipe the box's memory allows (`node.runtime.memory.pick_recipe`) and its step time
(`step_time`), the link speed of the reference box, and the rate its host decodes
and sums updates (measured with decode workers, `GPU_HOST_EXCHANGE_RATE`; `tessera plan --measure`
measures this machine's). The update size is measured: an update of the
run's strategy and codec is encoded from a fixed Gaussian sample (`update_size`). Not
modelled: compression on the device, the outer step, the fingerprint and the state save.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

from codec.chunking import ChunkLayout
from codec.spec import ModelSpec
from node.model.shapes import layers_spec, model_spec
from node.runtime.memory import GIB, PLAIN, MemoryOptions, pick_recipe, pick_sharding, step_time
from node.strategy import make_format, make_strategy
from node.strategy.format import Meta
from node.strategy.outer import LAND_BY
from node.window.consensus import MIN_PUBLISH_RESERVE_S, last_publish_block
from node.window.selection import probation_slots
from protocol.runconfig import RunConfig
from protocol.windows import WindowSchedule

MFU = 0.33
"""Model-FLOPs utilisation on GPUs with activations kept: 32.7 % measured at 1B on one H100
(`tessera bench step --preset 1B --device cuda`), assumed for every size and box; a recipe that
recomputes takes `step_time` longer per step."""

GPU_HOST_EXCHANGE_RATE = 66.1e6
"""Entries per second the host of a GPU box decodes and sums a window's updates with 16 decode
workers (`--exchange-workers`, `codec.pool`): measured on the 16-core host of one H100 at the
1B preset's shapes, the slower of two arrival orders, `tessera bench exchange --preset 1B
--peers 8 --layers 4 --workers 1,4,16 --device cuda` (2026-11-26: 66.7 and 66.1 M/s; one worker
15.6 M/s). The reference boxes have at least as many cores."""

PROBE_FORWARD_MFU = 0.34
"""Model-FLOPs utilisation of the validator's bf16 forward passes on a GPU: 34.0 % measured at 1B
on one H100 (64 × 2,048 tokens in 0.963 s, `tessera bench probe --preset 1B --device cuda`)."""
CPU_PROBE_FORWARD_MFU = 0.56
"""The same on the CPU box's stated peak: `tiny` on dev-2c, 64 × 128 tokens in 0.239 s (`tessera
bench probe --preset tiny`)."""
PROBE_FORWARDS = 4.03
"""One probe's time in forward passes of its samples (measured there: 3.884 s per probe)."""
PROBE_SAMPLES = 64
"""Samples per forward pass of a probe (`ValidatorConfig.n_own`, `n_random`)."""

CPU_EXCHANGE_RATE = 2.2e6
"""Entries per second the `tiny` preset's exchange runs at on its reference (one thread of the
2-core development machine, no workers): its tensors are small, so the fixed cost per tensor
weighs (`tessera plan --preset tiny --measure`: 2.20–2.39 M/s, 2026-11-26)."""

SAMPLE_SHAPES = {"w_in": (1024, 4096), "w_out": (4096, 1024), "norm": (1024,)}
"""The fixed sample an update's size and decode rate are measured on (8.4 M elements)."""


@dataclass(frozen=True)
class Hardware:
    """One accelerator kind: its peak dense throughput and where the figure comes from."""

    name: str
    peak_flops: float
    source: str
    memory_gib: float = 80.0  # per accelerator, the datasheet's figure


HARDWARE: dict[str, Hardware] = {
    "h100": Hardware("H100 SXM", 989.4e12, "bf16 dense, NVIDIA H100 datasheet"),
    "h200": Hardware("H200 SXM", 989.4e12, "bf16 dense, NVIDIA H200 datasheet", 141.0),
    "a100": Hardware("A100 SXM", 312e12, "bf16 dense, NVIDIA A100 80GB datasheet"),
    "cpu": Hardware(
        "x86 CPU, 2 cores",
        160e9,
        "fp32: 2 cores × 2.5 GHz × 32 FLOP/cycle (AVX2, two FMA units)",
        24.0,
    ),
}


@dataclass(frozen=True)
class Box:
    """A peer's machine: ``devices`` accelerators of one kind, a symmetric link, an MFU, and
    the rate its host decodes and sums gathered updates at (entries per second)."""

    gpu: str
    devices: int
    link_gbps: float
    mfu: float = MFU
    exchange_rate: float = GPU_HOST_EXCHANGE_RATE
    probe_mfu: float = PROBE_FORWARD_MFU  # the validator's forward passes

    @property
    def hardware(self) -> Hardware:
        return HARDWARE[self.gpu]

    @property
    def flops(self) -> float:
        """Useful FLOP/s of the whole box."""
        return self.devices * self.hardware.peak_flops * self.mfu

    def describe(self) -> str:
        return (
            f"{self.devices} × {self.hardware.name}, {self.mfu:.0%} MFU, {self.link_gbps:g} Gbit/s"
        )


REFERENCE: dict[str, Box] = {
    "tiny": Box(
        "cpu", 1, 1.0, mfu=0.10, exchange_rate=CPU_EXCHANGE_RATE, probe_mfu=CPU_PROBE_FORWARD_MFU
    ),
    "150M": Box("h100", 1, 1.0),
    "1B": Box("h100", 8, 1.0),
    "8B": Box("h100", 8, 1.0),
}
"""Each preset's reference machine. ``tiny`` is the CPU test preset: 10 % of the 2-core peak is
16 GFLOP/s, close to the 18 GFLOP/s `tessera doctor --run tiny` measured on one thread of the
development machine under load."""

TARGET_BUSY = 0.90
"""The share of a window the presets spend training on their reference box (tiny excepted:
its inner steps and batch are the training bench's, its window is sized for CI)."""
CPU_PRESETS = ("tiny",)


@dataclass(frozen=True)
class UpdateSize:
    """What one update of a run costs on the wire: entries sent and bytes."""

    entries: int
    bits_per_entry: float

    @property
    def bytes(self) -> int:
        return math.ceil(self.entries * self.bits_per_entry / 8)


@dataclass(frozen=True)
class Plan:
    """One window of a run on one box (see the module docstring); times in seconds."""

    params: int
    tokens: int
    flops: float
    window_s: float
    compute_s: float
    update: UpdateSize
    upload_s: float
    grace_s: float
    download_s: float
    decode_s: float
    fetch_budget_s: float
    manifest_wait_s: float
    recipe: MemoryOptions = PLAIN
    every_probe_s: float = 0.0  # the lead's probes of every selected update
    deadline_s: float = 0.0  # the upload deadline after the window's end
    newcomer_probes_s: float = 0.0  # the probes of the probation slots' updates alone
    lead_s: float = 0.0  # the gather block to the lead's last block to publish

    @property
    def probes_s(self) -> float:
        """The lead's probes before its manifest: of every selected update, or as many as its
        time holds (`probe_budget_s`)."""
        return max(0.0, min(self.every_probe_s, self.probe_budget_s))

    @property
    def comm_s(self) -> float:
        return self.upload_s + self.grace_s + self.download_s + self.decode_s

    @property
    def exchange_s(self) -> float:
        """From the end of training to the agreed step: the peers wait for the lead's manifest,
        which follows its probes of the selected updates."""
        return self.comm_s + self.probes_s

    @property
    def busy(self) -> float:
        """Share of the window spent training."""
        return self.compute_s / self.window_s

    @property
    def comm_share(self) -> float:
        return self.comm_s / self.window_s

    @property
    def fits(self) -> bool:
        """Training and the whole exchange fit in one window (``outer.delay = 0``)."""
        return self.compute_s + self.exchange_s <= self.window_s

    @property
    def budgets_fit(self) -> bool:
        """The run's consensus bounds leave room for the exchange: the gather's download fits its
        budget, and the lead's time after the fetch budget (a selected peer sending at the least
        rate holds the fetch that long) and the decode holds the probes of the probation slots'
        updates, which only a probe lets into the mean."""
        after_fetch = self.lead_s - self.fetch_budget_s - self.decode_s - MIN_PUBLISH_RESERVE_S
        return self.download_s <= self.fetch_budget_s and self.newcomer_probes_s <= after_fetch

    @property
    def probe_budget_s(self) -> float:
        """The lead's time to probe before its manifest: from the gather block to its last
        block to publish, less the download, the decode and the least publish reserve."""
        return self.lead_s - self.download_s - self.decode_s - MIN_PUBLISH_RESERVE_S

    @property
    def fits_overlapped(self) -> bool:
        """With ``outer.delay = 1``: the last window's exchange lands by `LAND_BY` of the inner
        steps or the peer waits for it there, and training, that wait and the upload fit in one
        window (the peer starts training at the last window's deadline, the latest it can)."""
        wait = max(0.0, self.exchange_s - self.upload_s - LAND_BY * self.compute_s)
        return self.compute_s + wait + self.upload_s <= self.window_s


def entries(run: RunConfig, spec: ModelSpec) -> int:
    """Values one update of ``spec`` carries: every element (dense) or the kept ones (sparse)."""
    if make_format(run, spec).dense:
        return spec.numel
    return sum(ChunkLayout.for_shape(t.shape, run.codec).n_values for t in spec.tensors)


def _sample(run: RunConfig) -> tuple[ModelSpec, bytes, int]:
    """(spec, wire bytes, entries) of one update of the fixed sample: Gaussian pseudo-gradients
    of a pseudo-gradient's size, well under the value cap (heavy-tailed ones code smaller)."""
    spec = ModelSpec.from_shapes(SAMPLE_SHAPES)
    strategy = make_strategy(run, spec)
    gen = torch.Generator().manual_seed(0)
    deltas = {t.name: torch.randn(t.shape, generator=gen) * 1e-3 for t in spec.tensors}
    with torch.no_grad():
        pieces = strategy.encoder.encode(deltas, 0)
    meta: Meta = {
        "run_id": run.run_id,
        "window": 0,
        "uid": 0,
        "hotkey": "5" * 48,
    }  # real field sizes
    data = strategy.format.to_bytes(pieces, meta, lambda _digest: bytes(64))
    return spec, data, entries(run, spec)


@cache
def _bits_per_entry(run: RunConfig) -> float:
    _, data, n = _sample(run)
    return 8 * len(data) / n


def update_size(run: RunConfig, spec: ModelSpec | None = None) -> UpdateSize:
    """The size of one update of ``run``: its entries, at the bits per entry measured by
    encoding the fixed sample with the run's strategy and codec."""
    spec = spec or model_spec(run.model)
    return UpdateSize(entries(run, spec), _bits_per_entry(run))


MEASURED_LAYERS = 4
"""Decoder layers `measure_decode_rate` encodes: workers are dealt whole tensors, and one layer's
nine leave most of 16 workers idle (one layer of 8B: 9.1 M/s on one worker, 24.9 M/s on 16)."""


def measure_decode_rate(run: RunConfig, workers: int, repeats: int = 3, updates: int = 4) -> float:
    """Entries per wall second this machine decodes and sums with ``workers`` decode workers
    (0: on this thread, the strategy's own mean): ``updates`` updates of the run's first
    `MEASURED_LAYERS` decoder layers (their real shapes; enough tensors for the workers to
    share evenly), best of ``repeats``."""
    from codec.pool import AggregatePool

    spec = layers_spec(run.model, MEASURED_LAYERS)
    strategy = make_strategy(run, spec)
    fmt, aggregator = strategy.format, strategy.aggregator
    cap = fmt.max_update_bytes()
    gen = torch.Generator().manual_seed(0)
    datas = []
    for uid in range(updates):
        peer = make_strategy(run, spec)
        deltas = {
            t.name: torch.randn(t.shape, generator=gen) * 1e-3 * (uid + 1) for t in spec.tensors
        }
        meta: Meta = {"run_id": run.run_id, "window": 0, "uid": uid, "hotkey": "5" * 48}
        with torch.no_grad():
            pieces = peer.encoder.encode(deltas, 10**6)
        datas.append(peer.format.to_bytes(pieces, meta, lambda _d: bytes(64)))
    n = updates * entries(run, spec)
    if workers == 0:
        return n / _best(
            lambda: aggregator.mean({u: fmt.decode(d, cap).tensors for u, d in enumerate(datas)}),
            repeats,
        )
    with AggregatePool(spec, run.codec, workers, cap) as pool:

        def once() -> None:
            pool.reset()
            for uid, data in enumerate(datas):
                pool.add(uid, data)
            pool.mean()

        once()  # the workers' start
        return n / _best(once, repeats)


def _best(fn: Callable[[], object], repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        begun = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - begun)
    return max(best, 1e-9)


def probe_seconds(run: RunConfig, box: Box) -> float:
    """One probe of one update on one of the box's accelerators (`PROBE_FORWARDS` forward
    passes of `PROBE_SAMPLES` sequences at the box's `probe_mfu`)."""
    flops = 2.0 * run.param_count() * PROBE_SAMPLES * run.seq_len
    return PROBE_FORWARDS * flops / (box.hardware.peak_flops * box.probe_mfu)


def box_recipe(run: RunConfig, box: Box) -> MemoryOptions:
    """The training recipe a peer of `run` takes on `box` (`tessera miner`'s default: the
    sharding and the fastest recipe its GPUs' memory fits); activations kept on a CPU."""
    if box.gpu == "cpu":
        return PLAIN
    memory = int(box.hardware.memory_gib * GIB)
    strategy = pick_sharding("auto", run, box.devices, memory)
    return pick_recipe(run, box.devices, strategy, memory)


def plan(
    run: RunConfig,
    box: Box,
    decode_rate: float | None = None,
    tokens_per_s: float | None = None,
) -> Plan:
    """The window of ``run`` on ``box``; ``decode_rate`` replaces the box's exchange rate and
    ``tokens_per_s`` the FLOP model with a measured training rate (`tessera doctor`)."""
    decode_rate = decode_rate or box.exchange_rate
    params = run.param_count()
    tokens = run.inner_steps * run.batch_size * run.seq_len
    flops = 6.0 * params * tokens
    recipe = box_recipe(run, box)
    compute_s = tokens / tokens_per_s if tokens_per_s else step_time(recipe) * flops / box.flops
    update = update_size(run)
    link = box.link_gbps * 1e9 / 8  # bytes per second
    schedule = WindowSchedule.from_run(run)
    download_s = run.gather_size * update.bytes / link
    decode_s = run.gather_size * update.entries / decode_rate
    probe_s = probe_seconds(run, box)
    lead_s = (last_publish_block(run, 0) - schedule.gather_block(0)) * run.timing.block_time_s
    return Plan(
        params=params,
        tokens=tokens,
        flops=flops,
        window_s=run.timing.blocks_per_window * run.timing.block_time_s,
        compute_s=compute_s,
        update=update,
        upload_s=update.bytes / link,
        grace_s=schedule.gather_grace_blocks * run.timing.block_time_s,
        download_s=download_s,
        decode_s=decode_s,
        fetch_budget_s=run.consensus.fetch_budget_s,
        manifest_wait_s=run.consensus.manifest_wait_s,
        recipe=recipe,
        every_probe_s=run.gather_size * probe_s,
        newcomer_probes_s=probation_slots(run) * probe_s,
        lead_s=lead_s,
        deadline_s=run.timing.upload_deadline_blocks * run.timing.block_time_s,
    )


@dataclass(frozen=True)
class Sizing:
    """Whole blocks per window and inner steps that reach ``target`` busy on a box."""

    blocks_per_window: int
    inner_steps: int
    busy: float


def suggest(
    run: RunConfig, box: Box, target: float = TARGET_BUSY, decode_rate: float | None = None
) -> Sizing:
    """The shortest window (whole blocks) whose exchange, the lead's probes included, fits
    beside ``target`` of training (``outer.delay = 0``), and the inner steps (at the run's
    batch) that fill that share of it."""
    p = plan(run, box, decode_rate)
    block = run.timing.block_time_s
    step_s = p.compute_s / run.inner_steps
    blocks = max(1, math.ceil(p.exchange_s / (1 - target) / block))
    while True:
        steps = max(1, math.floor((blocks * block - p.exchange_s) / step_s))
        if steps * step_s >= target * blocks * block:
            return Sizing(blocks, steps, steps * step_s / (blocks * block))
        blocks += 1
