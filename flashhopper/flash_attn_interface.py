"""FlashAttention-3's Python names and returns (`hopper/flash_attn_interface.py`), on flashhopper.

    from flashhopper.flash_attn_interface import flash_attn_func, flash_attn_varlen_func

Code written for FA3 runs unchanged where it uses what flashhopper has: the same arguments, the
same results (out, or (out, softmax_lse) with return_attn_probs=True; LSE (b, h, s_q) dense and
(h, total_q) varlen), FP8 descales, causal aligned bottom-right, windows, softcap, GQA.
Scheduling hints FA3 takes (num_splits, pack_gqa) are accepted and left to flashhopper's own dispatch;
sm_margin leaves that many SMs free for other kernels, as FA3's does (flashhopper.sm_margin). What
flashhopper does not have raises NotImplementedError naming it: qv (MLA's absorbed query),
attention_chunk, and for now in flash_attn_with_kvcache rotary embedding, appending packed new keys
(cu_seqlens_k_new with k, v) and FP8 caches (a paged cache runs: pages read in place where the page size
allows, else through a contiguous copy of the table's span). Differences from FA3: a row that sees no
key has LSE -inf (FA3: +inf); the varlen backward through seqused_q / seqused_k gives zero gradients
past the used rows (FA3 leaves them unwritten); head dims (192, 128) have a backward (FA3's has none).
"""

from __future__ import annotations

from flashhopper.interface import flash_attn_func as _attn
from flashhopper.interface import flash_attn_varlen_func as _attn_varlen
from flashhopper.kvcache import flash_attn_with_kvcache as _attn_kvcache
from flashhopper.sms import check_margin
from flashhopper.sms import sm_margin as _sm_margin


def _unsupported(qv, attention_chunk, num_splits) -> None:
    if qv is not None:
        raise NotImplementedError("qv (MLA's absorbed query) is not supported by flashhopper")
    if attention_chunk:
        raise NotImplementedError(f"attention_chunk={attention_chunk}: not supported by flashhopper (0 only)")
    if not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (a hint: 0 or 1 = let the library decide), got "
                         f"{num_splits!r}")


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                    pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    """FA3's flash_attn_func: out (b, s_q, h, dv), or (out, softmax_lse (b, h, s_q)) with
    return_attn_probs."""
    _unsupported(qv, attention_chunk, num_splits)
    with _sm_margin(sm_margin):
        return _attn(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                     softcap=softcap, deterministic=deterministic, return_lse=bool(return_attn_probs),
                     q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None,
                           k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0,
                           softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
                           return_attn_probs=False):
    """FA3's flash_attn_varlen_func: out (total_q, h, dv), or (out, softmax_lse (h, total_q)) with
    return_attn_probs. FP8 descales are not taken by flashhopper's varlen yet."""
    _unsupported(qv, attention_chunk, num_splits)
    if any(d is not None for d in (q_descale, k_descale, v_descale)):
        raise NotImplementedError("varlen with FP8 descales is not supported by flashhopper yet")
    with _sm_margin(sm_margin):
        return _attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                            seqused_q=seqused_q, seqused_k=seqused_k, softmax_scale=softmax_scale,
                            causal=causal, window_size=window_size, softcap=softcap,
                            deterministic=deterministic, return_lse=bool(return_attn_probs))


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                            cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                            scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                            return_softmax_lse=False):
    """FA3's KV-cache entry point on flashhopper.flash_attn_with_kvcache: returns out, or (out,
    softmax_lse) with return_softmax_lse (FA3 code unpacks `o, lse, *rest`)."""
    _unsupported(qv, attention_chunk, num_splits)
    missing = {"rotary_cos / rotary_sin": rotary_cos is not None or rotary_sin is not None,
               # SGLang passes cu_seqlens_k_new with no k / v to append: then there is nothing to read it for
               "cu_seqlens_k_new with k, v (packed new keys)": cu_seqlens_k_new is not None and k is not None,
               "q_descale / k_descale / v_descale (FP8 caches)": any(
                   x is not None for x in (q_descale, k_descale, v_descale))}
    if names := [name for name, given in missing.items() if given]:
        raise NotImplementedError(f"flash_attn_with_kvcache: {', '.join(names)} not supported by flashhopper "
                                  "yet")
    with _sm_margin(sm_margin):
        return _attn_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                             cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                             page_table=page_table, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                             softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                             softcap=softcap, num_splits=num_splits, pack_gqa=pack_gqa,
                             scheduler_metadata=scheduler_metadata, return_lse=bool(return_softmax_lse))


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                           cache_seqlens, qkv_dtype=None, headdim_v=None, cu_seqlens_q=None,
                           cu_seqlens_k_new=None, cache_leftpad=None, page_size=None, max_seqlen_k_new=0,
                           causal=False, window_size=(-1, -1), attention_chunk=0, has_softcap=False,
                           num_splits=0, pack_gqa=None, sm_margin=0):
    """FA3's per-step scheduling plan, computed once and passed to every layer's call. flashhopper plans
    each call from static extents (flashhopper/splitkv.py), so this returns an int32 tensor of
    batch_size + 1 zeros on cache_seqlens' device that the calls accept and do not read (serving
    engines copy it into a buffer of their own sized for the batch)."""
    import torch

    if not isinstance(batch_size, int) or batch_size < 0:
        raise ValueError(f"batch_size must be an int >= 0, got {batch_size!r}")
    check_margin(sm_margin)
    device = cache_seqlens.device if hasattr(cache_seqlens, "device") else None
    return torch.zeros(batch_size + 1, dtype=torch.int32, device=device)


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """FA3's merge of split outputs: out_partial (splits, b, s, h, d) and lse_partial (splits, b, s, h),
    fp32, merged by their LSE; returns (out (b, s, h, d) in out_dtype (default out_partial's), lse
    (b, s, h)). A row with -inf in every split gives 0 and -inf."""

    if out_partial.dim() != 5 or lse_partial.shape != out_partial.shape[:-1]:
        raise ValueError(f"out_partial {tuple(out_partial.shape)} must be (splits, b, s, h, d) and "
                         f"lse_partial {tuple(lse_partial.shape)} its first four extents")
    import torch

    from flashhopper.splitkv import merge_by_lse

    if out is None:  # the merge written in out_dtype: no cast of its own
        out = torch.empty(out_partial.shape[1:], dtype=out_dtype or out_partial.dtype,
                          device=out_partial.device)
        return merge_by_lse(out_partial, lse_partial.float(), dim=0, out=out)
    merged, lse = merge_by_lse(out_partial, lse_partial.float(), dim=0)
    out.copy_(merged.to(out_dtype or out_partial.dtype))
    return out, lse


__all__ = ["flash_attn_combine", "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
           "get_scheduler_metadata"]
