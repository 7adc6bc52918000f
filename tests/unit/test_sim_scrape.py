"""`tessera sim --metrics-port P`: ports from P in member order for the honest peers and
validators (never an adversary), a Prometheus configuration naming each, and a busy or
out-of-range port refused in one line before the run folder exists."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from commands.cli import main
from lab.sim.layout import build_world
from lab.sim.processes import command
from lab.sim.scrape import metrics_ports, write_scrape_config
from tests.support.prometheus import free_ports


def test_honest_peers_and_validators_get_a_port_each_and_a_scrape_target(tmp_path: Path) -> None:
    world = build_world(tmp_path / "run", 2, 1.0, 30, 2, ["noise"], "file", validators=2)
    ports = metrics_ports(world, 9300)
    assert ports == {"peer0": 9300, "peer1": 9301, "validator": 9302, "validator1": 9303}
    world.metrics_ports = ports
    for m in world.members:
        argv = command(world, m, 2)
        if m.kind == "noise":
            assert "--metrics-port" not in argv
        else:
            assert argv[argv.index("--metrics-port") + 1] == str(ports[m.name])
    config = json.loads(write_scrape_config(world, ports).read_text())
    jobs = {job["job_name"]: job["static_configs"] for job in config["scrape_configs"]}
    assert {t["labels"]["member"]: t["targets"] for t in jobs["miner"]} == {
        "peer0": ["127.0.0.1:9300"],
        "peer1": ["127.0.0.1:9301"],
    }
    assert [t["labels"]["member"] for t in jobs["validator"]] == ["validator", "validator1"]


@pytest.mark.parametrize("where", ["busy", "past the last port"])
def test_a_port_that_cannot_serve_is_one_line_before_anything_is_made(
    tmp_path: Path, where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    free = free_ports(2)  # the run's first member takes the first, finds the second busy
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free + 1))
        taken.listen()
        busy = free + 1
        base = free if where == "busy" else 65534  # 3 members: 65534..65536
        argv = ["sim", "--peers", "2", "--out", str(out), "--metrics-port", str(base)]
        assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    says = f"port {busy} is busy" if where == "busy" else "would pass 65535"
    assert len(err.splitlines()) == 1 and says in err and "Traceback" not in err, err
    assert not out.exists()
