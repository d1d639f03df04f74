"""`flash_attn_with_kvcache`: attention over a KV cache, with the new keys and values appended in place
first (FlashAttention-3's semantics and argument names; inference only, no backward).

First version: a contiguous cache (b_cache, s_cache, heads_k, d) through the varlen forward kernel.
The cache is read as packed rows: batch item i's keys start at row cache_batch_idx[i] * s_cache +
cache_leftpad[i] and run for cache_seqlens[i] + s_new - cache_leftpad[i] rows (the kernel takes each
sequence's start and used length as it is given, the rows past it masked, their V rows zeroed in
shared memory, so unused cache slots may hold anything). The append is an index copy computed on the
device (no host sync: capturable in a CUDA graph). A paged cache (`page_table`) has its semantics in
backend="reference" (append included); on the kernels, every position the page table covers is
gathered into a contiguous copy first (`_gather_pages`), unless the page size is one the kernels read by
TMA (validation.paged_tma_enabled, on by default) (a multiple of 8 that divides or
is divided by the key block: FwdConfig.page_size), with no cache_leftpad: then the kernels read the
pages through the table themselves (`_kernel_call` with `pages`). Decode (one query token) fills the
grid by PackGQA and split-KV inside the kernel (`_split_call`: runtime.forward_split, then the merge
kernel; validation.decode_split_enabled, on by default), or arranged around the varlen kernel
(flashhopper/splitkv.py) where that is switched off or the cache has no rows. Decode of 2 to 16 query
tokens an item (speculative decoding) goes, where validation.decode_qlen_enabled (the default since its
GPU tests and timing, docs/results-decode.md), packed and split as one token's decode, each token's rows
seeing their own keys in the split kernel (`_qlen_call`); otherwise through the varlen kernel over every
query head. A packed q (cu_seqlens_q, as SGLang and vLLM pass it) with the same 1 to 16 tokens in every
item takes the same paths (`_uniform_tokens`), as do flash_attn_func's inference calls of 1 to 16 query
tokens (`dense_decode`).
Not yet: FP8 caches, other page sizes without the copy, the append inside the kernel.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from flashhopper import splitkv, validation
from flashhopper.reference import attention_ref
from flashhopper.validation import (
    check_backend,
    check_flag,
    normalize_scale,
    normalize_softcap,
    normalize_window,
)


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    page_table=None,
    cu_seqlens_q=None,
    max_seqlen_q=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    num_splits=0,
    pack_gqa=None,
    scheduler_metadata=None,
    out=None,
    return_lse=False,
    backend="auto",
):
    """Attention of q over a KV cache, after writing k, v into it at each item's current length.

    q: (b, s_q, hq, d), or (total_q, hq, d) with int32 cu_seqlens_q (b + 1,) and max_seqlen_q (a Python
    int at least every item's query length). k_cache, v_cache: (b_cache, s_cache, hk, d), rows of one
    item contiguous after each other (stride(0) == s_cache * stride(1)). cache_seqlens: an int or int32
    (b,): each item's length in the cache before the append. k, v: None, or (b, s_new, hk, d) written
    in place at positions cache_seqlens .. cache_seqlens + s_new - 1 of the item's cache row
    (cache_seqlens + s_new <= s_cache is the caller's contract, as in FA3; items must use distinct
    cache rows when appending). cache_batch_idx: int32 (b,), the cache row of each item (default i).
    cache_leftpad: int32 (b,), the item's keys start at this position of its row. page_table: int32
    (b, max_pages) with a paged cache (num_pages, page_size, hk, d): position p of item i is slot
    p % page_size of page page_table[i, p // page_size] (any page size; no cache_batch_idx; on the
    kernels through a contiguous copy of the table's span, or read in place where the module docstring
    says). Attention then sees
    keys [leftpad, cache_seqlens + s_new) of the item's row; causal and windows align the queries
    bottom-right against them (the last query sits at the last key). softmax_scale, window_size,
    softcap as flash_attn_func. num_splits (0 = choose, 1 = none) and pack_gqa (None = choose) are
    hints taken where they keep the call exact, one query token per item and no window
    (flashhopper/splitkv.py: the keys split across CTAs and merged by LSE, the query heads of a KV
    head packed into one CTA's rows); with 2 to 16 query tokens and no window num_splits splits the keys
    all tokens see and the query heads are always packed (_qlen_call); scheduler_metadata is accepted and
    unused.
    out: an optional preallocated output like q's (b, s_q, hq, d) or (total_q, hq, d).

    Returns out (q's shape and dtype), or (out, lse) with lse float32 (b, hq, s_q), or (hq, total_q)
    with cu_seqlens_q. An item that sees no key gives 0 and -inf. backend="reference" runs the exact
    float64 reference per item on any device (and does the same append).
    """
    backend = check_backend(backend)
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (a hint: 0 = choose, 1 = no split), got "
                         f"{num_splits!r}")
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        raise ValueError(f"pack_gqa must be None (choose), True or False (a hint), got {pack_gqa!r}")
    scale = normalize_scale(softmax_scale, int(q.shape[-1]))
    causal = check_flag("causal", causal)
    window = normalize_window(window_size)
    softcap = normalize_softcap(softcap)
    return_lse = check_flag("return_lse", return_lse)
    packed_q = cu_seqlens_q is not None
    batch, lens_q = _check_q(q, cu_seqlens_q, max_seqlen_q)
    _check_cache(q, k_cache, v_cache)
    _check_out(q, out, v_cache)
    tokens = _uniform_tokens(q, batch, max_seqlen_q) if packed_q and backend != "reference" else 0
    if tokens:  # every item has `tokens` queries: the (b, s_q, hq, d) call, whose decode paths pack and split
        o = flash_attn_with_kvcache(
            q.unflatten(0, (batch, tokens)), k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens,
            cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, page_table=page_table,
            softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
            num_splits=num_splits, pack_gqa=pack_gqa,
            out=None if out is None else out.unflatten(0, (batch, tokens)), return_lse=return_lse,
            backend=backend)
        o, lse = o if return_lse else (o, None)
        o = out if out is not None else o.flatten(0, 1)
        return (o, lse.transpose(0, 1).reshape(lse.shape[1], -1)) if return_lse else o  # lse (hq, total_q)
    s_cache = k_cache.shape[1]
    s_new = _check_new(k, v, k_cache, v_cache, batch)
    lens = _int32_vector("cache_seqlens", cache_seqlens, batch, q.device, required=True)
    idx = _int32_vector("cache_batch_idx", cache_batch_idx, batch, q.device)  # None: item i in row i
    left = _int32_vector("cache_leftpad", cache_leftpad, batch, q.device)  # None: 0
    if page_table is not None:
        _check_page_table(page_table, batch, q.device, cache_batch_idx)
    rows_of = partial(_cache_rows, idx=idx, page_table=page_table, rows_per_item=s_cache)
    if s_new:
        positions = (lens[:, None].long() if s_new == 1  # int64 for index_copy_
                     else torch.add(torch.arange(s_new, device=q.device), lens[:, None]))
        new_rows = rows_of(positions)
        for cache, t in ((k_cache, k), (v_cache, v)):
            flat = cache.view(-1, *cache.shape[2:])
            flat.index_copy_(0, new_rows.reshape(-1), t.reshape(-1, *t.shape[2:]))
    k_rows = k_cache.view(-1, *k_cache.shape[2:])
    v_rows = v_cache.view(-1, *v_cache.shape[2:])
    if backend == "reference":
        limit = s_cache if page_table is None else s_cache * page_table.shape[1]  # positions of an item
        cu_q = cu_seqlens_q if packed_q else torch.arange(batch + 1, device=q.device) * q.shape[1]
        q_rows = q if packed_q else q.reshape(batch * q.shape[1], *q.shape[2:])
        used_k = _used_keys(lens, s_new, left)
        left = torch.zeros(batch, dtype=torch.int32, device=q.device) if left is None else left
        o, lse = _reference(q_rows, k_rows, v_rows, cu_q, rows_of, limit, left, used_k, scale, causal, window,
                            softcap)
        o = o.to(q.dtype)
        if out is not None:
            out.view(o.shape).copy_(o)
        return _returned(q, o, lse, out, batch, packed_q, return_lse)
    validation.require_hopper(q, backend)
    if validation.needs_grad(q, k_cache, v_cache):
        raise NotImplementedError("flash_attn_with_kvcache is inference only (no backward); detach the "
                                  "inputs, or train with flash_attn_func / flash_attn_varlen_func")
    validation.check_varlen_call(q, k_cache, v_cache)
    paged_layout = None  # the decode layout where the kernels read the pages themselves
    qlen = _qlen_taken(q, packed_q, window, k_rows)  # 2..16 query tokens: packed (_qlen_call)
    if qlen and page_table is not None and _qlen_pages_served(q, k_cache, v_cache, left, causal, softcap):
        page_size, capacity = k_cache.shape[1], page_table.shape[1] * k_cache.shape[1]
        layout = splitkv.plan_qlen_for(q, k_cache.shape[2], capacity, num_splits,
                                       align=math.lcm(splitkv.CHUNK_ALIGN, page_size))
        if page_table.stride(-1) != 1 or page_table.stride(0) == 0:
            page_table = page_table.contiguous()
        validation.check_layouts(("q", q), ("k_cache", k_rows), ("v_cache", v_rows))
        return _qlen_call(q, k_rows, v_rows, layout, used_k=_used_keys(lens, s_new, left), starts_k=None,
                          item_rows=page_table.stride(0), scale=scale, causal=causal, softcap=softcap,
                          out=out, return_lse=return_lse, page_table=page_table, page_size=page_size)
    if page_table is not None:
        paged_layout = _paged_plan(q, k_cache, v_cache, page_table, left, window, causal, softcap,
                                   num_splits, pack_gqa, packed_q)
        if paged_layout is None:  # a contiguous cache for the kernels: each item's positions gathered
            k_rows, v_rows, s_cache = _gather_pages(k_rows, v_rows, page_table, s_cache)
            idx = None  # item i's positions from row i * s_cache of the copy
    q_rows = q if packed_q else q.reshape(batch * q.shape[1], *q.shape[2:])
    validation.check_layouts(("q", q_rows), ("k_cache", k_rows), ("v_cache", v_rows))
    if paged_layout is not None:  # the kernels read the pages through the table (s_cache: the page size)
        if page_table.stride(-1) != 1 or page_table.stride(0) == 0:  # (a row stride of 0: rows apart)
            page_table = page_table.contiguous()
        if _split_taken(paged_layout, k_rows):
            return _split_call(q, k_rows, v_rows, paged_layout, lens=lens, s_new=s_new, starts_k=None,
                               key_rows=page_table.stride(0), left=None, scale=scale, softcap=softcap,
                               out=out, return_lse=return_lse, page_table=page_table, page_size=s_cache)
        return _kernel_call(q, q_rows, k_rows, v_rows, paged_layout, starts_k=None,
                            item_rows=page_table.stride(0), used_k=_used_keys(lens, s_new, left),
                            lens_q=lens_q, cu_seqlens_q=cu_seqlens_q, scale=scale, causal=causal,
                            window=window, softcap=softcap, out=out, return_lse=return_lse,
                            pages={"page_table": page_table, "page_size": s_cache})
    starts_k = _key_starts(batch, s_cache, idx, left)  # None: item i's keys from row i * s_cache
    if qlen and paged_layout is None and k_rows.shape[0] > 0:  # (paged here: gathered into a copy)
        layout = splitkv.plan_qlen_for(q, k_cache.shape[2], s_cache, num_splits)
        return _qlen_call(q, k_rows, v_rows, layout, used_k=_used_keys(lens, s_new, left), starts_k=starts_k,
                          item_rows=s_cache, scale=scale, causal=causal, softcap=softcap, out=out,
                          return_lse=return_lse)
    layout = splitkv.plan_for(q, k_cache.shape[2], s_cache, window, num_splits, pack_gqa, packed_q)
    if _split_taken(layout, k_rows):
        key_rows = s_cache if starts_k is None else 0  # 0: each item's first key row from starts_k
        return _split_call(q, k_rows, v_rows, layout, lens=lens, s_new=s_new, starts_k=starts_k,
                           key_rows=key_rows, left=left, scale=scale, softcap=softcap, out=out,
                           return_lse=return_lse)
    return _kernel_call(q, q_rows, k_rows, v_rows, layout, starts_k=starts_k, item_rows=s_cache,
                        used_k=_used_keys(lens, s_new, left), lens_q=lens_q, cu_seqlens_q=cu_seqlens_q,
                        scale=scale, causal=causal, window=window, softcap=softcap, out=out,
                        return_lse=return_lse)


def _used_keys(lens, s_new, left):
    """Each item's keys, int32 (b,): cache_seqlens + s_new - cache_leftpad (one kernel each term)."""
    used_k = lens + s_new if s_new else lens
    return used_k if left is None else used_k - left


def _split_taken(layout, k_rows) -> bool:
    """Whether the call runs the rearranged decode with the split inside the attention kernel
    (validation.decode_split_enabled; _split_call): one query token, no window, a cache with rows (a TMA
    descriptor needs them)."""
    return layout.rearranged and k_rows.shape[0] > 0 and validation.decode_split_enabled()


def _split_call(q, k_rows, v_rows, layout, *, lens, s_new, starts_k, key_rows, left, scale, softcap, out,
                return_lse, page_table=None, page_size=0):
    """The rearranged decode (one query token, no window: no mask) with the split inside the attention
    kernel (runtime.forward_split, FwdConfig.split_kv): q read in place as (b, rows, heads, d), the query
    heads (rows 1) or with PackGQA each KV head's g query heads as its rows; each item's keys counted in the
    kernel from cache_seqlens (+ s_new), from row item * key_rows (paged: the table's row; key_rows 0:
    starts_k[item]); its partials merged by the merge kernel (splitkv.merge_parts), or with one split
    written to the output itself. Two launches, one without splits; cache_leftpad costs one more (the used
    lengths) and, with cache_batch_idx, one or two for the items' first key rows (_key_starts)."""
    import flashhopper.hopper as hopper
    from flashhopper.hopper import runtime

    b, _, hq, _ = q.shape
    rows = hq // layout.heads_k if layout.pack_gqa else 1
    heads = hq // rows
    # query head h is row h % rows of head h // rows (PackGQA: of KV head h // g)
    q_items = q[:, 0].unflatten(1, (heads, rows)).transpose(1, 2)
    target = out
    if target is None:
        target = torch.empty(b, 1, hq, v_rows.shape[-1], dtype=q.dtype, device=q.device)
        if runtime.poison:
            target.fill_(float("nan"))
    lse = torch.empty(b, hq, 1, dtype=torch.float32, device=q.device)  # written, dropped without return_lse
    if runtime.poison:
        lse.fill_(float("nan"))
    out_rows = target[:, 0].unflatten(1, (heads, rows)).transpose(1, 2)  # (b, rows, heads, dv)
    lse_rows = lse[..., 0].unflatten(1, (heads, rows))  # (b, heads, rows)
    used = lens if left is None else torch.sub(lens, left)  # the kernel adds s_new
    call = partial(hopper.forward_split, q_items, k_rows, v_rows, used, scale, softcap, splits=layout.splits,
                   chunk=layout.chunk, new_keys=s_new, key_rows=key_rows, key_starts=starts_k,
                   page_table=page_table, page_size=page_size)
    if layout.splits == 1 and runtime.rows_aligned(out_rows):  # the TMA stores into the output itself
        call(out=out_rows, lse=lse_rows)
    else:
        o, lse_parts = call()
        splitkv.merge_parts(o, lse_parts.transpose(2, 3), out_rows,
                            lse_rows.transpose(1, 2) if return_lse else None)
    return (target, lse) if return_lse else target


def dense_decode(q, k, v, scale: float, causal: bool, window, softcap: float, leftpad=None):
    """flash_attn_func's inference call where it is a decode, (out, lse) by the decode paths, else None
    (the dense kernel then runs it). A decode: 1 to 16 query tokens an item, no window, k and v with
    (b, s_k, hk, d) strides whose items lie a whole number of key rows apart (contiguous ones, or the
    (b, hk, s_k, d) memory of a transformers cache seen as (b, s_k, hk, d)); one token where PackGQA or
    the split fills the grid better (splitkv.plan), more where the query heads share KV heads (packed
    per KV head, _qlen_call). Every item has all s_k keys (cache_seqlens s_k), or with `leftpad` (int32
    (b,) on q's device: cache_leftpad, a left-padded batch's padding) those from leftpad[i] on: the split
    plan's capacity s_k is exact or above. FlashAttention-3 decides the same way for its
    flash_attn_func (pack_gqa and num_splits from the shapes). Launches: those of _split_call /
    _qlen_call (with leftpad two or three more: the used lengths, the first key rows); the lengths
    tensor is made once per (device, b, s_k) outside CUDA graph capture. The caller has validated q, k,
    v as flash_attn_func does (dtypes, head dims, q's layout)."""
    b, s, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if (b == 0 or sk == 0 or s not in splitkv.DECODE_TOKENS or tuple(window) != (-1, -1)
            or not validation.decode_split_enabled()):
        return None
    if s > 1 and (hq == hk or not validation.decode_qlen_enabled()):
        return None
    rows = _key_rows(k, v)
    if rows is None:
        return None
    k_rows, v_rows, key_rows = rows
    if validation.layout_problem("k", k_rows) or validation.layout_problem("v", v_rows):
        return None
    lens = _constant_lengths(b, sk, q.device)
    if s == 1:
        layout = splitkv.plan_for(q, hk, sk, (-1, -1), 0, None, False)
        if not layout.rearranged:
            return None
        starts = _key_starts(b, key_rows, None, leftpad)  # None: item i from row i * key_rows
        return _split_call(q, k_rows, v_rows, layout, lens=lens, s_new=0, starts_k=starts,
                           key_rows=key_rows if starts is None else 0, left=leftpad, scale=scale,
                           softcap=softcap, out=None, return_lse=True)
    layout = splitkv.plan_qlen_for(q, hk, sk, 0)
    return _qlen_call(q, k_rows, v_rows, layout, used_k=_used_keys(lens, 0, leftpad),
                      starts_k=_key_starts(b, key_rows, None, leftpad), item_rows=key_rows, scale=scale,
                      causal=causal, softcap=softcap, out=None, return_lse=True)


def _key_rows(k, v):
    """(k rows, v rows, key_rows) for the split kernel: (b, s_k, hk, d) k and v seen as rows (extent,
    hk, d) with item i's keys from row i * key_rows, where both have a contiguous head dim and items a
    whole number of (the same) row strides apart, no two items overlapping; else None. The views reach
    exactly the memory of k and v (extent: the last item's last row)."""
    b, sk, hk, d = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k.stride(1) <= 0 or v.stride(1) <= 0:
        return None
    key_rows = sk  # one item: its stride(0) is never stepped over (torch may give a size-1 dim any stride)
    if b > 1:
        key_rows, rest = divmod(k.stride(0), k.stride(1))
        if rest or v.stride(0) != key_rows * v.stride(1) or key_rows < sk:
            return None
    extent = (b - 1) * key_rows + sk
    return (k.as_strided((extent, hk, d), (k.stride(1), k.stride(2), 1)),
            v.as_strided((extent, hk, v.shape[-1]), (v.stride(1), v.stride(2), 1)), key_rows)


_LENGTHS: dict = {}  # (device, b, n) -> int32 (b,) of n, never written: shared by streams and graphs


def _constant_lengths(b: int, n: int, device):
    """int32 (b,) of n on `device`, made once by a blocking copy from the host (so no stream needs to
    wait for it); under CUDA graph capture, where that copy cannot run, a fill captured with the call."""
    key = (device, b, n)
    t = _LENGTHS.get(key)
    if t is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.full((b,), n, dtype=torch.int32, device=device)
        if len(_LENGTHS) > 1024:
            _LENGTHS.clear()
        t = _LENGTHS[key] = torch.tensor([n] * b, dtype=torch.int32).to(device)
    return t


def _qlen_taken(q, packed_q, window, k_rows) -> bool:
    """Whether the call runs with its tokens packed (_qlen_call): enabled (validation.decode_qlen_enabled),
    2 to 16 query tokens an item (splitkv.QLEN_RANGE) in a (b, s_q, hq, d) q, no window, the split inside
    the kernel enabled (validation.decode_split_enabled) and a cache with rows (a TMA descriptor needs
    them)."""
    return (validation.decode_qlen_enabled() and not packed_q and q.shape[1] in splitkv.QLEN_RANGE
            and tuple(window) == (-1, -1) and k_rows.shape[0] > 0 and validation.decode_split_enabled())


def _qlen_pages_served(q, k_cache, v_cache, left, causal, softcap) -> bool:
    """Whether the split kernel of _qlen_call reads this call's paged cache itself
    (validation.paged_tma_enabled, no cache_leftpad, and its config serves the page size:
    runtime.split_config); otherwise the pages are gathered, or the call is left to the varlen kernel where
    it reads them (flash_attn_with_kvcache)."""
    from flashhopper.hopper.runtime import split_config

    page_size, d = k_cache.shape[1], q.shape[-1]
    if left is not None or not validation.paged_tma_enabled():
        return False
    dv = 0 if v_cache.shape[-1] == d else v_cache.shape[-1]
    return split_config(q.dtype, d, softcap > 0.0, dv, page_size, causal=causal).page_size == page_size


def _qlen_call(q, k_rows, v_rows, layout, *, used_k, starts_k, item_rows, scale, causal, softcap, out,
               return_lse, page_table=None, page_size=0):
    """Decode of s = 2..16 query tokens an item (speculative decoding), no window, in the split kernel
    (runtime.forward_split, the layout of splitkv.plan_qlen) with each KV head's g query heads of all s
    tokens packed as s * g rows of one CTA (row j * s + t: token t, the j-th query head of the group), so
    each KV head is read once an item; causal, row j * s + t sees the keys of token t, the item's first
    L - s + 1 + t of its L = used_k[b] (FwdConfig.token_rows: the mask in the kernel; token 0 may see none:
    0 and -inf), else all L. Where the keys split, the partials are merged by LSE in fp32 by the merge
    kernel (hopper/combine.py, splitkv.merge_parts). q is copied once into the packed rows (q cannot be
    viewed so), and the rows once into the output.

    item_rows: item i's keys from row i * item_rows where starts_k (int32 (b,)) is None; paged (page_table
    given, page_size its pages' rows): the table's row stride. Launches (the append's apart): 3 (the
    packing copy, the split kernel, the output's copy), one more where the keys split (their merge), one
    more for more than one item without cache_batch_idx / cache_leftpad: 4 at 1 x 8k, 5 at 8 x 32k
    (tests/test_decode_qlen.py counts them); cache_leftpad and cache_batch_idx add what _used_keys and
    _key_starts launch. Nothing is read on the host: capturable in a CUDA graph."""
    import flashhopper.hopper as hopper

    b, s, hq, d = q.shape
    hk, dv = layout.heads_k, v_rows.shape[-1]
    g = hq // hk
    rows = g * s
    packed = torch.empty(b, g, s, hk, d, dtype=q.dtype, device=q.device)
    packed.copy_(q.unflatten(2, (hk, g)).permute(0, 3, 1, 2, 4))
    merged = _qlen_buffer((b, rows, hk, dv), q.dtype, q.device)
    lse = _qlen_buffer((b, hq, s), torch.float32, q.device)  # written, dropped without return_lse
    lse_rows = lse.view(b, hk, rows)  # (b, heads, rows): query head k * g + j, token t at row j * s + t
    pages = {"page_table": page_table, "page_size": page_size} if page_table is not None else {}
    key_rows = item_rows if starts_k is None else 0  # 0: each item's first key row from starts_k
    call = partial(hopper.forward_split, packed.view(b, rows, hk, d), k_rows, v_rows, used_k, scale, softcap,
                   splits=layout.splits, chunk=layout.chunk, new_keys=0, key_rows=key_rows,
                   key_starts=starts_k, tokens=s if causal else 0, **pages)
    if layout.splits == 1:
        call(out=merged, lse=lse_rows)
    else:
        o, lse_parts = call()
        splitkv.merge_parts(o, lse_parts.transpose(2, 3), merged, lse_rows.transpose(1, 2))
    target = out
    if target is None:
        target = torch.empty(b, s, hq, dv, dtype=q.dtype, device=q.device)
    target.unflatten(2, (hk, g)).copy_(merged.view(b, g, s, hk, dv).permute(0, 2, 3, 1, 4))
    return (target, lse) if return_lse else target


def _qlen_buffer(shape, dtype, device):
    """A new buffer of _qlen_call, NaN where runtime.poison is set (the tests: an element left unwritten
    shows)."""
    from flashhopper.hopper import runtime

    t = torch.empty(shape, dtype=dtype, device=device)
    return t.fill_(float("nan")) if runtime.poison else t


def _paged_plan(q, k_cache, v_cache, page_table, left, window, causal, softcap, num_splits, pack_gqa,
                packed_q):
    """The decode layout (splitkv.plan) where the kernels read this call's paged cache themselves
    (validation.paged_tma_enabled, no cache_leftpad: a sequence's keys start a page, and the call's kernel
    config serves the page size: runtime.varlen_config), else None: the pages are gathered. A split
    decode's chunks are whole pages (a chunk's keys start a page of its item)."""
    from flashhopper.hopper.runtime import split_config, varlen_config

    page_size = k_cache.shape[1]
    if left is not None or not validation.paged_tma_enabled():
        return None
    capacity = page_table.shape[1] * page_size  # positions an item may hold
    align = math.lcm(splitkv.CHUNK_ALIGN, page_size)
    layout = splitkv.plan_for(q, k_cache.shape[2], capacity, window, num_splits, pack_gqa, packed_q,
                              align=align)
    # the rearranged decode passes no mask (one query at the end of its keys)
    dv = 0 if v_cache.shape[-1] == q.shape[-1] else v_cache.shape[-1]
    if _split_taken(layout, k_cache):  # the split inside the kernel: its own config (the same tiles)
        cfg = split_config(q.dtype, q.shape[-1], softcap > 0.0, dv, page_size)
    else:
        cfg = varlen_config(q.dtype, q.shape[-1], causal and not layout.rearranged, window, softcap > 0.0, dv,
                            decode=layout.rearranged, page_size=page_size)[0]
    return layout if cfg.page_size == page_size else None


def _kernel_call(q, q_rows, k_rows, v_rows, layout, *, starts_k, item_rows, used_k, lens_q, cu_seqlens_q,
                 scale, causal, window, softcap, out, return_lse, pages=None):
    """flash_attn_with_kvcache's varlen forward over the cache's rows k_rows / v_rows: item i's keys from
    row starts_k[i] (None: i * item_rows) for used_k[i] rows; or with `pages` (page_table, page_size) the
    kernels read a paged cache through its table, item i from its table row's first entry (item_rows:
    the table's row stride), a split decode's chunk from its first page's entry (whole pages:
    _paged_plan). One query token (layout.rearranged): PackGQA and / or split-KV (flashhopper/splitkv.py)."""
    from flashhopper.hopper import forward_varlen, runtime

    batch, packed_q = used_k.shape[0], cu_seqlens_q is not None
    pages = pages or {}
    if layout.rearranged:
        step = {"start_step": layout.chunk // pages["page_size"]} if pages else {}
        rows, cu_rows, per_seq, starts, used = splitkv.rearrange(layout, q, starts_k, used_k,
                                                                 item_rows=item_rows, **step)
        # one query at the end of its keys: causal is no mask (and a chunk has no end to align to);
        # a few rows a sequence: the decode tile where it is enabled (validation.decode_tile_enabled)
        keys = {"page_starts": starts[:-1], **pages} if pages else {}
        o_parts, lse_parts = forward_varlen(rows, k_rows, v_rows, cu_rows, None if pages else starts, per_seq,
                                            None, used, scale, False, window, softcap, decode=True, **keys)
        target = out
        if target is None:
            target = torch.empty(q.shape[:-1] + v_rows.shape[-1:], dtype=q.dtype, device=q.device)
            if runtime.poison:  # the tests and the fuzz: an element the merge leaves unwritten shows
                target.fill_(float("nan"))
        o, lse = splitkv.combine(layout, o_parts, lse_parts, batch, q.shape[2], out=target,
                                 return_lse=return_lse, fused=True)
        return (o, lse) if return_lse else o
    # the kernel reads each sequence's key start (paged: its first table entry) and used length; the
    # (b + 1)-th start is unused
    starts = None
    if not pages:
        starts = (splitkv.multiples(batch + 1, item_rows, q.device) if starts_k is None
                  else torch.cat([starts_k, starts_k[-1:]]))
    cu_q = cu_seqlens_q if packed_q else splitkv.multiples(batch + 1, q.shape[1], q.device)
    o_rows = None if out is None else out.view(q_rows.shape[:-1] + out.shape[-1:])
    # the most keys an item holds: its rows, or its table row's pages (the walk's L2 sections; k's rows by
    # default, the whole cache)
    max_keys = pages["page_table"].shape[1] * pages["page_size"] if pages else item_rows
    o, lse = forward_varlen(q_rows, k_rows, v_rows, cu_q, starts, max(lens_q), None, used_k, scale, causal,
                            window, softcap, out=o_rows, max_seqlen_k=max_keys, **pages)
    if out is not None and o.data_ptr() != out.data_ptr():
        out.view(o.shape).copy_(o)
    return _returned(q, o, lse, out, batch, packed_q, return_lse)


def _returned(q, o, lse, out, batch, packed_q, return_lse):
    """What the call returns from the varlen forward's o (rows) and lse (hq, rows): out where given,
    else o in q's layout; lse as (b, hq, s_q) with unpacked queries (views, no kernel)."""
    o = out if out is not None else (o if packed_q else o.view(*q.shape[:-1], o.shape[-1]))
    if not packed_q:
        lse = lse.view(q.shape[2], batch, q.shape[1]).transpose(0, 1)
    return (o, lse) if return_lse else o


def _key_starts(batch, s_cache, idx, left):
    """The cache row of each item's first key, int32 (b,): idx * s_cache + left; None where that is
    i * s_cache (no cache_batch_idx, no cache_leftpad), left to the callers to make in fewer kernels."""
    if idx is None and left is None:
        return None
    if idx is None:
        return left if batch == 1 else splitkv.multiples(batch, s_cache, left.device).add_(left)
    return idx * s_cache if left is None else torch.add(left, idx, alpha=s_cache)


def _check_q(q, cu_seqlens_q, max_seqlen_q):
    """(batch, the query lengths as Python ints where known: [s_q], or [max_seqlen_q])."""
    if not isinstance(q, torch.Tensor) or q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"q must be a float16 or bfloat16 torch.Tensor, got {getattr(q, 'dtype', type(q))}")
    if cu_seqlens_q is None:
        if q.dim() != 4:
            raise ValueError(f"q has shape {tuple(q.shape)}; accepted: (batch, seqlen_q, heads, headdim), or "
                             "(total_q, heads, headdim) with cu_seqlens_q")
        return q.shape[0], [q.shape[1]]
    if q.dim() != 3:
        raise ValueError(f"q has shape {tuple(q.shape)}; with cu_seqlens_q accepted: (total_q, heads, "
                         "headdim)")
    cu = cu_seqlens_q
    if (not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 2
            or cu.device != q.device):
        raise ValueError("cu_seqlens_q must be an int32 tensor of shape (batch + 1,) on q's device")
    if not isinstance(max_seqlen_q, int) or isinstance(max_seqlen_q, bool) or max_seqlen_q < 0:
        raise TypeError(f"max_seqlen_q must be a Python int >= 0 with cu_seqlens_q, got {max_seqlen_q!r}")
    return cu_seqlens_q.shape[0] - 1, [max_seqlen_q]


def _check_out(q, out, v_cache):
    if out is not None:
        if out.shape != q.shape[:-1] + v_cache.shape[-1:] or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(f"out has shape {tuple(out.shape)}, dtype {out.dtype}; accepted: "
                             f"{tuple(q.shape[:-1] + v_cache.shape[-1:])}, {q.dtype} on {q.device}")


def _uniform_tokens(q, batch: int, max_seqlen_q: int) -> int:
    """Query tokens of every item of a packed q (total_q, hq, d) where all items have the same number in
    the decode paths' range (1 to 16), else 0. Read from the shapes, not cu_seqlens_q (no host sync): by
    the contract that max_seqlen_q is at least every item's length, total_q == batch * max_seqlen_q holds
    only where each item has exactly max_seqlen_q. This is how SGLang and vLLM call decode (q packed, one
    or a few tokens an item), which then takes PackGQA and the split inside the kernel."""
    s = max_seqlen_q
    return s if batch > 0 and s in splitkv.DECODE_TOKENS and q.shape[0] == batch * s else 0


def _check_cache(q, k_cache, v_cache):
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, torch.Tensor) or c.dim() != 4:
            raise ValueError(f"{name} must be a (b_cache, s_cache, heads_k, headdim) tensor, got "
                             f"{getattr(c, 'shape', type(c))}")
        if c.dtype != q.dtype or c.device != q.device:
            raise ValueError(f"{name} is {c.dtype} on {c.device}; accepted: q's {q.dtype} on {q.device}")
        if c.stride(-1) != 1 or c.stride(0) != c.shape[1] * c.stride(1):
            raise ValueError(f"{name} has strides {c.stride()}; accepted: a contiguous head dim and each "
                             "cache row's tokens right after the previous row's (stride(0) == s_cache * "
                             "stride(1))")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ before "
                         "the head dim")
    if k_cache.shape[-1] != q.shape[-1]:
        raise ValueError(f"k_cache's head dim {k_cache.shape[-1]} is not q's {q.shape[-1]}")
    if q.shape[-2] % k_cache.shape[2]:
        raise ValueError(f"q's {q.shape[-2]} heads are not a multiple of the cache's {k_cache.shape[2]}")


def _check_new(k, v, k_cache, v_cache, batch) -> int:
    """The appended length s_new (0 without k, v)."""
    if (k is None) != (v is None):
        raise ValueError("k and v are appended together: pass both or neither")
    if k is None:
        return 0
    for name, t, c in (("k", k, k_cache), ("v", v, v_cache)):
        shape = tuple(getattr(t, "shape", ()))
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or shape[0] != batch or shape[2:] != c.shape[2:]:
            raise ValueError(f"{name} has shape {shape}; accepted: (batch={batch}, s_new, {c.shape[2]}, "
                             f"{c.shape[3]})")
        if t.dtype != c.dtype or t.device != c.device:
            raise ValueError(f"{name} is {t.dtype} on {t.device}; accepted: the cache's {c.dtype} on "
                             f"{c.device}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k appends {k.shape[1]} tokens, v {v.shape[1]}")
    return k.shape[1]


def _int32_vector(name, x, batch, device, required=False):
    """An int32 (batch,) tensor on `device` from x (an int, or such a tensor); None when x is None and
    not required (the callers spell the default without a tensor)."""
    if x is None:
        if required:
            raise ValueError(f"{name} is required: an int or an int32 tensor of shape ({batch},)")
        return None
    if isinstance(x, int) and not isinstance(x, bool) and name == "cache_seqlens":
        if x < 0:
            raise ValueError(f"cache_seqlens must be >= 0, got {x}")
        return torch.full((batch,), x, device=device, dtype=torch.int32)
    if not isinstance(x, torch.Tensor) or x.dtype != torch.int32 or tuple(x.shape) != (batch,):
        raise ValueError(f"{name} must be an int32 tensor of shape ({batch},)"
                         + (" or an int" if name == "cache_seqlens" else ""))
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}; accepted: q's device {device}")
    return x


