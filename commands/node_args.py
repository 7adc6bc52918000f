"""Command-line arguments shared by `tessera miner`, `tessera validator` and their relatives."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch
from substrateinterface import Keypair

from commands.arg_types import device, listen_address, port, positive_int
from commands.config_file import add_config_argument
from node.runtime.atomic_files import remove_stale_temporaries
from protocol.chain.base import Chain
from protocol.chain.url import NETWORKS
from protocol.presets import PRESETS
from protocol.runconfig import RunConfig, RunConfigError
from protocol.stores import ObjectStore

log = logging.getLogger(f"tessera.{__name__}")


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments every long-running role shares, each with its `TESSERA_*` variable; the
    Bittensor spellings (``--wallet.name``, ``--wallet.hotkey``, ``--wallet.path``,
    ``--subtensor.network``, ``--subtensor.chain_endpoint``) are accepted as well."""
    env = os.environ.get
    add_config_argument(parser)
    parser.add_argument(
        "--run",
        "--run-config",  # under torchrun: its --run-path makes --run ambiguous
        default=env("TESSERA_RUN", "tiny"),
        help="preset name or run config file [env TESSERA_RUN]",
    )
    parser.add_argument(
        "--chain",
        "--subtensor.network",
        "--subtensor.chain_endpoint",
        dest="chain",
        default=env("TESSERA_CHAIN"),
        help=f"{', '.join(NETWORKS)}, a ws(s)://host:port subtensor node, or local:///path.db "
        "(the embedded chain) [env TESSERA_CHAIN]",
    )
    parser.add_argument(
        "--netuid",
        type=int,
        default=env("TESSERA_NETUID"),
        help="the run's subnet: required on a subtensor chain, 1 on the embedded chain "
        "[env TESSERA_NETUID]",
    )
    parser.add_argument(
        "--store",
        default=env("TESSERA_STORE"),
        help="our bucket: file://… or s3://… [env TESSERA_STORE]",
    )
    parser.add_argument(
        "--local-root",
        default=env("TESSERA_LOCAL_ROOT"),
        help="root of local (file://) buckets [env TESSERA_LOCAL_ROOT]",
    )
    parser.add_argument(
        "--wallet",
        "--wallet.name",
        dest="wallet",
        default=env("TESSERA_WALLET", "default"),
        help="wallet name [env TESSERA_WALLET]",
    )
    parser.add_argument(
        "--hotkey",
        "--wallet.hotkey",
        dest="hotkey",
        default=env("TESSERA_HOTKEY", "default"),
        help="hotkey name in the wallet [env TESSERA_HOTKEY]",
    )
    parser.add_argument(
        "--wallet-path",
        "--wallet.path",
        dest="wallet_path",
        default=env("TESSERA_WALLET_PATH"),
        help="wallets folder, ~/.bittensor/wallets when unset [env TESSERA_WALLET_PATH]",
    )
    parser.add_argument(
        "--state-dir",
        default=env("TESSERA_STATE_DIR"),
        help="local state (resumable), ~/.tessera/<role>/<run id>/<hotkey> when unset "
        "[env TESSERA_STATE_DIR]",
    )
    parser.add_argument(
        "--windows",
        type=positive_int,
        default=env("TESSERA_WINDOWS", "1000000000"),
        help="windows to run, then exit (a miner sooner, once the run's last window, "
        "outer.total_windows - 1, has passed) [env TESSERA_WINDOWS]",
    )
    parser.add_argument(
        "--device",
        type=device,
        default=env("TESSERA_DEVICE", "cuda" if torch.cuda.is_available() else "cpu"),
        help="cpu, cuda or cuda:N [env TESSERA_DEVICE]",
    )
    parser.add_argument(
        "--commit", action="store_true", help="post our bucket commitment if missing or stale"
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        default=env("TESSERA_LOG_LEVEL", "INFO"),
        help="any case [env TESSERA_LOG_LEVEL]",
    )
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        default=env("TESSERA_LOG_FORMAT", "text"),
        help="text lines or JSON lines [env TESSERA_LOG_FORMAT]",
    )
    parser.add_argument(
        "--metrics-port",
        type=port,
        default=env("TESSERA_METRICS_PORT", "0"),
        help="serve Prometheus metrics on this port, 0: off [env TESSERA_METRICS_PORT]",
    )
    parser.add_argument(
        "--metrics-host",
        type=listen_address,
        default=env("TESSERA_METRICS_HOST", "127.0.0.1"),
        help="the address the metrics listen on: 127.0.0.1 for this machine only, 0.0.0.0 for "
        "every interface (inside a container that publishes the port) [env TESSERA_METRICS_HOST]",
    )
    parser.add_argument(
        "--exchange-workers",
        type=exchange_workers,
        default=env("TESSERA_EXCHANGE_WORKERS", "auto"),
        help="processes that decode and sum a window's updates; 0: the node's own thread; "
        "auto: half the cores, at most 16, none below 8 cores [env TESSERA_EXCHANGE_WORKERS]",
    )


