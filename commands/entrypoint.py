"""`tessera entrypoint`: what the Docker image runs. It checks the container, then `exec`s the node.

    tessera entrypoint miner [--nproc N] [--ignore-check NAME] [MINER OPTIONS]
    tessera entrypoint validator [--ignore-check NAME] [VALIDATOR OPTIONS]
    tessera entrypoint setup-local [OPTIONS]               # the `local` profile's chain job
    tessera entrypoint health                              # the image's HEALTHCHECK
    tessera entrypoint COMMAND ...                         # any other `tessera` command, as is

Before a node starts it checks, each as a function below (tests/unit/test_entrypoint.py): how many
ranks the GPUs it sees give and that they divide the batch size (`plan_ranks`), that the hotkey
is readable by the user the container runs as, with the fix if not (`wallet_problem`), the size
of /dev/shm (`shm_problem`), the tokenizer and dataset the run needs (`data_problems`), and that
the state folder is per run and hotkey (`state_dir_for`). Then it runs `tessera doctor`'s checks
(a failed one stops the start, unless named by `--ignore-check`, e.g. `"read key"` against an S3
server that cannot refuse writes; a missing commitment does not when `--commit` will post it) and
replaces itself with torchrun (miner) or `tessera validator`, so signals reach the node.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from prometheus_client.parser import text_string_to_metric_families

from codec.errors import TesseraError

__all__ = [
    "ACTIONS",
    "RankPlan",
    "data_problems",
    "plan_ranks",
    "readable_by",
    "shm_problem",
    "state_dir_for",
    "wallet_problem",
]

ACTIONS = ("miner", "validator", "setup-local", "health")
STUCK_WINDOWS = 3  # windows without a finished one before the health check fails
STUCK_GRACE_S = 600.0  # on top: a start-up (model load, catch-up) may take this long
STATE_ROOT = Path("/data/state")
"""The state volume of a node container; each run and hotkey gets its own folder under it."""
SHM_PER_RANK = 512 << 20
"""/dev/shm a multi-GPU peer needs per rank (NCCL's shared-memory transport); Docker gives 64 MiB."""
USER_FIX = (
    'run the container as the key\'s owner: `user: "${{UID}}:${{GID}}"` in docker/compose.yml '
    "(the default) with UID={uid} and GID={gid} in docker/.env"
)


class EntrypointError(TesseraError, RuntimeError):
    """The container cannot start the node; the message says why and how to fix it."""


# -- ranks --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankPlan:
    nproc: int
    note: str = ""


def plan_ranks(gpus: int, batch_size: int, requested: int | None = None) -> RankPlan:
    """torchrun's --nproc_per_node: one rank per visible GPU (or `requested` CPU ranks without
    GPUs), and a count that divides `batch_size` (each inner step splits its rows evenly)."""
    if requested is not None and requested < 1:
        raise EntrypointError(f"--nproc must be at least 1, got {requested}")
    if gpus == 0:
        nproc = requested or 1
        if batch_size % nproc:
            raise EntrypointError(
                f"batch_size {batch_size} does not split over {nproc} CPU ranks: pick a --nproc "
                "that divides it"
            )
        return RankPlan(nproc, "no GPU visible: CPU ranks (gloo)")
    if requested is not None and requested > gpus:
        raise EntrypointError(f"--nproc {requested} but only {gpus} GPU(s) are visible")
    wanted = requested or gpus
    nproc = max(n for n in range(1, wanted + 1) if batch_size % n == 0)
    if nproc == wanted:
        return RankPlan(nproc)
    return RankPlan(
        nproc,
        f"batch_size {batch_size} does not split over {wanted} GPUs: using {nproc}, "
        f"{wanted - nproc} stay idle; give the miner {nproc} GPUs (MINER_GPUS) or use a run "
        f"config whose batch_size is a multiple of {wanted}",
    )


# -- wallet -------------------------------------------------------------------------------------


def readable_by(st: os.stat_result, uid: int, gids: Sequence[int], mode: int = os.R_OK) -> bool:
    """POSIX permission check of `st` for a process with `uid` and groups `gids` (root: always)."""
    if uid == 0:
        return True
    if st.st_uid == uid:
        bits = {os.R_OK: stat.S_IRUSR, os.X_OK: stat.S_IXUSR}[mode]
    elif st.st_gid in gids:
        bits = {os.R_OK: stat.S_IRGRP, os.X_OK: stat.S_IXGRP}[mode]
    else:
        bits = {os.R_OK: stat.S_IROTH, os.X_OK: stat.S_IXOTH}[mode]
    return bool(st.st_mode & bits)


def wallet_problem(hotkey_file: Path, uid: int, gids: Sequence[int], mount: Path) -> str | None:
    """Why the hotkey file cannot be read by this user (with the fix), or None when it can.

    Folders are checked from the mount down before the file is touched: a wallets folder of
    mode 0700 (the usual) hides even whether the key exists from any other user.
    """
    missing = (
        f"no hotkey at {hotkey_file}: mount the wallets folder at {mount} (WALLETS in "
        "docker/.env) and set TESSERA_WALLET / TESSERA_HOTKEY to an existing hotkey"
    )
    folders = [p for p in reversed(hotkey_file.parents) if p == mount or mount in p.parents]
    for path in [*folders, hotkey_file]:
        try:
            st = path.stat()
        except FileNotFoundError:
            return missing
        kind, mode = ("hotkey", os.R_OK) if path == hotkey_file else ("folder", os.X_OK)
        if not readable_by(st, uid, gids, mode):
            verb = "read" if mode == os.R_OK else "entered"
            return (
                f"{kind} {path} (owner {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}) cannot be "
                f"{verb} by uid {uid}: " + USER_FIX.format(uid=st.st_uid, gid=st.st_gid)
            )
    return None


# -- shared memory, data, state -----------------------------------------------------------------


def shm_problem(shm_bytes: int, nproc: int, device: str) -> str | None:
    """/dev/shm too small for `nproc` CUDA ranks (NCCL), or None."""
    need = SHM_PER_RANK * nproc
    if nproc < 2 or not device.startswith("cuda") or shm_bytes >= need:
        return None
    return (
        f"/dev/shm is {shm_bytes >> 20} MiB; {nproc} NCCL ranks need at least {need >> 20} MiB: "
        "set shm_size (SHM_SIZE in docker/.env, default 16gb) or ipc: host"
    )


def _local_path(ref: str) -> Path | None:
    if ref.startswith("file://"):
        return Path(ref.removeprefix("file://"))
    return None if "://" in ref else Path(ref)


def data_problems(tokenizer: str, dataset: str, environ: dict[str, str]) -> list[str]:
    """What keeps the run's tokenizer or dataset from loading in this container."""
    from node.data.dataset import EMBEDDED_DATASET
    from node.data.shards import INDEX_NAME
    from node.data.tokenizer import EMBEDDED_BPE_RE

    problems = []
    tok_path = _local_path(tokenizer)
    if tok_path is not None and not tok_path.exists():
        problems.append(f"tokenizer file {tok_path} is missing: mount it or fix the run config")
    elif tokenizer.startswith("hf://") and not environ.get("HF_TOKEN"):
        hub_cache = Path(environ.get("HF_HOME", "~/.cache/huggingface")).expanduser() / "hub"
        if not hub_cache.is_dir():
            problems.append(
                f"tokenizer {tokenizer} comes from the Hugging Face hub and neither HF_TOKEN nor "
                f"a cache ({hub_cache}) is there: gated models need HF_TOKEN in the env file"
            )
    elif tokenizer.startswith("embedded://") and not EMBEDDED_BPE_RE.fullmatch(tokenizer):
        problems.append(f"unknown embedded tokenizer {tokenizer}")
    data_path = _local_path(dataset)
    if dataset == EMBEDDED_DATASET:
        pass
    elif data_path is not None:
        if not (data_path / INDEX_NAME).is_file():
            problems.append(
                f"dataset {dataset} has no {INDEX_NAME}: prepare it with `tessera data prep` "
                "into the cache volume (/data/cache) and point the run config at it"
            )
    elif dataset.startswith("s3://"):
        if not any(environ.get(k) for k in ("TESSERA_S3_ACCESS_KEY_ID", "AWS_ACCESS_KEY_ID")):
            problems.append(
                f"dataset {dataset} is read from S3 with TESSERA_S3_* (or AWS_*) keys and none "
                "are set"
            )
    else:
        problems.append(
            f"dataset {dataset} is not something this node opens: prepare token shards with "
            "`tessera data prep` (--input files or --hf DATASET) into /data/cache or an S3 bucket "
            "(`tessera data upload`) and name that in the run config"
        )
    return problems


def state_dir_for(role: str, run_id: str, hotkey: str, given: str | None) -> Path:
    """The node's state folder: `given` when it names this run and hotkey, else under STATE_ROOT.

    One folder per (role, run, hotkey), so a new TESSERA_RUN or hotkey starts fresh instead of
    refusing the old run's state in a restart loop.
    """
    if not given:
        return STATE_ROOT / role / run_id / hotkey
    parts = Path(given).parts
    if run_id not in parts or hotkey not in parts:
        raise EntrypointError(
            f"TESSERA_STATE_DIR={given} is not per run and hotkey: leave it unset (the entrypoint "
            f"uses {STATE_ROOT}/{role}/<run id>/<hotkey>) or put {run_id} and {hotkey} in it"
        )
    return Path(given)


# -- the launch ---------------------------------------------------------------------------------


def _node_parser(role: str) -> argparse.ArgumentParser:
    from commands.miner import add_arguments as miner_arguments
    from commands.validator import add_arguments as validator_arguments

    parser = argparse.ArgumentParser(prog=f"tessera entrypoint {role}")
    (miner_arguments if role == "miner" else validator_arguments)(parser)
    return parser


def _doctor_failures(
    role: str, node_argv: list[str], committing: bool, ignored: Sequence[str], state: Path
) -> list[str]:
    """`tessera doctor`'s checklist for this node, printed; the failures that stop the start
    (all but `ignored` ones, and a missing commitment when the node will post it)."""
    from rich.console import Console

    from commands.doctor.cli import add_arguments, collect
    from commands.doctor.report import Status, print_checklist

    parser = argparse.ArgumentParser(prog="tessera doctor")
    add_arguments(parser)
    args, _ = parser.parse_known_args([*node_argv, "--role", role, "--state-dir", str(state)])
    checks = collect(args)
    print_checklist(checks, Console(highlight=False), role)
    excused = {*ignored, *(["commitment"] if committing else [])}
    return [
        f"{c.name}: {c.detail}" for c in checks if c.status is Status.FAIL and c.name not in excused
    ]


def _shm_bytes() -> int:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return st.f_blocks * st.f_frsize


def _visible_gpus(device: str) -> int:
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count()


def prepare(
    role: str, argv: list[str], nproc: int | None = None, ignored: Sequence[str] = ()
) -> list[str]:
    """Every check; returns the command to exec. Raises `EntrypointError` with the fixes."""
    from commands.node_args import load_run
    from protocol.keys import hotkey_path, load_hotkey

    args = _node_parser(role).parse_args(argv)
    run = load_run(args.run)
    gpus = _visible_gpus(args.device)
    plan = plan_ranks(gpus, run.batch_size, nproc) if role == "miner" else RankPlan(1)
    mount = Path(args.wallet_path or "~/.bittensor/wallets").expanduser()
    key_file = hotkey_path(args.wallet, args.hotkey, mount)
    problems = [
        p
        for p in (
            wallet_problem(key_file, os.getuid(), os.getgroups(), mount),
            shm_problem(_shm_bytes(), plan.nproc, args.device),
        )
        if p
    ]
    problems += data_problems(run.tokenizer, run.dataset, dict(os.environ))
    if problems:
        raise EntrypointError("\n".join(f"✗ {p}" for p in problems))
    hotkey = load_hotkey(args.wallet, args.hotkey, mount).ss58_address
    state = state_dir_for(role, run.run_id, hotkey, args.state_dir)
    print(
        f"tessera entrypoint: {role}, run {run.run_id}, hotkey {hotkey}, {plan.nproc} rank(s) "
        f"({gpus} GPU(s) visible), state {state}",
        flush=True,
    )
    if plan.note:
        print(f"! {plan.note}", flush=True)
    failures = _doctor_failures(role, argv, args.commit, ignored, state)
    if failures:
        raise EntrypointError("tessera doctor failed:\n" + "\n".join(f"✗ {f}" for f in failures))
    node = [*argv, *([] if args.state_dir else ["--state-dir", str(state)])]
    if role == "validator":
        return ["tessera", "validator", *node]
    launcher = ["torchrun", "--standalone", f"--nproc_per_node={plan.nproc}"]
    return [*launcher, "-m", "commands.cli", "miner", *node]


def health(environ: dict[str, str], timeout: float = 5.0) -> str | None:
    """None when the metrics endpoint answers and the node finished a window within
    `STUCK_WINDOWS` windows (plus `STUCK_GRACE_S`), else why not (the HEALTHCHECK's verdict): a
    live thread serving metrics is not enough, the window loop must move."""
    port = int(environ.get("TESSERA_METRICS_PORT", "0") or 0)
    if port <= 0:
        return "TESSERA_METRICS_PORT is not set: nothing to check"
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
            body = r.read(1 << 20).decode("utf-8", "replace")
    except OSError as exc:
        return f"metrics on port {port} do not answer: {exc}"
    values = {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples}
    progress, window_s = (
        values.get("tessera_last_progress_timestamp_seconds"),
        values.get("tessera_window_length_seconds"),
    )
    if progress is None or window_s is None:
        return f"port {port} does not serve Tessera metrics"
    idle = time.time() - progress
    if window_s > 0 and idle > STUCK_WINDOWS * window_s + STUCK_GRACE_S:
        return f"no window finished in {idle:.0f} s (a window lasts {window_s:.0f} s): stuck"
    return None


def _exec(command: list[str]) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(command[0], command)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", help=f"{', '.join(ACTIONS)}, or any tessera command")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="options of the node or command")


def _own_options(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The entrypoint's options (--nproc, --ignore-check) apart from the node's."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--nproc", type=int, default=None)
    parser.add_argument("--ignore-check", action="append", default=[])
    return parser.parse_known_args(argv)


def dispatch(action: str, rest: list[str]) -> int:
    if action == "health":
        problem = health(dict(os.environ))
        print(problem or "healthy")
        return 1 if problem else 0
    if action == "setup-local":
        from commands.local_setup import main as setup_local

        return setup_local(rest)
    if action not in ("miner", "validator"):
        _exec(["tessera", action, *rest])
    own, node_argv = _own_options(rest)
    if own.nproc is not None and action != "miner":
        print("tessera entrypoint: --nproc is for the miner only", file=sys.stderr)
        return 2
    try:
        command = prepare(action, node_argv, own.nproc, own.ignore_check)
    except (EntrypointError, ValueError, OSError) as exc:
        print(f"tessera entrypoint: cannot start the {action}:\n{exc}", file=sys.stderr)
        return 2
    _exec(command)


def run(args: argparse.Namespace) -> int:
    return dispatch(args.action, list(args.rest))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m commands.entrypoint ACTION [ARGS...]")
    sys.exit(dispatch(sys.argv[1], sys.argv[2:]))
