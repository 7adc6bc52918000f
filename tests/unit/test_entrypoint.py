"""The container entrypoint's decisions (ranks, wallet permissions, shm, data, state folder, health),
its launch against a real embedded chain and file store, the `local` profile's chain job, and
SIGTERM handling around state saves (in-process, real signals)."""

from __future__ import annotations

import os
import signal
import socket
import stat
import time
from pathlib import Path

import pytest
import torch

from commands.entrypoint import (
    STATE_ROOT,
    STUCK_GRACE_S,
    STUCK_WINDOWS,
    EntrypointError,
    data_problems,
    health,
    plan_ranks,
    prepare,
    readable_by,
    shm_problem,
    state_dir_for,
    wallet_problem,
)
from commands.local_setup import _parser as setup_parser
from commands.local_setup import setup
from miner.metrics import PeerMetrics
from node.runtime.shutdown import Stopped, deferred_stop, install_stop_handler
from node.runtime.state import save_rotating
from protocol.chain.local import LocalChain
from protocol.chain.local_db import LocalChainDB, create_local_chain
from protocol.keys import create_hotkey
from protocol.runconfig import RunConfig

GIB = 1 << 30


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("TESSERA_", "AWS_")) or name in ("HF_TOKEN", "HF_HOME"):
            monkeypatch.delenv(name)


# -- ranks ----------------------------------------------------------------------------------------


def test_one_rank_per_visible_gpu_when_they_divide_the_batch() -> None:
    assert plan_ranks(8, 128).nproc == 8 and not plan_ranks(8, 128).note
    assert plan_ranks(4, 128).nproc == 4
    assert plan_ranks(1, 7).nproc == 1


def test_gpus_that_do_not_divide_the_batch_leave_some_idle_with_the_fix() -> None:
    plan = plan_ranks(6, 128)
    assert plan.nproc == 4
    assert "6 GPUs" in plan.note and "2 stay idle" in plan.note and "MINER_GPUS" in plan.note
    assert plan_ranks(7, 64).nproc == 4


def test_cpu_ranks_must_divide_the_batch_and_never_exceed_the_gpus() -> None:
    assert plan_ranks(0, 8).nproc == 1
    assert plan_ranks(0, 8, requested=2).nproc == 2
    with pytest.raises(EntrypointError, match="does not split over 3 CPU ranks"):
        plan_ranks(0, 8, requested=3)
    with pytest.raises(EntrypointError, match="only 2 GPU"):
        plan_ranks(2, 8, requested=4)
    with pytest.raises(EntrypointError, match="at least 1"):
        plan_ranks(2, 8, requested=0)


# -- wallet permissions ---------------------------------------------------------------------------


def _wallet(root: Path, mode: int = 0o600, folder_mode: int = 0o755) -> Path:
    create_hotkey("w", "h", root=root)
    root.chmod(0o755)  # the mounted wallets folder itself
    key = root / "w" / "hotkeys" / "h"
    key.chmod(mode)
    for folder in (root / "w", root / "w" / "hotkeys"):
        folder.chmod(folder_mode)
    return key


def test_posix_permission_bits_decide_readability() -> None:
    st = os.stat_result((stat.S_IFREG | 0o640, 0, 0, 1, 1000, 100, 0, 0, 0, 0))
    assert readable_by(st, 1000, [1000])  # owner: rw-
    assert readable_by(st, 2000, [100])  # group: r--
    assert not readable_by(st, 2000, [2000])  # other: ---
    assert readable_by(st, 0, [])  # root
    assert not readable_by(st, 1000, [1000], os.X_OK)


def test_host_owned_0600_hotkey_needs_the_user_mapping_and_the_fix_says_so(
    tmp_path: Path,
) -> None:
    key = _wallet(tmp_path)
    owner = key.stat().st_uid
    other = owner + 12345  # the image's user when no mapping is set
    problem = wallet_problem(key, other, [other], tmp_path)
    assert problem is not None
    assert 'user: "${UID}:${GID}"' in problem and f"UID={owner}" in problem
    assert "0600" in problem
    assert wallet_problem(key, owner, [key.stat().st_gid], tmp_path) is None


def test_a_wallet_folder_others_cannot_enter_is_reported(tmp_path: Path) -> None:
    key = _wallet(tmp_path, mode=0o644, folder_mode=0o700)
    other = key.stat().st_uid + 12345
    problem = wallet_problem(key, other, [other], tmp_path)
    assert problem is not None and "cannot be entered" in problem and "UID=" in problem


