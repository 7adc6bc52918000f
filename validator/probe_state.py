"""Where a validator keeps its probe's copies of the weights and the window's mean.

While it probes, a validator holds the window's start (each probe restores the weights from it
exactly), the consensus step and, in the run's first windows, the previous window's step; for
the outer step, the window's mean. Beside the model on its device they cost three to four times
the weights' memory again: an 8B validator on one 80 GB GPU does not fit
(`node.runtime.memory.plan_validator_memory`). On the host (pinned where the model is on a
GPU) each tensor of them comes over when it is used, one at a time. The values are the same
either way: copies and elementwise steps, the same bits on either side.

``--probe-state`` (`ValidatorConfig.probe_state`): ``device``, ``host``, or ``auto``: the host
where the GPU's memory cannot hold the plan's device figure for the run's first windows.
"""

from __future__ import annotations

import torch

from node.runtime.memory import plan_validator_memory
from protocol.runconfig import RunConfig
from validator.config import ProbeState

__all__ = ["copy_to", "probe_keep", "zeros_on"]

HOST = torch.device("cpu")


def probe_keep(state: ProbeState, run: RunConfig, device: torch.device) -> torch.device:
    """The device the probe's copies and the window's mean live on (module docstring)."""
    if device.type != "cuda" or state == "device":
        return device
    if state == "host":
        return HOST
    total = torch.cuda.get_device_properties(device).total_memory
    return HOST if plan_validator_memory(run).launch_device > total else device


def copy_to(t: torch.Tensor, keep: torch.device) -> torch.Tensor:
    """A copy of ``t`` on ``keep``, in pinned host memory when it comes from a GPU."""
    out = t.detach().to(keep, copy=True)
    if keep.type == "cpu" and t.is_cuda:
        out = out.pin_memory()
    return out


def zeros_on(t: torch.Tensor, keep: torch.device) -> torch.Tensor:
    """Zeros of ``t``'s shape and type on ``keep``, in pinned host memory when ``t`` is on a GPU."""
    if keep.type == "cpu" and t.is_cuda:
        return torch.zeros(t.shape, dtype=t.dtype).pin_memory()
    return torch.zeros(t.shape, dtype=t.dtype, device=keep)
