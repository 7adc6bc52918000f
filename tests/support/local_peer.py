"""A real peer on an embedded chain and a file store, registered and ready, for tests that drive
its steps one at a time."""

from __future__ import annotations

from pathlib import Path

from miner.peer import Peer
from protocol.chain import open_chain
from protocol.chain.local_db import LocalChainDB, create_local_chain
from protocol.keys import create_hotkey
from protocol.runconfig import RunConfig
from protocol.stores import open_store


def local_peer(tmp_path: Path, run: RunConfig) -> Peer:
    """A peer of `run` (uid 0) with its chain, wallet, bucket and state under `tmp_path`."""
    create_local_chain(tmp_path / "chain.db", 1, block_time=0.5)
    keypair = create_hotkey("sim", "peer", root=tmp_path / "wallets")
    LocalChainDB(tmp_path / "chain.db").register(1, keypair.ss58_address)
    chain = open_chain(f"local://{tmp_path / 'chain.db'}", netuid=1)
    store = open_store(f"file://{tmp_path / 'buckets'}?bucket=peer")
    return Peer(run, keypair, chain, store, tmp_path / "state", local_root=tmp_path / "buckets")
