"""`flashhopper bench --decode` without a GPU: the points, the byte count, the cache rotation, the
makers on the CPU (against the reference), the timing loop with fake providers, the table and the
command line (graph capture and the timing itself need a GPU)."""

import dataclasses
import functools
import io
import json
import math
import os
import subprocess
import sys
import types

import pytest
import torch

from flashhopper import cli
from flashhopper.bench import decode, runner
from flashhopper.interface import flash_attn_varlen_func
from flashhopper.kvcache import flash_attn_with_kvcache
from flashhopper.reference import visible_mask

MB = 10**6

# --- points, bytes, rotation ---


def test_points_are_the_issues():
    points = decode.decode_points()
    assert len(points) == len(set(points)) == 6 * 2 * 2
    assert {(p.batch, p.context) for p in points} == {(1, 8192), (1, 32768), (1, 131072), (8, 32768),
                                                      (64, 4096), (128, 8192)}
    assert {p.q_len for p in points} == {1, 4}
    assert {(p.heads_q, p.heads_k, p.hdim) for p in points} == {(32, 8, 128), (32, 32, 64)}
    assert points[0] == decode.DecodePoint(1, 8192, 1, 32, 8, 128)
    assert points[0].label == "1 x 8k q1 heads 32:8 hdim 128"
    assert [(p.q_len, p.hdim) for p in points[5:7]] == [(1, 128), (4, 128)]  # table order
    assert [p.hdim for p in decode.decode_points(hdims=[64])] == [64] * 12


def test_quick_points():
    quick = decode.decode_points(quick=True)
    assert [(p.batch, p.context, p.q_len, p.heads_q, p.heads_k, p.hdim) for p in quick] == [
        (1, 8192, 1, 32, 8, 128), (8, 32768, 1, 32, 8, 128), (64, 4096, 1, 32, 8, 128)]
    assert decode.decode_points(quick=True, hdims=[128]) == quick
    assert decode.decode_points(quick=True, hdims=[64]) == []


def test_kv_bytes():
    # batch x context x heads_k x hdim x 2 (K and V) x 2 bytes
    assert decode.kv_bytes(1, 8192, 8, 128) == 8192 * 8 * 128 * 4 == 32 * 2**20
    assert decode.kv_bytes(128, 8192, 32, 64) == 8 * 2**30
    assert decode.kv_bytes(64, 4096, 8, 128, element_bytes=1) == 64 * 4096 * 8 * 128 * 2
    p = decode.DecodePoint(8, 32768, 4, 32, 8, 128)
    assert p.kv_bytes == 8 * 32768 * 8 * 128 * 2 * 2  # the query length does not change what is read


def test_rotation_count():
    assert decode.rotation_count(32 * 2**20) == 4  # 1 x 8k GQA: 4 caches, 128 MiB
    assert decode.rotation_count(4 * 2**20) == 25  # 25 x 4 MiB = 100 MiB
    assert decode.rotation_count(3 * 2**20) == 34  # 34 x 3 MiB = 102 MiB
    assert decode.rotation_count(2**34) == 4
    with pytest.raises(ValueError):
        decode.rotation_count(0)


@pytest.mark.parametrize("point", decode.decode_points() + [decode.DecodePoint(1, 1024, 1, 32, 8, 128),
                                                            decode.DecodePoint(2, 640, 4, 8, 2, 64)])
def test_each_point_walks_at_least_4_caches_over_100_mb(point):
    n = point.caches
    assert n >= 4 and point.rotation_bytes == n * point.kv_bytes > 100 * MB
    assert n == 4 or (n - 1) * point.kv_bytes < decode.MIN_ROTATION_BYTES  # no more than it takes


def test_points_over_40_gib_are_skipped():
    points = decode.decode_points()
    assert all(p.skip_reason is None for p in points)  # the issue's points all fit
    assert max(p.rotation_bytes for p in points) == 32 * 2**30  # 128 x 8k at 32:32 hdim 64, 4 caches
    big = decode.DecodePoint(256, 131072, 1, 32, 8, 128)
    assert big.skip_reason == "4 caches x 128.0 GiB = 512.0 GiB > 40.0 GiB"
    assert decode.DecodePoint(160, 8192, 1, 32, 32, 64).skip_reason is None  # 4 x 10 GiB: at the limit
    over = decode.DecodePoint(161, 8192, 1, 32, 32, 64)
    assert over.skip_reason == "4 caches x 10.1 GiB = 40.2 GiB > 40.0 GiB"


def test_a_skipped_point_allocates_nothing(monkeypatch):
    monkeypatch.setattr(decode, "decode_inputs", lambda *a, **kw: pytest.fail("must not allocate"))
    provider = decode.DecodeProvider("flashhopper", lambda x, p: pytest.fail("must not run"))
    row = decode.run_decode_point(decode.DecodePoint(256, 131072, 1, 32, 8, 128), [provider], 4e12,
                                  device="cpu")
    assert row["skipped"].endswith("> 40.0 GiB") and row["us"] == {"flashhopper": None}
    assert row["ratio"] is None and row["errors"] == {}


# --- paged caches and chunked prefill: points, bytes, the memory budget ---

GIB, MIB = 2**30, 2**20
GQA_BIG = decode.DecodePoint(128, 8192, 1, 32, 8, 128)  # 4 GiB a cache, 4 caches
MHA_BIG = decode.DecodePoint(128, 8192, 1, 32, 32, 64)  # 8 GiB a cache, 4 caches


def test_prefill_points():
    points = decode.prefill_points()
    assert [(p.batch, p.context, p.q_len) for p in points] == [(1, 10240, 2048), (4, 10240, 2048),
                                                              (1, 34816, 2048), (4, 34816, 2048)]
    assert {(p.heads_q, p.heads_k, p.hdim) for p in points} == {(32, 8, 128)}
    assert [decode.prefill_label(p) for p in points[1:3]] == ["4 x chunk 2k after 8k heads 32:8 hdim 128",
                                                              "1 x chunk 2k after 32k heads 32:8 hdim 128"]
    assert decode.prefill_points(hdims=[128]) == points and decode.prefill_points(hdims=[64]) == []
    assert all(p.skip_reason is None for p in points)
    assert [p.caches for p in points] == [4, 4, 4, 4] and points[3].kv_bytes == 544 * MIB


def test_prefill_flops_count_the_visible_pairs():
    point = decode.prefill_points()[3]  # 4 x (2048 queries after 32k)
    pairs = 2048 * 32768 + 2048 * 2049 // 2  # query i sees the 32k cached keys and i + 1 of the chunk's
    assert decode.prefill_flops(point) == 4 * 128 * 32 * 4 * pairs
    small = decode.DecodePoint(2, 40, 8, 4, 2, 64)
    pairs = int(visible_mask(8, 40, causal=True).sum())  # bottom-right, as the calls align it
    assert pairs == 8 * 32 + 36 and decode.prefill_flops(small) == 4 * 64 * 4 * 2 * pairs


