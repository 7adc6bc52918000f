"""Start and supervise the simulation's processes (one per member), with logs in the run folder."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from lab.sim.buckets import read_key_env
from lab.sim.layout import NETUID, Member, World


@dataclass
class Running:
    member: Member
    proc: subprocess.Popen[bytes]
    log: Path


def command(world: World, m: Member, windows: int) -> list[str]:
    common = [
        "--run", str(world.run_path), "--chain", world.chain_url, "--netuid", str(NETUID),
        "--store", m.store_url, "--wallet", "sim", "--hotkey", m.name,
        "--wallet-path", str(world.out / "wallets"), "--state-dir", str(m.state_dir),
        "--windows", str(windows), "--commit",
    ]  # fmt: skip
    if world.local_root is not None:
        common += ["--local-root", str(world.local_root)]
    if m.name in world.metrics_ports:
        common += ["--metrics-port", str(world.metrics_ports[m.name])]
    if m.kind == "honest":
        return ["miner", *common]
    if m.kind == "validator":
        return ["validator", *common]
    honest = world.of_kind("honest")
    victims = ["--victim", str(honest[0].uid)]
    if m.kind == "mixer" and len(honest) > 1:
        victims += ["--second-victim", str(honest[1].uid)]
    if m.kind == "split":
        victims += ["--crowd", *(str(x.uid) for x in world.of_kind("split"))]
    return ["sim-adversary", "--kind", m.kind, *victims, *common]


def start(world: World, m: Member, windows: int) -> Running:
    log = world.out / "logs" / f"{m.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TESSERA_PROGRESS": "0", "PYTHONUNBUFFERED": "1"}
    if m.store_url.startswith("s3://"):
        env.update(read_key_env(), TESSERA_ALLOW_PRIVATE_ENDPOINTS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "commands.cli", *command(world, m, windows)],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    return Running(m, proc, log)


def supervise(
    running: list[Running], timeout_s: float, on_tick: object = None
) -> dict[str, int | None]:
    """Wait for every process (killing all on timeout); returns exit codes by member name."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(r.proc.poll() is None for r in running):
        if callable(on_tick):
            on_tick()
        time.sleep(1.0)
    for r in running:
        if r.proc.poll() is None:
            r.proc.kill()
            r.proc.wait()
    return {r.member.name: r.proc.returncode for r in running}
