"""Sample assignment and evaluation draws: pure, reproducible, disjoint, never held-out."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from node.data.sampling import (
    SlotPermutation,
    assigned_batch,
    assigned_batches,
    assigned_slots,
    eval_batch,
    eval_slots,
    sampling_key,
)
from tests.support.embedded_data import TINY, tiny_dataset

RUN = TINY.run_id
STEPS, BATCH = TINY.inner_steps, TINY.batch_size
PER_WINDOW = STEPS * BATCH


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), key=st.binary(min_size=0, max_size=40))
def test_slot_permutation_is_a_bijection(n: int, key: bytes) -> None:
    image = SlotPermutation(n, key)(np.arange(n))
    assert np.array_equal(np.sort(image), np.arange(n))


def test_permutation_depends_on_key_and_handles_huge_domains() -> None:
    a = SlotPermutation(10_000, b"a")(np.arange(100))
    b = SlotPermutation(10_000, b"b")(np.arange(100))
    assert not np.array_equal(a, b)
    huge = SlotPermutation(3 * 10**12, b"k")(np.arange(10_000))
    assert len(np.unique(huge)) == 10_000 and huge.max() < 3 * 10**12 and huge.min() >= 0
    with pytest.raises(ValueError):
        SlotPermutation(10, b"k")([10])


def test_sampling_keys_are_unambiguous() -> None:
    assert sampling_key("ab", "c") != sampling_key("a", "bc")
    assert sampling_key("1") != sampling_key(1)
    with pytest.raises(TypeError):
        sampling_key(1.5)  # type: ignore[arg-type]


def test_assignment_is_a_pure_function() -> None:
    n = tiny_dataset().n_train_slots
    first = assigned_slots(n, RUN, 3, 12, PER_WINDOW)
    assert np.array_equal(first, assigned_slots(n, RUN, 3, 12, PER_WINDOW))
    assert len(first) == PER_WINDOW == len(np.unique(first))
    assert not np.array_equal(first, assigned_slots(n, RUN, 3, 13, PER_WINDOW))  # other window
    other_run = "0" * 32
    assert not np.array_equal(first, assigned_slots(n, other_run, 3, 12, PER_WINDOW))


def test_peers_are_disjoint_within_a_window() -> None:
    n = tiny_dataset().n_train_slots
    uids = range(n // PER_WINDOW)  # every uid that fits: 64 at the tiny preset
    for window in (0, 1, 57):
        slots = np.concatenate([assigned_slots(n, RUN, uid, window, PER_WINDOW) for uid in uids])
        assert len(np.unique(slots)) == len(slots)


def test_held_out_slots_are_never_assigned() -> None:
    dataset = tiny_dataset()
    for window in range(20):
        for uid in (0, 1, 7, 63, 255, 4095):
            slots = assigned_slots(dataset.n_train_slots, RUN, uid, window, PER_WINDOW)
            assert slots.max() < dataset.n_train_slots
            assert not any(dataset.is_heldout(int(s)) for s in slots)


def test_validator_reproduces_a_peers_batches() -> None:
    dataset = tiny_dataset()
    peer_batches = list(assigned_batches(dataset, RUN, 5, 9, STEPS, BATCH))
    assert len(peer_batches) == STEPS
    assert all(b.shape == (BATCH, TINY.seq_len + 1) and b.dtype == torch.long for b in peer_batches)
    for step in (0, 4, STEPS - 1):  # a validator recomputes any step on its own
        again = assigned_batch(dataset, RUN, 5, 9, step, n_steps=STEPS, batch_size=BATCH)
        assert torch.equal(again, peer_batches[step])
    slots = assigned_slots(dataset.n_train_slots, RUN, 5, 9, PER_WINDOW)
    assert torch.equal(dataset.read_slots(slots[:BATCH]), peer_batches[0])
    with pytest.raises(ValueError):
        assigned_batch(dataset, RUN, 5, 9, STEPS, n_steps=STEPS, batch_size=BATCH)


def test_eval_batches_are_reproducible_distinct_and_held_out() -> None:
    dataset = tiny_dataset()
    slots = eval_slots(dataset, RUN, 4, "loss", 64)
    assert np.array_equal(slots, eval_slots(dataset, RUN, 4, "loss", 64))
    assert len(np.unique(slots)) == 64 and all(dataset.is_heldout(int(s)) for s in slots)
    assert not np.array_equal(slots, eval_slots(dataset, RUN, 4, "baseline", 64))
    assert not np.array_equal(slots, eval_slots(dataset, RUN, 5, "loss", 64))
    train = eval_slots(dataset, RUN, 4, "loss", 64, split="train")
    assert train.max() < dataset.n_train_slots
    batch = eval_batch(dataset, RUN, 4, "loss", 16)
    assert batch.shape == (16, TINY.seq_len + 1)
    assert torch.equal(batch, dataset.read_slots(slots[:16]))
    with pytest.raises(ValueError):
        eval_slots(dataset, RUN, 4, "loss", dataset.n_heldout_slots + 1)
