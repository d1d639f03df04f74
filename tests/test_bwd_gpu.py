"""Backward kernel (through flash_attn_func's autograd) against the float64 reference on an sm_90 GPU.

Every gradient is checked by the one rule of flashhopper/accuracy.py (per 128-row block, max and mean,
against our emulator of the kernels' rounding points); every buffer the kernels write starts as
NaN (runtime.poison), so an unwritten element fails.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from flashhopper.accuracy import check_grads
from flashhopper.reference import attention_bwd_ref, attention_ref

pytestmark = pytest.mark.gpu

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)

from flashhopper import flash_attn_func, plan  # noqa: E402
from flashhopper.hopper import runtime  # noqa: E402

DEV = "cuda"



def make_inputs(b, sq, sk, hq, hk, d, dtype, layout, seed, dv=None):
    """q, k (head dim d), v and dout (dv, default d); `layout` "packed": q, k, v of one (b, s, 3, h, d)
    tensor, "strided": each every other head of a tensor of twice the heads, else contiguous."""
    torch.manual_seed(seed)
    dv = dv or d
    if layout == "packed":  # q, k, v sliced out of one (b, s, 3, h, d) tensor: strided heads
        assert sq == sk and hq == hk and dv == d
        qkv = torch.randn(b, sq, 3, hq, d, device=DEV, dtype=dtype)
        q, k, v = (t.detach() for t in qkv.unbind(2))
    elif layout == "strided":
        q = torch.randn(b, sq, 2 * hq, d, device=DEV, dtype=dtype)[:, :, ::2]
        k = torch.randn(b, sk, 2 * hk, d, device=DEV, dtype=dtype)[:, :, 1::2]
        v = torch.randn(b, sk, 2 * hk, dv, device=DEV, dtype=dtype)[:, :, ::2]
    else:
        q = torch.randn(b, sq, hq, d, device=DEV, dtype=dtype)
        k = torch.randn(b, sk, hk, d, device=DEV, dtype=dtype)
        v = torch.randn(b, sk, hk, dv, device=DEV, dtype=dtype)
    dout = torch.randn(b, sq, hq, dv, device=DEV, dtype=dtype)
    return q, k, v, dout


def run_case(b, sq, sk, hq, hk, d, dtype=torch.bfloat16, causal=False, window=(-1, -1), softcap=0.0,
             layout="bshd", draw=0, dv=None):
    # a stable seed per case: hash() of a str differs per process, so a failure would not reproduce;
    # `draw` picks other inputs of the same case; `dv`: the value head dim (default d)
    key = (b, sq, sk, hq, hk, d, causal, window, softcap, layout) + ((dv,) if dv else ())
    seed = zlib.crc32(repr(key).encode()) + draw
    q, k, v, dout = make_inputs(b, sq, sk, hq, hk, d, dtype, layout, seed, dv)
    scale = 1.0 / math.sqrt(d)
    if layout in ("packed", "strided"):  # keep the strided views: they are what the kernel must read
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    else:
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = flash_attn_func(qg, kg, vg, causal=causal, window_size=window, softcap=softcap)
    dq, dk, dv = torch.autograd.grad(out, (qg, kg, vg), dout)
    torch.cuda.synchronize()
    check_grads((dq, dk, dv), q, k, v, dout, scale, causal, window, softcap, out=out.detach())
    return out


CASES = [  # b, sq, sk, hq, hk, d, causal, window, softcap
    (2, 128, 128, 2, 2, 64, False, (-1, -1), 0.0),
    (1, 1, 1, 2, 2, 64, False, (-1, -1), 0.0),
    (1, 1, 17, 2, 2, 128, False, (-1, -1), 0.0),
    (2, 17, 17, 4, 2, 64, True, (-1, -1), 0.0),
    (2, 300, 517, 4, 2, 64, False, (-1, -1), 0.0),
    (2, 517, 300, 2, 2, 64, True, (-1, -1), 0.0),
    (1, 1000, 1000, 2, 1, 64, True, (-1, -1), 0.0),
    (1, 700, 700, 2, 2, 64, False, (100, 20), 0.0),
    (1, 333, 333, 2, 2, 64, False, (-1, -1), 10.0),
    (2, 256, 256, 2, 2, 128, False, (-1, -1), 0.0),
    (1, 1000, 1000, 4, 1, 128, True, (-1, -1), 0.0),
    (1, 17, 1000, 2, 2, 128, False, (-1, -1), 0.0),
    (1, 1000, 17, 2, 2, 128, True, (-1, -1), 0.0),
    (1, 500, 500, 2, 2, 128, False, (64, 64), 5.0),
    (1, 4097, 4097, 1, 1, 128, True, (-1, -1), 0.0),
    (1, 1000, 1500, 8, 1, 128, True, (256, 0), 0.0),
    (2, 300, 517, 4, 2, 96, False, (-1, -1), 0.0),
    (1, 1000, 1000, 2, 1, 96, True, (-1, -1), 0.0),
    (1, 333, 333, 2, 2, 96, False, (100, 20), 10.0),
    (1, 1, 17, 2, 2, 192, False, (-1, -1), 0.0),
    (2, 300, 517, 6, 2, 192, False, (-1, -1), 0.0),
    (1, 1000, 1000, 3, 1, 192, True, (-1, -1), 0.0),
    (1, 700, 700, 2, 2, 192, False, (100, 20), 10.0),
    (1, 1, 1, 2, 2, 256, False, (-1, -1), 0.0),
    (2, 517, 300, 4, 2, 256, True, (-1, -1), 0.0),
    (1, 17, 1000, 2, 2, 256, False, (-1, -1), 0.0),
    (1, 1000, 1000, 4, 1, 256, True, (-1, -1), 0.0),
    (1, 500, 500, 2, 2, 256, False, (64, 64), 5.0),
]


@pytest.mark.parametrize("b,sq,sk,hq,hk,d,causal,window,softcap", CASES)
def test_backward(b, sq, sk, hq, hk, d, causal, window, softcap):
    run_case(b, sq, sk, hq, hk, d, causal=causal, window=window, softcap=softcap)


@pytest.mark.parametrize("fields", [{"tile_m": 64}, {"ds_stages": 2}, {"tile_m": 64, "ds_stages": 2},
                                    {"dq_by_rows": True}, {"dq_by_rows": True, "ds_stages": 1}])
@pytest.mark.parametrize("b,sq,sk,hq,hk,d,causal,window,softcap", [
    (2, 300, 517, 4, 2, 64, False, (-1, -1), 0.0),
    (1, 1000, 1000, 2, 1, 64, True, (-1, -1), 0.0),
    (1, 700, 700, 2, 2, 64, False, (100, 20), 10.0),
    (2, 17, 17, 4, 2, 64, True, (-1, -1), 0.0),
])
def test_backward_hdim64_variants(fields, b, sq, sk, hq, hk, d, causal, window, softcap):
    """hdim 64 runs 128 query rows per step (one dS^T buffer) by default; the 64-row kernel and
    the double-buffered dS^T stay selectable (runtime.bwd_config_overrides) and must agree too."""
    with runtime.bwd_config_overrides(**fields):
        run_case(b, sq, sk, hq, hk, d, causal=causal, window=window, softcap=softcap)


_BF16, _FP16 = torch.bfloat16, torch.float16
# the shapes each operand / schedule switch of the keys kernel is checked on: ragged key and query
# ends with GQA, causal with a single-KV-head group, a window with softcap, one short causal block
_SWITCH_CASES = [  # b, sq, sk, hq, hk, causal, window, softcap
    (2, 300, 517, 4, 2, False, (-1, -1), 0.0),
    (1, 1000, 1000, 2, 1, True, (-1, -1), 0.0),
    (1, 700, 700, 2, 2, False, (100, 20), 10.0),
    (2, 17, 17, 4, 2, True, (-1, -1), 0.0),
]


@pytest.mark.parametrize(("d", "fields", "dtype"), [
    (64, {"dk_rs": True}, _BF16), (64, {"dk_rs": True}, _FP16),
    (64, {"dk_rs": True, "dq_by_rows": True}, _BF16), (64, {"dk_rs": True, "tile_m": 64}, _BF16),
    (96, {"dk_rs": True}, _BF16), (128, {"dk_rs": True}, _BF16), (128, {"dk_rs": True}, _FP16),
    (128, {"dk_rs": True, "ds_stages": 2}, _BF16)])
@pytest.mark.parametrize("b,sq,sk,hq,hk,causal,window,softcap", _SWITCH_CASES)
def test_backward_dk_rs(d, fields, dtype, b, sq, sk, hq, hk, causal, window, softcap):
    """dK += dS^T Q with dS^T from registers (BwdConfig.dk_rs) agrees with the reference."""
    with runtime.bwd_config_overrides(**fields):
        run_case(b, sq, sk, hq, hk, d, dtype=dtype, causal=causal, window=window, softcap=softcap)


@pytest.mark.parametrize(("d", "fields", "dtype"), [
    (128, {"dq_per_wg": True}, _BF16), (128, {"dq_per_wg": True}, _FP16),
    (128, {"dq_per_wg": True, "dk_rs": True}, _BF16), (128, {"dq_per_wg": True, "ds_stages": 2}, _BF16),
    (64, {"dq_per_wg": True}, _BF16), (64, {"dq_per_wg": True}, _FP16),
    (64, {"dq_per_wg": True, "dq_by_rows": False}, _BF16), (64, {"dq_per_wg": True, "tile_m": 64}, _BF16),
    (96, {"dq_per_wg": True}, _BF16)])
@pytest.mark.parametrize("b,sq,sk,hq,hk,causal,window,softcap", _SWITCH_CASES)
def test_backward_dq_per_wg(d, fields, dtype, b, sq, sk, hq, hk, causal, window, softcap):
    """Per-warpgroup dQ hand-off (BwdConfig.dq_per_wg: each warpgroup's part of the dQ tile on its
    own barrier pair and its own TMA reduce-add) agrees with the reference."""
    with runtime.bwd_config_overrides(**fields):
        run_case(b, sq, sk, hq, hk, d, dtype=dtype, causal=causal, window=window, softcap=softcap)


@pytest.mark.parametrize(("d", "fields", "dtype"), [
    (64, {"scale_in_ds": True}, _BF16), (64, {"scale_in_ds": True}, _FP16),
    (96, {"scale_in_ds": True}, _BF16),
    (128, {"scale_in_ds": False}, _BF16), (128, {"scale_in_ds": False}, _FP16),  # on by default there
    (128, {"scale_in_ds": True, "tile_m": 64}, _BF16), (192, {"scale_in_ds": True}, _BF16),
    (256, {"scale_in_ds": True}, _BF16), (256, {"scale_in_ds": True, **plan.BWD_WIDE_ATOMICS[256]}, _FP16)])
@pytest.mark.parametrize("b,sq,sk,hq,hk,causal,window,softcap", _SWITCH_CASES)
def test_backward_scale_in_ds(d, fields, dtype, b, sq, sk, hq, hk, causal, window, softcap):
    """The softmax scale carried by dS (BwdConfig.scale_in_ds: D * scale from the preprocess, no
    scaling of dQ or dK) agrees with the reference."""
    with runtime.bwd_config_overrides(**fields):
        run_case(b, sq, sk, hq, hk, d, dtype=dtype, causal=causal, window=window, softcap=softcap)


@pytest.mark.variant
@pytest.mark.parametrize("d,causal,window", [(128, True, (-1, -1)), (256, False, (300, 40))])
def test_deterministic_scale_in_ds_is_bitwise_reproducible(d, causal, window):
    # (hdim 128 has it by default, so its off variant is the one checked there)
    with runtime.bwd_config_overrides(scale_in_ds=d != 128):
        _check_deterministic(d, causal, window)


_80 = {"tile_m": 80}


@pytest.mark.parametrize(("fields", "dtype"), [
    (_80, _BF16), (_80, _FP16), ({**_80, "dk_rs": True}, _BF16), ({**_80, "ds_stages": 2}, _BF16),
    ({**_80, "dq_per_wg": False}, _BF16)])
@pytest.mark.parametrize("b,sq,sk,hq,hk,causal,window,softcap", [
    (2, 300, 517, 4, 2, False, (-1, -1), 0.0),  # query blocks 0..3 full, block 3 ends at 320 > 300
    (1, 17, 1000, 2, 2, False, (-1, -1), 0.0),  # one partial query block
    (2, 80, 80, 4, 1, False, (-1, -1), 0.0),  # exactly one block, GQA 4:1
    (1, 81, 129, 2, 2, False, (-1, -1), 0.0),  # one query row into the second block
    (1, 1000, 700, 6, 2, False, (-1, -1), 0.0),  # sq > sk, 1040 padded rows (1088 preprocess rows)
    (1, 1000, 1000, 2, 1, True, (-1, -1), 0.0),  # 80-row blocks on a 128-key diagonal
    (1, 700, 700, 2, 2, False, (100, 20), 10.0),
    (2, 17, 17, 4, 2, True, (-1, -1), 0.0),
])
def test_backward_80_rows(fields, dtype, b, sq, sk, hq, hk, causal, window, softcap):
    """hdim 128 with 80 query rows per step (BwdConfig tile_m=80: dQ^T = K^T dS^T, 4-byte dQ
    stores, LSE / D stages 384 bytes apart) agrees with the reference, masks included."""
    with runtime.bwd_config_overrides(**fields):
        run_case(b, sq, sk, hq, hk, 128, dtype=dtype, causal=causal, window=window, softcap=softcap)


@pytest.mark.variant
def test_backward_80_rows_writes_every_gradient():
    q, k, v, dout = make_inputs(2, 333, 517, 4, 2, 128, torch.bfloat16, "bshd", 12)
    out, lse = runtime.forward(q, k, v, 0.125, False, (-1, -1), 0.0)
    dk = torch.full_like(k, float("nan"))
    dv = torch.full_like(v, float("nan"))
    with runtime.bwd_config_overrides(**_80):
        dq, dk, dv = runtime.backward(q, k, v, out, dout, lse, 0.125, False, (-1, -1), 0.0, dk=dk, dv=dv)
    assert not dq.isnan().any() and not dk.isnan().any() and not dv.isnan().any()


@pytest.mark.parametrize(("fields", "dtype"), [
    ({"ds_then_dv": True}, _BF16), ({"ds_then_dv": True}, _FP16),
    ({"ds_then_dv": True, "dk_rs": False}, _BF16), ({"ds_then_dv": True, "dq_by_rows": False}, _BF16),
    ({"ds_then_dv": True, "dq_per_wg": False}, _BF16)])
@pytest.mark.parametrize("b,sq,sk,hq,hk,causal,window,softcap", _SWITCH_CASES)
def test_backward_ds_then_dv(fields, dtype, b, sq, sk, hq, hk, causal, window, softcap):
    """hdim 64 in FA3 / FA4's step order (BwdConfig.ds_then_dv: all of dS^T stored before one dV
    group, dO released once dV is done) agrees with the reference; softcap keeps ds_before_dv."""
    with runtime.bwd_config_overrides(**fields):
        run_case(b, sq, sk, hq, hk, 64, dtype=dtype, causal=causal, window=window, softcap=softcap)


# BwdConfig.mask_runs: masked steps only where the query block crosses the causal / window edges
# of the key block or the key block is the ragged last one. Odd lengths (ragged key blocks and
# padded query blocks), seqlen_q < and > seqlen_k (diag of both signs), GQA, causal, symmetric,
# asymmetric and one-sided windows, softcap, and whole blocks (no ragged CTA: mask-free steps only
# in the non-causal kernel, both bodies in the causal one).
_MASK_RUNS_CASES = [  # b, sq, sk, hq, hk, causal, window, softcap
    (2, 300, 517, 4, 2, False, (-1, -1), 0.0),
    (2, 517, 300, 4, 2, True, (-1, -1), 0.0),
    (1, 1000, 1000, 2, 1, True, (-1, -1), 0.0),
    (1, 700, 700, 2, 2, False, (100, 20), 10.0),
    (1, 640, 1024, 2, 1, False, (37, 300), 0.0),
    (1, 1024, 640, 4, 2, False, (300, 37), 0.0),
    (1, 768, 768, 2, 2, True, (-1, -1), 3.0),
    (1, 650, 900, 2, 2, False, (-1, 70), 0.0),
    (1, 900, 650, 2, 2, False, (70, -1), 0.0),
    (2, 256, 384, 4, 4, False, (-1, -1), 5.0),
    (2, 17, 17, 4, 2, True, (-1, -1), 0.0),
    (1, 1, 17, 2, 2, False, (-1, -1), 0.0),
]


@pytest.mark.parametrize(("d", "fields", "dtype"), [
    (64, {"mask_runs": True}, _BF16), (64, {"mask_runs": True}, _FP16),
    (64, {"mask_runs": True, "tile_m": 64}, _BF16), (96, {"mask_runs": True}, _BF16),
    (128, {"mask_runs": True}, _BF16), (128, {"mask_runs": True}, _FP16)])
@pytest.mark.parametrize("b,sq,sk,hq,hk,causal,window,softcap", _MASK_RUNS_CASES)
def test_backward_mask_runs(d, fields, dtype, b, sq, sk, hq, hk, causal, window, softcap):
    """Masked / mask-free steps per query block (BwdConfig.mask_runs) agree with the reference."""
    with runtime.bwd_config_overrides(**fields):
        run_case(b, sq, sk, hq, hk, d, dtype=dtype, causal=causal, window=window, softcap=softcap)


@pytest.mark.parametrize(("d", "fields"), [
    (64, {"mask_runs": True, "dk_rs": False, "dq_per_wg": False}), (64, {"mask_runs": True, "ds_stages": 1}),
    (128, {"mask_runs": True, "ds_stages": 2}), (128, {"mask_runs": True, "dq_per_wg": False})])
@pytest.mark.parametrize("b,sq,sk,hq,hk,causal,window,softcap", [_MASK_RUNS_CASES[i] for i in (0, 2, 4, 6)])
def test_backward_mask_runs_variants(d, fields, b, sq, sk, hq, hk, causal, window, softcap):
    with runtime.bwd_config_overrides(**fields):
        run_case(b, sq, sk, hq, hk, d, causal=causal, window=window, softcap=softcap)


@pytest.mark.variant
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("b,sq,sk,hq,hk,causal,window,softcap",
                         [_MASK_RUNS_CASES[i] for i in (0, 1, 3, 4, 5, 6)])
def test_backward_mask_runs_matches_default_bitwise(d, b, sq, sk, hq, hk, causal, window, softcap):
    """mask_runs only drops selects that keep a value: with deterministic dQ the gradients equal the
    default kernel's bit for bit (the same P^T, dS^T and the same WGMMA / reduce order). Should this
    fail while test_backward_mask_runs passes, suspect ptxas contracting a multiply-add differently
    in one of the two step bodies before the mask."""
    q, k, v, dout = make_inputs(b, sq, sk, hq, hk, d, torch.bfloat16, "bshd", 11)
    grads = []
    for fields in ({}, {"mask_runs": True}):
        with runtime.bwd_config_overrides(**fields):
            qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
            out = flash_attn_func(qg, kg, vg, causal=causal, window_size=window, softcap=softcap,
                                  deterministic=True)
            grads.append(torch.autograd.grad(out, (qg, kg, vg), dout))
    for name, a, b_ in zip("qkv", *grads, strict=True):
        assert torch.equal(a, b_), f"d{name}: mask_runs differs from the default kernel"


@pytest.mark.variant
@pytest.mark.parametrize("d,causal,window", [(64, True, (-1, -1)), (128, False, (200, 50)),
                                             (96, False, (-1, -1))])
def test_deterministic_mask_runs_is_bitwise_reproducible(d, causal, window):
    with runtime.bwd_config_overrides(mask_runs=True):
        _check_deterministic(d, causal, window)


# hdim 192 / 256 (hopper/bwd_wide.py) tile shapes and dO ring depths for timing: tile_n 80 with one
# dO stage (FA3's hdim-256 tile; P / dS unswizzled, dQ in two chunks), FA4's 48, and one dO stage
# at today's tiles. Sequence lengths that are not multiples of 80 / 48 test the key-block edges.
_WIDE_CASES = [  # b, sq, sk, hq, hk, causal, window, softcap
    (2, 300, 517, 4, 2, False, (-1, -1), 0.0),
    (1, 1000, 1000, 4, 1, True, (-1, -1), 0.0),
    (2, 517, 300, 4, 2, True, (-1, -1), 0.0),
    (1, 17, 1000, 2, 2, False, (-1, -1), 0.0),
    (1, 700, 700, 2, 2, False, (100, 20), 10.0),
]


# the wide kernel with dQ by atomics, as formerly dispatched (the candidate tiles below were
# chosen against it; dQ by TMA reduce-adds through one smem part is dispatched since)
WIDE_ATOMICS = plan.BWD_WIDE_ATOMICS


@pytest.mark.variant
@pytest.mark.parametrize(("d", "fields"), [
    (256, {"tile_n": 64, "do_stages": 0}),
    (256, {"tile_n": 64, "do_stages": 1}),
    (256, {"tile_n": 48, "do_stages": 0}),
    (256, {"tile_n": 48}),
    (256, {"tile_n": 64, "do_stages": 0, "dq_chunks": 2}),
    (192, {"do_stages": 1}),
    (256, {"ds_stages": 1}),  # one P / dS buffer pair (two, the default, drop a barrier per step)
    (192, {"ds_stages": 1}),
    (192, {"dkv_by_keys": True, "num_consumer_wg": 2}),  # FA4's shape (docs/decisions.md)
])
@pytest.mark.parametrize("b,sq,sk,hq,hk,causal,window,softcap", _WIDE_CASES)
def test_backward_wide_variants(d, fields, b, sq, sk, hq, hk, causal, window, softcap):
    """The wide kernel's candidate tiles (BwdConfig tile_n, do_stages) agree with the reference."""
    with runtime.bwd_config_overrides(**{**WIDE_ATOMICS[d], **fields}):
        run_case(b, sq, sk, hq, hk, d, causal=causal, window=window, softcap=softcap)


