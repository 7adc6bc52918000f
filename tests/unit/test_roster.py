"""A window's roster on a real SQLite chain: pinned to its first block, probation only for the new.

Attacks: a validator's weights, a commitment or a registration landing right at the gather block
(which nodes reading the chain head would see at different moments), zeroed uids coming back
through probation slots, and a set shrunk to the few peers an early window's weights named.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

import pytest
from substrateinterface import Keypair

from node.runtime.clock import ChainClock
from node.runtime.commit import commitment_for
from node.window.consensus import roster_block, window_roster
from node.window.selection import probation_slots, select_peers
from protocol.chain.local import LocalChain
from protocol.chain.local_db import LocalChainDB, create_local_chain
from protocol.chain.models import Metagraph, Neuron
from protocol.commitment import render_commitment
from protocol.runconfig import RunConfig
from tests.support.chain_clock import Clock

NETUID = 2
BLOCK_TIME = 12.0
GENESIS = 1_000_000.0
RUN = RunConfig.preset(
    "tiny",
    name="roster",
    gather_size=2,
    timing={"blocks_per_window": 10, "upload_deadline_blocks": 2, "start_block": 0},
)
KEYS = [Keypair.create_from_uri(f"//roster{i}") for i in range(6)]  # 0: validator, 1..5: peers


def _commit(chain: LocalChain, key: Keypair, root: Path) -> None:
    url = f"file://{root}?bucket=bucket{KEYS.index(key)}"
    chain.commit(key, render_commitment(commitment_for(url)))


def test_roster_is_pinned_to_the_windows_first_block(tmp_path: Path) -> None:
    clock = Clock(GENESIS, BLOCK_TIME)
    path = tmp_path / "chain.db"
    create_local_chain(path, NETUID, block_time=BLOCK_TIME, clock=clock)
    admin = LocalChainDB(path, clock=clock)
    for i, key in enumerate(KEYS[:4]):
        admin.register(NETUID, key.ss58_address, validator=i == 0, stake=100.0 if i == 0 else 0.0)
    chain = LocalChain(path, NETUID, clock=clock)
    clock.at(1)
    for key in KEYS[:4]:
        _commit(chain, key, tmp_path)
    chain.set_weights(KEYS[0], [1, 2, 3], [0.5, 0.3, 0.2], 0)

    window = 2
    assert roster_block(RUN, window) == 20
    clock.at(23)  # past the roster block and final
    before = window_roster(chain, RUN, window, tmp_path)
    assert before.selected == [1, 2] and before.lead is not None and before.lead.uid == 0

    # around the gather block: weights flip, uid 1's commitment disappears, a newcomer registers
    clock.at(31)
    chain.set_weights(KEYS[0], [3], [1.0], 0)
    admin.register(NETUID, KEYS[4].ss58_address)
    _commit(chain, KEYS[4], tmp_path)
    clock.at(34)
    after = window_roster(chain, RUN, window, tmp_path)
    assert after.selected == before.selected
    assert set(after.buckets) == set(before.buckets) and after.block == before.block
    # the next window sees the changes
    clock.at(45)
    later = window_roster(chain, RUN, window + 2, tmp_path)
    assert 3 in later.selected and 1 not in later.selected
    chain.close()
    admin.close()


def _neuron(uid: int, registered: int, validator: bool = False, last_update: int = 0) -> Neuron:
    return Neuron(
        uid=uid, hotkey=KEYS[uid].ss58_address, stake=10.0 if validator else 0.0,
        validator_permit=validator, registered_block=registered, last_update=last_update,
    )  # fmt: skip


def _metagraph() -> Metagraph:
    return Metagraph(
        netuid=NETUID,
        block=300,
        neurons=[
            _neuron(0, 0, validator=True, last_update=200),
            _neuron(1, 10),  # weighed, positive
            _neuron(2, 10),  # weighed, positive
            _neuron(3, 150),  # registered before the last weights, given nothing: zeroed
            _neuron(4, 250),  # registered after the last weights: never scored
            _neuron(5, 260),  # never scored too, but probation holds one slot
        ],
    )


def test_probation_is_only_for_uids_never_scored() -> None:
    """Slots that positive scores and probation fill are never a zeroed uid's."""
    run = RunConfig.preset("tiny", name="probation", gather_size=3)
    assert probation_slots(run) == 1
    committed = {k.ss58_address for k in KEYS}
    weights = {0: {1: 0.6, 2: 0.4}}
    picked = [select_peers(_metagraph(), committed, weights, run, w) for w in range(40)]
    for sel in picked:
        assert 3 not in sel  # a zeroed uid never takes a slot someone else wants
        assert {1, 2} <= set(sel)
        assert len(set(sel) & {4, 5}) == 1  # exactly the one probation slot
    assert {4, 5} <= {u for sel in picked for u in sel}  # the draw rotates the slot


