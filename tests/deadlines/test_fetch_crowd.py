"""A crowd of stalling buckets against the fetch (docs/consensus.md, attacks): endpoints that hold
a connection slot as long as the rate rule lets them, registered ahead of the honest peers in uid
order, four times their number. Each request of a crowded pool gets a fair share of the budget;
the window's selected updates and the fingerprints have slots of their own."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest
import torch

from codec.spec import ModelSpec
from lab.sim.forgeries import noise_update
from lab.sim.slow_store import SlowStore
from node.model.llama import build_model
from node.window.buckets import PeerBucket
from node.window.exchange import encode_signed
from protocol.credentials import ReadCredentials
from protocol.keys import create_hotkey
from protocol.naming import update_key
from protocol.runconfig import RunConfig
from protocol.stores import S3Store, open_store
from protocol.stores.fetch import MARGIN_S, FetchRequest, Got, TooSlow, fetch_many
from validator.fetching import fetch_uploads

READ = ReadCredentials(access_key_id="r", secret_access_key="r")
HONEST = 8
CROWD = 4 * HONEST
BUDGET = 6.0
# the rate rule never cuts the crowd (its grace is the whole budget): they hold a slot as long as
# an endpoint sending just above the minimum rate would
RUN = RunConfig.preset(
    "tiny",
    name="crowd",
    inner_steps=2,
    consensus={"fetch_budget_s": BUDGET, "rate_grace_s": BUDGET},
)
SPEC = ModelSpec.from_module(build_model(RUN.model, RUN.seed))
WINDOW = 3


def test_a_stalling_crowd_ahead_in_line_holds_each_slot_for_a_share_not_the_budget(
    tmp_path: Path,
) -> None:
    (tmp_path / "honest").mkdir()
    for i in range(4):
        (tmp_path / "honest" / f"{i}.bin").write_bytes(bytes([i]) * 1000)
    honest = open_store(f"file://{tmp_path}?bucket=honest")
    with SlowStore(tmp_path, "hang") as endpoint:
        evil = S3Store("evil", READ, endpoint=endpoint)
        requests: dict[tuple[str, int] | int, FetchRequest] = {
            ("crowd", i): FetchRequest(evil, f"crowd/{i}.bin", 1 << 20) for i in range(16)
        }
        requests |= {i: FetchRequest(honest, f"{i}.bin", 1 << 20) for i in range(4)}
        t0 = time.monotonic()
        # 4 slots, 16 stalling requests first in line: each holds its slot for 5 x 4 / 20 s, so
        # the honest four get theirs after 4 s, with a second left on a loaded machine
        out = fetch_many(
            requests, budget_s=5.0, min_rate_bytes_s=1.0, grace_s=5.0, max_connections=4
        )
        took = time.monotonic() - t0
    assert took <= 5.0 + MARGIN_S
    for i in range(4):
        got = out[i]
        assert isinstance(got, Got) and got.data == bytes([i]) * 1000, out
    # every stalling request fails; those that held a slot while others waited were cut at
    # their share (the last few may outlast the honest reads, which then leave nobody waiting,
    # and run to the deadline)
    crowd = [out[("crowd", i)] for i in range(16)]
    assert not any(isinstance(got, Got) for got in crowd), crowd
    assert sum(isinstance(got, TooSlow) for got in crowd) >= 12, crowd


@pytest.mark.parametrize("selected", [False, True])
def test_the_lead_fetches_every_honest_peer_behind_a_crowd_four_times_their_number(
    tmp_path: Path, selected: bool
) -> None:
    root = tmp_path / "wallets"
    honest_keys = [create_hotkey("h", f"h{i}", root=root) for i in range(HONEST)]
    crowd_key = create_hotkey("s", "sybil", root=root)
    update = noise_update(SPEC, RUN, 0.01, torch.Generator().manual_seed(0))
    peers = []
    with SlowStore(tmp_path, "hang") as endpoint:
        evil = S3Store("evil", READ, endpoint=endpoint)
        # the crowd first in uid order: uids 0 .. CROWD - 1 (each bucket also stalls the
        # fingerprint request of window - 1)
        peers += [PeerBucket(uid, crowd_key.ss58_address, evil) for uid in range(CROWD)]
        for i, key in enumerate(honest_keys):
            uid = CROWD + i
            store = open_store(f"file://{tmp_path}?bucket=peer-{uid}")
            data = encode_signed(update, RUN, SPEC, WINDOW, uid, key)
            store.put(update_key(RUN.run_id, WINDOW, uid, key.ss58_address), data)
            peers.append(PeerBucket(uid, key.ss58_address, store))
        chosen = range(CROWD, CROWD + HONEST) if selected else ()
        spool = Path(tempfile.mkdtemp(dir=tmp_path))
        t0 = time.monotonic()
        out = fetch_uploads(peers, RUN, SPEC, WINDOW, time.time() + 600, spool, selected=chosen)
        took = time.monotonic() - t0
    assert took <= BUDGET + MARGIN_S + 30  # then each honest update is verified and decoded
    reached = [uid for uid in range(CROWD, CROWD + HONEST) if out[uid].fetched.ok]
    assert reached == list(range(CROWD, CROWD + HONEST)), [
        out[u].fetched.reason for u in range(CROWD, CROWD + HONEST)
    ]
    assert not any(out[uid].fetched.ok for uid in range(CROWD))
