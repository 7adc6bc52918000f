"""The LLaMA-style model: deterministic init, shapes, GQA, tied head, causality, learning."""

from __future__ import annotations

import pytest
import torch

from node.data.sampling import assigned_batches
from node.model.llama import CausalLM, build_model
from node.model.losses import bf16_by_default, row_losses
from protocol.runconfig import ModelConfig
from tests.support.embedded_data import TINY, tiny_dataset


def small_cfg(**overrides: object) -> ModelConfig:
    base: dict[str, object] = dict(
        vocab_size=257,
        hidden_size=64,
        intermediate_size=96,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=32,
        rope_theta=10000.0,
        tie_embeddings=False,
        norm_eps=1e-5,
    )
    return ModelConfig(**{**base, **overrides})


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_same_seed_gives_bit_identical_weights_and_other_seed_differs() -> None:
    cfg = small_cfg()
    assert same_weights(build_model(cfg, 7), build_model(cfg, 7))
    assert not same_weights(build_model(cfg, 7), build_model(cfg, 8))


def test_parameter_names_follow_hugging_face_llama() -> None:
    model = build_model(small_cfg(), 0)
    names = set(model.state_dict())
    for expected in (
        "model.embed_tokens.weight",
        "model.layers.1.input_layernorm.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.1.self_attn.v_proj.weight",
        "model.layers.1.self_attn.o_proj.weight",
        "model.layers.1.post_attention_layernorm.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ):
        assert expected in names
    assert model.state_dict()["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 16, 64)


@pytest.mark.parametrize("tie", [True, False])
def test_parameter_count_and_tying(tie: bool) -> None:
    cfg = small_cfg(tie_embeddings=tie)
    model = build_model(cfg, 0)
    assert sum(p.numel() for p in model.parameters()) == cfg.param_count()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie


def test_forward_shapes_and_loss_helpers() -> None:
    cfg = small_cfg()
    model = build_model(cfg, 0)
    tokens = torch.randint(0, cfg.vocab_size, (3, 17))
    logits = model(tokens[:, :-1])
    assert logits.shape == (3, 16, cfg.vocab_size) and logits.dtype == torch.float32
    loss = model.loss(tokens[:, :-1], tokens[:, 1:])
    assert torch.equal(loss, model.window_loss(tokens))
    assert abs(loss.item() - torch.log(torch.tensor(257.0)).item()) < 0.5  # near uniform at init
    with pytest.raises(ValueError):
        model(torch.zeros(1, cfg.max_seq_len + 1, dtype=torch.long))


def test_attention_is_causal() -> None:
    model = build_model(small_cfg(), 0)
    a = torch.randint(0, 257, (1, 20))
    b = a.clone()
    b[0, 12:] = (b[0, 12:] + 1) % 257
    with torch.no_grad():
        la, lb = model(a), model(b)
    assert torch.equal(la[:, :12], lb[:, :12])
    assert not torch.allclose(la[:, 12:], lb[:, 12:])


@pytest.mark.parametrize("n_kv_heads", [1, 2])
def test_grouped_query_attention_equals_mha_with_shared_kv_heads(n_kv_heads: int) -> None:
    """Query head h reads kv head h // group: an MHA copy with repeated k/v rows agrees."""
    gqa_cfg = small_cfg(n_kv_heads=n_kv_heads)
    gqa = build_model(gqa_cfg, 3)
    mha = CausalLM(small_cfg(n_kv_heads=4))
    group, head_dim = 4 // n_kv_heads, gqa_cfg.head_dim
    state = {}
    for name, tensor in gqa.state_dict().items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            heads = tensor.view(n_kv_heads, head_dim, -1)
            tensor = heads.repeat_interleave(group, dim=0).reshape(4 * head_dim, -1)
        state[name] = tensor
    mha.load_state_dict(state)
    tokens = torch.randint(0, 257, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(gqa(tokens), mha(tokens), rtol=1e-5, atol=1e-5)


def test_tiny_model_learns_real_text() -> None:
    """30 AdamW steps on the embedded corpus: the loss drops well below its starting value.

    A slimmer shape than the tiny preset (same 4096-token vocabulary) keeps this at ~2 s on 2
    CPU cores.
    """
    slim = {"hidden_size": 64, "intermediate_size": 192, "n_layers": 2, "max_seq_len": 64}
    cfg = ModelConfig.model_validate({**TINY.model.model_dump(), **slim})
    dataset = tiny_dataset(64)
    model = build_model(cfg, TINY.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    losses = []
    batches = (
        batch
        for window in range(3)
        for batch in assigned_batches(dataset, TINY.run_id, 0, window, 10, 8)
    )
    for batch in batches:
        loss = model.window_loss(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    assert len(losses) == 30
    start, end = sum(losses[:3]) / 3, sum(losses[-5:]) / 5
    assert start > 8.0  # ≈ ln(4096) = 8.32 at init
    assert end < start - 1.0, losses


def test_bf16_autocast_runs_and_stays_close_to_fp32() -> None:
    """The GPU recipe (bf16 autocast over fp32 weights), exercised on the CPU."""
    cfg = small_cfg()
    model = build_model(cfg, 2)
    tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    reference = model.window_loss(tokens)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(tokens[:, :-1]).dtype == torch.bfloat16
        loss = model.window_loss(tokens)
    assert loss.dtype == torch.float32
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    assert abs(loss.item() - reference.item()) < 0.05


def test_row_losses_run_bf16_only_where_asked_or_on_a_gpu() -> None:
    """The validator's probe: fp32 on the CPU by default, the training recipe on a GPU, and the
    bf16 readings close to the fp32 ones."""
    cfg = small_cfg()
    model = build_model(cfg, 2)
    tokens = torch.randint(0, cfg.vocab_size, (5, 33), generator=torch.Generator().manual_seed(3))
    cpu = torch.device("cpu")
    fp32 = row_losses(model, tokens, 2, cpu, bf16=False)
    assert fp32.shape == (5,) and fp32.dtype.name == "float64"
    assert (row_losses(model, tokens, 2, cpu) == fp32).all()
    bf16 = row_losses(model, tokens, 2, cpu, bf16=True)
    assert (bf16 != fp32).any()  # autocast really ran
    assert abs(bf16 - fp32).max() < 0.05
    assert bf16_by_default(torch.device("cuda")) and not bf16_by_default(cpu)
