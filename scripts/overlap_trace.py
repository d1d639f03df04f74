"""Timeline of one overlapped backward call (BwdConfig.overlap_chunks): each kernel's start and end
in microseconds from the call's first kernel, its stream, from torch.profiler's trace; then the
capped preprocess and cast alone (ctas 16 / 32 / 132) against the full-grid ones, to see what a
capped grid moves per microsecond.

    source .device/setup.sh && PYTHONPATH=$PWD python3 scripts/overlap_trace.py 256:1:512 128:0:512
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, ".")
from flashhopper.bench.grid import make_point  # noqa: E402
from flashhopper.hopper import runtime  # noqa: E402


def timeline(d, causal, s, fields):
    p = make_point(s, d, causal)
    q, k, v, do = (torch.randn(p.batch, s, p.heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = 1 / math.sqrt(d)
    out, lse = runtime.forward(q, k, v, scale, causal, (-1, -1), 0.0)
    with runtime.bwd_config_overrides(**fields):
        for _ in range(3):
            runtime.backward(q, k, v, out, do, lse, scale, causal, (-1, -1), 0.0)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runtime.backward(q, k, v, out, do, lse, scale, causal, (-1, -1), 0.0)
            torch.cuda.synchronize()
        # host time per call: launches are asynchronous, so with the queue far from full this is the
        # Python and launch cost alone
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            runtime.backward(q, k, v, out, do, lse, scale, causal, (-1, -1), 0.0)
        host_us = (time.perf_counter() - t0) * 1e5
        torch.cuda.synchronize()
    print(f"-- host {host_us:.1f} us a call", flush=True)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = [e for e in json.load(open(f.name))["traceEvents"] if e.get("cat") == "kernel"]
    t0 = min(e["ts"] for e in events)
    print(f"-- hdim {d} causal {causal} seqlen {s} {fields or 'default'}: "
          f"{max(e['ts'] + e['dur'] for e in events) - t0:.1f} us", flush=True)
    for e in sorted(events, key=lambda e: e["ts"]):
        name = e["name"]
        short = ("pre_capped" if "Capped" in name else "pre" if "Preprocess" in name
                 else "cast" if "DqCast" in name else "main" if "Bwd" in name else name[:30])
        grid = e.get("args", {}).get("grid")
        start = e["ts"] - t0
        print(f"   stream {e.get('tid')!s:>6} {short:>10} start {start:8.1f} end {start + e['dur']:8.1f}"
              f" dur {e['dur']:7.1f} grid {grid}", flush=True)


def alone(d, s):
    """The capped kernels by themselves on the whole point's tensors (every SM free)."""
    p = make_point(s, d, False)
    b, h = p.batch, p.heads
    o, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lse = torch.randn(b, h, s, device="cuda")
    rows = -(-s // 64) * 64
    lse2, dr = (torch.empty(b, h, rows, device="cuda") for _ in range(2))
    acc = torch.randn(b, s, h, d, device="cuda")
    dq = torch.empty(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    pre_c = runtime.compile_bwd_pre_capped("bf16", d)
    pre = runtime.compile_bwd_pre("bf16", d, zero_dq=True)
    cast = runtime.compile_dq_cast("bf16", d)
    calls = {"pre full": lambda: pre(o, do, lse, lse2, dr, acc, 1.0), "cast torch": lambda: dq.copy_(acc)}
    for n in (16, 32, 66, 132, 264):
        calls[f"pre ctas {n}"] = lambda n=n: pre_c(o, do, lse, lse2, dr, acc, 1.0, n)
        calls[f"cast ctas {n}"] = lambda n=n: cast(acc, dq, n)
    mb_pre = (2 * o.numel() * 2 + acc.numel() * 4) / 1e6
    mb_cast = (acc.numel() * 4 + dq.numel() * 2) / 1e6
    for name, fn in calls.items():
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn()
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 100
        mb = mb_pre if name.startswith("pre") else mb_cast
        print(f"   alone hdim {d} seqlen {s} {name:>14}: {us:7.1f} us, {mb / us:5.2f} TB/s", flush=True)


def main():
    for spec in [a for a in sys.argv[1:] if ":" in a] or ["256:1:512", "128:0:512"]:
        d, causal, s = (int(x) for x in spec.split(":"))
        for fields in ({}, {"overlap_chunks": 2}, {"overlap_chunks": 4}):
            timeline(d, bool(causal), s, fields)
        if "--alone" in sys.argv:
            alone(d, s)


if __name__ == "__main__":
    main()
