"""Which samples a peer trains on, and which ones a validator evaluates on: pure functions.

Training assignment. For window `w` of run `run_id`, the training slots `[0, n_train)` of the
dataset are put in a pseudo-random order by a keyed permutation `P_w` (key = BLAKE2b of
("train", run_id, w)). Peer `uid`, needing `m = n_steps * batch_size` samples per window, gets
positions `uid*m, uid*m + 1, ..., uid*m + m - 1` (mod n_train) of that order; step `s` uses the
positions `s*batch_size ...` of that run. Hence:

- anyone (a validator, an auditor) recomputes exactly which samples a peer had, for any step,
  from (run_id, uid, window, n_steps, batch_size) and the dataset's slot count alone;
- peers are *exactly* disjoint within a window as long as `(max uid + 1) * m ≤ n_train` (always
  the case for production datasets; for the embedded tiny corpus: uids 0..63 at the tiny preset);
- a peer gets fresh, independent samples every window; held-out slots are never assigned;
- a dataset smaller than one peer's need (`m > n_train`) wraps around: the peer sees repeats.

Evaluation samples: `n` distinct slots of a split (held-out by default, or training) chosen by
another keyed permutation (key = ("eval", split, run_id, window, purpose)), so each purpose (e.g.
"loss-before-after", "random-baseline") draws its own independent, reproducible set.

The permutation is a balanced Feistel network over 2·⌈log2(n)/2⌉ bits (8 rounds, a splitmix64
round function, round keys from BLAKE2b) with cycle walking down to [0, n): a true bijection,
evaluated in O(1) per position with numpy, so it never materializes a permutation of a
billion-slot dataset. It is not meant to be a cipher: everyone may compute every assignment.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Literal

import numpy as np
import torch

from node.data.dataset import Dataset

__all__ = [
    "SlotPermutation",
    "assigned_batch",
    "assigned_batches",
    "assigned_slots",
    "eval_batch",
    "eval_slots",
    "sampling_key",
]

Split = Literal["heldout", "train"]

_DOMAIN = b"tessera/sampling/v1\x00"
_ROUNDS = 8
_U64 = np.uint64
_M1, _M2, _GOLDEN = _U64(0xBF58476D1CE4E5B9), _U64(0x94D049BB133111EB), _U64(0x9E3779B97F4A7C15)


def sampling_key(*parts: str | int) -> bytes:
    """A 32-byte key from typed, length-prefixed parts (no two part lists collide)."""
    h = hashlib.blake2b(_DOMAIN, digest_size=32)
    for part in parts:
        if isinstance(part, bool) or not isinstance(part, str | int):
            raise TypeError(f"sampling key parts must be str or int, got {type(part).__name__}")
        data = (b"s" if isinstance(part, str) else b"i") + str(part).encode("utf-8")
        h.update(len(data).to_bytes(4, "little"))
        h.update(data)
    return h.digest()


def _mix(x: np.ndarray, k: np.uint64) -> np.ndarray:
    z = (x ^ k) * _GOLDEN
    z = (z ^ (z >> _U64(30))) * _M1
    z = (z ^ (z >> _U64(27))) * _M2
    return z ^ (z >> _U64(31))


class SlotPermutation:
    """A keyed bijection of `[0, n)` (Feistel network with cycle walking)."""

    def __init__(self, n: int, key: bytes) -> None:
        if n < 1:
            raise ValueError("a permutation needs a non-empty domain")
        self.n = n
        self._half = max(1, ((n - 1).bit_length() + 1) // 2)
        self._mask = _U64((1 << self._half) - 1)
        digest = hashlib.blake2b(key, digest_size=8 * _ROUNDS, person=b"tessera-feistel").digest()
        self._keys = [
            _U64(int.from_bytes(digest[8 * i : 8 * i + 8], "little")) for i in range(_ROUNDS)
        ]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        half = _U64(self._half)
        left, right = x >> half, x & self._mask
        for k in self._keys:
            left, right = right, left ^ (_mix(right, k) & self._mask)
        return (left << half) | right

    def __call__(self, positions: Sequence[int] | np.ndarray) -> np.ndarray:
        """The images of `positions` (each in `[0, n)`) as an int64 array."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= self.n):
            raise ValueError(f"positions must lie in [0, {self.n})")
        out = self._encrypt(pos.astype(np.uint64))
        outside = out >= _U64(self.n)
        while outside.any():  # cycle walking; on average fewer than 4 passes
            out[outside] = self._encrypt(out[outside])
            outside = out >= _U64(self.n)
        return out.astype(np.int64)


def _check_ids(uid: int, window: int) -> None:
    if uid < 0 or window < 0:
        raise ValueError("uid and window must be non-negative")


def assigned_slots(
    n_train_slots: int, run_id: str, uid: int, window: int, n_samples: int
) -> np.ndarray:
    """The `n_samples` training slots of peer `uid` in `window`, in training order (int64)."""
    _check_ids(uid, window)
    if n_samples < 0:
        raise ValueError("n_samples must be non-negative")
    perm = SlotPermutation(n_train_slots, sampling_key("train", run_id, window))
    start = (uid * n_samples) % n_train_slots
    return perm((start + np.arange(n_samples, dtype=np.int64)) % n_train_slots)


def assigned_batch(
    dataset: Dataset,
    run_id: str,
    uid: int,
    window: int,
    step: int,
    *,
    n_steps: int,
    batch_size: int,
) -> torch.Tensor:
    """The `(batch_size, seq_len + 1)` LongTensor peer `uid` trains on at inner `step`."""
    if not 0 <= step < n_steps:
        raise ValueError(f"step {step} outside [0, {n_steps})")
    slots = assigned_slots(dataset.n_train_slots, run_id, uid, window, n_steps * batch_size)
    return dataset.read_slots(slots[step * batch_size : (step + 1) * batch_size])


def assigned_batches(
    dataset: Dataset, run_id: str, uid: int, window: int, n_steps: int, batch_size: int
) -> Iterator[torch.Tensor]:
    """The `n_steps` batches `(batch_size, seq_len + 1)` of peer `uid` in `window`, in order."""
    slots = assigned_slots(dataset.n_train_slots, run_id, uid, window, n_steps * batch_size)
    for step in range(n_steps):
        yield dataset.read_slots(slots[step * batch_size : (step + 1) * batch_size])


def eval_slots(
    dataset: Dataset, run_id: str, window: int, purpose: str, n: int, split: Split = "heldout"
) -> np.ndarray:
    """`n` distinct global slots of `split`, drawn for (run_id, window, purpose)."""
    _check_ids(0, window)
    if split == "heldout":
        base, size = dataset.n_train_slots, dataset.n_heldout_slots
    elif split == "train":
        base, size = 0, dataset.n_train_slots
    else:
        raise ValueError(f"unknown split {split!r}")
    if not 0 <= n <= size:
        raise ValueError(f"cannot draw {n} distinct samples from the {size} {split} slots")
    perm = SlotPermutation(size, sampling_key("eval", split, run_id, window, purpose))
    return base + perm(np.arange(n, dtype=np.int64))


def eval_batch(
    dataset: Dataset, run_id: str, window: int, purpose: str, n: int, split: Split = "heldout"
) -> torch.Tensor:
    """A `(n, seq_len + 1)` LongTensor of evaluation samples (see `eval_slots`)."""
    return dataset.read_slots(eval_slots(dataset, run_id, window, purpose, n, split))