def test_pages_and_paged_bytes():
    assert decode.pages_per_item(8192, 64) == 128 and decode.pages_per_item(40, 16) == 3
    assert decode.pages_per_item(40, 1) == 40
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        decode.pages_per_item(40, 0)
    for page_size in (1, 16, 64):  # whole pages: the same K and V as the contiguous cache, and the table
        assert decode.paged_kv_bytes(GQA_BIG, page_size) == GQA_BIG.kv_bytes == 4 * GIB
        pages = 128 * 8192 // page_size
        assert decode.paged_bytes(GQA_BIG, page_size) == 4 * GIB + 4 * pages
    partial = decode.DecodePoint(2, 40, 1, 4, 2, 64)  # 3 pages of 16 an item, the last one half used
    assert decode.paged_kv_bytes(partial, 16) == 2 * 48 * 2 * 64 * 2 * 2 > partial.kv_bytes
    assert decode.paged_bytes(partial, 16) == decode.paged_kv_bytes(partial, 16) + 2 * 3 * 4


def test_gathered_page_sizes(monkeypatch):
    assert [decode.gathered(p) for p in (1, 3, 8, 16, 64, 256)] == [True, True, False, False, False, False]
    assert decode.gather_bytes(GQA_BIG, 1) == 4 * GIB and decode.gather_bytes(GQA_BIG, 64) == 0
    monkeypatch.setattr(decode.validation, "paged_tma_enabled", lambda: False)  # every size gathered
    assert decode.gathered(64) and decode.gather_bytes(GQA_BIG, 64) == 4 * GIB


def test_held_bytes():
    assert decode.held_bytes(GQA_BIG, []) == decode.held_bytes(GQA_BIG, [], together=False) == 16 * GIB
    page1 = 4 * (4 * GIB + 4 * 128 * 8192) + 4 * GIB  # 4 paged copies with their tables, and the gather
    page64 = 4 * (4 * GIB + 4 * 128 * 128)
    assert decode.held_bytes(GQA_BIG, [1]) == 16 * GIB + page1
    assert decode.held_bytes(GQA_BIG, [1, 64]) == 16 * GIB + page1 + page64  # every provider held
    assert decode.held_bytes(GQA_BIG, [1, 64], together=False) == 16 * GIB + page1  # one at a time


def test_fitting_pages_within_40_gib():
    kept, left_out = decode.fitting_pages(GQA_BIG, (1, 16, 64))
    assert kept == [1] and list(left_out) == [16, 64]
    assert left_out[16] == "its paged caches would not fit: the point would hold 52.0 GiB > 40.0 GiB"
    kept, left_out = decode.fitting_pages(GQA_BIG, (64, 1, 16))  # kept in the order given
    assert kept == [64] and [why[-19:] for why in left_out.values()] == ["52.0 GiB > 40.0 GiB",
                                                                         "48.0 GiB > 40.0 GiB"]
    assert decode.fitting_pages(GQA_BIG, (1, 16, 64), together=False) == ([1, 16, 64], {})
    kept, left_out = decode.fitting_pages(MHA_BIG, (1, 16, 64), together=False)  # 32 GiB contiguous already
    assert kept == [] and left_out[1].endswith("72.0 GiB > 40.0 GiB") and left_out[64].endswith("64.0 GiB > "
                                                                                                  "40.0 GiB")
    for point in decode.decode_points(quick=True) + decode.prefill_points():
        assert decode.fitting_pages(point, (1, 16, 64)) == ([1, 16, 64], {})
        assert decode.held_bytes(point, (1, 16, 64)) <= decode.MAX_ROTATION_BYTES


# --- inputs and the real makers, on the CPU ---

SMALL = decode.DecodePoint(2, 2048, 4, 4, 2, 64)  # 2 MiB of KV: 50 caches


def test_decode_inputs():
    inputs = decode.decode_inputs(SMALL, torch.bfloat16, "cpu")
    assert len(inputs) == SMALL.caches == 50
    x = inputs[0]
    assert x.q.shape == (2, 4, 4, 64) and x.k_cache.shape == x.v_cache.shape == (2, 2048, 2, 64)
    assert x.cache_seqlens.dtype == torch.int32 and x.cache_seqlens.tolist() == [2048, 2048]
    assert x.cu_seqlens_q.tolist() == [0, 4, 8] and x.cu_seqlens_k.tolist() == [0, 2048, 4096]
    assert x.cu_seqlens_q.dtype == x.cu_seqlens_k.dtype == torch.int32
    assert torch.equal(x.mask, visible_mask(4, 2048, causal=True)) and x.mask.shape == (4, 2048)
    assert x.mask[0, 2044] and not x.mask[0, 2045] and x.mask[3].all()  # bottom-right
    assert not torch.equal(inputs[0].k_cache, inputs[1].k_cache)  # independent caches
    assert not torch.equal(inputs[0].q, inputs[1].q)
    assert inputs[1].cache_seqlens is x.cache_seqlens  # the shared parts are shared
    one = decode.decode_inputs(decode.DecodePoint(2, 40, 1, 4, 2, 64), torch.bfloat16, "cpu", count=1)
    assert len(one) == 1 and one[0].mask is None


def _reference_kvcache(seen, q, k_cache, v_cache, **kw):
    seen.append(kw)
    return flash_attn_with_kvcache(q, k_cache, v_cache, backend="reference", **kw)


def _want(x):
    """The attention every provider must compute: flash_attn_with_kvcache's reference."""
    return flash_attn_with_kvcache(x.q, x.k_cache, x.v_cache, cache_seqlens=x.cache_seqlens, causal=True,
                                   backend="reference")


def test_flashhopper_provider_calls_the_cache(monkeypatch):
    from flashhopper import kvcache

    seen = []
    monkeypatch.setattr(kvcache, "flash_attn_with_kvcache", functools.partial(_reference_kvcache, seen))
    provider = decode.flashhopper_decode()
    x = decode.decode_inputs(SMALL, torch.bfloat16, "cpu", count=1)[0]
    with provider.context():
        got = provider.make(x, SMALL)()
    assert seen == [{"cache_seqlens": x.cache_seqlens, "causal": True}]
    torch.testing.assert_close(got, _want(x), rtol=0, atol=0)


@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)])
@pytest.mark.parametrize("enable_gqa", [True, False])
def test_sdpa_provider_computes_the_same_attention(q_len, heads, enable_gqa):
    point = decode.DecodePoint(2, 40, q_len, *heads, 64)
    x = decode.decode_inputs(point, torch.bfloat16, "cpu", count=1)[0]
    provider = decode.sdpa_decode(enable_gqa=enable_gqa)
    assert provider.info == {"gqa": "enable_gqa" if enable_gqa else "repeat_interleave"}
    got = provider.make(x, point)()
    assert got.shape == (2, q_len, heads[0], 64)
    torch.testing.assert_close(got, _want(x), rtol=2e-2, atol=2e-2)


