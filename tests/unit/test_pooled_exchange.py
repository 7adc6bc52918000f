"""A node's gather and mean through decode workers (`node.window.pooled`), against the strict
in-process path on the same stored updates: the same verdicts (a payload that fails its digest
is ``malformed`` either way, after a header and signature that verify), the same mean bit for
bit, and the usual path whenever the pool does not hold exactly the agreed updates."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from substrateinterface import Keypair

from codec.compress import Compressor
from lab.bench.compress import student_t3
from node.model.shapes import model_spec
from node.strategy import make_strategy
from node.strategy.format import Decoded
from node.window.buckets import PeerBucket
from node.window.exchange import encode_signed
from node.window.gather import Fetched, Pieces, gather
from node.window.pooled import PooledExchange, auto_workers, open_pool, supports
from protocol.naming import update_key
from protocol.runconfig import RunConfig
from protocol.stores import open_store

RUN = RunConfig.preset("tiny", name="pooled")
SPEC = model_spec(RUN.model)
WINDOW = 3


def _peers(tmp_path: Path, n: int = 5, tampered: int = 2) -> list[PeerBucket]:
    """n peers' signed updates in their own buckets; peer `tampered` flips a payload byte after
    signing (its header and signature still verify, its payload digest does not)."""
    peers = []
    gen = torch.Generator().manual_seed(0)
    for uid in range(n):
        key = Keypair.create_from_uri(f"//pooled{uid}")
        comp = Compressor(SPEC, RUN.codec)
        scale = 1e-3 * 4.0 ** (uid % 3)  # far apart: another summing order rounds otherwise
        update = [
            comp.compress(t.name, student_t3(t.shape, gen) * scale, 0.9) for t in SPEC.tensors
        ]
        data = bytearray(encode_signed(update, RUN, SPEC, WINDOW, uid, key))
        if uid == tampered:
            data[-100] ^= 0x01
        store = open_store(f"file://{tmp_path}?bucket=peer{uid}")
        store.put(update_key(RUN.run_id, WINDOW, uid, key.ss58_address), bytes(data))
        peers.append(PeerBucket(uid, key.ss58_address, store, keeps_clock=True))
    return peers


def _ok(fetched: Fetched) -> Decoded:
    """A peer's update that was fetched and decoded."""
    assert fetched.update is not None, fetched.reason
    return fetched.update


@pytest.fixture(scope="module")
def pooled() -> Iterator[PooledExchange]:
    made = PooledExchange.start(RUN, SPEC, 2)
    assert made is not None
    yield made
    made.close()


def test_same_verdicts_and_the_same_mean_as_the_strict_path(
    tmp_path: Path, pooled: PooledExchange
) -> None:
    peers = _peers(tmp_path)
    deadline = time.time() + 60
    strict = gather(peers, RUN, SPEC, WINDOW, deadline)
    fast = gather(peers, RUN, SPEC, WINDOW, deadline, pooled)
    assert {u: f.reason for u, f in fast.items()} == {u: f.reason for u, f in strict.items()}
    assert fast[2].reason.startswith("malformed") and "digest" in fast[2].reason
    assert [u for u, f in fast.items() if f.ok] == [0, 1, 3, 4]

    strategy = make_strategy(RUN, SPEC)
    for agreed_uids in ([0, 1, 3, 4], [4, 1]):
        agreed = {u: _ok(fast[u]) for u in agreed_uids}
        want = strategy.aggregator.mean(Pieces({u: _ok(strict[u]) for u in agreed_uids}))
        got = pooled.mean(agreed, torch.device("cpu"))
        assert got is not None
        for name in want:
            assert torch.equal(got[name], want[name]), name
        # the pooled tensors are lazily decodable too (the usual path, when it is needed)
        assert torch.equal(
            agreed[4].tensors[0].groups[0].idx, _ok(strict[4]).tensors[0].groups[0].idx
        )


def test_the_usual_path_when_the_pool_does_not_hold_the_agreed_updates(
    tmp_path: Path, pooled: PooledExchange
) -> None:
    peers = _peers(tmp_path, n=3, tampered=-1)
    deadline = time.time() + 60
    strict = gather(peers, RUN, SPEC, WINDOW, deadline)
    fast = gather(peers, RUN, SPEC, WINDOW, deadline, pooled)
    mixed = {0: _ok(fast[0]), 1: _ok(strict[1])}  # e.g. the lead's copy replaced ours
    assert pooled.mean(mixed, torch.device("cpu")) is None
    held = {u: _ok(f) for u, f in fast.items()}
    gather(peers, RUN, SPEC, WINDOW + 1, deadline, pooled)  # the pool moved on: all missing
    assert pooled.mean(held, torch.device("cpu")) is None


def test_only_sparse_runs_use_workers_and_small_machines_none() -> None:
    assert supports(RUN, SPEC)
    assert not supports(RunConfig.preset("tiny", strategy="diloco"), SPEC)
    assert open_pool(RUN, SPEC, 0) is None
    assert auto_workers(2) == 0 and auto_workers(8) == 4 and auto_workers(192) == 16


def test_a_validators_stored_updates_step_the_model_as_the_strategy_does(tmp_path: Path) -> None:
    """The validator's outer step (`mean_of_stored`, then `OuterOptimizer.step`) lands on the model of
    the in-process step bit for bit; an update without bytes sends it the usual way."""
    from codec.pool import AggregatePool
    from node.model.llama import build_model
    from node.window.gather import StoredUpdate
    from node.window.pooled import mean_of_stored
    from protocol.stores.spool import InMemory

    peers = _peers(tmp_path, n=4, tampered=-1)
    fetched = gather(peers, RUN, SPEC, WINDOW, time.time() + 60)
    stored = {}
    for u, f in fetched.items():
        assert f.body is not None, f.reason
        stored[u] = StoredUpdate.of(_ok(f), InMemory.of(f.body.read()), RUN, SPEC)
    models = [build_model(RUN.model, RUN.seed) for _ in range(2)]
    strategies = [make_strategy(RUN, SPEC) for _ in range(2)]
    strategies[0].outer.step(models[0], strategies[0].aggregator.mean(Pieces(stored)), 0)
    with AggregatePool(SPEC, RUN.codec, 2, strategies[1].format.max_update_bytes()) as pool:
        mean = mean_of_stored(pool, stored, torch.device("cpu"))
        assert mean is not None
        strategies[1].outer.step(models[1], mean, 0)
        assert mean_of_stored(pool, {**stored, 9: fetched[0].update}, torch.device("cpu")) is None
    after, other = models[0].state_dict(), models[1].state_dict()
    for name, a in after.items():
        assert torch.equal(a, other[name]), name
    initial = build_model(RUN.model, RUN.seed).state_dict()
    assert any(not torch.equal(a, initial[name]) for name, a in after.items())


def test_workers_that_cannot_start_leave_the_node_on_its_own_thread(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import node.window.pooled as pooled_module

    def no_room(*_args: object, **_kw: object) -> None:
        raise RuntimeError("unable to write to file </torch_1_2>: No space left on device (28)")

    monkeypatch.setattr(pooled_module, "AggregatePool", no_room)
    with caplog.at_level("WARNING"):
        assert PooledExchange.start(RUN, SPEC, 4) is None
    assert "could not start" in caplog.text and "No space left" in caplog.text
