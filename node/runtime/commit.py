"""Our own bucket commitment: what it should say, and making sure the chain says it."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from urllib.parse import parse_qs, urlsplit

from substrateinterface import Keypair

from codec.errors import TesseraError
from protocol.chain.base import Chain
from protocol.commitment import (
    BucketCommitment,
    Provider,
    parse_commitment,
    render_commitment,
)
from protocol.credentials import ReadCredentials

log = logging.getLogger(f"tessera.{__name__}")

LOCAL_READ_KEY = ReadCredentials(access_key_id="local", secret_access_key="local")


class CommitmentMismatch(TesseraError, RuntimeError):
    """The chain holds no commitment for us, or one that points elsewhere."""


def commitment_for(store_url: str, read: ReadCredentials | None = None) -> BucketCommitment:
    """The commitment that lets others read the bucket at `store_url` with the read key."""
    parts = urlsplit(store_url)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    if parts.scheme == "file":
        bucket = query.get("bucket") or parts.path.rstrip("/").rsplit("/", 1)[-1]
        return BucketCommitment(
            provider=Provider.LOCAL, bucket=bucket, region="local", credentials=LOCAL_READ_KEY
        )
    if read is None:
        read = ReadCredentials(
            access_key_id=os.environ["TESSERA_S3_READ_ACCESS_KEY_ID"],
            secret_access_key=os.environ["TESSERA_S3_READ_SECRET_ACCESS_KEY"],
        )
    endpoint = query.get("endpoint")
    bucket = parts.netloc
    if endpoint is None:
        return BucketCommitment(
            provider=Provider.S3,
            bucket=bucket,
            region=query.get("region", "us-east-1"),
            credentials=read,
        )
    host = urlsplit(endpoint).netloc
    if host.endswith(".r2.cloudflarestorage.com"):
        account, *rest = host.split(".")
        provider = Provider.R2_EU if rest[0] == "eu" else Provider.R2
        return BucketCommitment(
            provider=provider, bucket=bucket, account_id=account, credentials=read
        )
    provider = Provider.HTTPS if endpoint.startswith("https") else Provider.HTTP
    return BucketCommitment(
        provider=provider,
        bucket=bucket,
        host=host,
        region=query.get("region", "us-east-1"),
        credentials=read,
    )


def ensure_commitment(
    chain: Chain,
    keypair: Keypair,
    wanted: BucketCommitment,
    post: bool,
    before_post: Callable[[], None] | None = None,
) -> None:
    """Check the chain holds `wanted` for our hotkey; post it when `post`, else explain how.

    `before_post` runs just before posting and raises to stop it: the read-key check
    (`node.runtime.read_key.require_committable`). A commitment that carries a key is never
    posted without one."""
    current = chain.read_commitment(keypair.ss58_address)
    if current is not None:
        try:
            if parse_commitment(current.data, allow_private_endpoints=True) == wanted:
                return
        except ValueError:
            pass
    if not post:
        state = "missing" if current is None else "stale (points at another bucket or key)"
        raise CommitmentMismatch(
            f"the bucket commitment of {keypair.ss58_address} is {state}; rerun with --commit to "
            "post the commitment for the configured bucket"
        )
    if before_post is None:
        if wanted.provider is not Provider.LOCAL:
            raise ValueError("a commitment with a read key is posted only after the key check")
    else:
        before_post()
    chain.commit(keypair, render_commitment(wanted))
    log.info("posted bucket commitment: %s", wanted)
