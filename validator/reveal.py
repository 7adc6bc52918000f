"""Commit–reveal of the samples the validator scores on: unknown before the deadline, checkable after.

Everything about the training assignment is public (`node.data.sampling`), so a sample set drawn
from public values alone (run id, window, a fixed purpose) is known to every peer before the
window starts: a peer could fit the validator's "random" batch, or train only on the part of its
assignment that gets scored. Here the draw depends on a secret the validator commits to first:

* the validator keeps one 32-byte ``reveal_key`` in its state (`validator.state`, saved atomically,
  so a restart derives the same secrets) and derives the secret of window ``w``:
  ``secret_w = BLAKE2b-256(key=reveal_key, "{run_id}/{w}")``;
* before window ``w`` opens — at start-up for the next `COMMIT_AHEAD` + 1 windows, then after each
  window for the one `COMMIT_AHEAD` windows later — it publishes in its bucket a signed
  `CommitRecord` (`commit_key`) holding ``commit_w = BLAKE2b-256(secret_w)``;
* after the deadline it derives ``seed_w = BLAKE2b-256(run_id, w, secret_w)`` and draws from it
  the random batch (``n_random`` training slots, `random_slots`) and, for every scored peer,
  which ``n_own`` of its ``m = inner_steps * batch_size`` assigned samples are used (`own_slots`);
* the window's score report reveals ``secret_w`` (`SampleReveal`) and lists the slots; anyone
  recomputes them with `verify_reveal` / `verify_report_samples`, which refuse a secret that
  does not hash to its commitment, or slots that do not follow from it.

Before the reveal a peer holds the commitment (a hash: it says nothing about the seed) and every
public value, and still cannot compute a single drawn slot. A validator could leak its secret to
a colluding peer, but a validator that wants to favour a peer can simply give it weight, so a chain
beacon mixed into the seed would buy nothing here.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from substrateinterface import Keypair

from codec.errors import TesseraError
from node.data.dataset import Dataset
from node.data.sampling import SlotPermutation, assigned_slots, eval_slots, sampling_key
from protocol.keys import AddressError, ss58_to_public_key
from protocol.naming import run_prefix
from protocol.runconfig import RunConfig
from validator.config import ValidatorConfig

COMMIT_AHEAD = 2
"""Commitments are published this many windows ahead of the window being scored."""

RANDOM_PURPOSE = "validator-random"
_COMMIT_DOMAIN = b"tessera/eval-commit/v1\x00"
_HEX64 = r"^[0-9a-f]{64}$"


class RevealError(TesseraError, ValueError):
    """A revealed secret or a sample list that does not match its commitment."""


def new_reveal_key() -> bytes:
    import secrets

    return secrets.token_bytes(32)


def window_secret(reveal_key: bytes, run_id: str, window: int) -> bytes:
    """The secret of `window` (a keyed BLAKE2b: revealing it says nothing about the others)."""
    if len(reveal_key) != 32:
        raise ValueError("the reveal key is 32 bytes")
    msg = f"{run_id}/{window}".encode()
    return hashlib.blake2b(msg, key=reveal_key, digest_size=32, person=b"tessera-evalsec").digest()


def commitment(secret: bytes) -> str:
    """``commit = BLAKE2b-256(secret)``, hex."""
    return hashlib.blake2b(secret, digest_size=32, person=b"tessera-evalcom").hexdigest()


def sample_seed(run_id: str, window: int, secret: bytes) -> str:
    """The seed every sample draw of the window comes from, hex."""
    return sampling_key("validator-eval", run_id, window, secret.hex()).hex()


def random_slots(dataset: Dataset, run_id: str, window: int, seed: str, n: int) -> np.ndarray:
    """`n` distinct training slots for the random batch of the window."""
    n = min(n, dataset.n_train_slots)
    return eval_slots(dataset, run_id, window, f"{RANDOM_PURPOSE}/{seed}", n, split="train")


def own_slots(
    dataset: Dataset, run: RunConfig, uid: int, window: int, seed: str, n: int
) -> np.ndarray:
    """`n` of peer `uid`'s assigned training slots of `window` (all of them if it has fewer),
    chosen by the seed; in training order."""
    m = run.inner_steps * run.batch_size
    slots = assigned_slots(dataset.n_train_slots, run.run_id, uid, window, m)
    if n >= m:
        return slots
    perm = SlotPermutation(m, sampling_key("validator-own", seed, uid))
    return slots[np.sort(perm(np.arange(n, dtype=np.int64)))]


# -- what is published -----------------------------------------------------------------------------


class SampleReveal(BaseModel):
    """The secret of a window and what it determines (in the window's score report)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    secret: str = Field(pattern=_HEX64)
    commit: str = Field(pattern=_HEX64)
    seed: str = Field(pattern=_HEX64)
    n_random: int = Field(ge=0)
    n_own: int = Field(ge=0)
    random_slots: list[int]


def reveal_for(
    dataset: Dataset, run_id: str, window: int, secret: bytes, n_random: int, n_own: int
) -> SampleReveal:
    seed = sample_seed(run_id, window, secret)
    return SampleReveal(
        secret=secret.hex(),
        commit=commitment(secret),
        seed=seed,
        n_random=n_random,
        n_own=n_own,
        random_slots=random_slots(dataset, run_id, window, seed, n_random).tolist(),
    )


def verify_reveal(
    reveal: SampleReveal, dataset: Dataset, run_id: str, window: int, commit: str | None = None
) -> None:
    """Raise `RevealError` unless the secret hashes to the commitment (`commit`, the one published
    before the window, defaults to the copy in the reveal) and the seed and random slots follow."""
    secret = bytes.fromhex(reveal.secret)
    if commitment(secret) != reveal.commit or (commit is not None and commit != reveal.commit):
        raise RevealError(f"window {window}: the revealed secret does not match its commitment")
    if reveal.seed != sample_seed(run_id, window, secret):
        raise RevealError(f"window {window}: the seed does not follow from the secret")
    want = random_slots(dataset, run_id, window, reveal.seed, reveal.n_random).tolist()
    if reveal.random_slots != want:
        raise RevealError(f"window {window}: the random slots do not follow from the seed")


def verify_own_slots(
    reveal: SampleReveal, dataset: Dataset, run: RunConfig, window: int, uid: int, slots: list[int]
) -> None:
    """Raise `RevealError` unless `slots` are the own samples the seed draws for `uid`."""
    if own_slots(dataset, run, uid, window, reveal.seed, reveal.n_own).tolist() != slots:
        raise RevealError(f"window {window}: uid {uid}'s own slots do not follow from the seed")


class CommitRecord(BaseModel):
    """``commit_w`` as the validator publishes it before window ``w`` (`commit_key`), signed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str
    window: int = Field(ge=0)
    validator_uid: int = Field(ge=0)
    validator_hotkey: str
    commit: str = Field(pattern=_HEX64)
    signature: str = Field(pattern=r"^[0-9a-f]{128}$")

    def message(self) -> bytes:
        body = {k: v for k, v in self.model_dump().items() if k != "signature"}
        return _COMMIT_DOMAIN + json.dumps(body, sort_keys=True).encode()


def commit_key(run_id: str, window: int, uid: int, hotkey: str) -> str:
    """Where a validator publishes `CommitRecord` of `window` (outside `protocol.naming`'s kinds,
    like the run config: history readers skip names they do not parse)."""
    return f"{run_prefix(run_id)}eval-commits/{uid:05d}-{hotkey}/w{window:010d}.json"


def signed_commit(
    keypair: Keypair, run_id: str, window: int, uid: int, reveal_key: bytes
) -> CommitRecord:
    blank = CommitRecord(
        run_id=run_id, window=window, validator_uid=uid, validator_hotkey=keypair.ss58_address,
        commit=commitment(window_secret(reveal_key, run_id, window)), signature="0" * 128,
    )  # fmt: skip
    return blank.model_copy(update={"signature": keypair.sign(blank.message()).hex()})


def verify_commit_record(record: CommitRecord) -> None:
    """Raise `RevealError` unless the record is signed by the hotkey it names."""
    import sr25519

    try:
        public = ss58_to_public_key(record.validator_hotkey)
        ok = sr25519.verify(bytes.fromhex(record.signature), record.message(), public)
    except (AddressError, ValueError, TypeError):
        ok = False
    if ok is not True:
        raise RevealError(f"window {record.window}: commitment signature does not verify")


def window_reveal(
    reveal_key: bytes, dataset: Dataset, run: RunConfig, window: int, cfg: ValidatorConfig
) -> SampleReveal:
    """The reveal of our secret of `window`: the samples we score it on."""
    secret = window_secret(reveal_key, run.run_id, window)
    return reveal_for(dataset, run.run_id, window, secret, cfg.n_random, cfg.n_own)
