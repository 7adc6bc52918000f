"""The outer step clips chunk by chunk (`codec.aggregate.chunk_clip`, docs/consensus.md "What the
bound is"): an update that puts its whole norm into one chunk, as a targeted change (a backdoor's
few rows) would, moves that chunk no more than an update of the median size there does, however
small its norm is overall; half the set doing it together does not lift the chunk's bound.

Real SparseLoCo updates of the `tiny` codec (64×64 chunks, 256 kept) on a 256×256 tensor (16
chunks): honest updates spread over every chunk, targeted ones with an honest update's whole
norm in chunk 0 and nothing elsewhere, so a bound on whole updates does not clip them at all.
"""

from __future__ import annotations

import pytest
import torch

from codec.chunking import ChunkLayout
from codec.compress import Compressor, SparseTensor, densify
from codec.spec import ModelSpec
from node.strategy import make_strategy
from protocol.runconfig import RunConfig

RUN = RunConfig.preset("tiny", name="chunk-clip")
SHAPE = (256, 256)
SPEC = ModelSpec.from_shapes({"w": SHAPE})
LAYOUT = ChunkLayout.for_shape(SHAPE, RUN.codec)


def _compress(dense: torch.Tensor) -> list[SparseTensor]:
    return [Compressor(SPEC, RUN.codec).compress("w", dense, 0.0, freeze=True)]


def _dense(update: list[SparseTensor]) -> torch.Tensor:
    return densify(update[0], RUN.codec).double()


def _chunk0(t: torch.Tensor) -> torch.Tensor:
    return LAYOUT.split(t)[0][0]


def _updates(honest: int, targeted: int) -> tuple[dict[int, list[SparseTensor]], torch.Tensor]:
    """(updates by uid, the unit direction the targeted ones push in chunk 0)."""
    gen = torch.Generator().manual_seed(honest * 10 + targeted)
    updates = {u: _compress(torch.randn(SHAPE, generator=gen) * 0.01) for u in range(honest)}
    whole = float(_dense(updates[0]).norm())
    aim = torch.zeros(SHAPE)
    LAYOUT.group_view(aim, 0)[0, 0] = torch.randn(64, 64, generator=gen)
    probe = _compress(aim)
    target = _compress(aim * (whole / float(_dense(probe).norm())))
    direction = _chunk0(_dense(target))
    for i in range(targeted):
        updates[honest + i] = target
    return updates, direction / direction.norm()


@pytest.mark.parametrize(("honest", "targeted"), [(4, 1), (2, 2), (3, 2)])
def test_a_targeted_update_moves_its_chunk_no_more_than_the_median_update(
    honest: int, targeted: int
) -> None:
    updates, direction = _updates(honest, targeted)
    n = honest + targeted
    norms = sorted(float(_chunk0(_dense(u)).norm()) for u in updates.values())
    bound = norms[(n - 1) // 2]  # the lower median of chunk 0's norms: an honest one
    target_norm = float(_chunk0(_dense(updates[n - 1])).norm())
    assert target_norm > 3.5 * bound  # the whole norm of an honest update, in one chunk
    mean = make_strategy(RUN, SPEC).aggregator.mean(updates)["w"].double()
    pushed = float(_chunk0(mean) @ direction)
    # each targeted part is clipped to the bound, and more than half the set counts fully
    assert pushed <= targeted * bound / (n / 2) + 0.1 * bound, (pushed, bound)
    # clipping whole updates would have let each in at full size (its norm is honest)
    assert targeted * target_norm / n > 1.5 * (targeted * bound / (n / 2) + 0.1 * bound)


def test_honest_updates_spread_evenly_are_hardly_clipped() -> None:
    """Honest updates of similar size everywhere: the chunk-clipped mean keeps the plain mean's
    direction and length (the defence costs honest training little)."""
    updates, _ = _updates(5, 0)
    plain = torch.stack([_dense(u) for u in updates.values()]).mean(0)
    mean = make_strategy(RUN, SPEC).aggregator.mean(updates)["w"].double()
    cos = float(mean.flatten() @ plain.flatten() / (mean.norm() * plain.norm()))
    ratio = float(mean.norm() / plain.norm())
    assert cos > 0.999 and 0.95 < ratio < 1.05, (cos, ratio)


def test_with_min_support_two_a_lone_update_moves_nothing_only_it_sends() -> None:
    """``outer.min_support`` = 2: the coordinates only the targeted update sends stay where they
    were; those two or more updates send move as without the rule."""
    updates, _ = _updates(4, 1)
    sent = [(_dense(u) != 0) for u in updates.values()]
    alone = sent[-1] & ~torch.stack(sent[:-1]).any(0)  # only the targeted update's
    shared = torch.stack(sent).sum(0) >= 2
    assert int(alone.sum()) > 100 and int(shared.sum()) > 100
    plain = make_strategy(RUN, SPEC).aggregator.mean(updates)["w"]
    assert bool(plain[alone].ne(0).all())  # without the rule it moves them all
    run = RUN.model_copy(update={"outer": RUN.outer.model_copy(update={"min_support": 2})})
    mean = make_strategy(run, SPEC).aggregator.mean(updates)["w"]
    assert bool(mean[alone].eq(0).all()) and bool(mean[~shared].eq(0).all())
    assert torch.equal(mean[shared], plain[shared])
