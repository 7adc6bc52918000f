"""`sparseloco-mask`: the shared support against a plain per-chunk reference, the strategy against
a reference implementation over three windows, one support on every node (and after a restore),
and strict decoding: foreign supports, fresh entries on the support, hostile
``TSRM`` bytes."""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from codec import wire
from codec.chunking import ChunkLayout
from codec.compress import SparseGroup
from codec.errors import DecodeError
from codec.frame import payload_digest
from codec.masked import MaskedTensor, mix64, shared_counts, shared_support
from codec.spec import CodecParams, ModelSpec
from node.data.batches import open_run_dataset
from node.model.llama import build_model
from node.strategy import Strategy, make_strategy
from node.strategy.mask import MaskFormat, SharedSupport, mask_params
from node.window.exchange import encode_signed
from node.window.history import HistoryError, Source, catch_up, publish_aggregate
from protocol.keys import create_hotkey
from protocol.runconfig import RunConfig
from protocol.stores import open_store
from tests.support import wire_tampering as tampering
from tests.support.clip_reference import chunk_clipped_mean
from validator.config import ValidatorConfig
from validator.reveal import reveal_for
from validator.scoring import LossProbe, reference_norm

SHAPES = {"w": (40, 23), "v": (200,), "n": (50,)}
SPEC = ModelSpec.from_shapes(SHAPES)


def _run(shared: int = 20, beta: float = 0.9, explore: float = 0.25) -> RunConfig:
    return RunConfig.preset(
        "tiny", name="mask", strategy="sparseloco-mask",
        codec={"tile": 8, "k": 9, "max_abs_value": 1e6},
        mask={"shared_k": shared, "fresh_k": 3, "explore": explore},
        outer={"total_windows": 10, "ef_freeze_fraction": 0.0, "beta": beta, "alpha": 1.0},
    )  # fmt: skip


def _deltas(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def _masked(run: RunConfig) -> Strategy:
    """`make_strategy` of a masked run (`_run`)."""
    strategy = make_strategy(run, SPEC)
    assert isinstance(strategy.format, MaskFormat)
    return strategy


def _support(strategy: Strategy) -> SharedSupport:
    """The shared support a masked strategy's parts share."""
    assert isinstance(strategy.format, MaskFormat)
    return strategy.format.support


def _ref_support(
    last: torch.Tensor, params: CodecParams, shared_k: int, explore: float, seed: int
) -> list[torch.Tensor]:
    """The support rule, position by position with Python's sort."""
    layout = ChunkLayout.for_shape(tuple(last.shape), params)
    out, offset = [], 0
    for g, rows, s in zip(layout.groups, layout.split(last), shared_counts(layout, params, shared_k),
                          strict=True):  # fmt: skip
        c, x = g.chunk_size, min(s, int(explore * s + 0.5))
        group = []
        for j in range(g.n_chunks):
            noise = [int(mix64(np.array([offset + j * c + p], np.uint64), seed)[0]) >> 1
                     for p in range(c)]  # fmt: skip
            by_mag = sorted(range(c), key=lambda p: (-abs(float(rows[j, p])), noise[p]))
            top = set(by_mag[: s - x])
            rest = sorted((p for p in range(c) if p not in top), key=lambda p: noise[p])
            group.append(sorted(top | set(rest[:x])))
        out.append(torch.tensor(group, dtype=torch.int64).view(g.n_chunks, s))
        offset += g.n_chunks * c
    return out


def test_shared_support_is_the_plain_rule() -> None:
    params = CodecParams(tile=8, k=3)
    gen = torch.Generator().manual_seed(1)
    for name, shape in SHAPES.items():
        last = torch.randn(shape, generator=gen)
        last[last.abs() < 0.8] = 0.0  # ties at zero: decided by the noise order
        layout = ChunkLayout.for_shape(shape, params)
        for explore in (0.0, 0.25, 1.0):
            got = shared_support(last, layout, shared_counts(layout, params, 20), explore, 77)
            ref = _ref_support(last, params, 20, explore, 77)
            assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True)), (name, explore)


def _model() -> torch.nn.Module:
    model = torch.nn.Module()
    for n, s in SHAPES.items():
        model.register_parameter(n, torch.nn.Parameter(torch.zeros(s)))
    return model


