"""What a new process pays before its first attention step: `import flashhopper` + the first forward
+ the first backward, against a process that runs only `import torch; torch.cuda.init()` and the
same torch ops (allocations, an autograd step, a sync). Each is a whole new Python process, timed
from the outside; medians of --runs. With --cold, first once on an empty kernel cache.

    python3 scripts/startup_time.py --hdim 128 --runs 5 --cold
    python3 scripts/startup_time.py --ranks 8     # 8 processes started together on an empty cache

With --ranks N: N processes (one GPU) start together on an empty cache, each running a forward and
a backward at hdim 64 and 128, causal and not; the kernels compiled, summed over the processes,
should equal the number of distinct kernels (each compiled once).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import sys, time
t0 = time.perf_counter()
import torch
torch.cuda.init()
mode, hdim, causal = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
if mode == "flashhopper":
    from flashhopper import flash_attn_func
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(2, 1024, 8, hdim, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
           for _ in range(3))
dout = torch.randn(2, 1024, 8, hdim, device="cuda", dtype=torch.bfloat16, generator=g)
out = flash_attn_func(q, k, v, causal=causal) if mode == "flashhopper" else q * 1 + k * 0 + v * 0
out.backward(dout)
torch.cuda.synchronize()
print(f"inside {time.perf_counter() - t0:.3f}")
if mode == "flashhopper":
    from flashhopper.hopper import kernel_cache
    print("kernels", dict(kernel_cache.stats))
"""


def run(mode: str, hdim: int, causal: bool, env: dict) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, str(hdim), "1" if causal else "0"], env=env,
                          capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{mode} process failed: {proc.stderr[-2000:]}")
    return wall, proc.stdout.strip().replace("\n", "; ")


RANK = r"""
import sys, torch
from flashhopper import flash_attn_func
from flashhopper.hopper import kernel_cache
for hdim in (64, 128):
    for causal in (False, True):
        q, k, v = (torch.randn(1, 1000, 4, hdim, device="cuda", dtype=torch.bfloat16).requires_grad_()
                   for _ in range(3))
        flash_attn_func(q, k, v, causal=causal).sum().backward()
torch.cuda.synchronize()
print(kernel_cache.stats["compiled"], kernel_cache.stats["disk"], len(kernel_cache._memory))
"""


def ranks(n: int, env: dict) -> int:
    with tempfile.TemporaryDirectory(prefix="flashhopper-ranks-") as cold:
        t0 = time.perf_counter()
        rank_env = {**env, "FLASHHOPPER_CACHE_DIR": cold}
        procs = [subprocess.Popen([sys.executable, "-c", RANK], env=rank_env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(n)]
        outs = [p.communicate() for p in procs]
        wall = time.perf_counter() - t0
        if any(p.returncode for p in procs):
            print("a process failed:", *(err[-2000:] for _, err in outs), sep="\n")
            return 1
        counts = [tuple(map(int, out.split())) for out, _ in outs]
        entries = sum(len(files) for _, _, files in os.walk(cold))
    compiled = sum(c for c, _, _ in counts)
    distinct = counts[0][2]
    print(f"{n} processes together on an empty cache, {wall:.1f} s: {distinct} distinct kernels each, "
          f"{compiled} compiles in all (each compiled once: {compiled == distinct}), "
          f"per process (compiled, loaded from disk): {[c[:2] for c in counts]}; {entries} files")
    return 0 if compiled == distinct else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hdim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cold", action="store_true", help="first one flashhopper process on an empty cache")
    parser.add_argument("--cache-dir", help="the warm cache to use (default: $FLASHHOPPER_CACHE_DIR or its "
                        "default); the cold run uses a new temporary folder")
    parser.add_argument("--ranks", type=int, help="instead: N processes together on an empty cache")
    args = parser.parse_args()
    env = dict(os.environ)
    if args.ranks:
        return ranks(args.ranks, env)
    if args.cache_dir:
        env["FLASHHOPPER_CACHE_DIR"] = args.cache_dir
    rows = []
    if args.cold:
        with tempfile.TemporaryDirectory(prefix="flashhopper-cold-") as cold:
            wall, said = run("flashhopper", args.hdim, args.causal, {**env, "FLASHHOPPER_CACHE_DIR": cold})
            rows.append(("flashhopper, cold cache", [wall], said))
    run("flashhopper", args.hdim, args.causal, env)  # makes sure the warm cache holds the kernels
    base, warm = [], []
    said = {}
    for _ in range(args.runs):  # taking turns, so that a drift of the machine hits both alike
        wall, said["torch"] = run("torch", args.hdim, args.causal, env)
        base.append(wall)
        wall, said["flashhopper"] = run("flashhopper", args.hdim, args.causal, env)
        warm.append(wall)
    rows += [("torch only", base, said["torch"]), ("flashhopper, warm cache", warm, said["flashhopper"])]
    print(f"hdim {args.hdim}, causal {args.causal}, bf16 (2, 1024, 8, {args.hdim}); process wall seconds, "
          f"median of {args.runs} (cold: 1)")
    for name, walls, last in rows:
        print(f"  {name:<24} {statistics.median(walls):6.2f} s  (min {min(walls):.2f}, "
              f"max {max(walls):.2f})  last: {last}")
    extra = statistics.median(warm) - statistics.median(base)
    print(f"flashhopper's warm start costs {extra:+.2f} s over torch alone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
