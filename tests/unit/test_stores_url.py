"""Store URLs, credential sources, key rules and retry backoff (no network)."""

from __future__ import annotations

import random
from pathlib import Path, PurePosixPath

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.credentials import ReadCredentials, WriteCredentials
from protocol.stores import (
    FileLocation,
    FileStore,
    InvalidKey,
    RetryPolicy,
    S3Location,
    S3Store,
    StoreError,
    StoreURLError,
    credentials_from_env,
    open_store,
    parse_store_url,
    r2_endpoint,
    r2_store_url,
    validate_key,
)
from protocol.stores.s3_client import is_transient

ACCOUNT = "0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("file:///srv/tessera?bucket=peer-7", FileLocation(Path("/srv/tessera/peer-7"))),
        ("file:///srv/tessera/peer-7", FileLocation(Path("/srv/tessera/peer-7"))),
        ("file://localhost/srv/x/", FileLocation(Path("/srv/x"))),
        (
            f"s3://gradients?endpoint=https://{ACCOUNT}.r2.cloudflarestorage.com",
            S3Location("gradients", f"https://{ACCOUNT}.r2.cloudflarestorage.com", "auto", "path"),
        ),
        (
            "s3://my.bucket?region=eu-central-1",
            S3Location("my.bucket", None, "eu-central-1", "auto"),
        ),
        (
            "s3://minio-bkt?endpoint=http://127.0.0.1:9000/",
            S3Location("minio-bkt", "http://127.0.0.1:9000", "us-east-1", "path"),
        ),
        (
            "s3://bkt?endpoint=https://s3.example.com&region=x-1&addressing=virtual",
            S3Location("bkt", "https://s3.example.com", "x-1", "virtual"),
        ),
    ],
)
def test_parse_store_url(url: str, expected: object) -> None:
    assert parse_store_url(url) == expected


@pytest.mark.parametrize(
    "url",
    [
        "http://bucket",
        "s3://Bad_Bucket",
        "s3://ab",
        "s3://bucket/prefix",
        "s3://bucket?endpoint=ftp://host",
        "s3://bucket?endpoint=https://host/path",
        "s3://bucket?endpoint=https://host:99999",
        "s3://bucket?region=EU",
        "s3://bucket?addressing=sideways",
        "s3://bucket?bogus=1",
        "s3://bucket?region=a&region=b",
        "s3://bucket#frag",
        "file://remote-host/path",
        "file:relative/path",
        "file:///x?bucket=UPPER",
        "file:///x?bucket=../../etc",
        "s3://" + "b" * 3000,
    ],
)
def test_bad_urls_rejected(url: str) -> None:
    with pytest.raises(StoreURLError):
        parse_store_url(url)


def test_urls_with_credentials_are_refused_without_echoing_them() -> None:
    for url in (
        "s3://AKIA:sup3rs3cret@bucket",
        "s3://bucket?endpoint=https://AKIA:sup3rs3cret@host",
    ):
        with pytest.raises(StoreURLError) as info:
            parse_store_url(url)
        assert "sup3rs3cret" not in str(info.value)


def test_r2_helpers() -> None:
    assert r2_endpoint(ACCOUNT) == f"https://{ACCOUNT}.r2.cloudflarestorage.com"
    assert r2_endpoint(ACCOUNT, "eu") == f"https://{ACCOUNT}.eu.r2.cloudflarestorage.com"
    location = parse_store_url(r2_store_url(ACCOUNT, "peer-bucket"))
    assert location == S3Location("peer-bucket", r2_endpoint(ACCOUNT), "auto", "path")
    for bad in ("not-hex", ACCOUNT.upper(), ACCOUNT + "0", "evil.com/x"):
        with pytest.raises(StoreURLError):
            r2_endpoint(bad)


def test_credentials_from_env() -> None:
    env = {"AWS_ACCESS_KEY_ID": "aws-id", "AWS_SECRET_ACCESS_KEY": "aws-secret"}
    assert credentials_from_env(env) == WriteCredentials("aws-id", "aws-secret")
    env |= {"TESSERA_S3_ACCESS_KEY_ID": "t-id", "TESSERA_S3_SECRET_ACCESS_KEY": "t-secret"}
    assert credentials_from_env(env) == WriteCredentials("t-id", "t-secret")
    with pytest.raises(StoreError) as info:
        credentials_from_env({"TESSERA_S3_ACCESS_KEY_ID": "only-id"})
    assert "TESSERA_S3_SECRET_ACCESS_KEY" in str(info.value)
    with pytest.raises(StoreError):
        credentials_from_env({})


def test_open_store_picks_env_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_S3_ACCESS_KEY_ID", "env-id")
    monkeypatch.setenv("TESSERA_S3_SECRET_ACCESS_KEY", "env-secret-value")
    store = open_store("s3://bucket-one?endpoint=http://127.0.0.1:9")
    assert isinstance(store, S3Store) and not store.read_only
    assert "env-secret-value" not in repr(store)
    monkeypatch.delenv("TESSERA_S3_ACCESS_KEY_ID")
    monkeypatch.delenv("TESSERA_S3_SECRET_ACCESS_KEY")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    with pytest.raises(StoreError):
        open_store("s3://bucket-one")


def test_open_store_types(tmp_path: Path) -> None:
    read = ReadCredentials(access_key_id="id", secret_access_key="s")
    assert isinstance(open_store(f"file://{tmp_path}/bkt"), FileStore)
    assert open_store(f"file://{tmp_path}/bkt", read).read_only
    assert open_store("s3://bkt?endpoint=http://127.0.0.1:9", read).read_only
    with pytest.raises(TypeError):
        open_store(f"file://{tmp_path}/bkt", ("id", "secret"))  # type: ignore[call-overload]


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab./\\-_:~%\x00 ")), max_size=24))
def test_valid_keys_never_escape_the_bucket(key: str) -> None:
    try:
        validate_key(key)
    except InvalidKey:
        return
    parts = PurePosixPath(key).parts
    assert not key.startswith("/") and ".." not in parts and "." not in key.split("/")
    root = Path("/bucket")
    assert root.joinpath(*key.split("/")).resolve().is_relative_to(root)


def test_backoff_is_capped_and_jittered() -> None:
    policy = RetryPolicy(attempts=5, base_delay=0.5, max_delay=2.0)
    rng = random.Random(7)
    delays = [[policy.delay(n, rng) for _ in range(200)] for n in (1, 2, 3, 6)]
    assert all(0 <= d <= 0.5 for d in delays[0])
    assert all(0 <= d <= 1.0 for d in delays[1])
    assert all(0 <= d <= 2.0 for d in delays[3]) and max(delays[3]) > 1.0
    assert len({round(d, 6) for d in delays[2]}) > 100  # jitter, not a fixed schedule
    # a chain outage of ten minutes counts thousands of retries (`ResilientChain`)
    assert all(0 <= policy.delay(n, rng) <= 2.0 for n in (1025, 5000, 10**6))


def test_transient_classification() -> None:
    from botocore.exceptions import ClientError, EndpointConnectionError, SSLError

    def client_error(code: str, status: int) -> ClientError:
        return ClientError(
            {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject"
        )

    assert is_transient(EndpointConnectionError(endpoint_url="http://x"))
    assert is_transient(client_error("SlowDown", 503))
    assert is_transient(client_error("InternalError", 500))
    assert not is_transient(client_error("NoSuchKey", 404))
    assert not is_transient(client_error("AccessDenied", 403))
    assert not is_transient(SSLError(endpoint_url="https://x", error="bad cert"))
