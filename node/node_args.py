"""Command-line arguments shared by `tessera miner`, `tessera validator` and their relatives."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from protocol.runconfig import RunConfig


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments every long-running role shares (each reads a `TESSERA_*` variable)."""
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
        "--log-format",
        choices=["text", "json"],
        default=env("TESSERA_LOG_FORMAT", "text"),
        help="text lines or JSON lines",
    )


def load_run(ref: str) -> RunConfig:
    """A run config from a file, else a preset name."""
    path = Path(ref)
    return RunConfig.load(path) if path.exists() else RunConfig.preset(ref)
