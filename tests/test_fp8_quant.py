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


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_quantize_round_trips_within_e4m3_rounding(granularity):
    q, k = _x(h=4), _x(h=2, seed=1)
    q8, qd = fp8.quantize(q, granularity, heads_k=2)
    k8, kd = fp8.quantize(k, granularity)
    assert q8.dtype == k8.dtype == torch.float8_e4m3fn
    assert qd.shape == kd.shape == (2, 2) and qd.dtype == torch.float32
    qb, kb, _ = dequantize_fp8(q8, k8, k8, (qd, kd, None))
    for x, back, d, ratio in ((q, qb, qd, 2), (k, kb, kd, 1)):
        # every element within e4m3's rounding (2^-4 relative, below the subnormals their step), in x's
        # units: a descale off by a few percent fails (a median bound let 6% through)
        per_head = d.double().repeat_interleave(ratio, dim=1)[:, None, :, None]
        err = (back - x.double()).abs()
        assert (err <= x.double().abs() * 2.0 ** -4 + per_head * 2.0 ** -9).all()
        # the descale is the group's largest magnitude over e4m3's largest finite value
        groups = x.view(2, x.shape[1], 2, ratio, x.shape[-1]).abs().amax(dim=(1, 3, 4))
        want = groups.amax() if granularity == "tensor" else groups
        torch.testing.assert_close(d, (want / 448.0).expand(2, 2), rtol=0, atol=0)
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


@pytest.mark.parametrize("block", [1, 64, 128, 300, 1000])
def test_block_quantize_round_trips_with_a_scale_per_block(block):
    """"block": x8 * descale per token (batch, heads, seqlen) gives x back within e4m3's rounding (half a
    unit in the last of 3 mantissa bits: 2^-4 relative, below the subnormals), each block's largest
    magnitude maps to 448, and the descale is constant inside a block (the last one may be shorter)."""
    x = _x(s=300, h=3, outliers=True)
    x[:, 64:128] *= 1e-3  # a quiet stretch: its blocks keep their own scales
    x8, d = fp8.quantize(x, "block", block=block)
    assert x8.dtype == torch.float8_e4m3fn and d.dtype == torch.float32 and d.shape == (2, 3, 300)
    back = x8.double() * d.double().transpose(1, 2)[..., None]
    err = (back - x.double()).abs()
    tiny = d.double().transpose(1, 2)[..., None] * 2.0 ** -9  # e4m3's smallest subnormal step, in x's units
    assert (err <= x.double().abs() * 2.0 ** -4 + tiny).all()
    for start in range(0, 300, block):
        part = d[:, :, start:start + block]
        assert (part == part[:, :, :1]).all()
        peak = x8[:, start:start + block].float().abs().amax(dim=(1, 3))
        assert (peak == 448.0).all()


def test_block_quantize_reference_matches_the_dequantized_inputs():
    """Per-block descales through dequantize_fp8 are x8 * descale of each token and head, and a per-head
    descale given per token (expanded over the rows) dequantizes as the per-head form does."""
    q, k = _x(h=4), _x(h=2, seed=1)
    q8, qd = fp8.quantize(q, "block", block=32)
    k8, kd = fp8.quantize(k, "block", block=48)
    qb, kb, _ = dequantize_fp8(q8, k8, k8, (qd, kd, None))
    assert torch.equal(qb, q8.double() * qd.double().transpose(1, 2)[..., None])
    assert torch.equal(kb, k8.double() * kd.double().transpose(1, 2)[..., None])
    h8, hd = fp8.quantize(k, "head")
    per_token = hd[:, :, None].expand(2, 2, 300)
    assert torch.equal(dequantize_fp8(h8, h8, h8, (None, per_token, None))[1],
                       dequantize_fp8(h8, h8, h8, (None, hd, None))[1])


def test_bad_arguments():
    with pytest.raises(ValueError, match="granularity is 'row'"):
        fp8.quantize(_x(), "row")
    for block in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="block is"):
            fp8.quantize(_x(), "block", block=block)
    with pytest.raises(ValueError, match="heads_k is 3"):
        fp8.quantize(_x(h=4), heads_k=3)
    with pytest.raises(ValueError, match="rank 3"):
        fp8.quantize(torch.randn(3, 4, 5))
