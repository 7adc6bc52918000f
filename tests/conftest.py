"""Shared fixtures: an in-process S3 server (moto) on loopback.

- `s3_server` (session): endpoint URL of a `ThreadedMotoServer` on 127.0.0.1, free port.
- `s3_bucket`: a fresh, empty bucket on that server (its name).
- `s3_credentials`: write credentials the server accepts (moto accepts any key by default).
- `s3_url`: the store URL of `s3_bucket`, for `protocol.stores.open_store`.

IAM: under `enforced_iam` moto accepts only the keys of `tests.support.servers.iam_user`, with
their policies (a real read-only key is refused writes); without it, any key may do anything (the
stand-in for a key that can write).

The suite's layout: `tests/unit` (one process, real components), `tests/deadlines` (tests timed
against the wall clock: run at normal priority), `tests/e2e` (real peers and validators as
processes on a ticking chain clock, marked `slow`), `tests/support` (helpers and data the tests
share).
"""

from __future__ import annotations

import os

# Before anything imports torch: torch.distributed's FSDP imports `triton` (through dynamo), and
# `triton.language` reads this variable when it is first imported. Set later, its library
# functions stay compiled-only and the interpreted kernels cannot call them (tests/unit/test_triton_*).
os.environ.setdefault("TRITON_INTERPRET", "1")

import itertools
import logging
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from moto.core.authorization import enable_iam_authentication

from protocol.credentials import WriteCredentials
from tests.support.servers import (
    TEST_ACCESS_KEY_ID,
    TEST_SECRET,
    start_moto_server,
    stop_moto_server,
)

_bucket_numbers = itertools.count()


@pytest.fixture(autouse=True)
def _logging_as_it_was() -> Iterator[None]:
    """A command run in-process (`commands.cli.main`) sets the process's logging up: its handler
    writes to the stream that was `sys.stderr` then, which pytest closes after the test. The root
    and project loggers are put back as they were, so no later test logs into a closed stream."""
    root, project = logging.getLogger(), logging.getLogger("tessera")
    handlers, levels = root.handlers[:], (root.level, project.level)
    yield
    root.handlers[:] = handlers
    root.setLevel(levels[0])
    project.setLevel(levels[1])


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


@pytest.fixture
def enforced_iam() -> Iterator[None]:
    with enable_iam_authentication():
        yield


@pytest.fixture
def fast_manifest_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node reads the deciders' buckets again at once (for chains that step per look)."""
    from node.window import consensus

    monkeypatch.setattr(consensus, "MANIFEST_POLL_S", 0.0)
    monkeypatch.setattr(consensus, "MANIFEST_POLL_MAX_S", 0.0)