def test_mask_follows_a_plain_reference_implementation() -> None:
    """Three peers, three windows: values on the shared support plus the fresh Top-k of the rest,
    error feedback as SparseLoCo's, the chunk-clipped mean of the resolved entries, and the next
    support from that mean."""
    run, beta = _run(), 0.9
    params = run.codec.model_copy(update={"k": run.mask.fresh_k})
    peers = [_masked(run) for _ in range(3)]
    validator = _masked(run)
    model = _model()
    ref_e = [{n: torch.zeros(s) for n, s in SHAPES.items()} for _ in peers]
    for window in range(3):
        digest, supports = _support(validator).current()
        updates = {}
        for uid, (peer, e) in enumerate(zip(peers, ref_e, strict=True)):
            deltas = _deltas(10 * window + uid)
            sent = peer.encoder.encode(deltas, window)
            data = peer.format.to_bytes(sent, {"window": window}, None)
            updates[uid] = make_strategy(run, SPEC).format.decode(data, 1 << 20).tensors  # no state
            for piece in updates[uid]:
                n = piece.name
                e[n] = beta * e[n] + deltas[n]
                layout = ChunkLayout.for_shape(SHAPES[n], params)
                for gi, (g, chunk) in enumerate(
                    zip(layout.groups, layout.split(e[n]), strict=True)
                ):
                    shared = supports[n][gi]
                    rest = chunk.abs().scatter(1, shared, -1.0)  # off the support
                    fresh = torch.topk(rest, g.k, dim=1).indices.sort(1).values
                    assert torch.equal(piece.groups[gi].idx, fresh)
                pos, vals = validator.format.entries(piece)
                assert pos.numel() == len(set(pos.tolist()))
                e[n].view(-1)[pos] -= vals
                torch.testing.assert_close(
                    peer.encoder.local_state_dict()[n], e[n], atol=1e-5, rtol=0
                )
        mean = validator.aggregator.mean(updates)
        for n, shape in SHAPES.items():
            dense = []
            for up in updates.values():
                pos, vals = validator.format.entries(next(p for p in up if p.name == n))
                dense.append(torch.zeros(shape, dtype=torch.float64))
                dense[-1].view(-1)[pos] = vals.double()
            ref = chunk_clipped_mean(dense, ChunkLayout.for_shape(shape, run.codec))
            torch.testing.assert_close(mean[n].double(), ref, rtol=1e-6, atol=1e-7)
        validator.outer.receive(mean, window)
        validator.outer.advance(model)
        for peer in peers:
            peer.outer.receive(mean, window)
            peer.outer.advance(_model())
        new_digest = _support(validator).current()[0]
        assert new_digest != digest  # the support moved with the aggregate
        assert all(
            _support(p).current()[0] == new_digest for p in peers
        )  # and moved alike everywhere


def test_one_support_everywhere_and_after_a_restore() -> None:
    run = _run()
    a, b = _masked(run), _masked(run)
    assert _support(a).current()[0] == _support(b).current()[0]
    mean = {
        n: torch.randn(s, generator=torch.Generator().manual_seed(3)) for n, s in SHAPES.items()
    }
    a.outer.receive(mean, 0)
    a.outer.advance(_model())
    assert _support(a).current()[0] != _support(b).current()[0]
    b.outer.load_state_dict(a.outer.state_dict())
    assert _support(a).current()[0] == _support(b).current()[0]
    c = _masked(run)
    c.outer.receive({n: t.clone() for n, t in mean.items()}, 0)
    c.outer.advance(_model())
    assert _support(c).current()[0] == _support(a).current()[0]
    layout = ChunkLayout.for_shape(SHAPES["v"], mask_params(run))  # the aggregate's largest entries
    top = mean["v"].abs().topk(3).indices
    support = _support(a).current()[1]["v"]
    flat = torch.cat([layout.flat_positions(i, s).reshape(-1) for i, s in enumerate(support)])
    assert set(top.tolist()) <= set(flat.tolist())
    with pytest.raises(ValueError):
        b.outer.load_state_dict({"last.v": torch.zeros(3)})


def test_updates_for_another_support_or_with_fresh_entries_on_it_are_refused() -> None:
    run = _run()
    peer, validator = _masked(run), _masked(run)
    stale = peer.encoder.encode(_deltas(1), 0)
    validator.outer.receive(_deltas(5), 0)  # the validator is a window ahead
    validator.outer.advance(_model())
    with pytest.raises(DecodeError, match="another shared support"):
        validator.aggregator.mean({0: stale})
    digest, supports = _support(peer).current()
    forged = []
    for piece in stale:  # a fresh position moved onto the shared support
        g0 = piece.groups[0]
        idx = g0.idx.clone()
        idx[0, 0] = supports[piece.name][0][0, 0]
        idx[0] = idx[0].sort().values
        forged.append(MaskedTensor(piece.name, piece.shape, [SparseGroup(idx, g0.codes, g0.scales),
                                   *piece.groups[1:]], piece.codebook, piece.shared, digest))  # fmt: skip
    with pytest.raises(DecodeError, match="shared support"):
        peer.aggregator.mean({0: forged})
    assert peer.aggregator.mean({0: stale})["w"].abs().sum() > 0


