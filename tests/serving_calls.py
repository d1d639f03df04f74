"""The calls SGLang's and vLLM's FlashAttention backends make (argument sets and layouts read from
their sources, serving-ecosystem-facts.md), built as our own cases: a paged KV cache already written,
a batch of sequences whose queries are each sequence's last tokens (decode: one; chunked prefill:
several), and what each sequence's queries must see (its keys in order) for the checks."""

from __future__ import annotations

import torch


def paged_batch(*, page_size, lens_k, lens_q, hq=8, hk=2, d=128, dtype=torch.bfloat16, device="cpu", seed=0):
    """(q packed (total_q, hq, d), k_cache, v_cache (num_pages, page_size, hk, d), page table (b,
    max_pages) int32 with shuffled pages and garbage past each sequence's last page, seq lens int32,
    cu_seqlens_q int32, per sequence (its queries, keys, values) in order)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    b = len(lens_k)
    pages_each = [-(-n // page_size) for n in lens_k]
    max_pages = max(pages_each) + 1
    num_pages = sum(pages_each) + 7
    order = torch.randperm(num_pages, generator=g)
    table = torch.full((b, max_pages), num_pages + 1000, dtype=torch.int32)  # garbage: out of range
    k_cache = torch.full((num_pages, page_size, hk, d), float("nan"), dtype=dtype)
    v_cache = torch.full((num_pages, page_size, hk, d), float("nan"), dtype=dtype)
    seqs, start = [], 0
    for i, n in enumerate(lens_k):
        table[i, :pages_each[i]] = order[start:start + pages_each[i]].int()
        start += pages_each[i]
        keys, values = (torch.randn(n, hk, d, generator=g).to(dtype) for _ in range(2))
        pos = torch.arange(n)
        slots = (table[i, pos // page_size].long(), pos % page_size)
        k_cache[slots], v_cache[slots] = keys, values
        seqs.append((keys, values))
    q = torch.randn(sum(lens_q), hq, d, generator=g).to(dtype)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    per_seq = [(q[int(cu_q[i]):int(cu_q[i + 1])], *seqs[i]) for i in range(b)]
    to = lambda t: t.to(device)  # noqa: E731
    return (to(q), to(k_cache), to(v_cache), to(table), to(torch.tensor(lens_k, dtype=torch.int32)), to(cu_q),
            [tuple(map(to, s)) for s in per_seq])


def sglang_call(fa3, q, k_cache, v_cache, table, seq_lens, cu_q, max_q, window=(-1, -1), softcap=0.0):
    """SGLang's FlashAttentionBackend (decode and extend): flash_attn_with_kvcache over the pool's
    pages, no append (the pool was written first), page_table = req_to_token[..., :max_len]."""
    max_len = int(seq_lens.max())
    pages = -(-max_len // k_cache.shape[1])
    cu_k = torch.nn.functional.pad(seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
    return fa3.flash_attn_with_kvcache(
        q=q, k_cache=k_cache, v_cache=v_cache, page_table=table[:, :pages], cache_seqlens=seq_lens,
        cu_seqlens_q=cu_q, cu_seqlens_k_new=cu_k,
        max_seqlen_q=max_q, softmax_scale=q.shape[-1] ** -0.5, causal=True, window_size=window,
        softcap=softcap, k_descale=None, v_descale=None, return_softmax_lse=True)


def vllm_call(vllm, q, k_cache, v_cache, table, seq_lens, cu_q, max_q, window=(-1, -1), softcap=0.0):
    """vLLM's v1 FlashAttentionImpl: the fork's flash_attn_varlen_func over the block table, out=
    preallocated, window (sliding_window - 1, 0), num_splits from the scheduler."""
    out = torch.full_like(q, float("nan"))
    vllm.flash_attn_varlen_func(
        q=q, k=k_cache, v=v_cache, out=out, cu_seqlens_q=cu_q, max_seqlen_q=max_q, seqused_k=seq_lens,
        max_seqlen_k=int(seq_lens.max()), softmax_scale=q.shape[-1] ** -0.5, causal=True, alibi_slopes=None,
        window_size=list(window), block_table=table, softcap=softcap, scheduler_metadata=None,
        fa_version=3, q_descale=None, k_descale=None, v_descale=None, num_splits=0, s_aux=None)
    return out
