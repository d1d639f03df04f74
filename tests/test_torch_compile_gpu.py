"""flash_attn_func under torch.compile and in CUDA graphs, on an sm_90 GPU (skipped elsewhere).

Compiled calls run the same kernels as eager ones through the custom operators (flashhopper/ops.py),
so with deterministic=True the outputs and gradients must be bitwise equal to eager mode's; eager
mode itself is checked against the float64 reference by the other GPU suites (and once here).
"""

from __future__ import annotations

import math

import pytest
import torch

from flashhopper import flash_attn_func, ops
from flashhopper.accuracy import check_grads

pytestmark = pytest.mark.gpu

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)

from flashhopper.hopper import runtime  # noqa: E402

DEV = "cuda"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def qkv(b, sq, sk, h, hk, d, requires_grad=True, dtype=torch.bfloat16):
    ts = (torch.randn(b, sq, h, d, device=DEV, dtype=dtype),
          torch.randn(b, sk, hk, d, device=DEV, dtype=dtype),
          torch.randn(b, sk, hk, d, device=DEV, dtype=dtype))
    return tuple(t.requires_grad_(requires_grad) for t in ts)


def step(fn, q, k, v, w):
    out = fn(q, k, v)
    return out, torch.autograd.grad((out.float() * w).sum(), (q, k, v))


CASES = [  # (b, sq, sk, h, hk, d, kwargs)
    (2, 1000, 1000, 4, 2, 64, dict(causal=True)),
    (1, 17, 300, 4, 1, 128, dict(window_size=(40, 7), softcap=3.0)),
    (2, 333, 700, 2, 2, 256, dict(causal=True)),
    (1, 128, 128, 4, 4, 96, dict(softmax_scale=0.2)),
]
IDS = ["h64_causal_gqa", "h128_window_softcap", "h256_causal", "h96_scale"]


@pytest.mark.parametrize("b,sq,sk,h,hk,d,kwargs", CASES, ids=IDS)
def test_compiled_matches_eager_bitwise(b, sq, sk, h, hk, d, kwargs):
    """fullgraph (no graph break), inductor; deterministic: the same bits as eager, gradients too."""
    torch.manual_seed(d + sq)
    q, k, v = qkv(b, sq, sk, h, hk, d)
    w = torch.randn(b, sq, h, d, device=DEV)

    def attn(q, k, v):
        return flash_attn_func(q, k, v, deterministic=True, **kwargs)

    out, grads = step(torch.compile(attn, fullgraph=True), q, k, v, w)
    want_out, want_grads = step(attn, q, k, v, w)
    assert torch.equal(out, want_out)
    for got, want in zip(grads, want_grads, strict=True):
        assert torch.equal(got, want)


