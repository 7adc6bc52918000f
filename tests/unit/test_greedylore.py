"""GreedyLore (`node.strategy.greedylore`): the deterministic eigenbasis, the windowed algorithm
against a plain reference over two τ cycles, the outer state on restore, strict validation, and
strict decoding of its ``TSRL`` container."""

from __future__ import annotations

import math
from collections.abc import Iterator
from functools import partial

import pytest
import torch

from codec import detmath, lowrank, wire
from codec.compress import SparseTensor
from codec.dense import to_wire_precision
from codec.errors import DecodeError
from codec.spec import ModelSpec
from lab.strategies.greedylore_variants import NowBasis, greedylore_variant
from node.strategy import Strategy, make_strategy
from node.strategy.greedylore import LowRankBasis, LowRankEncoder, LowRankFormat
from protocol.runconfig import RunConfig
from tests.support import wire_tampering as tampering

SHAPES = {"embed_tokens.weight": (60, 8), "w": (12, 20), "t": (20, 12), "norm": (12,)}
SPEC = ModelSpec.from_shapes(SHAPES)
MATRICES = ("w", "t")


def _run(tau: int = 3, rank: int = 3) -> RunConfig:
    return RunConfig.preset(
        "tiny", name="greedylore", strategy="greedylore", dense={"dtype": "bf16"},
        codec={"tile": 4, "k": 3, "max_abs_value": 1e6}, lowrank={"rank": rank, "tau": tau},
        outer={"total_windows": 10, "ef_freeze_fraction": 0.0, "alpha": 1.0},
    )  # fmt: skip


def _deltas(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) * 0.1 for n, s in SHAPES.items()}


def _basis(strategy: Strategy) -> LowRankBasis:
    """The basis a GreedyLore strategy's parts share."""
    assert isinstance(strategy.format, LowRankFormat)
    return strategy.format.basis


def _work(name: str, x: torch.Tensor) -> torch.Tensor:
    return x.T if name == "t" else x  # "t" is taller than wide: sent transposed


class _Named(torch.nn.Module):
    """A model whose parameter names are the spec's (dots included)."""

    def __init__(self) -> None:
        super().__init__()
        self.params = {n: torch.nn.Parameter(torch.zeros(s)) for n, s in SHAPES.items()}

    def named_parameters(
        self, *args: object, **kwargs: object
    ) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return iter(self.params.items())


def test_det_eigh_is_an_eigenbasis_and_the_same_bits_alone_or_batched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(3, 9, 14, generator=gen, dtype=torch.float64)
    sym = detmath.det_matmul(g, g.transpose(-1, -2))
    values, vectors = detmath.det_eigh(sym)
    ref = torch.linalg.eigvalsh(sym).flip(-1)
    torch.testing.assert_close(values, ref, rtol=1e-12, atol=1e-12)
    eye = torch.eye(9, dtype=torch.float64).expand(3, 9, 9)
    torch.testing.assert_close(vectors.transpose(-1, -2) @ vectors, eye, rtol=0, atol=1e-12)
    torch.testing.assert_close(sym @ vectors, vectors * values[:, None, :], rtol=0, atol=1e-9)
    alone = detmath.det_eigh(sym[1])
    assert torch.equal(alone[1], vectors[1]) and torch.equal(alone[0], values[1])
    monkeypatch.setattr(detmath, "BLOCK_ELEMENTS", 7)
    assert torch.equal(detmath.det_matmul(g, g.transpose(-1, -2)), sym)


