"""The kernels' path of flash_attn_with_kvcache on the CPU, the varlen kernel replaced: the aten ops
around it that would each launch a device kernel, counted (a decode call's launches must not grow
back); with a float64 stand-in for the kernel, the call equal to the reference backend; and
splitkv.merge_by_lse equal to its first formula. The split inside the attention kernel
(runtime.forward_split, the default) the same way: its kernel replaced by a
float64 model that takes the kernel's own arguments and walks its tiles by the host twins of its
arithmetic (host.split_tile, host.split_keys, host.paged_row). The stand-ins: tests/kvcache_kernels.py."""

from __future__ import annotations

import pytest
import torch
from kvcache_kernels import cpu_kernel_path, merge_stand_in, split_kernels, varlen_stand_in
from torch.utils._python_dispatch import TorchDispatchMode

import flashhopper.hopper
from flashhopper import kvcache, splitkv, validation
from flashhopper.hopper.varlen_walk import uniform_walk_table, walk_table

# launches besides the attention kernel (forward_varlen's own seqused_q and walk table included) of one
# call, 32 query heads over 8 KV heads, hdim 128, bf16 (paged: pages read in place by the kernel), the
# merge kernel (hopper/combine.py, the default: validation.DECODE_MERGE_GPU_VERIFIED) counted; before the
# launches were cut: 40, 48, 40 and 53
LAUNCHES = {"1 x 8k": 9, "1 x 8k, append": 13, "8 x 32k": 11, "1 x 8k, paged 16": 10}
# the same where the merge is splitkv.merge_by_lse's torch ops (the merge kernel's gate off)
TORCH_MERGE_LAUNCHES = {"1 x 8k": 17, "1 x 8k, append": 21, "8 x 32k": 19, "1 x 8k, paged 16": 18}
# every launch of the call with the split inside the attention kernel
# (the default: validation.decode_split_enabled): the attention kernel, the merge kernel (16 splits at 1 x 8k,
# 2 at 8 x 32k), and the append's int64 positions and two index copies
SPLIT_LAUNCHES = {"1 x 8k": 2, "1 x 8k, append": 5, "8 x 32k": 2, "1 x 8k, paged 16": 2,
                  # q packed with cu_seqlens_q as SGLang and vLLM pass it, one token an item
                  "8 x 32k, packed q": 2, "1 x 8k, paged 16, packed q": 2}
FREE = {"empty", "empty_strided", "empty_like", "new_empty", "_unsafe_view", "lift_fresh"}  # no kernel


