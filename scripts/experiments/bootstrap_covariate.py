"""The own-data test at launch, before any peer has earned: Welch's test (what the validator
runs then) against the regression on a covariate every validator already holds, the per-sample
gain of the previous window's applied mean.

Three honest peers of the tiny preset train window 0 from the run's seed; their mean is applied
(`Strategy.step`). Each trains window 1 from there. Each window-1 update, and a random sparse
update of the same shape (`lab.sim.forgeries.noise_update`, the null), is probed at its own norm
on the validator's samples of four secrets (64 random + 64 own), and its own-data statistic is
computed both ways: `validator.scoring.welch`, and `validator.scoring.ancova` whose covariate is
the gain of the window-0 mean at the same step length.

    python scripts/experiments/bootstrap_covariate.py
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from codec.aggregate import update_norm
from codec.spec import ModelSpec
from lab.sim.forgeries import noise_update
from node.data.batches import open_run_dataset
from node.model.llama import build_model
from node.strategy import make_strategy
from protocol.runconfig import RunConfig
from tests.support.honest_updates import train_update
from validator.config import ValidatorConfig
from validator.reveal import own_slots, reveal_for
from validator.scoring import LossProbe, ancova, welch

PEERS, SECRETS = 3, 4


def main() -> None:
    torch.set_num_threads(1)
    run, cfg = RunConfig.preset("tiny"), ValidatorConfig()
    _, dataset = open_run_dataset(run)
    model = build_model(run.model, run.seed)
    spec = ModelSpec.from_module(model)
    strategy = make_strategy(run, spec)
    first = {u: train_update(run, dataset, model, u, 0) for u in range(PEERS)}
    previous = strategy.mean(first)
    strategy.step(model, first)
    second = {u: train_update(run, dataset, model, u, 1) for u in range(PEERS)}
    step = {k: v * cfg.score_scale * run.outer.alpha for k, v in previous.items()}
    z: dict[str, list[float]] = {k: [] for k in ("honest welch", "honest covariate",
                                                 "null welch", "null covariate")}  # fmt: skip
    correlation = []
    for key in range(SECRETS):
        secret = hashlib.blake2b(f"bootstrap {key}".encode(), digest_size=32).digest()
        reveal = reveal_for(dataset, run.run_id, 1, secret, cfg.n_random, cfg.n_own)
        norms = {u: update_norm(x) for u, x in second.items()}
        probe = LossProbe(model, run, dataset, 1, reveal, {}, norms, cfg, torch.device("cpu"))
        r_random = probe._gain(probe.before_random, probe._stepped(step, [probe.random])[0])
        for uid in range(PEERS):
            own = dataset.read_slots(own_slots(dataset, run, uid, 1, reveal.seed, cfg.n_own))
            before_own = probe._rows(own)
            r_own = probe._gain(before_own, probe._stepped(step, [own])[0])
            null = noise_update(spec, run, 1e-3, torch.Generator().manual_seed(10 * key + uid))
            for kind, update in (("honest", second[uid]), ("null", null)):
                norm = update_norm(update)
                factor = probe._factor(norm, norm)
                after_random, after_own = probe._stepped(update, [probe.random, own], factor)
                g_random = probe._gain(probe.before_random, after_random)
                g_own = probe._gain(before_own, after_own)
                z[f"{kind} welch"].append(welch(g_own, g_random).z)
                z[f"{kind} covariate"].append(ancova(g_own, g_random, r_own, r_random).z)
                if kind == "honest":
                    pair = np.corrcoef(np.r_[g_own, g_random], np.r_[r_own, r_random])
                    correlation.append(float(pair[0, 1]))
    print(
        f"own-data z at window 1, {PEERS} peers x {SECRETS} secrets (admission bar {cfg.admit_z})"
    )
    for name, values in z.items():
        below = sum(v < cfg.admit_z for v in values)
        print(f"  {name:17s} mean {np.mean(values):5.2f}  min {min(values):5.2f}  "
              f"below the bar {below}/{len(values)}")  # fmt: skip
    print(
        f"  correlation of an honest update's gains with the covariate: {np.mean(correlation):.2f}"
    )


if __name__ == "__main__":
    main()
