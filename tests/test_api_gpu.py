"""flash_attn_func on a Hopper GPU (skipped elsewhere): the public API against the float64 reference.

The tolerance is the FlashAttention convention: the kernel may be at most twice as far from the
exact result as a straightforward low-precision implementation (bf16 matmuls, fp32 softmax) is.
"""

import pytest
import torch

from flashhopper import flash_attn_func
from flashhopper.accuracy import check_forward

pytestmark = pytest.mark.gpu


def check(q, k, v, **kw):
    out, lse = flash_attn_func(q, k, v, return_lse=True, **kw)
    scale = kw.get("softmax_scale") or q.shape[-1] ** -0.5
    assert out.shape == q.shape and out.dtype == q.dtype
    check_forward(out, lse, q, k, v, scale, kw.get("causal", False), kw.get("window_size", (-1, -1)),
                  kw.get("softcap", 0.0))


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


@pytest.mark.parametrize("hdim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen", [1, 113, 1000])
def test_forward_square(hdim, causal, seqlen):
    check(rand(2, seqlen, 4, hdim), rand(2, seqlen, 4, hdim), rand(2, seqlen, 4, hdim), causal=causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(128, 512), (512, 128), (77, 300), (300, 77)])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_uneven_lengths(dtype, seqlen_q, seqlen_k, causal):
    check(rand(2, seqlen_q, 4, 128, dtype=dtype), rand(2, seqlen_k, 4, 128, dtype=dtype),
          rand(2, seqlen_k, 4, 128, dtype=dtype), causal=causal)


@pytest.mark.parametrize("heads_k", [1, 2])
def test_forward_gqa_mqa(heads_k):
    check(rand(2, 500, 8, 128), rand(2, 600, heads_k, 128), rand(2, 600, heads_k, 128), causal=True)


@pytest.mark.parametrize("window_size, causal", [((64, 64), False), ((100, -1), True), ((0, 0), False)])
def test_forward_sliding_window(window_size, causal):
    check(rand(1, 700, 4, 128), rand(1, 700, 4, 128), rand(1, 700, 4, 128),
          causal=causal, window_size=window_size)


@pytest.mark.parametrize("softcap", [0.0, 7.0])
@pytest.mark.parametrize("scale", [0.03, 0.3])
def test_forward_custom_scale(scale, softcap):
    """A softmax_scale other than 1/sqrt(d): a kernel that ignored it would fail here."""
    q, k, v = rand(2, 333, 4, 128), rand(2, 517, 2, 128), rand(2, 517, 2, 128)
    check(q, k, v, softmax_scale=scale, softcap=softcap, causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_forward_softcap(causal):
    check(rand(2, 400, 4, 128), rand(2, 400, 4, 128), rand(2, 400, 4, 128), causal=causal, softcap=30.0)


def test_non_contiguous_heads_view():
    qkv = rand(2, 300, 3, 4, 128)  # packed QKV: each of q, k, v is a strided view
    q, k, v = qkv.unbind(dim=2)
    check(q, k, v, causal=True)
