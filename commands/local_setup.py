"""The `local` compose profile's one-shot chain job (`tessera entrypoint setup-local`).

It creates the embedded chain with the run's block time and the subnet, a hotkey for the local
miner and one for the local validator in the wallets folder when they are missing (mode 0600,
owned by the user the container runs as, i.e. you with the documented `user:` mapping), and
registers both, the validator with a permit and stake. Running it again changes nothing.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from protocol.chain.local import LocalChain
from protocol.chain.local_db import LocalChainDB, create_local_chain
from protocol.keys import create_hotkey, hotkey_path, load_keypair_file

VALIDATOR_STAKE = 1000.0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera entrypoint setup-local")
    parser.add_argument("--db", type=Path, required=True, help="the embedded chain file")
    parser.add_argument("--netuid", type=int, default=1)
    parser.add_argument("--run", default="tiny", help="preset or run config (its block time)")
    parser.add_argument("--wallet-path", type=Path, required=True)
    parser.add_argument("--wallet", default="local")
    parser.add_argument("--miner-hotkey", default="miner")
    parser.add_argument("--validator-hotkey", default="validator")
    return parser


def ensure_hotkey(wallet: str, name: str, root: Path) -> str:
    """The SS58 address of hotkey `name`, created first when the file does not exist."""
    path = hotkey_path(wallet, name, root)
    if path.exists():
        return load_keypair_file(path).ss58_address
    if not os.access(root, os.W_OK):
        raise SystemExit(
            f"cannot create hotkey {path}: {root} is not writable by uid {os.getuid()} (create the "
            "folder yourself and set UID/GID in docker/.env to its owner)"
        )
    return create_hotkey(wallet, name, root).ss58_address


def setup(args: argparse.Namespace) -> dict[str, int]:
    """Chain, subnet, hotkeys and registrations; returns each hotkey name's uid."""
    from commands.node_args import load_run

    run = load_run(args.run)
    args.db.parent.mkdir(parents=True, exist_ok=True)
    create_local_chain(args.db, args.netuid, block_time=run.timing.block_time_s, exist_ok=True)
    uids = {}
    for name, is_validator in ((args.miner_hotkey, False), (args.validator_hotkey, True)):
        address = ensure_hotkey(args.wallet, name, args.wallet_path)
        with LocalChain(args.db, args.netuid) as chain:
            uid = chain.uid_of(address)
        if uid is None:
            db = LocalChainDB(args.db)
            try:
                uid = db.register(
                    args.netuid,
                    address,
                    validator=is_validator,
                    stake=VALIDATOR_STAKE if is_validator else 0.0,
                )
            finally:
                db.close()
        uids[name] = uid
        print(f"{name}: {address} is uid {uid} on subnet {args.netuid}", flush=True)
    return uids


def main(argv: Sequence[str]) -> int:
    setup(_parser().parse_args(list(argv)))
    return 0
