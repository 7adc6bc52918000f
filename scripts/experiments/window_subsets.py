"""One window of a finished simulation, replayed with other sets of its updates: what each set's
outer step does to the held-out loss and to the backdoor's trigger.

The validator's model at the start of the window is replayed from its published history (as a
joining peer does); each set's updates are read from the members' buckets and applied with the
run's aggregator and outer step (`OuterOptimizer.step`) from those same weights, then scored on
the simulation's held-out samples (`lab.sim.baseline`). Members are named as in the simulation
(``peer0``, ``backdoor``, …); their uids follow the order the simulation registered them in (its
report's order).

    python scripts/experiments/window_subsets.py OUT WINDOW peer1,peer2,peer3 peer0,peer1,peer2,peer3 ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from codec.spec import ModelSpec
from lab.bench.train.engine import heldout_loss, heldout_set
from lab.sim.backdoor import trigger_probability
from lab.sim.baseline import HELDOUT_SAMPLES
from node.data.batches import open_run_dataset
from node.model.llama import build_model
from node.strategy import make_strategy
from node.window.history import Source, catch_up_any
from protocol.runconfig import RunConfig
from protocol.stores import open_store


def update_file(out: Path, run_id: str, name: str, window: int) -> Path | None:
    folder = out / "buckets" / name / run_id / f"w{window:010d}" / "update"
    found = sorted(folder.glob("*.tsr"))
    return found[0] if found else None


def main(out: Path, window: int, sets: list[list[str]]) -> None:
    run = RunConfig.load(out / "run.json")
    report = json.loads((out / "report.json").read_text())
    names = [peer["name"] for peer in report["windows"][0]["peers"]]
    uids = {name: uid for uid, name in enumerate(names)}
    lead = out / "buckets" / "validator"
    hotkey = next(p.stem.split("-", 1)[1] for p in sorted(lead.rglob("*.json")) if "-5" in p.name)
    model = build_model(run.model, run.seed)
    strategy = make_strategy(run, ModelSpec.from_module(model))
    source = Source(len(names), hotkey, open_store(f"file://{lead}"))
    if catch_up_any(model, strategy.aggregator, strategy.outer, [source], 0, window) != window:
        raise SystemExit(f"the validator's history does not replay to window {window}")
    _, dataset = open_run_dataset(run)
    heldout = heldout_set(dataset, run.run_id, HELDOUT_SAMPLES)
    print(f"window {window} starts at held-out loss {heldout_loss(model, heldout):.4f}")
    start = {k: v.clone() for k, v in model.state_dict().items()}
    outer = {k: v.clone() for k, v in strategy.outer.state_dict().items()}
    cap = strategy.format.max_update_bytes()
    for members in sets:
        updates = {}
        for name in members:
            path = update_file(out, run.run_id, name, window)
            if path is None:
                raise SystemExit(f"{name} stored no update for window {window}")
            updates[uids[name]] = strategy.format.decode(path.read_bytes(), cap).tensors
        model.load_state_dict(start)
        strategy.outer.load_state_dict(outer)
        with torch.no_grad():
            strategy.outer.step(model, strategy.aggregator.mean(updates), window)
        loss, trigger = heldout_loss(model, heldout), trigger_probability(model, heldout)
        print(f"{','.join(members):<48} loss {loss:.4f}  trigger {trigger:.5f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), [s.split(",") for s in sys.argv[3:]])
