"""Gather what every process of a simulation wrote into one report (`report.json`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import torch
from pydantic import BaseModel

from lab.sim.baseline import HeldOut
from lab.sim.layout import World
from node.runtime.report_log import REPORTS, read_json_lines


class PeerWindow(BaseModel):
    """One member in one window, as its own log and the validator saw it."""

    name: str
    kind: str
    uid: int
    loss: float | None = None
    upload_bytes: int | None = None
    fingerprint: str | None = None
    verdict: str | None = None
    rule: str | None = None  # what decided its weight (`validator.reports`)
    detail: str | None = None
    score: float | None = None
    weight: float = 0.0


class WindowRow(BaseModel):
    window: int
    synced_loss: float | None = None  # held-out loss of the validator's model after the window
    trigger_probability: float | None = (
        None  # its P(backdoor target | trigger) (`lab.sim.backdoor`)
    )
    ddp_loss: float | None = None  # held-out loss of DDP on the honest peers' tokens
    validator_fingerprint: str | None = None
    standby_fingerprints: list[str] = []  # the other validators' models after the window
    peers: list[PeerWindow]


PAY_SPREAD_LIMIT = 0.2
"""With faults, every honest peer's pay from window 3 on stays within ±20 % of the honest mean."""


class SimReport(BaseModel):
    run_id: str
    dense_bytes: int
    kept_entries: int
    windows: list[WindowRow]
    exit_codes: dict[str, int | None]
    diverged: list[int]
    non_finite: list[int]
    final_weights: dict[str, float]  # the validator's weights after the last trained window
    parameters: dict[str, str] = {}  # the run's settings, for the report's reader

    def final_rules(self) -> dict[str, str]:
        """Each member's deciding rule in the last trained window."""
        trained = [r for r in self.windows if any(p.kind == "honest" and p.loss for p in r.peers)]
        rows = trained or self.windows
        return {p.name: p.rule or "–" for p in rows[-1].peers} if rows else {}

    def honest_spread(self, first_window: int = 3) -> float | None:
        """The largest relative deviation of an honest peer's weight from the honest mean, over
        the windows from `first_window` on that paid honest peers anything."""
        worst = None
        for row in self.windows:
            ws = [p.weight for p in row.peers if p.kind == "honest"]
            mean = sum(ws) / len(ws) if ws else 0.0
            if row.window >= first_window and mean > 0:
                dev = max(abs(w / mean - 1) for w in ws)
                worst = dev if worst is None else max(worst, dev)
        return worst

    def spread_hint(self, blocks_per_window: int, limit: float = PAY_SPREAD_LIMIT) -> str | None:
        """What to do when the honest pay spread from window 3 on is above `limit` (a run with
        faults is to pay every honest peer within it), or None."""
        spread = self.honest_spread()
        if spread is None or spread <= limit:
            return None
        return (
            f"honest pay spread from window 3 on is ±{spread:.1%}, above ±{limit:.0%}: a peer "
            f"that cannot finish its window in time misses the next ones and its score decays; "
            f"if this machine is loaded, try --blocks-per-window {2 * blocks_per_window}"
        )

    def unscored_hint(self, blocks_per_window: int) -> str | None:
        """What to do when the validator paid no honest peer because it never had time to
        score one (rule `unscored`: a slow or loaded machine), or None."""
        honest = [p for row in self.windows for p in row.peers if p.kind == "honest"]
        if not honest or any(p.weight > 0 for p in honest):
            return None
        unscored = sum(p.rule == "unscored" for p in honest)
        if 2 * unscored < len(honest):
            return None
        return (
            f"no honest peer was paid: the validator had no time to score them "
            f"({unscored} of {len(honest)} peer-windows unscored); this machine is too slow "
            f"for {blocks_per_window}-block windows with these processes: try "
            f"--blocks-per-window {2 * blocks_per_window}, or fewer peers"
        )


