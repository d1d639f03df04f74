"""Small forward runs for compute-sanitizer (memcheck / racecheck / synccheck).

    compute-sanitizer --tool racecheck --report-api-errors no python3 scripts/sanitize_fwd.py
"""
import math
import sys

import torch

sys.path.insert(0, ".")
from flashhopper.hopper import forward, runtime  # noqa: E402

torch.manual_seed(0)
runtime.persistent_ctas_cap = 2
for persistent, causal, (sq, sk) in [(p, c, s) for p in (False, True) for c in (False, True)
                                     for s in ((131, 131), (77, 301))]:
    with runtime.config_overrides(persistent=persistent):
        # 3 query tiles x 2 heads: a persistent grid is capped below at 2 CTAs so CTAs loop
        q = torch.randn(1, sq, 2, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, sk, 1, 64, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, sk, 1, 64, device="cuda", dtype=torch.bfloat16)
        out, lse = forward(q, k, v, 1 / math.sqrt(64), causal, (-1, -1), 0.0)
        torch.cuda.synchronize()
        print(f"persistent={persistent} causal={causal} sq={sq} sk={sk}: ok, "
              f"finite={bool(out.isfinite().all())}", flush=True)
