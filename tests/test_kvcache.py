"""flash_attn_with_kvcache on the CPU: the reference backend's semantics (the append in place and
nothing else written, cache_batch_idx, cache_leftpad, packed queries) against attention_ref over each
item's keys spelled out by hand, and the argument checks."""

from __future__ import annotations

import pytest
import torch

from flashhopper import flash_attn_with_kvcache
from flashhopper.reference import attention_ref

B, S_CACHE, HQ, HK, D = 3, 40, 4, 2, 64


def _cache(seed=0, b_cache=B):
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache = (torch.randn(b_cache, S_CACHE, HK, D, generator=g).to(torch.bfloat16)
                        for _ in range(2))
    return g, k_cache, v_cache


def _expected(q, k_cache, v_cache, lens, idx, left, causal, window=(-1, -1), softcap=0.0):
    """Item by item: attention_ref of its queries over keys [left, lens) of its cache row."""
    outs, lses = [], []
    for i in range(q.shape[0]):
        keys = slice(left[i], lens[i])
        o, lse = attention_ref(q[i:i + 1], k_cache[idx[i]:idx[i] + 1, keys], v_cache[idx[i]:idx[i] + 1, keys],
                               D ** -0.5, causal, window, softcap)
        outs.append(o.to(q.dtype))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("causal", [False, True])
def test_append_then_attend(causal):
    g, k_cache, v_cache = _cache()
    before = (k_cache.clone(), v_cache.clone())
    q = torch.randn(B, 3, HQ, D, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(B, 3, HK, D, generator=g).to(torch.bfloat16) for _ in range(2))
    lens = torch.tensor([0, 17, 37], dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=causal,
                                       return_lse=True, backend="reference")
    for i, n in enumerate(lens.tolist()):  # the append, element by element; nothing else changed
        assert torch.equal(k_cache[i, n:n + 3], k[i]) and torch.equal(v_cache[i, n:n + 3], v[i])
        for new, old in zip((k_cache, v_cache), before, strict=True):
            assert torch.equal(new[i, :n], old[i, :n]) and torch.equal(new[i, n + 3:], old[i, n + 3:])
    want, want_lse = _expected(q, k_cache, v_cache, (lens + 3).tolist(), [0, 1, 2], [0, 0, 0], causal)
    assert out.shape == q.shape and lse.shape == (B, HQ, 3)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)


def test_batch_idx_leftpad_and_int_seqlens():
    g, k_cache, v_cache = _cache(1, b_cache=5)
    q = torch.randn(B, 2, HQ, D, generator=g).to(torch.bfloat16)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    left = torch.tensor([0, 5, 30], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=33, cache_batch_idx=idx,
                                  cache_leftpad=left, causal=True, window_size=(7, 0), backend="reference")
    want, _ = _expected(q, k_cache, v_cache, [33] * 3, idx.tolist(), left.tolist(), True, (7, 0))
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_packed_queries():
    g, k_cache, v_cache = _cache(2)
    q = torch.randn(6, HQ, D, generator=g).to(torch.bfloat16)  # items of 1, 0 and 5 queries
    cu = torch.tensor([0, 1, 1, 6], dtype=torch.int32)
    lens = torch.tensor([9, 40, 12], dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, cu_seqlens_q=cu,
                                       max_seqlen_q=5, causal=True, return_lse=True, backend="reference")
    assert out.shape == q.shape and lse.shape == (HQ, 6)
    for i, rows in enumerate((slice(0, 1), slice(1, 1), slice(1, 6))):
        if rows.stop == rows.start:
            continue
        keys = slice(0, int(lens[i]))
        o, l_ = attention_ref(q[None, rows], k_cache[i:i + 1, keys], v_cache[i:i + 1, keys], D ** -0.5, True)
        torch.testing.assert_close(out[rows], o[0].to(q.dtype), rtol=0, atol=0)
        torch.testing.assert_close(lse[:, rows], l_[0], rtol=0, atol=0)


def test_an_item_with_no_key_gives_zero_and_minus_inf():
    g, k_cache, v_cache = _cache(3)
    q = torch.randn(B, 1, HQ, D, generator=g).to(torch.bfloat16)
    lens = torch.tensor([0, 4, 0], dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, return_lse=True,
                                       backend="reference")
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all() and torch.isfinite(lse[1]).all()


