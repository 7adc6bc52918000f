"""The validators' side of a window's consensus against faults and equivocating peers:

- a lead restarted between publishing its manifest and saving its state adopts what it published
  instead of publishing a second decision (peers may have applied the first);
- a peer that signs two updates for one window and serves one to the lead and the other to a
  follower: the follower applies the lead's bytes (the consensus rule) and marks the peer
  ``equivocation`` (paid nothing), since both versions verify under the peer's signature.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from substrateinterface import Keypair

from codec.spec import ModelSpec
from lab.sim.forgeries import noise_update
from node.model.fingerprint import fingerprint
from node.model.llama import build_model
from node.window.consensus import Agreement, Roster, agree
from node.window.exchange import encode_signed
from node.window.gather import Fetched
from node.window.history import publish_aggregate
from node.window.manifest import (
    Entry,
    WindowManifest,
    bytes_digest,
    publish_manifest,
    read_manifest,
)
from protocol.keys import create_hotkey
from protocol.runconfig import RunConfig
from protocol.stores import open_store
from tests.support.chain_time import SteppingChain
from tests.support.lead_views import checked_views, decide, lead_roster
from validator.admission import Admission
from validator.agreement import mark_equivocations
from validator.checks import Verdict
from validator.classify import PeerCheck
from validator.config import ValidatorConfig
from validator.fetching import Upload
from validator.ratings import severity

RUN = RunConfig.preset("tiny", name="lead-and-followers", inner_steps=2)
SPEC = ModelSpec.from_module(build_model(RUN.model, RUN.seed))
WINDOW, LEAD = 2, 9
START = fingerprint(build_model(RUN.model, RUN.seed))

ALL = Admission(frozenset(range(100)))  # the lead admits every update that passed


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Keypair]:
    root = tmp_path_factory.mktemp("wallets")
    return {u: create_hotkey("e", f"k{u}", root=root) for u in (0, 1, 2, LEAD)}


def _signed(uid: int, seed: int, keys: dict[int, Keypair]) -> bytes:
    update = noise_update(SPEC, RUN, 0.01, torch.Generator().manual_seed(seed))
    return encode_signed(update, RUN, SPEC, WINDOW, uid, keys[uid])


def _roster(keys: dict[int, Keypair], store: object, selected: list[int]) -> Roster:
    return lead_roster(keys, store, selected, WINDOW, LEAD)


def _views(
    data: dict[int, bytes], keys: dict[int, Keypair]
) -> tuple[dict[int, Fetched], dict[int, Upload], dict[int, PeerCheck]]:
    return checked_views(data, keys, RUN, SPEC, WINDOW)


def test_a_restarted_lead_adopts_the_manifest_it_published(
    tmp_path: Path, keys: dict[int, Keypair]
) -> None:
    store = open_store(f"file://{tmp_path}?bucket=lead")
    roster = _roster(keys, store, [0, 1, 2])
    _, uploads, checks = _views({u: _signed(u, 10 + u, keys) for u in range(3)}, keys)
    scratch = tmp_path / "scratch"
    scratch.mkdir()

    def run_again() -> Agreement:
        return decide(
            store, RUN, SPEC, keys[LEAD], roster, checks, uploads, START, scratch,
            SteppingChain(0), ALL,
        )  # fmt: skip

    first = run_again()
    assert first.manifest is not None and list(first.manifest.uids) == [0, 1, 2]
    # killed before its state was saved, the lead runs the window again and this time finds
    # uid 2 late: it must keep the decision the peers may have applied
    checks[2].verdict, checks[2].detail = Verdict.LATE, "late"
    again = run_again()
    assert again.manifest == first.manifest and sorted(again.updates) == [0, 1, 2]
    published = read_manifest(store, RUN.run_id, WINDOW, LEAD, keys[LEAD].ss58_address, 1 << 20)
    assert published == first.manifest


def test_a_peer_serving_two_signed_updates_is_marked_by_the_follower(
    tmp_path: Path, keys: dict[int, Keypair]
) -> None:
    leads, followers = _signed(1, 1, keys), _signed(1, 2, keys)  # two versions of uid 1's update
    honest = _signed(0, 3, keys)
    store = open_store(f"file://{tmp_path}?bucket=lead")
    applied = {0: honest, 1: leads}
    publish_aggregate(
        store, RUN, WINDOW, LEAD, keys[LEAD], applied, {u: keys[u].ss58_address for u in applied}
    )
    publish_manifest(
        store,
        WindowManifest(
            run_id=RUN.run_id,
            window=WINDOW,
            roster_block=40,
            validator_uid=LEAD,
            validator_hotkey=keys[LEAD].ss58_address,
            fingerprint_start=START,
            entries=tuple(
                Entry(uid=u, hotkey=keys[u].ss58_address, digest=bytes_digest(d), size=len(d))
                for u, d in sorted(applied.items())
            ),
        ),
        keys[LEAD],
    )
    manifest = read_manifest(store, RUN.run_id, WINDOW, LEAD, keys[LEAD].ss58_address, 1 << 20)
    fetched, _, checks = _views({0: honest, 1: followers}, keys)  # the follower's view
    agreed = agree(_roster(keys, store, [0, 1]), fetched, manifest, START, RUN, SPEC)
    assert agreed.manifest is not None and sorted(agreed.updates) == [0, 1]
    assert agreed.updates[1].digest != fetched[1].update.digest  # type: ignore[union-attr]

    assert mark_equivocations(checks, agreed) == [1]
    assert checks[1].verdict is Verdict.EQUIVOCATION and "window 2" in checks[1].detail
    assert checks[0].verdict is Verdict.OK
    assert severity(Verdict.EQUIVOCATION, ValidatorConfig()) == pytest.approx(
        severity(Verdict.COPY, ValidatorConfig())
    )
