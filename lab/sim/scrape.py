"""`tessera sim --metrics-port P`: the simulation's live view.

Every honest peer and validator serves its Prometheus metrics on 127.0.0.1, on ports P, P + 1, …
in member order, and the run folder gets ``prometheus.yml``, a Prometheus configuration that
scrapes them under the jobs the Docker monitoring profile uses (``miner``, ``validator``), each
target labelled with its member's name. ``prometheus --config.file runs/demo/prometheus.yml``
then feeds the dashboard of ``docker/monitoring`` from the simulation (docs/monitoring.md).
"""

from __future__ import annotations

import json
from pathlib import Path

from lab.sim.layout import World
from node.runtime.preflight import PreflightError, check_port_free

JOBS = {"honest": "miner", "validator": "validator"}
"""The members that serve metrics, by kind, and their Prometheus job."""
SCRAPE_INTERVAL_S = 2
CONFIG = "prometheus.yml"


def metrics_ports(world: World, base: int) -> dict[str, int]:
    """Each scraped member's metrics port (by member name), from `base` in member order."""
    scraped = [m for m in world.members if m.kind in JOBS]
    return {m.name: base + i for i, m in enumerate(scraped)}


def check_ports(base: int, count: int) -> None:
    """`SystemExit` with the fix when one of the `count` ports from `base` is past 65535 or busy
    on 127.0.0.1 (checked before the run folder or its chain is made)."""
    if base + count - 1 > 65535:
        raise SystemExit(
            f"--metrics-port {base}: {count} ports in a row would pass 65535: give a lower port"
        )
    for port in range(base, base + count):
        try:
            check_port_free(port)
        except PreflightError:
            raise SystemExit(
                f"--metrics-port {base}: port {port} is busy on 127.0.0.1: give another "
                f"first port ({count} in a row are used)"
            ) from None


def write_scrape_config(world: World, ports: dict[str, int]) -> Path:
    """Write ``prometheus.yml`` into the run folder (JSON, which is YAML) and return its path."""
    kinds = {m.name: m.kind for m in world.members}
    jobs: dict[str, list[object]] = {}
    for name, port in ports.items():
        target = {"targets": [f"127.0.0.1:{port}"], "labels": {"member": name}}
        jobs.setdefault(JOBS[kinds[name]], []).append(target)
    config = {
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s"},
        "scrape_configs": [
            {"job_name": job, "static_configs": targets} for job, targets in sorted(jobs.items())
        ],
    }
    path = world.out / CONFIG
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path
