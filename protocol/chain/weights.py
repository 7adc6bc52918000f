"""Weight vectors: validation, normalisation and the u16 form subtensor stores."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from protocol.chain.errors import InvalidWeights
from protocol.chain.models import MAX_UID

U16_MAX = 65_535
MAX_WEIGHTS = MAX_UID + 1


MAX_VERSION_KEY = 2**64 - 1


def validate_version_key(version_key: object) -> int:
    """The version key of a `set_weights` call: an integer that fits a u64."""
    if (
        isinstance(version_key, bool)
        or not isinstance(version_key, int)
        or not 0 <= version_key <= MAX_VERSION_KEY
    ):
        raise InvalidWeights("version_key must be an integer in [0, 2**64)")
    return version_key


def validate_weights(uids: Sequence[int], weights: Sequence[float]) -> dict[int, float]:
    """Check a weight vector and return it normalised to sum 1, zero entries dropped.

    Raises `InvalidWeights` for mismatched lengths, non-integer, out-of-range or duplicate uids,
    and for weights that are not finite, negative, or all zero.
    """
    uid_list = list(uids)
    weight_list = list(weights)
    if len(uid_list) != len(weight_list):
        raise InvalidWeights(f"{len(uid_list)} uids but {len(weight_list)} weights")
    if len(uid_list) > MAX_WEIGHTS:
        raise InvalidWeights(f"too many weights: {len(uid_list)} > {MAX_WEIGHTS}")
    clean: dict[int, float] = {}
    for uid, weight in zip(uid_list, weight_list, strict=True):
        if isinstance(uid, bool) or not isinstance(uid, int) or not 0 <= uid <= MAX_UID:
            raise InvalidWeights(f"uid {uid!r} is not an integer in [0, {MAX_UID}]")
        if uid in clean:
            raise InvalidWeights(f"duplicate uid {uid}")
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise InvalidWeights(f"weight for uid {uid} is not a number: {weight!r}")
        value = float(weight)
        if not math.isfinite(value) or value < 0.0:
            raise InvalidWeights(f"weight for uid {uid} must be finite and >= 0, got {value!r}")
        clean[uid] = value
    total = math.fsum(clean.values())
    if not total > 0.0:
        raise InvalidWeights("all weights are zero")
    return {uid: value / total for uid, value in clean.items() if value > 0.0}


def to_u16(normalised: Mapping[int, float]) -> tuple[list[int], list[int]]:
    """Max-upscale to u16 as the Bittensor SDK does: the largest weight becomes 65535.

    Entries that round to zero are dropped (the chain would store nothing for them). Uids come out
    sorted so that the call bytes are deterministic.
    """
    if not normalised:
        return [], []
    top = max(normalised.values())
    if not top > 0.0:
        raise InvalidWeights("all weights are zero")
    dests: list[int] = []
    values: list[int] = []
    for uid in sorted(normalised):
        value = round(normalised[uid] / top * U16_MAX)
        if value > 0:
            dests.append(uid)
            values.append(min(value, U16_MAX))
    return dests, values


def normalise_pairs(pairs: Iterable[tuple[int, int]]) -> dict[int, float]:
    """Turn validated (uid, raw) pairs read from chain into weights summing to 1 (or `{}`)."""
    raw: dict[int, int] = {}
    for uid, value in pairs:
        if value > 0:
            raw[uid] = raw.get(uid, 0) + value
    total = sum(raw.values())
    if total <= 0:
        return {}
    return {uid: value / total for uid, value in sorted(raw.items())}
