"""Prometheus metrics of a validator: `node.runtime.metrics.NodeMetrics` (identity, window,
progress, phases) plus what it decided in the last window: how many peers got each verdict and
each deciding rule, the weight of every uid, how many updates were selected and applied, and the
bytes it fetched."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Mapping

from prometheus_client import Counter, Gauge

from node.runtime.metrics import NodeMetrics
from validator.checks import Verdict
from validator.reports import ScoreReport


class ValidatorMetrics(NodeMetrics):
    def __init__(self, window_seconds: float) -> None:
        super().__init__("validator", window_seconds)
        r = self.registry
        self.verdicts = Gauge(
            "tessera_validator_peers", "peers with each verdict in the last window", ["verdict"],
            registry=r,
        )  # fmt: skip
        self.rules = Gauge(
            "tessera_validator_rule_peers",
            "peers whose weight each rule decided in the last window",
            ["rule"],
            registry=r,
        )
        self.weight = Gauge(
            "tessera_validator_weight", "the weight this validator gives each uid", ["uid"],
            registry=r,
        )  # fmt: skip
        self.selected = Gauge(
            "tessera_validator_selected_updates", "updates selected in the last window", registry=r
        )
        self.applied = Gauge(
            "tessera_validator_applied_updates", "updates applied in the last window", registry=r
        )
        self.fetched = Counter(
            "tessera_validator_fetched_bytes", "update bytes fetched", registry=r
        )

    def record(self, report: ScoreReport, phases: Mapping[str, float]) -> None:
        """A window is decided: its verdicts, rules, weights and phases."""
        verdicts = Tally(p.verdict for p in report.peers)
        for verdict in Verdict:
            self.verdicts.labels(verdict=verdict.value).set(verdicts[verdict])
        self.rules.clear()
        for rule, count in Tally(p.rule for p in report.peers).items():
            self.rules.labels(rule=rule).set(count)
        self.weight.clear()
        for uid, weight in report.weights.items():
            self.weight.labels(uid=str(uid)).set(weight)
        self.selected.set(len(report.selected))
        self.applied.set(len(report.aggregated))
        self.fetched.inc(sum(p.n_bytes for p in report.peers))
        self.finished(report.window, phases)
