"""Checks against the chain: our hotkey, its uid (and permit), our commitment, the clock."""

from __future__ import annotations

import time
from collections.abc import Callable

from substrateinterface import Keypair

from commands.doctor.report import Check, fail, ok
from commands.provision import ProvisionError, wanted_commitment
from node.runtime.commit import CommitmentMismatch, ensure_commitment
from protocol.chain import Chain, ChainError, open_chain
from protocol.chain.url import LOCAL_SCHEME, local_path
from protocol.commitment import BucketCommitment, Provider, parse_commitment
from protocol.keys import KeyFileError, hotkey_path, load_hotkey
from protocol.runconfig import RunConfig
from protocol.stores.errors import sanitize
from protocol.stores.s3_client import mask_key_id

Clock = Callable[[], float]


def hotkey_check(wallet: str, hotkey: str, wallet_path: str | None) -> tuple[Check, Keypair | None]:
    try:
        keypair = load_hotkey(wallet, hotkey, wallet_path)
    except (KeyFileError, OSError, ValueError) as exc:
        where = hotkey_path(wallet, hotkey, wallet_path)
        return fail(
            "hotkey",
            f"cannot load hotkey {wallet}/{hotkey}: {exc}",
            f"create it (btcli wallet new_hotkey --wallet.name {wallet} --wallet.hotkey "
            f"{hotkey}) or point --wallet/--hotkey/--wallet-path at it (looked in {where})",
        ), None
    return ok("hotkey", f"{wallet}/{hotkey} is {keypair.ss58_address}"), keypair


def chain_check(url: str | None, netuid: int | None) -> tuple[Check, Chain | None]:
    if not url:
        return fail("chain", "no chain configured", "pass --chain or set TESSERA_CHAIN"), None
    try:
        chain = open_chain(url, netuid=netuid)
        head = chain.block()
    except (ChainError, OSError, ValueError) as exc:
        return fail(
            "chain",
            f"cannot reach {sanitize(url, 120)}: {exc}",
            "check --chain (finney, test, local, wss://host:port or local:///path/chain.db), --netuid and the network",
        ), None
    return ok("chain", f"{chain.url} subnet {chain.netuid}, block {head}"), chain


def _register_fix(chain: Chain, hotkey: str, role: str) -> str:
    validator = " --validator" if role == "validator" else ""
    if chain.url.startswith(f"{LOCAL_SCHEME}:"):
        db = local_path(chain.url)
        return (
            f"tessera chain register --db {db} --netuid {chain.netuid} --hotkey {hotkey}{validator}"
        )
    return f"btcli subnet register --netuid {chain.netuid} (with this wallet and hotkey)"


def registration_check(chain: Chain, keypair: Keypair, role: str) -> Check:
    hotkey = keypair.ss58_address
    uid = chain.uid_of(hotkey)
    if uid is None:
        return fail(
            "registration",
            f"hotkey {hotkey} is not registered on subnet {chain.netuid}",
            f"register it: {_register_fix(chain, hotkey, role)}",
        )
    if role != "validator":
        return ok("registration", f"uid {uid} on subnet {chain.netuid}")
    neuron = chain.metagraph().neuron(uid)
    if neuron is None or not neuron.validator_permit:
        stake = f"{neuron.stake:,.1f}" if neuron is not None else "?"
        return fail(
            "registration",
            f"uid {uid} on subnet {chain.netuid} has no validator permit (stake {stake})",
            "stake on the hotkey until it earns a permit at the next epoch (btcli stake add); "
            "on a local chain register it with --validator",
        )
    return ok("registration", f"uid {uid} on subnet {chain.netuid}, validator permit")


def _difference(data: bytes, wanted: BucketCommitment) -> str:
    """What the commitment on chain says instead (chain data: parsed strictly, shown sanitized)."""
    try:
        current = parse_commitment(data, allow_private_endpoints=True)
    except ValueError as exc:
        return f"the one on chain is unreadable ({exc})"
    diffs = []
    if current.endpoint_url != wanted.endpoint_url:
        diffs.append(f"endpoint {current.endpoint_url}")
    if current.bucket != wanted.bucket:
        diffs.append(f"bucket {current.bucket}")
    if current.credentials != wanted.credentials:
        diffs.append(f"read key {mask_key_id(current.credentials.access_key_id)}")
    return "the one on chain names " + (", ".join(diffs) or "other settings")


def commitment_check(chain: Chain, keypair: Keypair, store_url: str, role: str) -> Check:
    fix = f"post it: tessera {role} --commit (or tessera commit) with this --store"
    if store_url.startswith("s3:"):
        fix += " and the read key in TESSERA_S3_READ_*"
    try:
        wanted = wanted_commitment(store_url)
    except ProvisionError as exc:
        return fail("commitment", exc.reason, exc.fix or "fix --store")
    try:
        ensure_commitment(chain, keypair, wanted, post=False)
    except CommitmentMismatch as exc:
        current = chain.read_commitment(keypair.ss58_address)
        extra = "" if current is None else f"; {_difference(current.data, wanted)}"
        return fail("commitment", f"{exc}{extra}", fix)
    if wanted.provider is Provider.LOCAL:
        return ok("commitment", f"on chain: local bucket {wanted.bucket}")
    key = mask_key_id(wanted.credentials.access_key_id)
    return ok(
        "commitment", f"on chain: bucket {wanted.bucket} at {wanted.endpoint_url}, read key {key}"
    )


def clock_check(chain: Chain, run: RunConfig, now: Clock = time.time) -> Check:
    """Our clock against the timestamp of the chain's newest block.

    A correct clock is ahead of the head block's time by less than one block interval (plus the
    time the request took); the run tolerates `clock_skew_tolerance_s` on top of that.
    """
    before = now()
    head = chain.block()
    stamp = chain.block_timestamp(head).timestamp()
    after = now()
    interval = run.timing.block_time_s
    if head > 0:
        try:
            observed = stamp - chain.block_timestamp(head - 1).timestamp()
            interval = max(interval, min(observed, 3600.0))
        except ChainError:
            pass
    slack = run.timing.clock_skew_tolerance_s
    offset = (before + after) / 2 - stamp
    latency = after - before
    high = slack + interval + latency
    low = -(slack + latency)
    side = "ahead of" if offset >= 0 else "behind"
    detail = (
        f"our clock is {abs(offset):.2f} s {side} block {head}'s timestamp (allowed: "
        f"{low:+.1f} s to {high:+.1f} s = run tolerance {slack:g} s + one {interval:g} s block)"
    )
    if low <= offset <= high:
        return ok("clock", detail)
    return fail(
        "clock",
        detail,
        "synchronise the system clock with NTP (timedatectl set-ntp true, or chrony)",
    )
