"""A late peer replays a validator's published history and lands on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from codec.compress import Compressor
from codec.spec import ModelSpec
from node.model.fingerprint import fingerprint
from node.model.llama import build_model
from node.strategy import make_strategy
from node.window.exchange import check_update, encode_signed
from node.window.history import (
    HistoryError,
    Source,
    catch_up,
    publish_aggregate,
    publish_checkpoint,
)
from protocol.keys import create_hotkey
from protocol.naming import aggregate_key
from protocol.runconfig import RunConfig
from protocol.stores import open_store


def test_late_peer_replays_checkpoint_and_aggregates(tmp_path: Path) -> None:
    run = RunConfig.preset("tiny", name="history")
    keys = [create_hotkey("w", f"k{i}", root=tmp_path / "wallets") for i in range(3)]
    validator = keys[2]
    store = open_store(f"file://{tmp_path}?bucket=validator")
    hotkeys = {i: k.ss58_address for i, k in enumerate(keys)}
    source = Source(2, validator.ss58_address, store)

    live = build_model(run.model, run.seed)
    spec = ModelSpec.from_module(live)
    compressors = [Compressor(spec, run.codec) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    fingerprints = {}
    for window in range(4):
        if window == 2:
            publish_checkpoint(store, run, window, 2, validator, live, outer={})
        raw = {}
        for uid in range(2):
            sparse = [
                compressors[uid].compress(n, torch.randn(p.shape, generator=gen) * 1e-3, 0.95)
                for n, p in live.named_parameters()
            ]
            raw[uid] = encode_signed(sparse, run, spec, window, uid, keys[uid])
        publish_aggregate(store, run, window, 2, validator, raw, hotkeys)
        # what the live peers did: the same replay of the same bytes
        replayed = make_strategy(run, spec)
        catch_up(live, replayed.aggregator, replayed.outer, source, window, window + 1)
        fingerprints[window + 1] = fingerprint(live)

    late, strategy = build_model(run.model, run.seed), make_strategy(run, spec)
    assert catch_up(late, strategy.aggregator, strategy.outer, source, 0, 4) == 4
    assert fingerprint(late) == fingerprints[4]

    # a publisher with no history replays nothing
    other = build_model(run.model, run.seed)
    stranger = Source(2, keys[0].ss58_address, store)
    strategy = make_strategy(run, spec)
    assert catch_up(other, strategy.aggregator, strategy.outer, stranger, 0, 4) == 0

    # a history signed by someone else is refused
    forged = open_store(f"file://{tmp_path}?bucket=forged")
    fake = publish_aggregate(forged, run, 0, 2, keys[0], {0: raw[0]}, hotkeys)
    forged.put(aggregate_key(run.run_id, 0, 2, validator.ss58_address), forged.get(fake, 1 << 24))
    with pytest.raises(HistoryError, match="signature"):
        catch_up(
            other,
            strategy.aggregator,
            strategy.outer,
            Source(2, validator.ss58_address, forged),
            0,
            1,
        )


def test_a_late_peer_restores_nesterov_momentum_from_a_checkpoint(tmp_path: Path) -> None:
    """DiLoCo with outer Nesterov: the checkpoint carries the momentum, so a late peer that
    starts from it (windows 0-1 are not even published) lands on the live weights bit for bit."""
    run = RunConfig.preset(
        "tiny", name="history-nesterov", strategy="diloco",
        outer={"optimizer": "nesterov", "momentum": 0.9, "alpha": 0.7},
    )  # fmt: skip
    keys = [create_hotkey("w", f"k{i}", root=tmp_path / "wallets") for i in range(3)]
    store = open_store(f"file://{tmp_path}?bucket=validator")
    hotkeys = {i: k.ss58_address for i, k in enumerate(keys)}
    source = Source(2, keys[2].ss58_address, store)
    live = build_model(run.model, run.seed)
    spec = ModelSpec.from_module(live)
    strategy = make_strategy(run, spec)
    gen = torch.Generator().manual_seed(1)
    for window in range(4):
        if window == 2:
            outer = strategy.outer.state_dict()
            assert outer  # there is momentum to carry
            publish_checkpoint(store, run, window, 2, keys[2], live, outer=outer)
        raw = {}
        for uid in range(2):
            deltas = {
                n: torch.randn(p.shape, generator=gen) * 1e-3 for n, p in live.named_parameters()
            }
            update = make_strategy(run, spec).encoder.encode(deltas, window)
            raw[uid] = encode_signed(update, run, spec, window, uid, keys[uid])
        if window < 2:  # applied live, never published: only the checkpoint can bring a peer here
            updates = {
                u: check_update(d, u, hotkeys[u], run, spec, window).tensors for u, d in raw.items()
            }
            strategy.outer.step(live, strategy.aggregator.mean(updates), window)
        else:
            publish_aggregate(store, run, window, 2, keys[2], raw, hotkeys)
            catch_up(live, strategy.aggregator, strategy.outer, source, window, window + 1)

    late = build_model(run.model, run.seed)
    late_strategy = make_strategy(run, spec)
    assert catch_up(late, late_strategy.aggregator, late_strategy.outer, source, 0, 4) == 4
    assert fingerprint(late) == fingerprint(live)
    theirs, ours = late_strategy.outer.state_dict(), strategy.outer.state_dict()
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in ours)
