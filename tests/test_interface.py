"""flash_attn_func: argument validation, the reference backend, and the wiring to the kernels."""

import math
import sys
import types

import pytest
import torch

import flashhopper
from flashhopper import flash_attn_func
from flashhopper.reference import attention_bwd_ref, attention_ref

BF16 = torch.bfloat16


def qkv(batch=1, seqlen=8, heads=2, hdim=64, dtype=BF16, seqlen_k=None, heads_k=None):
    seqlen_k = seqlen if seqlen_k is None else seqlen_k
    heads_k = heads if heads_k is None else heads_k
    return (
        torch.randn(batch, seqlen, heads, hdim, dtype=dtype),
        torch.randn(batch, seqlen_k, heads_k, hdim, dtype=dtype),
        torch.randn(batch, seqlen_k, heads_k, hdim, dtype=dtype),
    )


def misaligned(shape, dtype=BF16):
    """A contiguous tensor whose storage starts one element (2 bytes) past a 16-byte boundary."""
    flat = torch.randn(math.prod(shape) + 8, dtype=dtype)
    return flat[1 : 1 + math.prod(shape)].view(shape)


def replace(which, tensor):
    q, k, v = qkv()
    return {"q": (tensor, k, v), "k": (q, tensor, v), "v": (q, k, tensor)}[which]


TENSOR_CASES = [
    ("not a tensor", lambda: replace("q", [[1.0]]), TypeError, r"q must be a torch\.Tensor.*list"),
    ("k not a tensor", lambda: replace("k", None), TypeError, r"k must be a torch\.Tensor.*NoneType"),
    ("float32", lambda: qkv(dtype=torch.float32), TypeError, r"q has dtype torch\.float32.*bfloat16.*e4m3"),
    ("e5m2", lambda: tuple(t.to(torch.float8_e5m2) for t in qkv()), TypeError,
     r"q has dtype torch\.float8_e5m2.*float8_e4m3fn \(FP8 attention takes e4m3"),
    ("fp8 and bf16", lambda: replace("k", torch.randn(1, 8, 2, 64).to(torch.float8_e4m3fn)), TypeError,
     r"k has dtype torch\.float8_e4m3fn but q has torch\.bfloat16"),
    ("int8", lambda: replace("v", torch.zeros(1, 8, 2, 64, dtype=torch.int8)), TypeError, r"v has dtype"),
    ("dtype mismatch", lambda: replace("k", torch.randn(1, 8, 2, 64, dtype=torch.float16)), TypeError,
     r"k has dtype torch\.float16 but q has torch\.bfloat16"),
    ("device mismatch", lambda: replace("v", torch.empty(1, 8, 2, 64, dtype=BF16, device="meta")), ValueError,
     r"v is on meta but q is on cpu"),
    ("rank 3", lambda: replace("q", torch.randn(8, 2, 64, dtype=BF16)), ValueError, r"q has rank 3.*rank 4"),
    ("rank 5", lambda: replace("k", torch.randn(1, 1, 8, 2, 64, dtype=BF16)), ValueError, r"k has rank 5"),
    ("empty", lambda: qkv(seqlen=0), ValueError, r"q is empty.*\(1, 0, 2, 64\)"),
    ("empty k", lambda: qkv(seqlen_k=0), ValueError, r"k is empty"),
    ("batch", lambda: replace("v", torch.randn(2, 8, 2, 64, dtype=BF16)), ValueError,
     r"batch differs.*v has 2"),
    ("seqlen_k", lambda: replace("v", torch.randn(1, 9, 2, 64, dtype=BF16)), ValueError,
     r"v has seqlen 9 but k has 8"),
    ("hdim k", lambda: replace("k", torch.randn(1, 8, 2, 128, dtype=BF16)), ValueError,
     r"k has headdim 128 but q has 64"),
    ("hdim v", lambda: replace("v", torch.randn(1, 8, 2, 128, dtype=BF16)), ValueError,
     r"v has headdim 128 but q has 64"),
    ("hdim 80", lambda: qkv(hdim=80), ValueError, r"headdim.*80.*64, 96, 128, 192, 256"),
    ("hdim 32", lambda: qkv(hdim=32), ValueError, r"headdim.*32.*accepted"),
    ("gqa ratio", lambda: qkv(heads=3, heads_k=2), ValueError, r"q has 3 heads, k has 2.*multiple"),
    ("kv heads", lambda: replace("v", torch.randn(1, 8, 1, 64, dtype=BF16)), ValueError,
     r"v has 1 heads but k has 2"),
    ("last stride", lambda: replace("q", torch.randn(1, 8, 2, 128, dtype=BF16)[..., ::2]), ValueError,
     r"q has stride 2 in its last dimension"),
    ("row stride", lambda: replace("k", torch.randn(1, 8, 2, 68, dtype=BF16)[..., :64]), ValueError,
     r"k has strides \(1088, 136, 68, 1\).*multiple of 8 elements"),
    ("data_ptr", lambda: replace("v", misaligned((1, 8, 2, 64))), ValueError, r"v\.data_ptr\(\).*16-byte"),
]


