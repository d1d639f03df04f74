"""Run one backward configuration a few times (for ncu / nsys), e.g.

    python3 scripts/run_one_bwd.py --hdim 192 --seqlen 8192
    python3 scripts/run_one_bwd.py --hdim 192 --seqlen 8192 --set num_consumer_wg=2 --set dkv_by_keys=true
    python3 scripts/run_one_bwd.py --hdim 192 --seqlen 8192 --fa4   # FA4's SM90 backward instead

16k tokens, hidden 2048 (rounded down to whole heads), bf16, as the benchmark grid. The forward
runs once outside the iterations; each iteration is one backward (our preprocess, main kernel and
dQ cast, or FA4's three kernels): profile the main kernel with `ncu -k regex:...` and --launch-skip.
"""
import argparse
import math
import sys

import torch

sys.path.insert(0, ".")
from flashhopper.config import parse_overrides  # noqa: E402
from flashhopper.hopper import runtime  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--hdim", type=int, default=192)
parser.add_argument("--seqlen", type=int, default=8192)
parser.add_argument("--causal", action="store_true")
parser.add_argument("--iters", type=int, default=3)
parser.add_argument("--fa4", action="store_true", help="run flash_attn.cute (FA4) instead of flashhopper")
parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="BwdConfig override, e.g. dq_tma=true (repeatable)")
args = parser.parse_args()
overrides = parse_overrides(",".join(args.set))

b, h = max(16384 // args.seqlen, 1), max(2048 // args.hdim, 1)
q, k, v = (torch.randn(b, args.seqlen, h, args.hdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
dout = torch.randn(b, args.seqlen, h, args.hdim, device="cuda", dtype=torch.bfloat16)
if args.fa4:
    from flash_attn.cute import flash_attn_func as fa4

    out = fa4(q, k, v, causal=args.causal)
    out = out[0] if isinstance(out, tuple) else out
    for _ in range(args.iters):
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
else:
    from flashhopper import flash_attn_func

    out = flash_attn_func(q, k, v, causal=args.causal)
    with runtime.bwd_config_overrides(**overrides):
        for _ in range(args.iters):
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
torch.cuda.synchronize()
who = "FA4" if args.fa4 else "flashhopper"
print(f"ran {who} backward hdim {args.hdim} seqlen {args.seqlen} causal {args.causal} {overrides} "
      f"x{args.iters} (b {b}, h {h}, scale {1 / math.sqrt(args.hdim):.4f})")
