"""`tessera commit --store … [wallet args]`: post our bucket commitment unless the chain has it.

Takes the arguments (and `TESSERA_*` variables) of `tessera miner`; it uses --chain, --netuid,
--store and the wallet options. The read key comes from TESSERA_S3_READ_*.
"""

from __future__ import annotations

import argparse

from rich.console import Console

from commands.miner import add_arguments as add_node_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_node_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from commands.provision import ProvisionError, post_commitment
    from protocol.chain import ChainError, open_chain
    from protocol.keys import KeyFileError, load_hotkey

    console = Console(highlight=False, soft_wrap=True)
    if not args.chain or not args.store:
        raise SystemExit("--chain and --store are required (or TESSERA_CHAIN / TESSERA_STORE)")
    try:
        keypair = load_hotkey(args.wallet, args.hotkey, args.wallet_path)
        with open_chain(args.chain, netuid=args.netuid) as chain:
            posted = post_commitment(chain, keypair, args.store)
    except (ProvisionError, ChainError, KeyFileError, ValueError) as exc:  # one line (commands.cli)
        raise SystemExit(str(exc)) from None
    state = "posted" if posted else "already on chain"
    console.print(f"bucket commitment of {keypair.ss58_address} {state}")
    return 0