@pytest.mark.parametrize("make, exc, pattern", [c[1:] for c in TENSOR_CASES],
                         ids=[c[0] for c in TENSOR_CASES])
def test_tensor_validation(make, exc, pattern):
    with pytest.raises(exc, match=pattern):
        flash_attn_func(*make(), backend="reference")


OPTION_CASES = [
    (dict(window_size=(1,)), TypeError, r"window_size must be a 2-tuple.*\(1,\)"),
    (dict(window_size=5), TypeError, r"window_size must be a 2-tuple.*5"),
    (dict(window_size=(1.5, 2)), TypeError, r"window_size.*1\.5"),
    (dict(window_size=(True, 2)), TypeError, r"window_size"),
    (dict(window_size=(-2, 0)), ValueError, r"window_size=\(-2, 0\).*>= -1"),
    (dict(softcap=-1.0), ValueError, r"softcap is -1\.0.*>= 0"),
    (dict(softcap=math.inf), ValueError, r"softcap is inf"),
    (dict(softcap=math.nan), ValueError, r"softcap is nan"),
    (dict(softcap="3"), TypeError, r"softcap must be"),
    (dict(softmax_scale=0.0), ValueError, r"softmax_scale is 0\.0.*positive finite"),
    (dict(softmax_scale=-0.5), ValueError, r"softmax_scale is -0\.5"),
    (dict(softmax_scale=math.inf), ValueError, r"softmax_scale is inf"),
    (dict(softmax_scale=math.nan), ValueError, r"softmax_scale is nan"),
    (dict(softmax_scale="a"), TypeError, r"softmax_scale must be None or a positive finite number"),
    (dict(causal=1), TypeError, r"causal must be a bool, got 1"),
    (dict(deterministic="no"), TypeError, r"deterministic must be a bool"),
    (dict(return_lse=None), TypeError, r"return_lse must be a bool"),
    (dict(backend="cuda"), ValueError, r"backend is 'cuda'.*'auto', 'hopper', 'reference'"),
    (dict(backend=None), ValueError, r"backend is None"),
]


@pytest.mark.parametrize("kwargs, exc, pattern", OPTION_CASES, ids=[str(c[0]) for c in OPTION_CASES])
def test_option_validation(kwargs, exc, pattern):
    kwargs = {"backend": "reference", **kwargs}
    with pytest.raises(exc, match=pattern):
        flash_attn_func(*qkv(), **kwargs)


