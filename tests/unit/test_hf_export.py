"""Hugging Face export: bit-exact round trip, atomic files, and logits equal to transformers'."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from node.model.hf_export import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    HFExportError,
    export_hf,
    hf_config,
    load_hf,
    model_config_from_hf,
)
from node.model.llama import build_model
from protocol.runconfig import ModelConfig

CONFIGS = {
    "tied-gqa": ModelConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=64,
        rope_theta=10000.0,
        tie_embeddings=True,
        norm_eps=1e-5,
    ),
    "untied-mqa-llama3-theta": ModelConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        n_layers=2,
        n_heads=4,
        n_kv_heads=1,
        max_seq_len=64,
        rope_theta=500000.0,
        tie_embeddings=False,
        norm_eps=1e-6,
    ),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_round_trip_is_bit_exact(tmp_path: Path, name: str) -> None:
    cfg = CONFIGS[name]
    model = build_model(cfg, 11)
    export_hf(model, cfg, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]  # no temps
    loaded, loaded_cfg = load_hf(tmp_path)
    assert loaded_cfg == cfg
    original, again = model.state_dict(), loaded.state_dict()
    assert original.keys() == again.keys()
    assert all(torch.equal(original[k], again[k]) for k in original)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == cfg.tie_embeddings
    stored = load_file(str(tmp_path / WEIGHTS_NAME))
    assert ("lm_head.weight" in stored) != cfg.tie_embeddings


def test_config_json_is_a_llama_config(tmp_path: Path) -> None:
    cfg = CONFIGS["tied-gqa"]
    export_hf(build_model(cfg, 0), cfg, tmp_path, dtype=torch.bfloat16)
    written = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert written["architectures"] == ["LlamaForCausalLM"]
    assert written["torch_dtype"] == "bfloat16"
    assert written["num_key_value_heads"] == 2 and written["tie_word_embeddings"] is True
    assert load_file(str(tmp_path / WEIGHTS_NAME))["model.norm.weight"].dtype == torch.bfloat16
    assert model_config_from_hf(written) == cfg


def test_unsupported_llama_variants_are_refused() -> None:
    base = hf_config(CONFIGS["tied-gqa"])
    for bad in (
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
        {"attention_bias": True},
        {"model_type": "mistral"},
        {"head_dim": 32},
    ):
        with pytest.raises(HFExportError):
            model_config_from_hf({**base, **bad})


@pytest.mark.parametrize("name", CONFIGS)
def test_transformers_gives_the_same_logits(tmp_path: Path, name: str) -> None:
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed (pip install transformers)"
    )
    cfg = CONFIGS[name]
    model = build_model(cfg, 5).eval()
    export_hf(model, cfg, tmp_path)
    hf_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    tokens = torch.randint(
        0, cfg.vocab_size, (2, cfg.max_seq_len), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        ours, theirs = model(tokens), hf_model(tokens).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
