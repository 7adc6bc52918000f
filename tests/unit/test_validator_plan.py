"""What a validator holds (`node.runtime.memory.plan_validator_memory`), against the tensors a
real probe keeps, and where it may keep them (`validator.probe_state`)."""

from __future__ import annotations

import pytest
import torch

from codec.aggregate import update_norm
from codec.compress import Compressor
from codec.spec import ModelSpec
from node.data.batches import open_run_dataset
from node.model.llama import build_model
from node.runtime.memory import GIB, OVERHEAD, PROBE_LOGIT_BYTES, plan_validator_memory
from protocol.runconfig import RunConfig
from validator.config import ValidatorConfig
from validator.probe_state import probe_keep
from validator.reveal import reveal_for
from validator.scoring import LossProbe

RUN = RunConfig.preset("tiny")
CPU = torch.device("cpu")


def test_the_plan_counts_the_copies_a_real_probe_keeps() -> None:
    """A probe at launch (three updates in the consensus, the previous step as a covariate) keeps
    the window's start, the consensus step and the previous step: 12 bytes per parameter of the
    model it probes, which is what the plan adds to the model, a forward pass and the overhead."""
    model = build_model(RUN.model, RUN.seed)
    spec = ModelSpec.from_module(model)
    gen = torch.Generator().manual_seed(3)
    updates = {}
    for uid in range(3):
        comp = Compressor(spec, RUN.codec)
        updates[uid] = [
            comp.compress(t.name, torch.randn(t.shape, generator=gen) * 1e-3, 0.95)
            for t in spec.tensors
        ]
    norms = {u: update_norm(x) for u, x in updates.items()}
    previous = {k: torch.randn(p.shape, generator=gen) for k, p in model.named_parameters()}
    _, dataset = open_run_dataset(RUN)
    reveal = reveal_for(dataset, RUN.run_id, 0, b"k" * 32, 8, 8)
    cfg = ValidatorConfig(n_random=8, n_own=8)
    probe = LossProbe(model, RUN, dataset, 0, reveal, updates, norms, cfg, CPU, previous=previous)
    assert probe.ref is not None and probe.prev is not None
    kept = sum(t.nbytes for d in (probe.start, probe.ref, probe.prev) for t in d.values())
    params = sum(p.numel() for p in model.parameters())
    assert kept == 12 * params
    plan = plan_validator_memory(RUN)
    logits = RUN.micro_batch_size * RUN.seq_len * RUN.model.vocab_size * PROBE_LOGIT_BYTES
    model_bytes = 4 * params  # outer SGD, no delay: no outer state
    assert plan.launch_device == model_bytes + kept + logits + OVERHEAD
    assert plan.launch_device - plan.device == 4 * params  # the previous step, at launch only


def test_on_the_host_an_8b_validator_fits_one_80_gb_gpu() -> None:
    """Beside the model the probe's copies do not fit one H100; on the host the device holds
    the model, one forward pass and one tensor at a time."""
    run = RunConfig.preset("8B")
    beside, on_host = plan_validator_memory(run), plan_validator_memory(run, on_host=True)
    assert not beside.fits(80 * GIB)
    assert on_host.fits(80 * GIB, launching=True)
    assert on_host.host - beside.host == 8 * run.param_count()  # the copies moved over


@pytest.mark.parametrize("state", ["auto", "device", "host"])
def test_a_cpu_validator_keeps_everything_in_its_one_memory(state: str) -> None:
    assert probe_keep(state, RUN, CPU) == CPU  # type: ignore[arg-type]
