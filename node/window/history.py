"""The run's history: per-window aggregates and periodic checkpoints, published and replayed.

A validator publishes, in its own bucket:

* per window, an **aggregate** object: the exact wire bytes of every update that window applied
  (each still signed by its own peer), signed by the validator, so a node that replays it
  re-verifies and re-aggregates them and lands on bit-identical weights;
* every few windows, a **checkpoint** (safetensors of the weights at the *start* of a window, and
  of the strategy's outer-optimizer state under ``outer/`` names, e.g. Nesterov momentum or, with
  ``outer.delay = 1``, the previous window's mean still to apply, so a replay from it continues
  bit for bit) and its **manifest** (run id, window, size, SHA-256),
  signed by the validator and written after the checkpoint, so a manifest never points at a
  missing file.

Replaying takes the window's one step through the run's strategy (`node.strategy`): its
aggregator's mean of the window's updates, then its outer step, which carries the outer state
along; callers pass the aggregator and outer step that belong to the model they replay.

Everything read here is hostile. Sizes are capped from the run config (`HistoryCaps`), never from
what a publisher claims; every field is type-checked before it is hashed, converted or used to
size anything; signatures are verified before anything they cover is used. Whatever is wrong —
garbage, a refused listing, a timeout — surfaces as one `HistoryError`, and `catch_up_any` /
`resync` then fall through to the next validator.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgpack
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from substrateinterface import Keypair

from codec.errors import DecodeError, TesseraError
from codec.spec import ModelSpec
from node.model.fingerprint import fingerprint
from node.model.llama import build_model
from node.strategy import make_strategy
from node.strategy.aggregator import Aggregator
from node.strategy.outer import OuterOptimizer
from node.window.aggregate_writer import write_aggregate
from node.window.buckets import peer_buckets
from node.window.exchange import check_update, max_update_bytes
from protocol.chain.base import Chain
from protocol.naming import ObjectKind, aggregate_key, checkpoint_key, manifest_key, parse_key
from protocol.runconfig import RunConfig
from protocol.signing import SignatureError, payload_digest, sign_object, verify_object
from protocol.stores import ObjectNotFound, ObjectStore, ReadableStore, StoreError
from protocol.stores.spool import Body, InMemory

log = logging.getLogger(f"tessera.{__name__}")

MANIFEST_CAP = 4096
SAFETENSORS_SLACK = 1 << 20  # header: names, dtypes, shapes and offsets of every tensor
OUTER_PREFIX = "outer/"  # checkpoint names of the outer optimizer's state


class HistoryError(TesseraError, RuntimeError):
    """A validator's published history cannot be used (or cannot bring us where we asked)."""


@dataclass(frozen=True)
class Source:
    """One validator's published history: its uid, hotkey and (read-only) bucket."""

    uid: int
    hotkey: str
    store: ReadableStore


@dataclass(frozen=True)
class HistoryCaps:
    """The most bytes a legitimate history object of this run can need."""

    checkpoint: int
    aggregate: int

    @classmethod
    def of(cls, run: RunConfig, spec: ModelSpec) -> HistoryCaps:
        outer = sum(math.prod(s) for s in make_strategy(run, spec).outer.shapes().values())
        return cls(
            checkpoint=4 * (spec.numel + outer) + SAFETENSORS_SLACK,
            aggregate=run.gather_size * (max_update_bytes(spec, run) + 64) + 4096,
        )


# -- publishing ------------------------------------------------------------------------------------


