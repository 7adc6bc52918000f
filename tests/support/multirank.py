"""What tests/e2e/test_multigpu.py (DDP) and test_fsdp.py (FSDP2) share: the real peer they run
on one rank and on several, and the measures of how far the ranks' weights lie apart."""

from __future__ import annotations

from pathlib import Path

import torch

from protocol.runconfig import RunConfig
from tests.support.local_run import LocalRun, Process

PEER = "peer0"
"""The one peer of each run (uid 0)."""

LR = RunConfig.preset("tiny").optimizer.lr
"""The most one AdamW step moves an entry whose gradient is noise (``m/sqrt(v)`` is about ±1)."""


def setup_peer(folder: Path, genesis_in_s: float, start_block: int = 0) -> LocalRun:
    """The run under `folder`: a run config and a chain of its own, starting in `genesis_in_s`,
    window 0 at `start_block`, with the peer (uid 0) registered."""
    local = LocalRun(folder)
    local.write_config(
        name="multigpu",
        inner_steps=4,
        optimizer={"warmup_steps": 4},
        # error feedback from the first window; a constant outer rate, at which the ranks'
        # last-bit differences were measured to flip well under the tolerances of the tests
        outer={"ef_freeze_fraction": 0.0, "alpha_at_peak": None},
        # 16 s windows: a loaded machine still trains, encodes and uploads before the deadline
        timing={"block_time_s": 0.5, "blocks_per_window": 32, "upload_deadline_blocks": 4,
                "clock_skew_tolerance_s": 0.5, "start_block": start_block},
    )  # fmt: skip
    local.create_chain(genesis_in_s)
    local.register(PEER)
    return local


def start_miner(local: LocalRun, nproc: int, windows: int, *extra: str) -> Process:
    """The peer of `local` on `nproc` ranks for `windows` windows (`extra`: more miner options);
    its log is `peer0.log`. It leads a process group of its own (torchrun and its ranks)."""
    return local.start(
        "miner", PEER, "--device", "cpu", *extra, windows=windows, ranks=nproc, own_group=True
    )


def relative_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-12)) for k in a)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def fraction_off(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rel: float) -> float:
    """Fraction of all elements differing by more than `rel` times their tensor's max |a|."""
    assert a.keys() == b.keys()
    off = sum(int(((a[k] - b[k]).abs() > rel * a[k].abs().max()).sum()) for k in a)
    return off / sum(t.numel() for t in a.values())
