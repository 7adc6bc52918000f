"""Bucket commitments: round trips, size limits, strict parsing, no write keys."""

from __future__ import annotations

import secrets

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from protocol.commitment import (
    MAX_COMMITMENT_BYTES,
    RAW_FIELD_BYTES,
    BucketCommitment,
    CommitmentError,
    Provider,
    commitment_fields,
    join_commitment_fields,
    parse_commitment,
    parse_commitment_fields,
    render_commitment,
)
from protocol.credentials import ReadCredentials, SecretLeakError, WriteCredentials


def r2(bucket: str = "tessera-peer-0001", provider: Provider = Provider.R2) -> BucketCommitment:
    return BucketCommitment(
        provider=provider,
        account_id=secrets.token_hex(16),
        bucket=bucket,
        credentials=ReadCredentials(
            access_key_id=secrets.token_hex(16), secret_access_key=secrets.token_hex(32)
        ),
    )


AWS_CREDS = ReadCredentials(
    access_key_id="AKIAIOSFODNN7EXAMPLE",
    secret_access_key="wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
)


def aws(region: str = "us-east-1", bucket: str = "tessera-peer-0001") -> BucketCommitment:
    return BucketCommitment(
        provider=Provider.S3, region=region, bucket=bucket, credentials=AWS_CREDS
    )


def minio(
    host: str = "minio.example.org:9000", provider: Provider = Provider.HTTPS
) -> BucketCommitment:
    return BucketCommitment(
        provider=provider,
        host=host,
        region="us-east-1",
        bucket="peer-7",
        credentials=ReadCredentials(access_key_id="readonly-7", secret_access_key="s3cr3t!~value"),
    )


@pytest.mark.parametrize("provider", [Provider.R2, Provider.R2_EU])
@pytest.mark.parametrize("bucket", ["abc", "tessera-peer-0001", "a" * 63])
def test_r2_round_trip_fits_one_field(provider: Provider, bucket: str) -> None:
    c = r2(bucket, provider)
    body = render_commitment(c)
    assert len(body) == 1 + 16 + 16 + 32 + len(bucket) <= RAW_FIELD_BYTES
    assert commitment_fields(c) == (body,)
    assert parse_commitment(body) == c
    assert parse_commitment_fields([body]) == c
    assert c.region_name == "auto"
    assert c.endpoint_url.endswith(".r2.cloudflarestorage.com")
    assert c.account_id is not None and c.account_id in c.endpoint_url
    assert (".eu." in c.endpoint_url) == (provider is Provider.R2_EU)


@pytest.mark.parametrize("region", ["us-east-1", "ap-southeast-2", "us-gov-west-1"])
def test_aws_fits_one_field_even_with_longest_bucket(region: str) -> None:
    c = aws(region, "b" * 63)
    body = render_commitment(c)
    assert len(body) <= RAW_FIELD_BYTES
    assert parse_commitment(body) == c
    assert c.endpoint_url == f"https://s3.{region}.amazonaws.com"
    # 20-char key id and 40-char secret are packed as base64 (15 + 30 bytes)
    assert len(render_commitment(aws(region, "abc"))) == 1 + 1 + len(region) + 16 + 31 + 3


def test_generic_endpoints() -> None:
    c = minio("minio.example.org")
    assert parse_commitment(render_commitment(c)) == c
    assert c.endpoint_url == "https://minio.example.org"
    other_port = minio()
    assert other_port.endpoint_url == "https://minio.example.org:9000"
    assert (
        parse_commitment(render_commitment(other_port), allow_private_endpoints=True) == other_port
    )
    local = minio("127.0.0.1:9000", Provider.HTTP)
    body = render_commitment(local)
    assert parse_commitment(body, allow_private_endpoints=True) == local
    assert local.endpoint_url == "http://127.0.0.1:9000"


