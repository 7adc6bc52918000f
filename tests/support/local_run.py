"""A local run for the end-to-end tests: real node processes (`python -m commands.cli miner`,
`validator`, `sim-adversary`) on the embedded chain and file buckets, all under one folder.

`LocalRun(folder)` lays the run out as

- `run.json`: the run config, the tiny preset with a test's overrides (`write_config`);
- `chain.db`: the embedded chain, ticking at the run's block time (`create_chain`);
- `wallets/`: the wallet `sim`, one hotkey per node, each registered on the chain (`register`);
- `buckets/<name>/`: a node's file bucket; `<name>/`: its state (`state.pt`, `reports.jsonl`);
- `<name>.log`: its output, appended to over restarts (`start`).

Window 0 opens at the run config's ``start_block``, an allowance for every node to start on a
busy machine; `open_when_up` skips the rest of it once the nodes are up, as `tessera sim` does.

A node is known by its name: its hotkey, bucket, state folder and log all carry it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from contextlib import closing
from pathlib import Path
from typing import Any, TypeAlias

from substrateinterface import Keypair

from lab.sim.opening import open_when_up
from node.runtime.report_log import REPORTS
from protocol.chain.local import LocalChain
from protocol.chain.local_db import LocalChainDB, create_local_chain
from protocol.keys import create_hotkey, load_hotkey
from protocol.runconfig import RunConfig

NETUID = 1
WALLET = "sim"
ROOT = Path(__file__).resolve().parents[2]
"""The repository: the nodes' working directory, where `python -m commands.cli` is found."""

Process: TypeAlias = subprocess.Popen[bytes]


class LocalRun:
    """One run's config, chain, wallets, buckets and node processes under `folder` (created)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    @property
    def run_file(self) -> Path:
        return self.folder / "run.json"

    @property
    def chain_url(self) -> str:
        return f"local://{self.folder / 'chain.db'}"

    @property
    def wallets(self) -> Path:
        return self.folder / "wallets"

    @property
    def buckets(self) -> Path:
        """The local root of the file buckets (`--local-root`)."""
        return self.folder / "buckets"

    def write_config(self, **overrides: Any) -> None:
        """`run.json`: the tiny preset with `overrides` (nested dicts merged, as in
        `RunConfig.preset`)."""
        RunConfig.preset("tiny", **overrides).dump(self.run_file)

    def create_chain(self, genesis_in_s: float = 0.0) -> None:
        """The embedded chain, its block 0 `genesis_in_s` seconds from now, its blocks as long as
        the run config's (`write_config` first)."""
        block_time = RunConfig.load(self.run_file).timing.block_time_s
        create_local_chain(
            self.folder / "chain.db", NETUID, block_time=block_time,
            clock=lambda: time.time() + genesis_in_s,
        )  # fmt: skip

    def register(self, name: str, *, validator: bool = False) -> int:
        """A new hotkey `name` in the wallet, registered on the chain (with a validator permit if
        `validator`); returns its uid."""
        hotkey = create_hotkey(WALLET, name, root=self.wallets).ss58_address
        with closing(LocalChainDB(self.folder / "chain.db")) as db:
            return db.register(NETUID, hotkey, validator=validator)

    def keypair(self, name: str) -> Keypair:
        """The hotkey `register` made for `name`."""
        return load_hotkey(WALLET, name, root=self.wallets)

    def bucket(self, name: str) -> Path:
        return self.buckets / name

    def store_url(self, name: str) -> str:
        """Node `name`'s file store (`--store`); its bucket folder is created."""
        self.bucket(name).mkdir(parents=True, exist_ok=True)
        return f"file://{self.buckets}?bucket={name}"

    def state_dir(self, name: str) -> Path:
        return self.folder / name

    def start(
        self,
        role: str,
        name: str,
        *options: str,
        windows: int,
        ranks: int = 1,
        own_group: bool = False,
        env: Mapping[str, str] | None = None,
    ) -> Process:
        """Node `name` as `role` (`miner`, `validator`, `sim-adversary`) for `windows` windows,
        posting its bucket commitment, with `options` after those every node gets: on `ranks`
        processes under `torch.distributed.run` when more than one, leading a process group of
        its own if `own_group`. One thread per process (OMP_NUM_THREADS=1), then `env`; its
        output goes to `<name>.log`."""
        launcher = [sys.executable, "-m", "commands.cli"]
        if ranks > 1:
            launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", str(ranks), "-m", "commands.cli"]  # fmt: skip
        cmd = [
            *launcher, role, "--run-config", str(self.run_file),
            "--chain", self.chain_url, "--netuid", str(NETUID),
            "--store", self.store_url(name), "--local-root", str(self.buckets),
            "--wallet", WALLET, "--hotkey", name, "--wallet-path", str(self.wallets),
            "--state-dir", str(self.state_dir(name)), "--windows", str(windows), "--commit",
            *options,
        ]  # fmt: skip
        environ = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        with self._log_path(name).open("ab") as log:
            return subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=environ, cwd=ROOT,
                start_new_session=own_group,
            )  # fmt: skip

    def open_when_up(self, names: Iterable[str], timeout: float = 120.0) -> None:
        """Once the nodes `names` have all posted their commitments, skip the chain to just
        before window 0 (`lab.sim.opening`); after `timeout` seconds without them, leave the
        chain to get there at its own pace."""
        hotkeys = [self.keypair(n).ss58_address for n in names]
        timing = RunConfig.load(self.run_file).timing
        deadline = time.monotonic() + timeout
        with closing(LocalChain(self.folder / "chain.db", NETUID)) as chain:
            while open_when_up(chain, hotkeys, timing) is None and time.monotonic() < deadline:
                time.sleep(0.5)

    def reports(self, name: str) -> list[dict[str, Any]]:
        """Node `name`'s per-window reports so far (none before its first)."""
        path = self.state_dir(name) / REPORTS
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def log(self, name: str) -> str:
        """Everything node `name` has written to its log so far."""
        return self._log_path(name).read_text()

    def wait(self, procs: Mapping[str, Process], timeout: float, tail: int = 3000) -> None:
        """Wait for the nodes `procs` (by name), all of them within `timeout` seconds, then
        assert each exited with 0, showing the last `tail` characters of its log."""
        deadline = time.time() + timeout
        for proc in procs.values():
            proc.wait(timeout=max(1, deadline - time.time()))
        for name, proc in procs.items():
            assert proc.returncode == 0, self.log(name)[-tail:]

    def _log_path(self, name: str) -> Path:
        return self.folder / f"{name}.log"


def stop(procs: Iterable[Process]) -> None:
    """Terminate those of `procs` still running, giving each 10 s to exit."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (torchrun starts each rank in a session of its
    own, so its process group does not hold them)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    os.kill(pid, signal.SIGKILL)
    for child in children:
        kill_tree(child)
