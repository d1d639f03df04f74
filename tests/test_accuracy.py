"""The one correctness rule (flashhopper/accuracy.py) on the CPU, with the emulator standing in for a
kernel: it passes what a correct kernel could return (the exact result rounded once, a forward in a
kernel's blocked order), and fails each kind of fault a kernel could make (a
key block of dV zeroed, a wrong softmax scale, an unwritten row, a stale LSE)."""

from __future__ import annotations

import pytest
import torch

from flashhopper.accuracy import check_lse, check_output, emulate_backward, emulate_forward
from flashhopper.reference import attention_bwd_ref, attention_ref

SCALE = 64 ** -0.5


def inputs(sq=300, sk=517, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, sq, 2, 64, generator=g).to(dtype)
    k, v = (torch.randn(1, sk, 1, 64, generator=g).to(dtype) for _ in range(2))
    dout = torch.randn(1, sq, 2, 64, generator=g).to(dtype)
    return q, k, v, dout


def blocked_forward(q, k, v, scale, causal, softcap, block=128):
    """Another legitimate forward, a kernel's order rather than the emulator's: keys in blocks of
    `block`, an online softmax (running max, fp32 rescaling), P rounded to the inputs' dtype before P @ V,
    the row sums from the fp32 P. (b, s, h, d) in, (out in q's dtype, lse fp32 (b, h, s)) out."""
    from flashhopper.reference import expand_kv, visible_mask

    hq = q.shape[2]
    qf, kf, vf = q.float().transpose(1, 2), expand_kv(k, hq).float().transpose(1, 2), \
        expand_kv(v, hq).float().transpose(1, 2)
    sq, sk = q.shape[1], k.shape[1]
    seen = visible_mask(sq, sk, causal, (-1, -1))
    m = torch.full(qf.shape[:-1], float("-inf"))
    row_sum, acc = torch.zeros(qf.shape[:-1]), torch.zeros(*qf.shape[:-1], vf.shape[-1])
    for start in range(0, sk, block):
        cols = slice(start, min(start + block, sk))
        s_blk = qf @ kf[:, :, cols].transpose(-1, -2) * scale
        if softcap:
            s_blk = softcap * torch.tanh(s_blk / softcap)
        s_blk = s_blk.masked_fill(~seen[:, cols], float("-inf"))
        m_new = torch.maximum(m, s_blk.amax(-1))
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s_blk - safe[..., None])
        alpha = torch.exp(m - safe)
        row_sum = row_sum * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + p.to(q.dtype).float() @ vf[:, :, cols]
        m = m_new
    out = (acc / row_sum[..., None]).to(q.dtype).transpose(1, 2)
    return out, m + torch.log(row_sum)


@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("causal", [False, True])
def test_legitimate_implementations_pass(causal, softcap):
    """What a correct kernel could return passes: the float64 result rounded once to the output dtype
    (every output, the backward's too), and a forward in a kernel's order (blocked_forward); the yardstick
    is the emulator's error, as on the GPU. (The emulator's output against its own error would pass by
    construction.)"""
    q, k, v, dout = inputs()
    out_ref, lse_ref = attention_ref(q, k, v, SCALE, causal, (-1, -1), softcap)
    emu, emu_lse = emulate_forward(q, k, v, SCALE, causal, (-1, -1), softcap)
    check_output("out", out_ref.to(q.dtype), out_ref, emu, softcap)
    out, lse = blocked_forward(q, k, v, SCALE, causal, softcap)
    assert not torch.equal(out, emu)  # another rounding order, not the emulator again
    check_output("out", out, out_ref, emu, softcap)
    check_lse(lse, lse_ref, emu_lse, softcap)
    emus = emulate_backward(q, k, v, dout, SCALE, causal, (-1, -1), softcap)
    refs = attention_bwd_ref(q, k, v, dout, SCALE, causal, (-1, -1), softcap)
    for name, ref, emu_grad in zip(("dq", "dk", "dv"), refs, emus, strict=True):
        check_output(name, ref.to(q.dtype), ref, emu_grad, softcap)


def test_a_zeroed_key_block_of_dv_fails():
    q, k, v, dout = inputs()
    dq, dk, dv = emulate_backward(q, k, v, dout, SCALE, False, (-1, -1), 0.0)
    ref = attention_bwd_ref(q, k, v, dout, SCALE, False, (-1, -1), 0.0)[2]
    bad = dv.clone()
    bad[:, 384:] = 0  # the last (partial) 128-key block
    with pytest.raises(AssertionError, match="dv rows 384"):
        check_output("dv", bad, ref, dv)