@pytest.mark.parametrize(
    ("host", "provider"),
    [
        ("minio.example.org:9000", Provider.HTTP),  # plain http
        ("127.0.0.1:9000", Provider.HTTPS),
        ("10.1.2.3", Provider.HTTPS),
        ("169.254.169.254", Provider.HTTPS),  # cloud metadata
        ("0.0.0.0", Provider.HTTPS),
        ("localhost:9000", Provider.HTTPS),
        ("minio", Provider.HTTPS),  # single label: only resolves privately
        ("minio.example.org:9000", Provider.HTTPS),  # only port 443
        # legacy numeric spellings the system resolver reads as loopback/private/link-local
        ("127.1", Provider.HTTPS),
        ("0177.0.0.1", Provider.HTTPS),
        ("0x7f.1", Provider.HTTPS),
        ("10.1", Provider.HTTPS),
        ("169.254.43518", Provider.HTTPS),
        ("2130706433.example.0x7f", Provider.HTTPS),  # numeric last label
        ("8.8.8.08", Provider.HTTPS),  # a leading zero: not canonical even when public
    ],
)
def test_private_endpoints_refused_by_default(host: str, provider: Provider) -> None:
    body = render_commitment(minio(host, provider))
    with pytest.raises(CommitmentError):
        parse_commitment(body)
    assert parse_commitment(body, allow_private_endpoints=True).host == host


def test_long_commitment_splits_into_fields() -> None:
    long_host = ".".join(["a" * 60] * 3) + ".example.org"
    c = minio(long_host)
    body = render_commitment(c)
    fields = commitment_fields(c)
    assert len(body) > RAW_FIELD_BYTES
    assert len(fields) == 2 and len(fields[0]) == RAW_FIELD_BYTES
    assert join_commitment_fields(fields) == body
    assert parse_commitment_fields(fields) == c
    with pytest.raises(CommitmentError):
        parse_commitment_fields([fields[0][:-1], fields[0][-1:] + fields[1]])
    with pytest.raises(CommitmentError):
        parse_commitment_fields([body])  # a single field cannot exceed 128 bytes
    with pytest.raises(CommitmentError):
        parse_commitment_fields([])
    with pytest.raises(CommitmentError):
        parse_commitment_fields(body)  # type: ignore[arg-type]


def test_too_big_to_commit() -> None:
    c = BucketCommitment(
        provider=Provider.HTTPS,
        host=".".join(["a" * 61] * 4),
        region="r" * 32,
        bucket="b" * 63,
        credentials=ReadCredentials(access_key_id="K" * 63, secret_access_key="S!" * 31),
    )
    with pytest.raises(CommitmentError):
        render_commitment(c)


def test_write_credentials_can_never_be_committed() -> None:
    write = WriteCredentials(secrets.token_hex(16), secrets.token_hex(32))
    with pytest.raises(SecretLeakError, match="write credentials can never"):
        BucketCommitment(provider=Provider.R2, account_id="a" * 32, bucket="abc", credentials=write)
    with pytest.raises(SecretLeakError, match="write credentials can never"):
        BucketCommitment.model_validate(
            {"provider": 1, "account_id": "a" * 32, "bucket": "abc", "credentials": write}
        )
    smuggled = BucketCommitment.model_construct(  # deliberately the wrong type: it must not leak
        provider=Provider.R2,
        account_id="a" * 32,
        bucket="abc",
        credentials=write,  # type: ignore[arg-type]
    )
    with pytest.raises(SecretLeakError):
        render_commitment(smuggled)
    with pytest.raises(SecretLeakError):
        commitment_fields(smuggled)
    assert write.reveal_secret() not in repr(smuggled.credentials)

    class Wider(ReadCredentials):  # a read key that could carry more than a read key
        pass

    wider = Wider(access_key_id="a" * 32, secret_access_key="b" * 64)
    with pytest.raises(SecretLeakError, match="ReadCredentials only"):
        BucketCommitment(provider=Provider.R2, account_id="a" * 32, bucket="abc", credentials=wider)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"provider": Provider.R2, "account_id": "A" * 32},  # uppercase hex
        {"provider": Provider.R2, "account_id": "a" * 31},
        {"provider": Provider.R2, "account_id": "a" * 32, "bucket": "has.dot"},
        {"provider": Provider.R2, "account_id": "a" * 32, "region": "auto"},
        {"provider": Provider.R2, "account_id": "a" * 32, "bucket": "ab"},
        {"provider": Provider.R2, "account_id": "a" * 32, "bucket": "-abc"},
        {"provider": Provider.R2, "account_id": "a" * 32, "bucket": "Abc"},
        {"provider": Provider.S3, "region": "us-east-1", "account_id": "a" * 32},
        {"provider": Provider.S3, "region": None},
        {"provider": Provider.S3, "region": "US-EAST-1"},
        {"provider": Provider.S3, "region": "us-east-1", "host": "x.example.org"},
        {"provider": Provider.S3, "region": "us-east-1", "bucket": "192.168.1.1"},
        {"provider": Provider.S3, "region": "us-east-1", "bucket": "a..b"},
        {"provider": Provider.HTTPS, "region": "us-east-1"},  # no host
        {"provider": Provider.HTTPS, "region": "us-east-1", "host": "Minio.org"},
        {"provider": Provider.HTTPS, "region": "us-east-1", "host": "m.org:0"},
        {"provider": Provider.HTTPS, "region": "us-east-1", "host": "m.org:65536"},
        {"provider": Provider.HTTPS, "region": "us-east-1", "host": "https://m.org"},
        {"provider": Provider.HTTPS, "region": "us-east-1", "host": "m.org/path"},
        {"provider": Provider.HTTPS, "region": "us-east-1", "host": "user@m.org"},
    ],
)
def test_invalid_commitments_rejected_at_construction(kwargs: dict) -> None:
    hexcreds = ReadCredentials(access_key_id="a" * 32, secret_access_key="b" * 64)
    data = {"bucket": "good-bucket", "credentials": hexcreds, **kwargs}
    with pytest.raises(ValidationError):
        BucketCommitment(**data)


