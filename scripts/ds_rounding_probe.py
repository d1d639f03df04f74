"""What forming dS from the bf16-rounded P (BwdConfig.sdp_by_gemm) costs in gradient error, on the CPU.

For the hdim 256 cases of tests/test_bwd_gpu.py (same shapes and per-case seeds), the max abs error
against the float64 reference of: the tests' yardstick (reference.attention_grads_in_dtype), a flash
backward's roundings with the fp32 P in dS (what the dispatched kernels do), and with the rounded P.
The GPU tests require a kernel's error <= 2 x the yardstick's + 1e-3; printed as ratios to the yardstick.

    PYTHONPATH=$PWD .venv/bin/python scripts/ds_rounding_probe.py [--seeds N]
"""
from __future__ import annotations

import argparse
import math
import zlib

import torch

from flashhopper.reference import attention_bwd_ref, attention_grads_flash_rounding, attention_grads_in_dtype

CASES = [  # b, sq, sk, hq, hk, d, causal, window (tests/test_bwd_gpu.py's hdim 256 rows, no softcap)
    (2, 517, 300, 4, 2, 256, True, (-1, -1)),
    (1, 17, 1000, 2, 2, 256, False, (-1, -1)),
    (1, 1000, 1000, 4, 1, 256, True, (-1, -1)),
    (1, 500, 500, 2, 2, 256, False, (64, 64)),
]


def max_err(t, ref):
    return (t.double() - ref).abs().max().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=1, help="the test's seed, then this many - 1 more")
    args = ap.parse_args()
    print("case | seed | grad | yardstick err | fp32 P in dS / yardstick | rounded P in dS / yardstick")
    worst = [0.0, 0.0]
    for b, sq, sk, hq, hk, d, causal, window in CASES:
        base = zlib.crc32(repr((b, sq, sk, hq, hk, d, causal, window, 0.0, "bshd")).encode())
        for i in range(args.seeds):
            torch.manual_seed(base + i)
            q, k, v, dout = (torch.randn(b, s, h, d, dtype=torch.bfloat16)
                             for s, h in ((sq, hq), (sk, hk), (sk, hk), (sq, hq)))
            scale = 1.0 / math.sqrt(d)
            ref = attention_bwd_ref(q, k, v, dout, scale, causal, window, 0.0)
            yard = attention_grads_in_dtype(q, k, v, dout, scale, causal, window, 0.0)
            flash = [attention_grads_flash_rounding(q, k, v, dout, scale, causal, window, 0.0,
                                                    p_rounded_in_ds=r) for r in (False, True)]
            for g in range(3):
                pt = max_err(yard[g], ref[g])
                ratios = [max_err(f[g], ref[g]) / pt for f in flash]
                worst = [max(w, r) for w, r in zip(worst, ratios, strict=True)]
                print(f"{(b, sq, sk, hq, hk, causal, window)} | {i} | d{'qkv'[g]} | {pt:.4f} | "
                      f"{ratios[0]:.2f} | {ratios[1]:.2f}", flush=True)
    print(f"worst ratio: fp32 P {worst[0]:.2f}, rounded P {worst[1]:.2f} "
          "(the tests allow 2 + 1e-3 / yardstick)")


if __name__ == "__main__":
    main()