@pytest.mark.parametrize("dtype", [_BF16, _FP16])
@pytest.mark.parametrize("b,sq,sk,hq,hk", [(1, 512, 512, 2, 2), (2, 300, 517, 4, 2), (2, 1024, 1000, 4, 1),
                                          (1, 17, 1024, 2, 2), (1, 1, 1, 2, 2), (2, 80, 80, 2, 1)])
def test_backward_short_causal_dispatch(dtype, b, sq, sk, hq, hk):
    """hdim 128 causal up to 1k tokens runs 64-row steps (plan.bwd_per_call), not the 80 of longer
    sequences: the dispatched path itself, with ragged ends and GQA."""
    assert plan.bwd_per_call(128, sq, sk, True, False) == {"tile_m": 64, "dq_rows_interleaved": True}
    run_case(b, sq, sk, hq, hk, 128, dtype=dtype, causal=True)


@pytest.mark.parametrize("d,b,sq,sk,hq,hk", [(256, 1, 1024, 1024, 2, 1), (256, 2, 2000, 1500, 4, 2),
                                              (256, 1, 1100, 2048, 2, 2), (128, 1, 5000, 5000, 2, 1),
                                              (128, 1, 4097, 8192, 2, 2)])
def test_backward_lpt_causal_dispatch(d, b, sq, sk, hq, hk):
    """Causal hdim 256 at 1k-2k tokens and hdim 128 at 2k-8k launch longest first (plan.bwd_per_call):
    the dispatched path itself, with ragged ends, GQA and seqlen_q != seqlen_k."""
    assert plan.bwd_per_call(d, sq, sk, True, False) == {"lpt": True}
    run_case(b, sq, sk, hq, hk, d, causal=True)


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_backward_fp16(d):
    run_case(2, 333, 333, 2, 1, d, dtype=torch.float16, causal=True)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_backward_packed_qkv(d):
    run_case(2, 257, 257, 3, 3, d, layout="packed")


