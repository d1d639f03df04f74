"""First-call compile time and per-call host overhead of flash_attn_func on a tiny problem."""
import sys
import time

import torch

sys.path.insert(0, ".")
from flashhopper import flash_attn_func  # noqa: E402
from flashhopper.hopper import runtime  # noqa: E402

q, k, v = (torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
t0 = time.perf_counter()
flash_attn_func(q, k, v)
torch.cuda.synchronize()
first = time.perf_counter() - t0
for _ in range(50):
    flash_attn_func(q, k, v)
torch.cuda.synchronize()
n = 2000
t0 = time.perf_counter()
for _ in range(n):
    flash_attn_func(q, k, v)
host = (time.perf_counter() - t0) / n
torch.cuda.synchronize()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(n):
    flash_attn_func(q, k, v)
end.record()
torch.cuda.synchronize()
per_call = start.elapsed_time(end) / n * 1e3
print(f"first call (trace + compile + launch): {first:.2f} s; compile alone: "
      f"{list(runtime.compile_seconds.values())[0]:.2f} s")
print(f"per-call host time (no sync, tiny problem): {host * 1e6:.1f} us; "
      f"back-to-back period {per_call:.1f} us")
