"""Hotkeys: sr25519 keypairs in Bittensor wallet files, and strict SS58 address checks.

A Bittensor wallet lives under ``~/.bittensor/wallets/<wallet>/``; each hotkey is the file
``hotkeys/<hotkey>``. An unencrypted key file (the default for hotkeys) is one JSON object::

    {"accountId": "0x<32-byte public key hex>", "publicKey": "0x<same>",
     "privateKey": "0x<64-byte sr25519 secret hex>", "secretPhrase": "<bip39 words>",
     "secretSeed": "0x<32-byte mini-secret hex>", "ss58Address": "5..."}

Loading prefers ``secretSeed``, then ``secretPhrase``, then ``privateKey`` (as Bittensor does),
and checks that the derived address matches ``ss58Address``/``publicKey`` when present. Encrypted
key files (NaCl, Ansible vault, legacy Fernet) are refused with `KeyFileError`: a node that signs
every window needs its hotkey unattended. `create_hotkey` writes the same JSON with mode 0600.

Secrets never appear in exception messages, reprs or logs produced here.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from substrateinterface import Keypair, KeypairType
from substrateinterface.utils.ss58 import ss58_decode, ss58_encode

from codec.errors import TesseraError

SS58_FORMAT = 42
"""Bittensor (and generic Substrate) SS58 address prefix."""

MAX_KEYFILE_BYTES = 64 * 1024
DEFAULT_WALLET_ROOT = Path("~/.bittensor/wallets")

SS58_RE = re.compile(r"[1-9A-HJ-NP-Za-km-z]{47,48}")
"""Base58 alphabet, the length of a 32-byte account id with a one-byte prefix."""

_WALLET_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_HEX_RE = re.compile(r"0x[0-9a-fA-F]*")
_ENCRYPTED_PREFIXES = (b"$NACL", b"$ANSIBLE_VAULT", b"gAAAAA")


class AddressError(TesseraError, ValueError):
    """A string is not a canonical SS58 address of a 32-byte account in the Bittensor format."""


class KeyFileError(TesseraError, ValueError):
    """A key file is missing, unreadable, encrypted, malformed or inconsistent."""


def ss58_to_public_key(address: object) -> bytes:
    """The 32-byte public key of a canonical SS58 (format 42) address; `AddressError` otherwise."""
    if not isinstance(address, str) or SS58_RE.fullmatch(address) is None:
        raise AddressError("not an SS58 address")
    try:
        pub = bytes.fromhex(ss58_decode(address, valid_ss58_format=SS58_FORMAT))
    except (ValueError, IndexError, TypeError) as e:
        raise AddressError(f"invalid SS58 address: {e}") from None
    if len(pub) != 32 or ss58_encode(pub, ss58_format=SS58_FORMAT) != address:
        raise AddressError("SS58 address is not a canonical 32-byte account id")
    return pub


def is_ss58_address(address: object) -> bool:
    try:
        ss58_to_public_key(address)
    except AddressError:
        return False
    return True


def public_key_to_ss58(public_key: bytes) -> str:
    if not isinstance(public_key, bytes) or len(public_key) != 32:
        raise AddressError("a public key is 32 bytes")
    return ss58_encode(public_key, ss58_format=SS58_FORMAT)


def hotkey_path(wallet: str, hotkey: str, root: str | Path | None = None) -> Path:
    """``<root>/<wallet>/hotkeys/<hotkey>``; names are plain file names (no separators)."""
    for label, name in (("wallet", wallet), ("hotkey", hotkey)):
        if _WALLET_NAME_RE.fullmatch(name) is None or name in (".", ".."):
            raise KeyFileError(f"invalid {label} name {name!r}")
    base = Path(root if root is not None else DEFAULT_WALLET_ROOT).expanduser()
    return base / wallet / "hotkeys" / hotkey


def _hex_field(data: dict[str, object], key: str, size: int | None) -> bytes | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or _HEX_RE.fullmatch(value) is None:
        raise KeyFileError(f"key file field {key} is not 0x-prefixed hex")
    raw = bytes.fromhex(value[2:]) if len(value) % 2 == 0 else b""
    if size is not None and len(raw) != size:
        raise KeyFileError(f"key file field {key} must be {size} bytes")
    return raw


def keypair_from_keyfile_data(raw: bytes) -> Keypair:
    """Parse the bytes of an unencrypted Bittensor key file into a signing sr25519 `Keypair`."""
    if len(raw) > MAX_KEYFILE_BYTES:
        raise KeyFileError("key file too large")
    if raw.lstrip().startswith(_ENCRYPTED_PREFIXES):
        raise KeyFileError("key file is encrypted; decrypt the hotkey or use an unencrypted one")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise KeyFileError("key file is not a JSON object") from None
    if not isinstance(data, dict):
        raise KeyFileError("key file is not a JSON object")

    seed = _hex_field(data, "secretSeed", 32)
    private = _hex_field(data, "privateKey", 64)
    public = _hex_field(data, "publicKey", 32)
    account = _hex_field(data, "accountId", 32)
    phrase = data.get("secretPhrase")
    if phrase is not None and not isinstance(phrase, str):
        raise KeyFileError("key file field secretPhrase is not a string")
    try:
        if seed is not None:
            kp = Keypair.create_from_seed(seed.hex(), ss58_format=SS58_FORMAT)
        elif phrase:
            kp = Keypair.create_from_mnemonic(phrase, ss58_format=SS58_FORMAT)
        elif private is not None and public is not None:
            kp = Keypair(
                public_key=public,
                private_key=private,
                ss58_format=SS58_FORMAT,
                crypto_type=KeypairType.SR25519,
            )
        else:
            raise KeyFileError("key file holds no secret (public-only keys cannot sign)")
    except KeyFileError:
        raise
    except Exception:
        raise KeyFileError("key file secret does not form a valid sr25519 keypair") from None

    for label, expected in (("publicKey", public), ("accountId", account)):
        if expected is not None and expected != kp.public_key:
            raise KeyFileError(f"key file {label} does not match its secret")
    address = data.get("ss58Address")
    if address is not None and address != kp.ss58_address:
        raise KeyFileError("key file ss58Address does not match its secret")
    if private is not None and seed is not None and private != kp.private_key:
        raise KeyFileError("key file privateKey does not match its secretSeed")
    return kp


def load_keypair_file(path: str | Path) -> Keypair:
    """Load an unencrypted hotkey file."""
    path = Path(path).expanduser()
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_KEYFILE_BYTES + 1)
    except OSError as e:
        raise KeyFileError(f"cannot read key file {path}: {e.strerror}") from None
    try:
        return keypair_from_keyfile_data(raw)
    except KeyFileError as e:
        raise KeyFileError(f"{path}: {e}") from None


def load_hotkey(wallet: str, hotkey: str, root: str | Path | None = None) -> Keypair:
    """Load ``<root>/<wallet>/hotkeys/<hotkey>`` (root defaults to ~/.bittensor/wallets)."""
    return load_keypair_file(hotkey_path(wallet, hotkey, root))


def keyfile_data(keypair: Keypair) -> bytes:
    """The Bittensor JSON key-file bytes for `keypair` (contains the secret: handle with care)."""

    def hx(b: bytes | str | None) -> str | None:
        if b is None:
            return None
        return "0x" + (b if isinstance(b, str) else b.hex())

    doc = {
        "accountId": hx(keypair.public_key),
        "publicKey": hx(keypair.public_key),
        "privateKey": hx(keypair.private_key),
        "secretPhrase": keypair.mnemonic or None,
        "secretSeed": hx(keypair.seed_hex),
        "ss58Address": keypair.ss58_address,
    }
    return json.dumps(doc).encode("utf-8")


def write_keypair_file(path: str | Path, keypair: Keypair, *, overwrite: bool = False) -> Path:
    """Write `keypair` as an unencrypted key file with mode 0600 (parents created 0700)."""
    if keypair.crypto_type != KeypairType.SR25519 or not keypair.private_key:
        raise KeyFileError("only sr25519 keypairs with a secret can be written")
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_TRUNC if overwrite else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise KeyFileError(f"key file {path} exists (pass overwrite=True)") from None
    except OSError as e:  # e.g. ELOOP: the path is a symlink
        raise KeyFileError(f"cannot write key file {path}: {e.strerror}") from None
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, keyfile_data(keypair))
    finally:
        os.close(fd)
    return path


def create_hotkey(
    wallet: str,
    hotkey: str,
    root: str | Path | None = None,
    *,
    mnemonic: str | None = None,
    overwrite: bool = False,
) -> Keypair:
    """Create (or restore from `mnemonic`) an sr25519 hotkey and write it in wallet format."""
    try:
        words = mnemonic or Keypair.generate_mnemonic()
        kp = Keypair.create_from_mnemonic(
            words, ss58_format=SS58_FORMAT, crypto_type=KeypairType.SR25519
        )
    except Exception:
        raise KeyFileError("invalid mnemonic") from None
    write_keypair_file(hotkey_path(wallet, hotkey, root), kp, overwrite=overwrite)
    return kp