def test_noncontiguous_grad_output():
    """An expanded / transposed dout (from a sum or a view) still gives the right gradients."""
    q, k, v, _ = make_inputs(1, 200, 200, 2, 2, 64, torch.bfloat16, "bshd", 7)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    flash_attn_func(qg, kg, vg).sum().backward()
    ones = torch.ones(1, 200, 2, 64, device=DEV, dtype=torch.bfloat16)
    ref = attention_bwd_ref(q, k, v, ones, 1 / 8.0)
    for mine, exact in zip((qg.grad, kg.grad, vg.grad), ref, strict=True):
        assert (mine.double() - exact).abs().max().item() < 0.05 * max(1.0, exact.abs().max().item())


def test_grad_output_at_unaligned_offset():
    """A contiguous dout whose storage starts 2 bytes off 16-byte alignment (a view into a larger
    buffer) is copied for TMA, not read misaligned."""
    q, k, v, dout = make_inputs(1, 200, 200, 2, 2, 64, torch.bfloat16, "bshd", 5)
    buf = torch.empty(dout.numel() + 1, device=DEV, dtype=torch.bfloat16)
    shifted = buf[1:].view(dout.shape)
    shifted.copy_(dout)
    assert shifted.is_contiguous() and shifted.data_ptr() % 16
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    dq, dk, dv = torch.autograd.grad(flash_attn_func(qg, kg, vg), (qg, kg, vg), shifted)
    ref = attention_bwd_ref(q, k, v, dout, 1 / 8.0)
    for mine, exact in zip((dq, dk, dv), ref, strict=True):
        assert (mine.double() - exact).abs().max().item() < 0.05 * max(1.0, exact.abs().max().item())