def test_windowed_greedylore_follows_a_plain_reference() -> None:
    """Three peers, τ = 3, six windows: full rounds send G (bf16) and the basis becomes the
    eigenvectors of Ḡ Ḡ^T; projected rounds send R = P^T G with E ← G − P R, and the next
    window's columns are the Top-r of the mean sketch squared; the mean is P R̄ (clipped)."""
    run, rank = _run(), 3
    peers = [make_strategy(run, SPEC) for _ in range(3)]
    validator = make_strategy(run, SPEC)
    basis = _basis(validator)
    ref_e = [{n: torch.zeros(_work(n, torch.zeros(SHAPES[n])).shape) for n in MATRICES}
             for _ in peers]  # fmt: skip
    for window in range(6):
        full = window % 3 == 0
        assert basis.full_round == full
        projectors = {n: basis.projector(n).double() for n in MATRICES}
        updates = {}
        for uid, (peer, e) in enumerate(zip(peers, ref_e, strict=True)):
            deltas = _deltas(10 * window + uid)
            data = peer.format.to_bytes(
                peer.encoder.encode(deltas, window), {"window": window}, None
            )
            updates[uid] = (
                make_strategy(run, SPEC).format.decode(data, peer.format.max_update_bytes()).tensors
            )
            for piece in updates[uid]:
                if piece.name not in MATRICES:
                    assert isinstance(piece, SparseTensor)  # 1-D and embeddings: SparseLoCo
                    continue
                n = piece.name
                g = e[n] + _work(n, deltas[n])
                if full:
                    assert torch.equal(piece.values, to_wire_precision(g, "bf16", 1e6))
                    e[n] = g - piece.values
                else:
                    p = projectors[n]
                    assert piece.values.shape == (rank, g.shape[1])
                    torch.testing.assert_close(piece.values.double(), p.T @ g.double(),
                                               rtol=1e-2, atol=1e-3)  # fmt: skip
                    e[n] = (g.double() - p @ piece.values.double()).float()
                got = peer.encoder.local_state_dict()[n]
                torch.testing.assert_close(_work(n, got), e[n], rtol=0, atol=1e-5)
        norms = {u: validator.format.norm(up) for u, up in updates.items()}
        median = sorted(norms.values())[1]
        factors = {u: min(1.0, median / norms[u]) for u in updates}
        count = sum(min(n, median) / median for n in norms.values())  # min(norm, B)/B each
        mean = validator.aggregator.mean(updates)
        sums = {n: sum(factors[u] * next(p for p in up if p.name == n).values.double()
                       for u, up in updates.items()) / count for n in MATRICES}  # fmt: skip
        for n in MATRICES:
            ref = sums[n] if full else projectors[n] @ sums[n]
            torch.testing.assert_close(_work(n, mean[n]).double(), ref, rtol=1e-5, atol=1e-7)
        validator.outer.receive(mean, window)
        validator.outer.advance(_Named())
        for peer in peers:
            peer.outer.load_state_dict(validator.outer.state_dict())
        for n in MATRICES:
            u = basis._basis[n].double()
            if full:  # the new basis: eigenvectors of the aggregate's Gram matrix, descending
                sym = sums[n] @ sums[n].T
                d = u.T @ sym @ u
                torch.testing.assert_close(d, torch.diag(torch.diagonal(d)), rtol=0, atol=1e-6)
                assert bool((torch.diff(torch.diagonal(d)) <= 1e-9).all())
                assert basis._select[n].tolist() == list(range(rank))
            else:
                lam = sum(factors[u_] * next(p for p in up if p.name == n).sketch.double()
                          for u_, up in updates.items()) / count  # fmt: skip
                top = sorted(torch.argsort(-(lam**2), stable=True)[:rank].tolist())
                assert basis._select[n].tolist() == top


def test_outer_state_restores_the_basis_and_refuses_nonsense() -> None:
    run = _run()
    a, b = make_strategy(run, SPEC), make_strategy(run, SPEC)
    assert a.outer.state_dict() == {}
    ups = {u: make_strategy(run, SPEC).encoder.encode(_deltas(u), 0) for u in range(2)}
    a.outer.receive(a.aggregator.mean(ups), 0)
    a.outer.advance(_Named())
    state = a.outer.state_dict()
    b.outer.load_state_dict(state)
    assert not _basis(b).full_round
    assert all(torch.equal(_basis(a).projector(n), _basis(b).projector(n)) for n in MATRICES)
    assert set(state) == set(a.outer.shapes())
    bad = {
        "duplicate columns": {**state, "select.w": torch.tensor([1.0, 1.0, 2.0])},
        "column out of range": {**state, "select.w": torch.tensor([0.0, 1.0, 99.0])},
        "phase outside the cycle": {**state, "phase": torch.tensor([3.0])},
        "non-finite basis": {**state, "basis.w": torch.full((12, 12), math.nan)},
        "missing key": {k: v for k, v in state.items() if k != "basis.t"},
    }
    for name, s in bad.items():
        with pytest.raises(ValueError):
            b.outer.load_state_dict(s)
        assert name


def test_validation_refuses_the_wrong_round_kind_and_values_out_of_bounds() -> None:
    run = _run()
    peer, validator = make_strategy(run, SPEC), make_strategy(run, SPEC)
    full = peer.encoder.encode(_deltas(1), 0)
    validator.aggregator.mean({0: full})  # a full round: fine
    validator.outer.receive(validator.aggregator.mean({0: full}), 0)
    validator.outer.advance(_Named())
    with pytest.raises(DecodeError, match="other kind of round"):
        validator.aggregator.mean({0: full})
    peer.outer.load_state_dict(validator.outer.state_dict())
    projected = peer.encoder.encode(_deltas(2), 1)
    validator.aggregator.mean({0: projected})
    w = next(p for p in projected if p.name == "w")
    for change in ({"values": w.values * math.inf}, {"values": w.values[:2]},
                   {"values": w.values + 2e6}, {"sketch": w.sketch[:3]}):  # fmt: skip
        forged = [lowrank.Projected(**{**p.__dict__, **change}) if p is w else p for p in projected]
        with pytest.raises(DecodeError):
            validator.aggregator.mean({0: forged})