def _check_page_table(page_table, batch, device, cache_batch_idx):
    if (not isinstance(page_table, torch.Tensor) or page_table.dtype != torch.int32 or page_table.dim() != 2
            or page_table.shape[0] != batch or page_table.device != device):
        raise ValueError(f"page_table must be an int32 tensor of shape (batch={batch}, max_pages) on q's "
                         "device")
    if cache_batch_idx is not None:
        raise ValueError("cache_batch_idx with page_table: an item's pages are its page_table row; pass one")


def _gather_pages(k_rows, v_rows, page_table, page_size):
    """A paged cache on the kernels, first version: every position an item's page table covers,
    copied into a contiguous (b * positions, heads_k, d) cache (entries past the pages in use may be
    anything: clamped into range, their rows lie past the item's keys). The copy reads and writes the
    table's whole span once more than the attention does: a stopgap until the kernels take the page
    table themselves. Returns (k rows, v rows, positions per item)."""
    positions = page_table.shape[1] * page_size
    pages = page_table.clamp(0, k_rows.shape[0] // page_size - 1)
    slots = torch.arange(page_size, device=page_table.device)
    rows = torch.add(slots, pages[..., None], alpha=page_size).reshape(-1)  # int64: page * page_size + slot
    return k_rows.index_select(0, rows), v_rows.index_select(0, rows), positions


def _cache_rows(positions, idx, page_table, rows_per_item):
    """Rows (int64) of the cache viewed as (rows, heads_k, headdim) that hold (b, n) int64 positions of
    each item: contiguous, item i's positions from row idx[i] * s_cache (idx None: i * s_cache); paged
    (rows_per_item = page_size), position p of item i in page page_table[i, p // page_size] at slot
    p % page_size."""
    if page_table is None:
        if idx is None:
            if positions.shape[0] == 1:
                return positions
            idx = torch.arange(positions.shape[0], device=positions.device)
        return torch.add(positions, idx[:, None], alpha=rows_per_item)
    pages = page_table.gather(1, torch.div(positions, rows_per_item, rounding_mode="floor"))
    return torch.add(positions % rows_per_item, pages, alpha=rows_per_item)


def _reference(q_rows, k_rows, v_rows, cu_q, rows_of, limit, left, used_k, scale, causal, window, softcap):
    """attention_ref per item over its query rows and its cache keys (positions left .. left + used_k
    of at most `limit`, at the rows rows_of gives); checks the bounds."""
    cq, lefts, uk = cu_q.tolist(), left.tolist(), used_k.tolist()
    out = torch.zeros(*q_rows.shape[:2], v_rows.shape[-1], dtype=torch.float64, device=q_rows.device)
    lse = torch.full((q_rows.shape[1], q_rows.shape[0]), float("-inf"), device=q_rows.device)
    for i in range(len(cq) - 1):
        if lefts[i] < 0 or uk[i] < 0 or lefts[i] + uk[i] > limit:
            raise ValueError(f"item {i}: keys [{lefts[i]}, {lefts[i] + uk[i]}) outside the cache's {limit} "
                             "positions an item")
        rows = slice(cq[i], cq[i + 1])
        if rows.stop == rows.start or uk[i] == 0:
            continue
        positions = torch.zeros(len(cq) - 1, uk[i], dtype=torch.long, device=q_rows.device)
        positions[i] = torch.arange(lefts[i], lefts[i] + uk[i], device=q_rows.device)
        keys = rows_of(positions)[i]  # the other items' rows are unused
        if keys.min() < 0 or keys.max() >= k_rows.shape[0]:
            raise ValueError(f"item {i}: its keys fall outside the cache's {k_rows.shape[0]} rows")
        o, l_ = attention_ref(q_rows[None, rows], k_rows[None, keys], v_rows[None, keys], scale, causal,
                              window, softcap)
        out[rows], lse[:, rows] = o[0], l_[0]
    return out, lse
