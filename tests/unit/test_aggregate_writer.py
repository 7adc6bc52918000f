"""The aggregate object written one update at a time is the object `msgpack.packb` would give,
its signature verifies, and it is read back by `read_aggregate_bytes`; a spooled update that
changed before publishing stops the publication."""

from __future__ import annotations

import io
import os
from pathlib import Path

import msgpack
import pytest
from substrateinterface import Keypair

from codec.spec import ModelSpec
from node.model.llama import build_model
from node.window.aggregate_writer import write_aggregate
from node.window.history import publish_aggregate, read_aggregate_bytes
from protocol.naming import ObjectKind
from protocol.runconfig import RunConfig
from protocol.signing import payload_digest, verify_object
from protocol.stores import FileStore
from protocol.stores.spool import InMemory, Sink, Spooled, SpoolError

RUN = RunConfig.preset("tiny", name="aggregate-writer")
KEY = Keypair.create_from_uri("//aggregate-writer")
WINDOW, UID = 7, 3
# every msgpack bin header (bin8, bin16, bin32) for entries, and a body over 64 KiB (bin32)
SIZES = {0: 0, 1: 1, 2: 255, 3: 256, 5: 65535, 8: 65536, 13: 70_000}
HOTKEYS = {u: f"hotkey-{u}" for u in SIZES}


def _updates() -> dict[int, bytes]:
    return {uid: os.urandom(n) for uid, n in SIZES.items()}


def _spooled(directory: Path, updates: dict[int, bytes]) -> dict[int, Spooled]:
    out = {}
    for uid, data in updates.items():
        with Sink(directory / str(uid)) as sink:
            sink.write(data)
            body = sink.finish()
        assert isinstance(body, Spooled)
        out[uid] = body
    return out


def test_the_streamed_object_is_what_packb_gives(tmp_path: Path) -> None:
    updates = _updates()
    for bodies in (
        {u: InMemory.of(d) for u, d in updates.items()},
        _spooled(tmp_path, updates),
    ):
        out = io.BytesIO()
        hotkeys = {u: f"hotkey-{u}" for u in reversed(updates)}
        write_aggregate(out, RUN, WINDOW, UID, KEY, dict(reversed(bodies.items())), hotkeys)
        outer = msgpack.unpackb(out.getvalue())
        body, sig = outer["body"], outer["sig"]
        named = {u: f"hotkey-{u}" for u in sorted(updates)}
        expected = {"window": WINDOW, "hotkeys": named, "updates": dict(sorted(updates.items()))}
        assert body == msgpack.packb(expected)
        assert out.getvalue() == msgpack.packb({"body": body, "sig": sig})
        verify_object(
            KEY.ss58_address, sig, ObjectKind.AGGREGATE, RUN.run_id, WINDOW, UID,
            payload_digest(body),
        )  # fmt: skip


def test_published_from_the_spool_and_read_back(tmp_path: Path) -> None:
    spec = ModelSpec.from_module(build_model(RUN.model, RUN.seed))
    updates = _updates()
    bodies = _spooled(tmp_path, updates)
    store = FileStore(tmp_path / "bucket")
    publish_aggregate(store, RUN, WINDOW, UID, KEY, bodies, HOTKEYS, scratch=tmp_path)
    assert read_aggregate_bytes(store, RUN, spec, WINDOW, UID, KEY.ss58_address) == updates
    assert not list(tmp_path.glob("aggregate-*"))  # the scratch file is gone

    bodies[5].path.write_bytes(b"\0" * SIZES[5])  # changed in the spool since it was fetched
    with pytest.raises(SpoolError):
        publish_aggregate(store, RUN, WINDOW + 1, UID, KEY, bodies, HOTKEYS, scratch=tmp_path)
    assert len(store.list()) == 1  # window 7's object only
    assert not list(tmp_path.glob("aggregate-*"))
