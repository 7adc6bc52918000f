"""`tessera sim-adversary --kind …`: a misbehaving peer for simulations (never for real runs).

Every kind signs with its own hotkey and uses the real codec and naming, so only the defences
(`node.window.consensus`, the outer step's bounds, the validator's checks) stand between it and a
reward or a poisoned model:

* ``noise``: random updates; ``freeloader``: all-zero updates; ``nan``: non-finite values;
* ``tiny``: random updates a million times smaller than ``noise``'s (a crowd of them that held
  most of the applied set would set the outer step's clip bound, `validator.admission`);
* ``copier``: a perturbed copy of a victim's update; ``stale``: the victim's previous update;
* ``late``: uploads after the deadline;
* ``poison``: every value at the largest magnitude decoders admit, at the victim's positions and
  against its signs (random ones while it has not uploaded) in even windows, or a codebook of
  2^100 that decoders must refuse in odd windows;
* ``scaled``: the victim's update with its values multiplied by 5 (less if that passes the cap);
* ``equivocate``: a random update until the gather point (the deadline plus the skew grace),
  then, while everyone gathers, another random update (even windows) or nothing (odd windows);
* ``sigforge``: correct metadata and payload, signed by another key (even windows) or with one
  signature byte flipped (odd windows);
* ``recycler``: the previous window's published aggregate, re-compressed as its own update;
* ``mixer``: the victim's and a second honest peer's updates of the window mixed 50/50 by chunk
  (each chunk whole from one of them), re-compressed as its own update;
* ``slowdrip``: its bucket is its own HTTP server, which answers one byte per second;
* ``garbage``, ``backdoor``, ``split``: peers that train, on the wrong data or for a crowd of
  hotkeys (`lab.sim.trained`).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from substrateinterface import Keypair

from codec.compress import SparseTensor
from codec.spec import ModelSpec
from codec.wire import header_digest, read_header, with_signature
from lab.sim import forgeries as forge
from lab.sim.layout import ADVERSARY_KINDS
from lab.sim.trained import TRAINED_KINDS, run_trained
from protocol.chain.base import Chain
from protocol.runconfig import RunConfig
from protocol.stores import ObjectStore, StoreError
from protocol.windows import WindowSchedule

log = logging.getLogger("tessera.adversary")
NOISE_SCALE = 1e-3
TINY_SCALE = 1e-9


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from commands.node_args import add_node_arguments

    parser.add_argument("--kind", required=True, choices=ADVERSARY_KINDS)
    parser.add_argument("--victim", type=int, default=0, help="uid a copier or replayer copies")
    parser.add_argument(
        "--second-victim", type=int, default=None,
        help="the other uid a mixer mixes (default: the lowest other registered uid)",
    )  # fmt: skip
    parser.add_argument(
        "--crowd", type=int, nargs="+", default=(),
        help="every uid of a split crowd (each member uploads its piece of one training)",
    )  # fmt: skip
    add_node_arguments(parser)


@dataclass
class Adversary:
    """What every kind needs: its identity, the run, the chain, where it uploads."""

    kind: str
    uid: int
    keypair: Keypair
    run: RunConfig
    spec: ModelSpec
    chain: Chain
    store: ObjectStore
    local_root: Path | None
    victim: int
    gen: torch.Generator
    second_victim: int | None = None  # a mixer's other source (None: the lowest other uid)

    @property
    def sched(self) -> WindowSchedule:
        return WindowSchedule.from_run(self.run)

    def wait_block(self, block: int) -> None:
        while self.chain.block() < block:
            time.sleep(0.2)


def run(args: argparse.Namespace) -> int:
    from commands.node_args import connect, load_key, load_run, local_root
    from node.model.llama import build_model
    from node.runtime.logs import setup_logging

    if args.kind in TRAINED_KINDS:
        return run_trained(args)
    setup_logging(args.log_level, args.log_format)
    run_cfg = load_run(args.run)
    slow = args.kind == "slowdrip"
    args.commit = True  # an adversary always (re)posts its commitment
    keypair = load_key(args)
    chain, store = connect(args, keypair, "miner", preflight=not slow)
    uid = chain.uid_of(keypair.ss58_address)
    if uid is None:
        raise SystemExit("adversary hotkey is not registered")
    spec = ModelSpec.from_module(build_model(run_cfg.model, run_cfg.seed))
    adv = Adversary(
        args.kind, uid, keypair, run_cfg, spec, chain, store, local_root(args), args.victim,
        torch.Generator().manual_seed(7919 + uid), args.second_victim,
    )  # fmt: skip
    if slow:
        _serve_slowly(adv, args.store)
    first = max(0, adv.sched.window_of(chain.block()))
    for window in range(first, first + args.windows):
        adv.wait_block(adv.sched.first_block(window) + adv.sched.blocks_per_window // 2)
        update = FORGERS.get(adv.kind, _noise)(adv, window)
        if update is None:
            log.info("window %d: nothing to upload", window)
        else:
            UPLOADERS.get(adv.kind, _upload)(adv, window, update)
        while adv.sched.window_of(chain.block()) <= window:
            time.sleep(0.2)
    return 0


# -- what each kind uploads ------------------------------------------------------------------------


def _noise(adv: Adversary, window: int) -> list[SparseTensor]:
    return forge.noise_update(adv.spec, adv.run, NOISE_SCALE, adv.gen)


def _victim_or_noise(adv: Adversary, window: int) -> list[SparseTensor]:
    return _victim_update(adv, window) or _noise(adv, window)


def _poison(adv: Adversary, window: int) -> list[SparseTensor]:
    cap = adv.run.codec.max_abs_value if window % 2 == 0 else 2.0**100
    return forge.at_the_cap(_victim_or_noise(adv, window), cap)


def _copy(adv: Adversary, window: int) -> list[SparseTensor] | None:
    taken = _victim_update(adv, window)
    return forge.perturbed_copy(taken, adv.run.codec, adv.gen) if taken else None


def _recycled(adv: Adversary, window: int) -> list[SparseTensor] | None:
    """The last window's published aggregate: decoded, averaged, re-compressed as our own."""
    if window == 0:
        return None
    while (mean := _published_mean(adv, window - 1)) is None:
        if adv.chain.block() >= adv.sched.deadline_block(window) - 1:
            return None  # nobody published it in time
        time.sleep(0.5)
    return forge.from_dense(mean, adv.spec, adv.run)


