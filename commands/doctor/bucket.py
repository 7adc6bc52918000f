"""Checks of our bucket: the write key works, the committed read key reads but cannot write, and
the link is fast enough for the run's update size."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Mapping

from pydantic import ValidationError

from commands.doctor.report import Check, fail, ok, skip, warn
from node.runtime.preflight import PreflightError, check_bucket
from node.runtime.read_key import READ_ENV, READ_ONLY_FIX, probe_read_key, read_credentials
from protocol.runconfig import RunConfig
from protocol.stores import (
    AccessDenied,
    FileLocation,
    ObjectNotFound,
    ObjectStore,
    StoreError,
    StoreUnavailable,
    StoreURLError,
    credentials_from_env,
    open_store,
    parse_store_url,
)
from protocol.stores.s3_client import mask_key_id

MB = 1_000_000
MIB = 1 << 20
BANDWIDTH_PROBE = "tessera-probe/bandwidth"
BITS_PER_KEPT_ENTRY = 10
"""Index + 2-bit value + side information, ≈9.1 measured (README, codec figures), rounded up."""
WRITE_KEY_FIX = (
    "set TESSERA_S3_ACCESS_KEY_ID / TESSERA_S3_SECRET_ACCESS_KEY to a key with write access to "
    "this bucket (the read-only key goes in TESSERA_S3_READ_*)"
)


def _bucket_fix(cause: BaseException | None, url: str) -> str:
    if isinstance(cause, AccessDenied):
        return WRITE_KEY_FIX
    if isinstance(cause, StoreUnavailable):
        return "check the endpoint in --store, DNS and the network (firewall, proxy)"
    if isinstance(cause, ObjectNotFound):
        return f"create the bucket: tessera bucket create --store '{url}'"
    return "check --store and the bucket's settings (see docs/buckets.md)"


def bucket_check(url: str | None) -> tuple[Check, ObjectStore | None]:
    """Open our bucket with the write key and write, read back and delete a probe object."""
    if not url:
        return fail("bucket", "no bucket configured", "pass --store or set TESSERA_STORE"), None
    try:
        store = open_store(url)
    except StoreURLError as exc:
        return fail(
            "bucket",
            str(exc),
            "fix --store: s3://BUCKET?endpoint=https://ACCOUNT.r2.cloudflarestorage.com, "
            "s3://BUCKET?region=REGION or file:///ROOT?bucket=NAME",
        ), None
    except StoreError as exc:  # no or half-set write credentials
        return fail("bucket", str(exc), WRITE_KEY_FIX), None
    try:
        check_bucket(store)
    except PreflightError as exc:
        store.close()
        return fail("bucket", str(exc), _bucket_fix(exc.__cause__, url)), None
    if isinstance(parse_store_url(url), FileLocation):
        return ok("bucket", f"write, read and delete work on {store.location}"), store
    key = mask_key_id(credentials_from_env().access_key_id)
    return ok("bucket", f"write, read and delete work on {store.location} (key {key})"), store


def read_key_check(
    url: str, store: ObjectStore, role: str = "miner", env: Mapping[str, str] | None = None
) -> Check:
    """The key we commit on chain must read (and list) our bucket and be refused every write.

    Listing is needed in a validator's bucket (late peers look up its newest checkpoint); peers
    fetch a miner's updates by name, so there a key that cannot list is only a warning.
    """
    name = "read key"
    if isinstance(parse_store_url(url), FileLocation):
        return skip(name, "file:// store: no keys, the check does not apply")
    env = os.environ if env is None else env
    missing = f"set {READ_ENV[0]} and {READ_ENV[1]} to the bucket's read-only key"
    try:
        read = read_credentials(env)
    except ValidationError:
        return fail(name, "the read key in TESSERA_S3_READ_* is malformed", missing)
    if read is None:
        return fail(name, "no read key configured", missing)
    shown = mask_key_id(read.access_key_id)
    if read.access_key_id == credentials_from_env(env).access_key_id:
        return fail(
            name,
            f"the read key {shown} is the write key: committing it would publish write access",
            READ_ONLY_FIX,
        )
    p = probe_read_key(url, store, read)
    seen = str(p)
    if "allowed" in (p.put, p.delete):
        return fail(
            name,
            f"the read key {shown} can write to {store.location} ({seen}): anyone who reads "
            "our commitment could replace or delete our updates",
            READ_ONLY_FIX,
        )
    if p.get != "allowed":
        return fail(
            name,
            f"the read key {shown} cannot read {store.location} ({seen})",
            "give the read key object read access to this bucket (s3:GetObject)",
        )
    if p.put != "refused" or p.delete != "refused":
        return warn(
            name,
            f"could not tell whether the read key {shown} can write ({seen})",
            "rerun tessera doctor; if it persists, check the key's permissions by hand",
        )
    if p.list != "allowed":
        detail = f"the read key {shown} cannot list {store.location} ({seen})"
        list_fix = "give the read key list access to this bucket (s3:ListBucket)"
        if role == "validator":
            return fail(name, detail + "; late peers list a validator's bucket", list_fix)
        return warn(name, detail, list_fix)
    return ok(name, f"{shown} can get and list; put and delete are refused by the server")


def update_bytes(run: RunConfig) -> int:
    """Estimated size of one compressed update of this run."""
    kept = math.ceil(run.param_count() * run.codec.k / run.codec.chunk_size)
    return kept * BITS_PER_KEPT_ENTRY // 8 + 64 * 1024


def bandwidth_check(store: ObjectStore, run: RunConfig, size_mb: int, downloads: int) -> Check:
    """Time one upload and one download of `size_mb` MiB, against what a window needs."""
    name = "bandwidth"
    if size_mb <= 0:
        return skip(name, "--bandwidth-mb 0: not measured")
    size = size_mb * MIB
    data = os.urandom(size)
    try:
        start = time.perf_counter()
        store.put(BANDWIDTH_PROBE, data)
        up_s = time.perf_counter() - start
        start = time.perf_counter()
        back = store.get(BANDWIDTH_PROBE, size)
        down_s = time.perf_counter() - start
    except StoreError as exc:
        return fail(name, f"transfer test failed: {exc}", "see the bucket row; check the network")
    finally:
        with contextlib.suppress(StoreError):
            store.delete(BANDWIDTH_PROBE)
    if back != data:
        return fail(name, "the bucket returned other bytes than we wrote", "check the endpoint")
    up, down = size / max(up_s, 1e-6) / MB, size / max(down_s, 1e-6) / MB
    timing = run.timing
    update = update_bytes(run)
    up_budget = max(timing.upload_deadline_blocks, 1) * timing.block_time_s / 2
    down_budget = timing.blocks_per_window * timing.block_time_s / 2
    need_up = update / up_budget / MB
    need_down = downloads * update / down_budget / MB
    detail = (
        f"up {up:,.1f} MB/s, down {down:,.1f} MB/s ({size_mb} MiB object); a {run.preset_name} "
        f"update is ~{update / MB:,.2f} MB: needs ≥ {need_up:,.2f} MB/s up (half the "
        f"{up_budget * 2:g} s upload deadline) and ≥ {need_down:,.2f} MB/s down ({downloads} "
        "updates in half a window)"
    )
    if up < need_up or down < need_down:
        return warn(
            name,
            detail,
            "use a faster link or a bucket region closer to this machine, or a smaller preset",
        )
    return ok(name, detail)
