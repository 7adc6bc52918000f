"""Export to and load from a Hugging Face `LlamaForCausalLM` folder.

`export_hf(model, cfg, directory)` writes

- `model.safetensors`: the state dict under HF names (identical to ours, see `node.model.llama`); with
  tied embeddings `lm_head.weight` is left out, as Hugging Face does;
- `config.json`: a `LlamaConfig` dict (`hf_config`);
- optionally `tokenizer.json` (its end-of-text id then goes into the config);

each file atomically (temporary file, fsync, rename), weights first and `config.json` last, so a
folder with a config always has complete weights. `load_hf(directory)` reads such a folder (ours
or one written by `transformers`, as long as it is a plain Llama: no rope scaling, no biases,
head_dim = hidden/heads) back into a `CausalLM` and its `ModelConfig`; fp32 round trips are
bit-exact.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from codec.errors import TesseraError
from node.data.tokenizer import eos_token_id
from node.model.llama import INIT_STD, CausalLM
from node.runtime.atomic_files import atomic_path, write_json_atomic, write_text_atomic
from protocol.runconfig import ModelConfig

__all__ = [
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "HFExportError",
    "export_hf",
    "hf_config",
    "load_hf",
    "model_config_from_hf",
]

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
TOKENIZER_NAME = "tokenizer.json"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class HFExportError(TesseraError, ValueError):
    """A Hugging Face folder that cannot be read as a plain Llama model."""


def hf_config(
    cfg: ModelConfig, dtype: torch.dtype = torch.float32, eos_token_id: int | None = None
) -> dict[str, Any]:
    """The `LlamaConfig`-compatible dict for `cfg`."""
    return {
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "num_hidden_layers": cfg.n_layers,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": INIT_STD,
        "use_cache": True,
        "torch_dtype": _DTYPE_NAMES[dtype],
    }


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The `ModelConfig` of a Llama `config.json` dict; refuses features we do not implement."""
    arch = hf.get("architectures") or ["LlamaForCausalLM"]
    if hf.get("model_type", "llama") != "llama" or arch != ["LlamaForCausalLM"]:
        raise HFExportError(f"not a LlamaForCausalLM config: {hf.get('model_type')}, {arch}")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise HFExportError(f"{key}=true is not supported")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}  # v5 / v4 spelling
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise HFExportError(f"rope scaling {rope!r} is not supported")
    rope_theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    if hf.get("hidden_act", "silu") != "silu":
        raise HFExportError(f"hidden_act {hf.get('hidden_act')!r} is not supported")
    heads = hf["num_attention_heads"]
    try:
        cfg = ModelConfig(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=heads,
            n_kv_heads=hf.get("num_key_value_heads") or heads,
            max_seq_len=hf["max_position_embeddings"],
            rope_theta=float(rope_theta),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        )
    except (KeyError, ValueError) as e:
        raise HFExportError(f"unusable Llama config: {e}") from e
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim != cfg.head_dim:
        raise HFExportError(f"head_dim {head_dim} != hidden_size / num_attention_heads")
    return cfg


def _export_tensors(model: CausalLM, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_embeddings:
            continue  # HF re-ties it from embed_tokens
        tensors[name] = tensor.detach().to(device="cpu", dtype=dtype).contiguous()
    return tensors


def export_hf(
    model: CausalLM,
    cfg: ModelConfig,
    directory: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    tokenizer: Tokenizer | None = None,
) -> Path:
    """Write `model` as a Hugging Face Llama folder (see the module docstring); returns it."""
    if model.config != cfg:
        raise HFExportError("cfg does not describe this model")
    if dtype not in _DTYPE_NAMES:
        raise HFExportError(f"unsupported export dtype {dtype}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / WEIGHTS_NAME) as tmp:
        save_file(_export_tensors(model, dtype), str(tmp), metadata={"format": "pt"})
    eos = None
    if tokenizer is not None:
        write_text_atomic(out / TOKENIZER_NAME, tokenizer.to_str())
        eos = eos_token_id(tokenizer)
    write_json_atomic(out / CONFIG_NAME, hf_config(cfg, dtype, eos))
    return out


def load_hf(directory: str | os.PathLike[str]) -> tuple[CausalLM, ModelConfig]:
    """Load a Llama folder into an fp32 `CausalLM` on the CPU, with its `ModelConfig`."""
    folder = Path(directory)
    try:
        hf = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise HFExportError(f"cannot read {folder / CONFIG_NAME}: {e}") from e
    cfg = model_config_from_hf(hf)
    tensors = load_file(str(folder / WEIGHTS_NAME), device="cpu")
    for stale in [k for k in tensors if k.endswith("rotary_emb.inv_freq")]:  # old HF checkpoints
        del tensors[stale]
    if cfg.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = CausalLM(cfg)
    expected = {k for k in model.state_dict() if not (cfg.tie_embeddings and k == "lm_head.weight")}
    missing, unexpected = expected - tensors.keys(), tensors.keys() - expected
    if missing or unexpected:
        raise HFExportError(
            f"weights do not match the config: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    model.to_empty(device="cpu")
    model.tie_weights()
    with torch.no_grad():
        for name, param in model.named_parameters():
            src = tensors[name]
            if src.shape != param.shape:
                raise HFExportError(f"{name}: shape {tuple(src.shape)} != {tuple(param.shape)}")
            param.copy_(src.to(torch.float32))
    return model, cfg
