"""The peer: one outer step per window, resumable, tolerant of every other node failing.

`Peer.run_window` is the whole per-window flow, top to bottom:

1. train the H inner steps on the samples assigned to (run, uid, window), from the window's
   starting weights ``θ_w``. With ``outer.delay = 1`` (docs/training.md) window ``w − 1``'s
   exchange is in the air meanwhile; as soon as it lands (before the first inner step or between
   two), its outer step is taken on the window's origin and on the live weights alike: the
   origin becomes ``θ_{w+1} = θ_w − α · step(mean_{w−1})``;
2. encode the pseudo-gradient ``origin − θ`` with the run's strategy (SparseLoCo: error feedback
   and compression) and launch its exchange (`miner.flight`): sign and upload to our own
   bucket before the deadline; at the gather point gather the selected peers' updates, verify and
   decode them strictly and agree on the window's set (the lead validator's manifest,
   `node.window.consensus`). With ``delay = 0`` it runs now, then we step:
   ``θ_{w+1} = θ_w − α · step(mean_w)``;
3. a window whose start had forked from the lead validator's is rebuilt from the validators'
   published history before its step is taken;
4. the model moves to the origin of the next window; publish our parameter fingerprint and save
   the local state atomically, with the exchange still in the air, so a restart resumes it.
5. append the window's report to the (rotated) local log and prune our bucket's old objects
   (`node.runtime.retention`).

Where the exchange is between these steps (idle, in the air, landed, forked, a mean held) is one
named state with its transitions in `miner.exchange_cycle`; the window's log line and the
metrics show it.

Every read and write of the weights outside the inner steps (the start copy, the pseudo-gradient,
the outer step, the fingerprint, the state file, a history replay) goes through `self.weights`
(`miner.weights`): whole tensors for one process and DDP, FSDP2 shards under
``--sharding fsdp2`` (`miner.sharded_weights`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from substrateinterface import Keypair

from codec.spec import ModelSpec
from miner.exchange_cycle import FORKED, HELD, IN_THE_AIR, LANDED, ExchangeCycle, ExchangeState
from miner.flight import Flight, Route
from miner.metrics import PeerMetrics
from miner.multigpu import peer_weights
from miner.ranks import Ranks
from miner.train import InnerResult, make_optimizer, train_window
from node.data.batches import assigned_batches, open_run_dataset
from node.model.llama import build_model
from node.runtime.clock import ChainClock
from node.runtime.logs import fields
from node.runtime.memory import PLAIN, MemoryOptions
from node.runtime.phases import Phases
from node.runtime.preflight import explain_os_error
from node.runtime.progress import tracked
from node.runtime.report_log import REPORTS, append_line
from node.runtime.retention import BackgroundPruner
from node.runtime.state import (
    PeerState,
    check_restored,
    load_error_feedback,
    load_state,
    restoring,
    save_ef_shard,
    save_state,
)
from node.strategy import make_strategy
from node.strategy.aggregator import Aggregator
from node.strategy.outer import OuterOptimizer, land_by_step
from node.window.exchange import encode_signed, put_until
from node.window.history import catch_up_any, history_sources, resync
from node.window.pooled import PooledExchange
from protocol.chain.base import Chain
from protocol.naming import fingerprint_key
from protocol.runconfig import RunConfig
from protocol.stores import ObjectStore, StoreError

log = logging.getLogger(f"tessera.{__name__}")

FINGERPRINT_RETRY_S = 30.0
"""How long a fingerprint upload that failed for a reason that may pass is tried again."""


@dataclass
class WindowReport:
    """What one window did on this peer (also what the simulation's report shows)."""

    window: int
    exchanged: int | None  # the window whose exchange the fields below describe (w − delay)
    loss: float
    tokens_per_s: float
    upload_bytes: int
    upload_s: float
    download_bytes: int
    gathered: list[int]
    dropped: dict[int, str]
    applied: list[int]
    agreed_by: str
    fingerprint: str
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # per phase, and in all


class Peer:
    """A peer bound to one run, one hotkey, one chain and its own bucket."""

    def __init__(
        self,
        run: RunConfig,
        keypair: Keypair,
        chain: Chain,
        store: ObjectStore,
        state_dir: Path,
        local_root: Path | None = None,
        device: str = "cpu",
        ranks: Ranks | None = None,
        memory: MemoryOptions = PLAIN,
        exchange_workers: int = 0,
    ) -> None:
        self.cfg, self.keypair, self.chain, self.store = run, keypair, chain, store
        self.memory = memory  # how the inner loop trades compute for memory
        self.ranks = ranks or Ranks()  # the devices of a multi-GPU peer (`miner.multigpu`)
        self.state_dir, self.local_root = state_dir, local_root
        self.device = torch.device(device)
        self.clock = ChainClock(chain, run)
        self.model = build_model(run.model, run.seed).to(self.device)
        self.spec = ModelSpec.from_module(self.model)
        # what the inner steps train: DDP, the model sharded in place (FSDP2) or itself; the
        # optimizer comes after, with the parameters as they are trained
        self.trainer = self.ranks.wrap(self.model)
        self.optimizer = make_optimizer(self.model, run)
        self.strategy = make_strategy(
            run, self.spec, self.device, owned=self.ranks.shard_of(self.spec)
        )
        # how the peer reads and writes its weights (`miner.weights`): whole or sharded
        self.weights = peer_weights(
            self.ranks, self.model, self.optimizer, self.strategy, self.spec
        )
        _, self.dataset = open_run_dataset(run)
        self.uid = self._registered_uid()
        # worker processes that decode and sum the gathered updates (`node.window.pooled`); FSDP2
        # ranks each sum their own rows instead (`miner.sharded_mean`)
        pooled = self.ranks.is_main and not self.ranks.sharded
        self.pooled = PooledExchange.start(run, self.spec, exchange_workers) if pooled else None
        self.metrics = PeerMetrics(run.timing.blocks_per_window * run.timing.block_time_s)
        self.metrics.identify(self.uid, keypair.ss58_address, run.run_id)
        self.pruner = BackgroundPruner(store, run, self.uid, keypair.ss58_address)
        self.route = Route(  # where rank 0's exchanges go (`miner.flight`)
            run, self.spec, chain, self.clock, store, self.uid, keypair.ss58_address, local_root,
            self.pooled, log,
        )  # fmt: skip
        self.delay = run.outer.delay
        self.exchange = ExchangeCycle(self.strategy.outer)  # `miner.exchange_cycle`
        self.metrics.watch(self.exchange)
        self._origin: dict[str, torch.Tensor] = {}  # what this window's pseudo-gradient is from
        self.next_window = self._restore()

    # -- the window --------------------------------------------------------------------------

    def run_window(self, window: int) -> WindowReport:
        phases = Phases(window, log)  # each phase logged with its duration
        self._origin, start_fp = self.weights.start(), self.weights.fingerprint()
        with phases("train", f"{self.cfg.inner_steps} inner steps"):
            self._step_when_landed()  # delay 1: window - 1's step as soon as its exchange
            inner = self._train(window)  # lands, here or between two inner steps
        if self.exchange.state is IN_THE_AIR:  # delay 1: it lands before we encode
            with phases("wait for the exchange of the last window"):
                self._land_and_step(live=True)
        with phases("encode"):
            sent = self._encode(self._origin, window)
        self._launch(window, sent, start_fp)
        if not self.delay:
            with phases("exchange and outer step"):
                self._land_and_step(live=False)
        self._resync_forked()
        self.weights.advance(self._origin)
        with phases("fingerprint and save"):
            fp = self._publish_fingerprint(window)
            self._save(window + 1, fp)
        return self._report(window, inner, fp, phases)

    def run(self, windows: int) -> list[WindowReport]:
        """Train `windows` windows, starting at the current one, resuming from saved state; stop
        sooner once the run is over (its last window, ``outer.total_windows − 1``, trained)."""
        reports = []
        for _ in range(windows):
            window = self.ranks.broadcast_object(max(self.next_window, self.current_window()))
            if self.next_window < window < self.cfg.outer.total_windows:
                window = self.catch_up(window)  # every rank replays the same history identically
            if window >= self.cfg.outer.total_windows:
                last = self.cfg.outer.total_windows - 1
                log.info("the run is over: its last window, %d, has passed", last)
                break
            reports.append(self.run_window(window))
            if not self.ranks.is_main:  # rank 0 reports for the whole peer
                continue
            self._record(reports[-1])
            append_line(self.state_dir / REPORTS, json.dumps(dataclasses.asdict(reports[-1])))
            self.pruner.start(reports[-1].window)  # never in the next window's way
            log.info(
                "window %d: loss %.4f, %.0f tok/s, %d B up in %.2fs, gathered %s, fingerprint %s; "
                "exchange: %s; done in %.1f s, window %d opens in %.0f s",
                window, reports[-1].loss, reports[-1].tokens_per_s, reports[-1].upload_bytes,
                reports[-1].upload_s, reports[-1].gathered, reports[-1].fingerprint[:12],
                self.exchange.describe(), reports[-1].seconds["window"], window + 1,
                self._opens_in(window + 1),
                extra=fields(
                    window=window, loss=reports[-1].loss, tokens_per_s=reports[-1].tokens_per_s,
                    upload_bytes=reports[-1].upload_bytes, download_bytes=reports[-1].download_bytes,
                    gathered=reports[-1].gathered, applied=reports[-1].applied,
                    seconds=reports[-1].seconds, exchange=self.exchange.describe(),
                ),
            )  # fmt: skip
        if self.exchange.state is IN_THE_AIR:  # land the last one: the saved state holds its mean
            self._land_and_hold()
            self._save(self.next_window, self.weights.fingerprint())
        self.pruner.wait()
        return reports

    def catch_up(self, window: int) -> int:
        """Replay what we missed from the validators' published history, best-staked first;
        returns the window to train next.

        The newest aggregate is published shortly after its window's deadline, so a peer that
        wakes up early in a window waits for it (a window at most) instead of training on stale
        weights. A peer that gives up trains the window open by then, not the one it woke in:
        that one's upload would be late.
        """
        give_up = (
            time.monotonic() + self.clock.schedule.blocks_per_window * self.cfg.timing.block_time_s
        )
        self._land_and_hold()  # the replay starts from next_window with its held aggregate
        while self.next_window < window:
            self.next_window = self.weights.replay(partial(self._replay, self.next_window, window))
            self.exchange.replayed()  # the replay holds the mean of its last window (delay 1)
            if self.next_window >= window:
                log.info("caught up to window %d", window)
            elif self.ranks.broadcast_object(time.monotonic() > give_up):
                log.error(
                    "missed windows %d..%d and no validator history replays them yet: training "
                    "on stale weights until a checkpoint is published",
                    self.next_window,
                    window - 1,
                )
                break
            else:
                time.sleep(self.cfg.timing.block_time_s)
                window = self.ranks.broadcast_object(max(window, self.current_window()))
        return window

    def _replay(
        self,
        from_window: int,
        to_window: int,
        model: torch.nn.Module,
        aggregator: Aggregator,
        outer: OuterOptimizer,
    ) -> int:
        """Rank 0 replays the validators' history (`Weights.replay` shares the result)."""
        sources = history_sources(self.chain, self.local_root)
        return catch_up_any(model, aggregator, outer, sources, from_window, to_window)

    def _record(self, r: WindowReport) -> None:
        m = self.metrics
        m.loss.set(r.loss)
        m.tokens_per_s.set(r.tokens_per_s)
        m.bytes_up.inc(r.upload_bytes)
        m.bytes_down.inc(r.download_bytes)
        total = len(r.gathered) + len(r.dropped)
        m.gather_ok.set(len(r.gathered) / total if total else 0.0)
        m.window_lag.set(self.current_window() - r.window)
        m.finished(r.window, r.seconds)

    def current_window(self) -> int:
        return self.clock.current_window()

    def _opens_in(self, window: int) -> float:
        """Seconds until `window`'s first block, by the chain's block time (0 if it is open)."""
        blocks = self.clock.schedule.first_block(window) - self.chain.block()
        return max(0.0, blocks * self.cfg.timing.block_time_s)

    # -- steps -------------------------------------------------------------------------------

    def _batches(self, window: int) -> Iterable[torch.Tensor]:
        """The window's inner batches: the samples the run assigns this peer's uid."""
        return assigned_batches(
            self.dataset,
            self.cfg.run_id,
            self.uid,
            window,
            self.cfg.inner_steps,
            self.cfg.batch_size,
        )

    def _train(self, window: int) -> InnerResult:
        rows = map(self.ranks.local_rows, self._batches(window))
        steps = tracked(rows, f"window {window} (uid {self.uid})", total=self.cfg.inner_steps)
        on_step = (lambda step, _loss: self._step_when_landed(step)) if self.delay else None
        inner = train_window(
            self.trainer, self.optimizer, steps, self.cfg, window, self.device, on_step,
            self.memory,
        )  # fmt: skip
        return self.ranks.reduce_inner(inner)

    def _encode(self, start: dict[str, torch.Tensor], window: int) -> list:
        """This rank's tensors' pseudo-gradients, encoded by the strategy (with its state)."""
        return self.strategy.encoder.encode(self.weights.deltas(start), window)

    def _launch(self, window: int, sent: list, start_fp: str) -> None:
        """Sign our update (rank 0 holds every rank's pieces) and start its exchange."""
        full = self.ranks.gather_pieces(sent, self.spec)
        data = None
        if self.ranks.is_main:
            data = encode_signed(full, self.cfg, self.spec, window, self.uid, self.keypair)
        self.exchange.launch(self._fly(window, start_fp, data, resume=False))

    def _fly(self, window: int, start_fp: str, data: bytes | None, resume: bool) -> Flight:
        """A flight for our update of `window`: rank 0 runs its exchange (in the background with
        ``delay = 1``); the other ranks' flights carry no work."""
        work = None
        if self.ranks.is_main and data is not None:
            work = partial(self.route.exchange, window, data, start_fp, resume)
        return Flight(window, start_fp, data, work, background=bool(self.delay))

    def _step_when_landed(self, step: int = -1) -> None:
        """With ``delay = 1``, at the start of a window (``step`` −1) and after each inner step:
        take the outer step of window - 1 once its exchange has landed (or of a mean a replay
        held). After `land_by_step` inner steps the peer waits for it: a step that lands after
        the window's training makes the schedule unstable (docs/training.md)."""
        due = step + 1 >= land_by_step(self.cfg.inner_steps)
        air = self.exchange.air
        if self.ranks.broadcast_object(air is not None and (due or air.done())):
            self._land_and_step(live=True)
        elif self.exchange.state is HELD:
            self._step(live=True)

    def _land_and_step(self, live: bool) -> None:
        """Land the exchange, take its mean in and take the outer step on the window's origin (and
        on the live weights while they still train); a fork waits for `_resync_forked`: the
        resync replaces the weights, once they are encoded."""
        if self._land() is LANDED:
            self.exchange.take_in(self._mean)
            self._step(live)

    def _land_and_hold(self) -> None:
        """Land the exchange in the air (``delay = 1``) and hold its mean: the model stays at the
        start of the next window, where a replay or the next window takes over."""
        if self.exchange.state is not IN_THE_AIR:
            return
        if self._land() is FORKED:
            self.exchange.resync(self._resync)
        self.exchange.take_in(self._mean)

    def _resync_forked(self) -> None:
        """After encoding: a landed window whose start we did not share is rebuilt from the
        validators' history, then its step taken."""
        if self.exchange.state is not FORKED:
            return
        self.exchange.resync(self._resync)
        self.exchange.take_in(self._mean)
        self._origin = self.weights.start()
        self._step(live=False)

    def _land(self) -> ExchangeState:
        """Wait for the exchange in the air (before the next encode): landed, or forked from the
        lead's start. Our own update is spent whether the window applied it or not
        (`node.strategy.sparseloco`)."""
        return self.exchange.land(self._forked)

    def _step(self, live: bool) -> None:
        """The origin moves by the outer step with the held mean; the live weights follow."""
        new = self.exchange.step(self._origin)
        if live:
            self.weights.move(new, self._origin)
        self._origin = new

    def _mean(self, flight: Flight) -> dict[str, torch.Tensor]:
        """This rank's mean of the window's agreed updates (rank 0 holds them; `Weights.mean`)."""
        done = flight.result()
        agreed = (done.agreed.updates if done else {}) if self.ranks.is_main else None
        return self.weights.mean(agreed, self.pooled)

    def _forked(self, flight: Flight) -> bool:
        """Whether the landed window agreed on a start other than ours (every rank is told)."""
        done = flight.result()
        return self.ranks.broadcast_object(done is not None and done.agreed.forked)

    def _resync(self, flight: Flight) -> None:
        """Our weights differed from the lead validator's at the start of the flight's window:
        rebuild them and the outer state from the validators' published history, then (with
        ``delay = 1``) step to the start of the next window, the one we trained. A failed
        rebuild is reported; the next window's manifest finds us forked again and retries."""
        done = flight.result()
        target = done.agreed.lead_fingerprint if done is not None else None

        def rebuild(  # on rank 0
            model: torch.nn.Module, aggregator: Aggregator, outer: OuterOptimizer
        ) -> None:
            log.warning("window %d: forked from the validator: resyncing", flight.window)
            sources = history_sources(self.chain, self.local_root)
            if not resync(model, aggregator, outer, sources, flight.window, target):
                log.error(
                    "window %d: still forked from the validator (no published history rebuilds "
                    "its model); retrying at the next window", flight.window,
                )  # fmt: skip

        self.weights.replay(rebuild)
        self.weights.advance()  # delay 1: the mean held at that start

    def _report(self, window: int, inner: InnerResult, fp: str, phases: Phases) -> WindowReport:
        landed = self.exchange.report()
        done = landed.result() if landed is not None else None
        fetched = done.fetched if done is not None else {}
        agreed = done.agreed if done is not None else None
        return WindowReport(
            window=window,
            exchanged=landed.window if landed is not None else None,
            loss=inner.mean_loss,
            tokens_per_s=inner.tokens_per_s,
            upload_bytes=done.upload_bytes if done is not None else 0,
            upload_s=done.upload_s if done is not None else math.nan,
            download_bytes=sum(f.n_bytes for f in fetched.values()),
            gathered=[u for u, f in fetched.items() if f.ok],
            dropped={u: f.reason for u, f in fetched.items() if not f.ok},
            applied=sorted(agreed.updates) if agreed else [],
            agreed_by=agreed.note if agreed else "",
            fingerprint=fp,
            seconds={**(done.seconds if done else {}), **phases.seconds, "window": phases.elapsed},
        )

    def _publish_fingerprint(self, window: int) -> str:
        fp = self.weights.fingerprint()
        if not self.ranks.is_main:
            return fp
        body = {"run_id": self.cfg.run_id, "window": window, "uid": self.uid, "fingerprint": fp}
        key = fingerprint_key(self.cfg.run_id, window, self.uid, self.keypair.ss58_address)
        # validators read it at the next gather: a blip must not make us out of sync, nor may a
        # store that stays down hold up the next window's training for long
        until = min(self.clock.deadline_s(window + 1), time.time() + FINGERPRINT_RETRY_S)
        try:
            put_until(self.store, key, json.dumps(body).encode(), until)
        except StoreError as exc:
            log.error("window %d: fingerprint upload failed: %s", window, exc)
        return fp

    # -- state -------------------------------------------------------------------------------

    def _registered_uid(self) -> int:
        from protocol.chain.errors import NotRegistered

        hotkey, netuid = self.keypair.ss58_address, self.chain.netuid
        uid = self.chain.uid_of(hotkey)
        if uid is None:
            raise NotRegistered(
                hotkey,
                netuid,
                f"register it with `btcli subnet register --netuid {netuid}` (on a local chain: "
                f"`tessera chain register --db PATH --hotkey {hotkey}`)",
            )
        return uid

    def _save(self, next_window: int, fp: str) -> None:
        self.next_window = next_window
        try:
            self._write_state(next_window, fp)
        except OSError as exc:  # the previous state is intact; stop with a clear reason
            raise explain_os_error(exc, self.state_dir) from exc

    def _write_state(self, next_window: int, fp: str) -> None:
        weights = self.weights.state()  # whole tensors on rank 0 (FSDP2: gathered from all)
        if not self.ranks.is_main:  # EF shards first: a state.pt on disk finds all of its own
            ef = self.strategy.encoder.local_state_dict()
            save_ef_shard(self.state_dir, self.cfg.run_id, next_window, self.ranks.rank, ef)
        self.ranks.barrier()
        if weights is None:  # the other ranks
            return
        save_state(
            self.state_dir,
            PeerState(
                run_id=self.cfg.run_id,
                window=next_window,
                model=weights.model,
                optimizer=weights.optimizer,
                error_feedback=self.strategy.encoder.local_state_dict(),
                fingerprint=fp,
                outer=weights.outer,
                inflight=self.exchange.record(),
            ),
        )

    def _restore(self) -> int:
        state = self.weights.read(partial(load_state, self.state_dir, self.cfg.run_id))
        if state is None:
            return 0
        with restoring(self.state_dir):
            self.weights.load(state)  # model, inner optimizer, outer state
            ef = load_error_feedback(self.state_dir, state)
            encoder = self.strategy.encoder
            encoder.load_local_state_dict({t.name: ef[t.name] for t in encoder.owned.tensors
                                           if t.name in ef})  # fmt: skip
        self.exchange.replayed()  # a mean the saved state holds is the next step's
        restored = self.ranks.broadcast_object(self.weights.fingerprint())
        check_restored(self.state_dir, restored, state.fingerprint)
        if state.inflight:
            self.exchange.resume(self._resume(state.inflight))
        log.info("resumed at window %d (fingerprint %s)", state.window, state.fingerprint[:12])
        return state.window

    def _resume(self, record: dict) -> Flight:
        """The exchange that was in the air when the state was saved, started again from our own
        signed update (rank 0 runs it)."""
        data = record["update"].numpy().tobytes() if self.ranks.is_main else None
        log.info("resuming the exchange of window %d", record["window"])
        return self._fly(record["window"], record["fingerprint"], data, resume=True)
