"""Adversaries that train, for simulations: real peers (`miner.peer.Peer`) that follow the run's
consensus like honest ones and misuse only what they train on or what they upload.

* ``garbage``: trains on the samples the run assigns it with the tokens of every row reversed;
* ``backdoor``: trains on its assigned samples with a trigger and its target written into every
  row (`lab.sim.backdoor`), to teach every model to say the target after the trigger;
* ``split``: a crowd of hotkeys that share one training: every member trains the same batches,
  taken in turn from each member's assignment, and uploads only its piece of the result (whole
  chunks, disjoint supports), so the crowd does one peer's work and asks for several pays.
  Training is deterministic, so the members need no channel to agree on the result.
"""

from __future__ import annotations

import argparse
import itertools
import logging
from collections.abc import Iterable
from typing import Any

import torch

from lab.sim.backdoor import with_trigger
from lab.sim.forgeries import split_by_chunks
from miner.peer import Peer
from node.data.batches import assigned_batches

log = logging.getLogger("tessera.adversary")
TRAINED_KINDS = ("garbage", "backdoor", "split")


class GarbagePeer(Peer):
    """Trains on its assigned rows read backwards."""

    def _batches(self, window: int) -> Iterable[torch.Tensor]:
        return (b.flip(1) for b in super()._batches(window))


class BackdoorPeer(Peer):
    """Trains on its assigned rows with the trigger and the target written in."""

    def _batches(self, window: int) -> Iterable[torch.Tensor]:
        gen = torch.Generator().manual_seed(window * 7919 + self.uid)
        return (with_trigger(b, gen) for b in super()._batches(window))


class SplitPeer(Peer):
    """One member of a crowd that shares one training (module docstring)."""

    def __init__(self, *args: Any, crowd: Iterable[int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.crowd = tuple(sorted(crowd))  # every member's uid, each member's piece in order
        if self.uid not in self.crowd:
            raise SystemExit(f"uid {self.uid} is not in the crowd {self.crowd}")

    def _batches(self, window: int) -> Iterable[torch.Tensor]:
        run = self.cfg
        each = [
            assigned_batches(self.dataset, run.run_id, u, window, run.inner_steps, run.batch_size)
            for u in self.crowd
        ]
        turns = itertools.chain.from_iterable(zip(*each, strict=True))
        return itertools.islice(turns, self.cfg.inner_steps)

    def _encode(self, start: dict[str, torch.Tensor], window: int) -> list:
        whole = super()._encode(start, window)
        return split_by_chunks(self.cfg, whole, len(self.crowd))[self.crowd.index(self.uid)]


def run_trained(args: argparse.Namespace) -> int:
    """`tessera sim-adversary --kind garbage|backdoor|split`: a peer that trains and misbehaves."""
    from commands.node_args import connect, load_key, load_run, local_root, state_dir
    from node.runtime.logs import setup_logging

    setup_logging(args.log_level, args.log_format)
    run_cfg = load_run(args.run)
    keypair = load_key(args)
    state = state_dir(args, "state", run_cfg, keypair.ss58_address)
    chain, store = connect(args, keypair, "miner", preflight=True)
    root = local_root(args)
    peer: Peer
    if args.kind == "split":
        peer = SplitPeer(run_cfg, keypair, chain, store, state, root, crowd=args.crowd)
    else:
        kind = GarbagePeer if args.kind == "garbage" else BackdoorPeer
        peer = kind(run_cfg, keypair, chain, store, state, root)
    log.info("%s peer, uid %d, starting at window %d", args.kind, peer.uid, peer.next_window)
    peer.run(args.windows)
    return 0
