"""Measure how well the validator's checks separate honest peers from noise, stale and copies.

Simulates P honest SparseLoCo peers in-process (the real `miner.train`, `codec` compressor and
aggregate, the tiny preset with the end-to-end test's timing) for W windows and, every window,
scores with `validator.scoring.LossProbe`:

* each honest update (its own uid);
* a noise update (`lab.sim.forgeries.noise_update`) scaled to the honest median norm;
* a stale update: each honest peer's update of the previous window, replayed;
* a copy: honest peer 0's update claimed by another uid (whose own assignment it never saw);

and measures the pooled index Jaccard (`validator.copies`) between honest peers of a window,
of one peer across consecutive windows, and of a perturbed copy with its original. The probe
draws its samples from a fresh secret each window (`validator.reveal`); the honest updates are
the accepted ones (they set the median norm and the own-data test's consensus covariate).
`scripts/experiments/validator_fairness.py` measures the own-data test's false negatives and the pay.

    python scripts/experiments/validator_separation.py [--peers 4] [--windows 6] [--n 64]
"""

from __future__ import annotations

import argparse
import hashlib
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

from codec.aggregate import aggregate, clip_factors, update_norm
from codec.compress import densify
from codec.spec import ModelSpec
from lab.sim.forgeries import chunk_mix, from_dense, noise_update, perturbed_copy, requantised
from node.data.batches import open_run_dataset
from node.model.llama import build_model
from protocol.runconfig import RunConfig
from validator.config import ValidatorConfig
from validator.copies import (
    Sketch,
    SketchHistory,
    Stamp,
    aggregate_sketch,
    explain,
    explain_window,
    overlap,
    sketch,
)
from validator.reveal import reveal_for
from validator.scoring import LossProbe


def share_measurements(
    w: int,
    updates: dict,
    history: SketchHistory,
    last_mean: dict | None,
    spec: ModelSpec,
    run: RunConfig,
    gen: torch.Generator,
    add: Callable[[str, float], None],
) -> None:
    """Explained shares (`validator.copies`) of the honest updates of window `w` (by each other
    in any order, and by the closest single object of the history) and of each derivative (a
    copy-like one by this window's honest updates, a replayed one by the history)."""

    def sk(uid: int, upd: list) -> Sketch:
        digest = hashlib.blake2b(f"{uid}/{w}/{len(rows_seen)}".encode(), digest_size=32).digest()
        rows_seen.append(uid)
        return sketch(uid, w, digest, upd, spec, run.codec, 1 << 16, 1)

    rows_seen: list[int] = []
    honest = {u: sk(u, upd) for u, upd in updates.items()}
    stamps = {u: Stamp(None, False) for u in honest}
    for e in explain_window(honest, stamps, history, ValidatorConfig().replay_threshold).values():
        add("honest: share by this window's others", e.window.share)
        if history.entries():
            add("honest: share by one earlier object", e.history.share)
    a, b = updates[0], updates[1]
    da, db = ({s.name: densify(s, run.codec) for s in u} for u in (a, b))
    copies = {
        "copy (perturbed)": perturbed_copy(a, run.codec, gen),
        "copy (re-quantised)": requantised(a, spec, run, gen),
        "mix 50/50": chunk_mix(a, b, 0.5, gen, spec, run),
        "mix 60/40": chunk_mix(a, b, 0.4, gen, spec, run),
        "Top-k of a sum": from_dense({n: da[n] + db[n] for n in da}, spec, run),
    }
    for name, upd in copies.items():
        add(f"{name}: share by this window", explain(sk(99, upd), list(honest.values())).share)
    if last_mean is not None:
        recycled = sk(98, from_dense(last_mean, spec, run))
        add("recycled aggregate: share by one earlier object",
            explain(recycled, history.entries(), 1).share)  # fmt: skip
    return honest


