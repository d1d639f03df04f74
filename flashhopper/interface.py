"""Public entry point: `flash_attn_func`."""

from __future__ import annotations

import torch

from flashhopper import ops, validation
from flashhopper.reference import attention_ref, attention_varlen_ref, dequantize_fp8
from flashhopper.validation import (
    FP8_DTYPES,
    check_backend,
    check_descales,
    check_flag,
    check_fp8_call,
    check_split_hdims_call,
    check_tensors,
    check_varlen_call,
    check_varlen_tensors,
    normalize_scale,
    normalize_softcap,
    normalize_window,
)


def flash_attn_func(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    deterministic=False,
    return_lse=False,
    backend="auto",
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    """Attention over (batch, seqlen, heads, headdim) tensors.

    q: (b, sq, hq, d); k, v: (b, sk, hk, d) with hq a multiple of hk (GQA/MQA). fp16 or bf16, or
    float8_e4m3fn (forward only, bf16 output; FA3's convention): then q_descale, k_descale,
    v_descale are None (1) or float32 (batch, heads_k) tensors (an expanded scalar is fine) by which
    the stored values are multiplied; q_descale and k_descale may also come per token, (b, hq, sq) and
    (b, hk, sk) (per-block quantization: flashhopper.fp8.quantize(x, "block")), any strides.
    softmax_scale defaults to 1/sqrt(d). causal aligns the diagonal bottom-right when sq != sk.
    window_size=(left, right) limits each query to keys in [i + sk - sq - left, i + sk - sq + right];
    -1 leaves a side unbounded. softcap > 0 maps scores to softcap * tanh(scores / softcap).
    backend: "hopper" runs the sm_90a kernels, "reference" the exact float64 reference (any device,
    slow, differentiable), "auto" is "hopper" for now.

    Returns out (q.dtype, bf16 for FP8; (b, sq, hq, d)) or (out, lse) with lse float32 (b, hq, sq),
    natural log; rows that see no key give out = 0 and lse = -inf.
    """
    backend = check_backend(backend)
    compiling = torch.compiler.is_compiling()
    # torch.compile traces fake tensors, which have no data pointer: the custom operator checks the
    # layouts on the real ones
    check_tensors(q, k, v, layout=not compiling)
    scale = normalize_scale(softmax_scale, int(q.shape[-1]))  # int(): a static head dim under torch.compile
    causal = check_flag("causal", causal)
    window = normalize_window(window_size)
    softcap = normalize_softcap(softcap)
    deterministic = check_flag("deterministic", deterministic)
    return_lse = check_flag("return_lse", return_lse)
    descales = check_descales(q, k, (q_descale, k_descale, v_descale))
    check_split_hdims_call(q, k, v)

    if q.dtype in FP8_DTYPES:
        out, lse = _fp8_forward(q, k, v, descales, scale, causal, window, softcap, backend, compiling,
                                need_lse=return_lse)
    elif backend == "reference":
        out, lse = attention_ref(q, k, v, scale, causal, window, softcap)
        out = out.to(q.dtype)
    elif compiling:  # opaque to the compiler; its autograd formula calls ops.bwd
        out, lse = ops.fwd(q, k, v, scale, causal, window[0], window[1], softcap, deterministic)
    else:
        validation.require_hopper(q, backend)
        if validation.needs_grad(q, k, v):
            out, lse = _HopperAttention.apply(q, k, v, scale, causal, window, softcap, deterministic)
        else:  # inference: skip autograd's bookkeeping, it is a visible share of a small call
            from flashhopper.hopper import forward
            from flashhopper.kvcache import dense_decode

            # a decode (a few query tokens an item) by the decode paths: PackGQA, the split of the keys
            decoded = dense_decode(q, k, v, scale, causal, window, softcap)
            out, lse = decoded if decoded is not None else forward(q, k, v, scale, causal, window, softcap)
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    seqused_q=None,
    seqused_k=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    deterministic=False,
    return_lse=False,
    backend="auto",
    page_table=None,
    out=None,
):
    """Attention over sequences packed along the token dimension, with no padding.

    q: (total_q, hq, d), k, v: (total_k, hk, d); sequence i holds rows cu_seqlens_q[i] to
    cu_seqlens_q[i + 1] of q (cu_seqlens_k likewise for k, v), int32 tensors of batch + 1 entries on
    q's device; max_seqlen_q / _k are Python ints at least every sequence's length. seqused_q / _k
    (int32, (batch,)) limit each sequence to its first seqused tokens. Masks, softcap, GQA, dtypes
    and head dims as flash_attn_func, the causal diagonal aligned bottom-right per sequence.

    Returns out (total_q, hq, d) or (out, lse) with lse float32 (hq, total_q). A row that sees no key
    gives 0 and lse = -inf, also when total_k is 0 (FA3 returns +inf there). Rows past a sequence's
    seqused_q are not written (they keep what the output held: undefined). K and V rows past a
    sequence's seqused_k may hold anything, NaN too (the kernel masks them and zeroes their V rows).
    The bounds' types and shapes are checked (check_varlen_tensors says which properties are the
    caller's contract); backend="reference" (exact float64 per sequence, any device) checks all.
    Differentiable (dq, dk, dv; `deterministic` makes dq bitwise reproducible), head dims (192, 128)
    included. Through seqused_q / seqused_k: rows past a sequence's seqused_q get dq = 0 and their
    gradient (and out, lse) is not read, keys past its seqused_k get dk = dv = 0 and are not seen; there
    q, k, v and the gradient may hold anything, NaN too (the kernels zero those rows in shared memory;
    FA3 reads them as they are and leaves their gradients unwritten). Otherwise non-finite values in
    one sequence's q, k, v or gradient may reach the gradients of its neighbours (the kernels read a
    tile past a sequence's end from the next one and zero its contribution arithmetically). Under
    torch.compile it runs as the custom operators torch.ops.flashhopper.fwd_varlen / bwd_varlen.

    A paged KV cache (vLLM's path, inference only): k, v the caches (num_pages, page_size, hk, d),
    page_table (batch, max_pages) int32, seqused_k each sequence's length (required), cu_seqlens_k
    unused (None); it runs flash_attn_with_kvcache over the pages with no append. out: an optional
    preallocated (total_q, hq, dv) output.
    """
    if page_table is not None:
        return _varlen_paged(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                             page_table, softmax_scale, causal, window_size, softcap, return_lse, backend,
                             out)
    backend = check_backend(backend)
    compiling = torch.compiler.is_compiling()
    check_varlen_tensors(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                         seqused_k, layout=not compiling)
    check_split_hdims_call(q, k, v)
    scale = normalize_scale(softmax_scale, int(q.shape[-1]))
    causal = check_flag("causal", causal)
    window = normalize_window(window_size)
    softcap = normalize_softcap(softcap)
    deterministic = check_flag("deterministic", deterministic)
    return_lse = check_flag("return_lse", return_lse)
    if out is not None:
        _check_varlen_out(out, q, v, validation.needs_grad(q, k, v))
    buffer = out
    if backend == "reference":
        out, lse = attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, scale,
                                        causal, window, softcap)
        out = out.to(q.dtype)
    elif compiling:  # opaque to the compiler (max_seqlen_q is an int argument of the operator)
        out, lse = ops.fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                                  max_seqlen_k, scale, causal, window[0], window[1], softcap, deterministic)
    else:
        validation.require_hopper(q, backend)
        check_varlen_call(q, k, v, seqused_q, seqused_k)
        if validation.needs_grad(q, k, v):
            out, lse = _HopperVarlenAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q,
                                                    seqused_k, max_seqlen_q, max_seqlen_k, scale, causal,
                                                    window, softcap, deterministic)
        else:
            from flashhopper.hopper import forward_varlen

            out, lse = forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, seqused_q, seqused_k,
                                      scale, causal, window, softcap, out=buffer, max_seqlen_k=max_seqlen_k)
    if buffer is not None and out.data_ptr() != buffer.data_ptr():
        buffer.copy_(out)
        out = buffer
    return (out, lse) if return_lse else out


