"""Shared fixtures: an in-process S3 server (moto) on loopback.

- `s3_server` (session): endpoint URL of a `ThreadedMotoServer` on 127.0.0.1, free port.
- `s3_bucket`: a fresh, empty bucket on that server (its name).
- `s3_credentials`: write credentials the server accepts (moto accepts any key by default).
- `s3_url`: the store URL of `s3_bucket`, for `protocol.stores.open_store`.

`start_moto_server()` / `stop_moto_server()` start and fully stop an extra server (e.g. to make
one go away during a test). All moto servers of a process share one in-memory backend.

IAM: `iam_user()` creates a moto IAM user allowed some actions on some buckets and returns its key;
under `enforced_iam` moto accepts only such keys, with their policies (a real read-only key is
refused writes); without it, any key may do anything (the stand-in for a key that can write).
"""

from __future__ import annotations

import os

# Before anything imports torch: torch.distributed's FSDP imports `triton` (through dynamo), and
# `triton.language` reads this variable when it is first imported. Set later, its library
# functions stay compiled-only and the interpreted kernels cannot call them (tests/test_triton_*).
os.environ.setdefault("TRITON_INTERPRET", "1")

import itertools
import json
import logging
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import boto3
import pytest
from moto.core.authorization import enable_iam_authentication
from moto.server import ThreadedMotoServer

from protocol.credentials import WriteCredentials

TEST_ACCESS_KEY_ID = "tessera-test-key"
TEST_SECRET = "tessera-test-secret"
_bucket_numbers = itertools.count()


@contextmanager
def http_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A threaded HTTP server on a free loopback port answering with `handler`; yields its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def start_moto_server() -> tuple[ThreadedMotoServer, str]:
    """Start a moto S3 server on a free loopback port; returns it and its endpoint URL."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no access log per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


def stop_moto_server(server: ThreadedMotoServer) -> None:
    """Stop serving and close the listening socket, so that new connections are refused."""
    server.stop()
    inner = getattr(server, "_server", None)  # moto's stop() leaves the socket open
    if inner is not None:
        inner.server_close()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    server, endpoint = start_moto_server()
    yield endpoint
    stop_moto_server(server)


@pytest.fixture(scope="session")
def _s3_admin(s3_server: str) -> Iterator[Any]:
    client = boto3.client(
        "s3",
        endpoint_url=s3_server,
        region_name="us-east-1",
        aws_access_key_id=TEST_ACCESS_KEY_ID,
        aws_secret_access_key=TEST_SECRET,
    )
    yield client
    client.close()


@pytest.fixture
def s3_credentials() -> WriteCredentials:
    return WriteCredentials(TEST_ACCESS_KEY_ID, TEST_SECRET)


@pytest.fixture
def s3_bucket(_s3_admin: Any) -> str:
    name = f"tessera-test-{os.getpid()}-{next(_bucket_numbers)}"
    _s3_admin.create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_url(s3_server: str, s3_bucket: str) -> str:
    return f"s3://{s3_bucket}?endpoint={s3_server}&region=us-east-1"


def iam_user(endpoint: str, bucket: str, actions: list[str]) -> tuple[str, str]:
    """An IAM user allowed `actions` on `bucket` (a name or a pattern such as ``sim-*``) and its
    objects; returns its access key id and secret."""
    iam = boto3.client(
        "iam",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=TEST_ACCESS_KEY_ID,
        aws_secret_access_key=TEST_SECRET,
    )
    name = f"tessera-{uuid.uuid4().hex[:12]}"
    iam.create_user(UserName=name)
    policy = {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Action": actions,
                "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"],
            }
        ],
    }
    iam.put_user_policy(UserName=name, PolicyName="bucket", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName=name)["AccessKey"]
    iam.close()
    return key["AccessKeyId"], key["SecretAccessKey"]


@pytest.fixture
def enforced_iam() -> Iterator[None]:
    with enable_iam_authentication():
        yield
