"""`tessera miner`: run a peer (on one device; under `torchrun` see `node.multigpu`)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from node.node_args import add_node_arguments, load_run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_node_arguments(parser)
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get("TESSERA_METRICS_PORT", "0")),
        help="serve Prometheus metrics on this port (0: off)",
    )


def run(args: argparse.Namespace) -> int:
    from node.commit import commitment_for, ensure_commitment
    from node.logs import setup_logging
    from node.multigpu import init_ranks
    from node.peer import Peer
    from node.preflight import check_bucket, check_disk
    from node.resilient_chain import resilient
    from protocol.chain import open_chain
    from protocol.keys import load_hotkey
    from protocol.stores import open_store

    setup_logging(args.log_level, args.log_format)
    if not args.chain or not args.store:
        raise SystemExit(
            "tessera miner: --chain and --store are required (or TESSERA_CHAIN / TESSERA_STORE)"
        )
    run_cfg = load_run(args.run)
    ranks, device = init_ranks(args.device, run_cfg)  # one peer on all torchrun processes
    if not ranks.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    keypair = load_hotkey(args.wallet, args.hotkey, args.wallet_path)
    chain = resilient(open_chain(args.chain, netuid=args.netuid))
    store = open_store(args.store)
    if ranks.is_main:
        check_bucket(store)
        ensure_commitment(chain, keypair, commitment_for(args.store), post=args.commit)
    ranks.barrier()
    state_dir = Path(
        args.state_dir or Path.home() / ".tessera" / "state" / run_cfg.run_id / keypair.ss58_address
    )
    check_disk(state_dir, needed=1 << 26)
    peer = Peer(
        run_cfg,
        keypair,
        chain,
        store,
        state_dir,
        local_root=Path(args.local_root) if args.local_root else None,
        device=str(device),
        ranks=ranks,
    )
    if args.metrics_port and ranks.is_main:
        peer.metrics.serve(args.metrics_port)
    logging.getLogger("tessera.miner").info(
        "run %s, uid %d, starting at window %d", run_cfg.run_id, peer.uid, peer.next_window
    )
    try:
        peer.run(args.windows)
    finally:
        ranks.close()
    return 0
