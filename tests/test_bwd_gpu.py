"""Backward kernel against the float64 reference on an sm_90 GPU.

Opt-in (FLASHHOPPER_TEST_BWD=1) until the first backward kernel has been run and fixed on a GPU:
it was written and compile-checked without one, and flash_attn_func does not dispatch it yet.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from flashhopper.reference import attention_bwd_ref, visible_mask

pytestmark = pytest.mark.gpu

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)
if os.environ.get("FLASHHOPPER_TEST_BWD") != "1":
    pytest.skip("backward kernel not validated yet: set FLASHHOPPER_TEST_BWD=1", allow_module_level=True)

from flashhopper.hopper import forward, runtime  # noqa: E402


def torch_grads(q, k, v, dout, scale, causal, window, softcap):
    """PyTorch autograd in the input dtype (fp32 math): the yardstick for the dtype's own error."""
    qs, ks, vs = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    kk = ks.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    vv = vs.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qs.float(), kk.float()) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible_mask(q.shape[1], k.shape[1], causal, window, q.device), float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    o = torch.einsum("bhqk,bkhd->bqhd", p.to(q.dtype).float(), vv.float()).to(q.dtype)
    o.backward(dout)
    return qs.grad, ks.grad, vs.grad


@pytest.mark.parametrize("b,sq,sk,hq,hk,d,causal,window,softcap", [
    (2, 128, 128, 2, 2, 64, False, (-1, -1), 0.0),
    (2, 300, 517, 4, 2, 64, False, (-1, -1), 0.0),
    (1, 1000, 1000, 2, 1, 64, True, (-1, -1), 0.0),
    (2, 517, 300, 2, 2, 64, True, (-1, -1), 0.0),
    (1, 700, 700, 2, 2, 64, False, (100, 20), 0.0),
    (1, 333, 333, 2, 2, 64, False, (-1, -1), 10.0),
])
def test_backward(b, sq, sk, hq, hk, d, causal, window, softcap):
    torch.manual_seed(sq * 7 + sk)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16)
    scale = 1 / math.sqrt(d)
    out, lse = forward(q, k, v, scale, causal, window, softcap)
    dq, dk, dv = runtime.backward(q, k, v, out, dout, lse, scale, causal, window, softcap)
    ref = attention_bwd_ref(q, k, v, dout, scale, causal, window, softcap)
    yard = torch_grads(q, k, v, dout, scale, causal, window, softcap)
    for name, mine, exact, pt in zip("qkv", (dq, dk, dv), ref, yard, strict=True):
        assert not mine.isnan().any(), f"d{name} has NaN"
        err = (mine.double() - exact).abs().max().item()
        err_pt = (pt.double() - exact).abs().max().item()
        assert err <= 2 * err_pt + 1e-3, (name, err, err_pt)