def test_unwritten_gradients_show():
    """dK/dV buffers filled with NaN before the kernel: every element must be overwritten."""
    q, k, v, dout = make_inputs(2, 333, 517, 4, 2, 64, torch.bfloat16, "bshd", 11)
    out, lse = runtime.forward(q, k, v, 0.125, True, (-1, -1), 0.0)
    dk = torch.full_like(k, float("nan"))
    dv = torch.full_like(v, float("nan"))
    runtime.backward(q, k, v, out, dout, lse, 0.125, True, (-1, -1), 0.0, dk=dk, dv=dv)
    assert not dk.isnan().any() and not dv.isnan().any()


@pytest.mark.parametrize("d,causal,window,fields", [
    (128, False, (-1, -1), {}), (128, True, (-1, -1), {}), (64, False, (200, 50), {}),
    (96, True, (-1, -1), {}), (64, True, (-1, -1), {"dq_by_rows": True}),
    (64, True, (-1, -1), {"dk_rs": True}), (128, False, (-1, -1), {"dk_rs": True}),
    (128, True, (-1, -1), {"dq_per_wg": True}), (64, False, (200, 50), {"dq_per_wg": True}),
    (128, False, (-1, -1), {"tile_m": 80}), (128, True, (-1, -1), {"tile_m": 80}),
    (128, False, (-1, -1), {"tile_m": 80, "dq_per_wg": False}),
    (64, True, (-1, -1), {"ds_then_dv": True}),
    (256, False, (-1, -1), {}), (256, True, (-1, -1), {}), (192, False, (300, 0), {}),
    (192, True, (-1, -1), {})])
