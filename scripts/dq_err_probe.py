"""dQ error of the hdim-96 backward against the float64 reference, over seeds, for one window case
(session 7's one failure of test_backward_mask_runs): ours with mask_runs on and off, over the
test's yardstick (reference.attention_grads_in_dtype: fp32 math, dS never rounded) and the
flash-rounding one (reference.attention_grads_flash_rounding: O, P, dS rounded as flash kernels do)."""
import math
import sys

import torch

from flashhopper import flash_attn_func
from flashhopper.hopper import runtime
from flashhopper.reference import attention_bwd_ref, attention_grads_flash_rounding, attention_grads_in_dtype

b, sq, sk, hq, hk, d, window = 1, 640, 1024, 2, 1, 96, (37, 300)
seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 8
for seed in range(seeds):
    torch.manual_seed(seed)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16)
    scale = 1 / math.sqrt(d)
    ref = attention_bwd_ref(q, k, v, dout, scale, False, window, 0.0)
    yard = attention_grads_in_dtype(q, k, v, dout, scale, False, window, 0.0)
    flash = attention_grads_flash_rounding(q, k, v, dout, scale, False, window, 0.0)
    row = []
    for fields in ({}, {"mask_runs": False}):
        with runtime.bwd_config_overrides(**fields):
            qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
            out = flash_attn_func(qg, kg, vg, window_size=window)
            grads = torch.autograd.grad(out, (qg, kg, vg), dout)
        row.append([(g.double() - r).abs().max().item() for g, r in zip(grads, ref, strict=True)])
    pt = [(g.double() - r).abs().max().item() for g, r in zip(yard, ref, strict=True)]
    fl = (flash[0].double() - ref[0]).abs().max().item()
    print(f"seed {seed}: dq err default {row[0][0]:.4f} mask_runs=off {row[1][0]:.4f}"
          f" yardstick {pt[0]:.4f} flash-rounding yardstick {fl:.4f}"
          f" ratio {row[0][0] / pt[0]:.2f} / {row[1][0] / pt[0]:.2f};"
          f" max|dq| {ref[0].abs().max().item():.2f};"
          f" dk ratio {row[0][1] / pt[1]:.2f} dv ratio {row[0][2] / pt[2]:.2f}", flush=True)
