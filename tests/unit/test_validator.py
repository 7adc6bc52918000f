"""Validator unit tests: each classification, copies (perturbed) and replays, ratings and weights."""

from __future__ import annotations

import math
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
import torch

from codec.spec import ModelSpec
from lab.sim.forgeries import noise_update, perturbed_copy
from lab.sim.slow_store import SlowStore
from node.model.llama import build_model
from node.window.buckets import PeerBucket
from node.window.exchange import encode_signed
from node.window.gather import checked, fetch_all, update_request
from protocol.chain import open_chain
from protocol.chain.local_db import LocalChainDB, create_local_chain
from protocol.credentials import ReadCredentials
from protocol.keys import create_hotkey
from protocol.naming import update_key
from protocol.runconfig import RunConfig
from protocol.stores import S3Store, open_store
from protocol.stores.fetch import MARGIN_S, Got
from protocol.stores.spool import Spooled, SpoolError
from validator.checks import Verdict, classify_fetch, in_sync, norm_outliers
from validator.classify import check_window
from validator.config import ValidatorConfig
from validator.copies import Sketch, SketchHistory, Stamp, explain, explain_window, overlap, sketch
from validator.fetching import fetch_uploads
from validator.ratings import Book, PeerRecord, WindowOutcome
from validator.state import ValidatorState, load_state, save_state
from validator.weights import normalise, set_weights, version_key

REPLAY = ValidatorConfig().replay_threshold

RUN = RunConfig.preset("tiny", name="vt", inner_steps=2)
SPEC = ModelSpec.from_module(build_model(RUN.model, RUN.seed))
WINDOW = 3


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> list:
    root = tmp_path_factory.mktemp("wallets")
    return [create_hotkey("t", f"k{i}", root=root) for i in range(3)]


@pytest.fixture(scope="module")
def update() -> list:
    return noise_update(SPEC, RUN, 0.01, torch.Generator().manual_seed(0))


def _bucket(tmp: Path, name: str, uid: int, hotkey: str) -> tuple[PeerBucket, object]:
    store = open_store(f"file://{tmp}?bucket={name}")
    return PeerBucket(uid, hotkey, store), store


def _spool(tmp: Path) -> Path:
    """A new, empty spool directory for one `fetch_uploads`."""
    return Path(tempfile.mkdtemp(dir=tmp, prefix="spool-"))


def _put(store: object, data: bytes, uid: int, hotkey: str, window: int = WINDOW) -> None:
    store.put(update_key(RUN.run_id, window, uid, hotkey), data)  # type: ignore[attr-defined]


# -- classification from the fetch ---------------------------------------------------------------


def test_fetch_verdicts(tmp_path: Path, keys: list, update: list) -> None:
    now = time.time()
    a, b = keys[0], keys[1]
    peer, store = _bucket(tmp_path, "peer-a", 0, a.ss58_address)
    verdict = lambda deadline: classify_fetch(  # noqa: E731
        fetch_uploads([peer], RUN, SPEC, WINDOW, deadline, _spool(tmp_path))[0].fetched
    )[0]
    assert verdict(now + 60) is Verdict.MISSING
    _put(store, encode_signed(update, RUN, SPEC, WINDOW, 0, a), 0, a.ss58_address)
    now = time.time()  # the object's time is at most this (however loaded the machine is)
    assert verdict(now + 60) is Verdict.OK
    # stored 100 s after the deadline: late whatever its content (tolerance 1 s in the tiny run)
    assert verdict(now - 100) is Verdict.LATE
    # within the clock-skew tolerance: still on time
    assert verdict(now - RUN.timing.clock_skew_tolerance_s / 2) is Verdict.OK
    # signed by another key, or made for another window / uid: invalid
    _put(store, encode_signed(update, RUN, SPEC, WINDOW, 0, b), 0, a.ss58_address)
    assert verdict(now + 60) is Verdict.INVALID
    _put(store, encode_signed(update, RUN, SPEC, WINDOW + 1, 0, a), 0, a.ss58_address)
    assert verdict(now + 60) is Verdict.INVALID
    _put(store, encode_signed(update, RUN, SPEC, WINDOW, 1, a), 0, a.ss58_address)
    assert verdict(now + 60) is Verdict.INVALID
    _put(store, b"TSRU\x01garbage" * 10, 0, a.ss58_address)
    assert verdict(now + 60) is Verdict.MALFORMED


