"""Error feedback and exact chunked Top-k (Algorithm 1, lines 14-16; EF freeze, Appendix E)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from codec.chunking import ChunkLayout
from codec.compress import Compressor, SparseGroup, SparseTensor, densify, topk_rows
from codec.errors import DecodeError
from codec.spec import CodecParams, ModelSpec

SHAPES = {"emb": (70, 130), "proj": (64, 128), "norm": (300,), "conv": (5, 3, 7)}
PARAMS = CodecParams(tile=16, k=8)
BETA = 0.95


def reference_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Naive Top-k by |x|: stable sort descending (ties: lowest position first), then ascending."""
    order = torch.sort(x.abs(), dim=1, descending=True, stable=True).indices[:, :k]
    return order.sort(dim=1).values


def _matrix(kind: str, n: int, c: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "normal":
        return torch.randn(n, c, generator=gen)
    if kind == "heavy":
        return torch.randn(n, c, generator=gen) / torch.rand(n, c, generator=gen).add(1e-4)
    if kind == "ties":
        return torch.randint(-3, 4, (n, c), generator=gen).float()
    x = torch.zeros(n, c)  # "sparse": mostly zeros, some rows entirely
    x[::3, : max(1, c // 5)] = torch.randn(len(range(0, n, 3)), max(1, c // 5), generator=gen)
    return x


@settings(max_examples=120, deadline=None)
@given(
    st.integers(1, 40),
    st.integers(1, 600),
    st.floats(0.0, 1.0),
    st.sampled_from(["normal", "heavy", "ties", "sparse"]),
    st.integers(0, 2**31 - 1),
)
def test_topk_matches_naive_reference(n: int, c: int, frac: float, kind: str, seed: int) -> None:
    k = max(1, round(frac * c))
    x = _matrix(kind, n, c, torch.Generator().manual_seed(seed))
    pos, vals = topk_rows(x, k)
    assert torch.equal(pos, reference_topk(x, k))
    assert torch.equal(vals, torch.gather(x, 1, pos))


@pytest.mark.parametrize("kind", ["normal", "heavy", "ties", "sparse"])
@pytest.mark.parametrize(("c", "k"), [(4096, 64), (4096, 128), (1088, 17), (4096, 1)])
def test_topk_matches_reference_on_codec_sizes(kind: str, c: int, k: int) -> None:
    x = _matrix(kind, 64, c, torch.Generator().manual_seed(c + k))
    assert torch.equal(topk_rows(x, k)[0], reference_topk(x, k))


def _deltas(seed: int, scale: float = 1e-3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) * scale for n, s in SHAPES.items()}


def _compressor() -> Compressor:
    return Compressor(ModelSpec.from_shapes(SHAPES), PARAMS, block_elements=1024)


def _selected(sparse: SparseTensor) -> list[torch.Tensor]:
    return [g.idx for g in sparse.groups]


def test_ef_identity_and_exact_topk_over_steps() -> None:
    comp = _compressor()
    for step in range(4):
        for name, delta in _deltas(step).items():
            before = comp.error(name)
            expected = torch.add(delta, before, alpha=BETA)  # beta * e + delta, in float32
            sparse = comp.compress(name, delta, BETA)
            sparse.validate(PARAMS)
            sent = densify(sparse, PARAMS)
            after = comp.error(name)
            # a few float32 ulps: the subtraction and re-addition round, and a strided add may
            # fuse the multiply-add where the contiguous reference does not
            tol = float(expected.abs().max()) * 4e-7
            torch.testing.assert_close(after + sent, expected, rtol=0, atol=tol)
            # untouched entries did not move at all; sent entries are the exact Top-k of e
            layout = ChunkLayout.for_shape(delta.shape, PARAMS)
            for got, rows, g in zip(
                _selected(sparse), layout.split(expected), layout.groups, strict=True
            ):
                assert torch.equal(got, reference_topk(rows, g.k))
            untouched = sent == 0
            torch.testing.assert_close(after[untouched], expected[untouched], rtol=0, atol=tol)


def test_quantization_error_stays_in_the_buffer() -> None:
    comp = _compressor()
    delta = _deltas(11)["proj"]
    sparse = comp.compress("proj", delta, BETA)
    residual = comp.error("proj")
    layout = sparse.layout(PARAMS)
    for gi, g in enumerate(sparse.groups):
        flat = layout.flat_positions(gi, g.idx)
        # what is left is the 2-bit rounding error: small next to the value itself
        left = residual.view(-1)[flat]
        orig = delta.view(-1)[flat]
        assert float(left.square().sum()) < 0.1 * float(orig.square().sum())
        assert float(left.abs().max()) > 0


def test_freeze_compresses_delta_and_leaves_buffer() -> None:
    frozen, fresh = _compressor(), _compressor()
    for name, delta in _deltas(3).items():
        a = frozen.compress(name, delta, BETA, freeze=True)
        b = fresh.compress(name, delta, BETA)  # e == 0, so beta * e + delta == delta
        for ga, gb in zip(a.groups, b.groups, strict=True):
            assert torch.equal(ga.idx, gb.idx)
            assert torch.equal(ga.codes, gb.codes) and torch.equal(ga.scales, gb.scales)
        assert torch.equal(a.codebook, b.codebook)
        assert not frozen.error(name).any()
        assert fresh.error(name).any()
    # with a non-empty buffer, freezing neither uses nor changes it
    before = fresh.error("emb")
    delta = _deltas(4)["emb"]
    c = fresh.compress("emb", delta, BETA, freeze=True)
    assert torch.equal(fresh.error("emb"), before)
    d = _compressor().compress("emb", delta, BETA)
    assert all(torch.equal(x.idx, y.idx) for x, y in zip(c.groups, d.groups, strict=True))


def test_state_dict_round_trip() -> None:
    comp = _compressor()
    for step in range(2):
        for name, delta in _deltas(step).items():
            comp.compress(name, delta, BETA)
    state = comp.state_dict()
    assert {n: tuple(t.shape) for n, t in state.items()} == SHAPES
    restored = _compressor()
    restored.load_state_dict(state)
    for name, delta in _deltas(9).items():
        a = comp.compress(name, delta, BETA)
        b = restored.compress(name, delta, BETA)
        assert torch.equal(densify(a, PARAMS), densify(b, PARAMS))
        assert torch.equal(comp.error(name), restored.error(name))
    with pytest.raises(ValueError):
        restored.load_state_dict({k: v for k, v in state.items() if k != "norm"})
    with pytest.raises(ValueError):
        restored.load_state_dict({**state, "norm": torch.zeros(301)})
    with pytest.raises(ValueError):
        restored.load_state_dict({**state, "norm": torch.full((300,), float("nan"))})


def test_bad_delta_is_rejected_before_any_change() -> None:
    comp = _compressor()
    comp.compress("proj", _deltas(0)["proj"], BETA)
    before = comp.error("proj")
    bad = _deltas(1)["proj"]
    bad[3, 4] = float("nan")
    with pytest.raises(ValueError):
        comp.compress("proj", bad, BETA)
    bad[3, 4] = float("inf")
    with pytest.raises(ValueError):
        comp.compress("proj", bad, BETA)
    with pytest.raises(ValueError):
        comp.compress("proj", torch.zeros(64, 127), BETA)
    with pytest.raises(ValueError):
        comp.compress("proj", _deltas(1)["proj"], float("nan"))
    with pytest.raises(KeyError):
        comp.compress("nope", torch.zeros(3), BETA)
    assert torch.equal(comp.error("proj"), before)


def test_compress_all_checks_everything_first() -> None:
    comp, ref = _compressor(), _compressor()
    deltas = _deltas(6)
    sent = comp.compress_all(deltas, BETA)
    assert [s.name for s in sent] == list(SHAPES)
    for s in sent:
        r = ref.compress(s.name, deltas[s.name], BETA)
        assert torch.equal(densify(s, PARAMS), densify(r, PARAMS))
    state = comp.state_dict()
    bad = {**_deltas(7), "norm": torch.full((300,), float("nan"))}
    with pytest.raises(ValueError):
        comp.compress_all(bad, BETA)
    with pytest.raises(ValueError):
        comp.compress_all({"emb": deltas["emb"]}, BETA)
    assert all(torch.equal(state[n], comp.error(n)) for n in SHAPES)


def test_blocking_does_not_change_the_result() -> None:
    small = Compressor(ModelSpec.from_shapes(SHAPES), PARAMS, block_elements=1)
    large = Compressor(ModelSpec.from_shapes(SHAPES), PARAMS, block_elements=1 << 22)
    for step in range(2):
        for name, delta in _deltas(step).items():
            a, b = small.compress(name, delta, BETA), large.compress(name, delta, BETA)
            assert torch.equal(densify(a, PARAMS), densify(b, PARAMS))
            assert torch.equal(small.error(name), large.error(name))


def test_accepts_bfloat16_delta() -> None:
    comp = _compressor()
    delta = _deltas(5)["norm"]
    sparse = comp.compress("norm", delta.bfloat16(), BETA)
    expected = delta.bfloat16().float()
    torch.testing.assert_close(
        comp.error("norm") + densify(sparse, PARAMS), expected, rtol=0, atol=1e-9
    )


def test_validate_rejects_malformed_sparse() -> None:
    comp = _compressor()
    good = comp.compress("emb", _deltas(0)["emb"], BETA)
    good.validate(PARAMS)

    def with_group(gi: int, **change: torch.Tensor) -> SparseTensor:
        groups = list(good.groups)
        g = groups[gi]
        groups[gi] = SparseGroup(
            idx=change.get("idx", g.idx),
            codes=change.get("codes", g.codes),
            scales=change.get("scales", g.scales),
        )
        return SparseTensor(good.name, good.shape, groups, good.codebook)

    idx = good.groups[0].idx
    cases = [
        with_group(0, idx=idx.flip(1)),
        with_group(0, idx=idx + PARAMS.chunk_size),
        with_group(0, idx=idx - idx[:, :1] - 1),
        with_group(0, idx=idx.int()),
        with_group(0, idx=idx[:, :-1]),
        with_group(0, codes=good.groups[0].codes[:-1]),
        with_group(1, codes=good.groups[1].codes | 4),
        SparseTensor(good.name, good.shape, good.groups[:-1], good.codebook),
        SparseTensor(good.name, good.shape, good.groups, good.codebook * float("nan")),
        SparseTensor(good.name, (0, 3), good.groups, good.codebook),
    ]
    for bad in cases:
        with pytest.raises(DecodeError):
            bad.validate(PARAMS)