def test_sdpa_reads_only_the_context(monkeypatch):
    """With a cache longer than the context, SDPA sees the first `context` keys (the cache's tail
    filled with NaN would poison the output otherwise)."""
    point = decode.DecodePoint(2, 40, 4, 4, 2, 64)
    x = decode.decode_inputs(point, torch.bfloat16, "cpu", count=1)[0]
    longer = torch.full((2, 48, 2, 64), float("nan"), dtype=torch.bfloat16)
    k, v = longer.clone(), longer.clone()
    k[:, :40], v[:, :40] = x.k_cache, x.v_cache
    y = decode.DecodeInputs(x.q, k, v, x.cache_seqlens, x.cu_seqlens_q, x.cu_seqlens_k, x.mask)
    got = decode.sdpa_decode().make(y, point)()
    torch.testing.assert_close(got, _want(x), rtol=2e-2, atol=2e-2)


def test_sdpa_probe(monkeypatch):
    assert decode.sdpa_takes_enable_gqa()  # the torch this runs on has it

    def old_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        return q

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", old_sdpa)
    assert not decode.sdpa_takes_enable_gqa()
    assert decode.sdpa_decode().info == {"gqa": "repeat_interleave"}


@pytest.fixture
def fake_fa4(monkeypatch):
    """flash_attn.cute.interface with a varlen function that records its keywords and computes with
    flashhopper's reference varlen (which takes seqused_k like FA4's)."""
    seen = []

    def fa4(q, k, v, qv=None, **kw):
        assert qv is None
        seen.append({"q": q, "k": k, "v": v, **kw})
        out = flash_attn_varlen_func(q, k, v, kw["cu_seqlens_q"], kw["cu_seqlens_k"], kw["max_seqlen_q"],
                                     kw["max_seqlen_k"], seqused_k=kw["seqused_k"], causal=kw["causal"],
                                     backend="reference")
        return out, torch.zeros(q.shape[1], q.shape[0])  # (out, lse)

    interface = types.ModuleType("flash_attn.cute.interface")
    interface.flash_attn_varlen_func = fa4
    cute = types.ModuleType("flash_attn.cute")
    cute.interface = interface
    package = types.ModuleType("flash_attn")
    package.cute = cute
    for name, module in (("flash_attn", package), ("flash_attn.cute", cute),
                         ("flash_attn.cute.interface", interface)):
        monkeypatch.setitem(sys.modules, name, module)
    return seen


@pytest.mark.parametrize("q_len", [1, 4])
def test_fa4_reads_the_cache_as_packed_rows(fake_fa4, q_len):
    point = decode.DecodePoint(2, 40, q_len, 4, 2, 64)
    x = decode.decode_inputs(point, torch.bfloat16, "cpu", count=1)[0]
    providers = decode.decode_providers(io.StringIO())
    assert [p.name for p in providers] == ["flashhopper", "fa4", "sdpa"]
    with providers[1].context():
        got = providers[1].make(x, point)()
    (call,) = fake_fa4
    assert call["q"].shape == (2 * q_len, 4, 64) and call["q"].data_ptr() == x.q.data_ptr()
    assert call["k"].shape == (80, 2, 64) and call["k"].data_ptr() == x.k_cache.data_ptr()  # no copy
    assert call["v"].data_ptr() == x.v_cache.data_ptr()
    assert call["cu_seqlens_q"].tolist() == [0, q_len, 2 * q_len]
    assert call["cu_seqlens_k"].tolist() == [0, 40, 80]
    assert call["seqused_k"] is x.cache_seqlens and call["causal"] is True
    assert (call["max_seqlen_q"], call["max_seqlen_k"]) == (q_len, 40)
    assert got.shape == (2, q_len, 4, 64)
    torch.testing.assert_close(got, _want(x), rtol=0, atol=0)


def test_fa4_is_skipped_with_a_note_when_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails as for an absent package
    out = io.StringIO()
    assert [p.name for p in decode.decode_providers(out)] == ["flashhopper", "sdpa"]
    assert out.getvalue().startswith("(FA4 not measured: flash_attn.cute unavailable:")


def test_import_needs_no_gpu():
    code = ("import sys, flashhopper.bench.decode as d; d.decode_points(); d.flashhopper_decode(); "
            "d.sdpa_decode(); d.prefill_points(); d.prefill_providers((1, 64)); "
            "d.fitting_pages(d.decode_points()[0], (1, 64)); "
            "assert 'cutlass' not in sys.modules and 'flashhopper.hopper' not in sys.modules, sys.modules")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# --- paged caches and the prefill makers, on the CPU ---


def _gathered_on_cpu(paged, context):
    """The contiguous (b, context, hk, d) caches read back through the page table."""
    b, per_item = paged.page_table.shape
    rows = []
    for cache in (paged.k_cache, paged.v_cache):
        pages = cache[paged.page_table.long()]  # (b, per_item, page_size, hk, d)
        rows.append(pages.reshape(b, per_item * cache.shape[1], *cache.shape[2:])[:, :context])
    return rows


def test_shuffled_page_table_is_a_seeded_permutation():
    table = decode.shuffled_page_table(4, 10, torch.Generator().manual_seed(0), "cpu")
    assert table.dtype == torch.int32 and table.shape == (4, 10)
    assert sorted(table.reshape(-1).tolist()) == list(range(40))  # every page once
    assert not torch.equal(table.reshape(-1), torch.arange(40, dtype=torch.int32))  # shuffled
    again = decode.shuffled_page_table(4, 10, torch.Generator().manual_seed(0), "cpu")
    assert torch.equal(table, again)  # seeded: the same draw
    generator = torch.Generator().manual_seed(0)
    first, second = (decode.shuffled_page_table(4, 10, generator, "cpu") for _ in range(2))
    assert torch.equal(first, table) and not torch.equal(first, second)  # a new draw each time