@pytest.mark.parametrize("backend", ["auto", "hopper"])
def test_kernel_backend_on_cpu_points_to_reference(backend):
    pattern = r"Hopper GPU \(H100/H200, sm_90\).*backend=\"reference\" runs anywhere"
    with pytest.raises(RuntimeError, match=pattern):
        flash_attn_func(*qkv(), backend=backend)


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(causal=True), dict(window_size=[3, 1], softcap=5.0), dict(softmax_scale=0.2, causal=True)],
)
def test_reference_backend_matches_attention_ref(dtype, kwargs):
    q, k, v = qkv(batch=2, seqlen=33, heads=4, hdim=96, seqlen_k=41, heads_k=2, dtype=dtype)
    out, lse = flash_attn_func(q, k, v, return_lse=True, backend="reference", **kwargs)
    window = tuple(kwargs.pop("window_size", (-1, -1)))
    want_out, want_lse = attention_ref(q, k, v, window_size=window, **kwargs)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 33)
    assert torch.equal(out, want_out.to(dtype))
    assert torch.equal(lse, want_lse)
    assert torch.equal(flash_attn_func(q, k, v, backend="reference", window_size=window, **kwargs), out)


@pytest.mark.parametrize("hdim,dv", [(64, 64), (192, 128)])
def test_reference_backend_gradients(hdim, dv):
    q, k, v = qkv(batch=2, seqlen=20, heads=4, hdim=hdim, seqlen_k=27, heads_k=1)
    q, k, v = (t.requires_grad_() for t in (q, k, v[..., :dv].contiguous()))
    dout = torch.randn(2, 20, 4, dv, dtype=BF16)
    out = flash_attn_func(q, k, v, causal=True, softcap=3.0, backend="reference")
    out.backward(dout)
    want = attention_bwd_ref(q, k, v, dout, causal=True, softcap=3.0)
    for got, exact in zip((q.grad, k.grad, v.grad), want, strict=True):
        assert got.dtype == BF16
        torch.testing.assert_close(got.double(), exact, atol=1e-2, rtol=1e-2)


@pytest.fixture
def fake_kernels(monkeypatch):
    """Stand in for flashhopper.hopper on CPU to check the contract the kernels are called with."""
    calls = []

    def forward(q, k, v, softmax_scale, causal, window_size, softcap):
        calls.append((softmax_scale, causal, window_size, softcap))
        out, lse = attention_ref(q, k, v, softmax_scale, causal, window_size, softcap)
        return out.to(q.dtype), lse

    def backward(q, k, v, out, dout, lse, softmax_scale, causal, window_size, softcap, deterministic=False):
        calls.append(("bwd", softmax_scale, causal, window_size, softcap, deterministic, dout.stride(-1)))
        return attention_bwd_ref(q, k, v, dout, softmax_scale, causal, window_size, softcap)

    monkeypatch.setitem(sys.modules, "flashhopper.hopper",
                        types.SimpleNamespace(forward=forward, backward=backward))
    monkeypatch.setattr(flashhopper.validation, "require_hopper", lambda q, backend="hopper": None)
    return calls


def test_kernel_path_contract(fake_kernels):
    q, k, v = (t.requires_grad_() for t in qkv(hdim=128))
    out, lse = flash_attn_func(q, k, v, causal=True, window_size=[4, -1], softcap=2.0, return_lse=True,
                               deterministic=True)
    assert fake_kernels == [(1 / math.sqrt(128), True, (4, -1), 2.0)]
    assert type(fake_kernels[0][2]) is tuple and lse.requires_grad is False
    assert out.requires_grad
    # the gradient of a sum is an expanded (stride 0) tensor: the kernel must get a TMA-able copy
    out.float().sum().backward()
    assert fake_kernels[1] == ("bwd", 1 / math.sqrt(128), True, (4, -1), 2.0, True, 1)
    want = attention_bwd_ref(q, k, v, torch.ones_like(out), 1 / math.sqrt(128), True, (4, -1), 2.0)
    for got, exact in zip((q.grad, k.grad, v.grad), want, strict=True):
        torch.testing.assert_close(got.double(), exact, atol=1e-2, rtol=1e-2)  # grads come back in bf16


def test_package_import_does_not_load_cutlass():
    import subprocess

    code = "import sys, flashhopper; print(any(m.split('.')[0] == 'cutlass' for m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