def _check_varlen_out(out, q, v, grad: bool) -> None:
    want = (*q.shape[:-1], v.shape[-1])
    if (not isinstance(out, torch.Tensor) or tuple(out.shape) != want or out.dtype != q.dtype
            or out.device != q.device):
        raise ValueError(f"out must be a {q.dtype} tensor of shape {want} on {q.device}, got "
                         f"{getattr(out, 'dtype', type(out))} {tuple(getattr(out, 'shape', ()))}")
    if grad:
        raise ValueError("out= is for inference: the inputs require grad (the output must be autograd's own)")


def _varlen_paged(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, page_table,
                  softmax_scale, causal, window_size, softcap, return_lse, backend, out):
    """flash_attn_varlen_func over a paged cache: flash_attn_with_kvcache with no append."""
    from flashhopper.kvcache import flash_attn_with_kvcache

    if seqused_k is None:
        raise ValueError("page_table needs seqused_k: each sequence's length in the paged cache")
    if seqused_q is not None:
        raise NotImplementedError("seqused_q with page_table is not supported: pack only the queries in use")
    if not isinstance(max_seqlen_k, int) or isinstance(max_seqlen_k, bool) or max_seqlen_k < 0:
        raise TypeError(f"max_seqlen_k must be a Python int >= 0, got {max_seqlen_k!r}")
    page = k.shape[1] if k.dim() == 4 else 0
    if page < 1:
        raise ValueError("with page_table, k and v are paged caches (num_pages, page_size, heads_k, "
                         f"headdim); got k of shape {tuple(k.shape)}")
    table = page_table[:, : -(-max_seqlen_k // page)] if isinstance(page_table, torch.Tensor) else page_table
    return flash_attn_with_kvcache(q, k, v, cache_seqlens=seqused_k, page_table=table,
                                   cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                                   softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                   softcap=softcap, out=out, return_lse=return_lse, backend=backend)


class _HopperVarlenAttention(torch.autograd.Function):
    """flash_attn_varlen_func with gradients."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, used_q, used_k, max_q, max_k, scale, causal, window, softcap,
                deterministic):
        from flashhopper.hopper import forward_varlen

        out, lse = forward_varlen(q, k, v, cu_q, cu_k, max_q, used_q, used_k, scale, causal, window, softcap,
                                  max_seqlen_k=max_k)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, used_q, used_k)
        ctx.config = (max_q, max_k, scale, causal, window, softcap, deterministic)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        from flashhopper.hopper import backward_varlen

        if dout is None:
            return (None,) * 14
        q, k, v, out, lse, cu_q, cu_k, used_q, used_k = ctx.saved_tensors
        max_q, max_k, scale, causal, window, softcap, deterministic = ctx.config
        dq, dk, dv = backward_varlen(q, k, v, out, ops.tma_ready(dout), lse, cu_q, cu_k, max_q, max_k, scale,
                                     causal, window, softcap, deterministic=deterministic, seqused_q=used_q,
                                     seqused_k=used_k)
        return (dq, dk, dv) + (None,) * 11


def _fp8_forward(q, k, v, descales, scale, causal, window, softcap, backend, compiling, need_lse=True):
    if backend == "reference":
        out, lse = attention_ref(*dequantize_fp8(q, k, v, descales), scale, causal, window, softcap)
        return out.to(torch.bfloat16), lse
    if compiling:
        return ops.fwd_fp8(q, k, v, *descales, scale, causal, window[0], window[1], softcap)
    validation.require_hopper(q, backend)
    check_fp8_call(q, k, v)
    from flashhopper.hopper import forward

    # without the LSE the kernel may take its row sums from the tensor cores (plan.fp8_row_sum)
    return forward(q, k, v, scale, causal, window, softcap, descales=descales, need_lse=need_lse)


class _HopperAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, window, softcap, deterministic):
        # Imported here so that importing flashhopper never pulls in the CuTe DSL.
        from flashhopper.hopper import forward

        out, lse = forward(q, k, v, scale, causal, window, softcap)
        ctx.mark_non_differentiable(lse)
        # lse never has a gradient: without this autograd would fill a zero tensor for it every step
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.config = (scale, causal, window, softcap, deterministic)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        from flashhopper.hopper import backward

        if dout is None:  # no gradient reached out (grads are not materialized)
            return (None,) * 8
        q, k, v, out, lse = ctx.saved_tensors
        scale, causal, window, softcap, deterministic = ctx.config
        dq, dk, dv = backward(q, k, v, out, ops.tma_ready(dout), lse, scale, causal, window, softcap,
                              deterministic=deterministic)
        return dq, dk, dv, None, None, None, None, None

