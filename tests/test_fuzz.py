"""`flashhopper fuzz`'s draws, on the CPU: stratified over every (dtype, hdim, mask, softcap,
deterministic, kind: dense, varlen, a contiguous or a paged KV cache), reproducible, within the
reference's memory, every case's reproducer parses back; the attention strata draw what they drew before
the decode strata. Decode cases run here too: through the reference backend, with the fuzz's checks
(the checks catch planted faults), and through the kernels' path with float64 stand-ins for the kernels
(tests/kvcache_kernels.py), which launches exactly the configs kernels_of counts."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess

import pytest
from kvcache_kernels import SMS, cpu_kernel_path, merge_stand_in, split_kernels, varlen_stand_in

import flashhopper
import flashhopper.hopper
from flashhopper.cli import build_parser
from flashhopper.config import FwdConfig
from flashhopper.fuzz import (
    _MAX_SCORES,
    DECODE_GQA,
    PAGE_SIZES,
    Case,
    Decode,
    _page_table,
    decode_kernels_reachable,
    draw,
    fuzz_parallel,
    kernels_of,
    reachable_kernels,
    run,
    strata,
)
from flashhopper.hopper import runtime
from flashhopper.plan import dispatched_kernels

FULL = os.environ.get("FH_TEST_FULL") == "1"

# sha256 of the JSON of draws 0-999 of seeds 0 and 7 as the fuzz drew them before its decode strata
ATTENTION_DRAWS = "be647e81c058c372aceb9aa84a288319c9e10c2e22c195d334dc417e14b67827"


def _stratum(c: Case) -> tuple:
    return c.dtype, c.hdim, c.mask, c.softcap, c.deterministic, c.kind


def _check_decode_bounds(c: Case) -> None:
    """A decode case the call accepts (kvcache.py's contract) within the reference's memory."""
    d = c.decode
    assert (c.hq, c.hk) in DECODE_GQA and 1 <= c.b <= 8 and c.sq >= 1 and c.layout == "bshd"
    assert len(d.cache_seqlens) == c.b and c.sk == max(d.cache_seqlens) + d.new
    assert all(n + d.new <= d.capacity for n in d.cache_seqlens)
    assert c.hq * c.sq * c.sk <= _MAX_SCORES
    assert not d.leftpad or all(0 <= left <= n for left, n in zip(d.leftpad, d.cache_seqlens, strict=True))
    if d.page_size:
        assert d.page_size in PAGE_SIZES and d.capacity % d.page_size == 0 and not d.batch_idx
        assert d.cache_rows >= c.b * d.capacity // d.page_size
    else:
        assert d.cache_rows >= c.b
        assert not d.batch_idx or (len(set(d.batch_idx)) == c.b and max(d.batch_idx) < d.cache_rows)


def test_draws_are_stratified_reproducible_and_bounded():
    table = strata()
    assert table == strata("attention") + strata("decode")
    cases = [draw(i, seed=7) for i in range(2 * len(table))]
    assert {_stratum(c) for c in cases} == set(table)
    assert cases == [draw(i, seed=7) for i in range(2 * len(table))]
    assert cases != [draw(i, seed=8) for i in range(2 * len(table))]
    for c in cases:
        assert Case.from_json(c.to_json()) == c
        assert c.hq % c.hk == 0
        if c.decode is not None:
            _check_decode_bounds(c)
            continue
        assert c.varlen or c.b * c.hq * c.sq * c.sk <= _MAX_SCORES  # (varlen: per sequence, below)
        assert c.layout != "packed" or (c.sq == c.sk and c.hq == c.hk)
        if c.varlen:  # every sequence within the reference's memory, seqused within each
            assert all(c.hq * lq * lk <= _MAX_SCORES for lq, lk in c.seqlens)
            assert all(0 <= uq <= lq and 0 <= uk <= lk
                       for (lq, lk), (uq, uk) in zip(c.seqlens, c.seqused or c.seqlens, strict=True))


def test_the_attention_strata_draw_as_before_the_decode_strata():
    """--strata attention: the same cases for the same seed, printed the same (no "decode" key)."""
    text = "".join(draw(i, seed=s, group="attention").to_json() for s in (0, 7) for i in range(1000))
    assert hashlib.sha256(text.encode()).hexdigest() == ATTENTION_DRAWS
    assert "decode" not in json.loads(draw(3, seed=0).to_json())
    with pytest.raises(ValueError, match="strata group"):
        strata("kvcache")


def test_the_fp8_strata_are_the_attention_groups_fp8_ones():
    """--strata fp8: every FP8 stratum of the attention group, nothing else; its kernels are the dispatched
    FP8 forwards."""
    fp8 = strata("fp8")
    assert fp8 == [s for s in strata("attention") if s[0] == "e4m3"] and len(fp8) == 5 * 4 * 2
    assert {draw(i, seed=0, group="fp8").dtype for i in range(len(fp8))} == {"e4m3"}
    assert {c.dtype for c in reachable_kernels("fp8")} == {"e4m3"}


def test_the_shards_draw_from_the_same_strata(monkeypatch):
    """fuzz_parallel's shard command lines parse as the CLI's, with the run's strata and switches."""
    commands = []

    class Started(Exception):
        pass

    def popen(cmd, **kwargs):
        commands.append(cmd)
        raise Started

    monkeypatch.setattr(subprocess, "Popen", popen)
    with pytest.raises(Started):
        fuzz_parallel(10, 3, jobs=2, backward=False, group="decode", experimental=True)
    args = build_parser().parse_args(commands[0][3:])
    assert (args.cases, args.seed, args.strata, args.experimental, args.no_bwd, args.shard) == \
        (10, 3, "decode", True, True, "0/2")
    assert build_parser().parse_args(["fuzz"]).strata == "all"


def test_decode_draws_cover_what_the_call_takes():
    """Over two rounds of the decode strata: every page size, GQA ratio and query length class, appends,
    cache_batch_idx, cache_leftpad, both num_splits kinds, pack_gqa hints, no LSE, a preallocated out,
    the decode tile; item lengths of 0, 1 and page boundaries +-1."""
    cases = [draw(i, seed=1, group="decode") for i in range(2 * len(strata("decode")))]
    decodes = [c.decode for c in cases]
    assert {d.page_size for d in decodes} == {0, *PAGE_SIZES}
    assert {(c.hq, c.hk) for c in cases} == set(DECODE_GQA)
    assert {c.sq == 1 for c in cases} == {True, False} and max(c.sq for c in cases) > 16
    assert {bool(d.new) for d in decodes} == {True, False}
    for name in ("batch_idx", "leftpad", "out", "return_lse", "decode_tile"):
        assert {bool(getattr(d, name)) for d in decodes} == {True, False}, name
    assert {d.num_splits > 0 for d in decodes} == {True, False}
    assert {d.pack_gqa for d in decodes} == {None, True, False}
    lengths = {n for d in decodes for n in d.cache_seqlens}
    assert {0, 1} <= lengths
    for page in (16, 64, 128, 256):
        assert lengths & {page * k + e for k in range(1, 4096 // page + 1) for e in (-1, 1)}, page
    assert not any(d.split_in_kernel for d in decodes)  # its opt-in drawn with --experimental only


def test_experimental_only_adds_the_split_in_kernel():
    n = 2 * len(strata("decode"))
    plain, experimental = ([draw(i, seed=2, group="decode", experimental=e) for i in range(n)]
                           for e in (False, True))
    assert any(c.decode.split_in_kernel for c in experimental)
    unsplit = [dataclasses.replace(c, decode=dataclasses.replace(c.decode, split_in_kernel=False))
               for c in experimental]
    assert unsplit == plain


def test_page_tables_are_shuffled_with_garbage_past_the_pages_in_use():
    paged = [c for c in (draw(i, seed=4, group="decode") for i in range(320)) if c.decode.page_size]
    shuffled, garbage = 0, 0
    for c in paged:
        d = c.decode
        table = _page_table(c)
        assert table == _page_table(c) and len(table) == c.b
        used = [row[:-(-(n + d.new) // d.page_size)] for row, n in zip(table, d.cache_seqlens, strict=True)]
        flat = [page for row in used for page in row]
        assert len(set(flat)) == len(flat) and all(0 <= page < d.cache_rows for page in flat)
        for i, row in enumerate(table):  # past the pages in use: -1, far past the cache, or a page
            assert len(row) == d.capacity // d.page_size
            assert all(page in (-1, 1 << 30) or 0 <= page < d.cache_rows for page in row[len(used[i]):])
            garbage += sum(page in (-1, 1 << 30) for page in row[len(used[i]):])
        shuffled += any(b != a + 1 for row in used for a, b in zip(row, row[1:], strict=False))
    assert shuffled > len(paged) // 2 and garbage


def test_a_thousand_cases_reach_most_dispatched_kernels():
    hit = set().union(*(kernels_of(draw(i, seed=0), backward=True) for i in range(1000)))
    reachable = set(dispatched_kernels())
    assert hit <= reachable_kernels()
    assert len(hit & reachable) >= 0.8 * len(reachable), (len(hit & reachable), len(reachable))


@pytest.mark.parametrize("experimental,share", [(False, 0.75), (True, 0.6)])
def test_decode_cases_reach_most_decode_kernels(experimental, share):
    """Every config a decode case counts is one decode_kernels_reachable lists (the denominator of the
    count), and 8000 decode cases reach most of them (paged configs of each page size, the decode tile,
    with --experimental the split inside the kernel, the merge kernels, the split kernel causal over packed
    tokens: 240 configs, one a causal case of 2-16 tokens, which is one draw in 13)."""
    hit = set().union(*(kernels_of(draw(i, seed=0, group="decode", experimental=experimental), backward=False)
                        for i in range(8000)))
    reachable = decode_kernels_reachable(experimental)
    assert hit <= reachable
    assert len(hit) >= share * len(reachable), (len(hit), len(reachable))
    assert reachable_kernels("decode", experimental=experimental) == reachable
    assert reachable_kernels("all", backward=False) == set(dispatched_kernels(backward=False)) | \
        decode_kernels_reachable()


def test_decode_cases_pass_on_the_reference_backend():
    """The fuzz's decode run on the CPU, backend="reference": the float64 reference with the same append
    passes the checks (the inputs, the NaN in unused slots, the page tables, the checks' own indexing)."""
    cases = [draw(i, seed=0, group="decode") for i in range(0, 160 if FULL else 80, 5)]
    assert {c.kind for c in cases} == {"kvcache", "paged"}
    for c in cases:
        assert run(c, device="cpu", backend="reference") is None, c.to_json()


# pages of 16, an item whose last pages are garbage entries, an append across a page boundary
FAULT_CASE = Case("bf16", 64, "causal", 0.0, False, 2, 3, 49, 8, 2, (-1, -1), "bshd", None, 1.0, 11,
                  decode=Decode(cache_seqlens=(5, 46), new=3, page_size=16, capacity=64, cache_rows=9))


def _planted(fault: str):
    """flash_attn_with_kvcache on the reference backend, then one fault planted in what it did."""
    call = flashhopper.flash_attn_with_kvcache

    def faulty(q, k_cache, v_cache, **kw):
        out, lse = call(q, k_cache, v_cache, **kw)
        if fault == "stray_write":  # the first cache slot no item uses (NaN) written
            flat = k_cache.view(-1)
            flat[flat.isnan().nonzero()[0, 0]] = 0.5
        elif fault == "out_off":
            out[1, -1, 0] += 0.25
        elif fault == "unwritten":
            out[0, 0, -1, -1] = float("nan")
        elif fault == "lse_off":
            lse[0] += 1e-3
        return out, lse

    return faulty


def test_the_fault_case_passes():
    assert run(FAULT_CASE, device="cpu", backend="reference") is None


@pytest.mark.parametrize("fault,message", [("stray_write", "k_cache: entries besides the append changed"),
                                           ("out_off", "item 1: out rows 0+: max error"),
                                           ("unwritten", "item 0: out: NaN"),
                                           ("lse_off", "item 0: LSE error")])
def test_decode_checks_catch_planted_faults(monkeypatch, fault, message):
    monkeypatch.setattr(flashhopper, "flash_attn_with_kvcache", _planted(fault))
    problem = run(FAULT_CASE, device="cpu", backend="reference")
    assert problem is not None and problem.startswith(message), problem


def test_decode_checks_catch_a_missing_append(monkeypatch):
    call = flashhopper.flash_attn_with_kvcache

    def unappended(q, k_cache, v_cache, k=None, v=None, **kw):
        out = call(q, k_cache, v_cache, k=k, v=v, **kw)
        k_cache[kw["page_table"][1, 3].long(), 0] = float("nan")  # item 1's last new key (position 48)
        return out

    monkeypatch.setattr(flashhopper, "flash_attn_with_kvcache", unappended)
    assert run(FAULT_CASE, device="cpu", backend="reference") == "item 1: the appended k"


@pytest.fixture()
def kernel_path(monkeypatch):
    """flash_attn_with_kvcache's kernel path on the CPU (tests/kvcache_kernels.py), every config it asks
    for recorded: the varlen forward's (runtime.varlen_config, as forward_varlen asks), the split kernel's
    (runtime.get_kernel), the merge kernel's (combine_splits). runtime.poison restored after."""
    cpu_kernel_path(monkeypatch)
    monkeypatch.setattr(runtime, "poison", False)
    asked = []

    def forward_varlen(q, k, v, cu_q, starts, max_q, used_q, used_k, scale, causal, window, softcap, **kw):
        dv = v.shape[-1] if v.shape[-1] != q.shape[-1] else 0
        page_size = kw.get("page_size", 0) if kw.get("page_table") is not None else 0
        asked.append(runtime.varlen_config(q.dtype, q.shape[-1], causal, window, softcap > 0.0, dv,
                                           kw.get("decode", False), page_size)[0])
        return varlen_stand_in(q, k, v, cu_q, starts, max_q, used_q, used_k, scale, causal, window, softcap,
                               **kw)

    def combine_splits(cfg, *args):
        asked.append(cfg)
        merge_stand_in(cfg, *args)

    monkeypatch.setattr(flashhopper.hopper, "forward_varlen", forward_varlen)
    monkeypatch.setattr(flashhopper.hopper, "combine_splits", combine_splits)
    launched = split_kernels(monkeypatch)
    return asked, launched


def test_decode_cases_on_the_kernel_path_launch_what_kernels_of_counts(kernel_path):
    """Decode cases (--experimental: the split inside the kernel too) through the kernels' path with
    float64 stand-ins for the kernels pass the fuzz's checks, and launch exactly the configs kernels_of
    plans for them on the host. Cases whose split kernel model walks too many tiles are left out."""
    asked, launched = kernel_path
    ran, configs = [], set()
    draws = 160 if FULL else 72  # (CI: ~40 s of float64 stand-ins)
    for i in range(draws):
        c = draw(i, seed=5, group="decode", experimental=True)
        if c.b * c.hq * max(1, c.decode.capacity // 128) > 1500:
            continue
        asked.clear()
        launched.clear()
        assert run(c, device="cpu", backend="auto") is None, c.to_json()
        launches = set(asked) | {cfg for cfg, *_ in launched}
        assert launches == kernels_of(c, backward=False, sms=SMS), c.to_json()
        ran.append(c)
        configs |= launches
    assert len(ran) > draws * 3 // 8 and {c.kind for c in ran} == {"kvcache", "paged"}
    attention = [cfg for cfg in configs if isinstance(cfg, FwdConfig)]
    assert len(attention) < len(configs)  # merge kernels
    assert any(cfg.page_size for cfg in attention) and any(cfg.split_kv for cfg in attention)
    assert any(cfg.num_consumer_wg == 1 for cfg in attention)  # the decode tile
    assert any(cfg.causal or cfg.local for cfg in attention)
