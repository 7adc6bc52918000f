"""The validator: one `run_window` per window, top to bottom (the maths: docs/incentives.md).

1. read the window's roster from its pinned chain snapshot (`node.window.consensus`) and, while
   waiting for its gather point (deadline + skew tolerance, exactly when peers gather), take the
   probe's passes that need no update (`probe_start`);
2. fetch every peer's update and fingerprint under the run's hard budget (`fetching`) and
   classify them (`classify`: missing / late / invalid / malformed / copy / replay / sync);
3. agree on the window's set (`agreement`): the lead validator probes the selected updates that
   passed for evidence of training (`admission`), publishes the aggregate bytes and the signed
   manifest of the ones it admits; any other validator follows the lead's manifest (resyncing
   first if it forked), as peers do; norm outliers are judged against the applied set;
4. score the updates that passed against the model at the start of the window (`scoring`,
   `window_scores`), on samples drawn from the window's secret, committed to before the window
   (`reveal`);
5. update ratings, EMAs and penalties (`ratings`);
6. take the window's one outer step (`node.strategy`) and publish our fingerprint;
7. every M windows set weights on chain (`weights`);
8. publish the score report (revealing the window's secret), the commitment of a later window,
   and every N windows a checkpoint and the run config;
9. save the whole state atomically.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

import torch
from substrateinterface import Keypair

from codec.spec import ModelSpec
from node.data.batches import open_run_dataset
from node.model.fingerprint import fingerprint
from node.model.llama import build_model
from node.runtime.clock import ChainClock
from node.runtime.logs import fields
from node.runtime.preflight import write_rate
from node.runtime.report_log import REPORTS, append_line
from node.runtime.resilient_chain import chain_was_down, keep_outages
from node.runtime.retention import BackgroundPruner
from node.strategy import make_strategy
from node.strategy.format import Decoded
from node.window.buckets import PeerBucket
from node.window.consensus import (
    Agreement,
    Roster,
    last_publish_block,
    roster_block,
    wait_for_manifest,
    window_roster,
)
from node.window.gather import Pieces
from node.window.history import Source, history_sources, publish_checkpoint, resync
from node.window.pooled import mean_of_stored, open_pool
from protocol.chain.base import Chain
from protocol.chain.errors import BlockPruned, NotRegistered
from protocol.naming import fingerprint_key, run_prefix, scores_key
from protocol.runconfig import RunConfig
from protocol.stores import ObjectStore, StoreError
from protocol.stores.spool import SpoolError
from validator.admission import Admission, admit, probe_order, publish_reserve
from validator.agreement import Decider, adopt, follow, mark_equivocations, propose, publish_history
from validator.classify import (
    Measured,
    PeerCheck,
    applied_sketch,
    check_window,
    mark_norm_outliers,
    measure,
)
from validator.config import ValidatorConfig
from validator.fetching import Upload, clear_spool, fetch_uploads, window_spool
from validator.metrics import ValidatorMetrics
from validator.probe_start import ProbeStart
from validator.probe_state import probe_keep
from validator.ratings import window_outcomes
from validator.reports import ScoreReport, WindowResult, build_report
from validator.reveal import (
    COMMIT_AHEAD,
    SampleReveal,
    commit_key,
    signed_commit,
    window_reveal,
)
from validator.startup import begin, skip_pruned
from validator.state import OUTAGES_FILE, ValidatorState, save_state
from validator.weights import normalise, set_weights
from validator.window_scores import SCORABLE, WindowScorer

log = logging.getLogger(f"tessera.{__name__}")


def run_manifest_key(run_id: str) -> str:
    """Where the validator publishes the run config whose hash is the run id."""
    return f"{run_prefix(run_id)}run.json"


WRAP_UP_MARGIN = 2.0
"""How much slower than last time the work after scoring (outer step, weights, publishing, state)
may turn out: scoring stops that much before the next gather block."""


EARLY_ROSTER_BLOCKS = 3
"""How far the chain must be past a window's roster block for the roster to be read before the
gather (a block is final, so readable, about two blocks after it)."""


class Validator:
    """A validator bound to one run, one hotkey (with a validator permit), one chain and bucket."""

    def __init__(
        self,
        run: RunConfig,
        keypair: Keypair,
        chain: Chain,
        store: ObjectStore,
        state_dir: Path,
        cfg: ValidatorConfig | None = None,
        local_root: Path | None = None,
        device: str = "cpu",
        exchange_workers: int = 0,
    ) -> None:
        self.run, self.keypair, self.chain, self.store = run, keypair, chain, store
        self.cfg = cfg or ValidatorConfig()
        self.state_dir, self.local_root = state_dir, local_root
        self.device = torch.device(device)
        self.clock = ChainClock(chain, run)
        self.model = build_model(run.model, run.seed).to(self.device)
        self.spec = ModelSpec.from_module(self.model)
        self.strategy = make_strategy(run, self.spec, self.device)
        # worker processes that decode and sum the window's applied updates (`codec.pool`)
        self.pool = open_pool(run, self.spec, exchange_workers)
        _, self.dataset = open_run_dataset(run)
        uid = chain.uid_of(keypair.ss58_address)
        if uid is None:
            raise NotRegistered(keypair.ss58_address, chain.netuid, "register it as a validator")
        self.uid = uid
        self.pruner = BackgroundPruner(store, run, uid, keypair.ss58_address)
        self._reveal: SampleReveal | None = None  # the secret of the window being scored
        self._wrap_up_s: float | None = None  # the last window's work after scoring
        self._publish_s: float | None = None  # the last decision's publishing, as the lead
        self._write_rate: float | None = None  # our bucket's, measured as the windows start
        self._fetch_s = 0.0  # how long this window's fetch took
        # the last outer step (on the host) and the weights it reached, while no two peers earn
        self._last_step: tuple[str, dict[str, torch.Tensor]] | None = None
        self.metrics = ValidatorMetrics(run.timing.blocks_per_window * run.timing.block_time_s)
        self.metrics.identify(uid, keypair.ss58_address, run.run_id)
        clear_spool(state_dir)  # a crashed run's spool files
        keep_outages(self.chain, state_dir / OUTAGES_FILE)  # what an earlier run saw too
        self._restore()

    # -- the window --------------------------------------------------------------------------

    def run_window(self, window: int) -> ScoreReport:
        early, start = self._before_gather(window)  # the roster and the probe's start, if live
        self.clock.wait_for_block(self.clock.gather_block(window))
        live = window >= self.current_window() - 1  # else a window long past: catching up
        roster = early or window_roster(self.chain, self.run, window, self.local_root)
        hotkeys, buckets, no_bucket = _members(roster)
        with window_spool(self.state_dir, window) as spool:  # the updates' bytes, until stepped
            uploads = self._fetch(window, list(buckets.values()), spool, roster.selected)
            rated = uploads is not None  # else our disk failed: nobody is judged on it
            uploads = uploads or {}
            checks = check_window(
                window, hotkeys, uploads, no_bucket, self.fingerprint if window > 0 else None,
                self.history, self.run, self.spec, self.cfg, self.salt, self.strategy.format,
            )  # fmt: skip
            scorer = self._scorer(window, checks, start) if live and rated else None
            agreed = self._agree(window, roster, uploads, checks, spool, scorer)
            if agreed.forked and scorer is not None:  # resynced: probe the model we now hold
                scorer = self._scorer(window, checks, start)
            mark_norm_outliers(checks, sorted(agreed.updates), self.cfg.norm_ratio)
            until = self._scoring_deadline(window)
            losses = scorer.rest(until, sorted(agreed.updates)) if scorer else {}
            scored = time.monotonic()
            if rated:
                if down := chain_was_down(self.chain, *self.clock.window_span_s(window)):
                    log.warning("window %d: the chain failed us in it: lateness excused", window)
                self.book.update(
                    window_outcomes(checks, losses, agreed.updates), chain_was_down=down
                )
            sketches = [c.sketch for c in checks.values() if c.sketch is not None]
            sketches.append(applied_sketch(
                window, agreed.updates, checks, self.spec, self.run, self.cfg, self.salt,
                self.strategy.format,
            ))  # fmt: skip
            self.history.add(window, sketches)
            start_fp = self.fingerprint
            self._outer_step(window, agreed, keep=self.book.launching(hotkeys))
        weights = normalise(self.book.final_scores(), set(hotkeys))
        status = self._maybe_set_weights(window, weights, live)
        report = build_report(
            self._result(window, start_fp, roster.selected, sorted(agreed.updates), weights, status),
            checks, losses, self.book,
        )  # fmt: skip
        self._publish(window, report)
        self._save(window + 1)
        self._wrap_up_s = time.monotonic() - scored
        return report

    def run_windows(self, windows: int) -> list[ScoreReport]:
        """Process `windows` windows in order from the saved position (never skipping one: the
        model must replay every aggregate; windows already past are fetched without waiting)."""
        reports = []
        if self._write_rate is None:  # our bucket's, for a first publish: before any window
            self._write_rate = write_rate(self.store)
        for _ in range(windows):
            begun = time.monotonic()
            try:
                report = self.run_window(self.next_window)
            except BlockPruned as exc:  # down too long for a non-archive node: replay, go on
                self._skip_pruned(exc)
                continue
            reports.append(report)
            self._record(report, time.monotonic() - begun)
        self.pruner.wait()
        return reports

    def _record(self, report: ScoreReport, seconds: float) -> None:
        """A decided window in the metrics, the local report log and the log; our bucket pruned."""
        took = {"window": seconds, "after scoring": self._wrap_up_s or 0.0}
        self.metrics.record(report, took)
        append_line(self.state_dir / REPORTS, report.model_dump_json())
        self.pruner.start(report.window)  # never in the next window's way
        log.info(
            "window %d: aggregated %s, weights %s (%s)", report.window, report.aggregated,
            {u: round(w, 3) for u, w in report.weights.items()}, report.weights_status,
            extra=fields(
                window=report.window, aggregated=report.aggregated, weights=report.weights,
                verdicts={p.uid: p.verdict.value for p in report.peers}, seconds=took,
            ),
        )  # fmt: skip

    def current_window(self) -> int:
        return self.clock.current_window()

    # -- steps -------------------------------------------------------------------------------

    def _fetch(
        self, window: int, buckets: list[PeerBucket], spool: Path, selected: Collection[int]
    ) -> dict[int, Upload] | None:
        """Every peer's upload (bodies in `spool`; the `selected` updates in a pool of their own),
        each measured for the checks while the fetch has it decoded: the manifest the peers wait
        for then costs one decode per update. None when our spool failed (a full disk): the lead
        then decides that the window applies nothing, a follower takes the lead's copies, and
        nobody is scored or rated on it."""
        run, spec, cfg, salt = self.run, self.spec, self.cfg, self.salt
        fmt = self.strategy.format

        def take(uid: int, update: Decoded) -> Measured:
            return measure(uid, update, window, spec, run, cfg, salt, fmt)

        deadline_s = self.clock.deadline_s(window)
        begun = time.monotonic()
        try:
            uploads = fetch_uploads(buckets, run, spec, window, deadline_s, spool, take, selected)
        except SpoolError as exc:
            log.error(
                "window %d: cannot keep the updates (%s): free space under %s; this window "
                "applies nothing we decide and rates nobody", window, exc, self.state_dir,
            )  # fmt: skip
            return None
        got = sum(up.fetched.ok for up in uploads.values())
        self._fetch_s = time.monotonic() - begun
        log.info(
            "window %d: fetched %d of %d peers' updates in %.1f s", window, got, len(buckets),
            self._fetch_s,
        )  # fmt: skip
        return uploads

    def _agree(
        self,
        window: int,
        roster: Roster,
        uploads: Mapping[int, Upload],
        checks: Mapping[int, PeerCheck],
        spool: Path,
        scorer: WindowScorer | None,
    ) -> Agreement:
        """As a deciding validator (the lead or the standby): decide which selected updates show
        training (`validator.admission`), publish the window's set and apply the deciders'
        manifest that counts. Otherwise: follow it, waiting for it up to the window's settle block
        (our scores can wait, the agreement cannot). The aggregate we publish is written in
        `spool`, one update read back at a time."""
        if roster.decider(self.uid) is not None:
            admission = self._admit(roster, checks, uploads, scorer)
            begun = time.monotonic()
            me = Decider(self.store, self.run, self.spec, self.keypair, spool, self.chain)
            proposed = propose(me, roster, checks, uploads, self.fingerprint, admission)
            self._publish_s = time.monotonic() - begun
            agreed = adopt(me, roster, uploads, self.fingerprint, proposed)
        else:
            manifest = wait_for_manifest(roster, self.run, window, self.chain)
            agreed = follow(roster, uploads, manifest, self.fingerprint, self.run, self.spec)
            publish_history(
                self.store, self.run, self.keypair, window, self.uid, agreed, uploads, spool
            )
        for uid in mark_equivocations(checks, agreed):
            log.warning("window %d: uid %d equivocated: %s", window, uid, checks[uid].detail)
        if agreed.forked:
            self._resync(window, agreed.lead_fingerprint)
        return agreed

    def _resync(self, window: int, lead_fingerprint: str | None) -> None:
        """Our start of `window` differs from the lead's: rebuild it from the other validators'
        history; a failure is reported, and the next window's manifest retries it."""
        log.warning("window %d: forked from the lead validator: resyncing", window)
        others = self._other_sources()
        s = self.strategy
        if resync(self.model, s.aggregator, s.outer, others, window, lead_fingerprint):
            self.fingerprint = fingerprint(self.model)
            return
        log.error(
            "window %d: still forked from the lead validator (no published history rebuilds "
            "its model); retrying at the next window", window,
        )  # fmt: skip

    def _before_gather(self, window: int) -> tuple[Roster | None, ProbeStart | None]:
        """While we wait for a live window's gather block, once its roster block is final: the
        roster, and the probe's passes at the window's start for its selected peers
        (`validator.probe_start`), until the gather block."""
        settled = roster_block(self.run, window) + EARLY_ROSTER_BLOCKS
        left = self.clock.seconds_until(self.clock.gather_block(window))
        if window < self.current_window() - 1 or self.chain.block() < settled or left <= 0:
            return None, None
        roster = window_roster(self.chain, self.run, window, self.local_root)
        reveal = window_reveal(self.reveal_key, self.dataset, self.run, window, self.cfg)
        start = ProbeStart(
            self.model, self.run, self.dataset, window, reveal, self.cfg, self.device,
            self.strategy.format, self.fingerprint,
        )  # fmt: skip
        selected = {u: roster.hotkey(u) or "" for u in roster.selected}
        if self.book.launching(selected):
            start.use_previous(self._previous_step())
        until = time.monotonic() + left
        order = probe_order(self.run.run_id, window, list(selected), self.book.earning(selected))
        done = start.prepare(order, lambda: time.monotonic() > until)  # as the lead will probe
        log.info(
            "window %d: the probe's passes at the start taken before the gather for %d of %d "
            "selected peers", window, done, len(roster.selected),
        )  # fmt: skip
        return roster, start

    def _previous_step(self) -> dict[str, torch.Tensor] | None:
        """The step that led to our weights, kept while no two peers earn (the launch covariate)."""
        last = self._last_step
        return last[1] if last is not None and last[0] == self.fingerprint else None

    def _scorer(
        self, window: int, checks: Mapping[int, PeerCheck], start: ProbeStart | None = None
    ) -> WindowScorer | None:
        """The window's probe on the samples of its secret (`validator.reveal`), on the passes
        `start` took before the gather while our weights are still the ones it took them on;
        None when no update can be scored."""
        self._reveal = None
        if not any(c.verdict in SCORABLE for c in checks.values()):
            return None
        self._reveal = window_reveal(self.reveal_key, self.dataset, self.run, window, self.cfg)
        start = start if start is not None and start.fingerprint == self.fingerprint else None
        return WindowScorer(
            self.model, self.run, self.dataset, window, self._reveal, checks, self.book,
            self.cfg, self.device, self.strategy.format, self._previous_step(), start,
        )  # fmt: skip

    def _admit(
        self,
        roster: Roster,
        checks: Mapping[int, PeerCheck],
        uploads: Mapping[int, Upload],
        scorer: WindowScorer | None,
    ) -> Admission:
        """The lead's evidence on the selected updates (those of peers without earning evidence
        first), scored until its last block to publish less room to publish (`publish_reserve`)."""
        window = roster.window
        left = max(0.0, self.clock.seconds_until(last_publish_block(self.run, window)))
        if left <= 0:  # a window long past (catching up): nothing we decide can count
            return Admission(frozenset())
        passed = [u for u in roster.selected if u in checks and checks[u].ok]
        sizes = {u: up.body.size for u, up in uploads.items() if up.body}
        applied = sum(sizes.get(u, 0) for u in passed)
        reserve = publish_reserve(
            left, self._publish_s, applied, sum(sizes.values()), self._fetch_s, self._write_rate
        )
        until = time.monotonic() + left - reserve
        established = self.book.earning({u: checks[u].hotkey for u in passed})
        order = probe_order(self.run.run_id, window, passed, established)
        norms = {u: checks[u].norm or 0.0 for u in passed}
        admission = admit(
            order, (lambda u: scorer.own_norm_score(u, until)) if scorer else lambda _: None,
            norms, established, until,
            self.cfg.admit_z, self.cfg.admit_min_effect, self.cfg.norm_ratio,
            scorer.first_estimate_s if scorer else 0.0,
        )  # fmt: skip
        for uid, why in sorted(admission.refused.items()):
            log.info("window %d: uid %d not applied: %s", window, uid, why)
        log.info(
            "window %d: probed %d of %d selected updates for evidence of training in %.1f s "
            "(%.1f s left to publish, %.1f s kept for it, the probe set up in %.1f s): applying %s",
            window, admission.scored, len(passed), admission.seconds, left, reserve,
            scorer.setup_s if scorer else 0.0, sorted(admission.admitted),
        )  # fmt: skip
        return admission

    def _scoring_deadline(self, window: int) -> float:
        """When scoring `window` must stop (monotonic seconds): before the next window's gather
        block by `WRAP_UP_MARGIN` times the last window's work after scoring (the first time:
        ``manifest_wait_s``), so that the next agreement, which every node waits for until its
        cutoff block, never waits for our scores."""
        blocks = self.clock.gather_block(window + 1) - self.chain.block()
        last = self._wrap_up_s
        reserve = self.run.consensus.manifest_wait_s if last is None else WRAP_UP_MARGIN * last
        return time.monotonic() + blocks * self.run.timing.block_time_s - reserve

    def _outer_step(self, window: int, agreed: Agreement, keep: bool) -> None:
        """The window's one outer step (`node.strategy`), as every peer takes it: the mean from
        the decode workers when there are some, else decoded here one update at a time. With
        `keep`, the step itself is kept for the next window's own-data test (`validator.scoring`)."""
        params = dict(self.model.named_parameters())
        before = {k: p.detach().to("cpu", copy=True) for k, p in params.items()} if keep else None
        mean = None
        if self.pool is not None:
            where = probe_keep(self.cfg.probe_state, self.run, self.device)
            mean = mean_of_stored(self.pool, agreed.updates, where)
        if mean is None:
            mean = self.strategy.aggregator.mean(Pieces(agreed.updates))
        self.strategy.outer.step(self.model, mean, window)
        self.fingerprint = fingerprint(self.model)
        self._last_step = None
        if before is not None:
            step = {k: before[k].sub_(p.detach().cpu()) for k, p in params.items()}
            self._last_step = (self.fingerprint, step)

    def _maybe_set_weights(self, window: int, weights: dict[int, float], live: bool) -> str:
        """Weights for a window processed live (judged when it began: scoring runs up to the
        next gather block, so by now the clock is always a window further on)."""
        if window % self.cfg.weights_every != 0:
            return "not this window"
        if not live:
            return "skipped: catching up"
        return set_weights(self.chain, self.keypair, self.run, weights)

    def _result(
        self, window: int, start_fp: str, selected: list[int], applied: list[int],
        weights: dict[int, float], status: str,
    ) -> WindowResult:  # fmt: skip
        return WindowResult(
            run_id=self.run.run_id, window=window, validator_uid=self.uid,
            validator_hotkey=self.keypair.ss58_address, fingerprint_start=start_fp,
            fingerprint_end=self.fingerprint, selected=selected, aggregated=applied,
            weights=weights, weights_status=status, config=self.cfg,
            samples=self._reveal,
        )  # fmt: skip

    def _publish(self, window: int, report: ScoreReport) -> None:
        run_id, hk, uid = self.run.run_id, self.keypair.ss58_address, self.uid
        body = {"run_id": run_id, "window": window, "uid": uid, "fingerprint": self.fingerprint}
        steps: list[tuple[str, Callable[[], object]]] = [
            ("fingerprint", lambda: self.store.put(
                fingerprint_key(run_id, window, uid, hk), json.dumps(body).encode())),
            ("scores", lambda: self.store.put(
                scores_key(run_id, window, uid, hk), report.model_dump_json().encode())),
        ]  # fmt: skip
        ahead = window + 1 + COMMIT_AHEAD
        steps.append(("commitment", lambda: self._publish_commits(range(ahead, ahead + 1))))
        if (window + 1) % self.cfg.checkpoint_every == 0:
            steps.append(("run config", self._publish_run_config))
            steps.append(("checkpoint", lambda: publish_checkpoint(
                self.store, self.run, window + 1, uid, self.keypair, self.model,
                outer=self.strategy.outer.state_dict())))  # fmt: skip
        for what, step in steps:
            try:
                step()
            except StoreError as exc:  # our bucket failing costs the history, not the window
                log.error("window %d: publishing the %s failed: %s", window, what, exc)

    def _publish_run_config(self) -> None:
        self.store.put(run_manifest_key(self.run.run_id), self.run.canonical_json())

    def _publish_commits(self, windows: range) -> None:
        """Publish the signed commitment of each window's secret (`validator.reveal`), never
        overwriting one already there: its time of upload is part of the evidence."""
        hk = self.keypair.ss58_address
        for w in windows:
            key = commit_key(self.run.run_id, w, self.uid, hk)
            if not self.store.exists(key):
                record = signed_commit(self.keypair, self.run.run_id, w, self.uid, self.reveal_key)
                self.store.put(key, record.model_dump_json().encode())

    # -- state -------------------------------------------------------------------------------

    def _save(self, next_window: int) -> None:
        self.next_window = next_window
        save_state(
            self.state_dir,
            ValidatorState(
                run_id=self.run.run_id,
                window=next_window,
                model={k: v.detach().cpu() for k, v in self.model.state_dict().items()},
                fingerprint=self.fingerprint,
                salt=self.salt,
                records=self.book.records,
                sketches=self.history.entries(),
                reveal_key=self.reveal_key,
                outer=self.strategy.outer.state_dict(),
            ),
        )

    def _other_sources(self) -> list[Source]:
        """Every other validator's published history, most stake first."""
        return [s for s in history_sources(self.chain, self.local_root) if s.uid != self.uid]

    def _skip_pruned(self, exc: BlockPruned) -> None:
        reached = skip_pruned(self.model, self.strategy, self._other_sources(), self.next_window,
                              self.current_window(), exc)  # fmt: skip
        self.fingerprint = fingerprint(self.model)
        self._save(reached)

    def _restore(self) -> None:
        start = begin(self.state_dir, self.run, self.cfg, self.model, self.strategy,
                      max(0, self.current_window()),
                      lambda: history_sources(self.chain, self.local_root))  # fmt: skip
        self.next_window, self.fingerprint = start.next_window, start.fingerprint
        self.salt, self.book, self.history = start.salt, start.book, start.history
        self.reveal_key = start.reveal_key
        if start.unsaved:  # the key is on disk before any commitment is out
            self._save(self.next_window)
        if not start.resumed:
            try:
                self._publish_run_config()
            except StoreError as exc:
                log.error("publishing the run config failed: %s", exc)
        self._commit_ahead()

    def _commit_ahead(self) -> None:
        """At start-up: commitments for every window we may still score, up to `COMMIT_AHEAD`
        windows past the current one (later ones follow with each window's report)."""
        now = self.current_window()
        try:
            self._publish_commits(range(max(self.next_window, now - 1), now + COMMIT_AHEAD + 1))
        except StoreError as exc:
            log.error("publishing the sample commitments failed: %s", exc)


def _members(roster: Roster) -> tuple[dict[int, str], dict, dict[int, str]]:
    """Registered non-validator peers, their buckets, and why some have none."""
    peers = {n.uid: n.hotkey for n in roster.metagraph.neurons if not n.validator_permit}
    own = {u: b for u, b in roster.buckets.items() if u in peers}
    missing = {u: roster.problems.get(u, "missing") for u in peers if u not in own}
    return peers, own, missing
