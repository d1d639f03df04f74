"""Small forward runs for compute-sanitizer (memcheck / racecheck / synccheck).

    compute-sanitizer --tool racecheck --report-api-errors no python3 scripts/sanitize_fwd.py
"""
import math
import sys

import torch

sys.path.insert(0, ".")
from flashhopper.hopper import forward  # noqa: E402

torch.manual_seed(0)
for causal in (False, True):
    for (sq, sk) in ((131, 131), (77, 301)):
        q = torch.randn(1, sq, 2, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, sk, 1, 64, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, sk, 1, 64, device="cuda", dtype=torch.bfloat16)
        out, lse = forward(q, k, v, 1 / math.sqrt(64), causal, (-1, -1), 0.0)
        torch.cuda.synchronize()
        print(f"causal={causal} sq={sq} sk={sk}: ok, finite={bool(out.isfinite().all())}", flush=True)
