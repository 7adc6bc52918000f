"""What an honest update that a window leaves out does to the windows after it: put back into
its peer's error feedback (``e ← e + Δ̂``: what was taken out of ``e`` was never applied) or
spent (the peers' rule, `node.strategy.sparseloco`).

R replicas of a preset train as `tessera bench train` trains them (`lab.bench.train.engine`: the
run's token stream, AdamW per replica, the real wire and the consensus' mean and outer step), but
window ``w`` applies only the replicas that ``--applied`` names for it (every replica after the
last one given). Three runs: every replica applied in every window (clean), the schedule with
the left-out updates put back into their error feedback, the schedule with them spent. Prints
the held-out loss after every window of each run (`--rules` picks them). Nothing is put back
while the error feedback is frozen (`outer.ef_freeze_fraction`): nothing was taken out of it.

    python scripts/experiments/excluded_updates.py --windows 8 --applied 1,3 0,1 1,2,3 1,2,3

(the honest peers a crowd at launch left in the applied set of a `tessera sim` run's first
windows: uids 1 and 3, then 0 and 1, then 1–3 twice).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from codec.spec import ModelSpec
from lab.bench.train.engine import Setup, heldout_loss, heldout_set, transmit
from miner.train import make_optimizer, train_window
from node.data.batches import open_run_dataset
from node.model.llama import build_model
from node.strategy import Strategy, make_strategy
from protocol.runconfig import RunConfig

RULES = ("clean", "put back", "spent")


def put_back(peer: Strategy, sent: list[Any]) -> None:
    """``e ← e + Δ̂`` for a peer's update that no window applied (the decoded values where
    they were taken out)."""
    error = peer.encoder.local_state_dict()
    for piece in sent:
        peer.format.add_into(error[piece.name], piece)
    peer.encoder.load_local_state_dict(error)


def run(setup: Setup, schedule: list[set[int]], rule: str) -> list[float]:
    """The held-out loss after every window under `rule` (one of `RULES`)."""
    base = setup.base
    sync = build_model(base.model, base.seed)
    worker = build_model(base.model, base.seed)
    spec = ModelSpec.from_module(sync)
    everyone = set(range(setup.replicas))
    optimizers = [make_optimizer(worker, base) for _ in everyone]
    peers = [make_strategy(base, spec) for _ in everyone]
    consensus = make_strategy(base, spec)
    params = dict(worker.named_parameters())
    losses = []
    for w in range(setup.windows):
        applied = everyone if rule == "clean" or w >= len(schedule) else schedule[w]
        start = {n: p.detach().clone() for n, p in sync.named_parameters()}
        sent, updates = {}, {}
        for r in sorted(everyone):
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(start[n])
            batches = (setup.batch(r, w, i) for i in range(base.inner_steps))
            train_window(worker, optimizers[r], batches, base, w, torch.device("cpu"))
            with torch.no_grad():
                delta = {n: start[n] - p.detach() for n, p in params.items()}
            sent[r] = peers[r].encoder.encode(delta, w)
            updates[r] = transmit(peers[r].format, sent[r], w, r)[1]
        consensus.outer.receive(
            consensus.aggregator.mean({r: updates[r] for r in sorted(applied)}), w
        )
        new = consensus.outer.next_weights(start)
        with torch.no_grad():
            for n, p in sync.named_parameters():
                p.copy_(new[n])
        state = consensus.outer.state_dict()
        for r in sorted(everyone):
            peers[r].outer.load_state_dict(state)
            if rule == "put back" and r not in applied and w >= base.outer.ef_freeze_windows:
                put_back(peers[r], sent[r])
        losses.append(heldout_loss(sync, setup.heldout))
        print(f"{rule}: window {w} applied {sorted(applied)} held-out {losses[-1]:.4f}", flush=True)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--applied", nargs="*", default=[], help="per window: r,r,... applied")
    parser.add_argument("--rules", nargs="*", choices=RULES, default=list(RULES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = RunConfig.preset(args.preset).with_overrides(outer={"total_windows": args.windows})
    if base.outer.delay:
        raise SystemExit("a preset with outer.delay = 0")
    schedule = [{int(r) for r in item.split(",") if r} for item in args.applied]
    _, dataset = open_run_dataset(base)
    heldout = heldout_set(dataset, base.run_id, 128)
    setup = Setup(base, dataset, tuple(range(args.replicas)), args.windows, heldout, base.run_id)
    curves = {rule: run(setup, schedule, rule) for rule in args.rules}
    print("window | " + " | ".join(curves))
    for w in range(args.windows):
        print(f"{w} | " + " | ".join(f"{c[w]:.4f}" for c in curves.values()))


if __name__ == "__main__":
    main()
