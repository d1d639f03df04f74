"""Speed cost of deterministic=True in the backward (same inputs, same process, medians).

    source .device/setup.sh && PYTHONPATH=$PWD python3 scripts/bwd_det_cost.py [192,256]
"""

from __future__ import annotations

import functools
import math
import sys

import torch

sys.path.insert(0, ".")
from flashhopper.bench.grid import attention_flops, make_point  # noqa: E402
from flashhopper.bench.runner import time_ms  # noqa: E402
from flashhopper.hopper import runtime  # noqa: E402


def point(d, causal, s):
    p = make_point(s, d, causal)
    q, k, v, do = (torch.randn(p.batch, s, p.heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = 1 / math.sqrt(d)
    out, lse = runtime.forward(q, k, v, scale, causal, (-1, -1), 0.0)
    flops = attention_flops(p.batch, p.heads, s, s, d, causal, backward=True)
    run = functools.partial(runtime.backward, q, k, v, out, do, lse, scale, causal, (-1, -1), 0.0)
    tf = [flops / time_ms(functools.partial(run, deterministic=det)) / 1e9 for det in (False, True)]
    print(f"{d:>4} {'yes' if causal else 'no':>6} {s:>6} {tf[0]:9.1f} {tf[1]:9.1f} {tf[1] / tf[0] - 1:+6.1%}",
          flush=True)


def main():
    print("backward TFLOP/s, default vs deterministic=True")
    print(f"{'hdim':>4} {'causal':>6} {'seqlen':>6} {'default':>9} {'determ.':>9} {'cost':>6}")
    hdims = tuple(int(x) for x in sys.argv[1].split(",")) if len(sys.argv) > 1 else (64, 96, 128, 192, 256)
    for d in hdims:
        for causal in (False, True):
            for s in (1024, 8192):
                point(d, causal, s)


if __name__ == "__main__":
    main()
