"""Where the backward's time goes: GPU time per kernel (preprocess, dQaccum memset, main kernel,
dQ cast) of one `runtime.backward` call, from torch.profiler, at grid points; next to it the
per-call time the benchmark sees (`time_ms`, i.e. triton's do_bench, L2 flushed before each call)
and back-to-back CUDA-event time over 10 calls. In session 5 the kernel sum at hdim 64 / 128 was
8-10% below the benchmark's time (not at hdim 256): idle GPU between the kernels would show here
as bench/events > kernels.

    source .device/setup.sh && PYTHONPATH=$PWD python3 scripts/bwd_parts.py [hdims] [seqlens]
"""

from __future__ import annotations

import collections
import functools
import math
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, ".")
from flashhopper.bench.grid import make_point  # noqa: E402
from flashhopper.bench.runner import time_ms  # noqa: E402
from flashhopper.hopper import runtime  # noqa: E402

REPS = 10


def kind(name: str) -> str:
    if "Preprocess" in name or "bwd_pre" in name.lower():
        return "pre"
    if "Bwd" in name or "Backward" in name:
        return "main"
    if "fill" in name.lower() or "zero" in name.lower() or "memset" in name.lower():
        return "memset"
    if "copy" in name.lower() or "elementwise" in name.lower() or "cast" in name.lower():
        return "cast"
    return name[:40]


def point(d, causal, s):
    p = make_point(s, d, causal)
    q, k, v, do = (torch.randn(p.batch, s, p.heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = 1 / math.sqrt(d)
    out, lse = runtime.forward(q, k, v, scale, causal, (-1, -1), 0.0)
    for _ in range(3):
        runtime.backward(q, k, v, out, do, lse, scale, causal, (-1, -1), 0.0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPS):
            runtime.backward(q, k, v, out, do, lse, scale, causal, (-1, -1), 0.0)
        torch.cuda.synchronize()
    us = collections.Counter()
    for e in prof.key_averages():
        if e.device_type.name == "CUDA":
            us[kind(e.key)] += e.device_time_total / REPS
    total = sum(us.values())
    call = functools.partial(runtime.backward, q, k, v, out, do, lse, scale, causal, (-1, -1), 0.0)
    bench_us = time_ms(call) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPS):
        call()
    end.record()
    torch.cuda.synchronize()
    events_us = start.elapsed_time(end) * 1e3 / REPS
    parts = " ".join(f"{k} {v:7.1f} ({v / total:4.0%})" for k, v in sorted(us.items(), key=lambda kv: -kv[1]))
    print(f"{d:>4} {'yes' if causal else 'no':>6} {s:>6} kernels {total:8.1f} us, bench {bench_us:8.1f}, "
          f"events {events_us:8.1f}: {parts}", flush=True)


def main():
    hdims = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [64, 128]
    seqlens = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [512, 8192]
    print("GPU microseconds per backward call, by kernel")
    for d in hdims:
        for causal in (False, True):
            for s in seqlens:
                point(d, causal, s)


if __name__ == "__main__":
    main()