def test_r2_requires_hex_keys() -> None:
    with pytest.raises(ValidationError, match="R2 access key id must be 32 lowercase hex"):
        BucketCommitment(
            provider=Provider.R2, account_id="a" * 32, bucket="abc", credentials=AWS_CREDS
        )
    creds = ReadCredentials(access_key_id="a" * 32, secret_access_key="B" * 64)
    with pytest.raises(ValidationError, match="R2 secret must be 64 lowercase hex"):
        BucketCommitment(provider=Provider.R2, account_id="a" * 32, bucket="abc", credentials=creds)
    with pytest.raises(ValidationError, match="host too long"):
        minio("a" * 300)
    with pytest.raises(TypeError, match="expected BucketCommitment"):
        render_commitment("not a commitment")  # type: ignore[arg-type]
    unchecked = BucketCommitment.model_construct(  # validators skipped: rendering still checks
        provider=Provider.R2, account_id="not hex", bucket="abc",
        credentials=ReadCredentials(access_key_id="a" * 32, secret_access_key="b" * 64),
    )  # fmt: skip
    with pytest.raises(CommitmentError, match="cannot be rendered"):
        render_commitment(unchecked)


def test_uncarriable_credentials() -> None:
    with pytest.raises(ValidationError):
        BucketCommitment(
            provider=Provider.S3,
            region="us-east-1",
            bucket="abc",
            credentials=ReadCredentials(access_key_id="has space", secret_access_key="x"),
        )


def test_encodings_are_canonical() -> None:
    body = bytearray(render_commitment(aws()))
    # re-encode the base64-packed key id as ASCII: same meaning, different bytes -> refused
    region_len = body[1] & 0x3F
    pos = 2 + region_len
    assert body[pos] >> 6 == 2
    ascii_key = bytes([len(AWS_CREDS.access_key_id)]) + AWS_CREDS.access_key_id.encode()
    alt = bytes(body[:pos]) + ascii_key + bytes(body[pos + 1 + 15 :])
    with pytest.raises(CommitmentError, match="non-canonical"):
        parse_commitment(alt)


@pytest.mark.parametrize(
    ("data", "rule"),
    [
        (b"", "1..384 bytes"),
        (b"\x00", "unsupported commitment version 0"),
        (b"\x11", "truncated"),  # R2 header, nothing else
        (b"\x21" + b"\x00" * 70, "version 2"),
        (b"\x1f" + b"\x00" * 70, "unknown provider 15"),
        (b"\x10" + b"\x00" * 70, "unknown provider 0"),
        (b"0" * 128, "version 3"),  # an ASCII-hex commitment of another format
        (b"\x11" + b"\x00" * 64, "no bucket name"),
        (b"\x11" + b"\x00" * 64 + b"ABC", "disallowed characters"),
        (b"\x11" + b"\x00" * 64 + b"a\xffc", "non-ASCII"),
        (b"\x11" + b"\x00" * 64 + b"a" * 64, "bucket must be 3-63"),  # bucket too long
        (b"\x13" + b"\xc9" + b"\x00" * 9, "reserved string encoding"),
        (b"\x13" + b"\x00", "empty string field"),  # empty region
        (b"\x13\x09us-east-1\x82AB", "multiple of 3"),
        (b"\x14\x00", "empty host"),
        (b"\x11" * (MAX_COMMITMENT_BYTES + 1), "1..384 bytes"),
    ],
)
def test_malformed_bodies(data: bytes, rule: str) -> None:
    """Each body is refused by its own rule (the message): deleting any one check fails this."""
    with pytest.raises(CommitmentError, match=rule):
        parse_commitment(data)


