"""The throughput model (`node.runtime.plan`, `tessera plan`) and the presets sized from it."""

from __future__ import annotations

import json
import math

import pytest
import torch

from codec.compress import Compressor
from codec.spec import ModelSpec
from commands.cli import main
from commands.plan import memory
from node.model.llama import build_model
from node.model.shapes import model_spec
from node.runtime.memory import PLAIN, RECIPES, STEP_TIME
from node.runtime.plan import (
    CPU_PRESETS,
    REFERENCE,
    TARGET_BUSY,
    Box,
    entries,
    plan,
    probe_seconds,
    suggest,
    update_size,
)
from node.strategy import make_strategy
from node.strategy.outer import LAND_BY
from node.window.consensus import MIN_PUBLISH_RESERVE_S
from node.window.selection import probation_slots
from protocol.runconfig import PRESETS, RunConfig

LLAMA3_8B_PARAMS = 8_030_261_248  # the published parameter count of Meta-Llama-3-8B


@pytest.mark.parametrize("name", [n for n in PRESETS if n not in CPU_PRESETS])
def test_shipped_presets_keep_their_reference_box_busy(name: str) -> None:
    p = plan(RunConfig.preset(name), REFERENCE[name])
    assert p.busy >= TARGET_BUSY, f"{name}: {p.busy:.1%} busy"
    assert p.fits, (
        f"{name}: compute {p.compute_s:.0f} s + exchange {p.exchange_s:.0f} s > {p.window_s} s"
    )
    assert p.budgets_fit, f"{name}: download {p.download_s:.0f} s, decode {p.decode_s:.0f} s"


def test_1b_and_8b_train_at_most_100_inner_steps_a_window_and_stay_busy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """What `tessera plan --json` prints for the shipped presets at the measured exchange rate:
    1B and 8B at H <= 100, training at least 90 % of each window, the exchange fitting beside it
    and within the consensus budgets, with outer.delay = 0."""
    assert main(["plan", "--json"]) == 0
    rows = {r["preset"]: r for r in json.loads(capsys.readouterr().out)["plans"]}
    for name in ("1B", "8B"):
        row = rows[name]
        assert row["inner_steps"] <= 100 and row["busy"] >= TARGET_BUSY, row
        assert row["fits"] and row["budgets_fit"] and row["outer_delay"] == 0, row


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_fits_its_box_with_the_sharding_a_miner_picks(name: str) -> None:
    """What `tessera plan --json` reports as ``memory.fits``: the peer, DDP or FSDP2 as
    ``--sharding auto`` picks on its reference box, fits that box's GPUs."""
    got = memory(RunConfig.preset(name), REFERENCE[name], None)
    assert got["fits"] and got[got["sharding"]]["fits"], got
    assert got["sharding"] == ("fsdp2" if name == "8B" else "ddp")  # 8B: DDP fits no 80 GiB GPU


@pytest.mark.parametrize("name", CPU_PRESETS)
def test_the_cpu_test_preset_keeps_up_with_its_windows(name: str) -> None:
    p = plan(RunConfig.preset(name), REFERENCE[name])
    assert p.fits and p.budgets_fit


def test_a_short_8b_window_and_the_exchange_rate() -> None:
    """An 8B window of 30 steps × 128 × 2048 tokens in 30 blocks: 7.9 M tokens, 119 s of FLOPs
    on 8 × H100 at 40 % MFU, longer by the recipe 80 GiB GPUs need (layers recomputed), so 43 %
    of a 360 s window. Its gather (20 updates of 125 M entries) fits beside the training at the
    host's rate with decode workers, not on one thread; with the lead's probes (as many of the 20
    as its time before the manifest holds, 25 s each on one GPU) the window does not fit."""
    short = RunConfig.preset("8B", inner_steps=30, batch_size=128, timing={"blocks_per_window": 30})
    p = plan(short, Box("h100", 8, 1.0, mfu=0.40))
    assert p.params == LLAMA3_8B_PARAMS
    assert p.tokens == 7_864_320
    assert p.recipe == RECIPES[-1] and p.recipe.checkpoint_layers
    assert p.compute_s == pytest.approx(119.0 * STEP_TIME[-1], rel=0.02)
    assert p.window_s == 360 and p.busy == pytest.approx(0.43, abs=0.005)
    assert p.decode_s == pytest.approx(20 * entries(short, model_spec(short.model)) / 66.1e6)
    assert p.compute_s + p.comm_s <= p.window_s < p.compute_s + p.exchange_s and not p.fits
    one_thread = plan(short, Box("h100", 8, 1.0, mfu=0.40, exchange_rate=7.0e6))
    assert one_thread.compute_s + one_thread.comm_s > one_thread.window_s
    assert one_thread.decode_s > 5 * p.decode_s


