"""`codec.pool.AggregatePool`: real worker processes decode their share of the tensors of each
update as it lands; the mean is `codec.aggregate.aggregate` (median-clipped) bit for bit for any
number of workers and any arrival order, malformed updates are reported and left out, and the
reused buffers carry nothing from one window into the next."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from codec import wire
from codec.aggregate import aggregate
from codec.compress import Compressor, SparseTensor
from codec.pool import AggregatePool, deal
from codec.spec import CodecParams, ModelSpec
from lab.bench.compress import student_t3
from tests.support.sparse_pieces import as_sparse

SPEC = ModelSpec.from_shapes(
    {"q": (96, 80), "up": (200, 96), "down": (96, 200), "norm": (80,), "conv": (3, 5, 7)}
)
PARAMS = CodecParams(tile=16, k=8, max_abs_value=2.0**64)
CAP = 1 << 22


def _updates(seed: int, peers: int = 6) -> dict[int, bytes]:
    """Wire bytes per uid; scales far apart, so float32 sums in another order round otherwise."""
    comp = Compressor(SPEC, PARAMS)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for uid in range(peers):
        sparse = [
            comp.compress(t.name, student_t3(t.shape, gen) * 10.0 ** (uid % 4 - 2), 0.9)
            for t in SPEC.tensors
        ]
        out[uid * 3 + 1] = wire.encode_update(sparse, PARAMS, SPEC, sign=lambda _d: bytes(64))
    return out


def _want(datas: dict[int, bytes]) -> dict[str, torch.Tensor]:
    decoded = {
        u: as_sparse(wire.decode_update(d, SPEC, PARAMS, CAP).tensors) for u, d in datas.items()
    }
    return aggregate(decoded, SPEC, PARAMS, clip_to_median=True)


def _mean(pool: AggregatePool, datas: dict[int, bytes], order: list[int]) -> dict:
    pool.reset()
    for uid in order:
        pool.add(uid, datas[uid])
    mean, rejected = pool.mean()
    return {"mean": {n: t.clone() for n, t in mean.items()}, "rejected": rejected}


@pytest.fixture(scope="module")
def pools() -> Iterator[dict[int, AggregatePool]]:
    made = {w: AggregatePool(SPEC, PARAMS, w, CAP) for w in (1, 2, 3)}
    yield made
    for pool in made.values():
        pool.close()


def test_any_worker_count_and_arrival_order_gives_the_aggregate(pools: dict) -> None:
    datas = _updates(0)
    want = _want(datas)
    # the test can fail: summed in arrival order, the mean's bits differ
    decoded = {
        u: as_sparse(wire.decode_update(d, SPEC, PARAMS, CAP).tensors) for u, d in datas.items()
    }
    arrival = list(datas)[::-1]
    renamed = {rank: decoded[uid] for rank, uid in enumerate(arrival)}
    other = aggregate(renamed, SPEC, PARAMS, clip_to_median=True)
    assert any(not torch.equal(other[n], want[n]) for n in want)
    for workers, pool in pools.items():
        for seed in range(2):
            order = list(datas)
            random.Random(seed).shuffle(order)
            got = _mean(pool, datas, order)
            assert got["rejected"] == {}
            for name in want:
                assert torch.equal(got["mean"][name], want[name]), (workers, seed, name)


def test_a_malformed_update_is_reported_and_left_out(pools: dict) -> None:
    datas = _updates(1, peers=4)
    bad = bytearray(datas[4])
    bad[-40] ^= 0x10  # inside the payload: its digest no longer matches
    datas[4] = bytes(bad)
    want = _want({u: d for u, d in datas.items() if u != 4})
    good = [u for u in datas if u != 4]
    for pool in pools.values():  # one worker checks each digest: whichever, it is refused
        for at in range(len(datas)):
            got = _mean(pool, datas, [*good[:at], 4, *good[at:]])
            assert list(got["rejected"]) == [4]
            assert "digest" in str(got["rejected"][4])
            for name in want:
                assert torch.equal(got["mean"][name], want[name]), name


def test_a_window_starts_from_zero_and_uids_are_not_added_twice(pools: dict) -> None:
    pool = pools[2]
    _mean(pool, _updates(2), list(_updates(2)))
    datas = _updates(3, peers=2)
    got = _mean(pool, datas, list(datas))
    want = _want(datas)
    for name in want:
        assert torch.equal(got["mean"][name], want[name]), name
    with pytest.raises(ValueError, match="already added"):
        pool.add(1, datas[1])
    pool.reset()
    empty, rejected = pool.mean()
    assert rejected == {} and all(not t.any() for t in empty.values())


def test_tensors_are_dealt_evenly_and_once() -> None:
    from codec.chunking import ChunkLayout

    size = {t.name: ChunkLayout.for_shape(t.shape, PARAMS).n_values for t in SPEC.tensors}
    shares = deal(SPEC, PARAMS, 3)
    assert sorted(n for share in shares for n in share) == sorted(size)
    loads = [sum(size[n] for n in share) for share in shares]
    assert max(loads) - min(loads) <= max(size.values())  # greedy: within one tensor
    assert deal(SPEC, PARAMS, 8)[7] == []  # more workers than tensors: some idle
    with pytest.raises(ValueError, match="workers"):
        AggregatePool(SPEC, PARAMS, 0, CAP)


def test_the_mean_of_some_of_the_updates_and_rejections_before_it(pools: dict) -> None:
    datas = _updates(4, peers=5)
    bad = bytearray(datas[7])
    bad[-40] ^= 0x10
    datas[7] = bytes(bad)
    pool = pools[3]
    pool.reset()
    for uid in datas:
        pool.add(uid, datas[uid])
    assert list(pool.rejected()) == [7]  # known before any mean, from the workers' decodes
    some = [13, 4, 7]
    mean, rejected = pool.mean(some)
    assert list(rejected) == [7]
    want = _want({u: datas[u] for u in (4, 13)})
    for name in want:
        assert torch.equal(mean[name], want[name]), name
    with pytest.raises(ValueError, match="not added"):
        pool.mean([4, 99])


def test_a_worker_keeps_positions_in_two_bytes_and_sums_them_alike() -> None:
    from codec.compress import scatter_add
    from codec.pool import _compact

    (piece,) = [p for p in wire.decode_update(_updates(5, 1)[1], SPEC, PARAMS, CAP).tensors][:1]
    assert isinstance(piece, SparseTensor)
    small = _compact(piece, PARAMS)
    assert all(g.idx.dtype == torch.int16 for g in small.groups)  # 3 B per entry, not 9
    assert all(
        torch.equal(g.idx, h.idx.long()) for g, h in zip(piece.groups, small.groups, strict=True)
    )
    a, b = torch.zeros(piece.shape), torch.zeros(piece.shape)
    scatter_add(a, piece, PARAMS, 0.3)
    scatter_add(b, small, PARAMS, 0.3)
    assert torch.equal(a, b) and a.abs().sum() > 0


def test_workers_count_each_coordinates_support_like_the_aggregate() -> None:
    """``outer.min_support`` = 2 in a worker: the aggregate's mean bit for bit, which is not the
    mean without it (a worker counts the support of the tensors it owns, so one is enough)."""
    datas = _updates(2)
    decoded = {
        u: as_sparse(wire.decode_update(d, SPEC, PARAMS, CAP).tensors) for u, d in datas.items()
    }
    want = aggregate(decoded, SPEC, PARAMS, clip_to_median=True, min_support=2)
    assert any(not torch.equal(want[n], t) for n, t in _want(datas).items())
    with AggregatePool(SPEC, PARAMS, 1, CAP, min_support=2) as pool:
        got = _mean(pool, datas, list(datas)[::-1])
    for name in want:
        assert torch.equal(got["mean"][name], want[name]), name