def test_fetch_uploads_contains_a_hanging_peer(tmp_path: Path, keys: list, update: list) -> None:
    run = RunConfig.preset("tiny", name="vt", inner_steps=2, consensus={"fetch_budget_s": 1.0})
    good, store = _bucket(tmp_path, "peer-a", 0, keys[0].ss58_address)
    data = encode_signed(update, run, SPEC, WINDOW, 0, keys[0])
    store.put(update_key(run.run_id, WINDOW, 0, keys[0].ss58_address), data)  # type: ignore[attr-defined]
    with SlowStore(tmp_path, "hang") as endpoint:
        evil = S3Store(
            "evil", ReadCredentials(access_key_id="r", secret_access_key="r"), endpoint=endpoint
        )
        hung = PeerBucket(1, keys[1].ss58_address, evil)
        t0 = time.time()
        out = fetch_uploads([good, hung], run, SPEC, WINDOW, time.time() + 60, _spool(tmp_path))
        # the hung endpoint would hold the fetch until the deadline, 60 s away; the budget ends
        # it after 1 s (+ the fetch's margin), then the good update is verified and decoded,
        # which a loaded machine (the suite's niced half) may take a few seconds over
        assert time.time() - t0 < 1.0 + MARGIN_S + 10
    assert out[0].fetched.ok and out[0].body is not None
    assert classify_fetch(out[1].fetched)[0] is Verdict.UNREACHABLE


def test_a_lost_spool_file_is_our_fault_not_the_peers(
    tmp_path: Path, keys: list, update: list
) -> None:
    """A spool file gone between the fetch and a use raises `SpoolError`: the window stops
    loudly, and no verdict (malformed, invalid) is ever published against the peer."""
    hotkey = keys[0].ss58_address
    peer, store = _bucket(tmp_path, "peer-a", 0, hotkey)
    _put(store, encode_signed(update, RUN, SPEC, WINDOW, 0, keys[0]), 0, hotkey)
    got = fetch_all({0: update_request(peer, RUN, SPEC, WINDOW, _spool(tmp_path))}, RUN)[0]
    assert isinstance(got, Got) and isinstance(got.body, Spooled)
    got.body.path.unlink()
    with pytest.raises(SpoolError):
        checked(0, hotkey, got, RUN, SPEC, WINDOW, time.time() + 60)
    uploads = fetch_uploads([peer], RUN, SPEC, WINDOW, time.time() + 60, _spool(tmp_path))
    body = uploads[0].body
    assert uploads[0].fetched.ok and isinstance(body, Spooled)
    body.path.unlink()
    with pytest.raises(SpoolError):
        check_window(
            WINDOW, {0: hotkey}, uploads, {}, None, SketchHistory(4), RUN, SPEC,
            ValidatorConfig(), 0,
        )  # fmt: skip


def test_norm_and_sync_verdicts() -> None:
    norms = {0: 1.0, 1: 1.2, 2: 0.9, 3: 15.0, 4: math.nan, 5: 0.001}
    assert list(norm_outliers(norms, [1.0, 1.2, 0.9], ratio=10.0)) == [3]
    assert norm_outliers(norms, [], ratio=10.0) == {}
    assert in_sync("ab", "ab") is True and in_sync("ab", "cd") is False
    assert in_sync(None, "ab") is False  # a peer that publishes no fingerprint is out of sync
    assert in_sync("ab", None) is None  # nothing to compare with (window 0)


# -- copies and replays --------------------------------------------------------------------------


