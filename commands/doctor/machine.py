"""Checks of this machine: software versions, the run config, GPUs against the preset, disk space."""

from __future__ import annotations

import math
import platform
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from commands.doctor.report import Check, fail, ok, warn
from node.runtime.preflight import MIN_FREE_BYTES, PreflightError, check_disk
from protocol.runconfig import PRESETS, RunConfig, preset_param_count

GIB = 1 << 30
DDP_BYTES_PER_PARAM = 20
"""Per GPU under DDP: bf16/fp32 weights and grads, AdamW moments and the window's start copy."""
ACTIVATION_HEADROOM = 2 * GIB
"""CUDA context, activations of one micro-batch, allocator slack."""
STATE_BYTES_PER_PARAM = 16
"""On disk: fp32 weights, error feedback and AdamW's two moments."""
CPU_PRACTICAL_PARAMS = 20_000_000
"""Above this a CPU cannot do a window's inner steps in time."""


@dataclass(frozen=True)
class Gpu:
    name: str
    memory: int  # bytes


def visible_gpus() -> list[Gpu]:
    if not torch.cuda.is_available():
        return []
    return [
        Gpu(torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory)
        for i in range(torch.cuda.device_count())
    ]


def version_check() -> Check:
    try:
        ours = metadata.version("tessera-train")
    except metadata.PackageNotFoundError:
        ours = "not installed (source tree)"
    cuda = torch.version.cuda
    if cuda and torch.cuda.is_available():
        cuda_text = f"CUDA {cuda}"
    else:
        cuda_text = f"CUDA {cuda} (no GPU visible)" if cuda else "no CUDA (CPU build)"
    return ok(
        "versions",
        f"python {platform.python_version()}, torch {torch.__version__}, tessera {ours}, "
        f"{cuda_text}",
    )


def run_check(ref: str) -> tuple[Check, RunConfig | None]:
    """Load the run (preset name or config file); the row shows its run id."""
    from commands.miner import load_run

    try:
        run = load_run(ref)
    except (ValueError, OSError) as exc:
        return fail(
            "run",
            f"cannot load run {ref!r}: {exc}",
            f"--run must be a preset ({', '.join(PRESETS)}) or a readable run config file",
        ), None
    params = run.param_count()
    return ok(
        "run",
        f"run id {run.run_id} ({run.name}, preset {run.preset_name}, {params / 1e6:,.1f}M params)",
    ), run


def ddp_bytes_per_gpu(params: int) -> int:
    return DDP_BYTES_PER_PARAM * params + ACTIVATION_HEADROOM


def presets_that_fit(gpu_memory: int) -> list[str]:
    return [p for p in PRESETS if ddp_bytes_per_gpu(preset_param_count(p)) <= gpu_memory]


def gpu_check(run: RunConfig, device: str, gpus: Sequence[Gpu]) -> Check:
    """Does the preset fit the GPUs (DDP keeps a whole replica and its optimizer on each)?"""
    params = run.param_count()
    need = ddp_bytes_per_gpu(params)
    if not gpus:
        if device.startswith("cuda"):
            return fail(
                "gpu",
                f"--device {device} but no CUDA GPU is visible to torch {torch.__version__}",
                "check the driver (nvidia-smi) and install a CUDA build of PyTorch, "
                "or use --device cpu with the tiny preset",
            )
        if params <= CPU_PRACTICAL_PARAMS:
            return warn(
                "gpu",
                f"no GPU: training {run.preset_name} on the CPU; only the tiny preset is "
                "practical without GPUs",
                "use GPUs for any run larger than tiny",
            )
        return fail(
            "gpu",
            f"no GPU: the {run.preset_name} preset needs GPUs with ≥ {need / GIB:.0f} GiB each "
            f"(DDP, ~{DDP_BYTES_PER_PARAM} B/param); on a CPU only tiny is practical",
            "run on a machine with CUDA GPUs (see README, Running a peer)",
        )
    smallest = min(g.memory for g in gpus)
    names = sorted({g.name for g in gpus})
    box = f"{len(gpus)} × {', '.join(names)} ({smallest / GIB:.0f} GiB)"
    fits = presets_that_fit(smallest)
    if need <= smallest:
        return ok(
            "gpu",
            f"{box}: {run.preset_name} fits with DDP (~{need / GIB:.1f} GiB per GPU), "
            f"one replica per GPU, {len(gpus)} GPU(s) in use; presets that fit: "
            f"{', '.join(fits) or 'none'}",
        )
    sharded = math.ceil(DDP_BYTES_PER_PARAM * params / max(1, smallest - ACTIVATION_HEADROOM))
    return fail(
        "gpu",
        f"{box}: {run.preset_name} needs ~{need / GIB:.0f} GiB per GPU with DDP "
        f"(~{DDP_BYTES_PER_PARAM} B/param); sharded (FSDP2, planned) it would need ≥ {sharded} "
        "such GPUs",
        f"use a preset that fits these GPUs ({', '.join(fits) or 'none'}) or GPUs with "
        f"≥ {need / GIB:.0f} GiB",
    )


def disk_needed(params: int) -> int:
    """State written atomically (old and new copy on disk at once) plus room for caches."""
    return 2 * STATE_BYTES_PER_PARAM * params + MIN_FREE_BYTES


def _existing_parent(path: Path) -> Path:
    path = path.expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def disk_check(run: RunConfig, state_dir: Path) -> Check:
    needed = disk_needed(run.param_count())
    where = _existing_parent(state_dir)  # measure without creating anything
    try:
        check_disk(where, needed)
    except PreflightError as exc:
        return fail("disk", str(exc), "free space, or point --state-dir at a larger disk")
    except OSError as exc:
        return fail("disk", f"cannot inspect {where}: {exc.strerror}", "make --state-dir writable")
    free = shutil.disk_usage(where).free
    return ok(
        "disk",
        f"{free / GIB:,.1f} GiB free under {state_dir} (needs {needed / GIB:,.1f} GiB: "
        f"{2 * STATE_BYTES_PER_PARAM} B/param of state, saved atomically, + caches)",
    )