def loss_measurements(
    glob: torch.nn.Module, run: RunConfig, dataset: object, w: int, updates: dict,
    norms: dict, prev: dict, median: float, n: int, gen: torch.Generator,
    add: Callable[[str, float], None],
) -> None:  # fmt: skip
    """Loss scores and own-data statistics of honest, noise, stale and copied updates."""
    reveal = reveal_for(dataset, run.run_id, w, secrets.token_bytes(32), n, n)
    cfg = ValidatorConfig(n_random=n, n_own=n)
    probe = LossProbe(glob, run, dataset, w, reveal, updates, norms, cfg, torch.device("cpu"))
    spec = ModelSpec.from_module(glob)
    unit = noise_update(spec, run, 1.0, gen)
    noise = noise_update(spec, run, median / update_norm(unit), gen)
    for uid, u in updates.items():
        h = probe.score(uid, u, norms[uid], probe.target)
        add("honest s", h.score)
        add("honest indicator", h.indicator)
        add("honest own_z", h.own.z)
        ns = probe.score(uid, noise, update_norm(noise), probe.target)
        add("noise s", ns.score)
        add("noise indicator", ns.indicator)
        if uid in prev:
            st = probe.score(uid, prev[uid], update_norm(prev[uid]), probe.target)
            add("stale s", st.score)
            add("stale indicator", st.indicator)
            add("stale own_z", st.own.z)
    c = probe.score(len(updates), updates[0], norms[0], probe.target)
    add("copy indicator", c.indicator)
    add("copy own_z", c.own.z)
    print(f"  loss {probe.before_random.mean():.4f}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--windows", type=int, default=6)
    p.add_argument("--n", type=int, default=64, help="random and own samples per probe")
    p.add_argument("--inner-steps", type=int, default=4)
    p.add_argument("--shares-only", action="store_true", help="skip the loss probes")
    a = p.parse_args()
    torch.manual_seed(0)
    run = RunConfig.preset(
        "tiny", name="sep", inner_steps=a.inner_steps, optimizer={"warmup_steps": 4}
    )
    _, dataset = open_run_dataset(run)
    glob = build_model(run.model, run.seed)
    spec = ModelSpec.from_module(glob)
    peers = Peers(run, a.peers)
    gen = torch.Generator().manual_seed(7)
    rows: dict[str, list[float]] = {}
    prev: dict[int, list] = {}
    history = SketchHistory(4)  # as the validator keeps it: updates and applied aggregates
    last_mean: dict[str, torch.Tensor] | None = None
    t0 = time.time()

    def add(key: str, value: float) -> None:
        rows.setdefault(key, []).append(value)

    for w in range(a.windows):
        updates = peers.train(glob, dataset, w)
        norms = {u: update_norm(x) for u, x in updates.items()}
        median = statistics.median(norms.values())
        add("honest norm max/median", max(norms.values()) / median)
        if not a.shares_only:
            loss_measurements(glob, run, dataset, w, updates, norms, prev, median, a.n, gen, add)
        sk = {
            u: sketch(u, w, bytes([u]) * 32, upd, spec, run.codec, 1 << 16, 1)
            for u, upd in updates.items()
        }
        for i in sk:
            for j in sk:
                if i < j:
                    add("honest cross overlap", overlap(sk[i], sk[j]))
            if i in prev:
                old = sketch(i, w - 1, b"\xff" * 32, prev[i], spec, run.codec, 1 << 16, 1)
                add("honest self overlap (w-1)", overlap(sk[i], old))
        share_measurements(w, updates, history, last_mean, spec, run, gen, add)
        if prev:  # a replay of peer 0's previous update
            old = perturbed_copy(prev[0], run.codec, gen)
            old_sk = sketch(98, w, b"\x98" * 32, old, spec, run.codec, 1 << 16, 1)
            add("replay (perturbed): share by one earlier object",
                explain(old_sk, history.entries(), 1).share)  # fmt: skip
        cp = perturbed_copy(updates[0], run.codec, gen)
        add(
            "perturbed copy overlap",
            overlap(sk[0], sketch(9, w, b"\1" * 32, cp, spec, run.codec, 1 << 16, 1)),
        )
        prev = updates
        mean = aggregate(updates, spec, run.codec, clip_to_median=True)
        factors = clip_factors([norms[u] for u in sorted(updates)])
        history.add(
            w,
            [
                *sk.values(),
                aggregate_sketch(w, [sk[u] for u in sorted(sk)], [f / len(sk) for f in factors]),
            ],
        )
        last_mean = mean
        with torch.no_grad():
            for name, prm in glob.named_parameters():
                prm.sub_(mean[name], alpha=run.outer.alpha)
        print(f"window {w} done ({time.time() - t0:.0f}s)", flush=True)
    print(f"\n{a.peers} peers, {a.windows} windows, n = {a.n} samples per probe\n")
    for key, vals in rows.items():
        print(
            f"{key:28s} n={len(vals):3d} min {min(vals):+.5f} mean {statistics.mean(vals):+.5f} "
            f"max {max(vals):+.5f}"
        )


if __name__ == "__main__":
    main()
