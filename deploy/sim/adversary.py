"""`tessera sim-adversary --kind …`: a misbehaving peer for simulations (never for real runs).

Kinds: ``noise`` uploads random updates; ``copier`` uploads a perturbed copy of another peer's
update; ``stale`` replays another peer's update from the previous window; ``freeloader`` never
trains and uploads an all-zero update; ``nan`` uploads non-finite values; ``late`` uploads after
the deadline. All of them sign with their own hotkey and use the real codec and naming, so only
the validator's checks stand between them and a reward.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch

from codec.compress import SparseTensor
from codec.spec import ModelSpec
from deploy.sim.forgeries import noise_update, perturbed_copy, poisoned, zero_update
from deploy.sim.layout import ADVERSARY_KINDS
from protocol.chain.base import Chain
from protocol.runconfig import RunConfig

log = logging.getLogger("tessera.adversary")
NOISE_SCALE = 1e-3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from node.runtime.node_args import add_node_arguments

    parser.add_argument("--kind", required=True, choices=ADVERSARY_KINDS)
    parser.add_argument("--victim", type=int, default=0, help="uid a copier or replayer copies")
    add_node_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from node.model.llama import build_model
    from node.runtime.logs import setup_logging
    from node.runtime.node_args import connect, load_run, local_root
    from node.window.exchange import encode_signed, publish
    from protocol.windows import WindowSchedule

    setup_logging(args.log_level, args.log_format)
    run_cfg = load_run(args.run)
    args.commit = True  # an adversary always (re)posts its commitment
    keypair, chain, store = connect(args, "sim-adversary")
    uid = chain.uid_of(keypair.ss58_address)
    if uid is None:
        raise SystemExit("adversary hotkey is not registered")
    spec = ModelSpec.from_module(build_model(run_cfg.model, run_cfg.seed))
    sched = WindowSchedule.from_run(run_cfg)
    gen = torch.Generator().manual_seed(7919 + uid)
    root = local_root(args)
    first = max(0, sched.window_of(chain.block()))
    for window in range(first, first + args.windows):
        while chain.block() < sched.first_block(window) + sched.blocks_per_window // 2:
            time.sleep(0.2)
        update = _forge(args.kind, window, run_cfg, spec, chain, root, gen, args.victim)
        if update is None:
            log.info("window %d: nothing to upload", window)
        else:
            if args.kind == "late":
                late_by = run_cfg.timing.clock_skew_tolerance_s / run_cfg.timing.block_time_s + 2
                while chain.block() < sched.deadline_block(window) + late_by:
                    time.sleep(0.2)
            data = encode_signed(update, run_cfg, spec, window, uid, keypair)
            publish(store, data, run_cfg, window, uid, keypair.ss58_address)
            log.info("window %d: uploaded %s update (%d bytes)", window, args.kind, len(data))
        while sched.window_of(chain.block()) <= window:
            time.sleep(0.2)
    return 0


def _forge(
    kind: str,
    window: int,
    run_cfg: RunConfig,
    spec: ModelSpec,
    chain: Chain,
    local_root: Path | None,
    gen: torch.Generator,
    victim: int,
) -> list[SparseTensor] | None:
    if kind in ("noise", "late"):
        return noise_update(spec, run_cfg, NOISE_SCALE, gen)
    if kind == "freeloader":
        return zero_update(spec, run_cfg)
    if kind == "nan":
        return poisoned(noise_update(spec, run_cfg, NOISE_SCALE, gen))
    source_window = window - 1 if kind == "stale" else window
    if source_window < 0:
        return None
    taken = _victim_update(chain, local_root, run_cfg, spec, source_window, victim)
    if taken is None:
        return None
    return taken if kind == "stale" else perturbed_copy(taken, run_cfg.codec, gen)


def _victim_update(
    chain: Chain,
    local_root: Path | None,
    run_cfg: RunConfig,
    spec: ModelSpec,
    window: int,
    victim_uid: int,
    wait_s: float = 30.0,
) -> list[SparseTensor] | None:
    """The victim's verified update for `window`, polling its bucket for up to `wait_s`."""
    from node.window.buckets import peer_buckets
    from node.window.exchange import check_update, max_update_bytes
    from protocol.naming import update_key
    from protocol.stores import StoreError

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            victim = peer_buckets(chain, local_root)[0][victim_uid]
            key = update_key(run_cfg.run_id, window, victim.uid, victim.hotkey)
            data = victim.store.get(key, max_update_bytes(spec, run_cfg))
            return check_update(data, victim.uid, victim.hotkey, run_cfg, spec, window).tensors
        except (KeyError, StoreError):
            time.sleep(0.3)
    return None
