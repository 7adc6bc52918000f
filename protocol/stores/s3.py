"""S3-compatible object store (Cloudflare R2, AWS S3, MinIO) on botocore.

Downloads: the first request is a ranged GET for the first part; its Content-Range names the
object size, which is checked against the byte cap before a single body byte is read (an object
above the cap costs one request and no transfer). The rest of a large object is fetched with
parallel ranged GETs pinned to the first answer's ETag (If-Match), into a buffer or a temporary
file preallocated to the (already capped) size; every body is read with an exact byte budget, so a
server cannot push more than it announced. This saves the HEAD round trip that a "HEAD, then GET"
scheme pays on every object, which matters when gathering many small updates.

Uploads: one PutObject up to `multipart_threshold`, else a multipart upload with parts sent
concurrently and aborted on any failure. Every request has connect/read timeouts, botocore
retries it ("standard" mode), and the store's own loop retries whole operations (request + body)
on connection errors and 5xx answers with exponential backoff and jitter, then raises
`StoreUnavailable`.
"""

from __future__ import annotations

import builtins
import functools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

from botocore.credentials import Credentials
from botocore.exceptions import ClientError

from protocol.credentials import ReadCredentials, WriteCredentials
from protocol.endpoints import EndpointPolicy, EndpointRefused
from protocol.stores.atomic import atomic_write
from protocol.stores.base import DEFAULT_LIST_LIMIT, ObjectInfo, ObjectStore, check_max_bytes
from protocol.stores.errors import (
    AccessDenied,
    InvalidKey,
    ListingTooLarge,
    ObjectExists,
    ObjectNotFound,
    ObjectTooLarge,
    ReadOnlyStoreError,
    StoreError,
    StoreUnavailable,
    sanitize,
)
from protocol.stores.keys import validate_bucket_name, validate_key, validate_prefix
from protocol.stores.pinned import PinnedTransport
from protocol.stores.retry import call_with_retries
from protocol.stores.s3_client import (
    DENIED_CODES,
    NOT_FOUND_CODES,
    error_code,
    http_status,
    is_transient,
    mask_key_id,
    md5_b64,
    multipart_etag,
    new_client,
    precondition_failed,
)
from protocol.stores.s3_config import S3Config, S3Stats
from protocol.stores.s3_signing import SigningTarget
from protocol.stores.s3_transfer import (
    Cancelled,
    FileSink,
    MemorySink,
    Sink,
    closing_body,
    parse_content_range,
    pread_exact,
    read_exact,
    run_parallel,
)

__all__ = ["S3Store"]

T = TypeVar("T")
log = logging.getLogger(f"tessera.{__name__}")

_WRITE_OPS = ("put", "delete", "upload", "start multipart", "complete multipart")
_RESTARTS = 3  # how often a download restarts when the object is replaced under it


class _ObjectChanged(Exception):
    """The object was replaced during a multi-request download (If-Match failed)."""