def publish_aggregate(
    store: ObjectStore,
    run: RunConfig,
    window: int,
    uid: int,
    keypair: Keypair,
    updates: Mapping[int, bytes | Body],
    hotkeys: Mapping[int, str],
    scratch: Path | None = None,
) -> str:
    """Publish the exact update bytes a window applied, keyed by peer uid, with the hotkey each
    was verified under at the window's roster (`hotkeys`: at least every uid of `updates`),
    signed by us.

    The object is written to a temporary file in `scratch` (default: the system's) one update
    at a time (`node.window.aggregate_writer`), and uploaded from there."""
    bodies = {k: InMemory.of(v) if isinstance(v, bytes) else v for k, v in updates.items()}
    key = aggregate_key(run.run_id, window, uid, keypair.ss58_address)
    with tempfile.NamedTemporaryFile(dir=scratch, prefix="aggregate-") as out:
        write_aggregate(out.file, run, window, uid, keypair, bodies, hotkeys)
        out.flush()
        store.put_file(key, out.name)
    return key


def publish_checkpoint(
    store: ObjectStore,
    run: RunConfig,
    window: int,
    uid: int,
    keypair: Keypair,
    model: torch.nn.Module,
    *,
    outer: Mapping[str, torch.Tensor],
) -> str:
    """Publish the weights at the start of `window` with the outer optimizer's state there
    (`OuterOptimizer.state_dict`), then their signed manifest."""
    params = {k: v.detach().cpu().contiguous() for k, v in model.named_parameters()}  # tied once
    params |= {OUTER_PREFIX + k: v.detach().cpu().contiguous() for k, v in outer.items()}
    data = save_safetensors(params)
    store.put(checkpoint_key(run.run_id, window, uid, keypair.ss58_address), data)
    body = {
        "run_id": run.run_id,
        "window": window,
        "uid": uid,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    raw = _canonical(body)
    sig = sign_object(keypair, ObjectKind.MANIFEST, run.run_id, window, uid, payload_digest(raw))
    key = manifest_key(run.run_id, window, uid, keypair.ss58_address)
    store.put(key, json.dumps({"body": body, "sig": sig.hex()}).encode())
    return key


def _canonical(body: Mapping[str, object]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


# -- reading -----------------------------------------------------------------------------------


def read_aggregate_bytes(
    store: ReadableStore, run: RunConfig, spec: ModelSpec, window: int, uid: int, hotkey: str
) -> dict[int, bytes]:
    """The exact update bytes a validator published for `window` (its signature verified).

    `ObjectNotFound` when it is not published (yet); `HistoryError` for anything else wrong."""
    return read_aggregate_object(store, run, spec, window, uid, hotkey)[0]


def read_aggregate_object(
    store: ReadableStore, run: RunConfig, spec: ModelSpec, window: int, uid: int, hotkey: str
) -> tuple[dict[int, bytes], dict[int, str]]:
    """(update bytes, the hotkey each was verified under) of a validator's aggregate of
    `window`, its signature verified; errors as `read_aggregate_bytes`."""
    cap = HistoryCaps.of(run, spec).aggregate
    try:
        raw = store.get(aggregate_key(run.run_id, window, uid, hotkey), cap)
    except ObjectNotFound:
        raise
    except StoreError as exc:
        raise HistoryError(f"aggregate of window {window}: {exc}") from exc
    outer = _unpack(raw, cap, max_map=2)
    if not isinstance(outer, dict) or set(outer) != {"body", "sig"}:
        raise HistoryError(f"aggregate of window {window} is not {{body, sig}}")
    body, sig = outer["body"], outer["sig"]
    if not isinstance(body, bytes) or not isinstance(sig, bytes):
        raise HistoryError(f"aggregate of window {window}: body and sig must be bytes")
    try:
        verify_object(
            hotkey, sig, ObjectKind.AGGREGATE, run.run_id, window, uid, payload_digest(body)
        )
    except SignatureError as exc:
        raise HistoryError(f"aggregate of window {window}: {exc}") from exc
    inner = _unpack(body, cap, max_map=max(3, run.gather_size))
    if not isinstance(inner, dict) or set(inner) != {"window", "hotkeys", "updates"}:
        raise HistoryError(f"aggregate of window {window} is not {{window, hotkeys, updates}}")
    updates, hotkeys = inner["updates"], inner["hotkeys"]
    if inner["window"] != window or not isinstance(updates, dict) or not isinstance(hotkeys, dict):
        raise HistoryError(f"aggregate body does not match window {window}")
    if not all(
        isinstance(k, int) and 0 <= k <= 65535 and isinstance(v, bytes) for k, v in updates.items()
    ):
        raise HistoryError(f"aggregate of window {window}: entries must be uid -> bytes")
    if set(hotkeys) != set(updates) or not all(isinstance(v, str) for v in hotkeys.values()):
        raise HistoryError(f"aggregate of window {window}: hotkeys must name every entry's")
    return dict(sorted(updates.items())), hotkeys


def _unpack(data: bytes, cap: int, max_map: int) -> object:
    try:
        return msgpack.unpackb(
            data,
            strict_map_key=False,
            raw=False,
            max_bin_len=cap,
            max_str_len=256,
            max_array_len=16,
            max_map_len=max_map,
            max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.UnpackException, msgpack.ExtraData) as exc:
        raise HistoryError(f"not a valid history object: {type(exc).__name__}") from None


def read_aggregate(source: Source, run: RunConfig, spec: ModelSpec, window: int) -> dict[int, list]:
    """The verified, decoded updates a validator published for `window`, each verified under
    the hotkey the validator recorded for it at that window's roster (a uid registered again
    since has another hotkey today)."""
    out = {}
    raw, hotkeys = read_aggregate_object(source.store, run, spec, window, source.uid, source.hotkey)
    for peer_uid, data in raw.items():
        try:
            out[peer_uid] = check_update(
                data, peer_uid, hotkeys[peer_uid], run, spec, window
            ).tensors
        except (DecodeError, SignatureError) as exc:
            raise HistoryError(f"window {window}, uid {peer_uid}: {exc}") from exc
    return out


def _read_manifest(source: Source, run: RunConfig, window: int) -> dict:
    key = manifest_key(run.run_id, window, source.uid, source.hotkey)
    try:
        outer = json.loads(source.store.get(key, MANIFEST_CAP))
    except ValueError as exc:
        raise HistoryError(f"checkpoint manifest of window {window} is not JSON") from exc
    if not isinstance(outer, dict) or set(outer) != {"body", "sig"}:
        raise HistoryError(f"checkpoint manifest of window {window} is not {{body, sig}}")
    body, sig = outer["body"], outer["sig"]
    fields = {"run_id": str, "window": int, "uid": int, "bytes": int, "sha256": str}
    if not isinstance(body, dict) or set(body) != set(fields) or not isinstance(sig, str):
        raise HistoryError(f"checkpoint manifest of window {window} has the wrong fields")
    if any(type(body[f]) is not t for f, t in fields.items()) or len(sig) != 128:
        raise HistoryError(f"checkpoint manifest of window {window} has the wrong types")
    expected = {"run_id": run.run_id, "window": window, "uid": source.uid}
    if any(body[f] != v for f, v in expected.items()):
        raise HistoryError(f"checkpoint manifest of window {window} names another object")
    try:
        verify_object(
            source.hotkey, bytes.fromhex(sig), ObjectKind.MANIFEST, run.run_id, window,
            source.uid, payload_digest(_canonical(body)),
        )  # fmt: skip
    except (SignatureError, ValueError) as exc:
        raise HistoryError(f"checkpoint manifest of window {window}: {exc}") from exc
    return body


def _load_checkpoint(
    source: Source, outer: OuterOptimizer, window: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(weights, outer state) of a verified checkpoint that fits this model and outer step."""
    run, spec = outer.run, outer.spec
    manifest = _read_manifest(source, run, window)
    cap = HistoryCaps.of(run, spec).checkpoint
    if not 0 < manifest["bytes"] <= cap:
        raise HistoryError(f"checkpoint of window {window} claims {manifest['bytes']} bytes")
    data = source.store.get(checkpoint_key(run.run_id, window, source.uid, source.hotkey), cap)
    if len(data) != manifest["bytes"] or hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        raise HistoryError(f"checkpoint of window {window} does not match its manifest")
    try:
        tensors = load_safetensors(data)
    except Exception as exc:  # safetensors raises its own error types on garbage
        raise HistoryError(f"checkpoint of window {window} is not safetensors") from exc
    shapes = {t.name: tuple(t.shape) for t in spec.tensors}
    outer_shapes = {OUTER_PREFIX + k: s for k, s in outer.shapes().items()}
    got = {n: tuple(w.shape) for n, w in tensors.items()}
    weights_got = {n: s for n, s in got.items() if not n.startswith(OUTER_PREFIX)}
    outer_got = {n: s for n, s in got.items() if n.startswith(OUTER_PREFIX)}
    # the outer state may hold any of its groups (none before the first step; each group is
    # checked whole when it is loaded)
    if weights_got != shapes or any(outer_shapes.get(n) != s for n, s in outer_got.items()):
        raise HistoryError(f"checkpoint of window {window} does not fit this model")
    if any(w.dtype != torch.float32 or not torch.isfinite(w).all() for w in tensors.values()):
        raise HistoryError(f"checkpoint of window {window} holds non-float32 or non-finite values")
    weights = {n: w for n, w in tensors.items() if n in shapes}
    state = {n[len(OUTER_PREFIX) :]: w for n, w in tensors.items() if n in outer_shapes}
    return weights, state


def latest_checkpoint(
    source: Source, outer: OuterOptimizer, at_most: int
) -> tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor]] | None:
    """The newest verified checkpoint of this source starting at a window <= `at_most` that fits
    the model and `outer` (a whole model's outer step): (window, weights, outer state)."""
    windows = []
    for info in source.store.list(f"{outer.run.run_id}/"):
        try:
            key = parse_key(info.key)
        except ValueError:
            continue
        if key.kind == ObjectKind.MANIFEST and key.uid == source.uid and key.window <= at_most:
            windows.append(key.window)
    for window in sorted(windows, reverse=True):
        try:
            return window, *_load_checkpoint(source, outer, window)
        except (HistoryError, StoreError) as exc:
            log.warning("checkpoint of window %d unusable: %s", window, exc)
    return None


# -- replaying ---------------------------------------------------------------------------------


def _load(model: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])


@dataclass(frozen=True)
class _Saved:
    """A model's weights and its outer state, to put back after a failed attempt."""

    weights: dict[str, torch.Tensor]
    outer: dict[str, torch.Tensor]

    @classmethod
    def of(cls, model: torch.nn.Module, outer: OuterOptimizer) -> _Saved:
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        return cls(weights, outer.state_dict())

    def restore(self, model: torch.nn.Module, outer: OuterOptimizer) -> None:
        _load(model, self.weights)
        outer.load_state_dict(self.outer)


def catch_up(
    model: torch.nn.Module,
    aggregator: Aggregator,
    outer: OuterOptimizer,
    source: Source,
    from_window: int,
    to_window: int,
) -> int:
    """Bring `model` (and `outer`'s state) from the start of `from_window` towards the start of
    `to_window`, each window's step `outer.step` with `aggregator`'s mean.

    Loads a newer checkpoint when one helps, then replays the published aggregates in order,
    stopping early at the first one not published yet. Returns the window the model is now at.
    Raises `HistoryError` for anything invalid (the model may then be anywhere in between:
    restore it before trying another source).
    """
    try:
        ckpt = latest_checkpoint(source, outer, to_window)
        window = from_window
        if ckpt is not None and ckpt[0] > from_window:
            window = ckpt[0]
            _load(model, ckpt[1])
            try:
                outer.load_state_dict(ckpt[2])
            except ValueError as exc:
                raise HistoryError(f"checkpoint of window {window}: {exc}") from exc
            log.info("loaded checkpoint of window %d", window)
        return _replay(model, aggregator, outer, source, window, to_window)
    except StoreError as exc:
        raise HistoryError(f"history of validator uid {source.uid}: {exc}") from exc


def _replay(
    model: torch.nn.Module,
    aggregator: Aggregator,
    outer: OuterOptimizer,
    source: Source,
    window: int,
    to_window: int,
) -> int:
    while window < to_window:
        try:
            updates = read_aggregate(source, aggregator.run, aggregator.spec, window)
        except ObjectNotFound:
            break  # not published (yet): the model is consistently at `window`
        try:
            outer.step(model, aggregator.mean(updates), window)
        except DecodeError as exc:
            raise HistoryError(f"window {window}: {exc}") from exc
        window += 1
    return window


def catch_up_any(
    model: torch.nn.Module,
    aggregator: Aggregator,
    outer: OuterOptimizer,
    sources: Sequence[Source],
    from_window: int,
    to_window: int,
) -> int:
    """`catch_up` from the first source that gets furthest, and again from there while that is
    short of `to_window`, so a window one validator missed (down, its put failed) is taken from
    another's history. The model (and the outer state) is restored between attempts, so a bad
    source costs time, never correctness. Returns the window reached."""
    position = from_window
    while position < to_window:
        reached = _furthest(model, aggregator, outer, sources, position, to_window)
        if reached <= position:
            break  # no source brings us further
        position = reached
    return position


def _furthest(
    model: torch.nn.Module,
    aggregator: Aggregator,
    outer: OuterOptimizer,
    sources: Sequence[Source],
    from_window: int,
    to_window: int,
) -> int:
    """One `catch_up` round, each source from the same start: the model is left where the first
    source that gets furthest took it (as it was, if none moves it)."""
    start = _Saved.of(model, outer)
    best, best_state = from_window, start
    for source in sources:
        start.restore(model, outer)
        try:
            reached = catch_up(model, aggregator, outer, source, from_window, to_window)
        except HistoryError as exc:
            log.warning("history of validator uid %d unusable: %s", source.uid, exc)
            continue
        if reached >= to_window:
            return reached
        if reached > best:
            best, best_state = reached, _Saved.of(model, outer)
    best_state.restore(model, outer)
    return best


def resync(
    model: torch.nn.Module,
    aggregator: Aggregator,
    outer: OuterOptimizer,
    sources: Sequence[Source],
    target_window: int,
    expected_fingerprint: str | None,
) -> bool:
    """Rebuild a possibly forked model at the start of `target_window` from published history:
    the newest verified checkpoint at or before it (else the initial weights and no outer state),
    then every aggregate up to it. A source whose result differs from `expected_fingerprint` is
    skipped. Returns whether it succeeded (on failure the model is as it was)."""
    run = aggregator.run
    saved = _Saved.of(model, outer)
    initial = dict(build_model(run.model, run.seed).named_parameters())
    for source in sources:
        _load(model, {n: p.detach() for n, p in initial.items()})
        outer.load_state_dict({})
        try:
            reached = catch_up(model, aggregator, outer, source, 0, target_window)
        except HistoryError as exc:
            log.warning("resync from validator uid %d failed: %s", source.uid, exc)
            continue
        fp = fingerprint(model)
        if reached == target_window and expected_fingerprint in (None, fp):
            log.info("resynced to window %d from validator uid %d", target_window, source.uid)
            return True
        log.warning(
            "resync from validator uid %d reached window %d with fingerprint %s (wanted %s)",
            source.uid, reached, fp[:12], (expected_fingerprint or "-")[:12],
        )  # fmt: skip
    saved.restore(model, outer)
    return False


def history_sources(chain: Chain, local_root: Path | None = None) -> list[Source]:
    """Every validator with a readable bucket, most stake first."""
    buckets, _ = peer_buckets(chain, local_root)
    metagraph = chain.metagraph()
    validators = sorted(
        (n for n in metagraph.validators if n.uid in buckets), key=lambda n: (-n.stake, n.uid)
    )
    return [Source(n.uid, n.hotkey, buckets[n.uid].store) for n in validators]
