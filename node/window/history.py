"""The run's history for late peers: per-window aggregates and periodic checkpoints.

A validator publishes, in its own bucket:

* per window, an **aggregate** object: the exact wire bytes of every update that window applied
  (each still signed by its own peer), so a late peer re-verifies and re-aggregates them and lands
  on bit-identical weights — a dense aggregate would be both larger and unverifiable;
* every few windows, a **checkpoint** (safetensors of the weights at the *start* of a window) and
  its **manifest** (window, size, SHA-256), written checkpoint first so a manifest never points at
  a missing file.

`catch_up` loads the newest checkpoint at or before the target window and replays the aggregates
from there. Everything read here is hostile: sizes are capped, digests checked, every update
verified and decoded strictly.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping

import msgpack
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from substrateinterface import Keypair

from codec.errors import DecodeError
from codec.spec import ModelSpec
from node.window.exchange import check_update, max_update_bytes
from node.window.outer_step import apply_updates
from protocol.naming import (
    ObjectKind,
    aggregate_key,
    checkpoint_key,
    manifest_key,
    parse_key,
)
from protocol.runconfig import RunConfig
from protocol.signing import SignatureError, payload_digest, sign_object, verify_object
from protocol.stores import ObjectNotFound, ObjectStore, ReadableStore, StoreError

log = logging.getLogger(__name__)

MAX_MANIFEST_BYTES = 64 << 10


class HistoryError(RuntimeError):
    """The published history cannot bring this peer to the requested window."""


def publish_aggregate(
    store: ObjectStore,
    run: RunConfig,
    window: int,
    uid: int,
    keypair: Keypair,
    updates: Mapping[int, bytes],
) -> str:
    """Publish the exact update bytes a window applied, keyed by peer uid, signed by us."""
    body = msgpack.packb(
        {"window": window, "updates": {int(k): v for k, v in sorted(updates.items())}}
    )
    digest = payload_digest(body)
    sig = sign_object(keypair, ObjectKind.AGGREGATE, run.run_id, window, uid, digest)
    key = aggregate_key(run.run_id, window, uid, keypair.ss58_address)
    store.put(key, msgpack.packb({"body": body, "sig": sig}))
    return key


def publish_checkpoint(
    store: ObjectStore,
    run: RunConfig,
    window: int,
    uid: int,
    keypair: Keypair,
    model: torch.nn.Module,
) -> str:
    """Publish the weights at the start of `window` and then their manifest."""
    params = {k: v.detach().cpu().contiguous() for k, v in model.named_parameters()}  # tied once
    data = save_safetensors(params)
    store.put(checkpoint_key(run.run_id, window, uid, keypair.ss58_address), data)
    manifest = {
        "run_id": run.run_id,
        "window": window,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    key = manifest_key(run.run_id, window, uid, keypair.ss58_address)
    store.put(key, json.dumps(manifest).encode())
    return key


def read_aggregate_bytes(
    store: ReadableStore, run: RunConfig, spec: ModelSpec, window: int, uid: int, hotkey: str
) -> dict[int, bytes]:
    """The exact update bytes a validator published for `window` (signature checked)."""
    cap = 4096 * max_update_bytes(spec, run)
    try:
        raw = msgpack.unpackb(
            store.get(aggregate_key(run.run_id, window, uid, hotkey), cap), max_bin_len=cap
        )
        if (
            not isinstance(raw, dict)
            or set(raw) != {"body", "sig"}
            or not isinstance(raw["body"], bytes)
        ):
            raise DecodeError("malformed aggregate object")
        verify_object(
            hotkey,
            raw["sig"],
            ObjectKind.AGGREGATE,
            run.run_id,
            window,
            uid,
            payload_digest(raw["body"]),
        )
        body = msgpack.unpackb(raw["body"], strict_map_key=False, max_bin_len=cap)
        if (
            not isinstance(body, dict)
            or body.get("window") != window
            or not isinstance(body.get("updates"), dict)
        ):
            raise DecodeError("aggregate body does not match its window")
        return {
            int(k): bytes(v)
            for k, v in body["updates"].items()
            if isinstance(k, int) and isinstance(v, bytes)
        }
    except (StoreError, DecodeError, SignatureError, ValueError, msgpack.ExtraData) as exc:
        raise HistoryError(f"aggregate of window {window}: {exc}") from exc


def _read_aggregate(
    store: ReadableStore,
    run: RunConfig,
    spec: ModelSpec,
    window: int,
    uid: int,
    hotkey: str,
    peers: Mapping[int, str],
) -> dict[int, list]:
    cap = 4096 * max_update_bytes(spec, run)
    raw = msgpack.unpackb(
        store.get(aggregate_key(run.run_id, window, uid, hotkey), cap), max_bin_len=cap
    )
    if not isinstance(raw, dict) or set(raw) != {"body", "sig"}:
        raise DecodeError("malformed aggregate object")
    verify_object(
        hotkey,
        raw["sig"],
        ObjectKind.AGGREGATE,
        run.run_id,
        window,
        uid,
        payload_digest(raw["body"]),
    )
    body = msgpack.unpackb(raw["body"], strict_map_key=False, max_bin_len=cap)
    if (
        not isinstance(body, dict)
        or body.get("window") != window
        or not isinstance(body.get("updates"), dict)
    ):
        raise DecodeError("aggregate body does not match its window")
    out = {}
    for peer_uid, data in sorted(body["updates"].items()):
        if peer_uid not in peers:
            raise DecodeError(f"aggregate names uid {peer_uid}, which has no known hotkey")
        out[peer_uid] = check_update(data, peer_uid, peers[peer_uid], run, spec, window).tensors
    return out


def latest_checkpoint(
    store: ReadableStore, run: RunConfig, uid: int, hotkey: str, at_most: int
) -> tuple[int, dict[str, torch.Tensor]] | None:
    """The newest checkpoint of this publisher starting at a window <= `at_most`."""
    windows = []
    for info in store.list(f"{run.run_id}/"):
        try:
            key = parse_key(info.key)
        except ValueError:
            continue
        if key.kind == ObjectKind.MANIFEST and key.uid == uid and key.window <= at_most:
            windows.append(key.window)
    for window in sorted(windows, reverse=True):
        try:
            manifest = json.loads(
                store.get(manifest_key(run.run_id, window, uid, hotkey), MAX_MANIFEST_BYTES)
            )
            size = int(manifest["bytes"])
            data = store.get(checkpoint_key(run.run_id, window, uid, hotkey), size)
            if (
                hashlib.sha256(data).hexdigest() != manifest["sha256"]
                or manifest["window"] != window
            ):
                raise DecodeError("checkpoint digest or window mismatch")
            return window, load_safetensors(data)
        except (StoreError, DecodeError, ValueError, KeyError, TypeError) as exc:
            log.warning("checkpoint of window %d unusable: %s", window, exc)
    return None


def catch_up(
    model: torch.nn.Module,
    run: RunConfig,
    spec: ModelSpec,
    source: ReadableStore,
    source_uid: int,
    source_hotkey: str,
    peers: Mapping[int, str],
    from_window: int,
    to_window: int,
) -> int:
    """Bring `model` from the start of `from_window` towards the start of `to_window`.

    Loads a newer checkpoint when one helps, then replays the published aggregates in order,
    stopping early at the first one not published yet. Returns the window the model is now at.
    Raises `HistoryError` when the source publishes something invalid (then the model may be
    anywhere in between: restore it before trying another source).
    """
    ckpt = latest_checkpoint(source, run, source_uid, source_hotkey, to_window)
    window = from_window
    if ckpt is not None and ckpt[0] > from_window:
        window, weights = ckpt
        names = dict(model.named_parameters())
        if set(weights) != set(names) or any(weights[n].shape != p.shape for n, p in names.items()):
            raise HistoryError(f"checkpoint of window {window} does not fit this model")
        with torch.no_grad():
            for n, p in names.items():
                p.copy_(weights[n])
        log.info("loaded checkpoint of window %d", window)
    while window < to_window:
        try:
            updates = _read_aggregate(source, run, spec, window, source_uid, source_hotkey, peers)
        except ObjectNotFound:
            break  # not published (yet): the model is consistently at `window`
        except (StoreError, DecodeError, SignatureError) as exc:
            raise HistoryError(f"cannot replay window {window}: {exc}") from exc
        apply_updates(model, updates, run, spec)
        window += 1
    return window
