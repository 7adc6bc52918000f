"""What a validator holds for a window in the consensus tests: a roster with one lead, and the
updates it fetched and checked (every one verified, verdict ok)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from substrateinterface import Keypair

from codec.spec import ModelSpec
from node.window.buckets import PeerBucket
from node.window.consensus import Agreement, ChainTime, Roster
from node.window.exchange import check_update
from node.window.gather import Fetched
from protocol.chain.models import Metagraph, Neuron
from protocol.runconfig import RunConfig
from protocol.stores import ObjectStore
from protocol.stores.spool import InMemory
from validator.admission import Admission
from validator.agreement import Decider, adopt, propose
from validator.checks import Verdict
from validator.classify import PeerCheck
from validator.fetching import Upload


def cutoff_run(name: str) -> RunConfig:
    """The `tiny` preset with a cutoff easy to count in: 1 s blocks, 60 to a window, a 10 s gather
    and 20 s for the deciders to publish."""
    return RunConfig.preset(
        "tiny",
        name=name,
        inner_steps=2,
        consensus={"fetch_budget_s": 10.0, "manifest_wait_s": 20.0},
        timing={"block_time_s": 1.0, "blocks_per_window": 60, "upload_deadline_blocks": 5},
    )


def lead_roster(
    keys: Mapping[int, Keypair], store: object, selected: list[int], window: int, lead: int
) -> Roster:
    """Window `window`'s roster at block 40: every key registered, `lead` the one validator."""
    neurons = [
        Neuron(uid=u, hotkey=k.ss58_address, stake=10.0 if u == lead else 0.0,
               validator_permit=u == lead)
        for u, k in keys.items()
    ]  # fmt: skip
    bucket = PeerBucket(lead, keys[lead].ss58_address, store)  # type: ignore[arg-type]
    meta = Metagraph(netuid=1, block=40, neurons=neurons)
    return Roster(window, 40, meta, {lead: bucket}, {}, selected, (bucket,))


def checked_views(
    data: Mapping[int, bytes],
    keys: Mapping[int, Keypair],
    run: RunConfig,
    spec: ModelSpec,
    window: int,
) -> tuple[dict[int, Fetched], dict[int, Upload], dict[int, PeerCheck]]:
    """What a validator fetched and checked of `data` (uid -> signed update bytes)."""
    fetched, uploads, checks = {}, {}, {}
    for u, d in data.items():
        update = check_update(d, u, keys[u].ss58_address, run, spec, window)
        fetched[u] = Fetched(u, update, "ok", InMemory.of(d), None, len(d))
        uploads[u] = Upload(u, keys[u].ss58_address, fetched[u], None)
        checks[u] = PeerCheck(u, keys[u].ss58_address, uploads[u], Verdict.OK, "ok")
    return fetched, uploads, checks


def decide(
    store: ObjectStore,
    run: RunConfig,
    spec: ModelSpec,
    keypair: Keypair,
    roster: Roster,
    checks: Mapping[int, PeerCheck],
    uploads: Mapping[int, Upload],
    fingerprint_start: str,
    scratch: Path,
    chain: ChainTime,
    admission: Admission,
) -> Agreement:
    """A deciding validator's whole agreement, as its window loop runs it: its decision
    proposed, then the one that counts adopted."""
    me = Decider(store, run, spec, keypair, scratch, chain)
    proposed = propose(me, roster, checks, uploads, fingerprint_start, admission)
    return adopt(me, roster, uploads, fingerprint_start, proposed)