def test_a_wrong_scale_fails():
    q, k, v, _ = inputs()
    ref, _ = attention_ref(q, k, v, SCALE, True, (-1, -1), 0.0)
    emu, _ = emulate_forward(q, k, v, SCALE, True, (-1, -1), 0.0)
    wrong, _ = emulate_forward(q, k, v, SCALE * 1.01, True, (-1, -1), 0.0)
    with pytest.raises(AssertionError, match="error"):
        check_output("out", wrong, ref, emu)


def test_an_unwritten_row_fails():
    q, k, v, _ = inputs()
    ref, _ = attention_ref(q, k, v, SCALE, False, (-1, -1), 0.0)
    emu, _ = emulate_forward(q, k, v, SCALE, False, (-1, -1), 0.0)
    bad = emu.clone()
    bad[:, 299] = float("nan")  # as runtime.poison leaves a row no kernel wrote
    with pytest.raises(AssertionError, match="NaN"):
        check_output("out", bad, ref, emu)


def test_a_stale_or_shifted_lse_fails():
    q, k, v, _ = inputs()
    _, lse_ref = attention_ref(q, k, v, SCALE, True, (-1, -1), 0.0)
    _, lse = emulate_forward(q, k, v, SCALE, True, (-1, -1), 0.0)
    with pytest.raises(AssertionError, match="LSE error"):
        check_lse(lse + 1e-3, lse_ref, lse)
    sq = q.shape[1]
    no_key = torch.full_like(lse, float("-inf"))  # a window that hides every key
    with pytest.raises(AssertionError, match="-inf"):
        check_lse(lse, no_key.double(), no_key)
    stale = lse.clone()
    stale[:, :, sq // 2:] = lse[:, :, : sq - sq // 2]  # rows read from the wrong place
    with pytest.raises(AssertionError, match="LSE error"):
        check_lse(stale, lse_ref, lse)


def test_the_cancellation_floor_does_not_hide_a_zeroed_block_of_dk():
    from flashhopper.accuracy import cancellation_floor

    q, k, v, dout = inputs()
    dk = emulate_backward(q, k, v, dout, SCALE, True, (-1, -1), 0.0)[1]
    ref = attention_bwd_ref(q, k, v, dout, SCALE, True, (-1, -1), 0.0)[1]
    floor = cancellation_floor(dout, v, q, SCALE)
    check_output("dk", dk, ref, dk, floor=floor)
    bad = dk.clone()
    bad[:, 128:256] = 0
    with pytest.raises(AssertionError, match="dk rows 128"):
        check_output("dk", bad, ref, dk, floor=floor)


def fp8_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (2 * torch.randn(2, 300, 4, 64, generator=g)).to(torch.float8_e4m3fn)
    k, v = ((2 * torch.randn(2, 517, 2, 64, generator=g)).to(torch.float8_e4m3fn) for _ in range(2))
    descales = tuple(0.5 + torch.rand(2, 2, generator=g) for _ in range(3))
    return q, k, v, descales


@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_rule_passes_the_emulator_and_fails_a_wrong_descale(causal, softcap):
    """FP8: the emulator in the kernel's order (the dispatched key blocks, running max) passes the rule
    at r = 3 and the kernel-order check; V's descale left out, Q's read for the other kv head, a zeroed
    128-key block of V, and a 2% scale error (under FP8's own rounding noise) each fail."""
    from flashhopper import plan
    from flashhopper.accuracy import check_forward, emulate_forward_fp8

    q, k, v, ds = fp8_inputs()
    tile_n = plan.fwd_config("e4m3", q.shape[-1], causal=causal, softcap=softcap > 0).tile_n
    out, lse = emulate_forward_fp8(q, k, v, ds, SCALE, causal, (-1, -1), softcap, tile_n=tile_n)
    check_forward(out, lse, q, k, v, SCALE, causal, (-1, -1), softcap, ds)
    wrong_v = emulate_forward_fp8(q, k, v, (ds[0], ds[1], None), SCALE, causal, (-1, -1), softcap)[0]
    swapped = (ds[0].flip(1), ds[1], ds[2])
    wrong_q = emulate_forward_fp8(q, k, v, swapped, SCALE, causal, (-1, -1), softcap)[0]
    v_hole = v.clone()
    v_hole[:, 128:256] = 0
    holed = emulate_forward_fp8(q, k, v_hole, ds, SCALE, causal, (-1, -1), softcap)[0]
    for bad in (wrong_v, wrong_q, holed, (out.float() * 1.02).bfloat16()):
        with pytest.raises(AssertionError, match="out rows"):
            check_forward(bad, lse, q, k, v, SCALE, causal, (-1, -1), softcap, ds)


def test_fp8_rule_with_the_row_sums_of_the_e4m3_p():
    """FwdConfig.pv_row_sum: O normalized by the sums of the e4m3 P it was made from. The emulator with
    rounded_sums is that exactly (sum of p8 v over sum of p8); for such a config it passes the rule, while
    the same blocks normalized by the unrounded P's sums (what the other kernels do) fail the kernel-order
    check, as does a wrong V descale: the rule tells which sums a kernel used."""
    from flashhopper import plan
    from flashhopper.accuracy import check_forward, emulate_forward_fp8
    from flashhopper.reference import expand_kv

    q, k, v, ds = fp8_inputs()
    args = (q, k, v, ds, SCALE, False, (-1, -1), 0.0)
    cfg = plan.fwd_plan("e4m3", q.shape[-1], q.shape[1], k.shape[1], False, (-1, -1), False,
                        need_lse=False)[0]
    assert cfg.pv_row_sum
    rule = (q, k, v, SCALE, False, (-1, -1), 0.0, ds)
    out = emulate_forward_fp8(*args, tile_n=cfg.tile_n, rounded_sums=True)[0]
    # one block of all the keys: the same by hand
    whole = emulate_forward_fp8(*args, rounded_sums=True)[0]
    qd, kd, vd = (x.repeat_interleave(2, dim=1) for x in ds)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), expand_kv(k.float(), q.shape[2])) * SCALE
    s = s * qd[:, :, None, None] * kd[:, :, None, None]
    p8 = (torch.exp(s - s.amax(-1, keepdim=True)) * 256).to(torch.float8_e4m3fn).float()
    o = torch.einsum("bhqk,bkhd->bqhd", p8, expand_kv(v.float(), q.shape[2]))
    o = o / p8.sum(-1).transpose(1, 2)[..., None] * vd[:, None, :, None]
    assert (whole.float() - o).abs().max().item() <= 2 ** -7 * o.abs().max().item()
    check_forward(out, None, *rule, cfg=cfg)
    unrounded = emulate_forward_fp8(*args, tile_n=cfg.tile_n)[0]
    wrong_v = emulate_forward_fp8(q, k, v, (ds[0], ds[1], None), *args[4:], tile_n=cfg.tile_n,
                                  rounded_sums=True)[0]
    for bad in (unrounded, wrong_v):
        with pytest.raises(AssertionError, match="out rows"):
            check_forward(bad, None, *rule, cfg=cfg)