def test_deterministic_is_bitwise_reproducible(d, causal, window, fields):
    with runtime.bwd_config_overrides(**fields):
        _check_deterministic(d, causal, window)


def _check_deterministic(d, causal, window, dv=None):
    q, k, v, dout = make_inputs(2, 2000, 2000, 8, 2, d, torch.bfloat16, "bshd", 3, dv)
    grads, outs = [], []
    for _ in range(3):
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = flash_attn_func(qg, kg, vg, causal=causal, window_size=window, deterministic=True)
        outs.append(out.detach())
        grads.append(torch.autograd.grad(out, (qg, kg, vg), dout))
    for other in grads[1:]:
        for a, b in zip(grads[0], other, strict=True):
            assert torch.equal(a, b)
    check_grads(grads[0], q, k, v, dout, 1 / math.sqrt(d), causal, window, 0.0, out=outs[0])


@pytest.mark.parametrize("d", [192, 256])
def test_wide_dq_slot_handoffs_are_bitwise_reproducible(d):
    """The wide kernel's one dQ smem part, lent to the consumer warpgroups in turn (dq_tma, dq_slots=1):
    compute-sanitizer's racecheck reports write-after-write hazards between the two warpgroups' writes of
    it, because the order it relies on (the TMA reduce-add's `cp.async.bulk.wait_group.read`, then the
    writer warp's named barriers) is not in racecheck's model. Were that order broken, a warpgroup's
    dQ part would be overwritten before the TMA read it: dQ would change from run to run. 4k tokens
    (64 query steps a CTA, over 20,000 handoffs a run), deterministic mode, eight runs bitwise equal
    and checked against the reference."""
    cfg = plan.bwd_config("bf16", d, deterministic=True)
    assert cfg.dq_tma and cfg.dq_slots == 1, "the dispatch no longer lends one dQ part: retarget this test"
    q, k, v, dout = make_inputs(1, 4096, 4096, 4, 4, d, torch.bfloat16, "bshd", 11)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = flash_attn_func(qg, kg, vg, deterministic=True)
    first = torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True)
    for _ in range(7):
        again = torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True)
        for name, a, b in zip("qkv", first, again, strict=True):
            assert torch.equal(a, b), f"d{name} differs between two runs of the same deterministic call"
    check_grads(first, q, k, v, dout, 1 / math.sqrt(d), False, (-1, -1), 0.0, out=out.detach())


