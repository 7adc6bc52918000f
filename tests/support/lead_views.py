"""What a validator holds for a window in the consensus tests: a roster with one lead, and the
updates it fetched and checked (every one verified, verdict ok)."""

from __future__ import annotations

from collections.abc import Mapping

from substrateinterface import Keypair

from codec.spec import ModelSpec
from node.window.buckets import PeerBucket
from node.window.consensus import Roster
from node.window.exchange import check_update
from node.window.gather import Fetched
from protocol.chain.models import Metagraph, Neuron
from protocol.runconfig import RunConfig
from protocol.stores.spool import InMemory
from validator.checks import Verdict
from validator.classify import PeerCheck
from validator.fetching import Upload


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
