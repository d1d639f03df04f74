"""Run one forward configuration a few times (for ncu / nsys), e.g.

    python3 scripts/run_one_fwd.py --hdim 128 --seqlen 8192 --set pingpong=false
    python3 scripts/run_one_fwd.py --hdim 128 --seqlen 16384 --fa4   # FA4's SM90 kernel instead
"""
import argparse
import math
import sys

import torch

sys.path.insert(0, ".")
from flashhopper.config import parse_overrides  # noqa: E402
from flashhopper.hopper import runtime  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--hdim", type=int, default=128)
parser.add_argument("--seqlen", type=int, default=8192)
parser.add_argument("--causal", action="store_true")
parser.add_argument("--iters", type=int, default=3)
parser.add_argument("--fa4", action="store_true", help="run flash_attn.cute (FA4) instead of flashhopper")
parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="FwdConfig override, e.g. pingpong=false or row_max_chains=4 (repeatable)")
args = parser.parse_args()
overrides = parse_overrides(",".join(args.set))

b, h = 16384 // args.seqlen, 2048 // args.hdim
q, k, v = (torch.randn(b, args.seqlen, h, args.hdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
if args.fa4:
    from flash_attn.cute import flash_attn_func as fa4

    for _ in range(args.iters):
        fa4(q, k, v, causal=args.causal)
else:
    with runtime.config_overrides(**overrides):
        for _ in range(args.iters):
            runtime.forward(q, k, v, 1 / math.sqrt(args.hdim), args.causal, (-1, -1), 0.0)
torch.cuda.synchronize()
who = "FA4" if args.fa4 else "flashhopper"
print(f"ran {who} hdim {args.hdim} seqlen {args.seqlen} causal {args.causal} {overrides} x{args.iters}")
