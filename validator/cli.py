"""`tessera validator`: check, score and rate every peer each window, set weights, publish."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from node.node_args import add_node_arguments, load_run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    add_node_arguments(parser)
    parser.add_argument(
        "--weights-every", type=int, default=int(env("TESSERA_WEIGHTS_EVERY", "1")),
        help="set weights every M windows",
    )  # fmt: skip
    parser.add_argument(
        "--checkpoint-every", type=int, default=int(env("TESSERA_CHECKPOINT_EVERY", "10")),
        help="publish a checkpoint and the run config every N windows",
    )  # fmt: skip
    parser.add_argument(
        "--samples", type=int, default=int(env("TESSERA_VALIDATOR_SAMPLES", "64")),
        help="random and own samples per loss probe",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from node.commit import commitment_for, ensure_commitment
    from node.logs import setup_logging
    from node.preflight import check_bucket
    from node.resilient_chain import resilient
    from protocol.chain import open_chain
    from protocol.keys import load_hotkey
    from protocol.stores import open_store
    from validator.config import ValidatorConfig
    from validator.loop import Validator

    setup_logging(args.log_level, args.log_format)
    if not args.chain or not args.store:
        raise SystemExit("tessera validator: --chain and --store are required")
    run_cfg = load_run(args.run)
    keypair = load_hotkey(args.wallet, args.hotkey, args.wallet_path)
    chain = resilient(open_chain(args.chain, netuid=args.netuid))
    store = open_store(args.store)
    check_bucket(store)
    ensure_commitment(chain, keypair, commitment_for(args.store), post=args.commit)
    cfg = ValidatorConfig(
        weights_every=args.weights_every,
        checkpoint_every=args.checkpoint_every,
        n_random=args.samples,
        n_own=args.samples,
    )
    state_dir = Path(
        args.state_dir
        or Path.home() / ".tessera" / "validator" / run_cfg.run_id / keypair.ss58_address
    )
    validator = Validator(
        run_cfg, keypair, chain, store, state_dir, cfg,
        local_root=Path(args.local_root) if args.local_root else None, device=args.device,
    )  # fmt: skip
    logging.getLogger("tessera.validator").info(
        "run %s, uid %d, starting at window %d", run_cfg.run_id, validator.uid,
        validator.next_window,
    )  # fmt: skip
    validator.run_windows(args.windows)
    return 0
