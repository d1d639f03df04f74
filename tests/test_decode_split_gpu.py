"""Decode with the split inside the attention kernel (FwdConfig.split_kv, runtime.forward_split; on by
default, validation.decode_split_enabled) on the GPU: flash_attn_with_kvcache with one query token, each item
by the rule of flashhopper/accuracy.py against the float64 reference over its keys. Splits 1 to the most
the cache allows (the kernel's partials merged by hopper/combine.py, or written to the output itself with
one split), uneven cache_seqlens with 0 and the cache's capacity among them, contiguous and paged caches
(pages shuffled, entries past the pages in use garbage), appends (checked in the cache element by element),
cache_batch_idx and cache_leftpad, GQA packed and not, softcap, a given output, the 1-warpgroup decode tile,
CUDA graph replay on new lengths. Every cache slot no item uses is NaN (it must stay out), every output
and partial NaN before the call (runtime.poison), every launch checked to have been the split kernel and
the merge kernel (no walk table, no varlen launch).

The kernels: `flashhopper precompile --decode --paged`, or compiled on first use."""

from __future__ import annotations

import math

import pytest
import torch
from launched import record_split_launches

from flashhopper import flash_attn_with_kvcache, validation
from flashhopper.accuracy import check_forward, check_kvcache
from flashhopper.config import CombineConfig

pytestmark = pytest.mark.gpu

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)

DEV = "cuda"


@pytest.fixture(autouse=True)
def launched(monkeypatch):
    """The opt-ins, and every kernel launched: (config, the splits asked of forward_split or None)."""
    monkeypatch.setenv(validation.DECODE_SPLIT_OPT_IN, "1")
    return record_split_launches(monkeypatch)


def _check_launches(launched, page_size=0, merge_kernel=True, plain_ok=False):
    """The call launched the split kernel once (paged: the paged one), then the merge kernel where it split
    (`merge_kernel`: where it takes the output; else the merge is torch's) and nothing else of ours; returns
    the split count. `plain_ok`: hints that may leave the call unrearranged (pack_gqa=False and no split
    asked or chosen: splitkv.plan), where one plain varlen kernel is right instead (split count 1)."""
    kernels, splits = launched
    if plain_ok and not splits:
        assert len(kernels) == 1 and not kernels[0].split_kv, kernels
        kernels.clear()
        return 1
    assert len(splits) == 1, splits
    fwd = [cfg for cfg in kernels if not isinstance(cfg, CombineConfig)]
    merges = [cfg for cfg in kernels if isinstance(cfg, CombineConfig)]
    assert len(fwd) == 1 and fwd[0].split_kv and fwd[0].page_size == page_size, fwd
    assert len(merges) == (merge_kernel and splits[0] > 1), merges
    n = splits[0]
    kernels.clear()
    splits.clear()
    return n


def _case(launched, lens, *, s_new=0, hq=32, hk=8, d=128, s_cache=4097, page_size=0, idx=None, b_cache=None,
          left=None, softcap=0.0, dtype=torch.bfloat16, given_out=None, merge_kernel=True, seed=0, **hints):
    """One decode call; each item by the rule against its keys in position order, the append checked,
    the rest of the cache unchanged. lens: cache_seqlens before the append; page_size: a paged cache of
    ceil(s_cache / page_size) pages an item, shuffled. Returns the split count the call ran."""
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
    q = torch.randn(b, 1, hq, d, device=DEV, dtype=dtype)
    k = v = None
    if s_new:
        k, v = (torch.randn(b, s_new, hk, d, device=DEV, dtype=dtype) for _ in range(2))
    kw = dict(cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=DEV), causal=True, softcap=softcap,
              return_lse=True, **hints)
    if page_size:
        kw["page_table"] = table
    if idx is not None:
        kw["cache_batch_idx"] = torch.tensor(idx, dtype=torch.int32, device=DEV)
    if left is not None:
        kw["cache_leftpad"] = torch.tensor(left, dtype=torch.int32, device=DEV)
    if given_out is not None:
        kw["out"] = given_out
    before = (k_cache.clone(), v_cache.clone())
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kw)
    torch.cuda.synchronize()
    if given_out is not None:
        assert out is given_out
    plain_ok = hints.get("pack_gqa") is False and hints.get("num_splits", 0) in (0, 1)
    splits = _check_launches(launched, page_size, merge_kernel, plain_ok)
    check_kvcache(out, lse, q, k_cache, v_cache, lens, scale=1 / math.sqrt(d), causal=True, window=(-1, -1),
                  softcap=softcap, k_new=k, v_new=v, before=before, cache_batch_idx=idx, cache_leftpad=left,
                  page_table=kw.get("page_table"))
    return splits


