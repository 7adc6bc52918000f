"""Buckets for a simulation on an S3-compatible server (MinIO, or moto in tests).

Buckets are created with `commands.provision.ensure_s3_bucket`; this module picks the read key the
members commit on chain. That key is ``TESSERA_S3_READ_*`` and nothing else: never the write key
nor ``AWS_*``. `check_read_key` refuses it for a bucket whose server lets it write (the probe of
`node.runtime.read_key`), before any member starts, and every member checks again before it posts
its commitment.
"""

from __future__ import annotations

from codec.errors import TesseraError
from node.runtime.read_key import READ_ENV, ReadKeyCanWrite, read_credentials, require_read_only
from protocol.credentials import ReadCredentials
from protocol.stores import open_store


class SimKeyError(TesseraError, RuntimeError):
    """The simulation cannot publish a read key that is known to be read-only."""


def sim_read_key() -> ReadCredentials:
    """The read key of an S3 simulation, from TESSERA_S3_READ_* only."""
    try:
        read = read_credentials()
    except ValueError:
        raise SimKeyError(f"the read key in {READ_ENV[0]} / {READ_ENV[1]} is malformed") from None
    if read is None:
        raise SimKeyError(
            f"a simulation on S3 commits a read-only key on chain: set {READ_ENV[0]} and "
            f"{READ_ENV[1]} to a key that may only read the simulation's buckets (docs/buckets.md)"
        )
    return read


def read_key_env() -> dict[str, str]:
    """The environment that hands the read key to the members' processes."""
    read = sim_read_key()
    return {READ_ENV[0]: read.access_key_id, READ_ENV[1]: read.secret_access_key}


def check_read_key(url: str) -> None:
    """`SimKeyError` unless the server refuses the read key's writes to the bucket at `url`."""
    read = sim_read_key()
    with open_store(url) as store:
        try:
            require_read_only(url, store, read)
        except ReadKeyCanWrite as exc:
            raise SimKeyError(str(exc)) from None
