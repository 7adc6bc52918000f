"""A LLaMA-style decoder-only transformer, built from `protocol.runconfig.ModelConfig`.

Architecture and numerics follow Hugging Face `LlamaForCausalLM` (no biases, RMSNorm computed in
fp32 and cast back before the weight multiply, RoPE with `rope_theta` applied to the two halves
of each head — `rotate_half` — SwiGLU MLP, grouped-query attention where query head h reads
key/value head h // (n_heads / n_kv_heads)), and parameter names are HF's, so export is a plain
name map (`node.model.hf_export`):

    model.embed_tokens.weight
    model.layers.{i}.input_layernorm.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    model.layers.{i}.post_attention_layernorm.weight
    model.layers.{i}.mlp.{gate,up,down}_proj.weight
    model.norm.weight
    lm_head.weight                (the same Parameter as embed_tokens when tied)

Attention is `F.scaled_dot_product_attention(..., is_causal=True)`, so a GPU picks its flash or
memory-efficient kernel. The model is plain fp32; on a GPU run it under
`torch.autocast("cuda", dtype=torch.bfloat16)` (RMSNorm, RoPE tables and the loss stay fp32).

Initialization (`build_model`) is deterministic and independent of device and parameter order:
each parameter draws from its own CPU generator seeded by BLAKE2b(seed, parameter name).
Matrices ~ N(0, 0.02²), the residual output projections (o_proj, down_proj)
~ N(0, (0.02/√(2L))²), norm weights = 1.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from protocol.runconfig import ModelConfig

__all__ = ["INIT_STD", "CausalLM", "build_model", "init_weights", "rotary_tables"]

INIT_STD = 0.02
IGNORE_INDEX = -100


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotary_tables(
    cfg: ModelConfig, seq_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 `(cos, sin)` of shape `(seq_len, head_dim)` for positions `0..seq_len-1`."""
    dim = cfg.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # elementwise: autocast never lowers it
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, hd
        self.q_proj = nn.Linear(d, cfg.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, cfg.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, cfg.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * hd, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        group = self.n_heads // self.n_kv_heads
        if group > 1:  # query head h reads key/value head h // group
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """Embeddings, decoder layers and the final norm (HF `LlamaModel`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # an empty weight: `init_weights` fills it (torch's own init of an embedding on the meta
        # device imports torch._dynamo, seconds of CPU in every process that builds a model)
        empty = torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=empty)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)


def _chunk_loss(hidden: torch.Tensor, head: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed fp32 cross-entropy of one chunk of positions."""
    return F.cross_entropy(F.linear(hidden, head).float(), targets, reduction="sum")


class CausalLM(nn.Module):
    """The decoder plus the language-model head (HF `LlamaForCausalLM`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make `lm_head.weight` the embedding matrix when the config ties them."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    checkpoint_layers = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them
    (activation checkpointing: the same maths, one more forward per layer, far less memory)."""

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        loss_chunk_tokens: int = 0,
    ) -> torch.Tensor:
        """Logits `(batch, seq, vocab)` for `input_ids` `(batch, seq)`, causal; with `targets`
        (the same shape) the mean fp32 cross-entropy instead, over `loss_chunk_tokens` positions
        at a time when positive: only one chunk's fp32 logits exist at once, in the backward pass
        too (each chunk is recomputed there), never the whole `(batch, seq, vocab)`."""
        if input_ids.ndim != 2:
            raise ValueError("input_ids must have shape (batch, seq)")
        seq = input_ids.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len {self.config.max_seq_len}")
        cos, sin = rotary_tables(self.config, seq, input_ids.device)
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            if self.checkpoint_layers and torch.is_grad_enabled():
                h = checkpoint(layer, h, cos, sin, use_reentrant=False)
            else:
                h = layer(h, cos, sin)
        h = self.model.norm(h)
        if targets is None:
            return self.lm_head(h)
        if loss_chunk_tokens <= 0:
            logits = self.lm_head(h).float()
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        flat, wanted = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
        total = sum(
            checkpoint(
                _chunk_loss, flat[i : i + loss_chunk_tokens], self.lm_head.weight,
                wanted[i : i + loss_chunk_tokens], use_reentrant=False,
            )
            for i in range(0, flat.shape[0], loss_chunk_tokens)
        )  # fmt: skip
        return total / flat.shape[0]

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (fp32); `labels[b, t]` is the target of position t (already
        shifted, no shifting inside), -100 to ignore a position."""
        logits = self(input_ids)
        return F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]),
            labels.reshape(-1),
            ignore_index=IGNORE_INDEX,
        )

    def window_loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Loss on sample windows `(batch, seq_len + 1)`: inputs `[:, :-1]`, targets `[:, 1:]`."""
        return self.loss(tokens[:, :-1], tokens[:, 1:])


def _param_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8, person=b"tessera-init")
    return int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_weights(model: CausalLM, seed: int) -> None:
    """(Re)initialize every parameter deterministically (see the module docstring)."""
    residual_std = INIT_STD / math.sqrt(2 * model.config.n_layers)
    for name, param in model.named_parameters():  # a tied head appears once, as embed_tokens
        if param.ndim == 1:
            param.fill_(1.0)
            continue
        std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else INIT_STD
        gen = torch.Generator(device="cpu").manual_seed(_param_seed(seed, name))
        values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
        param.copy_(values)


def build_model(cfg: ModelConfig, seed: int) -> CausalLM:
    """A freshly initialized fp32 model on the CPU; same (cfg, seed) → bit-identical weights."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.to_empty(device="cpu")
    model.tie_weights()
    init_weights(model, seed)
    return model
