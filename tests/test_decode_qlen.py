"""flash_attn_with_kvcache with 2 to 16 query tokens an item packed into the split kernel's rows
(kvcache._qlen_call; causal: FwdConfig.token_rows) on the CPU: the split kernel's float64 model, the varlen
kernel's and the merge kernel's stand-ins (tests/kvcache_kernels.py), against backend="reference" (outputs,
LSEs, the appended caches); the launches the call makes; the layout and the calls with the path switched
off (the varlen kernel over every query head)."""

from __future__ import annotations

import itertools

import pytest
import torch
from kvcache_kernels import cpu_kernel_path, merge_stand_in, split_kernels, varlen_stand_in
from test_decode_launches import Launches

import flashhopper.hopper
from flashhopper import kvcache, plan, splitkv, validation
from flashhopper.hopper import runtime

S_CACHE = 700
D = 64


@pytest.fixture()
def kernels(monkeypatch):
    """The kernels' path on the CPU with the opt-in set: (the split kernel's launches as (cfg, splits,
    chunk), the varlen stand-in's calls as their `causal`, `decode`, the merge stand-in's calls)."""
    cpu_kernel_path(monkeypatch)
    monkeypatch.setattr(runtime, "poison", True)  # every buffer of the call NaN first: none left unwritten
    launched, varlen, merges = split_kernels(monkeypatch), [], []

    def varlen_recorded(*args, causal=None, decode=False, **kwargs):
        causal = args[9] if causal is None else causal
        varlen.append((causal, decode))
        return varlen_stand_in(*args[:9], causal, *args[10:], decode=decode, **kwargs)

    monkeypatch.setattr(flashhopper.hopper, "forward_varlen", varlen_recorded)
    monkeypatch.setattr(flashhopper.hopper, "combine_splits",
                        lambda *args: merges.append(args) or merge_stand_in(*args))
    monkeypatch.setenv(validation.DECODE_QLEN_OPT_IN, "1")
    return launched, varlen, merges


def _run(lens, *, s, hq, hk, s_new=0, idx=None, left=None, page_size=0, b_cache=None, out=False,
         return_lse=True, seed=0, **kw):
    """One call on the reference backend and on the kernels' path, on the same inputs: both results and
    caches compared (bf16 roundings apart); returns the kernels' result."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16)  # noqa: E731
    b = len(lens)
    q = rand(b, s, hq, D)
    call = dict(kw, cache_seqlens=torch.tensor(lens, dtype=torch.int32), return_lse=return_lse)
    if s_new:
        call["k"], call["v"] = rand(b, s_new, hk, D), rand(b, s_new, hk, D)
    if idx is not None:
        call["cache_batch_idx"] = torch.tensor(idx, dtype=torch.int32)
    if left is not None:
        call["cache_leftpad"] = torch.tensor(left, dtype=torch.int32)
    if page_size:  # shuffled pages, a few spare
        per_item = -(-S_CACHE // page_size)
        call["page_table"] = torch.randperm(b * per_item + 3, generator=g)[:b * per_item].to(torch.int32)
        call["page_table"] = call["page_table"].view(b, per_item)
        shape = (b * per_item + 3, page_size, hk, D)
    else:
        shape = (b_cache or b, S_CACHE, hk, D)
    caches = [rand(*shape) for _ in range(2)]
    results = []
    for backend in ("reference", "auto"):
        k_cache, v_cache = (c.clone() for c in caches)
        given = torch.full((b, s, hq, D), float("nan"), dtype=torch.bfloat16) if out else None
        got = kvcache.flash_attn_with_kvcache(q, k_cache, v_cache, out=given, backend=backend, **call)
        o = got[0] if return_lse else got
        if out:
            assert o is given
        results.append((got, k_cache, v_cache))
    (want, *want_caches), (got, *got_caches) = results
    if return_lse:
        torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
        assert got[1].shape == (b, hq, s) and got[1].dtype == torch.float32
    else:
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert all(torch.equal(a, c) for a, c in zip(got_caches, want_caches, strict=True))
    return got


def _taken(kernels, causal=True, splits=None):
    """The call ran packed: one split kernel launch (with `splits` where given; causal: its token_rows
    config), no varlen call, the merge where the keys split."""
    launched, varlen, merges = kernels
    assert len(launched) == 1, launched
    cfg, n = launched[0][:2]
    assert cfg.token_rows == cfg.causal == causal, cfg
    assert splits is None or n == splits, n
    assert varlen == [], varlen
    assert len(merges) == (n > 1), merges
    launched.clear()
    varlen.clear()
    merges.clear()
    return n


@pytest.mark.parametrize("s", [2, 4, 16])
@pytest.mark.parametrize("hq,hk", [(2, 2), (8, 2), (16, 2)])  # GQA 1, 4, 8
@pytest.mark.parametrize("s_new", [0, "s"])
def test_tokens_and_groups(kernels, s, hq, hk, s_new):
    """Lengths shorter than the tokens (0 and 1: rows that see no key), one past, a long one, the capacity;
    with and without an append of s tokens (0 + s: every key new)."""
    s_new = s if s_new == "s" else 0
    lens = [0, 1, s + 1 - s_new, 650, S_CACHE - s_new]
    _run(lens, s=s, hq=hq, hk=hk, s_new=s_new, causal=True)
    _taken(kernels)


@pytest.mark.parametrize("s", [2, 4, 16])
@pytest.mark.parametrize("num_splits", [0, 1, 5])
def test_chunk_boundaries(kernels, s, num_splits):
    """The keys token 0 sees (L - s + 1) ending one before, on and one past a chunk's end (num_splits 5:
    chunks of 256): the tokens' diagonal across it."""
    chunk = splitkv._chunks(S_CACHE, 5)[1]
    lens = [chunk - 1 + s - 1, chunk + s - 1, chunk + 1 + s - 1, 2 * chunk + s - 1, 2 * chunk - 1]
    _run(lens, s=s, hq=8, hk=2, causal=True, num_splits=num_splits)
    splits = _taken(kernels, splits=None if num_splits == 0 else min(num_splits, 3))
    assert splits > 1 or num_splits == 1