def test_the_meta_spec_is_the_built_models_spec() -> None:
    run = RunConfig.preset("tiny")
    assert model_spec(run.model) == ModelSpec.from_module(build_model(run.model, run.seed))


def test_entries_are_what_the_compressor_keeps() -> None:
    run = RunConfig.preset("tiny")
    spec = model_spec(run.model)
    comp = Compressor(spec, run.codec)
    gen = torch.Generator().manual_seed(1)
    kept = 0
    for t in spec.tensors:
        sparse = comp.compress(t.name, torch.randn(t.shape, generator=gen), 0.95)
        kept += sum(g.idx.numel() for g in sparse.groups)
    assert entries(run, spec) == kept
    dense = RunConfig.preset("tiny", strategy="diloco")
    assert entries(dense, spec) == spec.numel


@pytest.mark.parametrize("strategy", ["sparseloco", "diloco"])
def test_the_update_size_is_the_encoded_size_of_a_real_update(strategy: str) -> None:
    """A model with large tensors (like every preset from 150M up) encodes to the size the plan
    predicts, within 3 %."""
    run = RunConfig.preset("150M", strategy=strategy, model={"n_layers": 1, "vocab_size": 8192})
    spec = model_spec(run.model)
    s = make_strategy(run, spec)
    gen = torch.Generator().manual_seed(2)
    deltas = {t.name: torch.randn(t.shape, generator=gen) * 1e-3 for t in spec.tensors}
    meta: dict[str, str | int] = {"run_id": run.run_id, "window": 0, "uid": 3, "hotkey": "5" * 48}
    data = s.format.to_bytes(s.encoder.encode(deltas, 0), meta, lambda _d: bytes(64))
    assert update_size(run, spec).bytes == pytest.approx(len(data), rel=0.03)


def test_suggest_sizes_a_window_that_meets_the_target() -> None:
    run = RunConfig.preset("1B", codec={"k": 128}, gather_size=40)
    s = suggest(run, REFERENCE["1B"], target=0.92)
    sized = RunConfig.preset(
        "1B", codec={"k": 128}, gather_size=40, inner_steps=s.inner_steps,
        timing={"blocks_per_window": s.blocks_per_window},
    )  # fmt: skip
    p = plan(sized, REFERENCE["1B"])
    assert p.busy >= 0.92 and p.fits
    # the shortest such window: one block less leaves no whole number of steps that reaches it
    step_s = p.compute_s / s.inner_steps
    shorter = (s.blocks_per_window - 1) * sized.timing.block_time_s
    assert math.floor((shorter - p.exchange_s) / step_s) * step_s < 0.92 * shorter