def _published_mean(adv: Adversary, window: int) -> dict[str, torch.Tensor] | None:
    """The dense mean of the updates a validator published as `window`'s aggregate, if any."""
    from node.strategy import make_strategy
    from node.window.history import HistoryError, history_sources, read_aggregate

    for source in history_sources(adv.chain, adv.local_root):
        try:
            updates = read_aggregate(source, adv.run, adv.spec, window)
        except (HistoryError, StoreError):
            continue
        return make_strategy(adv.run, adv.spec).aggregator.mean(updates)
    return None


def _mixed(adv: Adversary, window: int) -> list[SparseTensor] | None:
    """The victim's and the second victim's updates of `window`, mixed 50/50 by chunk."""
    first = _victim_update(adv, window)
    second = _victim_update(adv, window, _second_victim(adv))
    if first is None or second is None:
        return None
    return forge.chunk_mix(first, second, 0.5, adv.gen, adv.spec, adv.run)


def _second_victim(adv: Adversary) -> int:
    if adv.second_victim is not None:
        return adv.second_victim
    others = [n.uid for n in adv.chain.metagraph().neurons if n.uid not in (adv.uid, adv.victim)]
    return min(others, default=adv.victim)


FORGERS: dict[str, Callable[[Adversary, int], list[SparseTensor] | None]] = {
    "freeloader": lambda adv, w: forge.zero_update(adv.spec, adv.run),
    "tiny": lambda adv, w: forge.noise_update(adv.spec, adv.run, TINY_SCALE, adv.gen),
    "nan": lambda adv, w: forge.poisoned(_noise(adv, w)),
    "copier": _copy,
    "stale": lambda adv, w: _victim_update(adv, w - 1) if w > 0 else None,
    "poison": _poison,
    "scaled": lambda adv, w: (
        forge.scaled(u, 5.0, adv.run.codec.max_abs_value) if (u := _victim_update(adv, w)) else None
    ),
    "equivocate": _noise,  # what passes a copy check, so only the switch can betray it
    "recycler": _recycled,
    "mixer": _mixed,
}


# -- how each kind uploads -----------------------------------------------------------------------


