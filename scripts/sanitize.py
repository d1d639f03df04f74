"""compute-sanitizer over one odd-shaped call of each dispatched kernel class: plan.covering_subset
(every field value of the dispatch at least once, as CI's compile checks; the varlen kernels' on their
own), each call made from the
first lengths that dispatch it (flashhopper.plan.dispatched_calls), forward and backward.

    compute-sanitizer --tool memcheck --report-api-errors no python3 scripts/sanitize.py
    compute-sanitizer --tool racecheck --report-api-errors no python3 scripts/sanitize.py --fwd
    compute-sanitizer --tool memcheck --report-api-errors no python3 scripts/sanitize.py --decode
    python3 scripts/sanitize.py --list

Run it for each of memcheck, racecheck and synccheck; a clean run ends with "0 errors".
(`--report-api-errors no`: the CUDA Python bindings probe driver entry points at start-up, which
memcheck would otherwise count.) --all takes every dispatched kernel instead of the subset.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from flashhopper.config import BwdConfig, BwdPreConfig  # noqa: E402
from flashhopper.plan import covering_subset, dispatched_calls  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fwd", action="store_true", help="forward kernels only")
    parser.add_argument("--all", action="store_true", help="every dispatched kernel, not the covering subset")
    parser.add_argument("--list", action="store_true", help="print the calls; run nothing")
    parser.add_argument("--pick", type=int, nargs="+", metavar="I", help="only these calls (--list numbers)")
    parser.add_argument("--keys", type=int, metavar="N",
                        help="dense calls read N keys instead of their listed lengths' (several key blocks a "
                             "tile, so the K / V rings wrap; a plan that depends on the lengths may then "
                             "dispatch another kernel than listed)")
    parser.add_argument("--decode", action="store_true",
                        help="the KV-cache calls instead (split-KV decode, appends, paged caches of 1 / 16 / "
                             "128 rows a page, chunked prefill)")
    args = parser.parse_args()
    if args.decode:
        return _decode(args.list)
    calls = dispatched_calls(backward=not args.fwd)
    if not args.all:  # and the varlen kernels covered on their own (their offsets meet every tile shape)
        varlen = [cfg for cfg in calls if getattr(cfg, "varlen", False)]
        chosen = dict.fromkeys(covering_subset(list(calls)) + covering_subset(varlen))
        calls = {cfg: calls[cfg] for cfg in chosen}
    runs = []
    for cfg, call in calls.items():
        if isinstance(cfg, BwdPreConfig):
            continue  # run by its backward
        runs.append((call, isinstance(cfg, BwdConfig)))
    if args.pick:
        runs = [runs[i] for i in args.pick]
    if args.list:
        for i, (call, bwd) in enumerate(runs):
            print(f"{i:3d} " + ("bwd " if bwd else "fwd ") + repr(call))
        print(f"{len(runs)} calls")
        return 0
    from flashhopper import flash_attn_func
    from flashhopper.hopper import runtime

    runtime.persistent_ctas_cap = 2  # persistent grids: every CTA walks several tiles
    for feature in ("FP8", "VARLEN"):  # sanitizing them is part of verifying them
        os.environ.setdefault(f"FLASHHOPPER_EXPERIMENTAL_{feature}", "1")
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "e4m3": torch.float8_e4m3fn}
    for call, bwd in runs:
        torch.manual_seed(0)
        if call.varlen:  # three sequences: the call's lengths, a short one, and one with no query
            _varlen(call, bwd)
            continue
        sk = args.keys or call.sk
        q = torch.randn(1, call.sq, 2, call.hdim, device="cuda").to(dt[call.dtype]).requires_grad_(bwd)
        k, v = (torch.randn(1, sk, 1, d, device="cuda").to(dt[call.dtype]).requires_grad_(bwd)
                for d in (call.hdim, call.dv or call.hdim))
        names = ("q_descale", "k_descale", "v_descale") if call.dtype == "e4m3" else ()
        descales = {name: torch.full((1, 1), 0.5, device="cuda") for name in names}  # FP8: per (b, kv head)
        if call.qk_descale == "token":  # the per-token kernels: q's and k's per row
            descales.update(q_descale=torch.full((1, 2, call.sq), 0.5, device="cuda"),
                            k_descale=torch.full((1, 1, sk), 0.5, device="cuda"))
        out = flash_attn_func(q, k, v, causal=call.causal, window_size=call.window, **descales,
                              softcap=5.0 if call.softcap else 0.0, deterministic=call.deterministic,
                              return_lse=call.lse)
        out = out[0] if call.lse else out  # the LSE asked or not picks the kernel (plan.fp8_row_sum)
        if bwd:
            out.sum().backward()
        torch.cuda.synchronize()
        print(("bwd " if bwd else "fwd ") + repr(call) + f": finite={bool(out.isfinite().all())}", flush=True)
    print(f"{len(runs)} calls ran", flush=True)
    return 0


def _varlen(call, bwd: bool) -> None:
    from flashhopper import flash_attn_varlen_func

    lens_q, lens_k = (call.sq, 17, 0), (call.sk, 33, 5)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for lens in (lens_q, lens_k))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[call.dtype]
    q = torch.randn(sum(lens_q), 2, call.hdim, device="cuda", dtype=dtype).requires_grad_(bwd)
    k, v = (torch.randn(sum(lens_k), 1, d, device="cuda", dtype=dtype).requires_grad_(bwd)
            for d in (call.hdim, call.dv or call.hdim))
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=call.causal,
                                 window_size=call.window, softcap=5.0 if call.softcap else 0.0,
                                 deterministic=call.deterministic)
    if bwd:
        out.sum().backward()
    torch.cuda.synchronize()
    print(("bwd " if bwd else "fwd ") + f"{call!r}: finite={bool(out.isfinite().all())}", flush=True)


# (batch, query rows, context, page size or 0, new rows appended, query heads, kv heads, hdim)
_DECODE_CALLS = [(1, 1, 8192, 0, 0, 32, 8, 128), (3, 1, 1000, 0, 1, 32, 8, 128),
                 (2, 4, 700, 16, 0, 8, 2, 64), (2, 1, 3000, 1, 1, 8, 8, 128),
                 (2, 1, 2000, 128, 0, 16, 2, 256), (2, 37, 300, 16, 37, 4, 2, 128)]


def _decode(list_only: bool) -> int:
    """flash_attn_with_kvcache over the split-KV decode, its merge, appends and the paged reads."""
    for i, call in enumerate(_DECODE_CALLS):
        print(f"{i:3d} decode (batch, q rows, context, page, appended, hq, hk, d) = {call}")
    if list_only:
        print(f"{len(_DECODE_CALLS)} calls")
        return 0
    from flashhopper import flash_attn_with_kvcache

    for b, sq, ctx, page, new, hq, hk, d in _DECODE_CALLS:
        torch.manual_seed(0)
        lens = torch.tensor([ctx - new - 37 * i for i in range(b)], dtype=torch.int32, device="cuda")
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16)
        kv = {"k": torch.randn(b, new, hk, d, device="cuda", dtype=torch.bfloat16),
              "v": torch.randn(b, new, hk, d, device="cuda", dtype=torch.bfloat16)} if new else {}
        if page:
            pages = -(-ctx // page)
            k_cache, v_cache = (torch.randn(b * pages, page, hk, d, device="cuda", dtype=torch.bfloat16)
                                for _ in range(2))
            table = torch.randperm(b * pages, device="cuda", dtype=torch.int32).view(b, pages)
        else:
            k_cache, v_cache = (torch.randn(b, ctx, hk, d, device="cuda", dtype=torch.bfloat16)
                                for _ in range(2))
            table = None
        out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, page_table=table, causal=True,
                                      **kv)
        torch.cuda.synchronize()
        print(f"decode {(b, sq, ctx, page, new, hq, hk, d)}: finite={bool(out.isfinite().all())}", flush=True)
    print(f"{len(_DECODE_CALLS)} calls ran", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
