"""flashhopper as a transformers attention implementation, on the CPU through the reference backend:
a small random Llama in bf16 gives SDPA's logits, with and without a padding mask, SDPA's weight
gradients through a padding mask, and generates SDPA's tokens with a KV cache (one query row per
step)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashhopper.integrations.transformers import register  # noqa: E402


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                      head_dim=64, max_position_embeddings=256)
    ours = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    sdpa = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    sdpa.load_state_dict(ours.state_dict())
    ours.set_attn_implementation(register("hopper_attn_ref", backend="reference"))
    sdpa.set_attn_implementation("sdpa")
    return ours, sdpa


def _close(a, b):
    # both round the attention output to bf16 once per layer: compare at bf16's resolution
    torch.testing.assert_close(a.float(), b.float(), atol=0.05, rtol=0.05)


def test_logits_match_sdpa(models):
    ours, sdpa = models
    ids = torch.randint(0, 97, (2, 37))
    with torch.no_grad():
        _close(ours(ids).logits, sdpa(ids).logits)


def test_left_padding_mask(models):
    ours, sdpa = models
    ids = torch.randint(0, 97, (2, 21))
    mask = torch.ones(2, 21, dtype=torch.long)
    mask[0, :6] = 0  # the first sequence is 6 tokens shorter, padded on the left
    with torch.no_grad():
        a, b = ours(ids, attention_mask=mask).logits, sdpa(ids, attention_mask=mask).logits
    _close(a[0, 6:], b[0, 6:])
    _close(a[1], b[1])


def test_generation_with_a_kv_cache(models):
    ours, sdpa = models
    ids = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        a = ours.generate(ids, max_new_tokens=6, do_sample=False)
        b = sdpa.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(a, b)


def test_names_with_flash_are_refused():
    with pytest.raises(ValueError, match="containing 'flash'"):
        register("flashhopper")


def test_training_through_a_padding_mask(models):
    """The padded path (flash_attn_varlen_func over the valid tokens) is differentiable: a loss over
    the valid tokens gives SDPA's weight gradients."""
    ours, sdpa = models
    ids = torch.randint(0, 97, (2, 19))
    mask = torch.ones(2, 19, dtype=torch.long)
    mask[1, :5] = 0
    grads = []
    for model in (ours, sdpa):
        model.zero_grad()
        logits = model(ids, attention_mask=mask).logits.float()
        (logits[0].square().mean() + logits[1, 5:].square().mean()).backward()
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad.float())
    scale = grads[1].abs().max().item()
    torch.testing.assert_close(grads[0], grads[1], atol=0.05 * scale, rtol=0.05)
    for model in (ours, sdpa):
        model.zero_grad()
