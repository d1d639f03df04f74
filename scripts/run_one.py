"""Run one forward (or --bwd backward) configuration a few times, for ncu / nsys / compute-sanitizer.

    python3 scripts/run_one.py --hdim 128 --seqlen 8192 --set pingpong=false
    python3 scripts/run_one.py --bwd --hdim 192 --seqlen 8192 --set dq_tma=true
    python3 scripts/run_one.py --hdim 128 --seqlen 16384 --fa4        # FA4's SM90 kernel instead
    python3 scripts/run_one.py --dtype fp8 --hdim 128 --seqlen 8192   # e4m3 in, no descales

16k tokens (batch = 16384 / seqlen), hidden 2048 (heads = 2048 / hdim), bf16, as the benchmark grid.
With --bwd the forward runs once outside the iterations; each iteration is one backward.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from flashhopper.config import parse_overrides  # noqa: E402
from flashhopper.hopper import runtime  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bwd", action="store_true", help="the backward (default: the forward)")
    parser.add_argument("--hdim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16", help="fp8: e4m3 q, k, v, forward")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--fa4", action="store_true", help="run flash_attn.cute (FA4) instead of flashhopper")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a FwdConfig (BwdConfig with --bwd) field, e.g. pingpong=false (repeatable)")
    args = parser.parse_args()
    if args.dtype == "fp8" and (args.bwd or args.fa4):
        parser.error("--dtype fp8 is flashhopper's forward only")
    os.environ.setdefault("FLASHHOPPER_EXPERIMENTAL_FP8", "1")
    overrides = parse_overrides(",".join(args.set))
    b, h = max(16384 // args.seqlen, 1), max(2048 // args.hdim, 1)
    q, k, v = (torch.randn(b, args.seqlen, h, args.hdim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=args.bwd) for _ in range(3))
    if args.dtype == "fp8":
        q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    if args.fa4:
        from flash_attn.cute import flash_attn_func as attention
    else:
        from flashhopper import flash_attn_func as attention
    if args.bwd:
        dout = torch.randn_like(q)
        out = attention(q, k, v, causal=args.causal)
        out = out[0] if isinstance(out, tuple) else out
        with runtime.bwd_config_overrides(**overrides):
            for _ in range(args.iters):
                torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    else:
        with runtime.config_overrides(**overrides):
            for _ in range(args.iters):
                if args.fa4:
                    attention(q, k, v, causal=args.causal)
                else:
                    attention(q, k, v, softmax_scale=1 / math.sqrt(args.hdim), causal=args.causal)
    torch.cuda.synchronize()
    who, what = "FA4" if args.fa4 else "flashhopper", "backward" if args.bwd else "forward"
    print(f"ran {who} {what} hdim {args.hdim} seqlen {args.seqlen} causal {args.causal} {overrides} "
          f"x{args.iters} (b {b}, h {h})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