def test_the_backward_rule_takes_d_from_the_kernels_out():
    """D = rowsum(dO * O) moves every dS of a row together, so an O rounded another legitimate way
    (unnormalized P, the division at the end, as the forward kernels do) moves a lone row's dQ by
    several times the emulator's own error there: the rule forms D from the O the backward was
    given. Seed 28: one row past a 128-row block, fp16, magnitude 4 (a fuzz failure's shape)."""
    from flashhopper.accuracy import check_grads
    from flashhopper.reference import visible_mask

    g = torch.Generator().manual_seed(28)
    q, k, v, dout = ((torch.randn(1, n, 1, 96, generator=g) * 4).half() for n in (129, 513, 513, 129))
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * 0.178
    s = s.masked_fill(~visible_mask(129, 513, True, (-1, -1), "cpu"), float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    out = (torch.einsum("bhqk,bkhd->bqhd", p.half().float(), v.float())
           / p.sum(-1, keepdim=True).permute(0, 2, 1, 3)).half()
    grads = emulate_backward(q, k, v, dout, 0.178, True, (-1, -1), 0.0, out=out)
    check_grads(grads, q, k, v, dout, 0.178, True, (-1, -1), 0.0, out=out)
    own_out = emulate_forward(q, k, v, 0.178, True, (-1, -1), 0.0)[0]
    with pytest.raises(AssertionError, match="dq rows 128"):
        check_grads(grads, q, k, v, dout, 0.178, True, (-1, -1), 0.0, out=own_out)


def test_the_backward_rule_rounds_ds_where_the_dispatched_kernel_does(monkeypatch):
    """fp16 of magnitude 0.1 with a small scale puts dS in fp16's subnormals, where rounding dS after
    the softmax scale (BwdConfig.scale_in_ds, dispatched at hdim 96 / 128) loses more than rounding
    it before: the emulator takes the dispatched rounding point. The same shape as the fuzz failures
    it explains (dQ off by 2.2e-7 where the other emulator was off by 3.3e-8)."""
    from flashhopper import accuracy

    g = torch.Generator().manual_seed(0)
    q, k, v, dout = ((torch.randn(1, n, 1, 96, generator=g) * 0.1).half() for n in (300, 1500, 1500, 300))
    out = emulate_forward(q, k, v, 0.0135, False, (-1, -1), 0.0)[0]
    kernel = emulate_backward(q, k, v, dout, 0.0135, False, (-1, -1), 0.0, out=out, ds_scaled=True)
    accuracy.check_grads(kernel, q, k, v, dout, 0.0135, False, (-1, -1), 0.0, out=out)
    monkeypatch.setattr(accuracy, "_dispatched_scale_in_ds", lambda *args: False)
    with pytest.raises(AssertionError, match="dq rows 0"):
        accuracy.check_grads(kernel, q, k, v, dout, 0.0135, False, (-1, -1), 0.0, out=out)


def test_the_flush_to_zero_floor_is_negligible_but_for_subnormal_outputs():
    from flashhopper.accuracy import ftz_floor

    assert ftz_floor(2049, 16.0) < 1e-33  # dV of 2049 queries, |dO| 16
    assert ftz_floor(2049, 16.0) > 1.07e-39  # the H200's bf16 dV off by 1.1e-39 (P ~ 1e-39 flushed)


def fp8_token_descales(q, k, seed=1):
    """Per-token q / k descales (batch, heads, seqlen) with a 16x spread, V's per (batch, kv head)."""
    g = torch.Generator().manual_seed(seed)
    qd = 0.25 * 2.0 ** (4 * torch.rand(q.shape[0], q.shape[2], q.shape[1], generator=g))
    kd = 0.25 * 2.0 ** (4 * torch.rand(k.shape[0], k.shape[2], k.shape[1], generator=g))
    return qd, kd, 0.5 + torch.rand(k.shape[0], k.shape[2], generator=g)


def test_fp8_per_token_descales_of_a_per_head_one_emulate_the_same():
    """A (batch, kv head) descale given per token (expanded over the rows, q's over its query heads) is the
    same input: the emulator's out and LSE are bitwise those of the per-head form."""
    from flashhopper.accuracy import emulate_forward_fp8

    q, k, v, (qd, kd, vd) = fp8_inputs()
    tok = (qd.repeat_interleave(2, dim=1)[:, :, None].expand(2, 4, 300), kd[:, :, None].expand(2, 2, 517), vd)
    for kw in ({}, {"tile_n": 128}):
        a = emulate_forward_fp8(q, k, v, (qd, kd, vd), SCALE, True, (-1, -1), 0.0, **kw)
        b = emulate_forward_fp8(q, k, v, tok, SCALE, True, (-1, -1), 0.0, **kw)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_per_token_rule_passes_the_emulator_and_fails_wrong_descales(causal, softcap):
    """Per-token descales: the emulator's LSE is the float64 one of the dequantized inputs (to fp32
    rounding), the kernel-order emulator passes the rule; a key block's k descales taken from the next
    block, q's rows reversed within each head, or a 2% error each fail it."""
    from flashhopper.accuracy import check_forward, emulate_forward_fp8
    from flashhopper.reference import attention_ref, dequantize_fp8

    q, k, v, _ = fp8_inputs()
    ds = fp8_token_descales(q, k)
    _, ref_lse = attention_ref(*dequantize_fp8(q, k, v, ds), SCALE, causal, (-1, -1), softcap)
    out, lse = emulate_forward_fp8(q, k, v, ds, SCALE, causal, (-1, -1), softcap, tile_n=128)
    seen = torch.isfinite(ref_lse)
    assert torch.allclose(lse[seen].double(), ref_lse[seen].double(), rtol=1e-5, atol=1e-5)
    check_forward(out, lse, q, k, v, SCALE, causal, (-1, -1), softcap, ds)
    shifted = ds[1].clone()
    shifted[:, :, 128:256] = ds[1][:, :, 256:384]
    wrong_k = emulate_forward_fp8(q, k, v, (ds[0], shifted, ds[2]), SCALE, causal, (-1, -1), softcap)[0]
    wrong_q = emulate_forward_fp8(q, k, v, (ds[0].flip(2), ds[1], ds[2]), SCALE, causal, (-1, -1), softcap)[0]
    for bad in (wrong_k, wrong_q, (out.float() * 1.02).bfloat16()):
        with pytest.raises(AssertionError, match="out rows"):
            check_forward(bad, lse, q, k, v, SCALE, causal, (-1, -1), softcap, ds)
