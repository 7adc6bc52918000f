"""One FSDP2 peer's windows under torchrun, for tests/test_fsdp.py: train, save the full state
(rank 0, atomically, as `state.pt`) after every window, resume from it on start.

    torchrun --nproc_per_node 2 tests/fsdp_worker.py OUT WINDOWS [HOLD_AFTER]

With HOLD_AFTER, rank 0 writes OUT/held-<window> after saving that window and then waits to be
killed (`kill -9`); without, the final full weights go to OUT/weights.pt.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from node.model.llama import build_model
from node.model.train import make_optimizer, train_window
from node.runtime.fsdp import full_state, full_tensors, init_sharded_ranks, load_state
from node.runtime.state import FORMAT, load_rotating, save_rotating
from protocol.runconfig import RunConfig

RUN = RunConfig.preset("tiny", inner_steps=2, optimizer={"warmup_steps": 2})


def main(out: Path, windows: int, hold_after: int | None) -> None:
    torch.set_num_threads(1)
    ranks, device = init_sharded_ranks("cpu", RUN)
    model = build_model(RUN.model, RUN.seed)
    ranks.wrap(model)
    optimizer = make_optimizer(model, RUN)
    current, previous = out / "state.pt", out / "state.prev.pt"
    saved = load_rotating(current, previous, RUN.run_id) if ranks.is_main else None
    start = ranks.broadcast_object(saved["window"] if saved else 0)
    if start:
        load_state(model, optimizer, saved and saved["model"], saved and saved["optimizer"])
    for window in range(start, windows):
        gen = torch.Generator().manual_seed(1000 + window)
        batches = [torch.randint(0, 4096, (8, 33), generator=gen) for _ in range(RUN.inner_steps)]
        train_window(model, optimizer, map(ranks.local_rows, batches), RUN, window, device)
        model_state, optimizer_state = full_state(model, optimizer)
        if ranks.is_main:
            body = {"format": FORMAT, "run_id": RUN.run_id, "window": window + 1,
                    "model": model_state, "optimizer": optimizer_state}  # fmt: skip
            save_rotating(current, previous, body)
            if hold_after == window + 1:
                (out / f"held-{window + 1}").write_text("saved")
                time.sleep(600)  # until kill -9
        ranks.barrier()
    weights = full_tensors(model)
    if ranks.is_main:
        torch.save(weights, out / "weights.pt")
    dist.barrier()
    ranks.close()


if __name__ == "__main__":
    hold = int(sys.argv[3]) if len(sys.argv) > 3 else None
    main(Path(sys.argv[1]), int(sys.argv[2]), hold)