def load_run(ref: str, flag: str = "--run") -> RunConfig:
    """A run config from a file, else a preset name (`RunConfigError` naming what is missing,
    and the option, ``flag``, that named it)."""
    path = Path(ref)
    if path.exists():
        return RunConfig.load(path)
    if path.suffix in (".toml", ".json") or len(path.parts) > 1:
        raise RunConfigError(
            f"{flag} {ref}: no such run config file (or a preset name: {', '.join(PRESETS)})"
        )
    return RunConfig.preset(ref)


def load_key(args: argparse.Namespace) -> Keypair:
    """Our hotkey, from ``--wallet``, ``--hotkey`` and ``--wallet-path``; the first thing a node
    loads, so it also refuses a command line without ``--chain`` or ``--store``."""
    from protocol.keys import load_hotkey

    if not args.chain or not args.store:
        raise SystemExit("--chain and --store are required (or TESSERA_CHAIN / TESSERA_STORE)")
    return load_hotkey(args.wallet, args.hotkey, args.wallet_path)


def connect(
    args: argparse.Namespace, keypair: Keypair, role: str, preflight: bool = True
) -> tuple[Chain, ObjectStore]:
    """A chain handle that rides out outages, and our bucket.

    With `preflight`, the hotkey must hold a uid on the subnet (and, for a validator, a permit),
    then the bucket is checked writable and readable and our commitment on chain is checked
    (posted with `--commit`, once the server has refused the read key's writes): nothing is
    written to the bucket or the chain before the registration is known, and every failure comes
    with the fix. Lifecycle rules are applied to our bucket where the provider has them
    (`node.runtime.retention`).
    """
    from commands.doctor.chain import registration_check
    from commands.doctor.report import Status
    from node.runtime.commit import commitment_for, ensure_commitment
    from node.runtime.preflight import PreflightError, check_bucket
    from node.runtime.read_key import require_committable
    from node.runtime.resilient_chain import resilient
    from node.runtime.retention import apply_lifecycle
    from protocol.chain import open_chain
    from protocol.stores import open_store

    chain = resilient(open_chain(args.chain, netuid=args.netuid))
    store = open_store(args.store)
    if preflight:
        registered = registration_check(chain, keypair, role)
        if registered.status is Status.FAIL:
            raise PreflightError(f"{registered.detail}; {registered.fix}")
        check_bucket(store)
        apply_lifecycle(store)
        wanted = commitment_for(args.store)
        ensure_commitment(
            chain, keypair, wanted, post=args.commit,
            before_post=lambda: require_committable(args.store, store, wanted),
        )  # fmt: skip
    return chain, store


def state_dir(args: argparse.Namespace, role: str, run: RunConfig, hotkey: str) -> Path:
    """`--state-dir`, else ~/.tessera/<role>/<run id>/<hotkey>; what an interrupted save left
    there (temporary files) is removed, and said."""
    path = Path(args.state_dir or Path.home() / ".tessera" / role / run.run_id / hotkey)
    for stale in remove_stale_temporaries(path):
        log.warning("removed %s, left by an interrupted save", stale)
    return path


def local_root(args: argparse.Namespace) -> Path | None:
    return Path(args.local_root) if args.local_root else None


def exchange_workers(text: str) -> int:
    """``--exchange-workers``: a number of processes (0: none) or ``auto`` (`auto_workers`)."""
    from node.window.pooled import auto_workers

    if text == "auto":
        return auto_workers()
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of processes (0: none) or auto")
    return int(text)
