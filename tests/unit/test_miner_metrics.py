"""A real peer (embedded chain and store, the `tiny` model) records a finished window, and its
Prometheus endpoint, on 127.0.0.1, serves it under Prometheus' names: who it is, the window, each
phase's seconds, loss, throughput, bytes moved and the gather's success."""

from __future__ import annotations

import socket
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from miner.peer import WindowReport
from protocol.runconfig import RunConfig
from tests.support.local_peer import local_peer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_finished_window_is_served_under_prometheus_names(tmp_path: Path) -> None:
    run = RunConfig.preset("tiny", name="metrics")
    peer = local_peer(tmp_path, run)
    port = _free_port()
    peer.metrics.serve(port)
    report = WindowReport(
        window=4, exchanged=4, loss=5.25, tokens_per_s=1234.0, upload_bytes=1000, upload_s=0.5,
        download_bytes=3000, gathered=[0, 1, 2], dropped={3: "late"}, applied=[0, 1, 2],
        agreed_by="manifest", fingerprint="f", seconds={"train": 12.5, "gather": 2.0, "window": 20.0},
    )  # fmt: skip
    for _ in range(2):
        peer._record(report)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        got = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.read().decode())
            for s in family.samples
        }
    info = (("hotkey", peer.keypair.ss58_address), ("role", "miner"), ("run_id", run.run_id),
            ("uid", str(peer.uid)))  # fmt: skip
    assert got[("tessera_node_info", info)] == 1
    assert got[("tessera_window", ())] == 4
    assert got[("tessera_window_length_seconds", ())] == (
        run.timing.blocks_per_window * run.timing.block_time_s
    )
    for phase, seconds in report.seconds.items():
        assert got[("tessera_phase_seconds", (("phase", phase),))] == seconds
    assert time.time() - got[("tessera_last_progress_timestamp_seconds", ())] < 60
    assert got[("tessera_miner_inner_loss", ())] == 5.25
    assert got[("tessera_miner_tokens_per_second", ())] == 1234.0
    assert got[("tessera_miner_uploaded_bytes_total", ())] == 2 * 1000  # a counter: twice
    assert got[("tessera_miner_downloaded_bytes_total", ())] == 2 * 3000
    assert got[("tessera_miner_gather_success_ratio", ())] == pytest.approx(3 / 4)
    peer.chain.close()
