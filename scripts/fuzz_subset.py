"""The fuzz's cases filtered: draws i = 0, 1, ... of `flashhopper fuzz --strata S --seed N` kept where they
match (query tokens, dtype, head dim), run by the fuzz's own rule (flashhopper.fuzz.run) until --cases of
them ran: a path's cases alone, against only the kernels it compiles (precompile them first).

    python3 scripts/fuzz_subset.py --strata decode --tokens 2 16 --dtype bf16 --hdim 128 --cases 400

Each failure printed as the fuzz prints it (`flashhopper fuzz --case '<json>'` reproduces it).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from flashhopper.fuzz import STRATA, draw, run  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strata", choices=STRATA, default="all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", type=int, default=200, help="cases to run (those matching)")
    ap.add_argument("--tokens", type=int, nargs=2, metavar=("LO", "HI"), help="query tokens an item, LO..HI")
    ap.add_argument("--dtype", nargs="+")
    ap.add_argument("--hdim", nargs="+", type=int)
    ap.add_argument("--no-bwd", action="store_true")
    args = ap.parse_args()
    ran = failed = i = 0
    while ran < args.cases and i < 1000 * args.cases:
        case = draw(i, args.seed, args.strata)
        i += 1
        if args.tokens and not args.tokens[0] <= case.sq <= args.tokens[1]:
            continue
        if (args.dtype and case.dtype not in args.dtype) or (args.hdim and case.hdim not in args.hdim):
            continue
        ran += 1
        problem = run(case, not args.no_bwd)
        if problem:
            failed += 1
            print(f"FAIL {problem}\n  reproduce: flashhopper fuzz --case '{case.to_json()}'"
                  + (" --no-bwd" if args.no_bwd else ""), flush=True)
    print(f"{ran} cases of {i} drawn (seed {args.seed}, strata {args.strata}), {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
