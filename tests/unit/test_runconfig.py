"""RunConfig: run id stability, sensitivity to every field, presets, file formats, mismatches."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest

from codec.spec import CODEC_VERSION, CodecParams
from protocol.runconfig import (
    PRESETS,
    ModelConfig,
    RunConfig,
    RunConfigError,
    RunMismatchError,
    preset_param_count,
    require_same_run,
)


@pytest.fixture
def tiny() -> RunConfig:
    return RunConfig.preset("tiny")


def test_run_id_shape_and_determinism(tiny: RunConfig) -> None:
    assert len(tiny.run_id) == 32
    assert all(c in "0123456789abcdef" for c in tiny.run_id)
    assert RunConfig.preset("tiny").run_id == tiny.run_id
    assert tiny.codec_version == CODEC_VERSION
    assert tiny.codec == CodecParams(k=256)  # tiny keeps 256 of 4096 (docs/training.md)


@pytest.mark.parametrize("suffix", [".toml", ".json"])
@pytest.mark.parametrize("name", list(PRESETS))
def test_load_dump_round_trip(tmp_path: Path, name: str, suffix: str) -> None:
    cfg = RunConfig.preset(name)
    path = cfg.dump(tmp_path / f"run{suffix}")
    loaded = RunConfig.load(path)
    assert loaded == cfg
    assert loaded.run_id == cfg.run_id
    assert loaded.canonical_json() == cfg.canonical_json()
    # and across formats
    other = ".json" if suffix == ".toml" else ".toml"
    again = RunConfig.load(loaded.dump(tmp_path / f"again{other}"))
    assert again.run_id == cfg.run_id


def test_toml_output_is_valid_toml_with_run_id(tiny: RunConfig) -> None:
    text = tiny.to_toml()
    assert tiny.run_id in text.splitlines()[0]
    data = tomllib.loads(text)
    assert data["model"]["hidden_size"] == tiny.model.hidden_size
    assert data["optimizer"]["betas"] == list(tiny.optimizer.betas)


def test_unusual_strings_survive_toml(tmp_path: Path) -> None:
    cfg = RunConfig.preset("tiny", dataset='s3://b/p"q\\r~', tokenizer="hf://x/y")
    assert RunConfig.load(cfg.dump(tmp_path / "r.toml")).run_id == cfg.run_id


def test_unknown_suffix_loads_either_format(tmp_path: Path, tiny: RunConfig) -> None:
    (tmp_path / "a.cfg").write_text(tiny.to_json())
    (tmp_path / "b.cfg").write_text(tiny.to_toml())
    assert RunConfig.load(tmp_path / "a.cfg").run_id == tiny.run_id
    assert RunConfig.load(tmp_path / "b.cfg").run_id == tiny.run_id


def test_key_order_and_int_floats_do_not_change_the_id(tiny: RunConfig) -> None:
    data = tiny.model_dump(mode="json")
    data["optimizer"]["grad_clip"] = 1  # an int where a float is expected
    shuffled = dict(reversed(list(data.items())))
    assert RunConfig.from_dict(shuffled).run_id == tiny.run_id
    assert RunConfig.from_json(json.dumps(shuffled)).run_id == tiny.run_id


def _leaf_paths(d: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += _leaf_paths(v, (*prefix, k))
        else:
            out.append((*prefix, k))
    return out


def _changed(value: Any, path: tuple[str, ...]) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        # keep divisibility constraints valid
        return {
            "n_heads": value * 2,
            "n_kv_heads": value * 2,
            "hidden_size": value * 2,
            "batch_size": value * 2,
            "micro_batch_size": value // 2 if value > 1 else value,
            "seq_len": value // 2,
            "max_seq_len": value * 2,
            "tile": value // 2,
            "k": value // 2,
            "codec_version": value + 1,
            "value_bits": 1,
            "upload_deadline_blocks": value + 1,
        }.get(path[-1], value + 1)
    if isinstance(value, float):
        return value * 0.5 if value > 0 else 0.5
    if isinstance(value, str):
        literals = {
            ("optimizer", "name"): "sgd",
            ("strategy",): "diloco",
            ("outer", "optimizer"): "nesterov",
            ("dense", "dtype"): "fp32",
        }
        if path in literals:
            return literals[path]
        return {"schedule": "cosine"}.get(path[-1], value + "x")
    if isinstance(value, list):
        return [v * 0.5 for v in value]
    if value is None and path == ("dataset_digest",):
        return "sha256:" + "ab" * 32
    if value is None and path == ("outer", "alpha_at_peak"):
        return 0.5
    raise AssertionError(path)


def test_every_field_change_changes_the_run_id(tiny: RunConfig) -> None:
    base = tiny.model_dump(mode="json")
    paths = _leaf_paths(base)
    assert len(paths) >= 35
    seen = {tiny.run_id}
    for path in paths:
        if path in {("optimizer", "schedule")}:
            continue  # a single-valued literal: no other legal value exists
        data = json.loads(json.dumps(base))
        node = data
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = _changed(node[path[-1]], path)
        cfg = RunConfig.from_dict(data)
        assert cfg.run_id not in seen, path
        seen.add(cfg.run_id)


def test_a_default_min_support_keeps_the_run_ids_of_configs_made_before_it(
    tiny: RunConfig,
) -> None:
    assert b"min_support" not in tiny.canonical_json()
    assert b"min_support" in RunConfig.preset("tiny", outer={"min_support": 2}).canonical_json()


def test_copies_get_their_own_run_id(tiny: RunConfig) -> None:
    _ = tiny.run_id
    copy = tiny.model_copy(update={"seed": 5})
    assert copy.run_id == RunConfig.preset("tiny", seed=5).run_id != tiny.run_id


def test_overrides_merge_into_nested_tables(tiny: RunConfig) -> None:
    cfg = RunConfig.preset("tiny", optimizer={"lr": 1e-3}, timing={"blocks_per_window": 30})
    assert cfg.optimizer.lr == 1e-3
    assert cfg.optimizer.warmup_steps == tiny.optimizer.warmup_steps
    assert cfg.timing.blocks_per_window == 30
    assert cfg.run_id != tiny.run_id
    assert RunConfig.preset("tiny", codec=CodecParams(tile=32, k=16)).codec.k == 16


def test_frozen_and_strict(tiny: RunConfig) -> None:
    with pytest.raises(Exception):  # noqa: B017 - pydantic's frozen error
        tiny.seq_len = 64  # type: ignore[misc]
    with pytest.raises(RunConfigError):
        RunConfig.preset("tiny", surprise=1)
    with pytest.raises(RunConfigError):
        RunConfig.preset("tiny", model={"extra": 1})
    with pytest.raises(RunConfigError):
        RunConfig.preset("nope")


@pytest.mark.parametrize(
    "overrides",
    [
        {"seq_len": 4096},  # longer than max_seq_len
        {"batch_size": 12},  # not a multiple of micro_batch_size
        {"model": {"n_kv_heads": 3}},
        {"timing": {"upload_deadline_blocks": 20}},  # not inside the next window
        {"optimizer": {"min_lr": 1.0}},
        {"optimizer": {"lr": float("nan")}},
        {"outer": {"beta": 1.0}},
        {"outer": {"min_support": 0}},
        {"strategy": "diloco", "outer": {"min_support": 2}},  # dense updates have no support
        {"codec": {"tile": 8, "k": 100}},
        {"name": "has space"},
        {"dataset": ""},
    ],
)
def test_invalid_configs_are_refused(overrides: dict[str, Any]) -> None:
    with pytest.raises(RunConfigError):
        RunConfig.preset("tiny", **overrides)


def test_stored_run_id_must_match(tmp_path: Path, tiny: RunConfig) -> None:
    data = json.loads(tiny.to_json())
    data["seq_len"] = 64
    (tmp_path / "r.json").write_text(json.dumps(data))
    with pytest.raises(RunMismatchError):
        RunConfig.load(tmp_path / "r.json")


@pytest.mark.parametrize("text", ["{", "[1, 2]", '{"a": NaN}', "", "x" * (2 << 20)])
def test_garbage_json_is_a_run_config_error(text: str) -> None:
    with pytest.raises(RunConfigError):
        RunConfig.from_json(text)


def test_garbage_files(tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_text("name = ")
    with pytest.raises(RunConfigError):
        RunConfig.load(tmp_path / "bad.toml")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe")
    with pytest.raises(RunConfigError):
        RunConfig.load(tmp_path / "bin.json")
    with pytest.raises(RunConfigError):
        RunConfig.load(tmp_path / "missing.toml")


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [
        ("tiny", 0.5e6, 5e6),
        ("150M", 120e6, 180e6),
        ("1B", 1.1e9, 1.4e9),
        ("8B", 7.8e9, 8.2e9),
    ],
)
def test_preset_param_counts(name: str, low: float, high: float) -> None:
    assert low <= preset_param_count(name) <= high


def test_the_70b_shape_is_a_lab_config_for_planning_not_a_preset() -> None:
    """No 70B preset: its peer fits no 8-GPU box (`tessera plan`); its shape stays for planning."""
    run = RunConfig.load(Path(__file__).resolve().parents[2] / "lab" / "configs" / "70b.toml")
    assert 69e9 <= run.param_count() <= 72e9
    with pytest.raises(ValueError, match="70B"):
        RunConfig.preset("70B")


def test_param_count_matches_a_manual_count() -> None:
    m = ModelConfig(
        vocab_size=10,
        hidden_size=8,
        intermediate_size=12,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        max_seq_len=16,
        rope_theta=1e4,
        tie_embeddings=False,
        norm_eps=1e-5,
    )
    # embed 80 + head 80 + final norm 8 + 2 * (q 64 + k 32 + v 32 + o 64 + mlp 288 + norms 16)
    assert m.param_count() == 80 + 80 + 8 + 2 * (64 + 32 + 32 + 64 + 288 + 16)


def test_llama3_8b_exact() -> None:
    assert preset_param_count("8B") == 8_030_261_248


def test_derived_values(tiny: RunConfig) -> None:
    assert tiny.outer.ef_freeze_windows == 5  # 5% of 100
    assert tiny.total_inner_steps == tiny.outer.total_windows * tiny.inner_steps
    assert tiny.grad_accum_steps == 1


def test_require_same_run() -> None:
    a = RunConfig.preset("tiny").run_id
    b = RunConfig.preset("tiny", seed=1).run_id
    require_same_run(a, a)
    for bad in (b, a.upper(), a + " ", None, 123, b"x"):
        with pytest.raises(RunMismatchError) as info:
            require_same_run(a, bad, "peer 7")
        assert info.value.local_run_id == a
        assert "peer 7" in str(info.value)


def test_an_unset_alpha_at_peak_keeps_the_run_ids_of_configs_made_before_it() -> None:
    plain = RunConfig.preset("tiny", outer={"alpha_at_peak": None})
    assert b"alpha_at_peak" not in plain.canonical_json()
    assert b"alpha_at_peak" in RunConfig.preset("tiny", outer={"alpha_at_peak": 1}).canonical_json()
