"""sha256 of the SASS of each head dim's kernels, compiled for sm_90a without a GPU: to show that a
change left them alone (or which it touched), run it before and after and compare. The list holds
each hdim's base configuration per mask (fwd_config / bwd_config) and the backward's lpt launch;
the forward's per-call variants for short sequences are not in it (add them with --set).

    python3 scripts/cubin_hashes.py > before.txt          # at the old commit
    python3 scripts/cubin_hashes.py --compare before.txt  # at the new one: the lines that differ
    python3 scripts/cubin_hashes.py --bwd --set lpt=True          # a config field on every kernel

Each line: kernel, its configuration, the first 16 hex digits of flashhopper.compile.sass_digest,
and the instruction count.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from flashhopper.compile import inspect_kernel  # noqa: E402
from flashhopper.config import parse_overrides  # noqa: E402

FWD = [("bf16", d, m) for d in (64, 96, 128, 192, 256) for m in ({}, {"causal": True})] + [
    ("bf16", 128, {"local": True}), ("bf16", 128, {"softcap": True}), ("fp16", 128, {}), ("fp16", 256, {})]
BWD = [("bf16", d, m) for d in (64, 96, 128, 192, 256) for m in ({}, {"causal": True})] + [
    ("bf16", d, m) for d in (128, 192, 256)
    for m in ({"local": True}, {"causal": True, "deterministic": True}, {"softcap": True})] + [
    ("bf16", 256, {"causal": True, "lpt": True}), ("fp16", 128, {}), ("fp16", 256, {})]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fwd", action="store_true", help="forward kernels only")
    ap.add_argument("--bwd", action="store_true", help="backward kernels only")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config field set on every kernel (e.g. lpt=True)")
    ap.add_argument("--compare", metavar="FILE", help="an earlier output: print only the lines that differ")
    args = ap.parse_args()
    extra = parse_overrides(",".join(args.set))
    kinds = [k for k, on in (("fwd", not args.bwd), ("bwd", not args.fwd)) if on]
    old = {}
    if args.compare:
        with open(args.compare) as f:
            old = {line.rsplit(" ", 2)[0]: line.strip() for line in f if line.strip()}
    changed = 0
    for kind in kinds:
        for dtype, hdim, mask in FWD if kind == "fwd" else BWD:
            cfg = {"dtype": dtype, "hdim": hdim, **mask, **extra}
            key = f"{kind} " + " ".join(f"{k}={v}" for k, v in cfg.items())
            try:
                r = inspect_kernel(kind, **cfg)
                line = f"{key} {r['sass_sha256'][:16]} {r['instructions']}"
            except Exception as exc:  # a config the kernel refuses: say so, go on
                line = f"{key} refused {type(exc).__name__}"
            if args.compare:
                if old.get(key) != line:
                    changed += 1
                    print(f"was {old.get(key, '(absent)')}\nnow {line}", flush=True)
            else:
                print(line, flush=True)
    if args.compare:
        print(f"{changed} kernel(s) differ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
