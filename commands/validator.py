"""`tessera validator`: check, score and rate every peer each window, set weights, publish."""

from __future__ import annotations

import argparse
import logging
import os

from commands.arg_types import positive_int
from commands.node_args import (
    add_node_arguments,
    connect,
    load_key,
    load_run,
    local_root,
    state_dir,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    add_node_arguments(parser)
    parser.add_argument(
        "--weights-every", type=positive_int, default=env("TESSERA_WEIGHTS_EVERY", "1"),
        help="set weights every M windows",
    )  # fmt: skip
    parser.add_argument(
        "--checkpoint-every", type=positive_int, default=env("TESSERA_CHECKPOINT_EVERY", "10"),
        help="publish a checkpoint and the run config every N windows",
    )  # fmt: skip
    parser.add_argument(
        "--samples", type=positive_int, default=env("TESSERA_VALIDATOR_SAMPLES", "64"),
        help="random and own samples per loss probe",
    )  # fmt: skip
    parser.add_argument(
        "--probe-state", type=_probe_state, default=env("TESSERA_PROBE_STATE", "auto"),
        help="auto, device or host: where the probe's copies of the weights and the window's "
        "mean live; auto keeps them on the GPU where it holds them (`tessera plan`), else on "
        "the host [env TESSERA_PROBE_STATE]",
    )  # fmt: skip


def _probe_state(text: str) -> str:
    """``--probe-state`` (and its environment variable, which argparse parses the same way)."""
    if text not in ("auto", "device", "host"):
        raise argparse.ArgumentTypeError(f"'{text}': use auto, device or host")
    return text


def run(args: argparse.Namespace) -> int:
    from node.runtime.logs import setup_logging
    from node.runtime.preflight import check_disk, check_port_free
    from node.runtime.shutdown import Stopped, install_stop_handler
    from validator.config import ValidatorConfig
    from validator.loop import Validator

    setup_logging(args.log_level, args.log_format)
    install_stop_handler()
    run_cfg = load_run(args.run)
    keypair = load_key(args)
    state = state_dir(args, "validator", run_cfg, keypair.ss58_address)
    check_disk(state)
    if args.metrics_port:
        check_port_free(args.metrics_port, args.metrics_host)
    chain, store = connect(args, keypair, "validator")
    cfg = ValidatorConfig(
        weights_every=args.weights_every,
        checkpoint_every=args.checkpoint_every,
        n_random=args.samples,
        n_own=args.samples,
        probe_state=args.probe_state,
    )
    validator = Validator(
        run_cfg, keypair, chain, store, state, cfg, local_root=local_root(args), device=args.device,
        exchange_workers=args.exchange_workers,
    )  # fmt: skip
    if args.metrics_port:
        validator.metrics.serve(args.metrics_port, args.metrics_host)
    logging.getLogger("tessera.validator").info(
        "run %s, uid %d, starting at window %d", run_cfg.run_id, validator.uid,
        validator.next_window,
    )  # fmt: skip
    try:
        validator.run_windows(args.windows)
    except Stopped as stop:  # SIGTERM: the last finished window is saved; a restart resumes it
        logging.getLogger("tessera.validator").info("%s at window %d", stop, validator.next_window)
    return 0
