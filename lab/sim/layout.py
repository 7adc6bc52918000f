"""The simulation's world on disk: run config, embedded chain, wallets, buckets, registrations."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

from substrateinterface import Keypair, KeypairType

from commands.provision import ensure_s3_bucket
from lab.sim.buckets import check_read_key
from protocol.chain.local_db import LocalChainDB, create_local_chain
from protocol.keys import SS58_FORMAT, create_hotkey, hotkey_path, write_keypair_file
from protocol.runconfig import RunConfig

NETUID = 1
VALIDATOR_STAKE = 1000.0
ADVERSARY_KINDS = (
    "noise", "copier", "stale", "freeloader", "nan", "late",
    "poison", "scaled", "equivocate", "sigforge", "recycler", "slowdrip", "mixer", "tiny",
    "garbage", "backdoor", "split",
)  # fmt: skip


@dataclass(frozen=True)
class Member:
    """One process of the simulation: an honest peer, an adversary or the validator."""

    name: str  # wallet hotkey name, e.g. peer0, noise, validator
    kind: str  # honest | validator | one of ADVERSARY_KINDS
    uid: int
    hotkey: str
    store_url: str
    state_dir: Path


@dataclass
class World:
    out: Path
    run_path: Path
    run: RunConfig
    chain_url: str
    local_root: Path | None
    members: list[Member] = field(default_factory=list)
    metrics_ports: dict[str, int] = field(default_factory=dict)  # by member name; none: off

    def of_kind(self, kind: str) -> list[Member]:
        return [m for m in self.members if m.kind == kind]


def sim_run_config(
    windows: int,
    block_time: float,
    blocks_per_window: int,
    start_block: int = 0,
    strategy: str = "sparseloco",
    delay: int = 0,
    min_support: int = 1,
) -> RunConfig:
    """The tiny preset with a clock fast enough for a simulation on a laptop.

    A gather may take a fifth of a window, and the lead validator has another 40 % of a window to
    publish its manifest (`node.window.consensus`): it scores the selected updates for evidence of
    training before it decides (`validator.admission`). A peer that finds none waits a few blocks
    more (the settle block), and still has a fifth of a window to train the next one.
    """
    window_s = block_time * blocks_per_window
    return RunConfig.preset(
        "tiny",
        name="sim",
        strategy=strategy,
        outer={"total_windows": max(windows, 1), "delay": delay, "min_support": min_support},
        consensus={"fetch_budget_s": max(2.0, window_s / 5), "manifest_wait_s": 0.4 * window_s},
        timing={
            "block_time_s": block_time,
            "blocks_per_window": blocks_per_window,
            "upload_deadline_blocks": max(1, blocks_per_window // 5),
            "clock_skew_tolerance_s": block_time,
            "start_block": start_block,
        },
    )


def bucket_url(storage: str, out: Path, name: str) -> str:
    """`file://` buckets under the run folder by default; `s3://PREFIX?endpoint=…` otherwise."""
    if storage == "file":
        return f"file://{out / 'buckets'}?bucket={name}"
    prefix, _, query = storage.removeprefix("s3://").partition("?")
    bucket = f"{prefix}-{name}" if prefix else f"tessera-sim-{name}"
    return f"s3://{bucket}?{query}" if query else f"s3://{bucket}"


def _settled_key(run_id: str, name: str, root: Path) -> Keypair:
    """A member's hotkey that follows from the run id and its name, so that two runs with the
    same settings give each member the same key and draws: for a simulation's local chain only
    (anyone who knows the run id can make it)."""
    seed = hashlib.blake2b(f"tessera-sim/{run_id}/{name}".encode(), digest_size=32).hexdigest()
    key = Keypair.create_from_seed(seed, ss58_format=SS58_FORMAT, crypto_type=KeypairType.SR25519)
    write_keypair_file(hotkey_path("sim", name, root), key, overwrite=True)
    return key


def startup_seconds(members: int) -> float:
    """Time every process gets to start (import torch, load data) before window 0 opens."""
    return 20.0 + 5.0 * members


def startup_blocks(members: int, block_time: float) -> int:
    """The first block window 0 may start at: `startup_seconds` of blocks."""
    return math.ceil(startup_seconds(members) / block_time)


def first_block(members: int, block_time: float, start_block: int | None = None) -> int:
    """Window 0's first block: `start_block`, or once every process can have started;
    `ValueError` (the operator's fix in its message) when `start_block` is earlier than that."""
    needed = startup_blocks(members, block_time)
    if start_block is None:
        return needed
    if start_block < needed:
        raise ValueError(
            f"--start-block {start_block}: the processes need until block {needed} to start; "
            f"give {needed} or more"
        )
    return start_block


def build_world(
    out: Path,
    windows: int,
    block_time: float,
    blocks_per_window: int,
    peers: int,
    adversaries: list[str],
    storage: str,
    strategy: str = "sparseloco",
    delay: int = 0,
    validators: int = 1,
    min_support: int = 1,
    start_block: int | None = None,
) -> World:
    """Create the run folder, the chain and every member's wallet, uid and bucket name.

    Window 0 starts once every process has had time to start, so nobody misses the beginning, or
    at `start_block` (no earlier than that): two runs with the same settings and start block share
    a run id and the members' hotkeys (`_settled_key`), so their honest peers train on the same
    samples under the same hotkeys and both are scored on the same held-out set.
    The first validator (``validator``) has the most stake and leads; the next (``validator1``,
    half its stake) is the standby that decides when the lead does not (docs/consensus.md).
    """
    start = first_block(peers + len(adversaries) + validators, block_time, start_block)
    out.mkdir(parents=True, exist_ok=True)
    db_path = out / "chain.db"
    create_local_chain(db_path, NETUID, block_time=block_time, exist_ok=True)
    db = LocalChainDB(db_path)
    run = sim_run_config(
        windows, block_time, blocks_per_window, start, strategy, delay, min_support
    )
    run_path = run.dump(out / "run.json")
    world = World(
        out=out,
        run_path=run_path,
        run=run,
        chain_url=f"local://{db_path}",
        local_root=out / "buckets" if storage == "file" else None,
    )
    roles = [(f"peer{i}", "honest") for i in range(peers)]
    earlier: dict[str, int] = {}  # a crowd of one kind: tiny, tiny1, tiny2, ...
    for kind in adversaries:
        n = earlier[kind] = earlier.get(kind, -1) + 1
        roles.append((f"{kind}{n}" if n else kind, kind))
    stakes = {
        f"validator{i}" if i else "validator": VALIDATOR_STAKE / (i + 1) for i in range(validators)
    }
    roles += [(name, "validator") for name in stakes]
    for name, kind in roles:
        key = (
            create_hotkey("sim", name, root=out / "wallets", overwrite=True)
            if start_block is None
            else _settled_key(run.run_id, name, out / "wallets")
        )
        url = bucket_url(storage, out, name)
        if url.startswith("s3://"):
            ensure_s3_bucket(url)
            check_read_key(url)  # never a key that can write goes on chain
        validator = kind == "validator"
        uid = db.register(
            NETUID,
            key.ss58_address,
            validator=validator,
            stake=stakes.get(name, 0.0),
        )
        world.members.append(
            Member(
                name=name,
                kind=kind,
                uid=uid,
                hotkey=key.ss58_address,
                store_url=url,
                state_dir=out / "state" / name,
            )
        )
    return world
