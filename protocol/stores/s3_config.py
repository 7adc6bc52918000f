"""Tuning knobs and transfer counters of the S3 store."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields

from protocol.stores.errors import StoreError
from protocol.stores.retry import RetryPolicy

__all__ = ["MAX_PARTS", "MIB", "MIN_PART_SIZE", "S3Config", "S3Stats"]

MIB = 1 << 20
MIN_PART_SIZE = 5 * MIB
"""S3's minimum size of every multipart part but the last."""
MAX_PARTS = 10_000
MAX_PART_SIZE = 5 * 1024 * MIB
MAX_OBJECT_SIZE = 5 * 1024 * 1024 * MIB


@dataclass(frozen=True, slots=True)
class S3Config:
    """How the S3 store talks to the endpoint. Defaults suit R2/S3 over the internet.

    - uploads larger than `multipart_threshold` use multipart with `part_size` parts (raised
      automatically when an object would need more than 10 000 parts), `max_concurrency` at once;
    - downloads fetch `download_part_size` bytes per ranged GET, `max_concurrency` at once;
    - every HTTP request has `connect_timeout`/`read_timeout` (seconds, per socket operation);
    - botocore retries each request `botocore_max_attempts` times in total ("standard" mode) and
      `retry` wraps whole operations (request + body) for connection errors and 5xx answers;
    - `content_md5` sends Content-MD5 on uploads so the server rejects corrupted bodies.
    """

    part_size: int = 16 * MIB
    multipart_threshold: int = 32 * MIB
    download_part_size: int = 16 * MIB
    max_concurrency: int = 8
    connect_timeout: float = 5.0
    read_timeout: float = 30.0
    botocore_max_attempts: int = 3
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    content_md5: bool = True
    list_page_size: int = 1000

    def __post_init__(self) -> None:
        if not MIN_PART_SIZE <= self.part_size <= MAX_PART_SIZE:
            raise ValueError(f"part_size must be within [5 MiB, 5 GiB], got {self.part_size}")
        if self.multipart_threshold < self.part_size:
            raise ValueError("multipart_threshold must be >= part_size")
        if self.download_part_size < 64 * 1024:
            raise ValueError("download_part_size must be >= 64 KiB")
        if not 1 <= self.max_concurrency <= 64:
            raise ValueError("max_concurrency must be within [1, 64]")
        if self.connect_timeout <= 0 or self.read_timeout <= 0:
            raise ValueError("timeouts must be positive")
        if self.botocore_max_attempts < 1:
            raise ValueError("botocore_max_attempts must be >= 1")
        if not 1 <= self.list_page_size <= 1000:
            raise ValueError("list_page_size must be within [1, 1000]")

    def upload_part_size(self, size: int) -> int:
        """The part size of a multipart upload of `size` bytes: `part_size`, raised (in whole
        MiB, so that every part but the last has one size, as R2 requires) where `size` would
        need more than `MAX_PARTS` parts; `StoreError` above S3's 5 TiB object limit."""
        if size > MAX_OBJECT_SIZE:
            raise StoreError(f"an object of {size} bytes is above the S3 limit of 5 TiB")
        needed = -(-size // MAX_PARTS)
        if needed <= self.part_size:
            return self.part_size
        return -(-needed // MIB) * MIB


@dataclass
class S3Stats:
    """Counters of one store, safe to bump from worker threads; read them with `snapshot()`."""

    http_attempts: int = 0
    """HTTP requests sent, botocore's own retries included."""
    range_requests: int = 0
    """GETs that carried a Range header."""
    retries: int = 0
    """Operations (request + body) that the store's own retry loop ran again."""
    bytes_downloaded: int = 0
    bytes_uploaded: int = 0
    parts_uploaded: int = 0
    multipart_aborts: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + amount)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "_lock"}
