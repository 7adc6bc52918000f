"""The compose file and .env.example agree with the code (no Docker engine here: parse and check)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from deploy.cli import COMMANDS

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker" / "compose.yml").read_text())
SERVICES = COMPOSE["services"]


def _env_example() -> dict[str, str]:
    pairs = {}
    for line in (ROOT / "docker" / ".env.example").read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            pairs[key] = value
    return pairs


def test_expected_services_exist() -> None:
    assert {"minio", "createbuckets", "chain", "miner", "validator"} <= set(SERVICES)


def test_miner_uses_every_gpu_through_torchrun() -> None:
    miner = SERVICES["miner"]
    assert miner["entrypoint"][:3] == ["torchrun", "--nproc_per_node", "${TESSERA_GPUS:-8}"]
    devices = miner["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and devices[0]["count"] == "all"
    assert "gpu" in devices[0]["capabilities"]


def test_service_commands_are_real_subcommands() -> None:
    for name in ("chain", "miner", "validator"):
        command = SERVICES[name]["command"]
        assert command[0] in COMMANDS, name


def test_node_services_share_the_data_volume_and_wallets() -> None:
    for name in ("chain", "miner", "validator"):
        volumes = SERVICES[name]["volumes"]
        assert "tessera-data:/data" in volumes
        assert any(v.endswith(":/wallets:ro") for v in volumes)
    assert "tessera-data" in COMPOSE["volumes"]


def test_every_env_variable_is_documented_and_used() -> None:
    documented = _env_example()
    source = "\n".join(p.read_text() for p in (ROOT / "node").rglob("*.py"))
    source += "\n".join(p.read_text() for p in (ROOT / "protocol").rglob("*.py"))
    used = set(re.findall(r'"(TESSERA_[A-Z0-9_]+)"', source))
    assert used <= set(documented), used - set(documented)
    for key in documented:
        if key.startswith("TESSERA_") and key != "TESSERA_GPUS":
            assert key in used, f"{key} is documented but no code reads it"
