"""What the validators published about one peer: its line of each window's score report.

Every validator publishes a `ScoreReport` per window (`protocol.naming.scores_key`) in its own
bucket. `peer_verdicts` reads the reports of the last windows from every validator with a permit
and a readable bucket, and keeps the peer's line of each: verdict, the rule that decided its
weight, every rule that lowered it, its score and its weight. A report is another node's bytes:
it is read with a size bound and validated, and one that is missing, unreadable or malformed is
reported as such, never raised.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from node.window.buckets import PeerBucket, peer_buckets
from protocol.chain.base import Chain
from protocol.naming import scores_key
from protocol.runconfig import RunConfig
from protocol.stores.errors import ObjectNotFound, StoreError
from validator.reports import PeerReport, ScoreReport

MAX_REPORT_BYTES = 32 << 20
"""The largest score report read: about 4 KB per peer, for 8,192 peers."""


@dataclass(frozen=True)
class ReportLine:
    """One validator's word on the peer for one window (``line`` None: see ``problem``)."""

    window: int
    validator_uid: int
    line: PeerReport | None
    problem: str = ""  # "no report", "not in the report", "unreadable: …", "malformed: …"
    weight: float | None = None  # the weight the report gives the peer (None: no report)


def validators(chain: Chain, local_root: Path | None) -> list[PeerBucket]:
    """Every uid with a validator permit and a readable bucket, most stake first."""
    meta = chain.metagraph()
    buckets, _ = peer_buckets(chain, local_root)
    permitted = [n for n in meta.neurons if n.validator_permit and n.uid in buckets]
    return [buckets[n.uid] for n in sorted(permitted, key=lambda n: (-n.stake, n.uid))]


def peer_verdicts(
    chain: Chain, run: RunConfig, uid: int, windows: list[int], local_root: Path | None = None
) -> list[ReportLine]:
    """The peer `uid`'s line in each validator's report of each of `windows`."""
    judges = validators(chain, local_root)
    return [_verdict(v, run, uid, window) for window in windows for v in judges]


def _verdict(validator: PeerBucket, run: RunConfig, uid: int, window: int) -> ReportLine:
    key = scores_key(run.run_id, window, validator.uid, validator.hotkey)
    try:
        report = ScoreReport.model_validate_json(validator.store.get(key, MAX_REPORT_BYTES))
    except ObjectNotFound:
        return ReportLine(window, validator.uid, None, "no report")
    except StoreError as exc:
        return ReportLine(window, validator.uid, None, f"unreadable: {exc}")
    except ValidationError as exc:
        return ReportLine(window, validator.uid, None, f"malformed: {exc.error_count()} errors")
    if report.run_id != run.run_id or report.window != window:
        return ReportLine(window, validator.uid, None, "malformed: another run or window")
    line = next((p for p in report.peers if p.uid == uid), None)
    problem = "" if line else "not in the report"
    return ReportLine(window, validator.uid, line, problem, report.weights.get(uid, 0.0))