def _signed(adv: Adversary, window: int, update: list[SparseTensor]) -> bytes:
    from node.window.exchange import encode_signed

    return encode_signed(update, adv.run, adv.spec, window, adv.uid, adv.keypair)


def _upload(adv: Adversary, window: int, update: list[SparseTensor]) -> None:
    from node.window.exchange import publish

    data = _signed(adv, window, update)
    publish(adv.store, data, adv.run, window, adv.uid, adv.keypair.ss58_address)
    log.info("window %d: uploaded %s update (%d bytes)", window, adv.kind, len(data))


def _upload_late(adv: Adversary, window: int, update: list[SparseTensor]) -> None:
    late_by = adv.run.timing.clock_skew_tolerance_s / adv.run.timing.block_time_s + 2
    adv.wait_block(adv.sched.deadline_block(window) + int(late_by) + 1)
    _upload(adv, window, update)


def _equivocate(adv: Adversary, window: int, update: list[SparseTensor]) -> None:
    from node.runtime.clock import ChainClock
    from protocol.naming import update_key

    _upload(adv, window, update)
    adv.wait_block(ChainClock(adv.chain, adv.run).gather_block(window))  # while everyone gathers
    key = update_key(adv.run.run_id, window, adv.uid, adv.keypair.ss58_address)
    if window % 2 == 0:
        adv.store.put(key, _signed(adv, window, _noise(adv, window)))
        log.info("window %d: replaced the update at the gather point", window)
    else:
        adv.store.delete(key)
        log.info("window %d: deleted the update at the gather point", window)


def _sigforge(adv: Adversary, window: int, update: list[SparseTensor]) -> None:
    from node.window.exchange import publish
    from protocol.signing import sign_update

    data = _signed(adv, window, update)
    header, _ = read_header(data)
    if window % 2 == 0:  # the same header, signed by a key that is not the uploader's
        other = Keypair.create_from_uri(f"//tessera-sigforge-{window}")
        sig = sign_update(other, adv.run.run_id, window, adv.uid, header_digest(header))
    else:  # one byte of a valid signature flipped
        sig = bytes([header.sig[0] ^ 1]) + header.sig[1:]
    data = with_signature(data, sig)
    publish(adv.store, data, adv.run, window, adv.uid, adv.keypair.ss58_address)
    log.info("window %d: uploaded a forged signature", window)


UPLOADERS: dict[str, Callable[[Adversary, int, list[SparseTensor]], None]] = {
    "late": _upload_late,
    "equivocate": _equivocate,
    "sigforge": _sigforge,
}


def _serve_slowly(adv: Adversary, store_url: str) -> None:
    """Serve our bucket folder from our own HTTP endpoint, one byte per second, and commit it."""
    from urllib.parse import parse_qs, urlsplit

    from lab.sim.slow_store import SlowStore
    from node.runtime.commit import commitment_for, ensure_commitment
    from protocol.credentials import ReadCredentials

    parts = urlsplit(store_url)
    bucket = parse_qs(parts.query)["bucket"][-1]
    endpoint = SlowStore(Path(parts.path), "drip_body").__enter__()  # lives as long as we do
    read = ReadCredentials(access_key_id="slowdrip", secret_access_key="slowdrip")
    wanted = commitment_for(f"s3://{bucket}?endpoint={endpoint}", read=read)
    # a placeholder key: the endpoint is our own server, which serves reads and nothing else
    ensure_commitment(adv.chain, adv.keypair, wanted, post=True, before_post=lambda: None)
    log.info("serving bucket %s from %s, one byte per second", bucket, endpoint)


def _victim_update(
    adv: Adversary, window: int, uid: int | None = None, wait_s: float = 30.0
) -> list[SparseTensor] | None:
    """The verified update of the victim (or of `uid`) for `window`, polling its bucket for up
    to `wait_s`."""
    from node.window.buckets import peer_buckets
    from node.window.exchange import check_update, max_update_bytes
    from protocol.naming import update_key

    if window < 0:
        return None
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            victim = peer_buckets(adv.chain, adv.local_root)[0][adv.victim if uid is None else uid]
            key = update_key(adv.run.run_id, window, victim.uid, victim.hotkey)
            data = victim.store.get(key, max_update_bytes(adv.spec, adv.run))
            return check_update(data, victim.uid, victim.hotkey, adv.run, adv.spec, window).tensors
        except (KeyError, StoreError):
            time.sleep(0.3)
    return None