@pytest.mark.parametrize("s_new", [0, 1, 4])
def test_batch_idx_and_leftpad(kernels, s_new):
    """cache_batch_idx (rows permuted, spare rows) and cache_leftpad: the keys from the kernel's key
    starts."""
    _run([50, 10, 600, 3], s=4, hq=8, hk=2, s_new=s_new, b_cache=6, idx=[4, 0, 2, 5], causal=True)
    _taken(kernels)
    _run([50, 10, 600, 3], s=4, hq=8, hk=2, s_new=s_new, b_cache=6, idx=[4, 0, 2, 5], left=[3, 0, 500, 2],
         causal=True, num_splits=3)
    _taken(kernels)
    _run([50, 600], s=3, hq=4, hk=4, s_new=s_new, left=[7, 129], causal=True)  # leftpad alone, GQA 1
    _taken(kernels)


@pytest.mark.parametrize("page_size", [16, 64, 7])
@pytest.mark.parametrize("s", [2, 16])
def test_paged(kernels, page_size, s):
    """Paged caches: pages the kernel reads (16, 64), and pages of 7 gathered first (then as a contiguous
    cache)."""
    lens = [0, 1, 15, 16, 17, 300, S_CACHE - s]
    _run(lens, s=s, hq=8, hk=2, s_new=s, page_size=page_size, causal=True)
    _taken(kernels)
    _run(lens[:3] + [S_CACHE], s=s, hq=8, hk=2, page_size=page_size, causal=True, num_splits=4)
    _taken(kernels)


def test_no_mask(kernels):
    """Without a mask every token sees every key: the split kernel's unmasked config."""
    for num_splits in (0, 1):
        _run([0, 1, 300, S_CACHE - 4], s=4, hq=8, hk=2, s_new=4, causal=False, num_splits=num_splits)
        _taken(kernels, causal=False)
    _run([0, 1, 300, S_CACHE], s=4, hq=8, hk=2, causal=False, page_size=16)
    _taken(kernels, causal=False)


@pytest.mark.parametrize("return_lse", [True, False])
def test_given_output_softcap_and_lse(kernels, return_lse):
    """out= written in place (returned), softcap, the LSE returned or not; pack_gqa=False is a hint the
    call does not need (the rows are packed all the same)."""
    _run([0, 1, 300], s=4, hq=8, hk=2, s_new=4, out=True, softcap=5.0, causal=True, return_lse=return_lse)
    _taken(kernels)
    _run([0, 1, 300], s=5, hq=8, hk=2, out=True, causal=True, pack_gqa=False, return_lse=return_lse)
    _taken(kernels)


def test_other_calls_keep_their_path(kernels):
    """One query token, more than 16, a window, packed queries: not this path (opt-in set)."""
    launched, varlen, merges = kernels
    _run([5, 600], s=1, hq=8, hk=2, causal=True)
    assert len(launched) == 1 and not varlen  # one token's decode: the split kernel alone
    launched.clear()
    merges.clear()
    for s, window in ((17, (-1, -1)), (4, (100, 0))):
        _run([5, 600], s=s, hq=8, hk=2, causal=True, window_size=window)
        assert not launched and varlen == [(True, False)]
        varlen.clear()