def _sk(
    uid: int, window: int, upd: list, digest: bytes | None = None, size: int = 1 << 16
) -> Sketch:
    return sketch(uid, window, digest or bytes([uid, window]) * 16, upd, SPEC, RUN.codec, size, 5)


def test_perturbed_copy_is_caught_and_the_later_upload_is_the_copier(update: list) -> None:
    gen = torch.Generator().manual_seed(1)
    copy = perturbed_copy(update, RUN.codec, gen, jitter=0.5, move_chunks=0.3)
    other = noise_update(SPEC, RUN, 0.01, gen)
    sk = {0: _sk(0, WINDOW, update), 1: _sk(1, WINDOW, copy), 2: _sk(2, WINDOW, other)}
    assert overlap(sk[0], sk[1]) > 0.9  # values jittered, 30 % of chunks with an index moved
    assert overlap(sk[0], sk[2]) < 0.05  # independent Top-k sets: ~k/C
    t = datetime(2026, 1, 1, tzinfo=UTC)
    hist = SketchHistory(4)

    def explained(stamps: dict[int, Stamp]) -> dict[int, tuple[float, tuple]]:
        return {
            u: (e.window.share, e.window.sources)
            for u, e in explain_window(sk, stamps, hist, REPLAY).items()
        }

    later0 = explained(
        {0: Stamp(t + timedelta(seconds=5), True), 1: Stamp(t, True), 2: Stamp(t, True)}
    )
    assert later0[0][0] > 0.9 and later0[0][1][0] == (1, WINDOW)  # uid 0 uploaded later
    assert later0[1][0] < 0.05 and later0[2][0] < 0.05
    # the same second on trusted clocks: no known order, so neither is judged the copier (with
    # the uid as a tie-break a copier with the lower uid would make its victim the copier)
    tie = explained({u: Stamp(t, True) for u in sk})
    assert tie[0][0] < 0.05 and tie[1][0] < 0.05
    # a copier whose own server keeps the clock cannot claim to be first
    forged = explained(
        {
            0: Stamp(t + timedelta(seconds=5), True),
            1: Stamp(t - timedelta(hours=1), False),
            2: Stamp(t, True),
        }
    )
    assert forged[1][0] > 0.9 and forged[0][0] < 0.05
    # between two untrusted clocks the order is unknown: each explains the other
    both = explained({u: Stamp(t, False) for u in sk})
    assert both[0][0] > 0.9 and both[1][0] > 0.9 and both[2][0] < 0.05


def test_identical_digest_is_a_copy_and_sampled_sketches_agree(update: list) -> None:
    a = _sk(0, WINDOW, update, b"d" * 32, size=2000)
    b = _sk(1, WINDOW, update, b"d" * 32, size=2000)
    assert overlap(a, b) == 1.0
    assert 0 < a.positions.size < 4000  # sub-sampled: about `size` positions
    full = overlap(
        _sk(0, 1, update), _sk(1, 1, perturbed_copy(update, RUN.codec, torch.Generator()))
    )
    sampled = overlap(
        _sk(0, 1, update, size=4000),
        _sk(1, 1, perturbed_copy(update, RUN.codec, torch.Generator()), size=4000),
    )
    assert abs(full - sampled) < 0.05


def test_replay_of_an_older_window_is_detected_and_history_is_bounded(update: list) -> None:
    hist = SketchHistory(windows=2)
    hist.add(1, [_sk(0, 1, update)])
    replay = _sk(2, 2, perturbed_copy(update, RUN.codec, torch.Generator()))
    e = explain_window({2: replay}, {}, hist, REPLAY)[2]
    assert e.history.share > 0.9 and e.history.sources == ((0, 1),) and e.window.share == 0.0
    fresh = noise_update(SPEC, RUN, 0.01, torch.Generator().manual_seed(9))
    assert explain(_sk(2, 2, fresh), hist.entries()).share < 0.05
    hist.add(3, [])
    hist.add(4, [])
    assert hist.entries() == []  # window 1 fell out of the last 2 windows


