"""Measure the validator's own-data test and pay on real updates: false negatives, fairness, nulls.

Simulates P honest SparseLoCo peers in-process (the real `miner.train`, `codec` compressor
and median-clipped outer step, the tiny preset as `tessera sim` runs it) plus, every window:

* ``scaled``: another peer that trains honestly and uploads its update with the codebook x5;
* ``noise``: a random update at the honest median norm; ``recycler``: the previous window's
  applied mean, re-compressed (both accepted, as the sim's checks accept them);
* ``copy``: honest peer 0's update under another uid; ``stale``: peer 0's previous update under
  another uid (their verdicts would be copy / replay: scored, not accepted).

Each window draws a fresh secret (`validator.reveal`), scores everyone with
`validator.scoring.LossProbe` and feeds `validator.ratings.Book` as the validator does, except
that every outcome counts as verdict ``ok`` (so the own-data test and the gain gate are measured
alone, without the copy and replay rules). It prints, per kind, ``own_z``, the share of windows
whose indicator passed, the pooled statistic Z and pay; for honest peers the per-window false-negative
rate (indicator -1), the share of peer-windows past the warm-up whose own-data factor is below 1,
and the largest deviation of an honest weight from the honest mean in every window past the
third.

    python scripts/experiments/validator_fairness.py [--peers 4] [--windows 10] [--n 64] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from inprocess_peers import Peers

from codec.aggregate import aggregate, update_norm
from codec.compress import SparseTensor
from lab.sim.forgeries import from_dense, noise_update
from node.data.batches import open_run_dataset
from node.model.llama import build_model
from protocol.runconfig import RunConfig
from validator.checks import Verdict
from validator.config import ValidatorConfig
from validator.ratings import Book, WindowOutcome
from validator.reveal import reveal_for
from validator.scoring import LossProbe, LossScore

Update = list[SparseTensor]
ACCEPTED = ("honest", "scaled", "noise", "recycler")
WARMUP = 3  # windows before the fairness and false-negative figures count


def scale(update: Update, c: float) -> Update:
    return [SparseTensor(s.name, s.shape, s.groups, s.codebook * c) for s in update]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--windows", type=int, default=10)
    p.add_argument("--n", type=int, default=64, help="random and own samples per probe")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--all-accepted", action="store_true", help="consensus of every accepted update")
    a = p.parse_args()
    torch.manual_seed(a.seed)
    torch.set_num_threads(1)
    run = RunConfig.preset("tiny", name=f"fair{a.seed}", outer={"total_windows": a.windows})
    cfg = ValidatorConfig(n_random=a.n, n_own=a.n)
    _, dataset = open_run_dataset(run)
    glob = build_model(run.model, run.seed)
    honest = Peers(run, a.peers)
    scaled_peer = Peers(run, 1, first_uid=a.peers)
    spec = honest.spec
    uid_of = {"noise": 100, "recycler": 101, "copy": 102, "stale": 103}
    kind_of = {u: "honest" for u in honest.uids} | {a.peers: "scaled"}
    kind_of |= {u: k for k, u in uid_of.items()}
    book, gen = Book(cfg), torch.Generator().manual_seed(7 + a.seed)
    rows: dict[str, list[float]] = {}
    prev: dict[int, Update] = {}
    prev_mean: dict[str, torch.Tensor] | None = None
    t0 = time.time()

    def add(key: str, value: float) -> None:
        rows.setdefault(key, []).append(value)

    for w in range(a.windows):
        ups = honest.train(glob, dataset, w)
        own_scaled = scaled_peer.train(glob, dataset, w)[a.peers]
        median = statistics.median(update_norm(u) for u in ups.values())
        unit = noise_update(spec, run, 1.0, gen)
        cands: dict[int, Update] = dict(ups) | {a.peers: scale(own_scaled, 5.0)}
        cands[uid_of["noise"]] = scale(unit, median / update_norm(unit))
        cands[uid_of["copy"]] = ups[0]
        if prev_mean is not None:
            cands[uid_of["recycler"]] = from_dense(prev_mean, spec, run)
        if prev:
            cands[uid_of["stale"]] = prev[0]
        reveal = reveal_for(dataset, run.run_id, w, secrets.token_bytes(32), a.n, a.n)
        accepted = {u: x for u, x in cands.items() if kind_of[u] in ACCEPTED}
        norms = {u: update_norm(x) for u, x in cands.items()}
        hotkeys = {u: f"hk{u}" for u in accepted}
        members = set(accepted) if a.all_accepted else book.consensus(hotkeys)
        ref = {u: accepted[u] for u in members}
        probe = LossProbe(
            glob, run, dataset, w, reveal, ref, {u: norms[u] for u in accepted}, cfg,
            torch.device("cpu"),
        )  # fmt: skip
        add("consensus members", len(ref))
        scores = {u: probe.score(u, x, norms[u], probe.target) for u, x in cands.items()}
        book.update({u: _ok(f"hk{u}", s) for u, s in scores.items()})
        weights = _weights(book.final_scores(list(cands)))
        _collect(add, w, scores, weights, book, kind_of)
        prev = ups
        prev_mean = aggregate(ups | {a.peers: cands[a.peers]}, spec, run.codec, clip_to_median=True)
        with torch.no_grad():
            for name, prm in glob.named_parameters():
                prm.sub_(prev_mean[name], alpha=run.outer.alpha)
        print(f"window {w} done ({time.time() - t0:.0f}s), loss {probe.before_random.mean():.4f}")
    _print(rows, a, cfg)


def _ok(hotkey: str, s: LossScore) -> WindowOutcome:
    return WindowOutcome(
        hotkey=hotkey, verdict=Verdict.OK, in_sync=True, score=s.score, own_z=s.own.z
    )


def _weights(final: dict[int, float]) -> dict[int, float]:
    total = sum(final.values())
    return {u: v / total if total > 0 else 0.0 for u, v in final.items()}


def _collect(
    add: Callable[[str, float], None],
    w: int,
    scores: dict[int, LossScore],
    weights: dict[int, float],
    book: Book,
    kind_of: dict[int, str],
) -> None:
    honest_w = [weights[u] for u in scores if kind_of[u] == "honest"]
    mean_w = statistics.mean(honest_w)
    for uid, s in scores.items():
        kind = kind_of[uid]
        add(f"{kind} own_z", s.own.z)
        add(f"{kind} indicator +1", 1.0 if s.indicator > 0 else 0.0)
        add(f"{kind} score", s.score)
        add(f"{kind} pooled Z", book.records[uid].own_pooled)
        add(f"{kind} weight", weights[uid])
        if kind == "honest" and w >= WARMUP:
            add(
                "honest own factor < 1 (past warm-up)",
                float(book.own_factor(book.records[uid]) < 1),
            )
            add("honest indicator -1 (past warm-up)", 1.0 if s.indicator < 0 else 0.0)
    if w >= WARMUP and mean_w > 0:
        add("honest max |weight/mean - 1|", max(abs(x / mean_w - 1) for x in honest_w))
        add(
            "scaled weight / honest mean",
            weights[next(u for u in scores if kind_of[u] == "scaled")] / mean_w,
        )
    add("honest method ancova", float(all(s.own.method == "ancova" for s in scores.values())))


def _print(rows: dict[str, list[float]], a: argparse.Namespace, cfg: ValidatorConfig) -> None:
    print(
        f"\n{a.peers} honest peers, {a.windows} windows, n = {a.n} random + up to {a.n} own "
        f"samples, own_z_pass {cfg.own_z_pass}, pay ramp on the pooled Z [{cfg.own_z_low}, {cfg.own_z_full}] "
        f"over {cfg.own_windows} windows\n"
    )
    for key, vals in rows.items():
        vals = [v for v in vals if math.isfinite(v)]
        print(
            f"{key:40s} n={len(vals):3d} min {min(vals):+.4f} mean {statistics.mean(vals):+.4f} "
            f"max {max(vals):+.4f}"
        )


if __name__ == "__main__":
    main()
