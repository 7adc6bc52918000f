"""The run presets, `tiny` to `8B`, as raw tables that `RunConfig.preset` validates and merges
overrides into (`protocol.runconfig`)."""

from __future__ import annotations

from typing import Any

# Shapes and sizes:
# Shapes follow the LLaMA family: `1B` = Llama-3.2-1B, `8B` = Llama-3-8B
# (max_seq_len kept at 8192 without RoPE scaling). `150M` is a GPT-2-vocabulary LLaMA-style model;
# `tiny` trains on two CPU cores in minutes; its SparseLoCo settings (k, α) are tuned with
# `tessera bench train`. Batch, inner steps and window length of 150M and up come from the
# throughput model (`node.runtime.plan`, `tessera plan`): training fills over 90 % of each window
# on the preset's reference box (at the MFU measured on one H100, with the training recipe the
# box's memory allows) while upload, gather, decode and the lead's probes fit in the rest. 1B and
# 8B train H = 100 inner steps a window (the SparseLoCo paper tests H <= 250, and its loss grows
# with H); 1B takes a larger batch to keep its exchange (the gather's grace and the lead's
# probes) under a tenth of the window. `fetch_budget_s` covers the download, and the manifest
# wait the decode and the probes of the probation slots' updates even when the fetch takes its
# whole budget; the lead probes established peers in the time left. Warmup keeps the earlier presets' warmup steps;
# `total_windows` keeps their tokens. The larger presets' codec follows the SparseLoCo paper
# (docs/training.md).

_LLAMA3_VOCAB = 128256


def _model(**kw: Any) -> dict[str, Any]:
    base = {"rope_theta": 500000.0, "norm_eps": 1e-5, "tie_embeddings": False}
    return {**base, **kw}


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "name": "tiny",
        "preset_name": "tiny",
        "model": _model(
            vocab_size=4096,
            hidden_size=128,
            intermediate_size=384,
            n_layers=4,
            n_heads=4,
            n_kv_heads=2,
            max_seq_len=128,
            rope_theta=10000.0,
            tie_embeddings=True,
        ),
        "tokenizer": "embedded://tiny-bpe-4096",
        "dataset": "embedded://tiny-corpus",
        "seq_len": 128,
        "micro_batch_size": 8,
        "batch_size": 8,
        "inner_steps": 10,
        "optimizer": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 20, "weight_decay": 0.1},
        "codec": {"k": 256},  # tuned with `tessera bench train` (docs/training.md)
        "outer": {"total_windows": 100, "alpha": 2.0, "alpha_at_peak": 1.2},
        "timing": {
            "block_time_s": 1.0,
            "blocks_per_window": 20,
            "upload_deadline_blocks": 4,
            "clock_skew_tolerance_s": 1.0,
        },
        "gather_size": 8,
    },
    "150M": {
        "name": "150m",
        "preset_name": "150M",
        "model": _model(
            vocab_size=50304,
            hidden_size=768,
            intermediate_size=3072,
            n_layers=12,
            n_heads=12,
            n_kv_heads=12,
            max_seq_len=2048,
            rope_theta=10000.0,
            tie_embeddings=True,
        ),
        "tokenizer": "hf://gpt2",
        "dataset": "s3://tessera-data/fineweb-edu/gpt2",
        "seq_len": 1024,
        "micro_batch_size": 16,
        "batch_size": 512,
        "inner_steps": 335,
        "optimizer": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 62},
        "outer": {"total_windows": 444},
        "timing": {"blocks_per_window": 45, "upload_deadline_blocks": 2},
        "gather_size": 16,
    },
    "1B": {
        "name": "1b",
        "preset_name": "1B",
        "model": _model(
            vocab_size=_LLAMA3_VOCAB,
            hidden_size=2048,
            intermediate_size=8192,
            n_layers=16,
            n_heads=32,
            n_kv_heads=8,
            max_seq_len=8192,
            tie_embeddings=True,
        ),
        "tokenizer": "hf://meta-llama/Llama-3.2-1B",
        "dataset": "s3://tessera-data/fineweb-edu/llama3",
        "seq_len": 2048,
        "micro_batch_size": 8,
        "batch_size": 1088,
        "inner_steps": 100,
        "optimizer": {"lr": 6e-4, "min_lr": 6e-5, "warmup_steps": 250},
        "outer": {"total_windows": 1599},
        "timing": {"blocks_per_window": 63, "upload_deadline_blocks": 3},
        "consensus": {"fetch_budget_s": 20.0, "manifest_wait_s": 30.0},
        "gather_size": 20,
    },
    "8B": {
        "name": "8b",
        "preset_name": "8B",
        "model": _model(
            vocab_size=_LLAMA3_VOCAB,
            hidden_size=4096,
            intermediate_size=14336,
            n_layers=32,
            n_heads=32,
            n_kv_heads=8,
            max_seq_len=8192,
        ),
        "tokenizer": "hf://meta-llama/Meta-Llama-3-8B",
        "dataset": "s3://tessera-data/fineweb-edu/llama3",
        "seq_len": 2048,
        "micro_batch_size": 4,
        "batch_size": 512,
        "inner_steps": 100,
        "optimizer": {"lr": 3e-4, "min_lr": 3e-5, "warmup_steps": 500},
        "outer": {"total_windows": 1302},
        "timing": {"blocks_per_window": 231, "upload_deadline_blocks": 3},
        "consensus": {"manifest_wait_s": 180.0},
        "gather_size": 20,
    },
}
"""Raw preset tables; use `RunConfig.preset(name, **overrides)`."""
