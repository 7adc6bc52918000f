"""`tessera miner`: run a peer (on one device; under `torchrun` see `node.multigpu`)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch

from protocol.runconfig import RunConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument(
        "--run",
        "--run-config",  # under torchrun: its --run-path makes --run ambiguous
        default=env("TESSERA_RUN", "tiny"),
        help="preset name or run config file",
    )
    parser.add_argument(
        "--chain", default=env("TESSERA_CHAIN"), help="local:///path.db or ws(s)://subtensor"
    )
    parser.add_argument("--netuid", type=int, default=int(env("TESSERA_NETUID", "1")))
    parser.add_argument(
        "--store", default=env("TESSERA_STORE"), help="our bucket: file://… or s3://…"
    )
    parser.add_argument(
        "--local-root", default=env("TESSERA_LOCAL_ROOT"), help="root of local (file://) buckets"
    )
    parser.add_argument("--wallet", default=env("TESSERA_WALLET", "default"))
    parser.add_argument("--hotkey", default=env("TESSERA_HOTKEY", "default"))
    parser.add_argument(
        "--wallet-path", default=env("TESSERA_WALLET_PATH"), help="default ~/.bittensor/wallets"
    )
    parser.add_argument(
        "--state-dir", default=env("TESSERA_STATE_DIR"), help="local state (resumable)"
    )
    parser.add_argument("--windows", type=int, default=int(env("TESSERA_WINDOWS", "1000000000")))
    parser.add_argument(
        "--device", default=env("TESSERA_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
    )
    parser.add_argument(
        "--commit", action="store_true", help="post our bucket commitment if missing or stale"
    )
    parser.add_argument("--log-level", default=env("TESSERA_LOG_LEVEL", "INFO"))
    parser.add_argument(
        "--metrics-port", type=int, default=int(env("TESSERA_METRICS_PORT", "0")), help="0: off"
    )


def load_run(ref: str) -> RunConfig:
    path = Path(ref)
    return RunConfig.load(path) if path.exists() else RunConfig.preset(ref)


def run(args: argparse.Namespace) -> int:
    from node.commit import commitment_for, ensure_commitment
    from node.multigpu import init_ranks
    from node.peer import Peer
    from node.preflight import check_bucket, check_disk
    from node.resilient_chain import resilient
    from protocol.chain import open_chain
    from protocol.keys import load_hotkey
    from protocol.stores import open_store

    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
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