def test_local_and_plain_http_buckets_are_refused_outside_simulations() -> None:
    local = BucketCommitment(
        provider=Provider.LOCAL, bucket="peer-7", region="local",
        credentials=ReadCredentials(access_key_id="local", secret_access_key="local"),
    )  # fmt: skip
    for commitment, rule in [
        (local, "local \\(file://\\) buckets are refused"),
        (minio("minio.example.org", Provider.HTTP), "plain-http endpoints are refused"),
    ]:
        body = render_commitment(commitment)
        with pytest.raises(CommitmentError, match=rule):
            parse_commitment(body)
        assert parse_commitment(body, allow_private_endpoints=True) == commitment


def test_on_chain_fields_are_joined_strictly() -> None:
    body = render_commitment(minio("minio.example.org"))
    assert join_commitment_fields([body]) == body
    for fields, rule in [
        ([], "1..3 fields"),
        ([body] * 4, "1..3 fields"),
        (body, "1..3 fields"),  # one bytes object, not a list of fields
        (["text"], "must be bytes"),
        ([b"x", body], "but the last must hold 128 bytes"),
    ]:
        with pytest.raises(CommitmentError, match=rule):
            join_commitment_fields(fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("data", [None, "string", 5, [b"x"]])
def test_non_bytes(data: object) -> None:
    with pytest.raises(CommitmentError):
        parse_commitment(data)  # type: ignore[arg-type]


def _only_commitment_error(data: bytes, allow_private: bool = False) -> None:
    try:
        c = parse_commitment(data, allow_private_endpoints=allow_private)
    except CommitmentError:
        return
    assert render_commitment(c) == data  # anything accepted is canonical


@settings(max_examples=600, deadline=None)
@given(st.binary(max_size=MAX_COMMITMENT_BYTES + 8), st.booleans())
def test_fuzz_random_bytes(data: bytes, allow_private: bool) -> None:
    _only_commitment_error(data, allow_private)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([Provider.R2, Provider.S3, Provider.HTTPS]), st.integers(0, 127))
def test_fuzz_header_plus_noise(provider: Provider, noise_len: int) -> None:
    _only_commitment_error(bytes([0x10 | provider]) + secrets.token_bytes(noise_len))


_VALID = [render_commitment(c) for c in (r2(), r2("a" * 63), aws(), minio())]


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    base=st.sampled_from(_VALID),
    cut=st.integers(0, 128),
    edits=st.lists(st.tuples(st.integers(0, 127), st.integers(0, 255)), max_size=4),
    allow_private=st.booleans(),
)
def test_fuzz_truncated_and_mutated(
    base: bytes, cut: int, edits: list[tuple[int, int]], allow_private: bool
) -> None:
    data = bytearray(base)
    for pos, value in edits:
        if data:
            data[pos % len(data)] = value
    _only_commitment_error(bytes(data[: max(0, len(data) - cut)]), allow_private)
    _only_commitment_error(bytes(data) + b"a", allow_private)


def test_truncations_of_valid_bodies_all_fail() -> None:
    for body in _VALID:
        for n in range(len(body)):
            prefix = body[:n]
            try:
                parsed = parse_commitment(prefix, allow_private_endpoints=True)
            except CommitmentError:
                continue
            # only a bucket name can be cut and still be valid (it is the tail)
            assert parsed.bucket != parse_commitment(body, allow_private_endpoints=True).bucket


def test_repr_is_short_and_has_no_secret() -> None:
    c = r2()
    assert c.credentials.secret_access_key not in repr(c)
    assert c.credentials.secret_access_key not in str(c)
