"""Sustained-load rates and SM clocks: the bf16 matmul against the forward at the matmul-ratio point.

    source .device/setup.sh && PYTHONPATH=$PWD python3 scripts/clock_study.py [--seconds 1.5] [--rounds 3]

Issue 4 asks for hdim 128, non-causal, 16k at >= 0.9 of the bf16 8192^3 matmul rate of the same run;
the grid measures the matmul once, first, for ~0.1 s. This times each workload as a back-to-back
stream of calls for `--seconds` (CUDA events around the whole stream), workloads taking turns over
rounds, and reads the SM clock and board power while each stream runs (NVML or nvidia-smi; read only,
nothing is set). It answers whether the two run at the same clock under sustained load.
"""
from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, ".")
from flashhopper.bench.grid import attention_flops  # noqa: E402
from flashhopper.hopper import runtime  # noqa: E402


def sampler():
    """A function returning (sm clock MHz, power W) of this process's GPU, read only."""
    try:
        import pynvml

        pynvml.nvmlInit()
        idx = torch.cuda.current_device()
        visible = __import__("os").environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            idx = int(visible.split(",")[idx])
        h = pynvml.nvmlDeviceGetHandleByIndex(idx)
        return lambda: (pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                        pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0)
    except Exception:
        visible = __import__("os").environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]

        def smi():
            out = subprocess.run(["nvidia-smi", "-i", visible, "--query-gpu=clocks.sm,power.draw",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
            mhz, watts = out.strip().split(",")
            return float(mhz), float(watts)
        return smi


def stream(fn, seconds, read):
    """ms per call over a back-to-back stream of ~`seconds`, and clock / power samples."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-5)
    n = max(10, int(seconds / one))
    samples, done = [], threading.Event()

    def poll():
        time.sleep(min(0.3, seconds / 3))
        while not done.is_set():
            samples.append(read())
            time.sleep(0.1)
    th = threading.Thread(target=poll)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    th.start()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    done.set()
    th.join()
    ms = start.elapsed_time(end) / n
    clocks = [s[0] for s in samples] or [float("nan")]
    watts = [s[1] for s in samples] or [float("nan")]
    return ms, statistics.median(clocks), statistics.median(watts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seqlen", type=int, default=16384)
    args = ap.parse_args()
    read = sampler()
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    s, hdim = args.seqlen, 128
    bs, h = 16384 // s, 2048 // hdim
    q, k, v = (torch.randn(bs, s, h, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    attn = attention_flops(bs, h, s, s, hdim, False)
    scale = 1 / math.sqrt(hdim)
    work = {"matmul 8192^3": (lambda: torch.matmul(a, b), 2.0 * n**3),
            "flashhopper": (lambda: runtime.forward(q, k, v, scale, False, (-1, -1), 0.0), attn)}
    try:
        from flash_attn.cute import flash_attn_func as fa4
        work["fa4"] = (lambda: fa4(q, k, v, causal=False), attn)
    except Exception as exc:
        print(f"fa4 not importable: {exc}")
    for fn, _ in work.values():
        fn()
    rows = {name: [] for name in work}
    for r in range(args.rounds):
        for name, (fn, flops) in work.items():
            ms, mhz, watts = stream(fn, args.seconds, read)
            rows[name].append((flops / ms / 1e9, mhz, watts))
            print(f"round {r} {name:14s} {flops / ms / 1e9:6.1f} TFLOP/s  SM {mhz:6.0f} MHz  {watts:5.0f} W",
                  flush=True)
    print(f"\nhdim 128 non-causal {s}, sustained {args.seconds} s streams, medians of {args.rounds} rounds:")
    base = statistics.median(x[0] for x in rows["matmul 8192^3"])
    for name, xs in rows.items():
        tf = statistics.median(x[0] for x in xs)
        mhz = statistics.median(x[1] for x in xs)
        w = statistics.median(x[2] for x in xs)
        print(f"{name:14s} {tf:6.1f} TFLOP/s  {tf / base:5.3f} of matmul  SM {mhz:5.0f} MHz  {w:4.0f} W  "
              f"{tf / mhz * 1000:6.1f} GFLOP/s per MHz")


if __name__ == "__main__":
    main()