# (hdim, dv) = (192, 128), MLA prefill's head sizes: hdim 192's kernel on V and dO padded with zero
# columns, D over O's 128 (hopper/runtime.py, _pad_value_dim). Odd lengths, sq != sk both ways, GQA,
# causal, windows, softcap, one query / one key, strided inputs (the padding's copies take any strides)
_SPLIT_CASES = [  # b, sq, sk, hq, hk, causal, window, softcap
    (1, 1, 1, 2, 2, False, (-1, -1), 0.0),
    (1, 1, 17, 2, 2, False, (-1, -1), 0.0),
    (2, 300, 517, 6, 2, False, (-1, -1), 0.0),
    (2, 517, 300, 4, 2, True, (-1, -1), 0.0),
    (1, 1000, 1000, 3, 1, True, (-1, -1), 0.0),
    (1, 700, 700, 2, 2, False, (100, 20), 10.0),
    (1, 333, 1000, 4, 4, False, (-1, 50), 0.0),
    (1, 1000, 700, 8, 2, True, (64, -1), 5.0),
]


@pytest.mark.parametrize("layout", ["bshd", "strided"])
@pytest.mark.parametrize("dtype", [_BF16, _FP16])
@pytest.mark.parametrize("b,sq,sk,hq,hk,causal,window,softcap", _SPLIT_CASES)
def test_backward_split_head_dims(dtype, layout, b, sq, sk, hq, hk, causal, window, softcap):
    run_case(b, sq, sk, hq, hk, 192, dtype=dtype, causal=causal, window=window, softcap=softcap,
             layout=layout, dv=128)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (300, 40))])
def test_backward_split_head_dims_deterministic_is_bitwise_reproducible(causal, window):
    _check_deterministic(192, causal, window, dv=128)


_HEAD_MAJOR_CASES = [  # the wide kernel's TMA reduce-adds (dq_tma) exist at hdim 192 / 256 only
    pytest.param(fields, d, id=f"{name}-{d}")
    for name, fields in (("pre_zero", {}), ("fill", {"pre_zero_dq": False}),
                         ("dq_slot", {"dq_tma": True, "dq_slots": 1, "ds_stages": 1}))
    for d in (64, 128, 192, 256) if name != "dq_slot" or d >= 192]


@pytest.mark.variant
@pytest.mark.parametrize(("fields", "d"), _HEAD_MAJOR_CASES)
@pytest.mark.parametrize("b,sq,sk,hq,hk,causal,window,softcap", [
    (2, 300, 517, 4, 2, False, (-1, -1), 0.0), (1, 1000, 1000, 2, 1, True, (-1, -1), 0.0),
    (1, 700, 700, 2, 2, False, (100, 20), 10.0), (2, 17, 17, 4, 2, True, (-1, -1), 0.0)])
def test_backward_dq_accum_head_major(fields, d, b, sq, sk, hq, hk, causal, window, softcap):
    """BwdConfig.dq_accum_head_major: the same kernels add dQ into a (b, h, sq, d)-ordered accumulator
    (a permuted view); dQ comes back in q's order. With the preprocess clearing it, with a fill, and
    with the wide kernel's TMA reduce-adds through one smem part."""
    with runtime.bwd_config_overrides(dq_accum_head_major=True, **fields):
        run_case(b, sq, sk, hq, hk, d, causal=causal, window=window, softcap=softcap)


@pytest.mark.variant
@pytest.mark.parametrize("d,causal,window", [(128, True, (-1, -1)), (192, False, (300, 40))])
def test_deterministic_dq_accum_head_major_is_bitwise_reproducible(d, causal, window):
    with runtime.bwd_config_overrides(dq_accum_head_major=True):
        _check_deterministic(d, causal, window)


@pytest.mark.variant
@pytest.mark.parametrize("d", [64, 128, 192, 256])
@pytest.mark.parametrize("b,sq,sk,hq,hk,causal,window,softcap", [
    (2, 300, 517, 4, 2, False, (-1, -1), 0.0), (1, 1000, 1000, 2, 1, True, (-1, -1), 0.0),
    (1, 700, 700, 2, 2, False, (100, 20), 10.0), (2, 17, 17, 4, 2, True, (-1, -1), 0.0)])
def test_backward_pdl(d, b, sq, sk, hq, hk, causal, window, softcap):
    """BwdConfig.pdl: the main kernel may start under the preprocess's tail; only the warps that
    read the preprocess's rows and cleared accumulator wait for it. Three calls in a row on different
    inputs, so that each call's preprocess follows the previous call's kernels and a main kernel that
    read the rows or the accumulator before its preprocess had written them would see another call's
    values (identical inputs would hide that)."""
    with runtime.bwd_config_overrides(pdl=True):
        for draw in range(3):
            run_case(b, sq, sk, hq, hk, d, causal=causal, window=window, softcap=softcap, draw=draw)


@pytest.mark.variant
@pytest.mark.parametrize("d,causal,window", [(128, True, (-1, -1)), (256, False, (300, 40))])
def test_deterministic_pdl_is_bitwise_reproducible(d, causal, window):
    with runtime.bwd_config_overrides(pdl=True):
        _check_deterministic(d, causal, window)


