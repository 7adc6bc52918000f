"""`tessera sim --faults …`: ordinary faults injected into a running simulation.

The simulation's invariants then still hold: the honest models and the validator's are identical
after every window, and every process exits 0. The faults, each at a fixed point of the chain so
that a run is reproducible:

- ``store-errors``: every bucket is served through `lab.sim.flaky_s3` (S3 behind a proxy that
  answers 503 SlowDown to first tries, loses answers to writes it stored and throttles writes);
  on ``file`` storage the S3 server is moto's, started by the simulation;
- ``lead-restart``: the lead validator is killed (SIGKILL, no clean shutdown) a few blocks after
  window 1's gather block, in the middle of its decision, and started again at once; it resumes
  from its saved state and must not publish a second decision for a window;
- ``lead-down``: the lead validator is killed after window 2's gather block and started again
  two windows later; meanwhile the standby's manifest applies (``--validators 2``; with one
  validator no manifest is published and every node applies nothing), and the restarted lead
  catches up on the windows it missed without publishing late decisions;
- ``peer-restart``: the first honest peer is killed (SIGKILL) a third of the way into window
  3's training and started again at once; it resumes from its saved state and its model stays
  the others' after every window;
- ``chain-stall``: the chain answers nothing (every call fails as an unreachable endpoint's does)
  for one and a half windows, at least `STALL_MIN_S`, from a few blocks before window 5's gather
  block: nodes ride it out and go on, none exits;
- ``load``: two busy loops at normal priority for the whole run, so the machine is full and every
  node (the lead first) is slowed down.
"""

from __future__ import annotations

import math
import os
import subprocess
from dataclasses import dataclass, field

from lab.sim.layout import World
from lab.sim.processes import Running, start
from node.runtime.report_log import REPORTS, read_json_lines
from protocol.chain.local_db import LocalChainDB
from protocol.windows import WindowSchedule

FAULT_KINDS = ("store-errors", "lead-restart", "lead-down", "peer-restart", "chain-stall", "load")
RESTART_AFTER_GATHER = 3  # blocks after window 1's gather block: the lead is deciding
DOWN_WINDOWS = 2  # how long the lead stays down
PEER_RESTART_WINDOW = 3  # the first honest peer is killed in this window's training
STALL_WINDOW, STALL_BEFORE_GATHER = 5, 3  # the chain stalls 3 blocks before window 5's gather
STALL_MIN_S = 45.0
"""The shortest chain stall: longer than a chain client's usual retries last."""


WINDOWS_NEEDED = {
    "lead-restart": 2,
    "lead-down": 3 + DOWN_WINDOWS,
    "peer-restart": PEER_RESTART_WINDOW + 2,
    "chain-stall": STALL_WINDOW + 1,
}
"""How many windows a run needs for the fault to happen and the run to go on after it."""


DEFAULT_BLOCKS_PER_WINDOW = 30
LOAD_HOGS = 2  # busy loops of the ``load`` fault


def default_blocks_per_window(kinds: list[str], cores: int | None = None) -> int:
    """The simulation's window length when ``--blocks-per-window`` is not given: 30 blocks, or,
    under the ``load`` fault, longer by the share of the machine its busy loops take
    (``× (1 + 2 / cores)``: 60 blocks on two cores), so that a loaded node's training still fits
    its window as it does on a quiet machine."""
    if "load" not in kinds:
        return DEFAULT_BLOCKS_PER_WINDOW
    cores = cores or os.cpu_count() or 1
    return math.ceil(DEFAULT_BLOCKS_PER_WINDOW * (1 + LOAD_HOGS / cores))


def parse_faults(text: str, windows: int) -> list[str]:
    """The fault kinds of a ``--faults`` value for a run of `windows`; `SystemExit` with the
    known ones, or the windows a fault needs, otherwise."""
    kinds = [k for k in text.split(",") if k]
    unknown = sorted(set(kinds) - set(FAULT_KINDS))
    if unknown:
        raise SystemExit(f"unknown faults: {', '.join(unknown)} (known: {', '.join(FAULT_KINDS)})")
    for kind in kinds:
        if windows < WINDOWS_NEEDED.get(kind, 1):
            raise SystemExit(
                f"--faults {kind} needs --windows {WINDOWS_NEEDED[kind]} or more, so that the run "
                "goes on after it"
            )
    return kinds


@dataclass
class Injector:
    """Injects the faults of `kinds` while `supervise` ticks (`tick` every second)."""

    world: World
    kinds: list[str]
    validator_windows: int  # windows the validator must process in all (the peers: one fewer)
    chain: LocalChainDB = field(init=False)  # the admin handle: it sees blocks through a stall
    _due: list[tuple[int, str]] = field(init=False)  # (block, action), in block order
    _hogs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.chain = LocalChainDB(self.world.chain_url.removeprefix("local://"))
        sched = WindowSchedule.from_run(self.world.run)
        due = []
        if "lead-restart" in self.kinds:
            at = sched.gather_block(1) + RESTART_AFTER_GATHER
            due += [(at, "kill"), (at, "start")]
        if "lead-down" in self.kinds:
            down = sched.gather_block(2) + RESTART_AFTER_GATHER
            due += [(down, "kill"), (down + DOWN_WINDOWS * sched.blocks_per_window, "start")]
        if "peer-restart" in self.kinds:
            at = sched.first_block(PEER_RESTART_WINDOW) + sched.blocks_per_window // 3
            due += [(at, "kill peer"), (at, "start peer")]
        if "chain-stall" in self.kinds:
            due += [(sched.gather_block(STALL_WINDOW) - STALL_BEFORE_GATHER, "stall")]
        self._due = sorted(due, key=lambda d: d[0])
        if "load" in self.kinds:
            self._hogs = [
                subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(LOAD_HOGS)
            ]

    def tick(self, running: list[Running]) -> None:
        """Run every action whose block the chain has reached (the validator is replaced in
        `running` when it is started again)."""
        block = self.chain.owner_block()
        while self._due and self._due[0][0] <= block:
            _, action = self._due.pop(0)
            if action == "stall":
                run = self.world.run.timing
                self.chain.set_outage(
                    max(STALL_MIN_S, 1.5 * run.block_time_s * run.blocks_per_window)
                )
                continue
            kind = "honest" if action.endswith(" peer") else "validator"
            i = next(i for i, r in enumerate(running) if r.member.kind == kind)
            if action.startswith("kill"):
                running[i].proc.kill()
                running[i].proc.wait()
            else:
                left = self._windows_left(running[i], block)
                running[i] = start(self.world, running[i].member, left)

    def _windows_left(self, r: Running, block: int) -> int:
        """The windows a restarted member has left, so that it stops at the run's last window.
        A validator counts every window it decides, those it catches up on too: what it has not
        reported. A peer counts the windows it trains, and catches up to the chain's window
        without training the ones in between: the windows from the chain's on."""
        if r.member.kind == "validator":
            done = len(read_json_lines(r.member.state_dir / REPORTS))
            return max(1, self.validator_windows - done)
        current = WindowSchedule.from_run(self.world.run).window_of(block)
        return max(1, self.validator_windows - 1 - max(current, 0))

    def stop(self) -> None:
        for hog in self._hogs:
            hog.kill()
            hog.wait()
        self.chain.close()