# -- ratings, penalties, weights -----------------------------------------------------------------


def _ok(hk: str, score: float, own_z: float = 4.0) -> WindowOutcome:
    return WindowOutcome(
        hotkey=hk, verdict=Verdict.OK, in_sync=True, score=score, own_z=own_z, own_effect=1.0
    )


def test_rating_maths_noise_zero_honest_positive() -> None:
    cfg = ValidatorConfig()
    book = Book(cfg)
    for _ in range(4):
        book.update(
            {
                0: _ok("a", 0.02),
                1: _ok("b", 0.01),
                2: _ok("n", -0.001, own_z=0.0),  # noise: hurts random data, no own-data signal
                3: WindowOutcome(hotkey="m", verdict=Verdict.MISSING),
                4: WindowOutcome(hotkey="c", verdict=Verdict.COPY, score=0.02, own_z=0.0),
            }
        )
    final = book.final_scores()
    assert final[0] > final[1] > 0
    assert final[2] == final[3] == final[4] == 0.0
    rec = book.records[0]
    # four windows at z = 4 pool to Z = 16 / 2 = 8: past own_z_full, so the own factor is 1
    assert rec.own_pooled == pytest.approx(8.0)
    b = book.breakdown(0)
    assert b["indicator_factor"] == 1.0
    # relative to the window's median accepted score: of a, b and n in the first window (nobody
    # has own-data evidence yet), of a and b (the peers whose evidence earns) after it
    relative = [0.02 / 0.01] + [0.02 / 0.015] * 3
    ema = 0.0
    for x in relative:
        ema = 0.7 * ema + 0.3 * x
    gain = ema / (1 - 0.7**4)  # bias-corrected: four windows from 0
    assert b["gain_factor"] == pytest.approx(gain)
    assert b["final"] == pytest.approx(gain * rec.sync_ema * (1 - rec.penalty))
    assert book.records[3].penalty == 1.0  # 0.5 per missed window, capped at 1


def test_lucky_noise_and_every_honest_peer() -> None:
    """Noise whose gain drifts slightly above zero earns nothing; the last honest peer earns."""
    book = Book(ValidatorConfig())
    for _ in range(4):
        book.update({0: _ok("a", 0.02), 1: _ok("b", 0.01), 2: _ok("n", 0.0001)})
    final = book.final_scores()
    assert final[0] > final[1] > 0.0
    assert book.records[2].gain_ema > 0.0 and final[2] == 0.0


def test_penalty_decays_so_a_peer_recovers() -> None:
    cfg = ValidatorConfig()
    book = Book(cfg)
    book.update({0: _ok("a", 0.02), 1: _ok("b", 0.01)})
    book.update({0: WindowOutcome(hotkey="a", verdict=Verdict.LATE), 1: _ok("b", 0.01)})
    assert book.records[0].penalty == 0.5
    for _ in range(4):
        book.update({0: _ok("a", 0.02), 1: _ok("b", 0.01)})
    assert book.records[0].penalty == pytest.approx(0.5 * 0.5**4)
    # a recycled uid (new hotkey) starts from scratch
    book.update({0: _ok("new", 0.02), 1: _ok("b", 0.01)})
    assert book.records[0].hotkey == "new" and book.records[0].penalty == 0.0


def test_a_chain_outage_excuses_lateness_and_absence_but_no_offence() -> None:
    """Two late windows in a row zero a peer's pay, unless the chain failed the validator while
    they ran: then late and missing leave the penalty as it was (neither added to nor decayed),
    while a copy in the same window is held against the peer as ever."""
    cfg = ValidatorConfig()
    late = {0: WindowOutcome(hotkey="a", verdict=Verdict.LATE), 1: _ok("b", 0.01)}
    strict, lenient = Book(cfg), Book(cfg)
    for book, down in ((strict, False), (lenient, True)):
        book.update({0: _ok("a", 0.02), 1: _ok("b", 0.01)})
        book.update(late, chain_was_down=down)
        book.update({**late, 2: WindowOutcome(hotkey="c", verdict=Verdict.COPY)}, down)
        book.update(
            {0: WindowOutcome(hotkey="a", verdict=Verdict.MISSING), 1: _ok("b", 0.01)}, down
        )
    assert strict.records[0].penalty == 1.0 and strict.final_scores()[0] == 0.0
    assert lenient.records[0].penalty == 0.0 and lenient.final_scores()[0] > 0.0
    assert lenient.records[2].penalty == strict.records[2].penalty == cfg.penalty_copy
    lenient.update({0: WindowOutcome(hotkey="a", verdict=Verdict.LATE), 1: _ok("b", 0.01)})
    assert lenient.records[0].penalty == cfg.penalty_late  # the chain up again: held against it


