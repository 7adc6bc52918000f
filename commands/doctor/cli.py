"""`tessera doctor`: preflight checks before joining a run, with a fix for each failure.

Takes the arguments (and `TESSERA_*` variables) of `tessera miner`, plus `--role`,
`--bandwidth-mb`, `--train-steps`, `--link-gbps` and `--json`; it never posts anything (`--commit`, `--windows` and
`--metrics-port` are accepted and ignored). Exit code 0 when no check failed (warnings allowed), 1 otherwise.
Secrets never reach the output: write keys are shown as masked key ids, read secrets not at all.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from rich.console import Console
from substrateinterface import Keypair

from commands.doctor.bucket import bandwidth_check, bucket_check, read_key_check
from commands.doctor.chain import (
    chain_check,
    clock_check,
    commitment_check,
    hotkey_check,
    registration_check,
)
from commands.doctor.machine import disk_check, gpu_check, run_check, version_check, visible_gpus
from commands.doctor.report import (
    Check,
    describe_error,
    fail,
    passed,
    print_checklist,
    skip,
    to_json,
)
from commands.doctor.throughput import throughput_check
from commands.miner import add_arguments as add_node_arguments
from protocol.chain import Chain
from protocol.runconfig import RunConfig
from protocol.stores import ObjectStore

ROLES = ("miner", "validator")
T = TypeVar("T")


MAX_TRANSFER_MIB = 1024
MAX_TRAIN_STEPS = 100


def _transfer_size(text: str) -> int:
    value = int(text)
    if not 0 <= value <= MAX_TRANSFER_MIB:
        raise argparse.ArgumentTypeError(f"must be within 0..{MAX_TRANSFER_MIB} MiB")
    return value


def _train_steps(text: str) -> int:
    value = int(text)
    if not 0 <= value <= MAX_TRAIN_STEPS:
        raise argparse.ArgumentTypeError(f"must be within 0..{MAX_TRAIN_STEPS}")
    return value


def _link_gbps(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError("must be a positive number of Gbit/s")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_node_arguments(parser)
    env = os.environ.get
    parser.add_argument(
        "--role", choices=ROLES, default=env("TESSERA_ROLE", "miner"), help="what this node runs"
    )
    parser.add_argument(
        "--bandwidth-mb",
        type=_transfer_size,
        default=_transfer_size(env("TESSERA_DOCTOR_BANDWIDTH_MB", "16")),
        help="size of the transfer test object in MiB (0: skip the test)",
    )
    parser.add_argument(
        "--train-steps",
        type=_train_steps,
        default=_train_steps(env("TESSERA_DOCTOR_TRAIN_STEPS", "3")),
        help="inner steps of the run timed on this machine (0: skip the throughput check)",
    )
    parser.add_argument(
        "--link-gbps",
        type=_link_gbps,
        default=_link_gbps(env("TESSERA_DOCTOR_LINK_GBPS", "1")),
        help="link speed the throughput check assumes for upload and gather, Gbit/s",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _failed(name: str, exc: Exception) -> Check:
    logging.getLogger(f"tessera.{__name__}").debug("check %s crashed", name, exc_info=exc)
    return fail(name, f"the check itself failed: {describe_error(exc)}", "see the rows above")


def _guarded(name: str, check: Callable[[], Check]) -> Check:
    """Run one check; an unexpected error becomes a failed row instead of a traceback."""
    try:
        return check()
    except Exception as exc:  # the doctor reports, it does not crash
        return _failed(name, exc)


def _guarded_open(
    name: str, opener: Callable[[], tuple[Check, T | None]]
) -> tuple[Check, T | None]:
    """`_guarded` for the checks that also hand back what they opened."""
    try:
        return opener()
    except Exception as exc:  # the doctor reports, it does not crash
        return _failed(name, exc), None


def state_dir_for(state_dir: str | None, role: str, run: RunConfig, hotkey: str | None) -> Path:
    """The state directory the node will use (the same default as miner/validator pick)."""
    if state_dir:
        return Path(state_dir)
    kind = "validator" if role == "validator" else "state"
    base = Path.home() / ".tessera" / kind / run.run_id
    return base / hotkey if hotkey else base


def collect(args: argparse.Namespace) -> list[Check]:
    """Every check, in order; the ones that depend on a failed one are skipped."""
    role: str = args.role
    checks = [version_check()]
    run_row, run = _guarded_open("run", lambda: run_check(args.run))
    checks.append(run_row)
    hotkey_row, keypair = _guarded_open(
        "hotkey", lambda: hotkey_check(args.wallet, args.hotkey, args.wallet_path)
    )
    if run is None:
        checks += [skip(n, "needs the run") for n in ("gpu", "disk", "throughput")]
    else:
        gpus = visible_gpus()
        checks.append(_guarded("gpu", lambda: gpu_check(run, args.device, gpus)))
        hotkey = keypair.ss58_address if keypair else None
        where = state_dir_for(args.state_dir, role, run, hotkey)
        checks.append(_guarded("disk", lambda: disk_check(run, where)))
        checks.append(
            _guarded(
                "throughput",
                lambda: throughput_check(run, args.device, gpus, args.train_steps, args.link_gbps),
            )
        )
    checks.append(hotkey_row)

    chain_row, chain = _guarded_open("chain", lambda: chain_check(args.chain, args.netuid))
    checks.append(chain_row)
    checks += _chain_checks(args, chain, keypair, run)

    bucket_row, store = _guarded_open("bucket", lambda: bucket_check(args.store))
    checks.append(bucket_row)
    checks += _store_checks(args, store, chain, run)
    for handle in (store, chain):
        if handle is not None:
            with contextlib.suppress(Exception):
                handle.close()
    return checks


def _chain_checks(
    args: argparse.Namespace, chain: Chain | None, keypair: Keypair | None, run: RunConfig | None
) -> list[Check]:
    names = ("registration", "commitment", "clock")
    if chain is None:
        return [skip(n, "needs the chain") for n in names]
    out: list[Check] = []
    if keypair is not None:
        out.append(_guarded(names[0], lambda: registration_check(chain, keypair, args.role)))
        if args.store:
            row = _guarded(
                names[1], lambda: commitment_check(chain, keypair, args.store, args.role)
            )
            out.append(row)
        else:
            out.append(skip(names[1], "needs --store"))
    else:
        out += [skip(n, "needs the hotkey") for n in names[:2]]
    if run is None:
        out.append(skip(names[2], "needs the run"))
    else:
        out.append(_guarded(names[2], lambda: clock_check(chain, run)))
    return out


def _store_checks(
    args: argparse.Namespace,
    store: ObjectStore | None,
    chain: Chain | None,
    run: RunConfig | None,
) -> list[Check]:
    if store is None:
        return [skip(n, "needs a working bucket") for n in ("read key", "bandwidth")]
    out = [_guarded("read key", lambda: read_key_check(args.store, store, args.role))]
    if run is None:
        out.append(skip("bandwidth", "needs the run"))
        return out
    downloads = run.gather_size
    if args.role == "validator" and chain is not None:
        with contextlib.suppress(Exception):  # the estimate falls back to the gather size
            downloads = max(downloads, chain.metagraph().n)
    out.append(
        _guarded("bandwidth", lambda: bandwidth_check(store, run, args.bandwidth_mb, downloads))
    )
    return out


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING)
    checks = collect(args)
    if args.json:
        print(to_json(checks, args.role))
    else:
        print_checklist(checks, Console(highlight=False), args.role)
    return 0 if passed(checks) else 1