def test_free_slots_go_to_the_other_candidates_by_the_draw() -> None:
    """With fewer positive scores than slots (a validator that scored only a few peers in a
    window), the set does not shrink to them: the free slots go to the rest in the draw's order,
    zeroed uids and never-scored ones past the probation bound included."""
    run = RunConfig.preset("tiny", name="probation", gather_size=4)
    committed = {k.ss58_address for k in KEYS}
    weights = {0: {1: 0.6, 2: 0.4}}
    picked = [select_peers(_metagraph(), committed, weights, run, w) for w in range(40)]
    assert all(len(sel) == 4 and {1, 2} <= set(sel) for sel in picked)
    assert {3, 4, 5} == {u for sel in picked for u in sel} - {1, 2}  # each gets a free slot
    # when validators zero everyone, every slot is free: the set is the window's draw
    zeroed = {0: {9: 1.0}}
    sets = [select_peers(_metagraph(), committed, zeroed, run, w) for w in range(10)]
    assert all(len(sel) == 4 for sel in sets) and len({tuple(s) for s in sets}) > 1


def test_bootstrap_draws_the_first_gather_size() -> None:
    run = RunConfig.preset("tiny", name="probation", gather_size=3)
    meta = Metagraph(netuid=NETUID, block=5, neurons=[_neuron(u, 1) for u in range(1, 6)])
    committed = {k.ss58_address for k in KEYS}
    sels = {tuple(select_peers(meta, committed, {}, run, w)) for w in range(30)}
    assert all(len(s) == 3 for s in sels) and len(sels) > 1


@pytest.mark.parametrize("fraction,slots", [(0.0, 0), (0.25, 2), (1.0, 8)])
def test_probation_bound_follows_the_run(fraction: float, slots: int) -> None:
    run = RunConfig.preset("tiny", name="probation", consensus={"probation_fraction": fraction})
    assert probation_slots(run) == slots


def _window_at_block_30(tmp_path: Path) -> tuple[Clock, LocalChain, RunConfig]:
    """A chain at genesis and a run whose window 0 is blocks 30-39, its deadline block 42."""
    clock = Clock(GENESIS, BLOCK_TIME)
    path = tmp_path / "chain.db"
    create_local_chain(path, NETUID, block_time=BLOCK_TIME, clock=clock)
    run = RunConfig.preset(
        "tiny", name="early", timing={"blocks_per_window": 10, "upload_deadline_blocks": 2,
                                      "start_block": 30, "block_time_s": BLOCK_TIME},
    )  # fmt: skip
    return clock, LocalChain(path, NETUID, clock=clock), run


def test_a_deadline_before_its_window_begins_is_estimated_from_the_head(tmp_path: Path) -> None:
    """A peer that trains a window before the chain reaches its first block (window 0 before the
    run's start block, or a fast peer) still knows its upload deadline: the head's timestamp plus
    a block time per block; once the first block exists its own timestamp anchors it."""
    clock, chain, run = _window_at_block_30(tmp_path)
    times = ChainClock(chain, run)
    clock.at(5)  # window 0 begins at block 30, its deadline is block 42
    head = times.chain.block()
    expected = times.chain.block_timestamp(head).timestamp() + (42 - head) * BLOCK_TIME
    assert times.deadline_s(0) == pytest.approx(expected)
    clock.at(31)
    first = times.chain.block_timestamp(30).timestamp()
    assert times.deadline_s(0) == pytest.approx(first + 12 * BLOCK_TIME)


class _Stalled:
    """A chain whose blocks from `after` on came `stall_s` late (no block was produced for that
    long): every later block's timestamp is shifted, as on a real chain after a stall."""

    def __init__(self, chain: LocalChain, after: int, stall_s: float) -> None:
        self._chain, self.after, self.stall_s = chain, after, stall_s

    def block_timestamp(self, block: int) -> datetime:
        ts = self._chain.block_timestamp(block)
        return ts + timedelta(seconds=self.stall_s) if block > self.after else ts

    def __getattr__(self, name: str):  # noqa: ANN204 - everything else is the real chain's
        return getattr(self._chain, name)


def test_a_windows_span_runs_from_its_first_block_to_its_gather_block(tmp_path: Path) -> None:
    """The span in which a validator asks whether the chain failed it (`ChainClock.window_span_s`):
    from the timestamp of the window's first block to that of its gather block."""
    clock, chain, run = _window_at_block_30(tmp_path)
    times = ChainClock(chain, run)
    clock.at(times.gather_block(0) + 3)
    start, end = times.window_span_s(0)
    assert start == pytest.approx(chain.block_timestamp(30).timestamp())
    assert end == pytest.approx(chain.block_timestamp(times.gather_block(0)).timestamp())
    assert end - start == pytest.approx((times.gather_block(0) - 30) * BLOCK_TIME)


def test_a_stall_before_the_deadline_moves_the_deadline_with_it(tmp_path: Path) -> None:
    """The chain stops for 60 s inside window 0 (after block 35): its deadline block (42) comes
    60 s later, and an upload stored in those 60 s is on time. Once the deadline block exists
    every node reads the deadline from its own timestamp, not from the window's first block."""
    clock, local, run = _window_at_block_30(tmp_path)
    chain = _Stalled(local, after=35, stall_s=60.0)
    times = ChainClock(chain, run)  # type: ignore[arg-type]
    clock.at(45)  # past the deadline block: the gather
    stalled_deadline = chain.block_timestamp(42).timestamp()
    assert times.deadline_s(0) == pytest.approx(stalled_deadline)
    assert stalled_deadline == pytest.approx(
        chain.block_timestamp(30).timestamp() + 12 * BLOCK_TIME + 60
    )
