"""Provisioning: create our bucket with the write key, post our bucket commitment.

Both are idempotent: an existing bucket we can use, or a commitment that already says what we
would post, is left alone. Creating the *read-only* key is the provider's job (see
docs/buckets.md); `tessera doctor` checks the result.
"""

from __future__ import annotations

from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from pydantic import ValidationError
from substrateinterface import Keypair

from codec.errors import TesseraError
from node.runtime.commit import CommitmentMismatch, commitment_for, ensure_commitment
from node.runtime.read_key import ReadKeyCanWrite, require_committable
from protocol.chain.base import Chain
from protocol.commitment import BucketCommitment
from protocol.credentials import WriteCredentials
from protocol.stores import (
    S3Config,
    S3Location,
    StoreError,
    credentials_from_env,
    open_store,
    parse_store_url,
)
from protocol.stores.errors import sanitize
from protocol.stores.s3_client import error_code, http_status, mask_key_id, new_client

_OURS = "BucketAlreadyOwnedByYou"
_TAKEN = "BucketAlreadyExists"


class ProvisionError(TesseraError, RuntimeError):
    """Provisioning failed; the message says why, `fix` (when set) what to do."""

    def __init__(self, message: str, fix: str = "") -> None:
        super().__init__(message if not fix else f"{message}; {fix}")
        self.reason, self.fix = message, fix


def ensure_s3_bucket(url: str, credentials: WriteCredentials | None = None) -> bool:
    """Create the bucket of an `s3://` store URL with the write key unless it exists.

    Returns True when it was created, False when it already existed and the key can use it.
    Credentials default to the environment's write key (`credentials_from_env`).
    """
    location = parse_store_url(url)
    if not isinstance(location, S3Location):
        raise ProvisionError(f"not an s3:// store URL: {sanitize(url, 120)}")
    creds = credentials if credentials is not None else credentials_from_env()
    client = new_client(
        creds.access_key_id,
        creds.reveal_secret(),
        region=location.region,
        endpoint=location.endpoint,
        addressing_style=location.addressing_style,
        config=S3Config(),
    )
    try:
        if _exists(client, location.bucket, creds):
            return False
        request: dict[str, object] = {"Bucket": location.bucket}
        if location.endpoint is None and location.region != "us-east-1":
            request["CreateBucketConfiguration"] = {"LocationConstraint": location.region}
        client.create_bucket(**request)
        return True
    except ClientError as exc:
        code = error_code(exc)
        if code == _OURS:  # created meanwhile by another process of ours
            return False
        if code == _TAKEN:
            raise ProvisionError(_taken(location.bucket, code)) from exc
        raise ProvisionError(
            f"cannot create bucket {location.bucket!r} with key {mask_key_id(creds.access_key_id)}"
            f": {sanitize(code or exc, 80)}; the write key needs permission to create buckets "
            "(or create it in the provider's dashboard, see docs/buckets.md)"
        ) from exc
    except BotoCoreError as exc:
        where = location.endpoint or f"AWS S3 ({location.region})"
        raise ProvisionError(f"cannot reach {where}: {sanitize(exc)}") from exc
    finally:
        client.close()


def _taken(bucket: str, code: str) -> str:
    return f"bucket name {bucket!r} is taken ({sanitize(code, 40)}): pick another name"


def _exists(client: Any, bucket: str, creds: WriteCredentials) -> bool:
    """True when the bucket exists and our key can use it; False when there is none."""
    try:
        client.head_bucket(Bucket=bucket)
    except ClientError as exc:
        code, status = error_code(exc), http_status(exc)
        if status == 404 or code in ("404", "NoSuchBucket", "NotFound"):
            return False
        if status == 403:
            raise ProvisionError(
                f"access to bucket {bucket!r} refused (HTTP 403) for key "
                f"{mask_key_id(creds.access_key_id)}: the write key is wrong or lacks access to "
                "the bucket, or the name belongs to someone else (then pick another)"
            ) from exc
        raise
    return True


def wanted_commitment(store_url: str) -> BucketCommitment:
    """Our commitment for `store_url` with the read key from TESSERA_S3_READ_*.

    Errors never quote the key: pydantic's messages would carry the rejected input.
    """
    try:
        return commitment_for(store_url)
    except KeyError:
        raise ProvisionError(
            "the read key is not set (the commitment publishes it)",
            "set TESSERA_S3_READ_ACCESS_KEY_ID and TESSERA_S3_READ_SECRET_ACCESS_KEY to the "
            "bucket's read-only key",
        ) from None
    except ValidationError as exc:
        reasons = "; ".join(sorted({str(e["msg"]) for e in exc.errors()}))
        raise ProvisionError(
            f"this bucket and read key cannot be committed: {reasons}",
            "use a bucket name and read key the commitment format carries (docs/buckets.md)",
        ) from None
    except ValueError as exc:
        raise ProvisionError(
            f"this bucket cannot be committed: {sanitize(exc)}", "fix --store"
        ) from None


def post_commitment(chain: Chain, keypair: Keypair, store_url: str) -> bool:
    """Make the chain hold our commitment for `store_url`; True when it had to be posted.

    Before posting, the server must refuse the read key's writes (`require_committable`)."""
    wanted = wanted_commitment(store_url)
    try:
        ensure_commitment(chain, keypair, wanted, post=False)
        return False
    except CommitmentMismatch:
        pass
    try:
        with open_store(store_url) as store:
            ensure_commitment(
                chain, keypair, wanted, post=True,
                before_post=lambda: require_committable(store_url, store, wanted),
            )  # fmt: skip
    except ReadKeyCanWrite as exc:
        raise ProvisionError(str(exc)) from None
    except StoreError as exc:
        raise ProvisionError(f"cannot open our bucket to check the read key: {exc}") from None
    return True