def test_a_missing_hotkey_names_the_mount_and_the_variables(tmp_path: Path) -> None:
    me = os.getuid()
    problem = wallet_problem(tmp_path / "w" / "hotkeys" / "h", me, [os.getgid()], tmp_path)
    assert problem is not None and "WALLETS" in problem and "TESSERA_HOTKEY" in problem


# -- shm, data, state ---------------------------------------------------------------------------


def test_docker_default_shm_is_refused_for_nccl_ranks_only() -> None:
    problem = shm_problem(64 << 20, 8, "cuda")
    assert problem is not None and "shm_size" in problem and "64 MiB" in problem
    assert shm_problem(16 * GIB, 8, "cuda") is None
    assert shm_problem(64 << 20, 1, "cuda") is None  # no NCCL peer-to-peer traffic
    assert shm_problem(64 << 20, 2, "cpu") is None  # gloo goes over sockets


def test_data_the_node_cannot_open_is_reported_before_start(tmp_path: Path) -> None:
    tiny = RunConfig.preset("tiny")
    assert data_problems(tiny.tokenizer, tiny.dataset, {}) == []
    big = RunConfig.preset("8B")
    problems = data_problems(big.tokenizer, big.dataset, {"HF_HOME": str(tmp_path)})
    assert len(problems) == 2
    assert "HF_TOKEN" in problems[0] and "TESSERA_S3_*" in problems[1]
    keyed = {"HF_TOKEN": "x", "TESSERA_S3_ACCESS_KEY_ID": "k"}
    assert data_problems(big.tokenizer, big.dataset, keyed) == []
    (tmp_path / "hub").mkdir()  # a filled cache volume is enough without a token
    assert len(data_problems(big.tokenizer, big.dataset, {"HF_HOME": str(tmp_path)})) == 1
    assert "tessera data prep" in data_problems(tiny.tokenizer, "hf://org/data", {})[0]
    missing = data_problems("embedded://tiny-bpe-4096", f"file://{tmp_path}/none", {})
    assert len(missing) == 1 and "index.json" in missing[0]
    assert data_problems(f"file://{tmp_path}/tok.json", "embedded://tiny-corpus", {})


def test_state_folder_is_per_run_and_hotkey() -> None:
    a = state_dir_for("miner", "run-a", "5Hot", None)
    assert a == STATE_ROOT / "miner" / "run-a" / "5Hot"
    assert a != state_dir_for("miner", "run-b", "5Hot", None)
    assert a != state_dir_for("miner", "run-a", "5Other", None)
    assert a != state_dir_for("validator", "run-a", "5Hot", None)
    with pytest.raises(EntrypointError, match="not per run and hotkey"):
        state_dir_for("miner", "run-a", "5Hot", "/data/state/miner")
    assert state_dir_for("miner", "run-a", "5Hot", "/x/run-a/5Hot") == Path("/x/run-a/5Hot")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_health_is_the_metrics_endpoint_answering_and_the_windows_moving() -> None:
    port = _free_port()
    env = {"TESSERA_METRICS_PORT": str(port)}
    assert "do not answer" in (health(env, timeout=2) or "")
    metrics = PeerMetrics(60.0)
    metrics.serve(port)
    assert health(env) is None  # just started
    stuck_for = STUCK_WINDOWS * 60.0 + STUCK_GRACE_S + 5
    metrics.progress.set(time.time() - stuck_for)  # a window loop that stopped moving
    assert "stuck" in (health(env) or "")
    metrics.progress.set(time.time() - 100.0)
    assert health(env) is None
    assert health({}) is not None


# -- the launch, against a real embedded chain and file store -----------------------------------


class Node:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.db = root / "chain.db"
        create_local_chain(self.db, 1, block_time=1.0)
        self.hotkey = create_hotkey("w", "h", root=root / "wallets").ss58_address
        db = LocalChainDB(self.db)
        try:
            db.register(1, self.hotkey)
        finally:
            db.close()

    def argv(self, *extra: str) -> list[str]:
        return [
            "--chain", f"local://{self.db}", "--store", f"file://{self.root}/b?bucket=peer",
            "--wallet", "w", "--hotkey", "h", "--wallet-path", str(self.root / "wallets"),
            "--device", "cpu", "--commit", *extra,
        ]  # fmt: skip