def test_plan_command_prints_the_figures(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--preset", "8B", "--gpus", "8", "--gpu", "h100", "--link-gbps", "1"]
    assert main([*args, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["plans"]
    assert row["busy"] >= TARGET_BUSY and row["fits"]
    assert row["compute_s"] + row["exchange_s"] <= row["window_s"]
    assert row["exchange_s"] == pytest.approx(row["comm_s"] + row["validator_probes_s"])
    assert row["comm_s"] == pytest.approx(
        row["upload_s"] + row["gather_wait_s"] + row["download_s"] + row["decode_s"]
    )
    assert row["inner_steps"] == RunConfig.preset("8B").inner_steps
    v = row["validator_memory"]  # one H100: only with the probe's copies on the host
    assert not v["fits"] and v["probe_state_host"]["fits"]
    # a slow link: the gather no longer fits beside the training
    assert main(["plan", "--preset", "8B", "--link-gbps", "0.02", "--json"]) == 0
    (slow,) = json.loads(capsys.readouterr().out)["plans"]
    assert slow["download_s"] == pytest.approx(50 * row["download_s"])
    assert not slow["fits"]
    assert main(["plan", "--preset", "8B"]) == 0
    out = capsys.readouterr().out
    assert "busy: training" in out and "8 × H100 SXM" in out


def test_the_recipe_the_box_memory_allows_sets_the_step_time() -> None:
    """1B under DDP: an H200 (141 GiB) keeps every activation; an H100 (80 GiB) of the same peak
    rate needs the loss in chunks and trains that much slower; the CPU box keeps activations."""
    run = RunConfig.preset("1B")
    roomy, tight = plan(run, Box("h200", 8, 1.0)), plan(run, Box("h100", 8, 1.0))
    assert roomy.recipe == PLAIN and tight.recipe == RECIPES[1]
    assert tight.compute_s / roomy.compute_s == pytest.approx(STEP_TIME[1])
    assert plan(RunConfig.preset("tiny"), REFERENCE["tiny"]).recipe == PLAIN


def test_the_lead_probes_until_its_last_block_to_publish() -> None:
    """The lead probes the selected updates before its manifest, each in the same time on one
    GPU (the probe grows with the model, not with the crowd registered), until its last block to
    publish: the peers wait for all of them when they fit, for the lead's whole time when they do
    not. The established peers' updates it had no time for are applied unprobed."""
    roomy = RunConfig.preset("1B", consensus={"manifest_wait_s": 3000.0})
    p = plan(roomy, REFERENCE["1B"])
    one = p.probes_s / roomy.gather_size
    assert one > 0 and p.probes_s < p.probe_budget_s  # every selected update probed
    doubled = plan(RunConfig.preset("1B", gather_size=40, consensus={"manifest_wait_s": 3000.0}),
                   REFERENCE["1B"])  # fmt: skip
    assert doubled.probes_s == pytest.approx(2 * p.probes_s)
    bigger = plan(RunConfig.preset("8B", consensus={"manifest_wait_s": 9000.0}), REFERENCE["1B"])
    ratio = RunConfig.preset("8B").param_count() / roomy.param_count()
    assert bigger.probes_s == pytest.approx(ratio * p.probes_s)
    for name in ("1B", "8B"):  # the presets: the lead's time, not every probe
        run = RunConfig.preset(name)
        q = plan(run, REFERENCE[name])
        lead = q.lead_s - q.download_s - q.decode_s - MIN_PUBLISH_RESERVE_S
        every = run.gather_size * probe_seconds(run, REFERENCE[name])
        assert q.probes_s == pytest.approx(lead) and q.probes_s < every


@pytest.mark.parametrize("name", ["1B", "8B"])
def test_the_newcomers_probes_fit_even_when_the_fetch_takes_its_whole_budget(name: str) -> None:
    """A newcomer is applied only once a probe shows it trains. A selected peer that sends at the
    least rate holds the lead's fetch to its budget; the manifest wait alone must then still hold
    the decode and the probation slots' probes, or a slow crowd keeps every newcomer out."""
    run = RunConfig.preset(name)
    p = plan(run, REFERENCE[name])
    after_fetch = p.lead_s - p.fetch_budget_s - p.decode_s - MIN_PUBLISH_RESERVE_S
    assert p.budgets_fit and p.newcomer_probes_s <= after_fetch
    assert p.newcomer_probes_s == pytest.approx(
        probation_slots(run) * probe_seconds(run, REFERENCE[name])
    )
    short = RunConfig.preset(name, consensus={"manifest_wait_s": p.newcomer_probes_s / 2})
    assert not plan(short, REFERENCE[name]).budgets_fit
    more = RunConfig.preset(name, consensus={"probation_fraction": 1.0})  # every slot a newcomer's
    assert not plan(more, REFERENCE[name]).budgets_fit


def test_peers_wait_for_the_leads_probes_before_the_next_window() -> None:
    """With delay 0 the next window trains once the lead's manifest is out, after its probes: a
    window that holds training and the gather but not the probes does not fit. With delay 1 the
    exchange must land by `LAND_BY` of the inner steps, or the peer waits there; training, that
    wait and the upload must fit in one window."""
    run = RunConfig.preset("1B")
    p = plan(run, REFERENCE["1B"])
    blocks = math.ceil((p.compute_s + p.comm_s + p.probes_s / 2) / run.timing.block_time_s)
    tight = plan(RunConfig.preset("1B", timing={"blocks_per_window": blocks}), REFERENCE["1B"])
    assert tight.compute_s + tight.comm_s <= tight.window_s and not tight.fits
    wait = tight.exchange_s - tight.upload_s - LAND_BY * tight.compute_s
    assert wait > 0 and tight.compute_s + wait + tight.upload_s <= tight.window_s
    assert tight.fits_overlapped  # lands after the first tenth; the wait still fits
    no_room = math.floor((tight.compute_s + wait) / run.timing.block_time_s)
    late = plan(RunConfig.preset("1B", timing={"blocks_per_window": no_room}), REFERENCE["1B"])
    assert late.compute_s + late.upload_s < late.window_s + late.deadline_s
    assert not late.fits_overlapped  # training and the wait overrun the window