def test_opt_in_off_keeps_the_layout_and_the_call(monkeypatch):
    """The path switched off (validation.DECODE_QLEN_GPU_VERIFIED False, the opt-in unset): splitkv.plan
    leaves several query tokens unrearranged, and the call is the varlen kernel over every query head,
    causal, on its own walk."""
    monkeypatch.setattr(validation, "DECODE_QLEN_GPU_VERIFIED", False)
    monkeypatch.delenv(validation.DECODE_QLEN_OPT_IN, raising=False)
    assert not validation.decode_qlen_enabled()
    for s in (2, 4, 16):
        layout = splitkv.plan(batch=8, seqlen_q=s, heads_q=32, heads_k=8, capacity=32768, window=(-1, -1),
                              num_splits=0, pack_gqa=None, sms=132)
        assert layout == splitkv.DecodeLayout(8, False, 1, 32768) and not layout.rearranged
    cpu_kernel_path(monkeypatch)
    launched, varlen = split_kernels(monkeypatch), []

    def varlen_recorded(*args, decode=False, **kwargs):
        varlen.append((args[4] is not None, args[9], decode, args[5]))
        return varlen_stand_in(*args, decode=decode, **kwargs)

    monkeypatch.setattr(flashhopper.hopper, "forward_varlen", varlen_recorded)
    _run([0, 1, 300], s=4, hq=8, hk=2, s_new=4, causal=True)
    assert not launched and varlen == [(True, True, False, 4)]


def test_qlen_window():
    assert list(splitkv.QLEN_RANGE) == list(range(2, 17))
    layout = splitkv.plan_qlen(batch=8, heads_q=32, heads_k=8, capacity=32768, num_splits=0, sms=132)
    assert layout == splitkv.plan(batch=8, seqlen_q=1, heads_q=32, heads_k=8, capacity=32768,
                                  window=(-1, -1), num_splits=0, pack_gqa=True, sms=132)
    assert layout.pack_gqa and layout.splits > 1  # 64 CTAs on 132 SMs: split
    assert splitkv.plan_qlen(batch=1, heads_q=4, heads_k=4, capacity=8192, num_splits=0, sms=132).pack_gqa


# every launch of a call of 4 query tokens, 32 query heads over 8 KV heads, hdim 128, bf16, causal but for
# "no mask" (the kernels counted: the split kernel, the merge kernel; 1 x 8k and 8 x 32k split the keys, 16
# and 2 splits), as _qlen_call's docstring counts them (the append's 5 apart)
QLEN_LAUNCHES = {"1 x 8k": 4, "1 x 8k, append": 9, "8 x 32k": 5, "1 x 8k, paged 16": 4,
                 "1 x 8k, no mask": 4}


@pytest.mark.parametrize("case", list(QLEN_LAUNCHES))
def test_launches(monkeypatch, case):
    """The launches of one call: no host sync (CUDA graphs capture it), at most QLEN_LAUNCHES."""
    from test_decode_launches import _no_kernel

    cpu_kernel_path(monkeypatch)
    monkeypatch.setenv(validation.DECODE_QLEN_OPT_IN, "1")
    launched, merges = split_kernels(monkeypatch, model=False), []
    monkeypatch.setattr(flashhopper.hopper, "combine_splits", lambda *args: merges.append(args))
    varlen = []

    def no_kernel(*args, **kwargs):
        varlen.append(kwargs["decode"])
        return _no_kernel(*args, **kwargs)

    monkeypatch.setattr(flashhopper.hopper, "forward_varlen", no_kernel)
    (b, context), hq, hk, d, s = ((8, 32768) if case == "8 x 32k" else (1, 8192)), 32, 8, 128, 4
    page = 16 if "paged" in case else None
    cache = (b * context // page, page) if page else (b, context)
    kw = dict(q=torch.randn(b, s, hq, d).to(torch.bfloat16),
              cache_seqlens=torch.full((b,), context - s, dtype=torch.int32))
    kw["k_cache"], kw["v_cache"] = (torch.empty(*cache, hk, d, dtype=torch.bfloat16) for _ in range(2))
    if page:
        kw["page_table"] = torch.arange(b * context // page, dtype=torch.int32).view(b, -1)
    if "append" in case:
        kw["k"], kw["v"] = (torch.randn(b, s, hk, d).to(torch.bfloat16) for _ in range(2))
    with Launches() as ops:
        kvcache.flash_attn_with_kvcache(**kw, causal="no mask" not in case)
    total = ops.ops + [launch[0] for launch in launched] + ["forward_varlen"] * len(varlen)
    total += ["combine_splits"] * len(merges)
    assert len(launched) == 1 and varlen == []
    assert "_local_scalar_dense" not in ops.ops
    assert len(total) <= QLEN_LAUNCHES[case], total


def test_kernels_built_by_precompile(capsys):
    """The kernels the path asks for (the split kernel, unmasked and causal over packed tokens, with and
    without pages of the paged sizes) are among those `flashhopper precompile --paged --decode` lists (what
    `make gpu-test` builds): with FLASHHOPPER_JIT=0 a missing one fails the call."""
    from flashhopper.cli import main

    hdims = (64, 128, 256)
    assert main(["precompile", "--list", "--paged", "--decode", "--hdim", *map(str, hdims)]) == 0
    built = set(capsys.readouterr().out.splitlines())
    for dtype in (torch.bfloat16, torch.float16):
        for d in hdims:
            for softcap in (False, True):
                for page_size, causal in itertools.product((0, *plan.PAGED_PAGE_SIZES), (False, True)):
                    split = runtime.split_config(dtype, d, softcap, 0, page_size, causal=causal)
                    assert repr(split) in built, split
