"""Shared by the strategies' hostile-bytes tests (demo, sparseloco-mask, greedylore): take a
container apart, put a tampered header back over its payload with a valid payload digest, decode
as a receiving node does, and check that a whole corpus is refused with `DecodeError`, fast."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import msgpack
import pytest

from codec.errors import DecodeError
from codec.frame import payload_digest
from codec.spec import ModelSpec
from node.strategy import make_strategy
from protocol.runconfig import RunConfig


def split(frame: Any, data: bytes) -> tuple[dict, bytes]:
    """The header (decoded) and the payload of one container."""
    raw, payload = frame.split(data, len(data))
    return msgpack.unpackb(bytes(raw), raw=False), bytes(payload)


def reframe(frame: Any, header: dict, payload: bytes) -> bytes:
    """A container of ``header`` over ``payload``, the header's digest fixed to the payload."""
    header = {**header, "digest": payload_digest(payload)}
    return frame.pack(msgpack.packb(header, use_bin_type=True), payload)


def decode(spec: ModelSpec, run: RunConfig, data: bytes) -> None:
    """Decode ``data`` as a node of ``run`` does, under the run's update cap."""
    strategy = make_strategy(run, spec)
    strategy.format.decode(data, strategy.format.max_update_bytes())


def assert_refused_quickly(
    corpus: Mapping[str, bytes], decode_one: Callable[[bytes], None], seconds: float = 2.0
) -> None:
    """Every item raises `DecodeError`, each within ``seconds``."""
    for name, data in corpus.items():
        t0 = time.perf_counter()
        with pytest.raises(DecodeError):
            decode_one(data)
        assert time.perf_counter() - t0 < seconds, name
