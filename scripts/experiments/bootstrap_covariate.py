"""The own-data test at launch, before any peer has earned: which covariate the validator should
regress on. Six ways, all through `validator.scoring.LossProbe`:

* none: Welch's test;
* this window's accepted updates (three honest): the leave-one-out consensus;
* the same with a crowd of four tiny updates accepted beside them (a launch's crowd);
* the previous window's outer step;
* both, this window's consensus and the previous step (what the validator regresses on until two
  peers earn), without and with the crowd.

Three honest peers of the tiny preset train window 0 from the run's seed; their mean is applied
(the aggregator's mean, `OuterOptimizer.step`), and the step taken is kept. Each trains window 1
from there. Each window-1 update, and a random sparse update of the same shape
(`lab.sim.forgeries.noise_update`, the null), is probed at its own norm on the validator's
samples of four secrets (64 random + 64 own).

    python scripts/experiments/bootstrap_covariate.py
"""

from __future__ import annotations

import copy
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
from validator.reveal import reveal_for
from validator.scoring import LossProbe

PEERS, SECRETS, CROWD = 3, 4, 4


def main() -> None:
    torch.set_num_threads(1)
    run, cfg = RunConfig.preset("tiny"), ValidatorConfig()
    _, dataset = open_run_dataset(run)
    model = build_model(run.model, run.seed)
    spec = ModelSpec.from_module(model)
    first = {u: train_update(run, dataset, model, u, 0) for u in range(PEERS)}
    before = copy.deepcopy(model)
    strategy = make_strategy(run, spec)
    strategy.outer.step(model, strategy.aggregator.mean(first), 0)
    step = {
        k: p.detach() - q.detach()
        for (k, p), q in zip(before.named_parameters(), model.parameters(), strict=True)
    }
    second = {u: train_update(run, dataset, model, u, 1) for u in range(PEERS)}
    gen = torch.Generator().manual_seed(7)
    crowd = {100 + i: noise_update(spec, run, 1e-9, gen) for i in range(CROWD)}
    ways = {
        "none (Welch)": ({}, None),
        "this window's honest": (second, None),
        f"this window's, {CROWD} tiny beside": ({**second, **crowd}, None),
        "the previous step": ({}, step),
        "this window's honest and the previous step": (second, step),
        f"this window's, {CROWD} tiny beside, and the previous step": ({**second, **crowd}, step),
    }
    z: dict[str, dict[str, list[float]]] = {w: {"honest": [], "null": []} for w in ways}
    for key in range(SECRETS):
        secret = hashlib.blake2b(f"bootstrap {key}".encode(), digest_size=32).digest()
        reveal = reveal_for(dataset, run.run_id, 1, secret, cfg.n_random, cfg.n_own)
        nulls = {
            u: noise_update(spec, run, 1e-3, torch.Generator().manual_seed(10 * key + u))
            for u in range(PEERS)
        }
        for way, (reference, previous) in ways.items():
            norms = {u: update_norm(x) for u, x in reference.items()}
            probe = LossProbe(
                model, run, dataset, 1, reveal, reference, norms, cfg, torch.device("cpu"),
                previous=previous,
            )  # fmt: skip
            for uid in range(PEERS):
                for kind, update in (("honest", second[uid]), ("null", nulls[uid])):
                    norm = update_norm(update)
                    z[way][kind].append(probe.score(uid, update, norm, norm).own.z)
    print(
        f"own-data z at window 1, {PEERS} peers x {SECRETS} secrets (admission bar {cfg.admit_z})"
    )
    print("| covariate | honest mean | honest min | honest below the bar | null mean | null max |")
    print("|---|---|---|---|---|---|")
    for way, by_kind in z.items():
        h, n = by_kind["honest"], by_kind["null"]
        below = sum(v < cfg.admit_z for v in h)
        print(f"| {way} | {np.mean(h):.2f} | {min(h):.2f} | {below}/{len(h)} | "
              f"{np.mean(n):.2f} | {max(n):.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