E4M3 = torch.float8_e4m3fn


def fp8_qkv(**kw):
    return tuple((2 * t.float()).to(E4M3) for t in qkv(**kw))


FP8_CASES = [
    ("descale shape", dict(q_descale=torch.ones(1, 4)), ValueError,
     r"q_descale has shape \(1, 4\); accepted: \(batch, heads_k\) = \(1, 2\) or per token \(batch, "
     r"heads_q, seqlen_q\) = \(1, 2, 8\)"),
    ("per-token q descale, wrong length", dict(q_descale=torch.ones(1, 2, 9)), ValueError,
     r"q_descale has shape \(1, 2, 9\); accepted: .* or per token \(batch, heads_q, seqlen_q\) = "
     r"\(1, 2, 8\)"),
    ("per-token k descale, wrong heads", dict(k_descale=torch.ones(1, 3, 8)), ValueError,
     r"k_descale has shape \(1, 3, 8\); accepted: \(batch, heads_k\) = \(1, 2\) or per token "
     r"\(batch, heads_k, seqlen_k\) = \(1, 2, 8\)"),
    ("v descale per token", dict(v_descale=torch.ones(1, 2, 8)), ValueError,
     r"v_descale has shape \(1, 2, 8\); accepted: \(batch, heads_k\) = \(1, 2\) \(expand"),
    ("per-token descale dtype", dict(k_descale=torch.ones(1, 2, 8, dtype=torch.bfloat16)), TypeError,
     r"k_descale has dtype torch\.bfloat16; accepted: torch\.float32"),
    ("descale dtype", dict(k_descale=torch.ones(1, 2, dtype=torch.float16)), TypeError,
     r"k_descale has dtype torch\.float16; accepted: torch\.float32"),
    ("descale type", dict(v_descale=1.0), TypeError, r"v_descale must be None or a torch\.Tensor, got float"),
    ("descale device", dict(q_descale=torch.ones(1, 2, device="meta")), ValueError,
     r"q_descale is on meta but q is on cpu"),
]


@pytest.mark.parametrize("kwargs, exc, pattern", [c[1:] for c in FP8_CASES], ids=[c[0] for c in FP8_CASES])
def test_fp8_validation(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        flash_attn_func(*fp8_qkv(), backend="reference", **kwargs)


def test_descales_only_with_fp8():
    with pytest.raises(ValueError, match=r"q_descale is given but q is torch\.bfloat16"):
        flash_attn_func(*qkv(), q_descale=torch.ones(1, 2), backend="reference")


def test_fp8_reference_dequantizes_per_kv_head():
    """backend="reference" with e4m3 inputs: attention of x * descale (q's descale per its kv head),
    bf16 out; an expanded scalar descale is the same as that value everywhere."""
    q, k, v = fp8_qkv(batch=2, seqlen=33, heads=4, hdim=64, seqlen_k=41, heads_k=2)
    qd, kd, vd = (0.5 + torch.rand(2, 2) for _ in range(3))
    out, lse = flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd,
                               return_lse=True, backend="reference")
    deq = [t.double() * d.double().repeat_interleave(t.shape[2] // 2, dim=1)[:, None, :, None]
           for t, d in ((q, qd), (k, kd), (v, vd))]
    want, want_lse = attention_ref(*deq, causal=True)
    assert out.dtype == BF16 and torch.equal(out, want.to(BF16)) and torch.equal(lse, want_lse)
    scalar = torch.tensor(0.75).expand(2, 2)
    a = flash_attn_func(q, k, v, q_descale=scalar, backend="reference")
    b = flash_attn_func(q, k, v, q_descale=torch.full((2, 2), 0.75), backend="reference")
    assert torch.equal(a, b)


def test_fp8_reference_dequantizes_per_token():
    """Per-token q / k descales (any strides, stride 0 too, mixed with a per-head v descale or none):
    backend="reference" is attention of x * each row's descale; a per-token descale that repeats a
    per-head one gives that per-head call's result."""
    q, k, v = fp8_qkv(batch=2, seqlen=33, heads=4, hdim=64, seqlen_k=41, heads_k=2)
    qd = 0.5 + torch.rand(2, 4, 33)
    kd = (0.5 + torch.rand(2, 41, 2)).transpose(1, 2)  # (b, hk, sk), not contiguous
    vd = 0.5 + torch.rand(2, 2)
    out, lse = flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd,
                               return_lse=True, backend="reference")
    deq = (q.double() * qd.double().transpose(1, 2)[..., None],
           k.double() * kd.double().transpose(1, 2)[..., None], v.double() * vd.double()[:, None, :, None])
    want, want_lse = attention_ref(*deq, causal=True)
    assert torch.equal(out, want.to(BF16)) and torch.equal(lse, want_lse)
    head = 0.5 + torch.rand(2, 2)
    a = flash_attn_func(q, k, v, k_descale=head, backend="reference")
    b = flash_attn_func(q, k, v, k_descale=head[:, :, None].expand(2, 2, 41), backend="reference")
    c = flash_attn_func(q, k, v, q_descale=head, backend="reference")
    d = flash_attn_func(q, k, v, q_descale=head.repeat_interleave(2, dim=1)[:, :, None].expand(2, 4, 33),
                        backend="reference")
    assert torch.equal(a, b) and torch.equal(c, d)


