"""A real Prometheus (the OS package's `prometheus`) watching a simulation: started on the
scrape configuration the run folder gets, it asks every query of the Grafana dashboard in
docker/monitoring every few seconds while the run goes on."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docker" / "monitoring" / "grafana" / "dashboards" / "tessera.json"
PROMETHEUS = shutil.which("prometheus")
MISSING = (
    "no prometheus binary: install the OS package (apt-get install prometheus; "
    "scripts/test.sh does as root)"
)


def dashboard_queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", []) if t.get("expr")]


def free_ports(count: int, start: int = 23000) -> int:
    """The first of `count` consecutive ports free on 127.0.0.1, from `start` on."""
    for base in range(start, 60000, 97):
        socks = [socket.socket() for _ in range(count)]
        try:
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


class Watcher(threading.Thread):
    """Starts Prometheus on the run folder's configuration once the simulation wrote it, then
    asks every dashboard query every few seconds, keeping the ones that returned series."""

    def __init__(self, out: Path, tsdb: Path, queries: list[str], web: int) -> None:
        super().__init__(daemon=True)
        self.out, self.tsdb, self.queries, self.web = out, tsdb, queries, web
        self.answered: set[str] = set()
        self.targets: list[dict] = []
        self.done = threading.Event()
        self.proc: subprocess.Popen[bytes] | None = None

    def run(self) -> None:
        config = self.out / "prometheus.yml"
        while not config.exists() and not self.done.wait(0.5):
            pass
        if self.done.is_set():
            return
        self.proc = subprocess.Popen(
            [PROMETHEUS or "prometheus", f"--config.file={config}",
             f"--storage.tsdb.path={self.tsdb}", f"--web.listen-address=127.0.0.1:{self.web}"],
            stdout=subprocess.DEVNULL, stderr=(self.tsdb.parent / "prometheus.log").open("wb"),
        )  # fmt: skip
        while not self.done.wait(3.0):
            for query in self.queries:
                if query not in self.answered and self._series(query):
                    self.answered.add(query)
            self.targets = self._api("targets").get("activeTargets", [])

    def _series(self, query: str) -> list:
        return self._api("query?" + urllib.parse.urlencode({"query": query})).get("result", [])

    def _api(self, path: str) -> dict:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.web}/api/v1/{path}", timeout=5
            ) as r:
                return json.loads(r.read())["data"]
        except OSError:
            return {}  # not up yet

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=30)
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
