"""flash_attn_func under torch.compile, on CPU: the custom operators (flashhopper/ops.py) with CPU
stand-ins for the kernels. The same tests on the H200 with the real kernels, plus CUDA graphs, are in
tests/test_torch_compile_gpu.py."""

import math
import sys
import types

import pytest
import torch

import flashhopper
from flashhopper import flash_attn_func, ops
from flashhopper.reference import attention_grads_flash_rounding, attention_ref

BF16 = torch.bfloat16


@pytest.fixture
def cpu_kernels(monkeypatch):
    """flashhopper.hopper's forward / backward computed on CPU, recording their calls. The backward
    is explicit (no autograd inside: a custom operator's implementation runs below autograd)."""
    calls = []

    def forward(q, k, v, softmax_scale, causal, window_size, softcap):
        calls.append(("fwd", softmax_scale, causal, window_size, softcap))
        out, lse = attention_ref(q, k, v, softmax_scale, causal, window_size, softcap)
        return out.to(q.dtype).contiguous(), lse.float().contiguous()

    def backward(q, k, v, out, dout, lse, softmax_scale, causal, window_size, softcap, deterministic=False):
        calls.append(("bwd", softmax_scale, causal, window_size, softcap, deterministic, dout.stride(-1)))
        dq, dk, dv = attention_grads_flash_rounding(q, k, v, dout, softmax_scale, causal, window_size,
                                                    softcap)
        # the real backward's layouts: dq contiguous, dk / dv like k / v
        return dq.contiguous(), torch.empty_like(k).copy_(dk), torch.empty_like(v).copy_(dv)

    monkeypatch.setitem(sys.modules, "flashhopper.hopper",
                        types.SimpleNamespace(forward=forward, backward=backward))
    monkeypatch.setattr(flashhopper.validation, "require_hopper", lambda q, backend="hopper": None)
    torch._dynamo.reset()
    yield calls
    torch._dynamo.reset()


def qkv(b=2, sq=17, sk=None, h=4, hk=None, d=64, requires_grad=True, dtype=BF16):
    sk, hk = sq if sk is None else sk, h if hk is None else hk
    ts = (torch.randn(b, sq, h, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype),
          torch.randn(b, sk, hk, d, dtype=dtype))
    return tuple(t.requires_grad_(requires_grad) for t in ts)


def step(fn, q, k, v, w):
    """out and the gradients of a weighted sum (a dout with real values, not an expanded one)."""
    out = fn(q, k, v)
    grads = torch.autograd.grad((out.float() * w).sum(), (q, k, v))
    return out, grads


KWARGS = [dict(causal=True), dict(window_size=(5, 3), softcap=2.0),
          dict(softmax_scale=0.3, deterministic=True)]


@pytest.mark.parametrize("kwargs", KWARGS, ids=["causal", "window_softcap", "scale_det"])
def test_fullgraph_forward_and_backward_through_the_operators(cpu_kernels, kwargs):
    q, k, v = qkv(sq=17, sk=29, h=4, hk=2)
    w = torch.randn(2, 17, 4, 64)

    def attn(q, k, v):
        return flash_attn_func(q, k, v, **kwargs)

    out, grads = step(torch.compile(attn, fullgraph=True, backend="aot_eager"), q, k, v, w)
    compiled_calls = list(cpu_kernels)
    cpu_kernels.clear()
    want_out, want_grads = step(attn, q, k, v, w)  # eager: the autograd.Function, same stand-ins
    assert compiled_calls == cpu_kernels and [c[0] for c in cpu_kernels] == ["fwd", "bwd"]
    assert torch.equal(out, want_out)
    for got, want in zip(grads, want_grads, strict=True):
        assert got.dtype == BF16 and torch.equal(got, want)


def test_compiled_return_lse_and_no_grad(cpu_kernels):
    q, k, v = qkv(requires_grad=False)
    fn = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True, return_lse=True), fullgraph=True,
                       backend="aot_eager")
    out, lse = fn(q, k, v)
    want_out, want_lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse) and lse.dtype == torch.float32
    q.requires_grad_()
    out, lse = fn(q, k, v)
    assert out.requires_grad and not lse.requires_grad


def test_dynamic_shapes_compile_once(cpu_kernels):
    """Sequence lengths and batch vary without a recompile per shape (inductor, dynamic=True)."""
    from torch._dynamo.utils import counters

    counters.clear()
    fn = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True), fullgraph=True, dynamic=True)
    # no size 1 or 2 (the heads) nor sq == sk, which dynamo would specialize on or tie together
    for b, sq, sk in ((3, 17, 23), (5, 33, 50), (3, 9, 40)):
        q, k, v = qkv(b=b, sq=sq, sk=sk, h=2, hk=1)
        w = torch.randn(b, sq, 2, 64)
        out, grads = step(fn, q, k, v, w)
        want_out, want_grads = step(lambda q, k, v: flash_attn_func(q, k, v, causal=True), q, k, v, w)
        assert torch.equal(out, want_out)
        assert all(torch.equal(a, b) for a, b in zip(grads, want_grads, strict=True))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.parametrize("kwargs", KWARGS, ids=["causal", "window_softcap", "scale_det"])
