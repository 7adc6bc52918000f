"""A saved state that the node's model cannot take (written for another model or by another
version, its checksum intact) stops the peer or the validator at start-up with one `StateError`
that names the folder and the fix, never a torch traceback, and leaves the file as it was."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from substrateinterface import Keypair

from node.runtime.state import STATE_FILE, PeerState, StateError, save_state
from protocol.chain.local import LocalChain
from protocol.chain.local_db import LocalChainDB, create_local_chain
from protocol.runconfig import RunConfig
from protocol.stores import open_store
from tests.support.local_peer import local_peer
from validator import state as validator_state
from validator.loop import Validator

RUN = RunConfig.preset("tiny", name="state-fit")
KEY = Keypair.create_from_uri("//state-fit-validator")


def _peer_state(tmp_path: Path) -> PeerState:
    """A true state of `RUN`'s peer: its model, optimizer and error feedback as a fresh peer
    holds them."""
    peer = local_peer(tmp_path / "source", RUN)
    ef, fp = peer.strategy.encoder.local_state_dict(), peer.weights.fingerprint()
    return PeerState(RUN.run_id, 1, peer.model.state_dict(), peer.optimizer.state_dict(), ef, fp)


def test_a_peer_state_of_another_model_is_one_error_with_its_fix(tmp_path: Path) -> None:
    state = _peer_state(tmp_path)
    model = dict(state.model)
    model.pop(next(iter(model)))  # a tensor this version's model has is missing
    save_state(tmp_path / "state", dataclasses.replace(state, model=model))
    saved = (tmp_path / "state" / STATE_FILE).read_bytes()
    with pytest.raises(StateError, match="does not fit this node's model") as err:
        local_peer(tmp_path, RUN)
    assert str(tmp_path / "state") in str(err.value) and "--state-dir" in str(err.value)
    assert (tmp_path / "state" / STATE_FILE).read_bytes() == saved


def test_a_peer_state_whose_model_is_not_its_fingerprint_is_one_error(tmp_path: Path) -> None:
    state = _peer_state(tmp_path)
    save_state(tmp_path / "state", dataclasses.replace(state, fingerprint="0" * 64))
    with pytest.raises(StateError, match="not the 000000000000 saved with it") as err:
        local_peer(tmp_path, RUN)
    assert "--state-dir" in str(err.value)
    # the true fingerprint restores: what failed above was the mismatch alone
    save_state(tmp_path / "again" / "state", state)
    assert local_peer(tmp_path / "again", RUN).next_window == 1


def _validator(root: Path) -> Validator:
    chain_db = root / "chain.db"
    if not chain_db.exists():
        create_local_chain(chain_db, 1, block_time=0.5)
        LocalChainDB(chain_db).register(1, KEY.ss58_address, validator=True, stake=100.0)
    store = open_store(f"file://{root / 'buckets'}?bucket=validator")
    chain = LocalChain(chain_db, 1)
    return Validator(RUN, KEY, chain, store, root / "state", local_root=root / "buckets")


@pytest.mark.parametrize("damage", ["shape", "fingerprint"])
def test_a_validator_state_that_does_not_fit_is_one_error(tmp_path: Path, damage: str) -> None:
    _validator(tmp_path)  # a first start saves the state
    saved = validator_state.load_state(tmp_path / "state", RUN.run_id)
    assert saved is not None
    if damage == "shape":
        name = next(iter(saved.model))
        saved.model[name] = saved.model[name][:1]
        expected = "does not fit this node's model"
    else:
        saved.fingerprint = "f" * 64
        expected = "not the ffffffffffff saved with it"
    validator_state.save_state(tmp_path / "state", saved)
    with pytest.raises(StateError, match=expected) as err:
        _validator(tmp_path)
    assert "--state-dir" in str(err.value)
