"""Object names: round trips, prefixes, and strict rejection of anything malformed."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from substrateinterface import Keypair

from protocol.naming import (
    EXTENSIONS,
    MAX_UID,
    MAX_WINDOW,
    NamingError,
    ObjectKind,
    aggregate_key,
    applied_key,
    checkpoint_key,
    fingerprint_key,
    kind_prefix,
    manifest_key,
    object_key,
    parse_key,
    parse_key_expecting,
    run_prefix,
    scores_key,
    update_key,
    window_prefix,
)

RUN = "0123456789abcdef0123456789abcdef"
HOTKEY = Keypair.create_from_seed("0x" + "11" * 32, ss58_format=42).ss58_address
OTHER = Keypair.create_from_seed("0x" + "22" * 32, ss58_format=42).ss58_address


def test_example_layout() -> None:
    key = update_key(RUN, 42, 17, HOTKEY)
    assert key == f"{RUN}/w0000000042/update/00017-{HOTKEY}.tsr"
    assert key.startswith(window_prefix(RUN, 42))
    assert key.startswith(kind_prefix(RUN, 42, "update"))
    assert window_prefix(RUN, 42).startswith(run_prefix(RUN))
    parsed = parse_key(key)
    assert (parsed.run_id, parsed.window, parsed.kind, parsed.uid, parsed.hotkey) == (
        RUN,
        42,
        ObjectKind.UPDATE,
        17,
        HOTKEY,
    )
    assert str(parsed) == key


def test_every_kind_round_trips() -> None:
    keys = {
        ObjectKind.UPDATE: update_key(RUN, 1, 2, HOTKEY),
        ObjectKind.AGGREGATE: aggregate_key(RUN, 1, 2, HOTKEY),
        ObjectKind.CHECKPOINT: checkpoint_key(RUN, 1, 2, HOTKEY, part=3),
        ObjectKind.SCORES: scores_key(RUN, 1, 2, HOTKEY),
        ObjectKind.FINGERPRINT: fingerprint_key(RUN, 1, 2, HOTKEY),
        ObjectKind.MANIFEST: manifest_key(RUN, 1, 2, HOTKEY),
        ObjectKind.APPLIED: applied_key(RUN, 1, 2, HOTKEY),
    }
    assert set(keys) == set(ObjectKind)
    for kind, key in keys.items():
        parsed = parse_key(key)
        assert parsed.kind is kind
        assert key.endswith("." + EXTENSIONS[kind])
        assert parsed.render() == key
    assert parse_key(keys[ObjectKind.CHECKPOINT]).part == 3
    assert ".p00003.ckpt" in keys[ObjectKind.CHECKPOINT]


@settings(max_examples=60, deadline=None)
@given(
    window=st.integers(0, MAX_WINDOW),
    uid=st.integers(0, MAX_UID),
    kind=st.sampled_from(list(ObjectKind)),
    part=st.integers(0, 99999),
)
def test_round_trip_property(window: int, uid: int, kind: ObjectKind, part: int) -> None:
    p = part if kind is ObjectKind.CHECKPOINT else None
    key = object_key(RUN, window, kind, uid, HOTKEY, p)
    assert parse_key(key).model_dump() == {
        "run_id": RUN,
        "window": window,
        "kind": kind,
        "uid": uid,
        "hotkey": HOTKEY,
        "part": p,
    }


def test_windows_sort_lexicographically() -> None:
    keys = [update_key(RUN, w, 0, HOTKEY) for w in (0, 9, 10, 99, 100, 12345)]
    assert sorted(keys) == keys


GOOD = update_key(RUN, 42, 17, HOTKEY)
BAD_HOTKEY = HOTKEY[:-1] + ("A" if HOTKEY[-1] != "A" else "B")  # breaks the checksum


@pytest.mark.parametrize(
    "key",
    [
        "",
        "/",
        GOOD + "/",
        "/" + GOOD,
        GOOD + " ",
        GOOD + "\n",
        GOOD.replace(".tsr", ".json"),  # wrong extension for the kind
        GOOD.replace("/update/", "/updates/"),  # unknown kind
        GOOD.replace("/update/", "/UPDATE/"),
        GOOD.replace(RUN, RUN.upper()),
        GOOD.replace(RUN, RUN[:-1]),
        GOOD.replace("w0000000042", "w42"),  # not zero-padded
        GOOD.replace("w0000000042", "w00000000042"),
        GOOD.replace("w0000000042", "w000000004\u0662"),  # Arabic-Indic digit
        GOOD.replace("00017-", "17-"),
        GOOD.replace("00017-", "99999-"),  # uid out of range
        GOOD.replace("00017-", "00017_"),
        GOOD.replace(HOTKEY, BAD_HOTKEY),
        GOOD.replace(HOTKEY, HOTKEY[:-1]),
        GOOD.replace(".tsr", ".p00001.tsr"),  # part on a non-checkpoint
        checkpoint_key(RUN, 1, 2, HOTKEY, 0).replace(".p00000", ""),  # checkpoint needs a part
        checkpoint_key(RUN, 1, 2, HOTKEY, 0).replace(".p00000", ".p0"),
        f"../{GOOD}",
        GOOD.replace("/update/", "/update/../"),
        GOOD + "x" * 200,
    ],
)
def test_malformed_names_are_rejected(key: str) -> None:
    with pytest.raises(NamingError):
        parse_key(key)


@pytest.mark.parametrize("key", [None, b"abc", 5, ["a"]])
def test_non_strings_are_rejected(key: object) -> None:
    with pytest.raises(NamingError):
        parse_key(key)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_random_text_only_raises_naming_error(key: str) -> None:
    with contextlib.suppress(NamingError):
        parse_key(key)


@settings(max_examples=200, deadline=None)
@given(pos=st.integers(0, len(GOOD) - 1), ch=st.characters(codec="ascii"))
def test_single_character_mutations(pos: int, ch: str) -> None:
    mutated = GOOD[:pos] + ch + GOOD[pos + 1 :]
    try:
        parsed = parse_key(mutated)
    except NamingError:
        return
    assert parsed.render() == mutated  # if it parses, it is a canonical (different) key


@pytest.mark.parametrize(
    "args",
    [
        (RUN, -1, "update", 0, HOTKEY, None),
        (RUN, MAX_WINDOW + 1, "update", 0, HOTKEY, None),
        (RUN, 0, "update", MAX_UID + 1, HOTKEY, None),
        (RUN, 0, "update", 0, "not-a-hotkey", None),
        (RUN, 0, "bogus", 0, HOTKEY, None),
        (RUN, 0, "checkpoint", 0, HOTKEY, None),
        (RUN, 0, "update", 0, HOTKEY, 1),
        (RUN, True, "update", 0, HOTKEY, None),
        ("xyz", 0, "update", 0, HOTKEY, None),
    ],
)
def test_renderer_rejects_bad_components(args: tuple) -> None:
    with pytest.raises(NamingError):
        object_key(*args)


def test_prefix_helpers_validate() -> None:
    with pytest.raises(NamingError):
        window_prefix(RUN, -1)
    with pytest.raises(NamingError):
        run_prefix("nope")
    with pytest.raises(NamingError):
        kind_prefix(RUN, 0, "nope")


def test_parse_key_expecting() -> None:
    parse_key_expecting(GOOD, run_id=RUN, window=42, kind="update", uid=17, hotkey=HOTKEY)
    for wrong in (
        {"run_id": "f" * 32},
        {"run_id": RUN, "window": 43},
        {"run_id": RUN, "kind": ObjectKind.AGGREGATE},
        {"run_id": RUN, "uid": 18},
        {"run_id": RUN, "hotkey": OTHER},
    ):
        with pytest.raises(NamingError):
            parse_key_expecting(GOOD, **wrong)