def test_opcheck(cpu_kernels, kwargs):
    """torch.library.opcheck: schema, fake against real outputs (shapes, strides, dtypes), autograd
    registration, AOT dispatch with dynamic shapes."""
    q, k, v = qkv(sq=9, sk=20, h=4, hk=1, requires_grad=False)
    scale = kwargs.get("softmax_scale", 1 / math.sqrt(64))
    window = kwargs.get("window_size", (-1, -1))
    args = (scale, kwargs.get("causal", False), *window, kwargs.get("softcap", 0.0),
            kwargs.get("deterministic", False))
    torch.library.opcheck(ops.fwd, (q, k, v, *args))
    torch.library.opcheck(ops.fwd, (q.requires_grad_(), k, v.requires_grad_(), *args))
    out, lse = ops.fwd(q.detach(), k, v.detach(), *args)
    dout = torch.randn_like(out)
    torch.library.opcheck(ops.bwd, (dout, q.detach(), k, v.detach(), out, lse, *args))


def test_compiled_dout_of_a_sum_is_made_tma_ready(cpu_kernels):
    """The gradient of .sum() reaches the backward operator expanded (stride 0): it must copy it."""
    q, k, v = qkv()
    fn = torch.compile(lambda q, k, v: flash_attn_func(q, k, v), fullgraph=True, backend="aot_eager")
    out = fn(q, k, v)
    out.sum().backward()
    assert cpu_kernels[-1][0] == "bwd" and cpu_kernels[-1][-1] == 1


def test_compiled_validation_messages(cpu_kernels):
    """Shape / dtype errors come from the traced Python; layout errors from the operator, which
    sees real tensors."""
    fn = torch.compile(lambda q, k, v: flash_attn_func(q, k, v), backend="aot_eager")
    q, k, v = qkv(requires_grad=False)
    with pytest.raises(Exception, match=r"q has dtype torch\.float32"):
        fn(q.float(), k, v)
    with pytest.raises(Exception, match=r"headdim \(q\.shape\[-1\]\) is 80"):
        fn(*qkv(d=80, requires_grad=False))
    flat = torch.randn(q.numel() + 8, dtype=BF16)
    misaligned = flat[1:1 + q.numel()].view(q.shape)
    with pytest.raises(ValueError, match=r"q\.data_ptr\(\) is not 16-byte aligned"):
        fn(misaligned, k, v)


def test_operator_on_cpu_tensors_points_to_reference():
    """Without the stand-ins the operator's real implementation refuses CPU tensors clearly."""
    q, k, v = qkv(requires_grad=False)
    with pytest.raises(RuntimeError, match=r"Hopper GPU \(H100/H200, sm_90\)"):
        ops.fwd(q, k, v, 0.125, False, -1, -1, 0.0, False)


@pytest.fixture
def cpu_varlen(monkeypatch):
    """flashhopper.hopper.forward_varlen on CPU (the per-sequence reference), recording max_seqlen_q."""
    from flashhopper.reference import attention_varlen_ref

    calls = []

    def forward_varlen(q, k, v, cu_q, cu_k, max_q, used_q, used_k, scale, causal, window, softcap,
                       max_seqlen_k=None):
        calls.append(max_q)
        out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, used_q, used_k, scale, causal, window, softcap)
        return out.to(q.dtype), lse

    def backward_varlen(q, k, v, out, dout, lse, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap,
                        deterministic=False, seqused_q=None, seqused_k=None):
        """Explicit per used sequence (a custom operator's implementation runs below autograd), zero
        elsewhere; dq, dk, dv like q, k, v (the real backward's layouts)."""
        calls.append(("bwd", seqused_q, seqused_k))
        grads = [torch.zeros_like(x) for x in (q, k, v)]
        for i in range(cu_q.shape[0] - 1):
            lq = int(cu_q[i + 1] - cu_q[i]) if seqused_q is None else int(seqused_q[i])
            lk = int(cu_k[i + 1] - cu_k[i]) if seqused_k is None else int(seqused_k[i])
            rows, keys = slice(int(cu_q[i]), int(cu_q[i]) + lq), slice(int(cu_k[i]), int(cu_k[i]) + lk)
            if lq and lk:
                seq = attention_grads_flash_rounding(q[None, rows], k[None, keys], v[None, keys],
                                                     dout[None, rows], scale, causal, window, softcap)
                for g, part, idx in zip(grads, seq, (rows, keys, keys), strict=True):
                    g[idx] = part[0]
        return tuple(grads)

    kernels = types.SimpleNamespace(forward_varlen=forward_varlen, backward_varlen=backward_varlen)
    monkeypatch.setitem(sys.modules, "flashhopper.hopper", kernels)
    monkeypatch.setattr(flashhopper.validation, "require_hopper", lambda q, backend="hopper": None)
    monkeypatch.setenv(flashhopper.validation.SEQUSED_BWD_OPT_IN, "1")
    torch._dynamo.reset()
    yield calls
    torch._dynamo.reset()


