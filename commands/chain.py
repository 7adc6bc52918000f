"""`tessera chain ...`: manage the embedded local chain (create a subnet, register hotkeys, stake).

    tessera chain create   --db sim/chain.db --netuid 1 --block-time 0.5
    tessera chain register --db sim/chain.db --hotkey 5F... [--validator] [--stake 100]
                           [--replace-uid 3]
    tessera chain stake    --db sim/chain.db --hotkey 5F... --amount 50
    tessera chain show     --db sim/chain.db [--json]

`--netuid` may be left out of register/stake/show when the file holds exactly one subnet.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from protocol.chain.errors import ChainError
from protocol.chain.local import LocalChain
from protocol.chain.local_db import LocalChainDB, SubnetParams, create_local_chain


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="chain_command", metavar="ACTION")
    sub.required = True

    create = sub.add_parser("create", help="create the chain file (if needed) and a subnet")
    create.add_argument("--db", type=Path, required=True, help="chain file (SQLite)")
    create.add_argument("--netuid", type=int, required=True)
    create.add_argument(
        "--block-time", type=float, default=12.0, help="seconds per block (fixed per file)"
    )
    create.add_argument("--tempo", type=int, default=360, help="blocks per epoch")
    create.add_argument("--max-uids", type=int, default=256)
    create.add_argument(
        "--commit-max-space",
        type=int,
        default=3100,
        help="commitment bytes per hotkey per epoch; a commit costs max(100, len)",
    )
    create.add_argument(
        "--weights-rate-limit",
        type=int,
        default=0,
        help="blocks between two set_weights of one validator (0: unlimited)",
    )
    create.add_argument("--exist-ok", action="store_true", help="succeed if the subnet exists")

    register = sub.add_parser("register", help="give a hotkey a uid on a subnet")
    register.add_argument("--db", type=Path, required=True)
    register.add_argument("--hotkey", required=True, help="SS58 address")
    register.add_argument("--netuid", type=int, default=None)
    register.add_argument("--coldkey", default=None, help="SS58 address of the owning coldkey")
    register.add_argument("--validator", action="store_true", help="grant a validator permit")
    register.add_argument("--stake", type=float, default=0.0, help="initial stake in TAO")
    register.add_argument(
        "--replace-uid",
        type=int,
        default=None,
        help="take this uid from its hotkey (as subtensor does when a subnet is full)",
    )

    stake = sub.add_parser("stake", help="add (or, negative, remove) stake of a hotkey")
    stake.add_argument("--db", type=Path, required=True)
    stake.add_argument("--hotkey", required=True, help="SS58 address")
    stake.add_argument("--amount", type=float, required=True, help="TAO to add (negative removes)")
    stake.add_argument("--netuid", type=int, default=None)

    show = sub.add_parser("show", help="print the metagraph, commitments and weights")
    show.add_argument("--db", type=Path, required=True)
    show.add_argument("--netuid", type=int, default=None)
    show.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    console = Console()
    try:
        if args.chain_command == "create":
            return _create(args, console)
        netuid = _resolve_netuid(args.db, args.netuid)
        if args.chain_command == "register":
            return _register(args, netuid, console)
        if args.chain_command == "stake":
            return _stake(args, netuid, console)
        if args.chain_command == "show":
            return _show(args, netuid, console)
    except (ChainError, ValueError) as exc:  # one line, `tessera chain: …` (commands.cli)
        raise SystemExit(str(exc)) from None
    raise SystemExit(f"unknown action {args.chain_command!r}")


def _create(args: argparse.Namespace, console: Console) -> int:
    params = create_local_chain(
        args.db,
        args.netuid,
        block_time=args.block_time,
        tempo=args.tempo,
        max_uids=args.max_uids,
        commit_max_space=args.commit_max_space,
        weights_rate_limit=args.weights_rate_limit,
        exist_ok=args.exist_ok,
    )
    console.print(
        f"subnet {params.netuid} ready in {args.db} (tempo {params.tempo}, "
        f"max uids {params.max_uids}); open it as local://{args.db.resolve()}",
        highlight=False,
    )
    return 0


def _resolve_netuid(db_path: Path, netuid: int | None) -> int:
    if netuid is not None:
        return netuid
    db = LocalChainDB(db_path)
    try:
        subnets = db.subnets()
    finally:
        db.close()
    if len(subnets) != 1:
        found = ", ".join(str(s.netuid) for s in subnets) or "none"
        raise ChainError(f"{db_path} holds subnets [{found}]; pass --netuid")
    return subnets[0].netuid


def _register(args: argparse.Namespace, netuid: int, console: Console) -> int:
    db = LocalChainDB(args.db)
    try:
        uid = db.register(
            netuid,
            args.hotkey,
            coldkey=args.coldkey,
            validator=args.validator,
            stake=args.stake,
            replace_uid=args.replace_uid,
        )
    finally:
        db.close()
    role = "validator" if args.validator else "miner"
    console.print(f"registered {args.hotkey} as uid {uid} ({role}) on subnet {netuid}")
    return 0


def _stake(args: argparse.Namespace, netuid: int, console: Console) -> int:
    db = LocalChainDB(args.db)
    try:
        total = db.add_stake(netuid, args.hotkey, args.amount)
    finally:
        db.close()
    console.print(f"{args.hotkey} now has {total:.4f} TAO staked on subnet {netuid}")
    return 0


def _show(args: argparse.Namespace, netuid: int, console: Console) -> int:
    with LocalChain(args.db, netuid) as chain:
        params = chain.params()
        metagraph = chain.metagraph()
        commitments = chain.read_all_commitments()
        weights = chain.weights_all()
        block_time = chain.db.clock.block_time
    if args.json:
        payload = {
            "netuid": netuid,
            "block": metagraph.block,
            "block_time": block_time,
            "params": params.model_dump(),
            "neurons": [n.model_dump() for n in metagraph.neurons],
            "commitments": {
                hk: {"block": c.block, "size": len(c.data), "sha256": _digest(c.data)}
                for hk, c in commitments.items()
            },
            "weights": {str(v): {str(u): w for u, w in row.items()} for v, row in weights.items()},
        }
        sys.stdout.write(json.dumps(payload, indent=2, sort_keys=True) + "\n")
        return 0
    console.print(_header(args.db, params, metagraph.block, block_time), highlight=False)
    table = Table(title=f"subnet {netuid} metagraph")
    for column in ("uid", "hotkey", "stake (TAO)", "validator", "commit block", "bytes", "sha256"):
        table.add_column(column)
    for neuron in metagraph.neurons:
        commitment = commitments.get(neuron.hotkey)
        table.add_row(
            str(neuron.uid),
            neuron.hotkey,
            f"{neuron.stake:.4f}",
            "yes" if neuron.validator_permit else "",
            str(commitment.block) if commitment else "-",
            str(len(commitment.data)) if commitment else "-",
            _digest(commitment.data) if commitment else "-",
        )
    console.print(table)
    stale = len(set(commitments) - set(metagraph.hotkeys))
    console.print(f"{len(commitments)} commitments ({stale} from unregistered hotkeys)")
    if weights:
        wtable = Table(title="weights (normalised)")
        wtable.add_column("validator uid")
        wtable.add_column("top weights uid:weight")
        for vuid, row in sorted(weights.items()):
            top = sorted(row.items(), key=lambda kv: -kv[1])[:8]
            more = f" (+{len(row) - 8} more)" if len(row) > 8 else ""
            wtable.add_row(str(vuid), " ".join(f"{u}:{w:.3f}" for u, w in top) + more)
        console.print(wtable)
    else:
        console.print("no weights set")
    return 0


def _header(db: Path, params: SubnetParams, block: int, block_time: float) -> str:
    return (
        f"{db}  subnet {params.netuid}  block {block}  epoch {params.epoch_of(block)}  "
        f"block time {block_time:g}s  tempo {params.tempo}  "
        f"commit budget {params.commit_max_space} B/epoch"
    )


def _digest(data: bytes) -> str:
    """A short fingerprint: commitments hold read credentials, so the table never prints them."""
    return hashlib.sha256(data).hexdigest()[:16]