def test_qk_descale_kind():
    from flashhopper.validation import qk_descale_kind

    two, three = torch.ones(1, 2), torch.ones(1, 2, 8)
    assert qk_descale_kind((None, None, None)) == qk_descale_kind((two, two, two)) == "head"
    assert qk_descale_kind((three, None, None)) == qk_descale_kind((two, three, two)) == "token"


@pytest.mark.parametrize("verified", [False, True])
def test_fp8_kernel_path_is_refused_until_verified(monkeypatch, verified):
    """Until the FP8 forward's current kernels have passed the GPU suite a call needs the opt-in, and at
    the head dims without two-level accumulation (192, 256) it always does; an FP8 input that requires
    grad is refused."""
    from flashhopper import validation

    monkeypatch.setattr(validation, "FP8_GPU_VERIFIED", verified)
    monkeypatch.delenv(validation.FP8_OPT_IN, raising=False)
    for d in (64, 128, 192, 256):
        q, k, v = fp8_qkv(hdim=d)
        if verified and d not in validation.FP8_ONE_LEVEL_HDIMS:
            validation.check_fp8_call(q, k, v)
        else:
            with pytest.raises(NotImplementedError, match=validation.FP8_OPT_IN):
                validation.check_fp8_call(q, k, v)
    monkeypatch.setenv(validation.FP8_OPT_IN, "1")
    for d in (64, 256):
        validation.check_fp8_call(*fp8_qkv(hdim=d))
    q, k, v = fp8_qkv()
    with pytest.raises(NotImplementedError, match="no FP8 backward"):
        validation.check_fp8_call(q.requires_grad_(), k, v)


def test_split_head_dims_differentiate_through_the_kernel_path(fake_kernels):
    """(192, 128) with inputs that require grad: the autograd formula calls the backward (no refusal), and
    dv comes back in v's head dim."""
    q, k, _ = qkv(hdim=192)
    v = torch.randn(1, 8, 2, 128, dtype=BF16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = flash_attn_func(q, k, v, causal=True)
    assert out.shape == (1, 8, 2, 128) and out.requires_grad
    dout = torch.randn_like(out)
    out.backward(dout)
    assert fake_kernels[-1][0] == "bwd" and v.grad.shape == v.shape
    want = attention_bwd_ref(q, k, v, dout, causal=True)
    for got, exact in zip((q.grad, k.grad, v.grad), want, strict=True):
        torch.testing.assert_close(got.double(), exact, atol=1e-2, rtol=1e-2)
