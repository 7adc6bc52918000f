"""The key a node publishes on chain must be refused every write, and the server is asked, not us.

`probe_read_key` tries a get, a list, a put and a delete in our bucket with the key we would
commit (the put and the delete are sent with write semantics, so they reach the server, which
must refuse them). `require_read_only` turns that into the rule every path that posts a
commitment follows (`tessera commit`, a node started with ``--commit``, the simulation): a key
that the server lets write, or whose writes could not be shown refused, is never committed.
`tessera doctor` reports the same probe (`commands.doctor.bucket`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from node.runtime.preflight import PreflightError
from protocol.commitment import BucketCommitment, Provider
from protocol.credentials import ReadCredentials, WriteCredentials
from protocol.stores import AccessDenied, ObjectStore, StoreError, open_store
from protocol.stores.s3_client import mask_key_id

READ_PROBE = "tessera-probe/read-key-check"
WRITE_ATTEMPT = "tessera-probe/read-key-write-attempt"
READ_ENV = ("TESSERA_S3_READ_ACCESS_KEY_ID", "TESSERA_S3_READ_SECRET_ACCESS_KEY")
READ_ONLY_FIX = (
    "create a read-only key for this bucket (R2: an 'Object Read only' API token; MinIO: the "
    "readonly policy; S3: s3:GetObject + s3:ListBucket only, see docs/buckets.md) and set "
    "TESSERA_S3_READ_* to it"
)


class ReadKeyCanWrite(PreflightError):
    """The key we would publish on chain can write our bucket (or could not be shown not to)."""


def read_credentials(env: Mapping[str, str] | None = None) -> ReadCredentials | None:
    """The read key from TESSERA_S3_READ_*, None when unset (`ValidationError` if malformed)."""
    env = os.environ if env is None else env
    key_id, secret = env.get(READ_ENV[0]), env.get(READ_ENV[1])
    if not key_id or not secret:
        return None
    return ReadCredentials(access_key_id=key_id, secret_access_key=secret)


def _attempt(action: Callable[[], object]) -> str:
    """'refused', 'allowed', or the error that made the outcome unclear."""
    try:
        action()
    except AccessDenied:
        return "refused"
    except StoreError as exc:
        return f"unclear ({exc})"
    return "allowed"


@dataclass(frozen=True)
class KeyProbe:
    """What the server let the read key do: each 'allowed', 'refused' or 'unclear (…)'."""

    get: str
    list: str
    put: str
    delete: str

    @property
    def writes_refused(self) -> bool:
        return self.put == "refused" and self.delete == "refused"

    def __str__(self) -> str:
        return f"get {self.get}, list {self.list}, put {self.put}, delete {self.delete}"


def probe_read_key(url: str, store: ObjectStore, read: ReadCredentials) -> KeyProbe:
    """Try a get, a list, a put and a delete with the read key (objects cleaned up after)."""
    as_reader = open_store(url, read)
    # the read key with write semantics, so the request reaches the server and it must refuse
    as_writer = open_store(url, WriteCredentials(read.access_key_id, read.secret_access_key))
    try:
        store.put(READ_PROBE, b"read-check")

        def get() -> None:
            if as_reader.get(READ_PROBE, 64) != b"read-check":
                raise StoreError("the read key got other bytes than we wrote")

        return KeyProbe(
            get=_attempt(get),
            list=_attempt(lambda: as_reader.list("tessera-probe/", limit=100)),
            put=_attempt(lambda: as_writer.put(WRITE_ATTEMPT, b"must be refused")),
            delete=_attempt(lambda: as_writer.delete(READ_PROBE)),
        )
    finally:
        for key in (WRITE_ATTEMPT, READ_PROBE):
            store.delete(key)
        as_reader.close()
        as_writer.close()


def require_read_only(url: str, store: ObjectStore, read: ReadCredentials) -> KeyProbe:
    """`ReadKeyCanWrite` unless the server refused both the put and the delete of `read`."""
    try:
        probe = probe_read_key(url, store, read)
    except StoreError as exc:
        raise ReadKeyCanWrite(
            f"cannot check the read key {mask_key_id(read.access_key_id)} on {store.location} "
            f"({exc}); it is not committed"
        ) from exc
    if not probe.writes_refused:
        raise ReadKeyCanWrite(
            f"refusing to commit the read key {mask_key_id(read.access_key_id)}: the server did "
            f"not refuse its writes to {store.location} ({probe}), so anyone reading the chain "
            f"could replace or delete our objects. Fix: {READ_ONLY_FIX}"
        )
    return probe


def require_committable(url: str, store: ObjectStore, wanted: BucketCommitment) -> None:
    """The check before posting `wanted` for our bucket at `url` (a `local` simulation bucket
    carries no key)."""
    if wanted.provider is not Provider.LOCAL:
        require_read_only(url, store, wanted.credentials)