@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
def test_paged_cache_holds_the_contiguous_cache(page_size):
    point = decode.DecodePoint(3, 200, 1, 4, 2, 64)
    x = decode.decode_inputs(point, torch.bfloat16, "cpu", count=1)[0]
    paged = decode.paged_cache(x.k_cache, x.v_cache, page_size, torch.Generator().manual_seed(1))
    per_item = decode.pages_per_item(200, page_size)
    assert paged.page_table.shape == (3, per_item) and paged.page_table.dtype == torch.int32
    assert sorted(paged.page_table.reshape(-1).tolist()) == list(range(3 * per_item))
    assert paged.k_cache.shape == paged.v_cache.shape == (3 * per_item, page_size, 2, 64)
    assert paged.k_cache.dtype == torch.bfloat16 and paged.k_cache.is_contiguous()
    k, v = _gathered_on_cpu(paged, 200)
    assert torch.equal(k, x.k_cache) and torch.equal(v, x.v_cache)
    if 200 % page_size:  # the unused slots of a last page: zeros
        last = paged.k_cache[paged.page_table[:, -1].long(), 200 % page_size:]
        assert not last.any()
    # position p of item i at slot p % page_size of page page_table[i, p // page_size], as kvcache reads it
    i, p = 2, 123
    page = int(paged.page_table[i, p // page_size])
    assert torch.equal(paged.k_cache[page, p % page_size], x.k_cache[i, p])


@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_provider_computes_the_same_attention(monkeypatch, q_len, page_size):
    from flashhopper import kvcache

    seen = []
    monkeypatch.setattr(kvcache, "flash_attn_with_kvcache", functools.partial(_reference_kvcache, seen))
    point = decode.DecodePoint(2, 40, q_len, 4, 2, 64)
    provider = decode.flashhopper_paged(page_size)
    assert provider.name == f"flashhopper-page{page_size}" and provider.page_size == page_size
    table = "a random permutation of the pages (seed 0)"
    assert provider.info == {"page_size": page_size, "page_table": table}
    x = decode.decode_inputs(point, torch.bfloat16, "cpu", count=1)[0]
    got = provider.make(x, point)()
    (call,) = seen
    assert call["cache_seqlens"] is x.cache_seqlens and call["causal"] is True
    table = call["page_table"]
    assert table.shape == (2, decode.pages_per_item(40, page_size)) and table.dtype == torch.int32
    assert got.shape == (2, q_len, 4, 64)
    torch.testing.assert_close(got, _want(x), rtol=0, atol=0)  # the same keys in the same order
    assert provider.notes(point) == {"pages_read": None}  # no GPU: the plan cannot be asked
    assert provider.notes(decode.DecodePoint(2, 48, q_len, 4, 2, 64)) == {"pages_read": None}


def test_paged_providers_draw_a_table_per_cache(monkeypatch):
    point = decode.DecodePoint(2, 64, 1, 4, 2, 64)
    provider = decode.flashhopper_paged(1)
    tables = []
    monkeypatch.setattr(decode, "paged_cache", lambda *a: tables.append(a[-1].initial_seed()) or
                        decode.PagedCache(*a[:2], None))
    for x in decode.decode_inputs(point, torch.bfloat16, "cpu", count=3):
        provider.make(x, point)
    assert tables == [0, 0, 0]  # one generator, seeded 0, drawn from for each cache


def test_pages_read_asks_the_kvcache_plan(monkeypatch):
    """On a GPU the row tells whether the kernels read the pages or kvcache gathered them first: asked of
    kvcache's plan with the SM count (which needs CUDA) stood in for."""
    from flashhopper import splitkv

    monkeypatch.setattr(splitkv, "_sm_count", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    point = decode.DecodePoint(2, 1024, 1, 32, 8, 128)
    x = decode.decode_inputs(point, torch.bfloat16, "cpu", count=1)[0]
    generator = torch.Generator().manual_seed(0)
    read = {p: decode.pages_read(x.q, decode.paged_cache(x.k_cache, x.v_cache, p, generator))
            for p in (1, 64)}
    assert read == {1: "gathered", 64: "kernels"}
    monkeypatch.setattr(decode.validation, "paged_tma_enabled", lambda: False)
    assert decode.pages_read(x.q, decode.paged_cache(x.k_cache, x.v_cache, 64, generator)) == "gathered"


def test_providers_with_pages(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # no FA4
    names = [p.name for p in decode.decode_providers(io.StringIO(), pages=(1, 64))]
    assert names == ["flashhopper", "flashhopper-page1", "flashhopper-page64", "sdpa"]
    assert [p.name for p in decode.prefill_providers()] == ["flashhopper-dense", "flashhopper",
                                                           "flashhopper-page64"]
    assert [p.page_size for p in decode.prefill_providers((1, 16))] == [0, 0, 1, 16]


def test_dense_prefill_is_the_same_attention(monkeypatch):
    """flash_attn_func over the contiguous keys, causal bottom-right, is the cache calls' attention for a
    chunk of queries after cached tokens (with GQA)."""
    from flashhopper import interface

    seen, real = [], interface.flash_attn_func

    def reference_dense(q, k, v, **kw):
        seen.append(kw)
        return real(q, k, v, backend="reference", **kw)

    monkeypatch.setattr(interface, "flash_attn_func", reference_dense)
    point = decode.DecodePoint(2, 48, 8, 4, 2, 64)  # 8 queries after 40 cached tokens
    x = decode.decode_inputs(point, torch.bfloat16, "cpu", count=1)[0]
    provider = decode.dense_prefill()
    assert provider.name == decode.DENSE == "flashhopper-dense" and provider.page_size == 0
    got = provider.make(x, point)()
    assert seen == [{"causal": True}]
    torch.testing.assert_close(got, _want(x), rtol=0, atol=0)


# --- the timing loop with fake providers (capture and timing patched) ---


class Clock:
    """Fake time: each fake call advances it by its provider's cost; replay_ms reads the walk's
    advance."""

    def __init__(self):
        self.now = 0.0

    def replay_ms(self, walk):
        start = self.now
        walk()
        return self.now - start


def _fake(name, clock, cost_ms, scale=1.0, seen=None, fail=None):
    """A provider whose calls cost `cost_ms` of fake time and return q times `scale`."""

    def make(x, point):
        if fail:
            raise RuntimeError(f"{fail}\ndetails")
        if seen is not None:
            seen.append((name, x.q))

        def call():
            clock.now += cost_ms
            return x.q * scale

        return call

    return decode.DecodeProvider(name, make)


def _fake_capture(fail_for=(), differ_for=()):
    """capture() as on a GPU, without one: the walk runs the calls; `fail_for` providers' captures
    raise, `differ_for` providers' replays return other outputs."""

    def capture(calls):
        outs = [call() for call in calls]
        name = capture.current
        if name in fail_for:
            raise RuntimeError("operation not permitted when stream is capturing")
        if name in differ_for:
            outs = [o + 1 for o in outs]
        return lambda: [call() for call in calls], outs

    capture.current = None
    return capture


@pytest.fixture
def fake_gpu(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(decode, "replay_ms", clock.replay_ms)
    fake = _fake_capture(fail_for=("fa4",), differ_for=("odd",))
    real_prepare = decode.prepare

    def prepare(provider, *a, **kw):
        fake.current = provider.name
        return real_prepare(provider, *a, **kw)

    monkeypatch.setattr(decode, "capture", fake)
    monkeypatch.setattr(decode, "prepare", prepare)
    monkeypatch.setattr(decode, "copy_rate", lambda: {"bytes": 2**30, "moved_bytes": 2**31, "ms": 0.5,
                                                      "repeats": 10, "bytes_per_s": 4e12})
    monkeypatch.setattr(runner.torch.cuda, "get_device_name", lambda: "fake GPU")
    return clock


def test_run_point_times_graphs_takes_turns_and_falls_back_to_eager(fake_gpu):
    seen = []
    provs = [_fake("flashhopper", fake_gpu, 0.010, seen=seen), _fake("fa4", fake_gpu, 0.020, seen=seen),
             _fake("sdpa", fake_gpu, 0.008, scale=1.5, seen=seen),
             _fake("broken", fake_gpu, 1.0, fail="no kernel")]
    row = decode.run_decode_point(SMALL, provs, 4e12, device="cpu", rounds=2)
    n = SMALL.caches
    # each provider makes one call per cache, each cache its own q, the same caches for every provider
    assert [s[0] for s in seen] == ["flashhopper"] * n + ["fa4"] * n + ["sdpa"] * n
    qs = [s[1] for s in seen]
    assert len({q.data_ptr() for q in qs[:n]}) == n
    assert all(a is b for a, b in zip(qs[:n], qs[n:2 * n], strict=True))
    assert row["us"]["flashhopper"] == pytest.approx(10.0) and row["us"]["sdpa"] == pytest.approx(8.0)
    assert row["us"]["fa4"] == pytest.approx(20.0) and row["us"]["broken"] is None
    frac = SMALL.kv_bytes / 10e-6 / 4e12
    assert row["fraction"]["flashhopper"] == pytest.approx(frac)
    assert row["ratio"] == pytest.approx(0.8)  # against sdpa, the faster peer
    assert row["timing"] == {"flashhopper": "graph", "fa4": "eager", "sdpa": "graph"}
    assert row["eager"] == {"fa4": "graph capture failed: RuntimeError: operation not permitted when stream "
                                   "is capturing"}
    assert row["errors"] == {"broken": "RuntimeError: no kernel"}
    assert row["spread"]["flashhopper"] == pytest.approx([10.0, 10.0]) and row["rounds"] == 2
    assert row["caches"] == n and row["rotation_bytes"] == n * SMALL.kv_bytes and row["skipped"] is None
    agreement = row["agreement"]
    assert agreement["against"] == "sdpa"
    assert agreement["max_rel_diff"] == pytest.approx({"flashhopper": 1 / 3, "fa4": 1 / 3}, abs=1e-2)
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        decode.run_decode_point(SMALL, provs, 4e12, device="cpu", rounds=0)


def test_a_replay_that_differs_from_the_eager_call_is_timed_eagerly(fake_gpu):
    row = decode.run_decode_point(SMALL, [_fake("odd", fake_gpu, 0.01)], 4e12, device="cpu", rounds=1)
    assert row["timing"] == {"odd": "eager"}
    assert row["eager"]["odd"].startswith("graph capture failed: RuntimeError: the replay's output differs")
    assert row["us"]["odd"] == pytest.approx(10.0) and row["ratio"] is None and row["agreement"] is None


def test_run_bench_table_summary_and_json(fake_gpu, tmp_path):
    provs = [_fake("flashhopper", fake_gpu, 0.010), _fake("fa4", fake_gpu, 0.020),
             _fake("sdpa", fake_gpu, 0.008)]
    points = [SMALL, decode.DecodePoint(2, 640, 1, 8, 2, 64), decode.DecodePoint(256, 131072, 1, 32, 8, 128)]
    out, path = io.StringIO(), tmp_path / "decode.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decode, "run_decode_point", functools.partial(decode.run_decode_point, device="cpu"))
        report = decode.run_decode_bench(points, json_path=str(path), providers=provs, out=out, rounds=1)
    text = out.getvalue()
    lines = text.splitlines()
    assert lines[0] == ("fake GPU, torch " + torch.__version__ + ", bf16; device-to-device copy of 1.0 GiB: "
                        "4.00 TB/s (2 x 1.0 GiB moved per copy: read + write; median of 10)")
    header = lines.index(decode.format_header(["flashhopper", "fa4", "sdpa"]))
    assert "fh/best" in lines[header] and "flashhopper us" in lines[header]
    first = lines[header + 1].split()
    frac = SMALL.kv_bytes / 10e-6 / 4e12
    assert first[:7] == ["2", "2048", "4", "4:2", "64", "50", "2.0"]
    assert first[7:] == ["10.0", f"{frac:.2f}", "20.0*", f"{frac / 2:.2f}", "8.0", f"{frac * 1.25:.2f}",
                         "0.80"]
    assert len(lines[header + 1]) == len(lines[header])
    assert lines[header + 2] == ("    fa4: graph capture failed: RuntimeError: operation not permitted when "
                                 "stream is capturing")
    skipped = lines.index("    skipped: its caches would not fit: 4 caches x 128.0 GiB = 512.0 GiB > "
                          "40.0 GiB")
    assert lines[skipped - 1].split()[:7] == ["256", "131072", "1", "32:8", "128", "4", "131072.0"]
    assert lines[skipped - 1].split()[7:] == ["-", "-", "-", "-", "-", "-", "-"]
    assert len(lines[skipped - 1]) == len(lines[header])
    assert "* = timed eagerly" in text and "fh/best = flashhopper / max(fa4, sdpa)" in text
    assert "geomean flashhopper / max(fa4, sdpa): 0.800 over 2 of 3 points" in text
    assert "lowest: 0.800 at " in text and "flashhopper reads its KV at" in text
    stored = json.loads(path.read_text())
    assert stored["benchmark"] == "decode" and stored["providers"] == ["flashhopper", "fa4", "sdpa"]
    assert stored["copy"]["bytes_per_s"] == 4e12 and "2 x the copied size" in stored["byte_convention"]
    assert stored["rotation"] == {"min_bytes": 100 * 2**20, "min_caches": 4, "max_bytes": 40 * 2**30}
    assert [r["kv_bytes"] for r in stored["results"]] == [p.kv_bytes for p in points]
    assert stored["results"][0]["timing"]["fa4"] == "eager" and stored["results"][2]["skipped"]
    assert stored["summary"]["geomean_ratio"] == pytest.approx(0.8)
    assert stored["summary"]["points"] == 3 and stored["summary"]["points_run"] == 2
    assert report["results"][1]["caches"] == decode.DecodePoint(2, 640, 1, 8, 2, 64).caches


def test_allocations_draw_fresh_caches_each_round_and_report_percentiles(fake_gpu):
    """--allocations: every round new caches and q for every provider (the previous ones freed, the
    spacers held), each provider prepared and timed once a round in an order rotated per round;
    p10 / p50 / p90 of the fractions, and the spread check in the summary."""
    seen, costs = [], [0.010, 0.012, 0.010, 0.011]  # one per round

    def make(x, point):
        cost = costs[sum(1 for s in seen if s[0] == "flashhopper") // SMALL.caches]
        seen.append(("flashhopper", x.q))

        def call():
            fake_gpu.now += cost
            return x.q

        return call

    provs = [decode.DecodeProvider("flashhopper", make), _fake("sdpa", fake_gpu, 0.008, seen=seen)]
    row = decode.run_decode_point(SMALL, provs, 4e12, device="cpu", rounds=4, allocations=True)
    n = SMALL.caches
    names = [s[0] for s in seen]
    # the order rotates: (flashhopper, sdpa), (sdpa, flashhopper), ...
    assert names == (["flashhopper"] * n + ["sdpa"] * n + ["sdpa"] * n + ["flashhopper"] * n) * 2
    assert len({id(s[1]) for s in seen}) == 4 * n  # a provider's caches are fresh each round
    assert row["allocations"] == 4 and row["rounds"] == 4
    pct = row["percentiles"]
    assert set(pct) == {"flashhopper", "sdpa"} and pct["sdpa"]["p10"] == pytest.approx(pct["sdpa"]["p50"])
    assert pct["flashhopper"]["p10"] <= pct["flashhopper"]["p50"] <= pct["flashhopper"]["p90"]
    assert row["ratio"] is not None and row["timing"] == {"flashhopper": "graph", "sdpa": "graph"}
    summary = decode.summarize([row])
    assert summary["spread"]["points"] == 1
    widest = pct["flashhopper"]["p50"] / pct["flashhopper"]["p10"]
    assert summary["spread"]["widest"] == pytest.approx(widest)
    assert (summary["spread"]["wider_than_allowed"] != []) == (widest > 1.05)
    assert any(line.startswith("spread p50/p10 over allocations") for line in decode.format_summary(summary))
    plain = decode.run_decode_point(SMALL, provs[1:], 4e12, device="cpu", rounds=2)
    assert "percentiles" not in plain and "spread" not in decode.summarize([plain])


def _costing(provider, clock, cost_ms):
    """A real provider whose calls also cost `cost_ms` of fake time."""

    def make(x, point):
        call = provider.make(x, point)

        def timed():
            clock.now += cost_ms
            return call()

        return timed

    return dataclasses.replace(provider, make=make)


@pytest.fixture
def reference_kernels(monkeypatch):
    """flash_attn_with_kvcache and flash_attn_func as their float64 references, on the CPU."""
    from flashhopper import interface, kvcache

    real = interface.flash_attn_func
    monkeypatch.setattr(kvcache, "flash_attn_with_kvcache", functools.partial(_reference_kvcache, []))
    monkeypatch.setattr(interface, "flash_attn_func", lambda *a, **kw: real(*a, backend="reference", **kw))
    monkeypatch.setattr(decode, "MIN_ROTATION_BYTES", 1)  # 4 caches a point
    return monkeypatch


@pytest.mark.parametrize("allocations", [False, True])
def test_paged_providers_are_timed_and_agree(fake_gpu, reference_kernels, allocations):
    point = decode.DecodePoint(2, 40, 1, 4, 2, 64)
    provs = [_costing(decode.flashhopper_decode(), fake_gpu, 0.010),
             _costing(decode.flashhopper_paged(16), fake_gpu, 0.012),
             _costing(decode.flashhopper_paged(1), fake_gpu, 0.030),
             _costing(decode.sdpa_decode(), fake_gpu, 0.008)]
    row = decode.run_decode_point(point, provs, 4e12, device="cpu", rounds=2, allocations=allocations)
    assert row["caches"] == 4 and row["errors"] == {} and row["left_out"] == {}
    assert row["us"]["flashhopper-page16"] == pytest.approx(12.0)
    assert row["fraction"]["flashhopper-page16"] == pytest.approx(point.kv_bytes / 12e-6 / 4e12)
    assert row["paged"] == {
        "flashhopper-page16": {"page_size": 16, "time_over_contiguous": pytest.approx(1.2),
                               "pages_read": None},
        "flashhopper-page1": {"page_size": 1, "time_over_contiguous": pytest.approx(3.0), "pages_read": None}}
    assert row["ratio"] == pytest.approx(0.8)  # flashhopper over sdpa: the paged ones are no peers
    agreement = row["agreement"]
    assert agreement["against"] == "sdpa"
    diffs = agreement["max_rel_diff"]
    assert set(diffs) == {"flashhopper", "flashhopper-page16", "flashhopper-page1"}
    assert diffs["flashhopper-page16"] == diffs["flashhopper-page1"] == diffs["flashhopper"] < 0.02
    assert row["held_bytes"] == decode.held_bytes(point, [16, 1], together=not allocations)
    if allocations:
        assert set(row["percentiles"]) == {"flashhopper", "flashhopper-page16", "flashhopper-page1", "sdpa"}


@pytest.mark.parametrize(("allocations", "left_out"), [(False, ["flashhopper-page1"]), (True, [])])
def test_paged_providers_that_do_not_fit_are_left_out(fake_gpu, reference_kernels, allocations, left_out):
    """With every provider held for the point the second paged copy goes over the budget; one provider at a
    time (allocations), both fit."""
    point = decode.DecodePoint(2, 40, 1, 4, 2, 64)
    budget = decode.held_bytes(point, [1], together=True)  # page 1's caches and gather: the larger
    reference_kernels.setattr(decode, "MAX_ROTATION_BYTES", budget)
    provs = [_costing(decode.flashhopper_decode(), fake_gpu, 0.010),
             _costing(decode.flashhopper_paged(16), fake_gpu, 0.012),
             _costing(decode.flashhopper_paged(1), fake_gpu, 0.030)]
    row = decode.run_decode_point(point, provs, 4e12, device="cpu", rounds=1, allocations=allocations)
    assert list(row["left_out"]) == left_out and row["us"]["flashhopper-page16"] == pytest.approx(12.0)
    if left_out:
        assert row["left_out"]["flashhopper-page1"].startswith("its paged caches would not fit: the point")
        assert row["us"]["flashhopper-page1"] is None and row["errors"] == {}
        assert row["paged"]["flashhopper-page1"]["time_over_contiguous"] is None
        assert set(row["agreement"]["max_rel_diff"]) == {"flashhopper-page16"}  # against flashhopper
        out = io.StringIO()
        decode.print_notes(row, out)
        assert out.getvalue() == f"    flashhopper-page1: {row['left_out']['flashhopper-page1']}\n"
    assert row["held_bytes"] <= budget


def test_prefill_point(fake_gpu, reference_kernels):
    point = decode.DecodePoint(2, 48, 8, 4, 2, 64)  # 8 queries after 40 cached tokens
    provs = [_costing(decode.dense_prefill(), fake_gpu, 0.100),
             _costing(decode.flashhopper_decode(), fake_gpu, 0.105),
             _costing(decode.flashhopper_paged(16), fake_gpu, 0.125)]
    row = decode.run_prefill_point(point, provs, device="cpu", rounds=1)
    flops = decode.prefill_flops(point)
    assert row["flops"] == flops
    assert row["tflops"]["flashhopper-dense"] == pytest.approx(flops / 100e-6 / 1e12)
    assert row["speed_over_dense"] == {"flashhopper": pytest.approx(100 / 105),
                                       "flashhopper-page16": pytest.approx(0.8)}
    assert row["paged"]["flashhopper-page16"]["time_over_contiguous"] == pytest.approx(125 / 105)
    assert row["agreement"]["against"] == "flashhopper-dense"
    assert set(row["agreement"]["max_rel_diff"]) == {"flashhopper", "flashhopper-page16"}
    assert max(row["agreement"]["max_rel_diff"].values()) == 0  # the same float64 reference: bitwise
    assert "fraction" not in row and "ratio" not in row
    alloc = decode.run_prefill_point(point, provs, device="cpu", rounds=2, allocations=True)
    assert alloc["percentiles"]["flashhopper-page16"]["p50"] == pytest.approx(flops / 125e-6 / 1e12)


def test_run_bench_with_pages_and_prefill(fake_gpu, tmp_path):
    provs = [_fake("flashhopper", fake_gpu, 0.010),
             dataclasses.replace(_fake("flashhopper-page64", fake_gpu, 0.0102), page_size=64,
                                 info={"page_size": 64}, notes=lambda point: {"pages_read": "kernels"}),
             _fake("sdpa", fake_gpu, 0.008)]
    prefill_with = [_fake("flashhopper-dense", fake_gpu, 0.100), _fake("flashhopper", fake_gpu, 0.105),
                    dataclasses.replace(_fake("flashhopper-page64", fake_gpu, 0.120), page_size=64)]
    tiny = decode.DecodePoint(2, 128, 1, 4, 2, 64)
    prefill = [decode.DecodePoint(2, 192, 64, 4, 2, 64)]
    out, path = io.StringIO(), tmp_path / "decode.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decode, "MIN_ROTATION_BYTES", 1)
        for run in ("run_decode_point", "run_prefill_point"):
            mp.setattr(decode, run, functools.partial(getattr(decode, run), device="cpu"))
        report = decode.run_decode_bench([tiny], json_path=str(path), providers=provs, out=out, rounds=1,
                                         prefill=prefill, prefill_with=prefill_with)
    lines = out.getvalue().splitlines()
    assert "pageP/fh = flashhopper-pageP us / flashhopper us (paged time over contiguous" in lines[1]
    assert "flashhopper-page64: page_size 64" in lines
    names = ["flashhopper", "flashhopper-page64", "sdpa"]
    header = lines.index(decode.format_header(names, ["flashhopper-page64"]))
    assert lines[header].split()[-2:] == ["fh/best", "page64/fh"] and "flashhopper-page64 us" in lines[header]
    row = lines[header + 1]
    assert len(row) == len(lines[header]) and row.split()[-2:] == ["0.80", "1.020"]
    assert ("flashhopper-page64 / flashhopper time: geomean 1.020 over 1 points, at most 1.020 at 2 x 128 q1 "
            "heads 4:2 hdim 64; one query token: at most 1.020 (target <= 1.05: met); pages read: kernels"
            ) in lines
    start = next(i for i, line in enumerate(lines) if line.startswith("chunked prefill:"))
    assert "X/dense = flashhopper-dense us / X us (speed over the dense kernel, target >= 0.9" in lines[start]
    prefill_header = lines.index(decode.format_prefill_header([p.name for p in prefill_with]))
    assert prefill_header == start + 1  # the prefill page64 here has no info to print
    assert lines[prefill_header].split()[-2:] == ["fh/dense", "page64/dense"]
    assert "flashhopper-dense us" in lines[prefill_header] and "TF/s" in lines[prefill_header]
    prefill_row = lines[prefill_header + 1]
    assert len(prefill_row) == len(lines[prefill_header])
    assert prefill_row.split()[:6] == ["2", "64", "128", "4:2", "64", "4"]
    assert prefill_row.split()[-2:] == [f"{100 / 105:.3f}", f"{100 / 120:.3f}"]
    assert ("flashhopper-page64 / flashhopper-dense speed: geomean 0.833 over 1 points, lowest 0.833 at 2 x "
            "chunk 64 after 128 heads 4:2 hdim 64 (target >= 0.90: NOT met)") in lines
    assert any(line.startswith("flashhopper / flashhopper-dense speed: geomean 0.952") for line in lines)
    stored = json.loads(path.read_text())
    assert stored["providers"] == names and stored["paged"]["providers"] == ["flashhopper-page64"]
    assert stored["paged"]["targets_at_one_query"] == {"64": 1.05, "1": 1.15}
    paged = stored["results"][0]["paged"]["flashhopper-page64"]
    assert paged == {"page_size": 64, "time_over_contiguous": pytest.approx(1.02), "pages_read": "kernels"}
    assert stored["summary"]["paged"]["flashhopper-page64"]["met"] is True
    assert stored["prefill"]["providers"] == [p.name for p in prefill_with]
    first = stored["prefill"]["results"][0]
    assert first["flops"] == decode.prefill_flops(prefill[0])
    assert first["speed_over_dense"]["flashhopper-page64"] == pytest.approx(100 / 120)
    assert stored["prefill"]["summary"]["flashhopper-page64"]["met"] is False
    assert stored["prefill"]["summary"]["flashhopper"]["target"] is None
    assert report["prefill"]["results"][0]["caches"] == 4


def test_paged_summary():
    def row(q_len, ratio, page="flashhopper-page64", size=64, read="kernels"):
        return {"batch": 1, "context": 8192, "q_len": q_len, "heads_q": 32, "heads_k": 8, "hdim": 128,
                "paged": {page: {"page_size": size, "time_over_contiguous": ratio, "pages_read": read}}}

    rows = [row(1, 1.02), row(1, 1.04), row(4, 1.2), row(1, None, read=None)]
    found = decode.paged_summary(rows)["flashhopper-page64"]
    assert found["max"] == 1.2 and found["max_point"] == "1 x 8k q4 heads 32:8 hdim 128"
    assert found["q1_max"] == 1.04 and found["target"] == 1.05 and found["met"] is True  # one query token
    assert found["points_with_ratio"] == 3
    assert found["geomean"] == pytest.approx((1.02 * 1.04 * 1.2) ** (1 / 3))
    assert found["pages_read"] == ["kernels", "unknown"]
    page1 = decode.paged_summary([row(1, 1.2, "flashhopper-page1", 1, "gathered")])["flashhopper-page1"]
    assert page1["target"] == 1.15 and page1["met"] is False
    page16 = decode.paged_summary([row(1, 1.0, "flashhopper-page16", 16)])["flashhopper-page16"]
    assert page16["target"] is None and page16["met"] is None
    none = decode.paged_summary([row(1, None)])["flashhopper-page64"]
    assert decode._paged_line("flashhopper-page64", none) == ("flashhopper-page64: no point has its time "
                                                              "over flashhopper's")
    assert decode._paged_line("flashhopper-page1", page1).endswith("(target <= 1.15: NOT met); pages read: "
                                                                  "gathered")


def test_summary_without_peers():
    row = {"batch": 1, "context": 8192, "q_len": 1, "heads_q": 32, "heads_k": 8, "hdim": 128, "skipped": None,
           "ratio": None, "fraction": {"flashhopper": 0.5}}
    summary = decode.summarize([row])
    assert summary["geomean_ratio"] is None and summary["flashhopper_fraction"] == [0.5, 0.5]
    assert decode.format_summary(summary) == [
        "no point has a flashhopper / max(fa4, sdpa) ratio (peers not measured)",
        "flashhopper reads its KV at 0.50 to 0.50 of the copy rate"]
    assert math.isclose(decode.summarize([{**row, "ratio": 2.0}])["geomean_ratio"], 2.0)


# --- CLI ---


def test_cli_parses_decode():
    args = cli.build_parser().parse_args(["bench", "--decode"])
    assert args.decode and not args.quick and not args.varlen and args.rounds is None
    argv = ["bench", "--decode", "--quick", "--json", "d.json", "--rounds", "5"]
    args = cli.build_parser().parse_args(argv)
    assert args.decode and args.quick and args.json == "d.json" and args.rounds == 5
    assert not cli.build_parser().parse_args(["bench"]).decode


def test_cli_bench_decode_runs_the_points(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(decode, "run_decode_bench", lambda points, **kw: calls.append((points, kw)) or {})
    assert cli.main(["bench", "--decode"]) == 0
    assert cli.main(["bench", "--decode", "--quick", "--json", "d.json", "--rounds", "1"]) == 0
    assert cli.main(["bench", "--decode", "--hdim", "64", "--dtype", "fp16"]) == 0
    assert cli.main(["bench", "--decode", "--quick", "--allocations", "20"]) == 0
    (full, full_kw), (quick, quick_kw), (mha, mha_kw), (_, alloc_kw) = calls
    assert full == decode.decode_points() and full_kw == {"dtype": "bf16", "json_path": None, "rounds": 3,
                                                          "allocations": False, "pages": (), "prefill": []}
    assert quick == decode.decode_points(quick=True)
    assert quick_kw == {"dtype": "bf16", "json_path": "d.json", "rounds": 1, "allocations": False,
                        "pages": (), "prefill": []}
    assert alloc_kw == {"dtype": "bf16", "json_path": None, "rounds": 20, "allocations": True, "pages": (),
                        "prefill": []}
    assert {(p.heads_q, p.heads_k, p.hdim) for p in mha} == {(32, 32, 64)} and len(mha) == 12
    assert mha_kw["dtype"] == "fp16"


@pytest.mark.parametrize(("argv", "message"), [
    (["--dtype", "e4m3"], "--decode times bf16 or fp16 caches, not --dtype e4m3"),
    (["--dtype", "fp8"], "--decode times bf16 or fp16 caches, not --dtype fp8"),
    (["--bwd"], "--bwd does not apply to --decode (decode is inference only: there is no backward)"),
    (["--varlen"], "--varlen does not apply to --decode (a benchmark of its own: run one at a time)"),
    (["--ablation"], "--ablation does not apply to --decode"),
    (["--plot", "x.png"], "--plot does not apply to --decode"),
    (["--set", "pingpong=false"], "--set does not apply to --decode"),
    (["--seqlen", "1024"], "--seqlen does not apply to --decode (fixed by its batch x context points)"),
    (["--causal", "yes"], "--causal does not apply to --decode"),
    (["--hdim", "256"], "--decode --hdim [256] not benchmarked; choose from [64, 128]"),
    (["--rounds", "0"], "--rounds takes N >= 1, got 0"),
    (["--allocations", "20", "--rounds", "2"], "--allocations replaces --rounds"),
    (["--quick", "--hdim", "64"], "no decode point left: --quick is hdim 128 only"),
])
def test_cli_bench_decode_refuses_what_does_not_apply(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(decode, "run_decode_bench", lambda *a, **kw: pytest.fail("must not run"))
    assert cli.main(["bench", "--decode", *argv]) == 2  # before any GPU check: refused on a CPU machine too
    assert message in capsys.readouterr().err


def test_cli_bench_decode_without_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "--decode", "--quick"]) == 2
    assert capsys.readouterr().err == "flashhopper bench: needs a CUDA GPU (none visible)\n"


def test_cli_parses_pages_and_prefill():
    args = cli.build_parser().parse_args(["bench", "--decode", "--pages", "1", "16", "64", "--prefill"])
    assert args.pages == [1, 16, 64] and args.prefill
    args = cli.build_parser().parse_args(["bench", "--decode"])
    assert args.pages is None and not args.prefill


def test_cli_bench_decode_with_pages_and_prefill(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(decode, "run_decode_bench", lambda points, **kw: calls.append((points, kw)) or {})
    argv = ["bench", "--decode", "--quick", "--pages", "1", "16", "64", "--prefill", "--allocations", "20",
            "--json", "out.json"]
    assert cli.main(argv) == 0
    assert cli.main(["bench", "--decode", "--quick", "--pages", "64", "64", "1"]) == 0
    assert cli.main(["bench", "--decode", "--prefill", "--hdim", "128"]) == 0
    (points, kw), (_, twice), (_, hdim) = calls
    assert points == decode.decode_points(quick=True)
    assert kw == {"dtype": "bf16", "json_path": "out.json", "rounds": 20, "allocations": True,
                  "pages": (1, 16, 64), "prefill": decode.prefill_points()}
    assert twice["pages"] == (64, 1) and twice["prefill"] == []  # each page size once, in the order given
    assert hdim["prefill"] == decode.prefill_points() and hdim["pages"] == ()


@pytest.mark.parametrize(("argv", "message"), [
    (["--decode", "--pages", "0", "16"], "--pages takes page sizes >= 1, got [0]"),
    (["--decode", "--prefill", "--hdim", "64"], "--prefill times hdim 128 only, not --hdim [64]"),
    (["--pages", "16"], "--pages applies to --decode only"),
    (["--varlen", "--prefill"], "--prefill applies to --decode only"),
    (["--quick", "--pages", "64"], "--pages applies to --decode only"),
])
def test_cli_refuses_pages_and_prefill_where_they_do_not_apply(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(decode, "run_decode_bench", lambda *a, **kw: pytest.fail("must not run"))
    assert cli.main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err
