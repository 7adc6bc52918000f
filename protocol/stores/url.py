"""Open a store from a URL.

URL forms
---------
``file:///abs/root?bucket=NAME``
    The embedded store: bucket directory ``/abs/root/NAME`` (created on first write).
``file:///abs/root/NAME``
    Same store, the path being the bucket directory itself.
``s3://BUCKET?endpoint=https://ACCOUNT.r2.cloudflarestorage.com&region=auto``
    Cloudflare R2 (``region`` defaults to ``auto`` for R2 endpoints; see `r2_store_url`).
``s3://BUCKET?region=eu-central-1``
    AWS S3 (no endpoint; ``region`` defaults to ``us-east-1``).
``s3://BUCKET?endpoint=http://HOST:9000``
    MinIO or any S3-compatible server.

``addressing=path|virtual|auto`` picks the bucket addressing; the default is ``path`` when an
endpoint is given (MinIO needs it, R2 accepts it) and ``auto`` for AWS. Unknown query parameters,
credentials embedded in a URL and non-http(s) endpoints are refused.

Credentials
-----------
``credentials`` may be `ReadCredentials` (the store refuses writes: `ReadOnlyStoreError` before
any request, and `open_store` is typed to return a `ReadableStore`) or `WriteCredentials`. When it
is ``None``, an s3 store reads write credentials from the environment: ``TESSERA_S3_ACCESS_KEY_ID``
and ``TESSERA_S3_SECRET_ACCESS_KEY`` if set, else ``AWS_ACCESS_KEY_ID`` and
``AWS_SECRET_ACCESS_KEY``. A file store needs no credentials; given `ReadCredentials` it is
read-only too.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import overload
from urllib.parse import parse_qs, unquote, urlsplit

from protocol.credentials import ReadCredentials, WriteCredentials
from protocol.endpoints import EndpointPolicy
from protocol.stores.base import ObjectStore, ReadableStore
from protocol.stores.errors import InvalidKey, StoreError
from protocol.stores.file import FileStore
from protocol.stores.keys import validate_bucket_name
from protocol.stores.s3 import S3Store
from protocol.stores.s3_config import S3Config

__all__ = [
    "ENV_ACCESS_KEY_ID",
    "ENV_SECRET_ACCESS_KEY",
    "FileLocation",
    "S3Location",
    "StoreURLError",
    "credentials_from_env",
    "open_store",
    "parse_store_url",
    "r2_endpoint",
    "r2_store_url",
]

ENV_ACCESS_KEY_ID = ("TESSERA_S3_ACCESS_KEY_ID", "AWS_ACCESS_KEY_ID")
ENV_SECRET_ACCESS_KEY = ("TESSERA_S3_SECRET_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY")

_MAX_URL = 2048
_REGION = re.compile(r"[a-z0-9][a-z0-9-]{0,31}")
_R2_ACCOUNT = re.compile(r"[0-9a-f]{32}")
_R2_SUFFIX = ".r2.cloudflarestorage.com"


class StoreURLError(StoreError, ValueError):
    """A store URL that cannot be used."""


@dataclass(frozen=True, slots=True)
class FileLocation:
    directory: Path


@dataclass(frozen=True, slots=True)
class S3Location:
    bucket: str
    endpoint: str | None
    region: str
    addressing_style: str


def _shown(url: str) -> str:
    """The URL for an error message: bounded, and never with a userinfo part."""
    text = url[:200]
    return "<a URL with embedded credentials>" if "@" in text.split("?")[0] else repr(text)


def _single_params(query: str, allowed: set[str], url: str) -> dict[str, str]:
    try:
        params = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise StoreURLError(f"malformed query in store URL {_shown(url)}") from None
    unknown = set(params) - allowed
    if unknown:
        raise StoreURLError(
            f"unknown parameter(s) {sorted(unknown)} in store URL {_shown(url)}; "
            f"allowed: {sorted(allowed)}"
        )
    repeated = [name for name, values in params.items() if len(values) != 1]
    if repeated:
        raise StoreURLError(f"parameter(s) {repeated} repeated in store URL {_shown(url)}")
    return {name: values[0] for name, values in params.items()}


def _bucket(name: str) -> str:
    try:
        return validate_bucket_name(name)
    except InvalidKey as exc:
        raise StoreURLError(str(exc)) from None


def _endpoint(value: str, url: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise StoreURLError(f"endpoint must be an http(s) URL with a host in {_shown(url)}")
    if parts.username is not None or parts.password is not None:
        raise StoreURLError("the endpoint must not embed credentials; pass them separately")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise StoreURLError(f"endpoint must have no path, query or fragment in {_shown(url)}")
    try:
        parts.port  # noqa: B018 - validates the port
    except ValueError:
        raise StoreURLError(f"endpoint has an invalid port in {_shown(url)}") from None
    return f"{parts.scheme}://{parts.netloc}"


def parse_store_url(url: str) -> FileLocation | S3Location:
    """Parse and validate a store URL (see the module docstring for the forms)."""
    if not isinstance(url, str) or len(url) > _MAX_URL:
        raise StoreURLError("store URL must be a str of at most 2048 characters")
    parts = urlsplit(url)
    if parts.fragment:
        raise StoreURLError(f"store URL must have no fragment: {_shown(url)}")
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise StoreURLError(f"file URL must be file:///absolute/path, got {_shown(url)}")
        params = _single_params(parts.query, {"bucket"}, url)
        path = unquote(parts.path)
        if not path.startswith("/") or "\x00" in path:
            raise StoreURLError(f"file URL needs an absolute path, got {_shown(url)}")
        directory = Path(os.path.normpath(path))
        if "bucket" in params:
            directory = directory / _bucket(params["bucket"])
        return FileLocation(directory)
    if parts.scheme == "s3":
        if "@" in parts.netloc:
            raise StoreURLError("s3 URL must not embed credentials; pass them separately")
        if parts.path not in ("", "/"):
            raise StoreURLError(f"s3 URL must be s3://bucket?..., without a path: {_shown(url)}")
        bucket = _bucket(parts.netloc)
        params = _single_params(parts.query, {"endpoint", "region", "addressing"}, url)
        endpoint = _endpoint(params["endpoint"], url) if "endpoint" in params else None
        is_r2 = endpoint is not None and (urlsplit(endpoint).hostname or "").endswith(_R2_SUFFIX)
        region = params.get("region") or ("auto" if is_r2 else "us-east-1")
        if _REGION.fullmatch(region) is None:
            raise StoreURLError(f"invalid region in {_shown(url)}")
        addressing = params.get("addressing") or ("path" if endpoint else "auto")
        if addressing not in ("path", "virtual", "auto"):
            raise StoreURLError(f"addressing must be path, virtual or auto in {_shown(url)}")
        return S3Location(bucket, endpoint, region, addressing)
    raise StoreURLError(f"unsupported store URL scheme {parts.scheme!r} (use file:// or s3://)")


def credentials_from_env(env: Mapping[str, str] | None = None) -> WriteCredentials:
    """Write credentials from TESSERA_S3_* (preferred) or AWS_* environment variables."""
    env = os.environ if env is None else env
    for key_var, secret_var in zip(ENV_ACCESS_KEY_ID, ENV_SECRET_ACCESS_KEY, strict=True):
        key_id, secret = env.get(key_var), env.get(secret_var)
        if key_id and secret:
            return WriteCredentials(key_id, secret)
        if key_id or secret:
            raise StoreError(f"set both {key_var} and {secret_var}, or neither")
    raise StoreError(
        "no S3 credentials: pass them to open_store or set TESSERA_S3_ACCESS_KEY_ID and "
        "TESSERA_S3_SECRET_ACCESS_KEY (or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
    )


@overload
def open_store(
    url: str,
    credentials: ReadCredentials,
    *,
    s3_config: S3Config | None = None,
    endpoint_policy: EndpointPolicy | None = None,
) -> ReadableStore: ...


@overload
def open_store(
    url: str,
    credentials: WriteCredentials | None = None,
    *,
    s3_config: S3Config | None = None,
    endpoint_policy: EndpointPolicy | None = None,
) -> ObjectStore: ...


def open_store(
    url: str,
    credentials: ReadCredentials | WriteCredentials | None = None,
    *,
    s3_config: S3Config | None = None,
    endpoint_policy: EndpointPolicy | None = None,
) -> ReadableStore:
    """Open the store a URL names. `s3_config` tunes s3:// stores (ignored for file://);
    `endpoint_policy` (for a bucket a peer named) makes an s3:// store check and pin every
    connection (`protocol.stores.pinned`)."""
    if credentials is not None and not isinstance(credentials, ReadCredentials | WriteCredentials):
        raise TypeError("credentials must be ReadCredentials, WriteCredentials or None")
    location = parse_store_url(url)
    if isinstance(location, FileLocation):
        return FileStore(location.directory, read_only=isinstance(credentials, ReadCredentials))
    return S3Store(
        location.bucket,
        credentials if credentials is not None else credentials_from_env(),
        endpoint=location.endpoint,
        region=location.region,
        addressing_style=location.addressing_style,
        config=s3_config,
        endpoint_policy=endpoint_policy,
    )


def r2_endpoint(account_id: str, jurisdiction: str | None = None) -> str:
    """The R2 S3 endpoint of an account (32 hex digits); `jurisdiction` e.g. "eu"."""
    if not isinstance(account_id, str) or _R2_ACCOUNT.fullmatch(account_id) is None:
        raise StoreURLError("an R2 account id is 32 lowercase hex digits")
    if jurisdiction is not None and jurisdiction not in ("eu", "fedramp"):
        raise StoreURLError("R2 jurisdiction must be 'eu' or 'fedramp'")
    middle = f".{jurisdiction}" if jurisdiction else ""
    return f"https://{account_id}{middle}{_R2_SUFFIX}"


def r2_store_url(account_id: str, bucket: str, jurisdiction: str | None = None) -> str:
    """The store URL of an R2 bucket, for building a peer's URL from its on-chain commitment."""
    _bucket(bucket)
    return f"s3://{bucket}?endpoint={r2_endpoint(account_id, jurisdiction)}&region=auto"