def test_compiled_against_reference_dynamic_shapes():
    """dynamic=True over odd lengths with the default (atomic dQ) backward: the forward bitwise as
    eager; the gradients within 2x a plain bf16 backward's error against the float64 reference; one
    compiled graph for all the lengths."""
    from torch._dynamo.utils import counters

    counters.clear()

    def attn(q, k, v):
        return flash_attn_func(q, k, v, causal=True)

    fn = torch.compile(attn, fullgraph=True, dynamic=True)
    for b, sq, sk in ((3, 17, 23), (5, 1000, 1111), (3, 4097, 300)):  # no 1s, no ties: see the CPU test
        torch.manual_seed(sq)
        q, k, v = qkv(b, sq, sk, 4, 1, 128)
        dout = torch.randn(b, sq, 4, 128, device=DEV, dtype=q.dtype)
        out = fn(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        assert torch.equal(out, attn(q, k, v))
        scale = 1 / math.sqrt(128)
        check_grads(grads, q, k, v, dout, scale, True, (-1, -1), 0.0, out=out.detach(),
                    label=f" at {sq} x {sk}")
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.parametrize("b,sq,sk,h,hk,d,kwargs", CASES[:3], ids=IDS[:3])
def test_opcheck_real_kernels(b, sq, sk, h, hk, d, kwargs):
    """Fake against real outputs (shapes, strides, dtypes), schema, autograd registration."""
    q, k, v = qkv(b, sq, sk, h, hk, d, requires_grad=False)
    window = kwargs.get("window_size", (-1, -1))
    args = (kwargs.get("softmax_scale", 1 / math.sqrt(d)), kwargs.get("causal", False), *window,
            kwargs.get("softcap", 0.0), True)
    torch.library.opcheck(ops.fwd, (q, k, v, *args))
    out, lse = ops.fwd(q, k, v, *args)
    torch.library.opcheck(ops.bwd, (torch.randn_like(out), q, k, v, out, lse, *args))


def _forward_inputs(seed, d=128):
    torch.manual_seed(seed)
    return [qkv(b, sq, sk, h, hk, d, requires_grad=False)
            for b, sq, sk, h, hk in ((2, 1000, 1000, 4, 2), (1, 77, 300, 8, 8), (3, 511, 700, 2, 1))]


@pytest.mark.parametrize("dynamic_sched", [False, True])
def test_cuda_graph_forward(dynamic_sched, monkeypatch):
    """Captured forwards replayed on fresh inputs give eager's bits. With the dynamic scheduler
    (a tile counter), two graphs replay at once on two streams: each captured launch has its own
    counter, so neither takes the other's tiles."""
    monkeypatch.setattr(runtime, "persistent_ctas_cap", 7 if dynamic_sched else None)
    overrides = dict(persistent=True, dynamic_sched=True) if dynamic_sched else {}
    with runtime.config_overrides(**overrides):
        inputs = _forward_inputs(0)
        static = [tuple(t.clone() for t in x) for x in inputs]
        for x in static:  # warm-up (compiles) outside capture
            flash_attn_func(*x, causal=True)
        torch.cuda.synchronize()
        graphs, outs = [], []
        for x in static:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outs.append(flash_attn_func(*x, causal=True, return_lse=True))
            graphs.append(g)
        for rnd in range(3):
            fresh = _forward_inputs(1 + rnd)
            want = [flash_attn_func(*x, causal=True, return_lse=True) for x in fresh]
            for x, y in zip(static, fresh, strict=True):
                for s, t in zip(x, y, strict=True):
                    s.copy_(t)
            streams = [torch.cuda.Stream() for _ in graphs]
            for s in streams:
                s.wait_stream(torch.cuda.current_stream())
            for _ in range(2):  # replays overlap across the streams
                for g, s in zip(graphs, streams, strict=True):
                    with torch.cuda.stream(s):
                        g.replay()
            for s in streams:
                torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            for (out, lse), (w_out, w_lse) in zip(outs, want, strict=True):
                assert torch.equal(out, w_out) and torch.equal(lse, w_lse), rnd
    if dynamic_sched:
        for key, counter in runtime._tile_counters.items():
            assert not counter.any(), (key, counter.tolist())


def test_cuda_graph_training_step():
    """Forward and backward captured in one graph (deterministic): replays give eager's bits."""
    torch.manual_seed(1)
    shape = (2, 700, 333, 4, 2, 128)
    q, k, v = qkv(*shape)
    w = torch.randn(2, 700, 4, 128, device=DEV)
    kwargs = dict(causal=True, deterministic=True)

    def attn(q, k, v):
        return flash_attn_func(q, k, v, **kwargs)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as PyTorch's capture recipe asks
        for _ in range(2):
            step(attn, q, k, v, w)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, grads = step(attn, q, k, v, w)
    for rnd in range(3):
        torch.manual_seed(10 + rnd)
        fresh = qkv(*shape)
        fresh_w = torch.randn_like(w)
        want_out, want_grads = step(attn, *fresh, fresh_w)
        with torch.no_grad():
            for s, t in zip((q, k, v, w), (*fresh, fresh_w), strict=True):
                s.copy_(t)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want_out), rnd
        for got, want in zip(grads, want_grads, strict=True):
            assert torch.equal(got, want), rnd


def test_compile_reduce_overhead():
    """torch.compile's CUDA graphs (mode="reduce-overhead"), forward and backward, none skipped."""
    from torch._dynamo.utils import counters

    counters.clear()
    torch.manual_seed(2)

    def attn(q, k, v):
        return flash_attn_func(q, k, v, window_size=(100, 0), deterministic=True)

    fn = torch.compile(attn, mode="reduce-overhead", fullgraph=True)
    for rnd in range(4):  # the first runs warm up, later ones replay the recorded graph
        q, k, v = qkv(2, 512, 512, 4, 4, 64)
        w = torch.randn(2, 512, 4, 64, device=DEV)
        out, grads = step(fn, q, k, v, w)
        out, grads = out.clone(), [g.clone() for g in grads]  # the graph's outputs are reused
        want_out, want_grads = step(attn, q, k, v, w)
        assert torch.equal(out, want_out), rnd
        for got, want in zip(grads, want_grads, strict=True):
            assert torch.equal(got, want), rnd
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