def test_out_is_written_in_place():
    g, k_cache, v_cache = _cache(4)
    q = torch.randn(B, 2, HQ, D, generator=g).to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    got = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=10, out=out, backend="reference")
    assert got is out and not out.isnan().any()


def test_bad_arguments_are_refused_clearly():
    g, k_cache, v_cache = _cache(5)
    q = torch.randn(B, 1, HQ, D, generator=g).to(torch.bfloat16)
    k = torch.randn(B, 1, HK, D, generator=g).to(torch.bfloat16)
    pages = torch.zeros(B, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="cache_batch_idx with page_table"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=1, page_table=pages, backend="reference",
                                cache_batch_idx=torch.arange(B, dtype=torch.int32))
    with pytest.raises(ValueError, match="pass both"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k=k, cache_seqlens=1, backend="reference")
    with pytest.raises(ValueError, match="cache_seqlens is required"):
        flash_attn_with_kvcache(q, k_cache, v_cache, backend="reference")
    with pytest.raises(ValueError, match="cache_batch_idx must be an int32"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=1, cache_batch_idx=torch.arange(B),
                                backend="reference")
    with pytest.raises(ValueError, match="stride"):
        flash_attn_with_kvcache(q, k_cache[:, :20], v_cache[:, :20], cache_seqlens=1, backend="reference")
    with pytest.raises(ValueError, match="heads"):
        flash_attn_with_kvcache(q[:, :, :3], k_cache, v_cache, cache_seqlens=1, backend="reference")
    with pytest.raises(ValueError, match="outside the cache"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=S_CACHE + 1, backend="reference")
    with pytest.raises(RuntimeError, match="Hopper GPU"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=1)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_paged_equals_contiguous(page_size):
    """The same tokens in shuffled pages (page_table) give the contiguous cache's results, and the
    append lands in the right slots of the right pages, crossing page boundaries."""
    g, k_cache, v_cache = _cache(6)
    q = torch.randn(B, 4, HQ, D, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(B, 4, HK, D, generator=g).to(torch.bfloat16) for _ in range(2))
    lens = torch.tensor([0, page_size * 2 - 1, 30], dtype=torch.int32)
    left = torch.tensor([0, 1, 5], dtype=torch.int32)
    pages_per_item = -(-S_CACHE // page_size)
    order = torch.randperm(B * pages_per_item, generator=g)  # physical page of each (item, logical page)
    table = order.view(B, pages_per_item).to(torch.int32)
    k_paged, v_paged = (torch.zeros(B * pages_per_item, page_size, HK, D, dtype=torch.bfloat16)
                        for _ in range(2))
    for i in range(B):
        for p in range(pages_per_item):
            n = min(page_size, S_CACHE - p * page_size)
            k_paged[table[i, p], :n] = k_cache[i, p * page_size:p * page_size + n]
            v_paged[table[i, p], :n] = v_cache[i, p * page_size:p * page_size + n]
    kw = dict(cache_seqlens=lens, cache_leftpad=left, causal=True, return_lse=True, backend="reference")
    want, want_lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kw)
    got, got_lse = flash_attn_with_kvcache(q, k_paged, v_paged, k, v, page_table=table, **kw)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=0)
    for i in range(B):  # every appended token where the page table puts it
        for j in range(4):
            pos = int(lens[i]) + j
            slot = (table[i, pos // page_size], pos % page_size)
            assert torch.equal(k_paged[slot], k[i, j]) and torch.equal(v_paged[slot], v[i, j])
    # the kernels' path: the table's span gathered into a contiguous cache, item after item
    from flashhopper.kvcache import _gather_pages

    table[0, -1] = -7  # an entry past the pages in use may be anything
    k_rows, v_rows, positions = _gather_pages(k_paged.view(-1, HK, D), v_paged.view(-1, HK, D), table,
                                              page_size)
    assert positions == pages_per_item * page_size >= S_CACHE
    for i in range(B):
        span = slice(i * positions, i * positions + S_CACHE - page_size)  # the item's positions, in order
        assert torch.equal(k_rows[span], k_cache[i, :S_CACHE - page_size])
        assert torch.equal(v_rows[span], v_cache[i, :S_CACHE - page_size])