def test_weights_normalise_and_land_on_the_local_chain(tmp_path: Path, keys: list) -> None:
    assert normalise({0: 2.0, 1: 0.0, 2: 6.0, 9: 1.0}, {0, 1, 2}) == {0: 0.25, 2: 0.75}
    assert normalise({0: 0.0}, {0}) == {}
    create_local_chain(tmp_path / "c.db", 1, block_time=0.5)
    db = LocalChainDB(tmp_path / "c.db")
    db.register(1, keys[0].ss58_address, validator=True)
    db.register(1, keys[1].ss58_address)
    db.register(1, keys[2].ss58_address)
    chain = open_chain(f"local://{tmp_path / 'c.db'}", netuid=1)
    assert set_weights(chain, keys[0], RUN, {}).startswith("skipped")
    assert set_weights(chain, keys[0], RUN, {1: 0.25, 2: 0.75}) == "set 2 weights"
    got = chain.read_weights(0)
    assert got == pytest.approx({1: 0.25, 2: 0.75}, abs=1e-4)
    assert set_weights(chain, keys[1], RUN, {2: 1.0}).startswith("failed: PermissionDenied")
    assert version_key(RUN) == RUN.codec_version


def test_state_roundtrip(tmp_path: Path, update: list) -> None:
    model = {"w": torch.arange(6.0)}
    state = ValidatorState(
        run_id=RUN.run_id, window=7, model=model, fingerprint="f", salt=2**62 + 3,
        records={3: PeerRecord(hotkey="x", mu=30.0, penalty=0.25)},
        sketches=[_sk(3, 6, update)],
    )  # fmt: skip
    save_state(tmp_path, state)
    save_state(tmp_path, state)  # previous kept
    back = load_state(tmp_path, RUN.run_id)
    assert back is not None and back.window == 7 and back.salt == state.salt
    assert back.records[3] == state.records[3]
    assert np.array_equal(back.sketches[0].positions, state.sketches[0].positions)
    assert back.sketches[0].digest == state.sketches[0].digest
    assert torch.equal(back.model["w"], model["w"])
    (tmp_path / "validator.pt").write_bytes(b"torn")
    assert load_state(tmp_path, RUN.run_id) is not None  # falls back to the previous file


def test_an_update_without_an_object_time_is_late(tmp_path: Path, keys: list, update: list) -> None:
    """A peer's own server that leaves out Last-Modified cannot pass the late rule that way."""
    uid, key = 0, keys[0]
    data = encode_signed(update, RUN, SPEC, WINDOW, uid, key)
    path = tmp_path / "evil" / update_key(RUN.run_id, WINDOW, uid, key.ss58_address)
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    for mode, verdict in (("normal", Verdict.OK), ("no_time", Verdict.LATE)):
        with SlowStore(tmp_path, mode) as endpoint:
            evil = S3Store(
                "evil", ReadCredentials(access_key_id="r", secret_access_key="r"), endpoint=endpoint
            )
            peer = PeerBucket(uid, key.ss58_address, evil)
            got = fetch_uploads([peer], RUN, SPEC, WINDOW, time.time() + 60, _spool(tmp_path))
        assert classify_fetch(got[uid].fetched)[0] is verdict, got[uid].fetched.reason
