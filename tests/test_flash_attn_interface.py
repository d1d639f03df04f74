"""flashhopper.flash_attn_interface: FA3's names, arguments and returns, mapped onto flashhopper
(on the CPU through the reference backend)."""

from __future__ import annotations

import functools

import pytest
import torch

from flashhopper import flash_attn_interface as fa3
from flashhopper import interface
from flashhopper.reference import attention_ref, attention_varlen_ref

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _reference(monkeypatch):
    monkeypatch.setattr(fa3, "_attn", functools.partial(interface.flash_attn_func, backend="reference"))
    monkeypatch.setattr(fa3, "_attn_varlen", functools.partial(interface.flash_attn_varlen_func,
                                                               backend="reference"))


def test_dense_returns_and_arguments():
    q = torch.randn(2, 33, 4, 64, dtype=BF16)
    k, v = torch.randn(2, 41, 2, 64, dtype=BF16), torch.randn(2, 41, 2, 64, dtype=BF16)
    out = fa3.flash_attn_func(q, k, v, causal=True, window_size=(5, -1), softcap=3.0, num_splits=0,
                              pack_gqa=True, sm_margin=8)
    want, want_lse = attention_ref(q, k, v, causal=True, window_size=(5, -1), softcap=3.0)
    assert torch.equal(out, want.to(BF16))
    out, lse = fa3.flash_attn_func(q, k, v, softmax_scale=0.2, return_attn_probs=True)
    assert lse.shape == (2, 4, 33) and torch.equal(lse, attention_ref(q, k, v, 0.2)[1])


def test_varlen_returns_and_arguments():
    lens = [5, 17, 3]
    cu = torch.tensor([0, 5, 22, 25], dtype=torch.int32)
    q = torch.randn(25, 4, 64, dtype=BF16)
    k, v = torch.randn(25, 2, 64, dtype=BF16), torch.randn(25, 2, 64, dtype=BF16)
    out, lse = fa3.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                          return_attn_probs=True)
    want, want_lse = attention_varlen_ref(q, k, v, cu, cu, causal=True)
    assert torch.equal(out, want.to(BF16)) and torch.equal(lse, want_lse) and lse.shape == (4, 25)


@pytest.mark.parametrize("kwargs, exc, pattern", [
    (dict(qv=torch.zeros(1)), NotImplementedError, "qv"),
    (dict(attention_chunk=128), NotImplementedError, "attention_chunk=128"),
    (dict(num_splits=-1), ValueError, "num_splits must be an int >= 0"),
])
def test_what_flashhopper_does_not_have(kwargs, exc, pattern):
    q = torch.randn(1, 8, 2, 64, dtype=BF16)
    with pytest.raises(exc, match=pattern):
        fa3.flash_attn_func(q, q, q, **kwargs)
    with pytest.raises(NotImplementedError, match="rotary"):
        fa3.flash_attn_with_kvcache(q, q, q, cache_seqlens=1, rotary_cos=torch.zeros(8, 32, dtype=BF16))
    with pytest.raises(NotImplementedError, match="cu_seqlens_k_new with k, v"):
        fa3.flash_attn_with_kvcache(q, q, q, q, q, cache_seqlens=1,
                                    cu_seqlens_k_new=torch.zeros(2, dtype=torch.int32))


def test_kvcache_returns_fa3s_tuple():
    """o, lse, *rest = flash_attn_with_kvcache(..., return_softmax_lse=True) (FA3's consumers' form)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 4, 64, generator=g).to(BF16)
    kc, vc = (torch.randn(2, 16, 2, 64, generator=g).to(BF16) for _ in range(2))
    monkey = fa3._attn_kvcache
    try:
        fa3._attn_kvcache = functools.partial(monkey, backend="reference")
        o, lse, *rest = fa3.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=7, causal=True,
                                                    return_softmax_lse=True)
        want = attention_ref(q, kc[:, :7], vc[:, :7], 64 ** -0.5, True)
    finally:
        fa3._attn_kvcache = monkey
    assert rest == [] and lse.shape == (2, 4, 1)
    torch.testing.assert_close(o, want[0].to(BF16), rtol=0, atol=0)


def test_scheduler_metadata_and_combine():
    """get_scheduler_metadata: a tensor the calls accept (flashhopper plans each call itself);
    flash_attn_combine: splits merged by LSE equal attention over all keys."""
    meta = fa3.get_scheduler_metadata(3, 1, 4096, 32, 8, 128, torch.zeros(3, dtype=torch.int32))
    assert meta.dtype == torch.int32 and meta.shape == (4,)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 4, 32, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 50, 4, 32, generator=g, dtype=torch.float64) for _ in range(2))
    parts = [attention_ref(q, k[:, a:b], v[:, a:b], 0.2) for a, b in ((0, 20), (20, 21), (21, 50))]
    # and a split with no key
    empty = (torch.zeros_like(parts[0][0]), torch.full_like(parts[0][1], float("-inf")))
    outs = torch.stack([o for o, _ in parts] + [empty[0]]).float()
    lses = torch.stack([lse.transpose(1, 2) for _, lse in parts] + [empty[1].transpose(1, 2)]).float()
    out, lse = fa3.flash_attn_combine(outs, lses)
    want, want_lse = attention_ref(q, k, v, 0.2)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse.transpose(1, 2).double(), rtol=1e-5, atol=1e-5)
