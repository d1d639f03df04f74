"""Sustained-load rates and SM clocks: the bf16 matmul against the forward at the matmul-ratio point.

    source .device/setup.sh && PYTHONPATH=$PWD python3 scripts/clock_study.py [--seconds 1.5] [--rounds 3]
        [--hdim 128] [--seqlen 16384] [--causal] [--bwd] [--no-matmul] [--no-peers]
        [--fh-config default --fh-config persistent=False ...]

Issue 4 asks for hdim 128, non-causal, 16k at >= 0.9 of the bf16 8192^3 matmul rate of the same run;
the grid measures the matmul once, first, for ~0.1 s. This times each workload as a back-to-back
stream of calls for `--seconds` (CUDA events around the whole stream), workloads taking turns over
rounds, and reads the SM clock and board power while each stream runs (NVML or nvidia-smi; read only,
nothing is set). It answers whether the two run at the same clock under sustained load.

With --fh-config (FwdConfig, or with --bwd BwdConfig, field overrides; repeatable) it compares
flashhopper variants the same way: the rate per MHz of SM clock is the figure that survives the
machine's power-capped clock swings (5-10% between runs of the same kernel), as long as the
variants draw similar power.
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
from flashhopper.config import parse_overrides  # noqa: E402
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


def workloads(args):
    """name -> (callable, flops) for the matmul, each flashhopper variant and the peers."""
    work = {}
    if not args.no_matmul:
        n = 8192
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        work["matmul 8192^3"] = (lambda: torch.matmul(a, b), 2.0 * n**3)
    s, hdim, causal = args.seqlen, args.hdim, args.causal
    bs, h = 16384 // s, 2048 // hdim
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    q, k, v = (torch.randn(bs, s, h, hdim, device="cuda", dtype=dtype,
                           requires_grad=args.bwd) for _ in range(3))
    flops = attention_flops(bs, h, s, s, hdim, causal) * (2.5 if args.bwd else 1.0)
    scale = 1 / math.sqrt(hdim)
    if args.bwd:
        out, lse = runtime.forward(q.detach(), k.detach(), v.detach(), scale, causal, (-1, -1), 0.0)
        dout = torch.randn_like(out)

    def fh(fields):
        ctx = runtime.bwd_config_overrides if args.bwd else runtime.config_overrides
        if args.bwd:
            def call():
                with ctx(**fields):
                    runtime.backward(q.detach(), k.detach(), v.detach(), out, dout, lse, scale, causal,
                                     (-1, -1), 0.0)
        else:
            def call():
                with ctx(**fields):
                    runtime.forward(q.detach(), k.detach(), v.detach(), scale, causal, (-1, -1), 0.0)
        return call
    for text in args.fh_config or ["default"]:
        work["fh " + text if args.fh_config else "flashhopper"] = (fh(parse_overrides(text)), flops)
    if not args.no_peers:
        try:
            from flash_attn.cute import flash_attn_func as fa4
            if args.bwd:
                o4 = fa4(q, k, v, causal=causal)
                o4 = o4[0] if isinstance(o4, tuple) else o4
                g = torch.randn_like(o4)
                work["fa4"] = (lambda: torch.autograd.grad(o4, (q, k, v), g, retain_graph=True), flops)
            else:
                work["fa4"] = (lambda: fa4(q.detach(), k.detach(), v.detach(), causal=causal), flops)
        except Exception as exc:
            print(f"fa4 not importable: {exc}")
    return work


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--bwd", action="store_true", help="time the backward alone (FLOPs 2.5x forward)")
    ap.add_argument("--no-matmul", action="store_true")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="attention inputs (the matmul "
                    "stays bf16)")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--fh-config", action="append", help="config overrides, e.g. persistent=False")
    args = ap.parse_args()
    read = sampler()
    work = workloads(args)
    for fn, _ in work.values():
        fn()
    rows = {name: [] for name in work}
    for r in range(args.rounds):
        for name, (fn, flops) in work.items():
            ms, mhz, watts = stream(fn, args.seconds, read)
            rows[name].append((flops / ms / 1e9, mhz, watts))
            print(f"round {r} {name:30s} {flops / ms / 1e9:6.1f} TFLOP/s  SM {mhz:6.0f} MHz  {watts:5.0f} W",
                  flush=True)
    what = "backward" if args.bwd else "forward"
    mask = "causal" if args.causal else "non-causal"
    print(f"\n{what} {args.dtype} hdim {args.hdim} {mask} {args.seqlen}, sustained {args.seconds} s streams, "
          f"medians of {args.rounds} rounds:")
    first = next(iter(rows))
    base = statistics.median(x[0] for x in rows[first])
    for name, xs in rows.items():
        tf = statistics.median(x[0] for x in xs)
        mhz = statistics.median(x[1] for x in xs)
        w = statistics.median(x[2] for x in xs)
        per = statistics.median(x[0] / x[1] * 1000 for x in xs)
        print(f"{name:30s} {tf:6.1f} TFLOP/s  {tf / base:5.3f} of {first[:12]:12s} SM {mhz:5.0f} MHz  "
              f"{w:4.0f} W  {per:6.1f} GFLOP/s per MHz")


if __name__ == "__main__":
    main()
