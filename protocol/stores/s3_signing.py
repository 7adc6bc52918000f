"""Signed S3 requests for clients other than boto3 (the asyncio gather in `protocol.stores.fetch`)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote

from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

__all__ = ["SigningTarget"]


@dataclass(frozen=True)
class SigningTarget:
    """Where a bucket is (path-style) and the key that signs requests to it."""

    endpoint: str
    bucket: str
    region: str
    credentials: Credentials

    def url(self, key: str) -> str:
        return f"{self.endpoint.rstrip('/')}/{self.bucket}/{quote(key, safe='/~')}"

    def signed_get(self, key: str) -> tuple[str, dict[str, str]]:
        """The URL and SigV4 headers of a GET of `key`."""
        url = self.url(key)
        request = AWSRequest(method="GET", url=url)
        S3SigV4Auth(self.credentials, "s3", self.region).add_auth(request)
        return url, {k: str(v) for k, v in request.headers.items()}

    def __repr__(self) -> str:  # never print the secret
        return f"SigningTarget({self.endpoint}, {self.bucket}, {self.region})"
