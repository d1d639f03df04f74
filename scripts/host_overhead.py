"""First-call compile time and per-call host overhead of flash_attn_func on a tiny problem; with
--bwd, the backward's host time per call (runtime.backward at hdim 64 / 128 / 256, tiny and
grid-sized, and the whole autograd step on the tiny problem) and a cProfile of its Python side.

    source .device/setup.sh && PYTHONPATH=$PWD python3 scripts/host_overhead.py [--bwd]

Session 26 measured 108-186 us of host time per backward call at the grid's 512-token points
(scripts/overlap_trace.py in aef4924), against 32 us for the forward: --bwd says where it goes.
"""
import cProfile
import io
import math
import pstats
import sys
import time

import torch

sys.path.insert(0, ".")
from flashhopper import flash_attn_func  # noqa: E402
from flashhopper.hopper import runtime  # noqa: E402


def host_us(fn, n=500) -> float:
    """Host time per call with the launch queue far from full (no sync inside the loop)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


def forward_overhead():
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


def backward_overhead():
    shapes = [(1, 128, 1), (8, 512, 8)]  # tiny; a 512-token grid point's shape at a smaller batch
    for d in (64, 128, 256):
        for causal in (False, True):
            for b, s, h in shapes:
                q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                scale = 1 / math.sqrt(d)
                out, lse = runtime.forward(q, k, v, scale, causal, (-1, -1), 0.0)

                def call(q=q, k=k, v=v, out=out, do=do, lse=lse, scale=scale, causal=causal):
                    return runtime.backward(q, k, v, out, do, lse, scale, causal, (-1, -1), 0.0)

                n = 100 if s > 128 else 500
                print(f"backward host time, hdim {d} causal {causal!s:>5} (b, s, h) = {(b, s, h)}: "
                      f"{host_us(call, n):7.1f} us a call", flush=True)
    # the whole training step's backward on the tiny problem: autograd, the interface, the kernels
    q, k, v = (torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)

    def step():
        out = flash_attn_func(q, k, v)
        return torch.autograd.grad(out, (q, k, v), do)

    fwd_only = host_us(lambda: flash_attn_func(q, k, v))
    print(f"autograd forward + backward, tiny: {host_us(step):.1f} us a step "
          f"(forward with grad alone {fwd_only:.1f} us)", flush=True)
    # where the Python side of runtime.backward spends it (hdim 256, tiny problem)
    q, k, v, do = (torch.randn(1, 128, 1, 256, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = runtime.forward(q, k, v, 1 / 16, False, (-1, -1), 0.0)
    host_us(lambda: runtime.backward(q, k, v, out, do, lse, 1 / 16, False, (-1, -1), 0.0), 50)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        runtime.backward(q, k, v, out, do, lse, 1 / 16, False, (-1, -1), 0.0)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
    print(text.getvalue())


if __name__ == "__main__":
    forward_overhead()
    if "--bwd" in sys.argv:
        backward_overhead()