class S3Store(ObjectStore):
    """An `ObjectStore` on one S3 bucket. Opened with `ReadCredentials`, it refuses writes."""

    def __init__(
        self,
        bucket: str,
        credentials: ReadCredentials | WriteCredentials,
        *,
        endpoint: str | None = None,
        region: str = "us-east-1",
        addressing_style: str = "auto",
        config: S3Config | None = None,
        endpoint_policy: EndpointPolicy | None = None,
    ) -> None:
        self._bucket = validate_bucket_name(bucket)
        self._policy = endpoint_policy
        self._endpoint = endpoint
        self._region = region
        self._cfg = config or S3Config()
        self._stats = S3Stats()
        if isinstance(credentials, WriteCredentials):
            key_id, secret = credentials.access_key_id, credentials.reveal_secret()
            self._read_only = False
        elif isinstance(credentials, ReadCredentials):
            key_id, secret = credentials.access_key_id, credentials.secret_access_key
            self._read_only = True
        else:
            raise TypeError("credentials must be ReadCredentials or WriteCredentials")
        self._key_hint = mask_key_id(key_id)
        self._signing = SigningTarget(
            endpoint or f"https://s3.{region}.amazonaws.com", self._bucket, region,
            Credentials(key_id, secret),
        )  # fmt: skip
        self._client = new_client(
            key_id,
            secret,
            region=region,
            endpoint=endpoint,
            addressing_style=addressing_style,
            config=self._cfg,
        )
        del secret
        self._client.meta.events.register("before-send.s3", self._count_request)
        self._transport: PinnedTransport | None = None
        if endpoint_policy is not None:  # a peer's bucket: checked, pinned, no redirects
            endpoint_policy.check_url(self._signing.endpoint)
            self._transport = PinnedTransport(endpoint_policy, self._cfg)
            self._client.meta.events.register("before-send.s3", self._transport)

    # -- properties ----------------------------------------------------------------------------

    @property
    def bucket(self) -> str:
        return self._bucket

    @property
    def location(self) -> str:
        where = self._endpoint or f"AWS S3 ({self._region})"
        return f"s3://{self._bucket} at {where}"

    @property
    def read_only(self) -> bool:
        return self._read_only

    @property
    def endpoint_policy(self) -> EndpointPolicy | None:
        """The policy every connection of this store obeys; None for our own configured bucket."""
        return self._policy

    def signing_target(self) -> SigningTarget:
        """Endpoint, bucket, region and key for signing requests outside boto3 (path-style)."""
        return self._signing

    @property
    def config(self) -> S3Config:
        return self._cfg

    @property
    def stats(self) -> S3Stats:
        return self._stats

    def close(self) -> None:
        self._client.close()
        if self._transport is not None:
            self._transport.close()

    # -- plumbing ------------------------------------------------------------------------------

    def _count_request(self, request: Any, **_: Any) -> None:
        self._stats.add("http_attempts")
        if request.headers.get("Range"):
            self._stats.add("range_requests")

    def _require_writable(self, op: str) -> None:
        if self._read_only:
            raise ReadOnlyStoreError(
                f"{op} refused: {self.location} was opened with read-only credentials"
            )

    def _translate(self, exc: ClientError, op: str, key: str) -> StoreError:
        code, status = error_code(exc), http_status(exc)
        if code == "NoSuchBucket":
            return ObjectNotFound(key, f"{self.location} (the bucket does not exist)")
        if code in NOT_FOUND_CODES or status == 404:
            return ObjectNotFound(key, self.location)
        if code in DENIED_CODES or status == 403:
            where = self._endpoint or f"AWS S3 ({self._region})"
            right = "write to" if op.startswith(_WRITE_OPS) else "read"
            return AccessDenied(
                f"access denied ({sanitize(code, 40)}) to bucket {self._bucket!r} at {where} "
                f"for {op} {key!r} with access key id {self._key_hint}: check that the access "
                f"key id and secret are right for this endpoint and that the key may {right} "
                "this bucket"
            )
        return StoreError(
            f"{op} {key!r} on {self.location} failed: HTTP {status} {sanitize(code, 40)}"
        )

    def _call(
        self,
        op: str,
        key: str,
        fn: Callable[[], T],
        *,
        should_stop: Callable[[], bool] | None = None,
    ) -> T:
        """Run one operation under the retry loop and map S3 errors to store errors."""
        try:
            return call_with_retries(
                fn,
                policy=self._cfg.retry,
                is_transient=is_transient,
                what=f"{op} {key!r} on {self.location}",
                on_retry=lambda _exc: self._stats.add("retries"),
                should_stop=should_stop,
            )
        except ClientError as exc:
            raise self._translate(exc, op, key) from exc
        except EndpointRefused as exc:
            raise StoreUnavailable(f"{op} {key!r} on {self.location}: refused: {exc}") from exc

    # -- reads ---------------------------------------------------------------------------------

    def head(self, key: str) -> ObjectInfo:
        validate_key(key)
        resp = self._call(
            "head", key, lambda: self._client.head_object(Bucket=self._bucket, Key=key)
        )
        return self._info(key, resp.get("ContentLength"), resp.get("LastModified"))

    def _info(self, key: str, size: object, modified: object) -> ObjectInfo:
        if not isinstance(size, int) or size < 0:
            raise StoreError(f"{self.location} sent no valid size for {key!r}")
        if not isinstance(modified, datetime) or modified.tzinfo is None:
            raise StoreError(f"{self.location} sent no valid LastModified for {key!r}")
        return ObjectInfo(key, size, modified.astimezone(UTC))

    def list(self, prefix: str = "", *, limit: int = DEFAULT_LIST_LIMIT) -> list[ObjectInfo]:
        validate_prefix(prefix)
        found: list[ObjectInfo] = []
        token: str | None = None
        empty_pages = 0
        while True:
            kwargs: dict[str, Any] = {
                "Bucket": self._bucket,
                "Prefix": prefix,
                "MaxKeys": self._cfg.list_page_size,
            }
            if token is not None:
                kwargs["ContinuationToken"] = token
            page = self._call(
                "list", prefix, functools.partial(self._client.list_objects_v2, **kwargs)
            )
            contents = page.get("Contents") or []
            for item in contents:
                key = item.get("Key")
                try:
                    validate_key(key)
                except InvalidKey:
                    log.debug("%s: skipping a listed key that breaks the key rules", self.location)
                    continue
                if not key.startswith(prefix):
                    continue
                found.append(self._info(key, item.get("Size"), item.get("LastModified")))
                if len(found) > limit:
                    raise ListingTooLarge(
                        f"{self.location} has more than {limit} objects under {prefix!r}"
                    )
            if not page.get("IsTruncated"):
                break
            next_token = page.get("NextContinuationToken")
            empty_pages = 0 if contents else empty_pages + 1
            if not isinstance(next_token, str) or next_token == token or empty_pages > 10:
                raise StoreError(f"{self.location} sent a broken listing continuation")
            token = next_token
        found.sort(key=lambda info: info.key)
        return found

    def get(self, key: str, max_bytes: int) -> bytes:
        check_max_bytes(max_bytes)
        validate_key(key)
        sink = MemorySink()
        self._download(key, max_bytes, sink)
        return bytes(sink.buffer)

    def get_to_file(self, key: str, path: str | os.PathLike[str], max_bytes: int) -> int:
        check_max_bytes(max_bytes)
        validate_key(key)
        try:
            with atomic_write(path) as fd:
                return self._download(key, max_bytes, FileSink(fd))
        except OSError as exc:
            raise StoreError(f"cannot write {os.fspath(path)!r}: {exc.strerror}") from exc

    def _download(self, key: str, max_bytes: int, sink: Sink) -> int:
        for _ in range(_RESTARTS):
            try:
                return self._download_once(key, max_bytes, sink)
            except _ObjectChanged:
                log.info("%s: %r changed during download; restarting", self.location, key)
        raise StoreError(f"{key!r} on {self.location} kept changing during download")

    def _download_once(self, key: str, max_bytes: int, sink: Sink) -> int:
        first_len = min(self._cfg.download_part_size, max_bytes + 1)
        total, fetched, etag = self._call(
            "get", key, lambda: self._get_first(key, max_bytes, first_len, sink)
        )
        if fetched >= total:
            return total
        part = self._cfg.download_part_size
        ranges = [(start, min(start + part, total) - 1) for start in range(fetched, total, part)]
        failed = threading.Event()

        def fetch(first: int, last: int) -> None:
            self._call(
                "get",
                key,
                lambda: self._get_range(key, first, last, total, etag, sink, failed),
                should_stop=failed.is_set,
            )

        run_parallel(fetch, ranges, workers=self._cfg.max_concurrency, failed=failed)
        return total

    def _get_first(
        self, key: str, max_bytes: int, first_len: int, sink: Sink
    ) -> tuple[int, int, str | None]:
        """First GET (ranged): learn the size, enforce the cap, fill the first part.

        Returns (total size, bytes already in the sink, ETag)."""
        try:
            resp = self._client.get_object(
                Bucket=self._bucket, Key=key, Range=f"bytes=0-{first_len - 1}"
            )
        except ClientError as exc:
            if error_code(exc) != "InvalidRange" and http_status(exc) != 416:
                raise
            # Only an empty object has no byte 0: fetch it whole, still under the cap.
            resp = self._client.get_object(Bucket=self._bucket, Key=key)
        with closing_body(resp) as body:
            status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
            length = resp.get("ContentLength")
            if not isinstance(length, int) or length < 0:
                raise StoreError(f"{self.location} sent no Content-Length for {key!r}")
            if status == 206:
                first, last, total = parse_content_range(resp.get("ContentRange"))
                if first != 0 or last != min(first_len, total) - 1 or length != last + 1:
                    raise StoreError(f"{self.location} answered a different range for {key!r}")
            elif status == 200:
                total = length  # whole object (empty, or the server ignored Range)
            else:
                raise StoreError(f"{self.location} answered HTTP {status} for {key!r}")
            if total > max_bytes:
                raise ObjectTooLarge(key, max_bytes, total)
            sink.allocate(total)
            read_exact(
                body,
                sink,
                0,
                length,
                what=f"get {key!r} from {self.location}",
                on_bytes=self._count_download,
            )
            etag = resp.get("ETag")
            return total, length, etag if isinstance(etag, str) else None

    def _get_range(
        self,
        key: str,
        first: int,
        last: int,
        total: int,
        etag: str | None,
        sink: Sink,
        failed: threading.Event,
    ) -> None:
        if failed.is_set():
            raise Cancelled
        kwargs: dict[str, Any] = {
            "Bucket": self._bucket,
            "Key": key,
            "Range": f"bytes={first}-{last}",
        }
        if etag:
            kwargs["IfMatch"] = etag
        try:
            resp = self._client.get_object(**kwargs)
        except ClientError as exc:
            if precondition_failed(exc):
                raise _ObjectChanged from None
            raise
        with closing_body(resp) as body:
            length = resp.get("ContentLength")
            status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status != 206 or parse_content_range(resp.get("ContentRange")) != (
                first,
                last,
                total,
            ):
                raise StoreError(f"{self.location} answered a different range for {key!r}")
            if length != last - first + 1:
                raise StoreError(f"{self.location} sent a wrong Content-Length for {key!r}")
            read_exact(
                body,
                sink,
                first,
                length,
                what=f"get {key!r} from {self.location}",
                on_bytes=self._count_download,
                cancelled=failed.is_set,
            )

    def _count_download(self, n: int) -> None:
        self._stats.add("bytes_downloaded", n)

    # -- writes --------------------------------------------------------------------------------

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self._require_writable("put")
        validate_key(key)
        view = memoryview(data).cast("B")
        if len(view) <= self._cfg.multipart_threshold:
            self._put_single(key, data if isinstance(data, bytes) else view.tobytes())
        else:
            self._put_multipart(key, len(view), lambda off, n: view[off : off + n].tobytes())

    def put_new(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self._require_writable("put")
        validate_key(key)
        if len(data) > self._cfg.multipart_threshold:
            raise StoreError(f"a create-only write of {key!r} must fit one request")
        try:
            self._put_single(key, bytes(data), IfNoneMatch="*")
        except StoreError as exc:
            if precondition_failed(exc.__cause__):
                raise ObjectExists(key, self.location) from None
            raise

    def put_file(self, key: str, path: str | os.PathLike[str]) -> int:
        self._require_writable("put_file")
        validate_key(key)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise StoreError(f"cannot read {os.fspath(path)!r}: {exc.strerror}") from exc
        try:
            size = os.fstat(fd).st_size
            if size <= self._cfg.multipart_threshold:
                self._put_single(key, pread_exact(fd, 0, size))
            else:
                self._put_multipart(key, size, lambda off, n: pread_exact(fd, off, n))
        finally:
            os.close(fd)
        return size

    def delete(self, key: str) -> None:
        self._require_writable("delete")
        validate_key(key)
        self._call("delete", key, lambda: self._client.delete_object(Bucket=self._bucket, Key=key))

    def lifecycle_rules(self) -> builtins.list[dict[str, Any]]:
        """The bucket's lifecycle rules (none: an empty list)."""
        get = functools.partial(
            self._client.get_bucket_lifecycle_configuration, Bucket=self._bucket
        )
        try:
            return list(self._call("get lifecycle of", self._bucket, get).get("Rules") or [])
        except ObjectNotFound:  # NoSuchLifecycleConfiguration
            return []

    def set_lifecycle_rules(self, rules: Sequence[dict[str, Any]]) -> None:
        """Replace the bucket's lifecycle rules (needs the write key)."""
        self._require_writable("set lifecycle")
        put = functools.partial(
            self._client.put_bucket_lifecycle_configuration,
            Bucket=self._bucket,
            LifecycleConfiguration={"Rules": list(rules)},
        )
        self._call("put lifecycle of", self._bucket, put)

    def _put_single(self, key: str, body: bytes, **conditions: str) -> None:
        kwargs: dict[str, Any] = {"Bucket": self._bucket, "Key": key, "Body": body, **conditions}
        if self._cfg.content_md5:
            kwargs["ContentMD5"] = md5_b64(body)
        self._call("put", key, lambda: self._client.put_object(**kwargs))
        self._stats.add("bytes_uploaded", len(body))

    def _put_multipart(self, key: str, size: int, read_part: Callable[[int, int], bytes]) -> None:
        part_size = self._cfg.upload_part_size(size)
        created = self._call(
            "start multipart upload",
            key,
            lambda: self._client.create_multipart_upload(Bucket=self._bucket, Key=key),
        )
        upload_id = created.get("UploadId")
        if not isinstance(upload_id, str) or not upload_id:
            raise StoreError(f"{self.location} sent no UploadId for {key!r}")
        failed = threading.Event()

        def send(number: int, offset: int, length: int) -> dict[str, Any]:
            if failed.is_set():
                raise Cancelled
            body = read_part(offset, length)
            kwargs: dict[str, Any] = {
                "Bucket": self._bucket,
                "Key": key,
                "UploadId": upload_id,
                "PartNumber": number,
                "Body": body,
            }
            if self._cfg.content_md5:
                kwargs["ContentMD5"] = md5_b64(body)
            resp = self._call(
                f"upload part {number} of",
                key,
                lambda: self._client.upload_part(**kwargs),
                should_stop=failed.is_set,
            )
            etag = resp.get("ETag")
            if not isinstance(etag, str):
                raise StoreError(f"{self.location} sent no ETag for part {number} of {key!r}")
            self._stats.add("parts_uploaded")
            self._stats.add("bytes_uploaded", length)
            return {"PartNumber": number, "ETag": etag}

        items = [
            (number, offset, min(part_size, size - offset))
            for number, offset in enumerate(range(0, size, part_size), start=1)
        ]
        try:
            parts = run_parallel(send, items, workers=self._cfg.max_concurrency, failed=failed)
            self._complete(key, upload_id, parts, size)
        except BaseException:
            self._abort(key, upload_id)
            raise

    def _complete(
        self, key: str, upload_id: str, parts: Sequence[dict[str, Any]], size: int
    ) -> None:
        attempts = 0

        def complete() -> None:
            nonlocal attempts
            attempts += 1
            try:
                self._client.complete_multipart_upload(
                    Bucket=self._bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                )
            except ClientError:
                # An earlier attempt may have completed before its answer was lost: the upload
                # is then gone (AWS says NoSuchUpload, others fail otherwise), and the object
                # under the key is ours exactly when its ETag is that of these parts
                if attempts > 1 and self._stored_whole(key, parts, size):
                    return
                raise

        self._call("complete multipart upload", key, complete)

    def _stored_whole(self, key: str, parts: Sequence[dict[str, Any]], size: int) -> bool:
        """Whether `key` holds the object these `parts` make (its multipart ETag, the MD5 of the
        parts' MD5s and their count, and its size); False when that cannot be told."""
        expected = multipart_etag([str(p["ETag"]) for p in parts])
        if expected is None:
            return False
        try:
            info = self._client.head_object(Bucket=self._bucket, Key=key)
        except Exception:  # the completion's own error is the one to report
            return False
        return info.get("ETag") == expected and info.get("ContentLength") == size

    def _abort(self, key: str, upload_id: str) -> None:
        self._stats.add("multipart_aborts")
        try:
            self._client.abort_multipart_upload(Bucket=self._bucket, Key=key, UploadId=upload_id)
        except Exception as exc:  # the failure that got us here matters more
            log.warning(
                "%s: could not abort the multipart upload of %r (%s); a lifecycle rule should "
                "clean it up",
                self.location,
                key,
                type(exc).__name__,
            )