def test_the_masked_encoder_refuses_two_supports_or_another_shared_k() -> None:
    run = _run()
    peer = _masked(run)
    pieces = peer.encoder.encode(_deltas(1), 0)
    shared_k = run.mask.shared_k
    wire.decode_update(
        wire.encode_update(pieces, mask_params(run), SPEC, fmt=wire.MASKED, shared_k=shared_k),
        SPEC, mask_params(run), fmt=wire.MASKED, shared_k=shared_k,
    )  # fmt: skip
    two = [*pieces[:-1], dataclasses.replace(pieces[-1], digest=bytes(32))]
    with pytest.raises(ValueError, match="same support"):
        wire.encode_update(two, mask_params(run), SPEC, fmt=wire.MASKED, shared_k=shared_k)
    with pytest.raises(ValueError, match="do not match shared_k"):
        wire.encode_update(pieces, mask_params(run), SPEC, fmt=wire.MASKED, shared_k=shared_k - 1)


def test_a_replayed_window_made_for_another_support_is_a_history_error(tmp_path: Path) -> None:
    """A validator's history holds peers' genuinely signed updates, made on another support (a
    fork's): replaying them is refused as one `HistoryError`, so catch-up tries the next source."""
    run = _run()
    peer_key, validator_key = (create_hotkey("w", n, root=tmp_path / "keys") for n in "pv")
    forked = make_strategy(run, SPEC)
    forked.outer.receive(_deltas(5), 0)
    forked.outer.advance(_model())
    update = encode_signed(forked.encoder.encode(_deltas(1), 0), run, SPEC, 0, 0, peer_key)
    store = open_store(f"file://{tmp_path}?bucket=validator")
    publish_aggregate(store, run, 0, 2, validator_key, {0: update}, {0: peer_key.ss58_address})
    source = Source(2, validator_key.ss58_address, store)
    replayed = make_strategy(run, SPEC)
    with pytest.raises(HistoryError, match=r"window 0: .*another shared support"):
        catch_up(_model(), replayed.aggregator, replayed.outer, source, 0, 1)


def test_a_masked_piece_is_checked_field_by_field() -> None:
    """What `MaskedTensor.validate` and `resolve` refuse in a piece built by hand (the wire
    decoder builds well-shaped pieces, so each rule is pinned here)."""
    run = _run()
    peer = _masked(run)
    piece = next(p for p in peer.encoder.encode(_deltas(1), 0) if p.name == "w")
    params = mask_params(run)
    piece.validate(params)
    g = piece.groups[0]

    def group(**change: torch.Tensor) -> MaskedTensor:
        return dataclasses.replace(
            piece, groups=[dataclasses.replace(g, **change), *piece.groups[1:]]
        )

    nan_book = piece.codebook.clone()
    nan_book[0, 0] = float("nan")
    cases = {
        "bad shape": dataclasses.replace(piece, shape=(-1, 23)),
        "groups do not match": dataclasses.replace(piece, groups=piece.groups[1:]),
        "fresh idx must be int64": group(idx=g.idx.to(torch.int32)),
        "codes or scales do not fit": group(codes=g.codes[:, 1:]),
        "position outside the chunk": group(idx=g.idx + 10_000),
        "fresh positions not ascending": group(idx=g.idx.flip(1)),
        "group 0: ": dataclasses.replace(piece, codebook=nan_book),
    }
    for rule, bad in cases.items():
        with pytest.raises(DecodeError, match=rule):
            bad.validate(params)
    support = _support(peer).current()[1]["w"]
    piece.resolve(support)
    with pytest.raises(DecodeError, match="support has 0 groups"):
        piece.resolve([])
    with pytest.raises(DecodeError, match="does not match the update's layout"):
        piece.resolve([s[:, 1:] for s in support])


