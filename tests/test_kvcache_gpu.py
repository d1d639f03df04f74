"""flash_attn_with_kvcache on the GPU: each item by the rule of flashhopper/accuracy.py against the
float64 reference over its keys; unused cache slots hold NaN (they must stay out); the append checked
element by element with the rest of the cache unchanged (accuracy.check_kvcache, as the fuzz's decode
cases); a CUDA graph replayed with new lengths."""

from __future__ import annotations

import math

import pytest
import torch

from flashhopper import flash_attn_with_kvcache
from flashhopper.accuracy import check_forward, check_kvcache

pytestmark = pytest.mark.gpu

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)

DEV = "cuda"




def _case(b, sq, s_new, lens, hq=8, hk=2, d=128, s_cache=700, b_cache=None, idx=None, left=None,
          causal=True, window=(-1, -1), softcap=0.0, dtype=torch.bfloat16, seed=0, **hints):
    torch.manual_seed(seed)
    b_cache = b_cache or b
    k_cache, v_cache = (torch.randn(b_cache, s_cache, hk, d, device=DEV, dtype=dtype) for _ in range(2))
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    idx_l = idx or list(range(b))
    left_l = left or [0] * b
    for i, (row, n) in enumerate(zip(idx_l, lens, strict=True)):  # slots past the new end: NaN
        k_cache[row, n + s_new:] = float("nan")
        v_cache[row, n + s_new:] = float("nan")
        k_cache[row, :left_l[i]] = float("nan")
        v_cache[row, :left_l[i]] = float("nan")
    q = torch.randn(b, sq, hq, d, device=DEV, dtype=dtype)
    k = v = None
    if s_new:
        k, v = (torch.randn(b, s_new, hk, d, device=DEV, dtype=dtype) for _ in range(2))
    before = (k_cache.clone(), v_cache.clone())
    kw = dict(cache_seqlens=lens_t, causal=causal, window_size=window, softcap=softcap, return_lse=True,
              **hints)
    if idx is not None:
        kw["cache_batch_idx"] = torch.tensor(idx, dtype=torch.int32, device=DEV)
    if left is not None:
        kw["cache_leftpad"] = torch.tensor(left, dtype=torch.int32, device=DEV)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kw)
    torch.cuda.synchronize()
    check_kvcache(out, lse, q, k_cache, v_cache, lens, scale=1 / math.sqrt(d), causal=causal, window=window,
                  softcap=softcap, k_new=k, v_new=v, before=before, cache_batch_idx=idx, cache_leftpad=left)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("sq,s_new", [(1, 1), (1, 0), (4, 4), (16, 3)])
def test_decode_and_speculative(d, sq, s_new):
    _case(4, sq, s_new, [0, 1, 127, 600], d=d)


@pytest.mark.parametrize("hints", [{}, {"num_splits": 1}, {"pack_gqa": False}, {"num_splits": 7},
                                   {"num_splits": 1, "pack_gqa": False}])
@pytest.mark.parametrize("hq,hk", [(8, 2), (4, 4)])
def test_decode_split_kv_and_pack_gqa(hq, hk, hints):
    """One query token over a long cache (flashhopper/splitkv.py): chunks past an item's length, an
    empty item, an item shorter than one chunk, leftpad; every way of arranging it by the rule."""
    _case(3, 1, 1, [4000, 0, 129], hq=hq, hk=hk, s_cache=4097, left=[5, 0, 0], **hints)
    _case(2, 1, 0, [3000, 17], hq=hq, hk=hk, s_cache=3001, softcap=8.0, causal=False, **hints)


def test_page_boundaries_and_prefill_chunks():
    _case(3, 300, 300, [63, 64, 65], s_cache=1000, causal=True)
    _case(2, 129, 0, [129, 700], causal=False, softcap=10.0)


def test_batch_idx_permutation_and_leftpad():
    _case(3, 2, 2, [50, 10, 300], b_cache=5, idx=[4, 0, 2], left=[3, 0, 299], window=(40, 0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gqa_and_dtypes(dtype):
    _case(2, 5, 1, [33, 400], hq=32, hk=8, dtype=dtype)


def test_graph_replay_with_new_lengths():
    """Captured once, replayed with other cache_seqlens: no host sync, no recompile."""
    torch.manual_seed(1)
    b, hq, hk, d, s_cache = 2, 4, 1, 128, 512
    k_cache, v_cache = (torch.randn(b, s_cache, hk, d, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(b, 1, hq, d, device=DEV, dtype=torch.bfloat16)
    lens = torch.tensor([10, 20], dtype=torch.int32, device=DEV)
    flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True)  # compile / load first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True,
                                           return_lse=True)
    for new in ([100, 3], [511, 512], [0, 77]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        for i in range(b):
            if new[i]:
                keys = slice(0, new[i])
                check_forward(out[i:i + 1], lse[i:i + 1], q[i:i + 1], k_cache[i:i + 1, keys],
                              v_cache[i:i + 1, keys], d ** -0.5, True, (-1, -1), 0.0)
            else:
                assert (out[i] == 0).all() and torch.isneginf(lse[i]).all()


@pytest.mark.parametrize("page_size,sq", [(1, 1), (16, 1), (16, 5), (128, 1), (3, 7)])
def test_paged_cache(page_size, sq):
    """A paged cache (SGLang: page 1; vLLM: page 16), pages shuffled, unused table entries garbage,
    the append across pages; each item by the rule against its keys in order."""
    torch.manual_seed(page_size)
    b, hq, hk, d, s_cache = 3, 8, 2, 128, 1000
    lens = [999 - sq, 0, 130]
    pages_per_item = -(-s_cache // page_size)
    table = torch.randperm(b * pages_per_item + 5, device=DEV)[: b * pages_per_item].view(b, -1).int()
    shape = (b * pages_per_item + 5, page_size, hk, d)
    k_paged, v_paged = (torch.randn(shape, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    for t in (k_paged, v_paged):  # slots no item uses: NaN, which must stay out
        used = torch.zeros(t.shape[0], page_size, dtype=torch.bool, device=DEV)
        for i, n in enumerate(lens):
            pos = torch.arange(n + sq, device=DEV)
            used[table[i, pos // page_size].long(), pos % page_size] = True
        t[~used] = float("nan")
    table[1, 3:] = -1  # item 1 uses three pages at most: the rest of its row is garbage
    q = torch.randn(b, sq, hq, d, device=DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(b, sq, hk, d, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    before = (k_paged.clone(), v_paged.clone())
    out, lse = flash_attn_with_kvcache(q, k_paged, v_paged, k, v, cache_seqlens=lens_t, page_table=table,
                                       causal=True, return_lse=True)
    torch.cuda.synchronize()
    check_kvcache(out, lse, q, k_paged, v_paged, lens, scale=d ** -0.5, causal=True, window=(-1, -1),
                  softcap=0.0, k_new=k, v_new=v, before=before, page_table=table)
