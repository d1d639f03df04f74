"""Decode of 2 to 16 query tokens an item packed into the split kernel's rows, causal in the kernel
(kvcache._qlen_call, FwdConfig.token_rows; the default: validation.decode_qlen_enabled) on the GPU:
flash_attn_with_kvcache,
each item by the rule of flashhopper/accuracy.py against the float64 reference over its keys, causal
aligned bottom-right (and without a mask). Tokens 2, 4, 16; GQA 1, 4, 8; lengths shorter than the tokens
(0, 1: rows that see no key), at the chunk boundaries +-1 and the capacity; appends (checked in the cache
element by element); cache_batch_idx and cache_leftpad; paged caches read by the kernels and gathered;
softcap, fp16, other head dims, a given output, the LSE returned or not; CUDA graph replay on new lengths.
Every cache slot no item uses is NaN (it must stay out), every output, partial and buffer NaN before the
call (runtime.poison), every launch checked: the split kernel, its merge kernel.

The kernels: `flashhopper precompile --decode --paged` (the split kernels, unmasked and causal, paged, and
the merge kernels), or compiled on first use."""

from __future__ import annotations

import math

import pytest
import torch
from launched import record_split_launches

from flashhopper import flash_attn_with_kvcache, splitkv, validation
from flashhopper.accuracy import check_forward, check_kvcache
from flashhopper.config import CombineConfig

pytestmark = pytest.mark.gpu

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)

DEV = "cuda"
S_CACHE = 4097


@pytest.fixture(autouse=True)
def launched(monkeypatch):
    """Every kernel launched: (config, the splits asked of forward_split)."""
    return record_split_launches(monkeypatch)


def _check_launches(launched, *, causal, page_size=0):
    """The call launched the split kernel once (paged: the paged one; causal: over the packed tokens), its
    merge where it split; nothing else of ours. Returns the split count."""
    kernels, splits = launched
    assert len(splits) == 1, splits
    split = [cfg for cfg in kernels if not isinstance(cfg, CombineConfig) and cfg.split_kv]
    others = [cfg for cfg in kernels if not isinstance(cfg, CombineConfig) and not cfg.split_kv]
    merges = [cfg for cfg in kernels if isinstance(cfg, CombineConfig)]
    assert len(split) == 1 and split[0].page_size == page_size, split
    assert split[0].causal == split[0].token_rows == causal, split
    assert not others, others
    assert len(merges) == (splits[0] > 1), merges
    n = splits[0]
    kernels.clear()
    splits.clear()
    return n


def _case(launched, lens, *, s, s_new=0, hq=32, hk=8, d=128, s_cache=S_CACHE, page_size=0, idx=None,
          b_cache=None, left=None, causal=True, softcap=0.0, dtype=torch.bfloat16, given_out=None,
          return_lse=True, seed=0, kernels_read_pages=True, **hints):
    """One call of s query tokens an item; each item by the rule against its keys in position order, the
    append checked, the rest of the cache unchanged. lens: cache_seqlens before the append; page_size: a
    paged cache of ceil(s_cache / page_size) pages an item, shuffled. Returns the split count the call
    ran."""
    torch.manual_seed(seed)
    b = len(lens)
    idx_l = idx or list(range(b))
    left_l = left or [0] * b
    if page_size:
        per_item = -(-s_cache // page_size)
        num_pages = b * per_item + 3
        table = torch.randperm(num_pages, device=DEV)[: b * per_item].view(b, per_item).int()
        shape = (num_pages, page_size, hk, d)
        k_cache, v_cache = (torch.randn(shape, device=DEV, dtype=dtype) for _ in range(2))
        slot = lambda i, p: (table[i, p // page_size].long(), p % page_size)  # noqa: E731
    else:
        shape = (b_cache or b, s_cache, hk, d)
        k_cache, v_cache = (torch.randn(shape, device=DEV, dtype=dtype) for _ in range(2))
        slot = lambda i, p: (idx_l[i], p)  # noqa: E731
    used = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=DEV)
    for i, n in enumerate(lens):  # slots no item uses (past its new end, before its leftpad): NaN
        pos = torch.arange(left_l[i], n + s_new, device=DEV)
        used[slot(i, pos)] = True
    for c in (k_cache, v_cache):
        c[~used] = float("nan")
    q = torch.randn(b, s, hq, d, device=DEV, dtype=dtype)
    k = v = None
    if s_new:
        k, v = (torch.randn(b, s_new, hk, d, device=DEV, dtype=dtype) for _ in range(2))
    kw = dict(cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=DEV), causal=causal, softcap=softcap,
              return_lse=return_lse, **hints)
    if page_size:
        kw["page_table"] = table
    if idx is not None:
        kw["cache_batch_idx"] = torch.tensor(idx, dtype=torch.int32, device=DEV)
    if left is not None:
        kw["cache_leftpad"] = torch.tensor(left, dtype=torch.int32, device=DEV)
    if given_out is not None:
        kw["out"] = given_out
    before = (k_cache.clone(), v_cache.clone())
    got = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kw)
    out, lse = got if return_lse else (got, None)
    torch.cuda.synchronize()
    if given_out is not None:
        assert out is given_out
    splits = _check_launches(launched, causal=causal,
                             page_size=page_size if page_size and kernels_read_pages else 0)
    check_kvcache(out, lse, q, k_cache, v_cache, lens, scale=1 / math.sqrt(d), causal=causal, window=(-1, -1),
                  softcap=softcap, k_new=k, v_new=v, before=before, cache_batch_idx=idx, cache_leftpad=left,
                  page_table=kw.get("page_table"))
    return splits


