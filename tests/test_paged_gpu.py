"""Paged KV read by the kernels (FwdConfig.page_size) on the GPU (on by default where the page size allows;
the tests also set FLASHHOPPER_EXPERIMENTAL_PAGED_TMA=1): flash_attn_with_kvcache over a paged cache
whose page size the kernels read by TMA, each item by the rule of flashhopper/accuracy.py against the
float64 reference over its keys. Page tables shuffled, their entries past the pages in use garbage (-1, a
page far past the cache, a page of another item), every cache slot no item uses NaN (it must stay out:
masked scores, V rows zeroed), every launch checked to have been the paged kernel (no gathered copy).
Decode (one query token: PackGQA and split-KV, whose chunks start inside their item's table row) on the
varlen tile and the 1-warpgroup decode tile, prefill (causal, several query tokens, an append across
pages), GQA and not, head dims 64 / 128 / 256, pages of 16, 64, 128 and 256 rows.

Passed on an H100 (2026-12-05, docs/testing.md), hence validation.PAGED_TMA_GPU_VERIFIED; `make gpu-test`
precompiles its kernels (`precompile --paged --decode`)."""

from __future__ import annotations

import math

import pytest
import torch
from launched import record_launches

from flashhopper import flash_attn_with_kvcache, validation
from flashhopper.accuracy import check_kvcache

pytestmark = pytest.mark.gpu

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)

DEV = "cuda"
PAGE_SIZES = [16, 64, 128, 256]
# keys each item sees: one, one past a 128-key block, a long one ending inside a page
CONTEXTS = [1, 129, 1000]


@pytest.fixture(autouse=True)
def launched(monkeypatch):
    """Paged TMA on (as by default, whatever the caller's environment), and every forward config
    launched."""
    monkeypatch.setenv(validation.PAGED_TMA_OPT_IN, "1")
    return record_launches(monkeypatch)


def _paged(launched, page_size, d, hq, hk, sq, contexts, s_new=0, causal=True, dtype=torch.bfloat16, seed=0,
           **hints):
    """One call over a shuffled paged cache; each item checked against its keys in position order."""
    torch.manual_seed(seed)
    b = len(contexts)
    max_pages = -(-max(contexts) // page_size) + 2  # room the items do not use
    num_pages = b * max_pages + 3
    table = torch.randperm(num_pages, device=DEV)[: b * max_pages].view(b, max_pages).int()
    shape = (num_pages, page_size, hk, d)
    k_paged, v_paged = (torch.randn(shape, device=DEV, dtype=dtype) for _ in range(2))
    used = torch.zeros(num_pages, page_size, dtype=torch.bool, device=DEV)
    for i, n in enumerate(contexts):
        pos = torch.arange(n, device=DEV)
        used[table[i, pos // page_size].long(), pos % page_size] = True
    for t in (k_paged, v_paged):  # slots no item uses (past each item's keys, unused pages): NaN
        t[~used] = float("nan")
    for i, n in enumerate(contexts):  # entries past the pages in use: garbage
        garbage = [-1, 1 << 30, int(table[(i + 1) % b, 0])]
        for j in range(-(-n // page_size), max_pages):
            table[i, j] = garbage[j % 3]
    q = torch.randn(b, sq, hq, d, device=DEV, dtype=dtype)
    lens = [n - s_new for n in contexts]
    k = v = None
    if s_new:
        k, v = (torch.randn(b, s_new, hk, d, device=DEV, dtype=dtype) for _ in range(2))
    before = (k_paged.clone(), v_paged.clone())
    launched.clear()
    out, lse = flash_attn_with_kvcache(q, k_paged, v_paged, k, v, page_table=table, causal=causal,
                                       cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=DEV),
                                       return_lse=True, **hints)
    torch.cuda.synchronize()
    assert launched and all(cfg.page_size == page_size for cfg in launched), launched
    # the append landed in the item's pages, nothing else changed; each item by the rule
    check_kvcache(out, lse, q, k_paged, v_paged, lens, scale=1 / math.sqrt(d), causal=causal, window=(-1, -1),
                  softcap=0.0, k_new=k, v_new=v, before=before, page_table=table)
    return launched


@pytest.mark.parametrize("splits", [1, 0])  # no split (PackGQA alone), split-KV (chosen: few CTAs)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_paged_decode(launched, monkeypatch, page_size, d, splits):
    monkeypatch.delenv(validation.DECODE_TILE_OPT_IN, raising=False)  # a run may opt in for the others
    cfgs = _paged(launched, page_size, d, 16, 4, 1, CONTEXTS, num_splits=splits)
    assert all(cfg.num_consumer_wg > 1 for cfg in cfgs)  # the varlen tile (decode tile not opted in)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_paged_decode_tile(launched, monkeypatch, page_size, d):
    """The rearranged decode on the 1-warpgroup decode tile (FLASHHOPPER_EXPERIMENTAL_DECODE_TILE=1)."""
    monkeypatch.setenv(validation.DECODE_TILE_OPT_IN, "1")
    cfgs = _paged(launched, page_size, d, 32, 8, 1, CONTEXTS)
    assert all(cfg.num_consumer_wg == 1 for cfg in cfgs)


@pytest.mark.parametrize("hq,hk", [(8, 2), (4, 4)])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_paged_prefill_causal(launched, page_size, d, hq, hk):
    """Prefill over a paged cache: several query tokens at the end of each item's keys, causal."""
    _paged(launched, page_size, d, hq, hk, 129, [129, 300, 1000])


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_paged_append_and_no_mask(launched, page_size):
    """An append across pages before the attention (the new keys land in the item's pages first), and a
    call without a mask."""
    _paged(launched, page_size, 128, 8, 2, 5, [10, 140, 700], s_new=5)
    _paged(launched, page_size, 128, 8, 2, 3, [3, 200, 513], causal=False, seed=1)


@pytest.mark.parametrize("d", [96, 192])
def test_paged_other_head_dims(launched, d):
    """hdim 96 (64-byte swizzle: three column chunks a box) and 192 (64 keys a block under pages of 64+)."""
    for page_size in (16, 128):
        _paged(launched, page_size, d, 8, 2, 1, CONTEXTS)
        _paged(launched, page_size, d, 8, 2, 64, [64, 700], seed=2)


def test_paged_fp16(launched):
    _paged(launched, 64, 128, 8, 2, 1, CONTEXTS, dtype=torch.float16)
    _paged(launched, 16, 128, 8, 2, 100, [100, 900], dtype=torch.float16)
