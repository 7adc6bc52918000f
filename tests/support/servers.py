"""Servers the tests run on loopback: a plain HTTP server with a given handler, moto's S3 server
and IAM users on it.

`start_moto_server()` / `stop_moto_server()` start and fully stop a server (e.g. to make one go
away during a test). All moto servers of a process share one in-memory backend. `iam_user()`
creates a moto IAM user allowed some actions on some buckets and returns its key.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import boto3
from moto.server import ThreadedMotoServer

from lab.sim.flaky_s3 import start_embedded_s3

TEST_ACCESS_KEY_ID = "tessera-test-key"
TEST_SECRET = "tessera-test-secret"


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
    """Start a moto S3 server on a free loopback port; returns it and its endpoint URL (the
    simulation's embedded provider, `lab.sim.flaky_s3.start_embedded_s3`)."""
    return start_embedded_s3()


def stop_moto_server(server: ThreadedMotoServer) -> None:
    """Stop serving and close the listening socket, so that new connections are refused."""
    server.stop()
    inner = getattr(server, "_server", None)  # moto's stop() leaves the socket open
    if inner is not None:
        inner.server_close()


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
