"""Object stores: where peers publish updates and validators fetch them.

    store = open_store("s3://bucket?endpoint=https://ACCOUNT.r2.cloudflarestorage.com",
                       ReadCredentials(access_key_id=..., secret_access_key=...))
    data = store.get("gradient-12-7.bin", max_bytes=64 << 20)

Backends: `FileStore` (file://, the embedded default) and `S3Store` (s3:// for R2, AWS S3 and
MinIO). URL forms and credential sources are documented in `protocol.stores.url`; the shared
semantics in `protocol.stores.base`; key rules in `protocol.stores.keys`.
"""

from protocol.stores.base import DEFAULT_LIST_LIMIT, ObjectInfo, ObjectStore, ReadableStore
from protocol.stores.errors import (
    AccessDenied,
    InvalidKey,
    ListingTooLarge,
    ObjectExists,
    ObjectNotFound,
    ObjectTooLarge,
    ReadOnlyStoreError,
    ServerBusy,
    StoreError,
    StoreUnavailable,
)
from protocol.stores.file import FileStore
from protocol.stores.keys import validate_bucket_name, validate_key, validate_prefix
from protocol.stores.retry import RetryPolicy
from protocol.stores.s3 import S3Store
from protocol.stores.s3_config import S3Config, S3Stats
from protocol.stores.url import (
    FileLocation,
    S3Location,
    StoreURLError,
    credentials_from_env,
    open_store,
    parse_store_url,
    r2_endpoint,
    r2_store_url,
)

__all__ = [
    "DEFAULT_LIST_LIMIT",
    "AccessDenied",
    "FileLocation",
    "FileStore",
    "InvalidKey",
    "ListingTooLarge",
    "ObjectExists",
    "ObjectInfo",
    "ObjectNotFound",
    "ObjectStore",
    "ObjectTooLarge",
    "ReadOnlyStoreError",
    "ReadableStore",
    "RetryPolicy",
    "S3Config",
    "S3Location",
    "S3Stats",
    "S3Store",
    "ServerBusy",
    "StoreError",
    "StoreURLError",
    "StoreUnavailable",
    "credentials_from_env",
    "open_store",
    "parse_store_url",
    "r2_endpoint",
    "r2_store_url",
    "validate_bucket_name",
    "validate_key",
    "validate_prefix",
]
