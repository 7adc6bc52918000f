"""Update signatures and Bittensor hotkey files."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import pytest
from substrateinterface import Keypair, KeypairType

from protocol.keys import (
    AddressError,
    KeyFileError,
    create_hotkey,
    hotkey_path,
    is_ss58_address,
    keyfile_data,
    keypair_from_keyfile_data,
    load_hotkey,
    load_keypair_file,
    public_key_to_ss58,
    ss58_to_public_key,
    write_keypair_file,
)
from protocol.naming import ObjectKind
from protocol.runconfig import RunConfig
from protocol.signing import (
    SIGNATURE_BYTES,
    SignatureError,
    payload_digest,
    sign_object,
    sign_update,
    signed_message,
    verify_object,
    verify_update,
)

RUN = RunConfig.preset("tiny").run_id
OTHER_RUN = RunConfig.preset("tiny", seed=7).run_id
SEED_A = "0x" + "a1" * 32
SEED_B = "0x" + "b2" * 32


@pytest.fixture(scope="module")
def kp() -> Keypair:
    return Keypair.create_from_seed(SEED_A, ss58_format=42)


@pytest.fixture(scope="module")
def other() -> Keypair:
    return Keypair.create_from_seed(SEED_B, ss58_format=42)


DIGEST = payload_digest(b"compressed update bytes")


def test_sign_and_verify(kp: Keypair) -> None:
    sig = sign_update(kp, RUN, 12, 3, DIGEST)
    assert isinstance(sig, bytes) and len(sig) == SIGNATURE_BYTES
    verify_update(kp.ss58_address, sig, RUN, 12, 3, DIGEST)


@pytest.mark.parametrize(
    "change",
    [
        {"run_id": OTHER_RUN},
        {"window": 13},
        {"uid": 4},
        {"digest": payload_digest(b"other bytes")},
        {"digest": DIGEST[:-1] + bytes([DIGEST[-1] ^ 1])},
    ],
)
def test_tampered_fields_fail(kp: Keypair, change: dict) -> None:
    sig = sign_update(kp, RUN, 12, 3, DIGEST)
    fields = {"run_id": RUN, "window": 12, "uid": 3, "digest": DIGEST, **change}
    with pytest.raises(SignatureError):
        verify_update(kp.ss58_address, sig, **fields)


def test_wrong_signer_and_bad_signatures(kp: Keypair, other: Keypair) -> None:
    sig = sign_update(kp, RUN, 12, 3, DIGEST)
    with pytest.raises(SignatureError):
        verify_update(other.ss58_address, sig, RUN, 12, 3, DIGEST)
    flipped = bytes([sig[0] ^ 1]) + sig[1:]
    for bad in (flipped, b"\x00" * 64):
        with pytest.raises(SignatureError):
            verify_update(kp.ss58_address, bad, RUN, 12, 3, DIGEST)
    for malformed in (sig[:-1], sig + b"\x00", b"", sig.hex(), None):  # refused before curve work
        with pytest.raises(SignatureError, match="must be 64 bytes"):
            verify_update(kp.ss58_address, malformed, RUN, 12, 3, DIGEST)  # type: ignore[arg-type]
    for hotkey in ("", "5" * 48, kp.ss58_address[:-1], "0x" + kp.public_key.hex(), None):
        with pytest.raises(SignatureError):
            verify_update(hotkey, sig, RUN, 12, 3, DIGEST)  # type: ignore[arg-type]


def test_wrapped_bytes_signature_is_not_accepted(kp: Keypair) -> None:
    message = signed_message("update", RUN, 1, 1, DIGEST)
    wrapped_sig = kp.sign(b"<Bytes>" + message + b"</Bytes>")
    assert kp.verify(message, wrapped_sig)  # substrate-interface would accept it
    with pytest.raises(SignatureError):
        verify_update(kp.ss58_address, wrapped_sig, RUN, 1, 1, DIGEST)


def test_kinds_are_domain_separated(kp: Keypair) -> None:
    sig = sign_object(kp, ObjectKind.AGGREGATE, RUN, 5, 0, DIGEST)
    verify_object(kp.ss58_address, sig, "aggregate", RUN, 5, 0, DIGEST)
    with pytest.raises(SignatureError):
        verify_update(kp.ss58_address, sig, RUN, 5, 0, DIGEST)


def test_message_layout_is_fixed() -> None:
    msg = signed_message("update", RUN, 258, 7, b"\x01" * 32)
    assert msg.startswith(b"tessera/signed-object/v1\x00\x06update")
    assert msg.endswith(b"\x20" + b"\x01" * 32)
    assert (258).to_bytes(8, "big") + (7).to_bytes(2, "big") in msg
    assert bytes.fromhex(RUN) in msg


@pytest.mark.parametrize(
    "args",
    [
        ("update", "not-a-run", 1, 1, DIGEST),
        ("update", RUN.upper(), 1, 1, DIGEST),
        ("update", RUN, -1, 1, DIGEST),
        ("update", RUN, 1 << 64, 1, DIGEST),
        ("update", RUN, True, 1, DIGEST),
        ("update", RUN, 1, 65536, DIGEST),
        ("update", RUN, 1, 1, b"short"),
        ("update", RUN, 1, 1, b"x" * 65),
        ("update", RUN, 1, 1, DIGEST.hex()),
        ("nonsense", RUN, 1, 1, DIGEST),
    ],
)
def test_message_inputs_validated(args: tuple) -> None:
    with pytest.raises(SignatureError):
        signed_message(*args)


def test_signing_needs_a_secret(kp: Keypair) -> None:
    public_only = Keypair(ss58_address=kp.ss58_address)
    with pytest.raises(SignatureError):
        sign_update(public_only, RUN, 1, 1, DIGEST)
    ed = Keypair.create_from_seed(SEED_A, crypto_type=KeypairType.ED25519)
    with pytest.raises(SignatureError):
        sign_update(ed, RUN, 1, 1, DIGEST)


# -- addresses ----------------------------------------------------------------------------


def test_ss58_helpers(kp: Keypair) -> None:
    assert ss58_to_public_key(kp.ss58_address) == kp.public_key
    assert public_key_to_ss58(kp.public_key) == kp.ss58_address
    assert is_ss58_address(kp.ss58_address)
    polkadot = Keypair.create_from_seed(SEED_A, ss58_format=0).ss58_address
    for bad in (polkadot, kp.ss58_address[:-1] + "1", "", "0x" + "00" * 32, None, 42):
        assert not is_ss58_address(bad)
        with pytest.raises(AddressError):
            ss58_to_public_key(bad)


# -- wallet files -------------------------------------------------------------------------


def test_create_and_load_hotkey(tmp_path: Path) -> None:
    kp = create_hotkey("miner", "default", tmp_path)
    path = tmp_path / "miner" / "hotkeys" / "default"
    assert path == hotkey_path("miner", "default", tmp_path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    data = json.loads(path.read_text())
    assert set(data) == {
        "accountId",
        "publicKey",
        "privateKey",
        "secretPhrase",
        "secretSeed",
        "ss58Address",
    }
    assert data["ss58Address"] == kp.ss58_address
    assert data["publicKey"] == "0x" + kp.public_key.hex()
    loaded = load_hotkey("miner", "default", tmp_path)
    assert loaded.ss58_address == kp.ss58_address
    sig = sign_update(loaded, RUN, 1, 2, DIGEST)
    verify_update(kp.ss58_address, sig, RUN, 1, 2, DIGEST)


def test_create_refuses_to_overwrite(tmp_path: Path) -> None:
    first = create_hotkey("w", "h", tmp_path)
    with pytest.raises(KeyFileError):
        create_hotkey("w", "h", tmp_path)
    assert load_hotkey("w", "h", tmp_path).ss58_address == first.ss58_address
    second = create_hotkey("w", "h", tmp_path, overwrite=True)
    assert load_hotkey("w", "h", tmp_path).ss58_address == second.ss58_address


def test_restore_from_mnemonic(tmp_path: Path) -> None:
    words = Keypair.generate_mnemonic()
    kp = create_hotkey("w", "h", tmp_path, mnemonic=words)
    assert kp.ss58_address == Keypair.create_from_mnemonic(words, ss58_format=42).ss58_address
    with pytest.raises(KeyFileError):
        create_hotkey("w", "h2", tmp_path, mnemonic="not a real mnemonic")


def test_load_variants(tmp_path: Path, kp: Keypair) -> None:
    full = json.loads(keyfile_data(Keypair.create_from_mnemonic(Keypair.generate_mnemonic())))
    # seed only, phrase only, private key only: all yield the same signer
    addr = full["ss58Address"]
    for keep in (["secretSeed"], ["secretPhrase"], ["privateKey", "publicKey"]):
        doc = {k: full[k] for k in keep}
        assert keypair_from_keyfile_data(json.dumps(doc).encode()).ss58_address == addr
    # a bittensor-style file with nulls for missing fields
    nulls = {**full, "secretPhrase": None, "privateKey": None}
    assert keypair_from_keyfile_data(json.dumps(nulls).encode()).ss58_address == addr


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"not json",
        b"[]",
        b"{}",
        b'{"ss58Address": "5FHneW46xGXgs5mUiveU4sbTyGBzmstUspZC92UhjJM694ty"}',  # public only
        b'{"secretSeed": "0x1234"}',
        b'{"secretSeed": "a1a1"}',
        b'{"secretSeed": 5}',
        b'{"secretPhrase": ["x"]}',
        b'{"secretPhrase": "definitely not a mnemonic"}',
        b"$NACL" + b"\x00" * 64,
        b"$ANSIBLE_VAULT;1.1;AES256\n6162",
        b"gAAAAABkexample",
        b"\xff\xfe",
        b"{" * 100_000,
    ],
)
def test_bad_keyfiles(raw: bytes) -> None:
    with pytest.raises(KeyFileError):
        keypair_from_keyfile_data(raw)


def test_inconsistent_keyfile(kp: Keypair, other: Keypair) -> None:
    doc = json.loads(keyfile_data(kp))
    doc["ss58Address"] = other.ss58_address
    with pytest.raises(KeyFileError):
        keypair_from_keyfile_data(json.dumps(doc).encode())
    doc = json.loads(keyfile_data(kp))
    doc["publicKey"] = "0x" + other.public_key.hex()
    with pytest.raises(KeyFileError):
        keypair_from_keyfile_data(json.dumps(doc).encode())


def test_errors_do_not_leak_secrets(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    kp = Keypair.create_from_mnemonic(Keypair.generate_mnemonic(), ss58_format=42)
    doc = json.loads(keyfile_data(kp))
    doc["ss58Address"] = public_key_to_ss58(b"\x01" * 32)
    path = tmp_path / "bad"
    path.write_text(json.dumps(doc))
    caplog.set_level(logging.DEBUG)
    with pytest.raises(KeyFileError) as info:
        load_keypair_file(path)
    text = str(info.value) + repr(info.value) + caplog.text
    for secret in (doc["secretSeed"], doc["privateKey"], doc["secretPhrase"]):
        assert secret[2:10] not in text
    bad_phrase = {"secretPhrase": kp.mnemonic + " extra"}
    with pytest.raises(KeyFileError) as info:
        keypair_from_keyfile_data(json.dumps(bad_phrase).encode())
    assert kp.mnemonic.split()[0] not in str(info.value).split()


def test_path_validation_and_missing_files(tmp_path: Path) -> None:
    for wallet, hotkey in (("../x", "h"), ("w", "a/b"), ("", "h"), ("w", ".."), ("w", "h\x00")):
        with pytest.raises(KeyFileError):
            hotkey_path(wallet, hotkey, tmp_path)
    with pytest.raises(KeyFileError):
        load_hotkey("nobody", "none", tmp_path)
    assert str(hotkey_path("w", "h")).endswith(".bittensor/wallets/w/hotkeys/h")


def test_write_requires_signing_keypair(tmp_path: Path, kp: Keypair) -> None:
    with pytest.raises(KeyFileError):
        write_keypair_file(tmp_path / "x", Keypair(ss58_address=kp.ss58_address))
    (tmp_path / "target").write_text("keep")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    with pytest.raises(KeyFileError):
        write_keypair_file(tmp_path / "link", kp, overwrite=True)
    assert (tmp_path / "target").read_text() == "keep"
    path = write_keypair_file(tmp_path / "deep" / "x", kp)
    assert load_keypair_file(path).public_key == kp.public_key
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
