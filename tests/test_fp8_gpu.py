"""FP8 (e4m3) forward through flash_attn_func against the float64 reference on the dequantized
inputs, by the rule of flashhopper/accuracy.py (r = 3; the emulator rounds P to e4m3 the kernel's
way); out and LSE start as NaN (runtime.poison).

The shapes are the forward's list: odd lengths, sq != sk, GQA / MQA, causal, windows, softcap,
strided (packed qkv), every head dim, and each way a descale can come: None, a (batch, heads_k)
tensor with a different value per head, an expanded scalar (stride 0).
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from flashhopper.accuracy import check_forward
from flashhopper.validation import FP8_OPT_IN

pytestmark = pytest.mark.gpu

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)

from flashhopper import flash_attn_func  # noqa: E402

DEV = "cuda"
E4M3 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _fp8_opt_in(monkeypatch):
    monkeypatch.setenv(FP8_OPT_IN, "1")


def make_inputs(b, sq, sk, hq, hk, d, layout="bshd", descale="tensor", magnitude=2.0):
    """e4m3 q, k, v drawn from a seed of the case (descale: the case's descale kind, part of the seed)."""
    torch.manual_seed(zlib.crc32(repr((b, sq, sk, hq, hk, d, layout, descale, magnitude)).encode()))
    if layout == "packed":
        assert sq == sk and hq == hk
        return (magnitude * torch.randn(b, sq, 3, hq, d, device=DEV)).to(E4M3).unbind(2)
    return tuple((magnitude * torch.randn(b, s, h, d, device=DEV)).to(E4M3)
                 for s, h in ((sq, hq), (sk, hk), (sk, hk)))


def make_case(b, sq, sk, hq, hk, d, layout="bshd", descale="tensor", magnitude=2.0):
    q, k, v = make_inputs(b, sq, sk, hq, hk, d, layout, descale, magnitude)
    if descale == "none":
        descales = (None, None, None)
    elif descale == "scalar":  # what vLLM and SGLang pass: one value, expanded
        descales = tuple(torch.tensor(x, device=DEV).expand(b, hk) for x in (0.7, 1.3, 0.9))
    else:  # a different value per (batch, kv head): a descale read for the wrong head shows
        descales = tuple(0.5 + torch.rand(b, hk, device=DEV) for _ in range(3))
    return q, k, v, descales


def check_call(q, k, v, descales, causal=False, window=(-1, -1), softcap=0.0, softmax_scale=None):
    """One call (out and LSE poisoned first by runtime.poison) checked by the rule; returns out."""
    out, lse = flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window,
                               softcap=softcap, return_lse=True, q_descale=descales[0], k_descale=descales[1],
                               v_descale=descales[2])
    torch.cuda.synchronize()
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    check_forward(out, lse, q, k, v, scale, causal, window, softcap, descales)
    return out


def run_case(b, sq, sk, hq, hk, d, causal=False, window=(-1, -1), softcap=0.0, layout="bshd",
             descale="tensor", softmax_scale=None):
    q, k, v, descales = make_case(b, sq, sk, hq, hk, d, layout, descale)
    check_call(q, k, v, descales, causal, window, softcap, softmax_scale)


CASES = [  # b, sq, sk, hq, hk, d, causal, window, softcap
    (1, 1, 1, 2, 2, 128, False, (-1, -1), 0.0),
    (2, 17, 17, 4, 2, 64, True, (-1, -1), 0.0),
    (2, 300, 517, 4, 2, 64, False, (-1, -1), 0.0),
    (2, 517, 300, 2, 2, 128, True, (-1, -1), 0.0),
    (1, 1000, 1000, 8, 1, 128, True, (-1, -1), 0.0),
    (1, 700, 700, 2, 2, 128, False, (100, 20), 0.0),
    (1, 333, 333, 2, 2, 128, False, (-1, -1), 10.0),
    (1, 500, 500, 2, 2, 128, True, (64, 0), 5.0),
    (1, 4097, 4097, 1, 1, 128, True, (-1, -1), 0.0),
    (2, 300, 517, 4, 2, 96, False, (-1, -1), 0.0),
    (1, 1000, 1000, 2, 1, 96, True, (-1, -1), 0.0),
    (2, 300, 517, 6, 2, 192, False, (-1, -1), 0.0),
    (1, 1000, 1000, 3, 1, 192, True, (-1, -1), 0.0),
    (1, 700, 700, 2, 2, 192, False, (100, 20), 10.0),
    (2, 517, 300, 4, 2, 256, True, (-1, -1), 0.0),
    (1, 17, 1000, 2, 2, 256, False, (-1, -1), 0.0),
    (1, 1000, 1000, 4, 1, 256, True, (-1, -1), 0.0),
    (1, 500, 500, 2, 2, 256, False, (64, 64), 5.0),
]