class Launches(TorchDispatchMode):
    """Records the aten ops that read or write device memory (not views, allocations, metadata): on
    CUDA each launches one kernel, as every op on this path does (a composite that launches several,
    torch.logsumexp say, would count as one)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        returns = func._schema.returns
        view = bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write
        if not (view or func._schema.name.split("::")[1] in FREE):
            self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _no_kernel(q, k, v, cu_q, starts, max_q, used_q, used_k, *args, out=None, decode=False, **kwargs):
    """forward_varlen but its kernel: seqused_q from cu_seqlens_q where not given, the walk table, the
    outputs."""
    if used_q is None:
        used_q = cu_q[1:] - cu_q[:-1]
    if decode:
        uniform_walk_table(used_k.shape[0], max_q, tile_m=128, device=q.device)
    else:
        walk_table(used_q, used_k, tile_m=128)
    out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype) if out is None else out
    return out, torch.empty(q.shape[1], q.shape[0])


@pytest.fixture()
def cpu_kernels(monkeypatch):
    """flash_attn_with_kvcache's kernel path on CPU tensors, as on 132 SMs (the tests set forward_varlen):
    the call arranged around the varlen kernel, as with the split inside the kernel switched off (the
    split's tests opt in: split_kernels)."""
    monkeypatch.setattr(validation, "DECODE_SPLIT_GPU_VERIFIED", False)
    return cpu_kernel_path(monkeypatch)


def _call_ops(cpu_kernels, case):
    """The ops one call of `case` launches besides the attention kernel (replaced)."""
    cpu_kernels.setattr(flashhopper.hopper, "forward_varlen", _no_kernel)
    (b, context), hq, hk, d = ((8, 32768) if case == "8 x 32k" else (1, 8192)), 32, 8, 128
    page = 16 if "paged" in case else None
    cache = (b * context // page, page) if page else (b, context)
    kw = dict(q=torch.randn(b, 1, hq, d).to(torch.bfloat16), cache_seqlens=torch.full((b,), context - 1,
                                                                                       dtype=torch.int32))
    kw["k_cache"], kw["v_cache"] = (torch.empty(*cache, hk, d, dtype=torch.bfloat16) for _ in range(2))
    if page:
        kw["page_table"] = torch.arange(b * context // page, dtype=torch.int32).view(b, -1)
    if "append" in case:
        kw["k"], kw["v"] = (torch.randn(b, 1, hk, d).to(torch.bfloat16) for _ in range(2))
    if "packed" in case:
        kw.update(q=kw["q"][:, 0], cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32), max_seqlen_q=1)
    with Launches() as launches:
        kvcache.flash_attn_with_kvcache(**kw, causal=True)
    return launches.ops


@pytest.mark.parametrize("case", list(LAUNCHES))
def test_decode_launches(cpu_kernels, case):
    """The default call: the merge kernel's one launch for merge_by_lse's nine (and for the unsplit copy)."""
    merges = []
    cpu_kernels.setattr(flashhopper.hopper, "combine_splits", lambda *args: merges.append(args))
    ops = _call_ops(cpu_kernels, case) + ["combine_splits"] * len(merges)
    assert len(merges) == 1
    assert "_local_scalar_dense" not in ops  # no host sync: CUDA graphs capture the call
    assert len(ops) <= LAUNCHES[case], ops


@pytest.mark.parametrize("case", list(TORCH_MERGE_LAUNCHES))
def test_decode_launches_torch_merge(cpu_kernels, case):
    cpu_kernels.setattr(validation, "DECODE_MERGE_GPU_VERIFIED", False)
    cpu_kernels.delenv(validation.DECODE_MERGE_OPT_IN, raising=False)
    ops = _call_ops(cpu_kernels, case)
    assert "_local_scalar_dense" not in ops
    assert len(ops) <= TORCH_MERGE_LAUNCHES[case], ops


@pytest.mark.parametrize("case", list(SPLIT_LAUNCHES))
def test_decode_launches_split(cpu_kernels, case):
    """Every launch of the call with the split inside the attention kernel (opted in): that kernel, the merge
    kernel where there are splits (whatever FLASHHOPPER_EXPERIMENTAL_DECODE_MERGE says), the append's ops;
    no walk table, no copy of q, no per-split bounds."""
    launched = split_kernels(cpu_kernels, model=False)
    merges = []
    cpu_kernels.setattr(flashhopper.hopper, "combine_splits", lambda *args: merges.append(args))
    ops = _call_ops(cpu_kernels, case)
    assert len(launched) == 1 and len(merges) == 1  # both cases split (16 at 1 x 8k, 2 at 8 x 32k)
    assert "_local_scalar_dense" not in ops
    assert len(ops) + len(launched) + len(merges) <= SPLIT_LAUNCHES[case], ops


def _cases():
    """(name, call kwargs) over one small cache: decode with every arrangement, appends, cache_batch_idx,
    cache_leftpad, a paged cache, more than one query token, packed queries."""
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16)  # noqa: E731
    b, hq, hk, d, s_cache = 3, 8, 2, 64, 700
    lens = torch.tensor([650, 0, 129], dtype=torch.int32)
    one = dict(cache_seqlens=lens)
    idx, left = torch.tensor([3, 0, 1], dtype=torch.int32), torch.tensor([0, 0, 40], dtype=torch.int32)
    for hints in ({}, {"num_splits": 5}, {"num_splits": 5, "pack_gqa": False}, {"num_splits": 1},
                  {"num_splits": 1, "pack_gqa": False}, {"num_splits": 64}):
        yield f"decode {hints}", dict(q=rand(b, 1, hq, d), cache_seqlens=lens, **hints)
    full = torch.tensor([700, 0, 1], dtype=torch.int32)  # the cache's capacity, none, one
    yield "full, softcap", dict(q=rand(b, 1, hq, d), cache_seqlens=full, softcap=3.0, num_splits=4)
    yield "full after the append", dict(q=rand(b, 1, hq, d), k=rand(b, 1, hk, d), v=rand(b, 1, hk, d),
                                        cache_seqlens=full - torch.tensor([1, 0, 0], dtype=torch.int32))
    yield "one item", dict(q=rand(1, 1, hq, d), cache_seqlens=lens[:1], num_splits=4)
    yield "append, idx, left", dict(q=rand(b, 1, hq, d), k=rand(b, 1, hk, d), v=rand(b, 1, hk, d),
                                    cache_batch_idx=idx, cache_leftpad=left, cache_seqlens=lens, num_splits=3)
    yield "left", dict(q=rand(b, 1, hq, d), cache_leftpad=left, cache_seqlens=lens, softcap=5.0)
    yield "one item, left, append 2", dict(q=rand(1, 1, hq, d), k=rand(1, 2, hk, d), v=rand(1, 2, hk, d),
                                           cache_leftpad=left[2:], cache_seqlens=lens[2:], num_splits=4)
    yield "queries 3, out", dict(q=rand(b, 3, hq, d), k=rand(b, 3, hk, d), v=rand(b, 3, hk, d),
                                 cache_batch_idx=idx, out=True, **one)
    cu = torch.tensor([0, 1, 1, 5], dtype=torch.int32)
    yield "packed", dict(q=rand(5, hq, d), cu_seqlens_q=cu, max_seqlen_q=4, cache_leftpad=left, **one)
    # every item the same tokens (SGLang's and vLLM's decode): the unpacked call's paths
    yield "packed, one each", dict(q=rand(b, hq, d), cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32),
                                   max_seqlen_q=1, num_splits=3, **one)
    yield "packed, three each, append, out", dict(
        q=rand(3 * b, hq, d), cu_seqlens_q=torch.arange(0, 3 * b + 1, 3, dtype=torch.int32), max_seqlen_q=3,
        k=rand(b, 3, hk, d), v=rand(b, 3, hk, d), out=True, **one)
    table = torch.randperm(b * s_cache // 7, generator=g).to(torch.int32).view(b, -1)
    paged = dict(page_table=table, caches=(b * s_cache // 7, 7), **one)
    yield "paged 7", dict(q=rand(b, 1, hq, d), k=rand(b, 1, hk, d), v=rand(b, 1, hk, d), **paged)
    yield "paged 7, queries 2", dict(q=rand(b, 2, hq, d), k=rand(b, 2, hk, d), v=rand(b, 2, hk, d),
                                     cache_leftpad=left, **paged)
    yield "int seqlens, idx, out", dict(q=rand(b, 1, hq, d), cache_seqlens=300, cache_batch_idx=idx, out=True)
    # pages of 16 the kernels read in place (44 a row: 704 positions an item), shuffled, 5 spare
    table16 = torch.randperm(b * 44 + 5, generator=g)[:b * 44].to(torch.int32).view(b, 44)
    paged16 = dict(page_table=table16, caches=(b * 44 + 5, 16))
    yield "paged 16", dict(q=rand(b, 1, hq, d), k=rand(b, 1, hk, d), v=rand(b, 1, hk, d), cache_seqlens=lens,
                           num_splits=3, **paged16)
    yield "paged 16, full, unpacked", dict(q=rand(b, 1, hq, d), cache_seqlens=torch.tensor([704, 0, 17],
                                                                                          dtype=torch.int32),
                                           pack_gqa=False, **paged16)


@pytest.mark.parametrize("merge", ["torch", "kernel", "split"])
@pytest.mark.parametrize("name,kw", list(_cases()), ids=[name for name, _ in _cases()])
def test_kernel_path_equals_reference(cpu_kernels, name, kw, merge):
    """The call as the kernels' path arranges it, with the stand-in for the varlen kernel, against
    backend="reference" (bf16 roundings apart): outputs, LSEs, and the appended caches. merge "kernel":
    the splits merged by the merge kernel (the default), a float64 stand-in for it; "torch": by
    merge_by_lse (the merge kernel's gate off). "split": the split inside
    the attention kernel (opted in), its float64 model (split_kernel_model: the kernel's arguments, walk,
    key ranges and partials' layout), merged by the merge kernel's stand-in."""
    cpu_kernels.setattr(flashhopper.hopper, "forward_varlen", varlen_stand_in)
    merges, launched = [], []
    if merge == "torch":
        cpu_kernels.setattr(validation, "DECODE_MERGE_GPU_VERIFIED", False)
    else:
        if merge == "split":
            launched = split_kernels(cpu_kernels)
        cpu_kernels.setattr(flashhopper.hopper, "combine_splits",
                            lambda *args: merges.append(args) or merge_stand_in(*args))
    g = torch.Generator().manual_seed(1)
    kw = dict(kw)  # the parametrized dict is shared by the merge cases
    q = kw["q"]
    shape = kw.pop("caches", (4, 700))
    caches = [torch.randn(*shape, 2, q.shape[-1], generator=g).to(torch.bfloat16) for _ in range(2)]
    results = []
    for backend in ("reference", "auto"):
        k_cache, v_cache = (c.clone() for c in caches)
        call = dict(kw, out=torch.full(q.shape, float("nan"), dtype=q.dtype)) if kw.get("out") else kw
        got = kvcache.flash_attn_with_kvcache(k_cache=k_cache, v_cache=v_cache, causal=True, return_lse=True,
                                              backend=backend, **call)
        if kw.get("out"):
            assert got[0] is call["out"]
        results.append((*got, k_cache, v_cache))
    (want, want_lse, *want_caches), (out, lse, *caches) = results
    b = kw["cache_seqlens"].shape[0] if isinstance(kw["cache_seqlens"], torch.Tensor) else q.shape[0]
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(caches, want_caches, strict=True))
    # query tokens an item: q's, or a packed q's where every item has max_seqlen_q of them
    tokens = q.shape[1] if q.dim() == 4 else kw["max_seqlen_q"] * (q.shape[0] == b * kw["max_seqlen_q"])
    # one query token, unless neither split nor packed: rearranged, merged by the kernel
    rearranged = tokens == 1 and (kw.get("num_splits"), kw.get("pack_gqa")) != (1, False)
    several = tokens > 1  # (causal, no window) the tokens packed, causal in the kernel
    if merge == "split" and several:  # one split-kernel launch (token_rows); the merge where the keys split
        # (tests/test_decode_qlen.py)
        assert len(launched) == 1 and launched[0][0].token_rows and len(merges) == (launched[0][1] > 1)
    elif merge == "split":  # one launch of the split kernel; the merge kernel where there are splits
        assert len(launched) == rearranged and len(merges) == (rearranged and launched[0][1] > 1)
    else:
        assert len(merges) == (merge == "kernel" and rearranged)


def _merge_first_form(o, lse, dim):
    """merge_by_lse as first written (a9538dd)."""
    top = lse.amax(dim=dim, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(lse - top)
    total = weights.sum(dim=dim)
    divisor = torch.where(total > 0, total, torch.ones_like(total))
    out = (o.float() * weights[..., None]).sum(dim=dim) / divisor[..., None]
    return out, top.squeeze(dim) + torch.log(total)


def test_merge_by_lse_equals_its_first_form():
    g = torch.Generator().manual_seed(0)
    o = torch.randn(5, 6, 4, 3, 16, generator=g, dtype=torch.float64).float().double()  # fp32 values
    lse = torch.randn(5, 6, 4, 3, generator=g, dtype=torch.float64) * 30
    lse[torch.rand(lse.shape, generator=g) < 0.3] = float("-inf")  # parts with no key
    lse[:, 2] = float("-inf")  # rows with no key in any part
    o[:, 2] = torch.randn(o[:, 2].shape, generator=g, dtype=torch.float64)  # garbage where no key: weighs 0
    lse[0, 3, 1, 2] = float("nan")  # propagates as it did
    for dim in (0, 1):  # the parts along dim 0, and along dim 1 of a transposed view
        parts = (o.transpose(0, 1), lse.transpose(0, 1)) if dim else (o, lse)
        want, want_lse = _merge_first_form(*parts, dim)
        got, got_lse = splitkv.merge_by_lse(*parts, dim)
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13, equal_nan=True)
        torch.testing.assert_close(got_lse, want_lse, rtol=1e-13, atol=1e-13, equal_nan=True)
    clean = torch.where(lse.isnan(), 0.0, lse)
    out, merged = splitkv.merge_by_lse(o, clean, dim=0)
    assert not out.isnan().any() and not merged.isnan().any()
    assert (out[2] == 0).all() and torch.isneginf(merged[2]).all()
    # into a strided bf16 target, the LSE skipped: the same values, rounded once
    target = torch.empty(6, 4, 16, 3, dtype=torch.bfloat16).transpose(2, 3)
    got, none = splitkv.merge_by_lse(o, clean, dim=0, out=target, return_lse=False)
    assert got is target and none is None and torch.equal(target, out.to(torch.bfloat16))


def test_decode_tile_asked_for_only_by_the_rearranged_call(cpu_kernels):
    """forward_varlen(decode=True) (the 1-warpgroup tile where enabled) from the rearranged decode call
    only (one query token: packed GQA, split keys or both), never with more query tokens."""
    asked = []

    def recorded(*args, decode=False, **kwargs):
        asked.append(decode)
        return varlen_stand_in(*args, decode=decode, **kwargs)

    cpu_kernels.setattr(flashhopper.hopper, "forward_varlen", recorded)
    cpu_kernels.setattr(flashhopper.hopper, "combine_splits", merge_stand_in)
    caches = [torch.randn(2, 700, 2, 32).to(torch.bfloat16) for _ in range(2)]
    lens = torch.tensor([650, 7], dtype=torch.int32)
    for sq, hints, rearranged in ((1, {}, True), (1, {"num_splits": 1}, True), (1, {"pack_gqa": False}, True),
                                  (1, {"num_splits": 1, "pack_gqa": False}, False), (3, {}, False)):
        q = torch.randn(2, sq, 8, 32).to(torch.bfloat16)
        kvcache.flash_attn_with_kvcache(q, *caches, cache_seqlens=lens, causal=True, **hints)
        assert asked.pop() == rearranged and not asked