def test_miner_launch_execs_torchrun_with_the_planned_ranks_and_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TESSERA_DOCTOR_BANDWIDTH_MB", "0")
    monkeypatch.setenv("TESSERA_DOCTOR_TRAIN_STEPS", "0")
    node = Node(tmp_path)
    command = prepare("miner", node.argv(), nproc=2)
    run_id = RunConfig.preset("tiny").run_id
    assert command[:3] == ["torchrun", "--standalone", "--nproc_per_node=2"]
    assert command[3:6] == ["-m", "commands.cli", "miner"]
    assert command[-2:] == ["--state-dir", str(STATE_ROOT / "miner" / run_id / node.hotkey)]
    assert "commitment" in capsys.readouterr().out  # the doctor ran (and --commit excuses it)


def test_doctor_failures_stop_the_launch_unless_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TESSERA_DOCTOR_BANDWIDTH_MB", "0")
    monkeypatch.setenv("TESSERA_DOCTOR_TRAIN_STEPS", "0")
    node = Node(tmp_path)
    argv = [a for a in node.argv() if a != "--commit"]  # nobody posts the commitment
    with pytest.raises(EntrypointError, match="commitment"):
        prepare("validator", argv)
    with pytest.raises(EntrypointError, match="registration"):  # no permit
        prepare("validator", argv, ignored=["commitment"])
    command = prepare("validator", argv, ignored=["commitment", "registration"])
    assert command[:2] == ["tessera", "validator"]


def test_a_state_dir_for_another_run_is_refused_before_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TESSERA_DOCTOR_BANDWIDTH_MB", "0")
    monkeypatch.setenv("TESSERA_DOCTOR_TRAIN_STEPS", "0")
    node = Node(tmp_path)
    with pytest.raises(EntrypointError, match="not per run and hotkey"):
        prepare("miner", node.argv("--state-dir", str(tmp_path / "state")))


# -- the local profile's chain job ----------------------------------------------------------------


def test_setup_local_creates_keys_and_registers_both_once(tmp_path: Path) -> None:
    wallets = tmp_path / "wallets"
    wallets.mkdir()
    argv = ["--db", str(tmp_path / "c" / "chain.db"), "--wallet-path", str(wallets)]
    first = setup(setup_parser().parse_args(argv))
    assert setup(setup_parser().parse_args(argv)) == first  # idempotent
    key = wallets / "local" / "hotkeys" / "validator"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    with LocalChain(tmp_path / "c" / "chain.db", 1) as chain:
        neurons = {n.uid: n for n in chain.metagraph().neurons}
        assert chain.db.clock.block_time == RunConfig.preset("tiny").timing.block_time_s
    assert neurons[first["validator"]].validator_permit
    assert not neurons[first["miner"]].validator_permit


# -- SIGTERM --------------------------------------------------------------------------------------


@pytest.fixture
def stop_handler() -> object:
    previous = signal.getsignal(signal.SIGTERM)
    install_stop_handler()
    yield
    signal.signal(signal.SIGTERM, previous)


def test_sigterm_stops_at_once_outside_a_save(stop_handler: object) -> None:
    with pytest.raises(Stopped, match="SIGTERM"):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises long before this ends


class _SignalWhilePickled:
    """Sends SIGTERM to this process while torch.save is serialising it (mid-save)."""

    def __reduce__(self) -> tuple[object, tuple[int]]:
        os.kill(os.getpid(), signal.SIGTERM)
        return (int, (7,))


def test_sigterm_during_a_state_save_waits_for_the_save(
    tmp_path: Path, stop_handler: object
) -> None:
    current, previous = tmp_path / "state.pt", tmp_path / "state.prev.pt"
    save_rotating(current, previous, {"window": 1})
    body = {"window": 2, "weights": torch.ones(1000), "probe": _SignalWhilePickled()}
    with pytest.raises(Stopped):
        save_rotating(current, previous, body)
    saved = torch.load(current, weights_only=False)
    assert saved["window"] == 2 and saved["probe"] == 7  # the new state is complete
    assert torch.load(previous, weights_only=False)["window"] == 1


def test_nested_deferred_blocks_raise_once_at_the_outermost_end(stop_handler: object) -> None:
    done = []
    with pytest.raises(Stopped), deferred_stop():
        with deferred_stop():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
            done.append("inner")
        done.append("outer")
    assert done == ["inner", "outer"]