@pytest.mark.parametrize("s", [2, 4, 16])
@pytest.mark.parametrize("hq,hk", [(8, 8), (32, 8), (64, 8)])  # GQA 1, 4, 8
@pytest.mark.parametrize("s_new", [0, "s"])
def test_tokens_and_groups(launched, s, hq, hk, s_new):
    """Lengths shorter than the tokens (rows that see no key; 0 + s: every key new), one past, a long one,
    the capacity; with and without an append of s tokens."""
    s_new = s if s_new == "s" else 0
    _case(launched, [0, 1, s + 1 - s_new, 3000, S_CACHE - s_new], s=s, s_new=s_new, hq=hq, hk=hk)


@pytest.mark.parametrize("s", [2, 4, 16])
@pytest.mark.parametrize("num_splits", [0, 1, 2, 7, 64])  # 0: chosen; 64: capped at the cache's chunks
def test_chunk_boundaries(launched, s, num_splits):
    """The keys token 0 sees (L - s + 1) ending one before, on and one past a chunk's end (unsplit: a key
    block's at 2048): the tokens' diagonal across it."""
    layout = splitkv.plan_qlen(batch=5, heads_q=32, heads_k=8, capacity=S_CACHE, num_splits=num_splits,
                               sms=splitkv._sm_count(torch.cuda.current_device()))
    chunk = layout.chunk if layout.splits > 1 else 2048
    lens = [chunk - 1 + s - 1, chunk + s - 1, chunk + s, min(2 * chunk - 1, S_CACHE), S_CACHE]
    splits = _case(launched, lens, s=s, num_splits=num_splits)
    assert splits == num_splits or num_splits in (0, 64)


@pytest.mark.parametrize("s_new", [0, 1, 4])
def test_batch_idx_and_leftpad(launched, s_new):
    _case(launched, [50, 10, 3000, 7], s=4, s_new=s_new, b_cache=6, idx=[4, 0, 2, 5], left=[3, 0, 1000, 7],
          num_splits=6)
    _case(launched, [50, 4000 - s_new], s=4, s_new=s_new, idx=[1, 0], left=[0, 129], num_splits=1,
          softcap=5.0)
    _case(launched, [50, 4000 - s_new, 2], s=3, s_new=s_new, hq=8, hk=8, left=[7, 129, 0])


@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("s", [2, 16])
@pytest.mark.parametrize("num_splits", [0, 1, 5])
def test_paged(launched, page_size, s, num_splits):
    """Pages read by the kernel, the tokens' diagonal at and across page ends."""
    lens = [0, 1, page_size - 1, page_size, page_size + 1, 3000, S_CACHE - s]
    _case(launched, lens, s=s, s_new=s, page_size=page_size, num_splits=num_splits)


