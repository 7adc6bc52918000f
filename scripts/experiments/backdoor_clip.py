"""How far a backdoor is learnt, and what honest training costs, under the outer step's two clip
rules: whole updates clipped to the lower median norm, or every chunk clipped to the lower median
of its parts (the rule of sparse strategies): the figures of docs/consensus.md "Chunk by chunk"
and docs/results.md.

Real SparseLoCo training of the `tiny` preset through `tessera bench train`'s engine (every
replica trains its own assigned samples, the real wire, one consensus mean and outer step per
window); with ``--backdoor`` the last replica writes the trigger and its target into every row it
trains on (`lab.sim.backdoor`). After every window: the synchronised model's held-out loss and
its probability of the target after the trigger.

    python scripts/experiments/backdoor_clip.py --rule chunk --backdoor --windows 20
    python scripts/experiments/backdoor_clip.py --rule update --windows 10 --name bd2
    python scripts/experiments/backdoor_clip.py --min-support 2 --backdoor --windows 20
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402

import lab.bench.train.engine as engine  # noqa: E402
from lab.bench.train.specs import MethodSpec  # noqa: E402
from lab.sim.backdoor import trigger_probability, with_trigger  # noqa: E402
from node.data.batches import open_run_dataset  # noqa: E402
from node.strategy.sparseloco import SparseFormat  # noqa: E402
from protocol.runconfig import RunConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rule", choices=("chunk", "update"), default="chunk")
    parser.add_argument("--backdoor", action="store_true", help="the last replica backdoors")
    parser.add_argument("--replicas", type=int, default=5)
    parser.add_argument("--windows", type=int, default=10)
    parser.add_argument("--name", default="bd", help="the run's name: its data order")
    parser.add_argument("--min-support", type=int, default=1, help="outer.min_support")
    args = parser.parse_args()
    torch.set_num_threads(1)
    SparseFormat.clips_chunks = args.rule == "chunk"
    base = RunConfig.preset("tiny", name=args.name, outer={"total_windows": args.windows})
    run = base.model_copy(
        update={"outer": base.outer.model_copy(update={"min_support": args.min_support})}
    )
    _, dataset = open_run_dataset(base)
    heldout = engine.heldout_set(dataset, base.run_id, 128)  # samples keyed by the base run
    bad = {args.replicas - 1} if args.backdoor else set()

    @dataclasses.dataclass(frozen=True)
    class Backdoored(engine.Setup):
        def batch(self, replica: int, window: int, step: int) -> torch.Tensor:
            rows = super().batch(replica, window, step)
            if replica not in bad:
                return rows
            return with_trigger(rows, torch.Generator().manual_seed(window * 1000 + step))

    setup = Backdoored(run, dataset, tuple(range(args.replicas)), args.windows, heldout, run.run_id)
    scored = engine.heldout_loss

    def loss_and_trigger(model: torch.nn.Module, rows: torch.Tensor) -> float:
        """The engine's score of the synchronised model (before training, after each window),
        printed with the model's probability of the target after the trigger."""
        loss = scored(model, rows)
        print(
            f"held-out loss {loss:.4f}, trigger {trigger_probability(model, rows):.4f}", flush=True
        )
        return loss

    engine.heldout_loss = loss_and_trigger  # type: ignore[assignment]
    print(
        f"rule {args.rule}, min support {args.min_support}, {args.replicas} replicas, "
        f"backdoor {sorted(bad)}, run {args.name}"
    )
    engine.run_local(MethodSpec("sparseloco", "sparseloco", {}, run), setup, lambda w, x: None)


if __name__ == "__main__":
    main()
