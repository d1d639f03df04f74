"""flashhopper as a transformers attention implementation, on the CPU through the reference backend:
small random models in bf16 (a Llama with GQA, a Mistral with a sliding window) give SDPA's and eager
attention's logits, with and without a padding mask, SDPA's weight gradients through a padding mask,
SDPA's tokens generated with a KV cache (one query row per step), and on packed batches (a flattening
collator's position_ids alone, or its cu_seq_lens too) each sequence's logits and gradients as if run
alone. Each model has its own config: set_attn_implementation writes the config, so two models sharing
one would both run the last implementation set (and compare SDPA with itself)."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashhopper.integrations import transformers as fh_transformers  # noqa: E402
from flashhopper.integrations.transformers import register  # noqa: E402

LLAMA = dict(vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=256)


def _pair(config_cls, reference, **fields):
    """(ours, the same weights under `reference`): each with its own config."""
    torch.manual_seed(0)
    config = config_cls(**LLAMA, **fields)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config)).to(torch.bfloat16).eval()
    with torch.no_grad():  # scores of order 1 (the default init leaves attention nearly uniform, where
        for layer in ours.model.layers:  # a wrong softmax scale would change the logits by 0.02)
            layer.self_attn.q_proj.weight.mul_(5.0)
            layer.self_attn.k_proj.weight.mul_(5.0)
    other = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config)).to(torch.bfloat16).eval()
    other.load_state_dict(ours.state_dict())
    ours.set_attn_implementation(register("hopper_attn_ref", backend="reference"))
    other.set_attn_implementation(reference)
    assert ours.config._attn_implementation == "hopper_attn_ref"
    assert other.config._attn_implementation == reference
    return ours, other


@pytest.fixture(scope="module")
def models():
    return _pair(transformers.LlamaConfig, "sdpa")


@pytest.fixture
def our_calls(monkeypatch):
    """How many times our attention function ran (a comparison it took no part in proves nothing)."""
    calls = []
    real = fh_transformers.attention_forward

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(fh_transformers, "attention_forward", counted)
    return calls


def _close(a, b):
    # both round the attention output to bf16 once per layer: compare at bf16's resolution (the logits
    # differ by about 0.01; a softmax scale 10% off moves them by 0.08, twice as large by 0.5)
    torch.testing.assert_close(a.float(), b.float(), atol=0.03, rtol=0.03)


def test_logits_match_sdpa(models, our_calls):
    ours, sdpa = models
    ids = torch.randint(0, 97, (2, 37))
    with torch.no_grad():
        _close(ours(ids).logits, sdpa(ids).logits)
    assert len(our_calls) == 2  # one a layer


@pytest.mark.parametrize("reference", ["sdpa", "eager"])
def test_sliding_window_model(reference, our_calls):
    """A Mistral with a window of 6 over 29 tokens: every layer's call passes the window, and the logits
    are the reference implementation's (which masks by the window too)."""
    ours, other = _pair(transformers.MistralConfig, reference, sliding_window=6)
    ids = torch.randint(0, 97, (2, 29))
    with torch.no_grad():
        a, b = ours(ids).logits, other(ids).logits
    assert our_calls and all(kw.get("sliding_window") == 6 for kw in our_calls)
    _close(a, b)
    # the window matters here: the same model without it differs
    ours.config.sliding_window = None
    with torch.no_grad():
        wide = ours(ids).logits
    assert (wide.float() - b.float()).abs().max() > 0.1


@pytest.mark.parametrize("how", ["position_ids", "cu_seq_lens"])
def test_packed_sequences(models, our_calls, how):
    """Sequences packed into one row by transformers' DataCollatorWithFlattening (padding-free training):
    by default only position_ids mark where each starts; with return_flash_attn_kwargs also cu_seq_lens.
    Each sequence's logits and weight gradients are those of running it alone."""
    ours, sdpa = models
    g = torch.Generator().manual_seed(4)
    docs = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (7, 1, 12, 5)]
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=how == "cu_seq_lens")
    batch = collator([{"input_ids": d} for d in docs])
    kwargs = {k: v for k, v in batch.items() if k not in ("labels",)}
    if how == "position_ids":
        assert set(kwargs) == {"input_ids", "position_ids"}
    grads = []
    for model, runs in ((ours, [kwargs]), (sdpa, [{"input_ids": torch.tensor([d])} for d in docs])):
        model.zero_grad()
        logits = torch.cat([model(**run).logits for run in runs], dim=1).float()
        logits.square().mean().backward()
        grads.append((logits.detach(), model.model.layers[0].self_attn.q_proj.weight.grad.float()))
    assert our_calls
    _close(grads[0][0], grads[1][0])
    scale = grads[1][1].abs().max().item()
    torch.testing.assert_close(grads[0][1], grads[1][1], atol=0.05 * scale, rtol=0.05)
    for model in (ours, sdpa):
        model.zero_grad()


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


def test_position_packing_rule():
    """Where position_ids split a packed row, as transformers' FlashAttention path splits it: at each
    position equal to the row's least (0 from the collator), the row's start too; nothing for a batch, a
    decode step, keys other than the queries (a cache), one run of positions, or several rows of
    positions; a length other than the queries' is refused. The analysis is reused by the next layers'
    calls with the same tensor, and made again after it changes in place."""
    from flashhopper.integrations.transformers import _position_packing

    def qk(s, b=1, sk=None):
        return torch.empty(b, s, 2, 8), torch.empty(b, sk or s, 1, 8)

    pos = torch.tensor([[3, 4, 0, 1, 2, 0, 0, 1]])
    cu, longest = _position_packing(pos, *qk(8))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 5, 6, 8] and longest == 3
    assert _position_packing(pos, *qk(8))[0] is cu  # the next layer
    pos[0, 3] = 0  # changed in place: analysed again
    assert _position_packing(pos, *qk(8))[0].tolist() == [0, 2, 3, 5, 6, 8]
    assert _position_packing(torch.tensor([[0, 1, 2, 0, 1]]), *qk(5))[0].tolist() == [0, 3, 5]
    assert _position_packing(torch.arange(5, 13)[None], *qk(8)) is None  # one run
    assert _position_packing(None, *qk(8)) is None
    assert _position_packing(pos, *qk(8, b=2)) is None
    assert _position_packing(torch.tensor([[0]]), *qk(1)) is None
    assert _position_packing(pos, *qk(8, sk=20)) is None
    assert _position_packing(pos.expand(3, 1, 8), *qk(8)) is None  # multimodal rotary's rows
    with pytest.raises(ValueError, match="position_ids"):
        _position_packing(torch.tensor([[0, 1, 0]]), *qk(8))