# BwdConfig.dq_tma in FA4's tiles: hdim 192 as 2 warpgroups x 48 keys, hdim 256 at 64 x 64 with one
# Q / dO stage (the fp32 dQ smem tile takes what a stage and a P / dS pair had)
DQ_TMA = {192: {"num_consumer_wg": 2, "dkv_by_keys": True, "dq_tma": True, "dq_slots": 0, "do_stages": 1,
                "ds_stages": 1},
          256: {"tile_n": 64, "num_stages": 1, "do_stages": 1, "ds_stages": 1, "dq_tma": True, "dq_slots": 0}}


# with dq_slots: one dQ part in smem lent to each warpgroup in turn, in the dispatched tiles with one
# P / dS pair (192 in FA4's split with two Q / dO stages)
DQ_SLOT = {192: {"num_consumer_wg": 2, "dkv_by_keys": True, "ds_stages": 1, "dq_tma": True, "dq_slots": 1},
           256: {"ds_stages": 1, "dq_tma": True, "dq_slots": 1}}


# the slot with dQ's query rows interleaved in smem and read back by a 5-D TMA view of the padded
# accumulator (BwdConfig.dq_rows_interleaved): batch > 1 with ragged query lengths is where a wrong
# merge of batch into the rows would show
DQ_ROWS = {d: {**DQ_SLOT[d], "dq_rows_interleaved": True} for d in DQ_SLOT}


@pytest.mark.variant
@pytest.mark.parametrize("b,sq,sk,hq,hk,causal,window,softcap", [
    (2, 300, 517, 4, 2, False, (-1, -1), 0.0), (1, 1000, 1000, 3, 1, True, (-1, -1), 0.0),
    (1, 700, 700, 2, 2, False, (100, 20), 10.0), (2, 17, 17, 4, 2, True, (-1, -1), 0.0)])
def test_backward_dq_tma_fa4_tile_256(b, sq, sk, hq, hk, causal, window, softcap):
    """FA4's hdim 256 tile (64 x 48, two Q stages, one dO stage, one P / dS pair) with the whole fp32
    dQ tile in smem."""
    with runtime.bwd_config_overrides(tile_n=48, do_stages=1, ds_stages=1, dq_tma=True, dq_slots=0):
        run_case(b, sq, sk, hq, hk, 256, causal=causal, window=window, softcap=softcap)


@pytest.mark.variant
@pytest.mark.parametrize("slot", ["tile", "slot", "rows"])
@pytest.mark.parametrize("d", [192, 256])
@pytest.mark.parametrize("b,sq,sk,hq,hk,causal,window,softcap", [
    (2, 300, 517, 4, 2, False, (-1, -1), 0.0), (2, 517, 300, 2, 2, True, (-1, -1), 0.0),
    (1, 1000, 1000, 3, 1, True, (-1, -1), 0.0), (1, 700, 700, 2, 2, False, (100, 20), 10.0),
    (1, 1, 17, 2, 2, False, (-1, -1), 0.0), (2, 17, 17, 4, 2, True, (-1, -1), 0.0)])
def test_backward_dq_tma(slot, d, b, sq, sk, hq, hk, causal, window, softcap):
    with runtime.bwd_config_overrides(**{"tile": DQ_TMA, "slot": DQ_SLOT, "rows": DQ_ROWS}[slot][d]):
        run_case(b, sq, sk, hq, hk, d, causal=causal, window=window, softcap=softcap)


@pytest.mark.variant
@pytest.mark.parametrize("slot", ["tile", "slot", "rows"])
@pytest.mark.parametrize("d,causal,window", [(192, True, (-1, -1)), (256, False, (300, 40))])
def test_deterministic_dq_tma_is_bitwise_reproducible(slot, d, causal, window):
    with runtime.bwd_config_overrides(**{"tile": DQ_TMA, "slot": DQ_SLOT, "rows": DQ_ROWS}[slot][d]):
        _check_deterministic(d, causal, window)


# the keys kernel's dQ tile with its rows interleaved the same way (hdim 64 / 96; 128 at 64-row steps)
@pytest.mark.variant
@pytest.mark.parametrize(("d", "fields"), [(64, {}), (96, {}), (128, {"tile_m": 64})])
@pytest.mark.parametrize("b,sq,sk,hq,hk,causal,window,softcap", [
    (2, 300, 517, 4, 2, False, (-1, -1), 0.0), (2, 517, 300, 2, 2, True, (-1, -1), 0.0),
    (1, 1000, 1000, 3, 1, True, (-1, -1), 0.0), (1, 700, 700, 2, 2, False, (100, 20), 10.0),
    (1, 1, 17, 2, 2, False, (-1, -1), 0.0), (3, 17, 17, 4, 2, True, (-1, -1), 0.0)])
def test_backward_dq_rows_interleaved_keys(d, fields, b, sq, sk, hq, hk, causal, window, softcap):
    with runtime.bwd_config_overrides(dq_rows_interleaved=True, **fields):
        run_case(b, sq, sk, hq, hk, d, causal=causal, window=window, softcap=softcap)


@pytest.mark.variant
@pytest.mark.parametrize("d,causal,window", [(64, True, (-1, -1)), (96, False, (300, 40))])
def test_deterministic_dq_rows_interleaved_keys_is_bitwise_reproducible(d, causal, window):
    with runtime.bwd_config_overrides(dq_rows_interleaved=True):
        _check_deterministic(d, causal, window)


@pytest.mark.variant
@pytest.mark.parametrize("d,causal,window", [(256, True, (-1, -1)), (192, False, (300, 40))])
def test_deterministic_wide_one_pds_buffer_is_bitwise_reproducible(d, causal, window):
    with runtime.bwd_config_overrides(**{**WIDE_ATOMICS[d], "ds_stages": 1}):
        _check_deterministic(d, causal, window)


@pytest.mark.variant
@pytest.mark.parametrize("d,causal,window", [(192, True, (-1, -1)), (192, False, (300, 40))])
def test_deterministic_wide_dkv_by_keys_is_bitwise_reproducible(d, causal, window):
    with runtime.bwd_config_overrides(**{**WIDE_ATOMICS[d], "dkv_by_keys": True, "num_consumer_wg": 2}):
        _check_deterministic(d, causal, window)


