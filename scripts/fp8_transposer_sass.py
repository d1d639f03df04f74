"""The FP8 forward's V transposer (hopper/fp8.py) in SASS: the instructions of the transposer warps'
loop, one V tile per iteration, compiled for sm_90a without a GPU (through the kernel cache).

    python3 scripts/fp8_transposer_sass.py                  # the default FP8 kernel of each hdim
    python3 scripts/fp8_transposer_sass.py --all --hdim 128   # every dispatched FP8 kernel of hdim 128

Per kernel: the loop's instructions (`static`: all of its code, each warp's unrolled units included),
what one warp runs of it per V tile (`per warp`: the loop less the other warps' unit lists), and the
opcodes. The loop is the innermost backward branch around the first transposing load (LDSM.16.MT88,
or LDS.64 of the earlier transposer); the warps' unit lists lie between the last branch before that
load and the target of the unconditional branch that ends the first list.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from flashhopper.compile import find_sass_tools  # noqa: E402
from flashhopper.config import SUPPORTED_HDIMS  # noqa: E402
from flashhopper.plan import dispatched_kernels, fwd_config  # noqa: E402

_LINE = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_GUARD = re.compile(r"^@!?U?P[T0-9]+\s+")
_TARGET = re.compile(r"BRA\s+(?:`\(.*?\)\s*)?0x([0-9a-f]+)")


def _opcode(body: str) -> str:
    return _GUARD.sub("", body).split(" ")[0]


def _is_transposing_load(body: str) -> bool:
    op = _opcode(body)
    return op.startswith("LDSM.16.MT88") or op == "LDS.64"


def transposer_loop(sass: str) -> dict:
    """{"static": n, "per_warp": n, "opcodes": Counter} of the transposer loop in `cuobjdump -sass` text."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in map(_LINE.match, sass.splitlines()) if m]
    first = next(i for i, (_, body) in enumerate(ins) if _is_transposing_load(body))
    at = ins[first][0]
    loops = [(int(t.group(1), 16), addr) for addr, body in ins
             if _opcode(body) == "BRA" and (t := _TARGET.search(body)) and int(t.group(1), 16) <= at <= addr]
    head, tail = min(loops, key=lambda loop: loop[1] - loop[0])
    body = [(addr, text) for addr, text in ins if head <= addr <= tail]
    first = next(i for i, (_, text) in enumerate(body) if _is_transposing_load(text))
    start = max((i for i in range(first) if _opcode(body[i][1]) == "BRA"), default=-1) + 1
    ends = [i for i in range(first, len(body)) if body[i][1].startswith("BRA ")]
    per_warp = len(body)
    if ends:  # each warp's unit list ends with a branch to the join (the last one falls through)
        join_at = int(_TARGET.search(body[ends[0]][1]).group(1), 16)
        join = next(i for i, (addr, _) in enumerate(body) if addr == join_at)
        cuts = [start] + [i + 1 for i in ends if i < join] + [join]
        per_warp = len(body) - (join - start) + max(b - a for a, b in zip(cuts, cuts[1:], strict=False))
    return {"static": len(body), "per_warp": per_warp,
            "opcodes": collections.Counter(_opcode(text) for _, text in body)}


def _sass(cubin: bytes) -> str:
    cuobjdump, nvdisasm = find_sass_tools()
    env = dict(os.environ, PATH=os.path.dirname(nvdisasm) + os.pathsep + os.environ.get("PATH", ""))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, env=env,
                              check=True).stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdim", nargs="+", type=int, default=list(SUPPORTED_HDIMS))
    ap.add_argument("--all", action="store_true",
                    help="every dispatched FP8 forward kernel, not the default one")
    args = ap.parse_args()
    from flashhopper.hopper.runtime import kernel_cubin

    configs = (dispatched_kernels(["e4m3"], args.hdim, forward=True, backward=False) if args.all
               else [fwd_config("e4m3", hdim) for hdim in args.hdim])
    for cfg in configs:
        loop = transposer_loop(_sass(kernel_cubin(cfg)))
        ops = ", ".join(f"{op} {n}" for op, n in loop["opcodes"].most_common(8))
        print(f"hdim {cfg.hdim} tile_n {cfg.tile_n} causal {cfg.causal} local {cfg.local} "
              f"softcap {cfg.softcap} qk_descale {cfg.qk_descale}: static {loop['static']}, "
              f"per warp {loop['per_warp']} ({ops})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