@pytest.mark.parametrize("dynamic", [None, True])
def test_varlen_max_seqlen_is_no_compile_key(cpu_varlen, dynamic):
    """20 steps, each with another packing and max_seqlen: with dynamic=True one compile and no
    recompile; by default torch's automatic dynamic shapes recompile once (at the first change of
    the shapes and ints), then never again: max_seqlen enters no guard."""
    from torch._dynamo.testing import CompileCounter

    from flashhopper import flash_attn_varlen_func

    counter = CompileCounter()
    def attend(q, k, v, cq, ck, mq, mk):
        return flash_attn_varlen_func(q, k, v, cq, ck, mq, mk, causal=True)

    fn = torch.compile(attend, backend=counter, fullgraph=True, dynamic=dynamic)
    for step in range(20):
        lens = [5 + step, 3, 7 + 2 * step]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        q = torch.randn(sum(lens), 4, 64, dtype=BF16)
        k, v = torch.randn(sum(lens), 2, 64, dtype=BF16), torch.randn(sum(lens), 2, 64, dtype=BF16)
        out = fn(q, k, v, cu, cu, max(lens), max(lens))
        want = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True, backend="reference")
        assert torch.equal(out, want)
    assert cpu_varlen == [7 + 2 * s for s in range(20)]  # the op saw every step's max_seqlen_q
    assert counter.frame_count == (1 if dynamic else 2)


def test_varlen_gradients_through_seqused_under_compile(cpu_varlen):
    """flash_attn_varlen_func with seqused_q / seqused_k and gradients, fullgraph: the operators carry
    the used lengths to the backward (torch.ops.flashhopper.bwd_varlen), whose gradients match the
    eager autograd.Function's and the reference backend's; rows past them get zero gradients although
    q, k, v and dout hold NaN there. opcheck: the backward operator's schema and fake."""
    from flashhopper import flash_attn_varlen_func

    lens_q, lens_k, used_q, used_k = [6, 9, 4], [8, 5, 7], [4, 9, 0], [8, 2, 7]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                  for n in (lens_q, lens_k))
    uq, uk = torch.tensor(used_q, dtype=torch.int32), torch.tensor(used_k, dtype=torch.int32)
    q, dout = torch.randn(sum(lens_q), 4, 64, dtype=BF16), torch.randn(sum(lens_q), 4, 64, dtype=BF16)
    k, v = torch.randn(sum(lens_k), 2, 64, dtype=BF16), torch.randn(sum(lens_k), 2, 64, dtype=BF16)
    for x, starts, used in ((q, cu_q, used_q), (dout, cu_q, used_q), (k, cu_k, used_k), (v, cu_k, used_k)):
        for i, n in enumerate(used):
            x[int(starts[i]) + n:int(starts[i + 1])] = float("nan")

    def attend(q, k, v, backend="auto"):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 8, seqused_q=uq, seqused_k=uk, causal=True,
                                      backend=backend)

    def grads(fn, **kw):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(fn(*leaves, **kw), leaves, dout)

    compiled = grads(torch.compile(attend, fullgraph=True, backend="aot_eager"))
    assert ("bwd", uq, uk) in [c for c in cpu_varlen if isinstance(c, tuple)]
    for got, eager, ref in zip(compiled, grads(attend), grads(attend, backend="reference"), strict=True):
        assert not got.isnan().any() and torch.equal(got, eager)
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
    args = (cu_q, cu_k, uq, uk, 9, 8, 0.125, True, -1, 0, 0.0, False)
    out, lse = ops.fwd_varlen(q, k, v, *args)
    torch.library.opcheck(ops.bwd_varlen, (dout, q, k, v, out, lse, *args))


def test_split_head_dims_through_the_operators(cpu_kernels):
    """(192, 128) under torch.compile: the forward and backward operators with a value head dim of 128
    (fake shapes included: opcheck), gradients as in eager mode."""
    q = torch.randn(2, 17, 4, 192, dtype=BF16, requires_grad=True)
    k = torch.randn(2, 29, 2, 192, dtype=BF16, requires_grad=True)
    v = torch.randn(2, 29, 2, 128, dtype=BF16, requires_grad=True)
    w = torch.randn(2, 17, 4, 128)

    def attn(q, k, v):
        return flash_attn_func(q, k, v, causal=True)

    out, grads = step(torch.compile(attn, fullgraph=True, backend="aot_eager"), q, k, v, w)
    want_out, want_grads = step(attn, q, k, v, w)
    assert out.shape == (2, 17, 4, 128) and torch.equal(out, want_out)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads, strict=True))
    args = (192 ** -0.5, True, -1, 0, 0.0, False)
    torch.library.opcheck(ops.fwd, (q, k, v, *args))
    out, lse = ops.fwd(q.detach(), k.detach(), v.detach(), *args)
    dout = torch.randn_like(out)
    torch.library.opcheck(ops.bwd, (dout, q.detach(), k.detach(), v.detach(), out, lse, *args))
