"""`tessera miner`: run a peer (on one device; under `torchrun` see `miner.multigpu` and,
with ``--sharding fsdp2``, `miner.fsdp`)."""

from __future__ import annotations

import argparse
import logging
import os

from commands.arg_types import non_negative_int
from commands.node_args import (
    add_node_arguments,
    connect,
    load_key,
    load_run,
    local_root,
    state_dir,
)
from node.runtime.memory import SHARDINGS


def _env_flag(name: str) -> bool | None:
    """A boolean from the environment: "1" or "0", None when unset."""
    value = os.environ.get(name)
    if value not in (None, "0", "1"):
        raise SystemExit(f"tessera miner: {name}={value!r}: set it to 1 or 0, or unset it")
    return None if value is None else value == "1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_node_arguments(parser)
    parser.add_argument(
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=_env_flag("TESSERA_ACTIVATION_CHECKPOINTING"),
        help="recompute each decoder layer's activations in the backward pass (less memory, "
        "about a third more compute); unset with --loss-chunk-tokens unset: the fastest recipe "
        "the memory plan fits to the GPU [env TESSERA_ACTIVATION_CHECKPOINTING=1 or 0]",
    )
    parser.add_argument(
        "--loss-chunk-tokens",
        type=non_negative_int,
        default=os.environ.get("TESSERA_LOSS_CHUNK_TOKENS"),
        help="cross-entropy over this many positions at a time, so the fp32 logits of the whole "
        "micro-batch never exist at once; 0: all at once; unset: see --activation-checkpointing "
        "[env TESSERA_LOSS_CHUNK_TOKENS]",
    )
    parser.add_argument(
        "--sharding",
        choices=SHARDINGS,
        default=os.environ.get("TESSERA_SHARDING", "auto"),
        help="under torchrun: DDP replicas, FSDP2 shards, or auto (FSDP2 when the memory plan "
        "says DDP does not fit the GPU; DDP on the CPU). A single process is never sharded.",
    )


def run(args: argparse.Namespace) -> int:
    from miner.multigpu import init_peer_ranks, training_recipe
    from miner.peer import Peer
    from node.runtime.logs import setup_logging
    from node.runtime.preflight import check_disk, check_port_free
    from node.runtime.shutdown import Stopped, install_stop_handler

    setup_logging(args.log_level, args.log_format)
    install_stop_handler()
    run_cfg = load_run(args.run)
    ranks, device = init_peer_ranks(args.device, run_cfg, args.sharding)  # one peer, all ranks
    if not ranks.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    keypair = load_key(args)
    state = state_dir(args, "state", run_cfg, keypair.ss58_address)
    check_disk(state, needed=1 << 26)
    if args.metrics_port and ranks.is_main:
        check_port_free(args.metrics_port, args.metrics_host)
    chain, store = connect(args, keypair, "miner", preflight=ranks.is_main)
    ranks.barrier()
    memory = training_recipe(
        run_cfg, ranks, device, args.activation_checkpointing, args.loss_chunk_tokens
    )
    peer = Peer(
        run_cfg, keypair, chain, store, state, local_root=local_root(args), device=str(device),
        ranks=ranks, memory=memory, exchange_workers=args.exchange_workers,
    )  # fmt: skip
    if args.metrics_port and ranks.is_main:
        peer.metrics.serve(args.metrics_port, args.metrics_host)
    logging.getLogger("tessera.miner").info(
        "run %s, uid %d, starting at window %d", run_cfg.run_id, peer.uid, peer.next_window
    )
    try:
        peer.run(args.windows)
    except Stopped as stop:  # SIGTERM: the last finished window is saved; a restart resumes it
        logging.getLogger("tessera.miner").info("%s at window %d", stop, peer.next_window)
    finally:
        ranks.close()
    return 0
