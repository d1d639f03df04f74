"""sha256 of the SASS of every dispatched kernel (flashhopper.plan.dispatched_kernels), compiled for
sm_90a without a GPU, through the kernel cache: to show that a change left the kernels alone (or
which it touched), run it before and after and compare.

    python3 scripts/cubin_hashes.py > before.txt                 # at the old commit
    python3 scripts/cubin_hashes.py --compare before.txt         # at the new one: the lines that differ
    python3 scripts/cubin_hashes.py --hdim 128 --dtype bf16 --jobs 2

Each line: the kernel's config (its repr), the first 16 hex digits of flashhopper.compile.sass_digest
and the instruction count. --jobs compiles the missing kernels first with `flashhopper precompile`'s
workers.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from flashhopper.compile import inspect_cubin  # noqa: E402
from flashhopper.config import DTYPES, FP8_DTYPES, SUPPORTED_HDIMS  # noqa: E402
from flashhopper.plan import dispatched_kernels  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", nargs="+", choices=DTYPES + FP8_DTYPES, default=list(DTYPES))
    ap.add_argument("--hdim", nargs="+", type=int, default=list(SUPPORTED_HDIMS))
    ap.add_argument("--fwd", action="store_true", help="forward kernels only")
    ap.add_argument("--bwd", action="store_true", help="backward kernels only")
    ap.add_argument("--jobs", type=int, help="compile the missing kernels first, N at a time")
    ap.add_argument("--compare", metavar="FILE", help="an earlier output: print only the lines that differ")
    args = ap.parse_args()
    configs = dispatched_kernels(args.dtype, args.hdim, forward=not args.bwd, backward=not args.fwd)
    if args.jobs:
        from flashhopper.precompile import precompile

        precompile(configs, jobs=args.jobs, log=lambda msg: print(msg, file=sys.stderr))
    from flashhopper.hopper.runtime import kernel_cubin

    old = {}
    if args.compare:
        with open(args.compare) as f:
            old = {line.rsplit(" ", 2)[0]: line.strip() for line in f if line.strip()}
    changed = 0
    for cfg in configs:
        r = inspect_cubin(kernel_cubin(cfg))
        line = f"{cfg!r} {r['sass_sha256'][:16]} {r['instructions']}"
        if args.compare:
            if old.get(repr(cfg)) != line:
                changed += 1
                print(f"was {old.get(repr(cfg), '(absent)')}\nnow {line}", flush=True)
        else:
            print(line, flush=True)
    if args.compare:
        print(f"{changed} of {len(configs)} kernel(s) differ")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
