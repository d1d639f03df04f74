"""flash_attn_func's inference calls that are a decode (kvcache.dense_decode) on the CPU: routed to the split
kernel (its float64 model, tests/kvcache_kernels.py) and merged by the merge kernel's stand-in, against the
reference; the calls that are not a decode left to the dense kernel (a stand-in that records them)."""

from __future__ import annotations

import pytest
import torch
from kvcache_kernels import cpu_kernel_path, merge_stand_in, split_kernels

import flashhopper.hopper
from flashhopper import flash_attn_func
from flashhopper.reference import attention_ref


@pytest.fixture()
def paths(monkeypatch):
    """(split kernel launches, dense kernel calls) of the calls made in the test."""
    cpu_kernel_path(monkeypatch)
    launched = split_kernels(monkeypatch)
    monkeypatch.setattr(flashhopper.hopper, "combine_splits", merge_stand_in)
    dense = []

    def forward(q, k, v, scale, causal, window, softcap, **kwargs):
        dense.append(q.shape)
        out, lse = attention_ref(q, k, v, scale, causal, window, softcap)
        return out.to(q.dtype), lse

    monkeypatch.setattr(flashhopper.hopper, "forward", forward)
    return launched, dense


def _inputs(b, s, hq, hk, sk, d=64, heads_major=False, seed=0):
    """q (b, s, hq, d); k, v (b, sk, hk, d): contiguous, or with heads_major the (b, hk, sk, d) memory of a
    transformers cache seen as (b, sk, hk, d)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16)  # noqa: E731
    q = rand(b, s, hq, d)
    if heads_major:
        k, v = (rand(b, hk, sk, d).transpose(1, 2) for _ in range(2))
    else:
        k, v = rand(b, sk, hk, d), rand(b, sk, hk, d)
    return q, k, v


@pytest.mark.parametrize("heads_major", [False, True])
@pytest.mark.parametrize("b,s,hq,hk,sk,causal", [
    (1, 1, 8, 2, 700, True),  # PackGQA and the split
    (3, 1, 8, 8, 700, False),  # the split alone (24 CTAs on 132 SMs)
    (2, 1, 8, 1, 1, True),  # one key
    (2, 3, 8, 2, 700, True),  # several tokens, causal in the kernel
    (2, 4, 8, 2, 2, True),  # fewer keys than tokens: the first tokens see none (0, -inf)
    (1, 16, 4, 1, 257, False),  # sixteen tokens, every key seen
])
def test_decode_by_the_split_kernel(paths, heads_major, b, s, hq, hk, sk, causal):
    launched, dense = paths
    q, k, v = _inputs(b, s, hq, hk, sk, heads_major=heads_major)
    out, lse = flash_attn_func(q, k, v, causal=causal, softcap=0.0 if s > 1 else 2.5, return_lse=True)
    want, want_lse = attention_ref(q, k, v, q.shape[-1] ** -0.5, causal, (-1, -1), 0.0 if s > 1 else 2.5)
    assert len(launched) == 1 and not dense
    assert launched[0][0].token_rows == (s > 1 and causal)
    assert out.shape == (b, s, hq, 64) and lse.shape == (b, hq, s)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, want_lse.float(), rtol=1e-5, atol=1e-5)


def test_one_item_of_any_batch_stride(paths):
    """One item whose k / v have a batch stride of 0 (torch may give a size-1 dim any stride): never stepped
    over, taken."""
    launched, dense = paths
    q, k, v = _inputs(1, 1, 8, 2, 700)
    k, v = (t.as_strided(t.shape, (0, *t.stride()[1:])) for t in (k, v))
    assert k.stride(0) == 0
    out = flash_attn_func(q, k, v, causal=True)
    want, _ = attention_ref(q, k, v, 64 ** -0.5, True, (-1, -1), 0.0)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert len(launched) == 1 and not dense


@pytest.mark.parametrize("case", ["window", "17 tokens", "tokens without GQA", "grid full", "items overlap"])
def test_not_a_decode_left_to_the_dense_kernel(paths, case):
    launched, dense = paths
    kw = {}
    b, s, hq, hk = {"17 tokens": (1, 17, 8, 2), "tokens without GQA": (1, 4, 8, 8),
                    "grid full": (32, 1, 8, 8)}.get(case, (1, 1, 8, 2))
    q, k, v = _inputs(b, s, hq, hk, 300)
    if case == "window":
        kw["window_size"] = (100, 0)
    if case == "items overlap":  # one cache for two items (stride 0): not rows a whole item apart
        q, k, v = _inputs(2, 1, 8, 2, 300)
        k, v = k[:1].expand(2, -1, -1, -1), v[:1].expand(2, -1, -1, -1)
    flash_attn_func(q, k, v, causal=True, **kw)
    assert not launched and len(dense) == 1


@pytest.mark.parametrize("s", [1, 3])
def test_transformers_left_padded_decode(paths, s):
    """The transformers integration's decode step over a left-padded batch: the split kernel with the
    padding as cache_leftpad (no packing of the cache), each row against its own keys."""
    from types import SimpleNamespace

    from flashhopper.integrations.transformers import attention_forward

    launched, dense = paths
    b, hq, hk, sk, d = 3, 8, 2, 300, 64
    g = torch.Generator().manual_seed(3)
    query = torch.randn(b, hq, s, d, generator=g).to(torch.bfloat16)
    key, value = (torch.randn(b, hk, sk, d, generator=g).to(torch.bfloat16) for _ in range(2))
    valid = [300, 250, 17]
    mask = torch.stack([torch.arange(sk) >= sk - n for n in valid]).long()
    out, _ = attention_forward(SimpleNamespace(is_causal=True), query, key, value, mask)
    assert len(launched) == 1 and not dense
    for i, n in enumerate(valid):
        want, _ = attention_ref(query[i:i + 1].transpose(1, 2), key[i:i + 1, :, sk - n:].transpose(1, 2),
                                value[i:i + 1, :, sk - n:].transpose(1, 2), d ** -0.5, True, (-1, -1), 0.0)
        torch.testing.assert_close(out[i:i + 1].float(), want.float(), rtol=2e-2, atol=2e-2)


def test_transformers_mask_analysed_once_a_step():
    """transformers passes one mask object to every layer: its analysis (a host sync) runs on the first
    layer's call and is reused while the mask is the same object, unchanged, for the same query count."""
    from flashhopper.integrations.transformers import _mask_info

    left = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    info = _mask_info(left, 1)
    assert (info.no_padding, info.left_padded, info.leftpad.tolist()) == (False, True, [2, 0])
    assert _mask_info(left, 1) is info  # the next layers
    assert _mask_info(left, 3) is not info and not _mask_info(left, 3).left_padded  # a padded query
    left[1, 0] = 0  # changed in place: analysed again
    assert _mask_info(left, 1).leftpad.tolist() == [2, 1]
    right = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert not _mask_info(right, 1).left_padded and not _mask_info(right, 1).no_padding
    full = torch.ones(2, 4, dtype=torch.long)
    assert _mask_info(full, 2).no_padding and _mask_info(full, 2).left_padded


def test_transformers_packing_made_once_a_step(monkeypatch):
    """The padding path's packing (cu_seqlens, the valid rows, the longest lengths: host syncs) is made by
    the step's first layer and reused by the next ones, which get the same tensors and lengths."""
    from types import SimpleNamespace

    import flashhopper
    from flashhopper.integrations import transformers as T

    calls = []

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        calls.append((cu_q, cu_k, max_q, max_k))
        return torch.zeros(q.shape[0], q.shape[1], v.shape[-1])

    monkeypatch.setattr(flashhopper, "flash_attn_varlen_func", varlen)
    g = torch.Generator().manual_seed(5)
    query = torch.randn(2, 4, 3, 64, generator=g)
    key, value = (torch.randn(2, 2, 5, 64, generator=g) for _ in range(2))
    mask = torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]])  # right padding: not the decode route
    for _ in range(3):  # three layers
        T.attention_forward(SimpleNamespace(is_causal=True), query, key, value, mask, backend="reference")
    assert len(calls) == 3 and all(c[0] is calls[0][0] and c[1] is calls[0][1] for c in calls)
    assert calls[0][2:] == (3, 4) and calls[0][0].tolist() == [0, 2, 5] and calls[0][1].tolist() == [0, 4, 8]