@pytest.mark.parametrize("b,sq,sk,hq,hk,d,causal,window,softcap", CASES)
def test_fp8_forward(b, sq, sk, hq, hk, d, causal, window, softcap):
    run_case(b, sq, sk, hq, hk, d, causal, window, softcap)


NO_LSE_CASES = [  # b, sq, sk, hq, hk, d, causal: the tensor cores' row sums (plan.fp8_row_sum) and not
    (2, 300, 517, 4, 2, 64, False), (2, 17, 17, 4, 2, 64, True), (1, 1000, 1000, 8, 1, 64, True),
    (1, 4097, 4097, 2, 2, 64, False), (2, 517, 300, 2, 2, 128, False), (1, 1, 1, 2, 2, 128, False),
    (1, 3000, 3000, 2, 1, 128, False), (1, 1000, 1000, 8, 1, 128, True), (2, 300, 517, 4, 2, 96, False),
]


@pytest.mark.parametrize("descale", ["none", "tensor"])
@pytest.mark.parametrize("b,sq,sk,hq,hk,d,causal", NO_LSE_CASES)
def test_fp8_forward_without_lse(b, sq, sk, hq, hk, d, causal, descale):
    """A call that returns no LSE runs the kernel its plan gives it (where plan.fp8_row_sum applies, O over
    the tensor cores' sums of the e4m3 P): out by the rule with that kernel's emulator, whose kernel-order
    check fails the other kernel's sums (tests/test_accuracy.py)."""
    q, k, v, descales = make_case(b, sq, sk, hq, hk, d, descale=descale)
    out = flash_attn_func(q, k, v, causal=causal, q_descale=descales[0], k_descale=descales[1],
                          v_descale=descales[2])
    torch.cuda.synchronize()
    check_forward(out, None, q, k, v, 1.0 / math.sqrt(d), causal, (-1, -1), 0.0, descales)


@pytest.mark.parametrize("descale", ["none", "scalar", "tensor"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_fp8_descales(d, descale):
    run_case(2, 300, 517, 4, 2, d, causal=True, descale=descale)


@pytest.mark.parametrize("d", [64, 128])
def test_fp8_packed_qkv_strides(d):
    run_case(2, 1000, 1000, 4, 4, d, layout="packed")


def test_fp8_custom_softmax_scale():
    run_case(2, 300, 517, 4, 2, 128, causal=True, softmax_scale=0.3)


@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_fp8_every_key_block_and_tile(d):
    """Many key blocks and query tiles, so that the V^T ring and the sVt ring wrap many times."""
    run_case(2, 2049, 3000, 4, 2, d)


def test_fp8_under_torch_compile():
    q, k, v, descales = make_case(2, 300, 517, 4, 2, 128)
    compiled = torch.compile(lambda *a: flash_attn_func(*a[:3], causal=True, q_descale=a[3], k_descale=a[4],
                                                        v_descale=a[5]), fullgraph=True)
    out = compiled(q, k, v, *descales)
    eager = flash_attn_func(q, k, v, causal=True, q_descale=descales[0], k_descale=descales[1],
                            v_descale=descales[2])
    assert out.dtype == torch.bfloat16 and torch.equal(out, eager)


def test_fp8_requires_grad_is_refused():
    q, k, v, _ = make_case(1, 64, 64, 2, 2, 64)
    with pytest.raises(NotImplementedError, match="no FP8 backward"):
        flash_attn_func(q.requires_grad_(), k, v)
