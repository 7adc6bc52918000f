"""The botocore side of the S3 store: client construction and error classification."""

from __future__ import annotations

import base64
import hashlib
import http.client
import threading
from collections.abc import Sequence
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    HTTPClientError,
    IncompleteReadError,
    SSLError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)

from protocol.stores.s3_config import S3Config
from protocol.stores.s3_transfer import ShortRead

__all__ = [
    "DENIED_CODES",
    "NOT_FOUND_CODES",
    "THROTTLED_CODES",
    "error_code",
    "http_status",
    "is_transient",
    "mask_key_id",
    "md5_b64",
    "new_client",
]

NOT_FOUND_CODES = {"NoSuchKey", "NoSuchBucket", "404", "NotFound"}
DENIED_CODES = {
    "AccessDenied",
    "403",
    "Forbidden",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
    "AllAccessDisabled",
    "AccountProblem",
    "Unauthorized",
}
THROTTLED_CODES = {
    "SlowDown",
    "RequestTimeout",
    "InternalError",
    "ServiceUnavailable",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequests",
}
_TRANSIENT_TYPES = (
    BotoConnectionError,  # refused, DNS, connect timeout
    HTTPClientError,  # connection closed, read timeout, body stream broken
    IncompleteReadError,
    ShortRead,
    http.client.IncompleteRead,
    ConnectionError,
    TimeoutError,
)


_session_lock = threading.Lock()
_session: boto3.session.Session | None = None


def _shared_session_client(**kwargs: Any) -> Any:
    """An S3 client from one shared session: loading the service model once per process instead
    of once per store (a validator opens a store per peer). boto3 sessions are not thread-safe,
    so client creation is serialized; the clients themselves are."""
    global _session
    with _session_lock:
        if _session is None:
            _session = boto3.session.Session()
        return _session.client("s3", **kwargs)


def error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def http_status(exc: ClientError) -> int:
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return status if isinstance(status, int) else 0


def precondition_failed(exc: BaseException | None) -> bool:
    """An S3 answer 412: a conditional request (``If-Match``, ``If-None-Match``) was refused."""
    return isinstance(exc, ClientError) and (
        error_code(exc) == "PreconditionFailed" or http_status(exc) == 412
    )


def is_transient(exc: BaseException) -> bool:
    """Failures worth retrying: dropped/refused/timed-out connections, throttling, 5xx."""
    if isinstance(exc, SSLError):
        return False  # a certificate problem does not heal by retrying
    if isinstance(exc, _TRANSIENT_TYPES):
        return True
    if isinstance(exc, ClientError):
        status = http_status(exc)
        return status >= 500 or status == 429 or error_code(exc) in THROTTLED_CODES
    return False


def mask_key_id(access_key_id: str) -> str:
    if len(access_key_id) <= 8:
        return access_key_id[:2] + "…"
    return f"{access_key_id[:4]}…{access_key_id[-4:]}"


def md5_b64(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()


def new_client(
    access_key_id: str,
    secret_access_key: str,
    *,
    region: str,
    endpoint: str | None,
    addressing_style: str,
    config: S3Config,
) -> Any:
    """A botocore S3 client set up for R2/S3/MinIO with the store's timeouts and retries."""
    if addressing_style not in ("auto", "path", "virtual"):
        raise ValueError("addressing_style must be auto, path or virtual")
    botocore_config = Config(
        region_name=region,
        signature_version="s3v4",
        connect_timeout=config.connect_timeout,
        read_timeout=config.read_timeout,
        retries={"mode": "standard", "total_max_attempts": config.botocore_max_attempts},
        max_pool_connections=max(10, 2 * config.max_concurrency),
        s3={"addressing_style": addressing_style},
        # No flexible checksums unless an operation requires them: R2 and MinIO releases
        # differ in which trailers they accept; uploads carry Content-MD5 instead.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        # The endpoint comes from the store URL only, never from AWS_ENDPOINT_URL or profiles.
        ignore_configured_endpoint_urls=True,
        tcp_keepalive=True,
        user_agent_extra="tessera",
    )
    return _shared_session_client(
        aws_access_key_id=access_key_id,
        aws_secret_access_key=secret_access_key,
        region_name=region,
        endpoint_url=endpoint,
        config=botocore_config,
    )


def multipart_etag(part_etags: Sequence[str]) -> str | None:
    """The ETag S3-compatible stores give an object completed from parts with these ETags: the
    MD5 of the parts' binary MD5s, a dash and their count (None when a part's ETag is not an
    MD5)."""
    try:
        digests = b"".join(bytes.fromhex(e.strip('"')) for e in part_etags)
    except ValueError:
        return None
    if len(digests) != 16 * len(part_etags):
        return None
    return f'"{hashlib.md5(digests).hexdigest()}-{len(part_etags)}"'
