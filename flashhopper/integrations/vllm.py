"""The call vLLM's FlashAttention backend makes, on flashhopper.

vLLM does not call FA3's `flash_attn_interface`: its v1 backend calls its own fork's
`vllm_flash_attn.flash_attn_varlen_func`, whose arguments come in another order (max_seqlen_q before
cu_seqlens_q) and which takes the paged cache directly: k and v are the caches (num_blocks,
block_size, heads_k, d), `block_table` (num_seqs, max_blocks) int32 and `seqused_k` each sequence's
length, `out=` preallocated. The KV cache is written beforehand (reshape_and_cache_flash), so there is
no append. Decode and prefill (chunked included) are the same call: each sequence's queries are its
last tokens, causal aligned bottom-right.

`flash_attn_varlen_func` here has that signature. With a block table it runs flashhopper's
`flash_attn_with_kvcache` over the pages (no append); without, flashhopper's varlen forward. What
flashhopper does not have raises NotImplementedError naming it: q_v, dropout, ALiBi, attention sinks
(s_aux), FP8 caches (descales) and context parallelism.
"""

from __future__ import annotations

from flashhopper.interface import flash_attn_varlen_func as _attn_varlen
from flashhopper.kvcache import flash_attn_with_kvcache as _attn_kvcache


def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None,
                           seqused_k=None, q_v=None, dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=None, softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None, return_softmax_lse=False, out=None,
                           scheduler_metadata=None, q_descale=None, k_descale=None, v_descale=None,
                           num_splits=0, fa_version=3, s_aux=None, cp_world_size=1, cp_rank=0,
                           cp_tot_seqused_k=None):
    """vllm_flash_attn.flash_attn_varlen_func's arguments: out (total_q, hq, d), or (out, lse
    (hq, total_q)) with return_softmax_lse."""
    missing = {"q_v": q_v is not None, "dropout_p > 0": bool(dropout_p),
               "alibi_slopes": alibi_slopes is not None,
               "s_aux (attention sinks)": s_aux is not None,
               "q_descale / k_descale / v_descale (FP8)": any(x is not None for x in (q_descale, k_descale,
                                                                                       v_descale)),
               "context parallelism (cp_world_size > 1)": cp_world_size != 1,
               "return_attn_probs": bool(return_attn_probs)}
    if names := [name for name, given in missing.items() if given]:
        raise NotImplementedError(f"flash_attn_varlen_func: {', '.join(names)} not supported by flashhopper")
    if fa_version != 3:
        raise ValueError(f"fa_version={fa_version!r}: flashhopper stands in for FA3 (fa_version=3)")
    window = (-1, -1) if window_size is None else tuple(window_size)
    if block_table is not None:
        if seqused_k is None:
            raise ValueError("block_table needs seqused_k (each sequence's length in the cache)")
        block = k.shape[1]
        table = block_table[:, : -(-int(max_seqlen_k) // block)]  # the blocks any sequence may use
        result = _attn_kvcache(q, k, v, cache_seqlens=seqused_k, page_table=table, cu_seqlens_q=cu_seqlens_q,
                               max_seqlen_q=int(max_seqlen_q), softmax_scale=softmax_scale, causal=causal,
                               window_size=window, softcap=softcap, num_splits=num_splits, out=out,
                               return_lse=bool(return_softmax_lse))
        return result
    if cu_seqlens_k is None:
        raise ValueError("without block_table, cu_seqlens_k is required")
    result = _attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                          seqused_k=seqused_k, softmax_scale=softmax_scale, causal=causal, window_size=window,
                          softcap=softcap, deterministic=deterministic, return_lse=bool(return_softmax_lse))
    o = result[0] if return_softmax_lse else result
    if out is not None:
        out.copy_(o)
        o = out
    return (o, result[1]) if return_softmax_lse else o
