"""Run the bench's methods one after another, or ``jobs`` at a time in worker processes.

The methods are independent (each builds its own models from the run's seed and reads the same
token stream), so running them in parallel changes nothing in their results; it only uses more
cores. Workers are spawned (never forked: torch's thread pools do not survive a fork) and report
every window back through a queue, so progress shows as it happens.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from typing import Any

import torch

from lab.bench.train.engine import Curve, Setup, run_method
from lab.bench.train.specs import MethodSpec

Report = Callable[[int, int, float], None]  # (method index, window, held-out loss)


def _worker(index: int, m: MethodSpec, parts: dict[str, Any], threads: int, q: Any) -> Curve:
    from node.data.batches import open_run_dataset

    if threads:
        torch.set_num_threads(threads)
    _, dataset = open_run_dataset(parts["base"])
    setup = Setup(dataset=dataset, **parts)
    return run_method(m, setup, lambda w, loss: q.put((index, w, loss)))


def run_all(
    tasks: list[tuple[MethodSpec, Setup]], jobs: int, threads: int, report: Report
) -> list[Curve]:
    """Every task's `Curve` (a method trained in a setup, e.g. one of several seeds), in the
    order given; ``jobs`` workers share all of them, so no core waits for the next seed."""
    if jobs <= 1 or len(tasks) <= 1:
        return [run_method(m, setup, partial(report, i)) for i, (m, setup) in enumerate(tasks)]
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager, ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        q = manager.Queue()
        futures = [
            pool.submit(_worker, i, m, _parts(setup), threads, q)
            for i, (m, setup) in enumerate(tasks)
        ]
        while True:
            try:
                report(*q.get(timeout=0.5))
            except queue.Empty:
                if all(f.done() for f in futures):
                    break
        while not q.empty():
            report(*q.get())
        return [f.result() for f in futures]


def _parts(setup: Setup) -> dict[str, Any]:
    """A setup without its dataset, which each worker opens again."""
    return {
        "base": setup.base, "uids": setup.uids, "windows": setup.windows,
        "heldout": setup.heldout, "data_run_id": setup.data_run_id, "device": setup.device,
    }  # fmt: skip