def collect(
    world: World,
    exit_codes: dict[str, int | None],
    dense_bytes: int,
    kept: int,
    ddp: dict[int, float],
    synced: Mapping[int, HeldOut] | None = None,
) -> SimReport:
    peer_logs = {
        m.name: {r["window"]: r for r in read_json_lines(m.state_dir / REPORTS)}
        for m in world.members
    }
    validator, *standbys = world.of_kind("validator")
    scores = {r["window"]: r for r in read_json_lines(validator.state_dir / REPORTS)}
    others = [{r["window"]: r for r in read_json_lines(v.state_dir / REPORTS)} for v in standbys]
    # the windows the honest peers trained (the validator runs one more, in case they start late),
    # of the run's own: a peer that skipped one (a chain outage, a restart) trains past its end
    planned = world.run.outer.total_windows
    trained = {w for m in world.of_kind("honest") for w in peer_logs[m.name] if w < planned}
    if scores:  # a peer that skipped a window (and caught up) trains one past the validator's
        trained = {w for w in trained if w <= max(scores)}
    windows = sorted(trained or scores)
    rows: list[WindowRow] = []
    for w in windows:
        by_uid = {p["uid"]: p for p in scores.get(w, {}).get("peers", [])}
        weights = {int(k): v for k, v in scores.get(w, {}).get("weights", {}).items()}
        peers = []
        for m in world.members:
            if m.kind == "validator":
                continue
            own, seen = peer_logs[m.name].get(w, {}), by_uid.get(m.uid, {})
            loss = seen.get("loss") or {}
            peers.append(
                PeerWindow(
                    name=m.name,
                    kind=m.kind,
                    uid=m.uid,
                    loss=own.get("loss"),
                    upload_bytes=own.get("upload_bytes") or seen.get("n_bytes"),
                    fingerprint=own.get("fingerprint"),
                    verdict=seen.get("verdict"),
                    rule=seen.get("rule"),
                    detail=seen.get("detail"),
                    score=loss.get("score"),
                    weight=weights.get(m.uid, 0.0),
                )
            )
        fp = scores.get(w, {}).get("fingerprint_end")
        held = (synced or {}).get(w)
        rows.append(
            WindowRow(
                window=w,
                synced_loss=held.loss if held else None,
                trigger_probability=held.trigger if held else None,
                ddp_loss=ddp.get(w),
                validator_fingerprint=fp,
                standby_fingerprints=[
                    o[w]["fingerprint_end"] for o in others if o.get(w, {}).get("fingerprint_end")
                ],
                peers=peers,
            )
        )
    trained_rows = [r for r in rows if any(p.kind == "honest" and p.loss for p in r.peers)]
    last = (trained_rows or rows)[-1].peers if rows else []
    return SimReport(
        run_id=world.run.run_id,
        dense_bytes=dense_bytes,
        kept_entries=kept,
        windows=rows,
        exit_codes=exit_codes,
        diverged=_diverged(rows),
        non_finite=_non_finite(rows, non_finite_fingerprints(world)),
        final_weights={p.name: p.weight for p in last},
        parameters=run_parameters(world),
    )


def run_parameters(world: World) -> dict[str, str]:
    """What a reader of the report needs to know about the run, as text."""
    run, kinds = world.run, [m.kind for m in world.members]
    adversaries = sorted({k for k in kinds if k not in ("honest", "validator")})
    return {
        "run id": run.run_id,
        "strategy": run.strategy,
        "honest peers": str(kinds.count("honest")),
        "adversaries": ", ".join(f"{k} ×{kinds.count(k)}" for k in adversaries) or "none",
        "window": f"{run.timing.blocks_per_window} blocks of {run.timing.block_time_s:g} s",
        "inner steps (H)": str(run.inner_steps),
        "kept per 4096 (k)": str(run.codec.k),
        "outer step": f"{run.outer.optimizer}, α = {run.outer.alpha:g}, delay {run.outer.delay}, "
        f"min support {run.outer.min_support}",
        "gather size": str(run.gather_size),
    }


def _diverged(rows: list[WindowRow]) -> list[int]:
    """Windows where honest peers that finished them, or the validators, hold different models."""
    out = []
    for row in rows:
        fps = {p.fingerprint for p in row.peers if p.kind == "honest" and p.fingerprint}
        if fps:
            fps.update(row.standby_fingerprints)
            if row.validator_fingerprint:
                fps.add(row.validator_fingerprint)
        if len(fps) > 1:
            out.append(row.window)
    return out


def _non_finite(rows: list[WindowRow], bad: set[str]) -> list[int]:
    """Windows where an honest model went non-finite: an honest peer's training loss is NaN or
    inf, or an honest peer (or the validator) reports the fingerprint of a non-finite model."""
    return [
        row.window
        for row in rows
        if row.validator_fingerprint in bad
        or any(
            p.kind == "honest"
            and (p.fingerprint in bad or (p.loss is not None and not math.isfinite(p.loss)))
            for p in row.peers
        )
    ]


def non_finite_fingerprints(world: World) -> set[str]:
    """Fingerprints of the non-finite models among those the honest peers and the validator saved
    (each keeps its last two states: `state.pt`/`validator.pt` and their `.prev.pt`)."""
    bad = set()
    for m in world.members:
        if m.kind not in ("honest", "validator"):
            continue
        for path in sorted(m.state_dir.glob("*.pt")):
            saved = _saved_model(path)
            if saved is not None and not all(torch.isfinite(t).all() for t in saved[1].values()):
                bad.add(saved[0])
    return bad


def _saved_model(path: Path) -> tuple[str, dict[str, torch.Tensor]] | None:
    """(fingerprint, weights) of a saved peer or validator state, or None for any other file."""
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # torn, foreign or not a state at all: nothing to judge
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("fingerprint"), str):
        return None
    model = raw.get("model")
    if not isinstance(model, dict):
        return None
    weights = {k: v for k, v in model.items() if torch.is_tensor(v) and v.is_floating_point()}
    return raw["fingerprint"], weights
