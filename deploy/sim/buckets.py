"""Buckets for a simulation on an S3-compatible server (MinIO, or moto in tests)."""

from __future__ import annotations

import os
from urllib.parse import parse_qs, urlsplit

import boto3
from botocore.exceptions import ClientError


def ensure_s3_bucket(url: str) -> None:
    """Create the bucket of an `s3://BUCKET?endpoint=…` URL with the env's write key if missing."""
    parts = urlsplit(url)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    client = boto3.client(
        "s3",
        endpoint_url=query.get("endpoint"),
        region_name=query.get("region", "us-east-1"),
        aws_access_key_id=os.environ.get(
            "TESSERA_S3_ACCESS_KEY_ID", os.environ.get("AWS_ACCESS_KEY_ID")
        ),
        aws_secret_access_key=os.environ.get(
            "TESSERA_S3_SECRET_ACCESS_KEY", os.environ.get("AWS_SECRET_ACCESS_KEY")
        ),
    )
    try:
        client.create_bucket(Bucket=parts.netloc)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in (
            "BucketAlreadyOwnedByYou",
            "BucketAlreadyExists",
        ):
            raise


def read_key_env() -> dict[str, str]:
    """The read key peers commit on chain: TESSERA_S3_READ_* if set, else (local sim) the write key."""
    env = os.environ
    return {
        "TESSERA_S3_READ_ACCESS_KEY_ID": env.get("TESSERA_S3_READ_ACCESS_KEY_ID")
        or env.get("TESSERA_S3_ACCESS_KEY_ID", env.get("AWS_ACCESS_KEY_ID", "")),
        "TESSERA_S3_READ_SECRET_ACCESS_KEY": env.get("TESSERA_S3_READ_SECRET_ACCESS_KEY")
        or env.get("TESSERA_S3_SECRET_ACCESS_KEY", env.get("AWS_SECRET_ACCESS_KEY", "")),
    }