def test_select_now_takes_this_windows_sketches() -> None:
    run = _run()
    a = greedylore_variant(run, SPEC, NowBasis)
    basis = _basis(a)
    assert isinstance(basis, NowBasis) and isinstance(a.encoder, LowRankEncoder)
    a.outer.receive(a.aggregator.mean({0: a.encoder.encode(_deltas(1), 0)}), 0)
    a.outer.advance(_Named())
    sketch = a.encoder.sketches(_deltas(2))
    basis.select(sketch)
    for n in MATRICES:
        top = sorted(torch.argsort(-(sketch[n].double() ** 2), stable=True)[:3].tolist())
        assert basis._select[n].tolist() == top
    before = {n: basis._select[n].clone() for n in MATRICES}
    a.outer.receive(
        a.aggregator.mean({0: a.encoder.encode(_deltas(3), 1)}), 1
    )  # no lagged selection
    a.outer.advance(_Named())
    assert all(torch.equal(basis._select[n], before[n]) for n in MATRICES)


# -- the wire -----------------------------------------------------------------------------


def _good(run: RunConfig, full: bool = False) -> bytes:
    peer = make_strategy(run, SPEC)
    if not full:  # after a full round: a projected one
        peer.outer.receive(peer.aggregator.mean({0: peer.encoder.encode(_deltas(3), 0)}), 0)
        peer.outer.advance(_Named())
    return peer.format.to_bytes(peer.encoder.encode(_deltas(4), 1), {"window": 1}, None)


_parts = partial(tampering.split, lowrank.FRAME)
_reframe = partial(tampering.reframe, lowrank.FRAME)
_decode = partial(tampering.decode, SPEC)


def test_the_encoder_refuses_pieces_out_of_order_or_of_two_round_kinds() -> None:
    run = _run()
    fresh, later = make_strategy(run, SPEC), make_strategy(run, SPEC)
    full = fresh.encoder.encode(_deltas(4), 0)  # the first round is a full one
    later.outer.receive(later.aggregator.mean({0: later.encoder.encode(_deltas(3), 0)}), 0)
    later.outer.advance(_Named())
    projected = later.encoder.encode(_deltas(4), 1)
    names = [p.name for p in projected]
    w, t = names.index("w"), names.index("t")
    swapped = list(projected)  # two projected matrices swapped, the sparse rest in order
    swapped[w], swapped[t] = projected[t], projected[w]
    with pytest.raises(ValueError, match=r"^an update must carry every tensor of the spec"):
        lowrank.encode_lowrank(swapped, SPEC, run.codec, "bf16", 3)
    mixed = [full[w] if i == w else p for i, p in enumerate(projected)]
    with pytest.raises(ValueError, match="one round kind"):
        lowrank.encode_lowrank(mixed, SPEC, run.codec, "bf16", 3)


def test_hostile_greedylore_bytes_raise_decode_error_quickly() -> None:
    run = _run()
    good, full = _good(run), _good(run, full=True)
    _decode(run, good)
    _decode(run, full)
    header, payload = _parts(good)
    sparse_part, dense_part = payload[: header["sparse_bytes"]], payload[header["sparse_bytes"] :]
    signed_sparse = wire.with_signature(sparse_part, b"\x01" * 64)
    sparse = make_strategy(run.model_copy(update={"strategy": "sparseloco"}), SPEC)
    corpus = {
        "truncated": good[:-5],
        "extra byte": good + b"\x00",
        "claims a full round": _reframe({**header, "full": True}, payload),
        "other rank": _reframe({**header, "rank": 4}, payload),
        "other spec": _reframe({**header, "spec_digest": "0" * 32}, payload),
        "parts' lengths lie": _reframe(
            {
                **header,
                "sparse_bytes": header["sparse_bytes"] + 1,
                "dense_bytes": header["dense_bytes"] - 1,
            },
            payload,
        ),
        "parts swapped": _reframe(
            {**header, "sparse_bytes": len(dense_part), "dense_bytes": len(sparse_part)},
            dense_part + sparse_part,
        ),
        "a signed part": _reframe(
            {**header, "sparse_bytes": len(signed_sparse)}, signed_sparse + dense_part
        ),
        "extra header field": _reframe({**header, "evil": 1}, payload),
        "a sparseloco update": sparse.format.to_bytes(
            sparse.encoder.encode(_deltas(4), 0), {}, None
        ),
        "flipped payload bit": good[:-30] + bytes([good[-30] ^ 8]) + good[-29:],
    }
    tampering.assert_refused_quickly(corpus, partial(_decode, run))
    rules = {  # the rule that refuses each case (a later rule may not stand in)
        "truncated": "parts disagree",
        "extra byte": "parts disagree",
        "other rank": "rank 4, the run sends rank 3",
        "other spec": "another model spec",
        "a signed part": "meta or signature",
        "flipped payload bit": "low-rank payload digest",
        "another codec version": "codec version",
        "non-canonical header": "canonical form",
    }
    corpus["another codec version"] = _reframe(
        {**header, "codec_version": header["codec_version"] + 1}, payload
    )
    corpus["non-canonical header"] = _reframe(dict(reversed(list(header.items()))), payload)
    for name, rule in rules.items():
        with pytest.raises(DecodeError, match=rule):
            _decode(run, corpus[name])
            pytest.fail(name)
