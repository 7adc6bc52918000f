"""`tessera why`: what the validators said about a peer in the last windows, and what to do.

    tessera why --chain finney --netuid N --wallet W --hotkey H     # our hotkey's peer
    tessera why --chain local:///tmp/run/chain.db --uid 3 --windows 10 --json

Reads every permitted validator's published score report of each of the last `--windows`
windows (`validator.published`) and prints, per window and validator, the peer's verdict, the
rule that decided its weight, the weight, and for a weight of 0 (or cut) what the rule means and
how to fix it. Nothing is written anywhere.
"""

from __future__ import annotations

import argparse
import json
import os

from rich.console import Console
from rich.table import Table

from codec.errors import TesseraError
from commands.arg_types import non_negative_int
from protocol.chain.base import Chain
from validator.published import ReportLine

HINTS: dict[str, str] = {
    "missing": "no update of yours was found: is the miner running and uploading? "
    "(its log: 'exchange of window N: upload'; `tessera doctor`)",
    "unreachable": "the validator could not read your bucket: check the read key on chain and "
    "the bucket's endpoint (`tessera doctor`)",
    "late": "your update landed after the upload deadline: see the miner's phase timings "
    "(train, upload) and your link",
    "invalid": "the signature or header did not match your registered hotkey: "
    "`tessera commit` with the hotkey the miner signs with",
    "malformed": "your update did not decode: run the run's tessera version",
    "non_finite": "your update held NaN or inf: your training diverged (see the miner's loss)",
    "norm_outlier": "your update's size was far from the others': a diverged or misconfigured "
    "training (check the run config)",
    "copy": "your update was explained by another peer's of the same window: copies are not paid",
    "replay": "your update was explained by an earlier update or aggregate: replays are not paid",
    "unscored": "not scored yet: each window scores a bounded number of peers; keep uploading",
    "penalty": "an earlier offence (copy, replay, ...) still weighs on your pay; it decays",
    "gain gate": "your updates have not lowered the validator's loss enough over recent windows",
    "indicator": "no evidence yet that you trained on your own assigned data",
    "effect": "no measurable effect of your update on your own assigned data",
    "out of sync": "your model differs from the validator's: see the miner's log (fork, resync)",
    "indicator (partial)": "little evidence yet of training on your own data: it builds up",
    "norm band": "this window's update size was outside the band around the others'",
    "effect (partial)": "your update's effect on your data is below an honest peer's",
    "penalty (decaying)": "an earlier offence is still decaying",
    "sync (partial)": "your model was out of sync recently: it recovers as you stay in sync",
}


class NotAPeer(TesseraError, RuntimeError):
    """The hotkey asked about is not registered on the run's subnet."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("--run", default=env("TESSERA_RUN", "tiny"), help="preset or run file")
    parser.add_argument("--chain", default=env("TESSERA_CHAIN"), help="the run's chain")
    parser.add_argument("--netuid", type=int, default=env("TESSERA_NETUID"), help="its subnet")
    parser.add_argument("--local-root", default=env("TESSERA_LOCAL_ROOT"), help="file:// buckets")
    parser.add_argument(
        "--uid", type=non_negative_int, help="the peer's uid (default: our hotkey's)"
    )
    parser.add_argument(
        "--wallet", "--wallet.name", dest="wallet", default=env("TESSERA_WALLET", "default")
    )
    parser.add_argument(
        "--hotkey", "--wallet.hotkey", dest="hotkey", default=env("TESSERA_HOTKEY", "default")
    )
    parser.add_argument(
        "--wallet-path", "--wallet.path", dest="wallet_path", default=env("TESSERA_WALLET_PATH")
    )
    parser.add_argument("--windows", type=int, default=5, help="how many of the last windows")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from commands.node_args import load_run
    from protocol.chain import open_chain
    from protocol.windows import WindowSchedule
    from validator.published import peer_verdicts, validators

    if not args.chain:
        raise SystemExit("--chain is required (or TESSERA_CHAIN): the run's chain")
    if args.windows < 1:
        raise SystemExit(f"--windows {args.windows}: ask for at least one window")
    run_cfg = load_run(args.run)
    local_root = Path(args.local_root) if args.local_root else None
    with open_chain(args.chain, netuid=args.netuid) as chain:
        uid = args.uid if args.uid is not None else _our_uid(chain, args)
        if not validators(chain, local_root):
            raise SystemExit("no validator with a permit has a readable bucket on this subnet")
        last = WindowSchedule.from_run(run_cfg).window_of(chain.block()) - 1
        windows = list(range(max(0, last - args.windows + 1), last + 1))
        verdicts = peer_verdicts(chain, run_cfg, uid, windows, local_root)
    if args.json:
        for v in verdicts:
            print(json.dumps(_row(v)))
    else:
        _print(uid, verdicts)
    return 0


def _our_uid(chain: Chain, args: argparse.Namespace) -> int:
    from protocol.keys import load_hotkey

    hotkey = load_hotkey(args.wallet, args.hotkey, args.wallet_path).ss58_address
    uid = chain.uid_of(hotkey)
    if uid is None:
        raise NotAPeer(f"hotkey {hotkey} is not registered on this subnet: register it first")
    return int(uid)


def _row(v: ReportLine) -> dict:
    line = v.line
    return {
        "window": v.window,
        "validator_uid": v.validator_uid,
        "verdict": line.verdict if line else None,
        "rule": line.rule if line else None,
        "rules": line.rules if line else [],
        "weight": v.weight,
        "score": line.loss.score if line and line.loss else None,
        "detail": line.detail if line else v.problem,
        "hint": HINTS.get(line.rule, "") if line else "",
    }


def _print(uid: int, verdicts: list[ReportLine]) -> None:
    console = Console(highlight=False, soft_wrap=True)
    table = Table(title=f"what the validators said about uid {uid}")
    for column in ("window", "validator", "verdict", "rule", "weight", "why"):
        table.add_column(column, justify="right" if column in ("window", "weight") else "left")
    for v in verdicts:
        row = _row(v)
        weight = "–" if row["weight"] is None else f"{row['weight']:.4f}"
        why = row["hint"] or row["detail"]
        table.add_row(
            str(v.window), f"uid {v.validator_uid}", str(row["verdict"] or "–"),
            str(row["rule"] or "–"), weight, why,
        )  # fmt: skip
    console.print(table)
