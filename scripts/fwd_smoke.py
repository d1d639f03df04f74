"""Quick forward smoke run on a Hopper GPU: a few shapes against the float64 reference."""
import math
import sys
import time

import torch

sys.path.insert(0, ".")
from flashhopper.hopper import forward, kernel_cache  # noqa: E402
from flashhopper.reference import attention_ref  # noqa: E402

for (b, sq, sk, h, hk, d, causal) in [(1, 128, 128, 1, 1, 128, False), (1, 200, 300, 2, 1, 64, False),
                                       (2, 1000, 1000, 4, 4, 128, True), (1, 17, 4097, 2, 2, 256, False)]:
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
    t0 = time.time()
    out, lse = forward(q, k, v, 1 / math.sqrt(d), causal, (-1, -1), 0.0)
    torch.cuda.synchronize()
    t1 = time.time()
    ref, lse_ref = attention_ref(q, k, v, 1 / math.sqrt(d), causal)
    err = (out.double() - ref).abs().max().item()
    print(f"b{b} sq{sq} sk{sk} h{h}/{hk} d{d} causal={causal}: max err {err:.2e} "
          f"lse err {(lse-lse_ref).abs().max().item():.2e} first call {t1-t0:.2f}s", flush=True)
print("compile seconds:",
      {f"{c.hdim}/{c.causal}": round(s, 2) for c, s in kernel_cache.compile_seconds.items()})