# uneven lengths: none, one, one past a 128-key block, a long one, the cache's capacity (4097)
LENS = [0, 1, 129, 3000, 4097]


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 0, 64])  # 0: chosen; 64: capped at the cache's chunks
@pytest.mark.parametrize("pack_gqa", [None, False])
@pytest.mark.parametrize("page_size", [0, 16, 128])
def test_splits(launched, num_splits, pack_gqa, page_size):
    splits = _case(launched, LENS, page_size=page_size, num_splits=num_splits, pack_gqa=pack_gqa)
    assert splits == num_splits or num_splits in (0, 64)  # (the cache's 4097 positions take 7 chunks)


@pytest.mark.parametrize("s_new", [1, 2])
@pytest.mark.parametrize("page_size", [0, 64])
@pytest.mark.parametrize("num_splits", [1, 5])
def test_appends(launched, s_new, page_size, num_splits):
    """The append before the attention, the kernel counting the new keys (cache_seqlens + s_new); an item
    filled to the capacity by it."""
    _case(launched, [0, 200, 4097 - s_new], s_new=s_new, page_size=page_size, num_splits=num_splits)


@pytest.mark.parametrize("d", [64, 96, 192, 256])
@pytest.mark.parametrize("hq,hk", [(8, 8), (16, 2), (128, 1)])  # GQA 1 (nothing to pack), 8, MQA 128 rows
def test_head_dims_and_groups(launched, d, hq, hk):
    _case(launched, [5, 2000, 0], hq=hq, hk=hk, d=d, s_cache=2048, num_splits=4)


def test_batch_idx_and_leftpad(launched):
    """cache_batch_idx (rows permuted, spare rows) and cache_leftpad: each item's first key row from the
    kernel's key_starts, its length less the pad."""
    _case(launched, [50, 10, 3000, 7], s_new=1, b_cache=6, idx=[4, 0, 2, 5], left=[3, 0, 1000, 8],
          s_cache=4097, num_splits=6)
    _case(launched, [50, 4000], idx=[1, 0], left=[0, 129], num_splits=1, softcap=5.0)


@pytest.mark.parametrize("num_splits", [1, 9])
def test_softcap_fp16_and_a_given_output(launched, num_splits):
    """fp16, softcap; a given output: written in place by the kernel (one split), by the merge otherwise, and
    through the merge where it is not of whole 16-byte rows."""
    out = torch.full((4, 1, 32, 128), float("nan"), device=DEV, dtype=torch.float16)
    _case(launched, [3, 4097, 0, 600], softcap=10.0, dtype=torch.float16, given_out=out,
          num_splits=num_splits)
    odd = torch.full((4, 1, 32, 136), float("nan"), device=DEV, dtype=torch.float16)[..., 4:132]
    _case(launched, [3, 4097, 0, 600], dtype=torch.float16, given_out=odd, num_splits=num_splits,
          merge_kernel=False)


def test_decode_tile(launched, monkeypatch):
    """On the 1-warpgroup decode tile (FLASHHOPPER_EXPERIMENTAL_DECODE_TILE=1)."""
    monkeypatch.setenv(validation.DECODE_TILE_OPT_IN, "1")
    for page_size in (0, 16):
        _case(launched, LENS, page_size=page_size, num_splits=5)


@pytest.mark.parametrize("page_size", [0, 16])
def test_graph_replay_with_new_lengths(launched, page_size):
    """Captured once (two launches in the graph with splits), replayed on other cache_seqlens, 0 and the
    capacity among them: no host sync, no recompile, the kernel reads the lengths."""
    torch.manual_seed(3)
    b, hq, hk, d, s_cache = 3, 32, 8, 128, 4096
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
    q = torch.randn(b, 1, hq, d, device=DEV, dtype=torch.bfloat16)
    lens = torch.tensor([10, 20, 30], dtype=torch.int32, device=DEV)

    def call():
        return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True, return_lse=True,
                                       **extra)

    call()  # compiled and loaded before the capture
    assert _check_launches(launched, page_size) > 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = call()
    launched[0].clear()
    launched[1].clear()
    for new in ([100, 3, 4096], [4096, 0, 1], [0, 0, 2049]):
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
