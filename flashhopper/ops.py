"""`torch.ops.flashhopper.fwd` / `bwd`: the Hopper kernels as PyTorch custom operators.

torch.compile cannot trace into the CuTe DSL launch (TVM-FFI calls, data pointers), so under
`torch.compile` `flash_attn_func` calls these opaque operators instead: their fake implementations
give the output shapes to the compiler, their real ones run the same `flashhopper.hopper` functions
as eager mode, and the forward's registered autograd formula calls the backward operator, so
`fullgraph=True` compiles attention, its gradient and the code around them without a graph break.

Eager calls keep the plain autograd.Function in interface.py. Dispatching through a custom operator
costs Python time a small call would feel: on the 2-core CPU machine, with a stub in place of the
kernel, ops.fwd took 18-25 us a call against 4 us for the same checks and stub called directly, and
65 us when an input requires grad.

Checks that need real tensors (data pointers for TMA alignment, the GPU's compute capability) run in
the real implementations; the fake ones check only what shapes and dtypes tell.
"""

from __future__ import annotations

import importlib

import torch

from flashhopper import validation
from flashhopper.validation import check_layouts, layout_problem


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """The kernels read through TMA (the layout the inputs are validated for). Gradients handed to
    backward (expanded, sliced) need not have it; copy those (a clone, not .contiguous(): a
    contiguous view at an unaligned offset would come back as it is)."""
    return t if layout_problem("dout", t) is None else t.clone(memory_format=torch.contiguous_format)


def _kernels():
    # imported on first use so that importing flashhopper never pulls in the CuTe DSL (and through
    # sys.modules, where the CPU tests put their stand-ins)
    return importlib.import_module("flashhopper.hopper")


@torch.library.custom_op("flashhopper::fwd", mutates_args=())
def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool,
        window_left: int, window_right: int, softcap: float, deterministic: bool
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of attention; `deterministic` is the backward's, carried for the autograd formula."""
    validation.require_hopper(q)
    check_layouts(("q", q), ("k", k), ("v", v))
    return _kernels().forward(q, k, v, softmax_scale, causal, (window_left, window_right), softcap)


@fwd.register_fake
def _(q, k, v, softmax_scale, causal, window_left, window_right, softcap, deterministic):
    b, sq, h, _ = q.shape
    return q.new_empty((b, sq, h, v.shape[-1])), q.new_empty((b, h, sq), dtype=torch.float32)


@torch.library.custom_op("flashhopper::bwd", mutates_args=())
def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, softmax_scale: float, causal: bool, window_left: int, window_right: int,
        softcap: float, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from the forward's out and lse."""
    validation.require_hopper(q)
    check_layouts(("q", q), ("k", k), ("v", v), ("out", out))
    return _kernels().backward(q, k, v, out, tma_ready(dout), lse, softmax_scale, causal,
                               (window_left, window_right), softcap, deterministic=deterministic)


@bwd.register_fake
def _(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap, deterministic):
    # as the real one allocates: dq contiguous, dk / dv like k / v
    return q.new_empty(q.shape), torch.empty_like(k), torch.empty_like(v)


@torch.library.custom_op("flashhopper::fwd_fp8", mutates_args=())
def fwd_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_descale: torch.Tensor | None,
            k_descale: torch.Tensor | None, v_descale: torch.Tensor | None, softmax_scale: float,
            causal: bool, window_left: int, window_right: int, softcap: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out bf16, lse) of attention over float8_e4m3fn q, k, v (forward only: no autograd formula); the
    descales as flash_attn_func takes them (per (batch, kv head), or q's and k's per token), checked
    there (validation.check_descales, which shapes alone decide under torch.compile too)."""
    validation.require_hopper(q)
    validation.check_fp8_call(q, k, v)
    check_layouts(("q", q), ("k", k), ("v", v))
    return _kernels().forward(q, k, v, softmax_scale, causal, (window_left, window_right), softcap,
                              descales=(q_descale, k_descale, v_descale))


@fwd_fp8.register_fake
def _(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal, window_left, window_right, softcap):
    b, sq, h, _ = q.shape
    return (q.new_empty((b, sq, h, v.shape[-1]), dtype=torch.bfloat16),
            q.new_empty((b, h, sq), dtype=torch.float32))


@torch.library.custom_op("flashhopper::fwd_varlen", mutates_args=())
def fwd_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
               cu_seqlens_k: torch.Tensor, seqused_q: torch.Tensor | None, seqused_k: torch.Tensor | None,
               max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int,
               window_right: int, softcap: float, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse (heads, total_q)) of attention over packed sequences; max_seqlen_k and
    `deterministic` are the backward's, carried for the autograd formula."""
    validation.require_hopper(q)
    validation.check_varlen_call(q, k, v, seqused_q, seqused_k)
    check_layouts(*((name, t) for name, t in (("q", q), ("k", k), ("v", v)) if t.numel()))
    return _kernels().forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, seqused_q, seqused_k,
                                     softmax_scale, causal, (window_left, window_right), softcap,
                                     max_seqlen_k=max_seqlen_k)


@fwd_varlen.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale,
      causal, window_left, window_right, softcap, deterministic):
    total_q, h, _ = q.shape
    return q.new_empty((total_q, h, v.shape[-1])), q.new_empty((h, total_q), dtype=torch.float32)


@torch.library.custom_op("flashhopper::bwd_varlen", mutates_args=())
def bwd_varlen(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
               seqused_q: torch.Tensor | None, seqused_k: torch.Tensor | None, max_seqlen_q: int,
               max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int, window_right: int,
               softcap: float, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of the varlen forward from its out and lse (zero past seqused_q / seqused_k)."""
    validation.require_hopper(q)
    return _kernels().backward_varlen(q, k, v, out, tma_ready(dout), lse, cu_seqlens_q, cu_seqlens_k,
                                      max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                      (window_left, window_right), softcap, deterministic=deterministic,
                                      seqused_q=seqused_q, seqused_k=seqused_k)


@bwd_varlen.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
      softmax_scale, causal, window_left, window_right, softcap, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context_varlen(ctx, inputs, output):
    q, k, v, cu_q, cu_k, used_q, used_k, *config = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, used_q, used_k)
    ctx.config = tuple(config)
    ctx.mark_non_differentiable(lse)


def _backward_varlen(ctx, dout, dlse):
    if dout is None:
        return (None,) * 15
    q, k, v, out, lse, cu_q, cu_k, used_q, used_k = ctx.saved_tensors
    dq, dk, dv = bwd_varlen(dout, q, k, v, out, lse, cu_q, cu_k, used_q, used_k, *ctx.config)
    return (dq, dk, dv) + (None,) * 12


fwd_varlen.register_autograd(_backward_varlen, setup_context=_setup_context_varlen)


def _setup_context(ctx, inputs, output):
    q, k, v, *config = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.config = tuple(config)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    if dout is None:
        return (None,) * 9
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = bwd(dout, q, k, v, out, lse, *ctx.config)
    return (dq, dk, dv) + (None,) * 6


fwd.register_autograd(_backward, setup_context=_setup_context)