def test_paged_gathered(launched):
    """Pages of 7 (not read by the kernels): gathered, then as a contiguous cache."""
    _case(launched, [0, 1, 6, 7, 3000], s=4, s_new=4, page_size=7, kernels_read_pages=False)


@pytest.mark.parametrize("num_splits", [0, 1])
@pytest.mark.parametrize("page_size", [0, 16])
def test_no_mask(launched, num_splits, page_size):
    """Without a mask every token sees every key: the split kernel alone (and its merge)."""
    _case(launched, [0, 1, 300, S_CACHE - 4], s=4, s_new=4, causal=False, num_splits=num_splits,
          page_size=page_size)


@pytest.mark.parametrize("d", [64, 96, 192, 256])
def test_head_dims(launched, d):
    _case(launched, [5, 2000, 0], s=4, s_new=2, hq=16, hk=2, d=d, s_cache=2048, num_splits=4)


@pytest.mark.parametrize("return_lse", [True, False])
def test_softcap_fp16_and_a_given_output(launched, return_lse):
    out = torch.full((4, 4, 32, 128), float("nan"), device=DEV, dtype=torch.float16)
    _case(launched, [3, S_CACHE - 4, 0, 600], s=4, s_new=4, softcap=10.0, dtype=torch.float16, given_out=out,
          return_lse=return_lse)
    odd = torch.full((4, 4, 32, 136), float("nan"), device=DEV, dtype=torch.float16)[..., 4:132]
    _case(launched, [3, S_CACHE, 0, 600], s=4, dtype=torch.float16, given_out=odd, return_lse=return_lse,
          num_splits=3)


def test_decode_tile(launched, monkeypatch):
    """The packed tokens on the 1-warpgroup decode tile (FLASHHOPPER_EXPERIMENTAL_DECODE_TILE=1; 128 rows at
    16 tokens of GQA 8: two query blocks)."""
    monkeypatch.setenv(validation.DECODE_TILE_OPT_IN, "1")
    for page_size in (0, 16):
        _case(launched, [0, 1, 129, 3000, S_CACHE - 16], s=16, s_new=16, hq=64, hk=8, page_size=page_size,
              num_splits=5)


@pytest.mark.parametrize("page_size", [0, 16])
def test_graph_replay_with_new_lengths(launched, page_size):
    """Captured once, replayed on other cache_seqlens, shorter than the tokens and the capacity among them:
    no host sync, no recompile, the kernels read the lengths."""
    torch.manual_seed(3)
    b, s, hq, hk, d, s_cache = 3, 4, 32, 8, 128, 4096
    if page_size:
        per_item = s_cache // page_size
        table = torch.randperm(b * per_item, device=DEV).view(b, per_item).int()
        k_cache, v_cache = (torch.randn(b * per_item, page_size, hk, d, device=DEV, dtype=torch.bfloat16)
                            for _ in range(2))
        extra = {"page_table": table}

        def keys_of(c, i, n):
            pos = torch.arange(n, device=DEV)
            return c[table[i, pos // page_size].long(), pos % page_size][None]
    else:
        shape = (b, s_cache, hk, d)
        k_cache, v_cache = (torch.randn(shape, device=DEV, dtype=torch.bfloat16) for _ in range(2))
        extra = {}

        def keys_of(c, i, n):
            return c[i:i + 1, :n]
    q = torch.randn(b, s, hq, d, device=DEV, dtype=torch.bfloat16)
    lens = torch.tensor([10, 20, 30], dtype=torch.int32, device=DEV)

    def call():
        return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True, return_lse=True,
                                       **extra)

    call()  # compiled and loaded before the capture
    assert _check_launches(launched, causal=True, page_size=page_size) > 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = call()
    launched[0].clear()
    launched[1].clear()
    for new in ([100, 3, 4096], [4096, 0, 1], [0, 2, 2049]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i, n in enumerate(new):
            if n:
                check_forward(out[i:i + 1], lse[i:i + 1], q[i:i + 1], keys_of(k_cache, i, n),
                              keys_of(v_cache, i, n), d ** -0.5, True, (-1, -1), 0.0)
            else:
                assert (out[i] == 0).all() and torch.isneginf(lse[i]).all()
    assert not launched[0]  # replays launch nothing from Python
