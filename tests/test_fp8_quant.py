"""flashhopper.fp8 on the CPU: quantization with the kernel's descales, and the Hadamard rotation."""

from __future__ import annotations

import pytest
import torch

from flashhopper import fp8
from flashhopper.reference import dequantize_fp8


def _x(b=2, s=300, h=4, d=128, seed=0, outliers=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, h, d, generator=g)
    if outliers:  # 0.1% of entries 10x larger (FlashAttention-3's Table 3 inputs)
        mask = torch.rand(b, s, h, d, generator=g) < 1e-3
        x = torch.where(mask, 10 * x, x)
    return x


@pytest.mark.parametrize("granularity", fp8.GRANULARITIES)
def test_quantize_round_trips_within_e4m3_rounding(granularity):
    q, k = _x(h=4), _x(h=2, seed=1)
    q8, qd = fp8.quantize(q, granularity, heads_k=2)
    k8, kd = fp8.quantize(k, granularity)
    assert q8.dtype == k8.dtype == torch.float8_e4m3fn
    assert qd.shape == kd.shape == (2, 2) and qd.dtype == torch.float32
    qb, kb, _ = dequantize_fp8(q8, k8, k8, (qd, kd, None))
    for x, back in ((q, qb), (k, kb)):
        rel = ((back - x.double()).abs() / x.double().abs().clamp(min=1e-2)).median()
        assert rel < 2 ** -4  # e4m3: 3 mantissa bits
    assert q8.float().abs().max() == 448.0  # the largest magnitude maps to e4m3's largest finite value
    if granularity == "tensor":
        assert qd.stride() == (0, 0) and (qd == qd[0, 0]).all()


def test_per_head_scales_follow_each_group():
    x = _x(h=4)
    x[:, :, 2:] *= 100  # the second kv head's query heads are 100x larger
    _, d = fp8.quantize(x, "head", heads_k=2)
    assert (d[:, 1] / d[:, 0] > 50).all()


@pytest.mark.parametrize("hdim", [64, 96, 128, 192, 256])
def test_hadamard_is_orthogonal_and_keeps_qk(hdim):
    rot = fp8.hadamard_matrix(hdim, seed=3).double()
    assert torch.allclose(rot @ rot.T, torch.eye(hdim, dtype=torch.float64), atol=1e-6)
    q, k = _x(h=2, d=hdim).double(), _x(h=2, d=hdim, seed=1).double()
    qr, kr = (fp8.hadamard(t.float(), seed=3).double() for t in (q, k))
    before = torch.einsum("bqhd,bkhd->bhqk", q, k)
    after = torch.einsum("bqhd,bkhd->bhqk", qr, kr)
    assert torch.allclose(before, after, atol=1e-3)


def test_hadamard_spreads_outliers():
    """The largest magnitude over the RMS (what a scale must cover) falls: ~25 -> ~5.5 here."""
    x = _x(outliers=True)
    peak = lambda t: t.abs().amax() / t.pow(2).mean().sqrt()  # noqa: E731
    assert peak(fp8.hadamard(x)) < 0.4 * peak(x)


def test_bad_arguments():
    with pytest.raises(ValueError, match="granularity is 'block'"):
        fp8.quantize(_x(), "block")
    with pytest.raises(ValueError, match="heads_k is 3"):
        fp8.quantize(_x(h=4), heads_k=3)
    with pytest.raises(ValueError, match="rank 3"):
        fp8.quantize(torch.randn(3, 4, 5))