@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("causal,softcap", [(False, 0.0), (True, 0.0), (False, 3.0)])
def test_gradient_matches_finite_differences(d, causal, softcap):
    """<grad, direction> from the kernel against a central difference of the exact float64
    forward: an independent check of the whole chain rule (mask, softcap, scale, GQA sums)."""
    q, k, v, w = make_inputs(1, 37, 53, 4, 2, d, torch.bfloat16, "bshd", 5)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = flash_attn_func(qg, kg, vg, causal=causal, softcap=softcap)
    grads = torch.autograd.grad(out, (qg, kg, vg), w)
    gen = torch.Generator(device=DEV).manual_seed(9)
    x64 = [t.double() for t in (q, k, v)]
    scale, eps = 1 / math.sqrt(d), 1e-3
    for i in range(3):
        direction = torch.randn(x64[i].shape, device=DEV, dtype=torch.float64, generator=gen)

        def loss(sign, i=i, direction=direction):
            args = [t + sign * eps * direction if j == i else t for j, t in enumerate(x64)]
            return (attention_ref(*args, scale, causal, (-1, -1), softcap)[0] * w.double()).sum().item()

        fd = (loss(1) - loss(-1)) / (2 * eps)
        mine = (grads[i].double() * direction).sum().item()
        assert abs(mine - fd) <= 0.02 * abs(fd) + 0.05, ("qkv"[i], mine, fd)


def test_hopper_and_reference_backends_agree_through_autograd():
    q, k, v, dout = make_inputs(1, 65, 65, 2, 2, 64, torch.bfloat16, "bshd", 1)
    grads = []
    for backend in ("hopper", "reference"):
        qg = q.clone().requires_grad_(True)
        out = flash_attn_func(qg, k, v, backend=backend, causal=True)
        grads.append(torch.autograd.grad(out, (qg,), dout)[0].double())
    assert (grads[0] - grads[1]).abs().max().item() < 0.05


_LPT_CASES = [  # b, sq, sk, hq, hk, causal, window, softcap
    (3, 517, 300, 4, 2, True, (-1, -1), 0.0),  # 6 (head, batch) pairs, sq > sk
    (2, 300, 1000, 6, 2, True, (-1, -1), 0.0),  # sk > sq, GQA 3:1
    (5, 1000, 1000, 2, 1, True, (-1, -1), 0.0),  # 5 pairs: a partial last section at 64 KiB
    (1, 700, 700, 2, 2, False, (100, 20), 10.0),  # local, softcap
]


@pytest.mark.parametrize("fields", [{"lpt": True}, {"lpt": True, "lpt_l2_kib": 64},
                                    {"lpt": True, "lpt_l2_kib": 2600}])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("b,sq,sk,hq,hk,causal,window,softcap", _LPT_CASES)
def test_backward_lpt(d, fields, b, sq, sk, hq, hk, causal, window, softcap):
    """Longest-first launch order (BwdConfig.lpt): one section (24 MiB), one pair per section
    (64 KiB: a pair of these shapes takes 0.3-5 MiB), and two pairs per section with a partial
    last one (2600 KiB at hdim 64, 5 x 1000 x 1000, GQA 2:1: 1.2 MiB a pair). Each key block of
    each (head, batch) pair must run once: dK / dV start as NaN so that a CTA left out shows."""
    q, k, v, dout = make_inputs(b, sq, sk, hq, hk, d, torch.bfloat16, "bshd", 17)
    scale = 1 / math.sqrt(d)
    with runtime.bwd_config_overrides(**fields):
        out, lse = runtime.forward(q, k, v, scale, causal, window, softcap)
        dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        dq, dk, dv = runtime.backward(q, k, v, out, dout, lse, scale, causal, window, softcap, dk=dk, dv=dv)
    torch.cuda.synchronize()
    check_grads((dq, dk, dv), q, k, v, dout, scale, causal, window, softcap, out=out)


@pytest.mark.variant
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("b,sq,sk,hq,hk,causal,window,softcap", [
    (2, 300, 517, 4, 2, False, (-1, -1), 0.0), (1, 1000, 1000, 2, 1, True, (-1, -1), 0.0),
    (2, 17, 17, 4, 2, True, (-1, -1), 0.0), (1, 1, 17, 2, 2, False, (-1, -1), 0.0),
    (1, 700, 700, 2, 2, False, (100, 20), 10.0)])
def test_backward_pre_zero_dq(d, b, sq, sk, hq, hk, causal, window, softcap, monkeypatch):
    """The preprocess clears the fp32 dQ accumulator (BwdConfig.pre_zero_dq) instead of a fill
    kernel: the accumulator starts as NaN, so a row it missed shows in dQ."""
    monkeypatch.setattr(runtime, "poison", True)
    with runtime.bwd_config_overrides(pre_zero_dq=True):
        run_case(b, sq, sk, hq, hk, d, causal=causal, window=window, softcap=softcap)


# hdim 256 splits S / dP by GEMM (sdp_by_gemm, dispatched) except under softcap,
# which keeps the split by keys: that kernel without softcap too, as formerly dispatched
@pytest.mark.variant
@pytest.mark.parametrize("b,sq,sk,hq,hk,causal,window", [
    (2, 300, 517, 4, 2, False, (-1, -1)), (1, 1000, 1000, 3, 1, True, (-1, -1)),
    (1, 700, 700, 2, 2, False, (100, 20)), (1, 1, 17, 2, 2, False, (-1, -1))])
def test_backward_hdim256_split_by_keys(b, sq, sk, hq, hk, causal, window):
    with runtime.bwd_config_overrides(sdp_by_gemm=False):
        run_case(b, sq, sk, hq, hk, 256, causal=causal, window=window)