def test_copy_detection_compares_the_shared_and_the_fresh_positions() -> None:
    run = _run()
    peers = [_masked(run) for _ in range(2)]
    sent = [p.encoder.encode(_deltas(i), 0) for i, p in enumerate(peers)]
    for piece in sent[0]:
        assert peers[0].format.entries(piece)[0].numel() == sum(
            g.codes.numel() for g in piece.groups
        )
    shared = set(peers[0].format.entries(sent[0][0])[0].tolist()) & set(
        peers[1].format.entries(sent[1][0])[0].tolist()
    )
    assert len(shared) >= sum(piece.shared[0] * g.n_chunks for piece in sent[:1][0][:1]
                              for g in ChunkLayout.for_shape(piece.shape, mask_params(run)).groups[:1])  # fmt: skip


# -- the wire -----------------------------------------------------------------------------


def _good(run: RunConfig) -> bytes:
    peer = make_strategy(run, SPEC)
    return peer.format.to_bytes(peer.encoder.encode(_deltas(4), 0), {"window": 0}, None)


_parts = partial(tampering.split, wire.MASKED.frame)
_reframe = partial(tampering.reframe, wire.MASKED.frame)
_decode = partial(tampering.decode, SPEC)


def test_hostile_mask_bytes_raise_decode_error_quickly() -> None:
    run = _run()
    good = _good(run)
    _decode(run, good)
    header, payload = _parts(good)
    no_digest = {k: v for k, v in header.items() if k != "support_digest"}
    other = _run(shared=12)
    sparse_run = run.model_copy(update={"strategy": "sparseloco"})
    sparse = make_strategy(sparse_run, SPEC)
    corpus = {
        "truncated": good[:-5],
        "extra byte": good + b"\x00",
        "no support digest": _reframe(no_digest, payload),
        "short support digest": _reframe({**header, "support_digest": b"\x01" * 5}, payload),
        "shared_k lies": _reframe({**header, "shared_k": header["shared_k"] + 1}, payload),
        "made with another shared_k": _good(other),
        "a sparseloco update": sparse.format.to_bytes(
            sparse.encoder.encode(_deltas(4), 0), {}, None
        ),
        "flipped payload bit": good[:-30] + bytes([good[-30] ^ 8]) + good[-29:],
    }
    tampering.assert_refused_quickly(corpus, partial(_decode, run))
    with pytest.raises(DecodeError, match="shared values per chunk"):
        _decode(run, _good(other))
    with pytest.raises(DecodeError, match="support digest"):
        _decode(run, _reframe(no_digest, payload))
    unmasked = {k: v for k, v in header.items() if k != "shared_k"}  # a digest, no shared values
    raw = msgpack.packb({**unmasked, "digest": payload_digest(payload)}, use_bin_type=True)
    same_k = sparse_run.model_copy(update={"codec": mask_params(run)})
    with pytest.raises(DecodeError, match="support digest"):
        _decode(same_k, wire.FRAME.pack(raw, payload))


def test_the_validators_probe_scores_mask_updates_with_its_own_support() -> None:
    """The loss probe applies updates: with the validator's strategy (which holds the window's
    support) it scores them; a strategy without that state would refuse them."""
    run = RunConfig.preset("tiny", name="mask-probe", strategy="sparseloco-mask",
                           outer={"total_windows": 10, "ef_freeze_fraction": 0.0})  # fmt: skip
    model = build_model(run.model, run.seed)
    spec = ModelSpec.from_module(model)
    validator = make_strategy(run, spec)
    gen = torch.Generator().manual_seed(0)
    small = {t.name: torch.randn(t.shape, generator=gen) * 1e-3 for t in spec.tensors}
    validator.outer.receive(small, 0)  # the support has moved once
    validator.outer.advance(build_model(run.model, run.seed))
    peers = [make_strategy(run, spec) for _ in range(2)]
    for peer in peers:
        peer.outer.load_state_dict(validator.outer.state_dict())
    updates = {
        u: p.encoder.encode({n: t * (u + 1) for n, t in small.items()}, 1)
        for u, p in enumerate(peers)
    }
    norms = {u: validator.format.norm(up) for u, up in updates.items()}
    _, dataset = open_run_dataset(run)
    reveal = reveal_for(dataset, run.run_id, 1, b"k" * 32, 8, 8)
    cfg = ValidatorConfig(n_random=8, n_own=8)
    cpu = torch.device("cpu")
    probe = LossProbe(model, run, dataset, 1, reveal, updates, norms, cfg, cpu, validator.format)
    score = probe.score(0, updates[0], norms[0], reference_norm(norms))
    assert (
        math.isfinite(score.loss_after_random)
        and score.loss_after_random != score.loss_before_random
    )
    with pytest.raises(DecodeError, match="another shared support"):
        LossProbe(model, run, dataset, 1, reveal, updates, norms, cfg, cpu)  # no support
