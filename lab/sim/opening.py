"""Window 0 opens as soon as every member of the simulation is up.

`lab.sim.layout.build_world` puts window 0's first block where every process can surely have
started (`startup_seconds`, sized for a loaded machine), so nobody misses the beginning. Most runs
are up far sooner: each member posts its bucket commitment on chain as it starts, and once every
member's is there the chain skips ahead (`LocalChainDB.fast_forward`) to `READY_MARGIN_S` before
window 0 instead of idling until then. A member that never comes up leaves the chain to reach
window 0 at its own pace, as without the skip.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from lab.sim.layout import NETUID, World
from protocol.chain.errors import ChainError
from protocol.chain.local import LocalChain
from protocol.runconfig import TimingConfig

READY_MARGIN_S = 5.0
"""Seconds between the last commitment and window 0: what a member does after posting its
commitment (build the model, open the data) before it trains."""


def open_when_up(chain: LocalChain, hotkeys: Iterable[str], timing: TimingConfig) -> int | None:
    """If every one of `hotkeys` has a commitment on `chain`, skip the chain to `READY_MARGIN_S`
    before window 0 (``timing.start_block``) and return how many blocks it skipped (0 when the
    chain was there already); None while someone is still starting."""
    committed = chain.read_all_commitments()
    if any(h not in committed for h in hotkeys):
        return None
    head = chain.block()
    target = timing.start_block - math.ceil(READY_MARGIN_S / timing.block_time_s)
    return max(0, chain.db.fast_forward(target) - head)


@dataclass
class Opening:
    """Skips the chain to window 0 once every member of `world` has committed (`tick`)."""

    world: World
    opened: bool = False
    _chain: LocalChain = field(init=False)

    def __post_init__(self) -> None:
        self._chain = LocalChain(self.world.chain_url.removeprefix("local://"), NETUID)

    def tick(self) -> str | None:
        """Skip ahead if every member is up now; returns the line that says so, once."""
        if self.opened:
            return None
        timing = self.world.run.timing
        try:
            skipped = open_when_up(self._chain, (m.hotkey for m in self.world.members), timing)
        except ChainError:  # an outage or a busy file: the next tick asks again
            return None
        self.opened = skipped is not None
        if not skipped:  # still starting, or the chain got there first
            return None
        return (
            f"all {len(self.world.members)} members are up: window 0 opens in "
            f"{READY_MARGIN_S:.0f} s ({skipped * timing.block_time_s:.0f} s of start-up "
            "allowance skipped)"
        )

    def close(self) -> None:
        self._chain.close()
