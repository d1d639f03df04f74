"""Time config variants of the forward (or --bwd backward) against each other on a GPU: each
--variant is a comma-separated list of FwdConfig / BwdConfig fields ("default" = the dispatch),
timed on every point with the variants taking turns for --rounds rounds; medians in TFLOP/s and
each variant's ratio to the first.

    python3 scripts/config_sweep.py --hdim 128 --seqlen 2048 8192 --variant default --variant pingpong=false
    python3 scripts/config_sweep.py --bwd --hdim 256 --causal yes --variant default --variant lpt=true

Points follow the benchmark grid (16k tokens, hidden 2048, bf16: flashhopper.bench.grid).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from flashhopper.bench.grid import make_point  # noqa: E402
from flashhopper.bench.runner import time_ms  # noqa: E402
from flashhopper.config import parse_overrides  # noqa: E402
from flashhopper.hopper import runtime  # noqa: E402


def step(attention, q, k, v, causal: bool, backward: bool):
    """What one timed call runs: the forward, or the backward of one forward made here."""
    if not backward:
        return lambda: attention(q, k, v, causal=causal)
    out, dout = attention(q, k, v, causal=causal), torch.randn_like(q)
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bwd", action="store_true")
    parser.add_argument("--hdim", type=int, nargs="+", default=[128])
    parser.add_argument("--seqlen", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--variant", action="append", required=True, metavar="FIELDS")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    variants = [(text, parse_overrides(text)) for text in args.variant]
    overrides = runtime.bwd_config_overrides if args.bwd else runtime.config_overrides
    from flashhopper import flash_attn_func

    causal_modes = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    print(f"{'hdim':>4} {'causal':>6} {'seqlen':>6}  " + "  ".join(f"{t[:24]:>24}" for t, _ in variants))
    for hdim in args.hdim:
        for causal in causal_modes:
            for seqlen in args.seqlen:
                p = make_point(seqlen, hdim, causal)
                flops = p.bwd_flops if args.bwd else p.flops
                times = {text: [] for text, _ in variants}
                for _ in range(args.rounds):
                    for text, fields in variants:  # fresh inputs each turn
                        shape, grad = (p.batch, seqlen, p.heads, hdim), args.bwd
                        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
                                   for _ in range(3))
                        with overrides(**fields):
                            times[text].append(time_ms(step(flash_attn_func, q, k, v, causal, args.bwd)))
                tflops = {t: flops / statistics.median(ms) / 1e9 for t, ms in times.items()}
                base = tflops[variants[0][0]]
                cells = [f"{tflops[t]:7.1f} ({tflops[t] / base:5.3f}x)" for t, _ in variants]
                row = "  ".join(f"{c:>24}" for c in cells)
                print(f"{hdim:>4} {'yes' if causal else 'no':>6} {seqlen:>6}  {row}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
