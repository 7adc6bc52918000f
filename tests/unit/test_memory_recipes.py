"""The training recipes the memory plan chooses from: each trades compute for memory, the plan
picks the fastest that fits, and the operator's choice wins over the plan."""

from __future__ import annotations

import pytest
import torch

from miner.multigpu import training_recipe
from miner.ranks import Ranks
from node.runtime.memory import (
    GIB,
    PLAIN,
    RECIPES,
    STEP_TIME,
    MemoryOptions,
    activation_bytes,
    pick_recipe,
    plan_memory,
)
from protocol.presets import PRESETS
from protocol.runconfig import RunConfig


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_each_recipe_keeps_no_more_than_the_one_before_and_costs_no_less(preset: str) -> None:
    run = RunConfig.preset(preset)
    kept = [activation_bytes(run, r) for r in RECIPES]
    assert kept == sorted(kept, reverse=True)
    assert kept[-1] < kept[0]  # recomputing the layers always saves memory
    assert list(STEP_TIME) == sorted(STEP_TIME) and STEP_TIME[0] == 1.0


def test_a_loss_in_chunks_saves_the_logits_of_all_but_one_chunk() -> None:
    run = RunConfig.preset("1B")  # 8 × 2,048 positions per micro-batch, 128 k vocabulary
    tokens = run.micro_batch_size * run.seq_len
    whole, chunked = activation_bytes(run), activation_bytes(run, MemoryOptions(False, 1024))
    per_position = (whole - chunked) / (tokens - 1024)
    assert per_position == pytest.approx(
        (whole - activation_bytes(run, MemoryOptions(False, 2048))) / (tokens - 2048)
    )
    assert per_position > 2 * run.model.vocab_size  # at least the bf16 logits themselves


@pytest.mark.parametrize("preset", ["150M", "1B", "8B"])
def test_the_plan_picks_the_fastest_recipe_that_fits(preset: str) -> None:
    run = RunConfig.preset(preset)
    totals = [plan_memory(run, 8, "fsdp2", r).total for r in RECIPES]
    assert pick_recipe(run, 8, "fsdp2", totals[0]) == PLAIN
    for i in range(1, len(RECIPES)):
        if totals[i] < totals[i - 1]:
            assert pick_recipe(run, 8, "fsdp2", totals[i - 1] - 1) == RECIPES[i]
    assert pick_recipe(run, 8, "fsdp2", 1 * GIB) == RECIPES[-1]  # nothing fits: the smallest


def test_the_operators_recipe_wins_and_the_cpu_keeps_activations() -> None:
    run, ranks, cpu = RunConfig.preset("1B"), Ranks(), torch.device("cpu")
    assert training_recipe(run, ranks, cpu, None, None) == PLAIN
    assert training_recipe(run, ranks, cpu, True, None) == MemoryOptions(True, 0)
    assert training_recipe(run, ranks, cpu, None, 512) == MemoryOptions(False, 512)
    assert training_recipe(run, ranks, cpu, False, 0) == PLAIN
