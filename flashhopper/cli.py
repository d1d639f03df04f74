"""Command line: `flashhopper inspect | precompile | cache | fuzz | demo | bench | plot`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from flashhopper.compile import ensure_arch_env


def _cmd_inspect(args) -> int:
    from flashhopper.compile import inspect_kernel

    cfg = {"dtype": args.dtype, "hdim": args.hdim, "causal": args.causal}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"flashhopper inspect: --set expects KEY=VALUE, got {item!r}", file=sys.stderr)
            return 2
        cfg[key] = _parse_value(value)
    try:
        report = inspect_kernel(args.kernel, **cfg)
    except ImportError as exc:
        print(f"flashhopper inspect: the GPU kernels (flashhopper.hopper) are not importable: {exc}",
              file=sys.stderr)
        return 2
    except (KeyError, FileNotFoundError) as exc:
        print(f"flashhopper inspect: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
    else:
        _print_inspection(report)
    return 0


def _parse_value(text: str):
    """'true'/'false' -> bool, integers -> int, anything else stays a string."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        return text


def _print_inspection(r: dict) -> None:
    cfg = " ".join(f"{k}={v}" for k, v in r["config"].items())
    sass = r["sass"]
    counts = "  ".join(f"{k} {v}" for k, v in sass.items() if k != "USETMAXREG")
    rows = [
        ("kernel", f"{r['kernel']} ({cfg})"),
        ("function", r["function"]),
        ("registers", f"{r['registers']} at launch; setmaxnreg {sass['USETMAXREG'] or 'none'}"),
        ("spill bytes", r["spill_bytes"]),
        ("smem bytes", f"{r['smem_bytes']} ({r['smem_bytes'] / 1024:.1f} KiB)"),
        ("instructions", f"{r['instructions']} (SASS sha256 {r['sass_sha256'][:16]})"),
        ("SASS", counts),
    ]
    for key, value in rows:
        print(f"{key:<13} {value}")


def _cmd_precompile(args) -> int:
    from flashhopper.config import BWD_HDIMS, DTYPES, FP8_DTYPES, SUPPORTED_HDIMS
    from flashhopper.plan import (
        PAGED_PAGE_SIZES,
        combine_kernels,
        decode_kernels,
        dispatched_kernels,
        paged_kernels,
        split_kernels,
    )
    from flashhopper.precompile import precompile
    from flashhopper.validation import (
        decode_split_enabled,
        decode_tile_enabled,
        paged_tma_enabled,
    )

    hdims = args.hdim or list(SUPPORTED_HDIMS)
    if bad := sorted(set(hdims) - set(SUPPORTED_HDIMS)):
        print(f"flashhopper precompile: --hdim {bad} not supported; choose from {list(SUPPORTED_HDIMS)}",
              file=sys.stderr)
        return 2
    if args.bwd_only and not set(hdims) & set(BWD_HDIMS):
        print(f"flashhopper precompile: no backward at hdim {hdims}", file=sys.stderr)
        return 2
    configs = dispatched_kernels(args.dtype or DTYPES + FP8_DTYPES, hdims, forward=not args.bwd_only,
                                 backward=args.bwd or args.bwd_only)
    if not args.bwd_only and (args.decode or decode_tile_enabled()):  # the gated 1-warpgroup decode tile
        configs += decode_kernels(args.dtype or DTYPES, hdims)
    if not args.bwd_only:  # split-KV decode's merge kernels (the default merge)
        configs += combine_kernels(args.dtype or DTYPES, hdims)
    if not args.bwd_only and (args.decode or decode_split_enabled()):  # the gated split inside the kernel
        pages = (0, *PAGED_PAGE_SIZES) if args.paged or paged_tma_enabled() else (0,)
        # --decode: on both tiles (the varlen one, and the 1-warpgroup one the decode tile's opt-in takes)
        for tile in (False, True) if args.decode else (decode_tile_enabled(),):
            configs += [cfg for cfg in split_kernels(args.dtype or DTYPES, hdims, pages, decode_tile=tile)
                        if cfg not in configs]
    if not args.bwd_only and (args.paged or paged_tma_enabled()):  # the gated paged K / V kernels
        configs += paged_kernels(args.dtype or DTYPES, hdims)
    if args.list:
        for cfg in configs:
            print(cfg)
        print(f"{len(configs)} kernels")
        return 0
    if args.jobs is not None and args.jobs < 1:
        print(f"flashhopper precompile: --jobs takes N >= 1, got {args.jobs}", file=sys.stderr)
        return 2
    try:
        report = precompile(configs, jobs=args.jobs)
    except OSError as exc:
        print(f"flashhopper precompile: {exc}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _cmd_cache(args) -> int:
    from flashhopper.hopper import kernel_cache

    if args.action == "clear":
        n = kernel_cache.clear(stale_only=args.stale)
        print(f"removed {n} folder(s) under {kernel_cache.cache_root()}")
        return 0
    report = kernel_cache.info()
    if args.json:
        print(json.dumps(report))
        return 0
    off = "" if report["disk"] else f" (off: {kernel_cache.ENV_DISK}=0)"
    print(f"cache folder   {report['root']}{off}")
    versions = ", ".join(f"{k} {v}" for k, v in report["versions"].items())
    print(f"fingerprint    {report['fingerprint'][:16]} ({versions})")
    folders = report["folders"]
    if not any(f["current"] for f in folders):
        folders.append({"folder": report["current"], "current": True, "entries": 0, "by_kind": {},
                        "bytes": 0})
    for folder in folders:
        kinds = ", ".join(f"{n} {k}" for k, n in folder["by_kind"].items()) or "empty"
        mark = "current" if folder["current"] else "stale  "
        print(f"{mark}        {folder['folder']}: {folder['entries']} kernels ({kinds}), "
              f"{folder['bytes'] / 2**20:.1f} MiB")
    return 0


def _cmd_fuzz(args) -> int:
    import torch

    from flashhopper.fuzz import Case, fuzz, fuzz_parallel, run

    if args.cases < 1 and not args.case:
        print(f"flashhopper fuzz: --cases takes N >= 1, got {args.cases}", file=sys.stderr)
        return 2
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        print("flashhopper fuzz: needs an NVIDIA Hopper GPU (sm_90)", file=sys.stderr)
        return 2
    if args.case:
        try:
            case = Case.from_json(args.case)
        except (ValueError, TypeError, KeyError) as exc:
            print(f"flashhopper fuzz: --case takes the JSON a failure printed ({exc})", file=sys.stderr)
            return 2
        problem = run(case, backward=not args.no_bwd)
        print(problem or "passed")
        return 1 if problem else 0
    try:
        k, n = (int(x) for x in args.shard.split("/"))
        if not 0 <= k < n:
            raise ValueError
    except ValueError:
        print(f"flashhopper fuzz: --shard takes K/N with 0 <= K < N, got {args.shard!r}", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print(f"flashhopper fuzz: --jobs takes N >= 1, got {args.jobs}", file=sys.stderr)
        return 2
    if args.jobs > 1:
        report = fuzz_parallel(args.cases, args.seed, args.jobs, backward=not args.no_bwd, group=args.strata,
                               experimental=args.experimental)
    else:
        report = fuzz(args.cases, args.seed, backward=not args.no_bwd, shard=(k, n), group=args.strata,
                      experimental=args.experimental)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if report["failed"] else 0


def _cmd_fp8_accuracy(args) -> int:
    import torch

    from flashhopper.fp8_accuracy import format_rows, seqlen_sweep, table3

    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        print("flashhopper fp8-accuracy: needs an NVIDIA Hopper GPU (sm_90)", file=sys.stderr)
        return 2
    os.environ.setdefault("FLASHHOPPER_EXPERIMENTAL_FP8", "1")  # measuring it is part of verifying it
    report = {"table3": table3(), "seqlen": seqlen_sweep(args.seqlen)}
    print("\n".join(format_rows(report["table3"])) + "\n")
    print("\n".join(format_rows(report["seqlen"])))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _cmd_demo(args) -> int:
    from flashhopper.demo import run_demo

    return run_demo()


def _cmd_bench(args) -> int:
    import torch

    if args.decode:
        return _bench_decode(args)
    for flag, given in (("--pages", args.pages), ("--prefill", args.prefill)):
        if given:  # checked first: a wrong command line needs no GPU to tell
            print(f"flashhopper bench: {flag} applies to --decode only", file=sys.stderr)
            return 2
    if args.varlen:
        return _bench_varlen(args)
    args.rounds = 1 if args.rounds is None else args.rounds
    for flag, given in (("--plot", args.plot), ("--bwd", args.bwd)):
        if args.ablation and given:  # checked first: a wrong command line needs no GPU to tell
            print(f"flashhopper bench: {flag} applies to the grid, not to --ablation (forward only)",
                  file=sys.stderr)
            return 2
    args.dtype = "e4m3" if args.dtype == "fp8" else args.dtype
    if args.dtype == "e4m3" and args.bwd:
        print("flashhopper bench: --dtype e4m3 is the forward grid only, not --bwd", file=sys.stderr)
        return 2
    # FP8's ablation is the grid with the same kernel fed a transposed V beside it (the upper bound)
    fp8_upper_bound = args.dtype == "e4m3" and args.ablation
    args.ablation = args.ablation and not fp8_upper_bound
    from flashhopper.config import BwdConfig, FwdConfig, parse_overrides

    try:
        overrides = parse_overrides(",".join(args.set))
    except ValueError:
        print(f"flashhopper bench: --set takes KEY=VALUE (an int or true / false), got {args.set}",
              file=sys.stderr)
        return 2
    fields = {f.name for f in dataclasses.fields(BwdConfig if args.bwd else FwdConfig)}
    for flag, given in (("--set", overrides), ("--allocations", args.allocations)):
        if args.ablation and given:
            print(f"flashhopper bench: {flag} applies to the grid, not to --ablation", file=sys.stderr)
            return 2
    if args.rounds < 1:
        print(f"flashhopper bench: --rounds takes N >= 1, got {args.rounds}", file=sys.stderr)
        return 2
    if args.allocations < 0 or (args.allocations and args.rounds > 1):
        print(f"flashhopper bench: --allocations takes N >= 1 and replaces --rounds, got {args.allocations}",
              file=sys.stderr)
        return 2
    if unknown := sorted(set(overrides) - fields):
        print(f"flashhopper bench: --set {unknown} not a field of {'BwdConfig' if args.bwd else 'FwdConfig'}",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("flashhopper bench: needs a CUDA GPU (none visible)", file=sys.stderr)
        return 2
    if args.ablation:
        from flashhopper.bench.ablation import run_ablation

        causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
        run_ablation(dtype=args.dtype, json_path=args.json, causal=causal, rounds=args.rounds)
        return 0
    if args.plot:
        # fail now, not after a grid that takes minutes
        from flashhopper.bench.plot import MissingMatplotlib, require_matplotlib

        try:
            require_matplotlib()
        except MissingMatplotlib as exc:
            print(f"flashhopper bench: {exc}", file=sys.stderr)
            return 2
    from flashhopper.bench.grid import HDIMS, SEQLENS, quick_grid, standard_grid
    from flashhopper.bench.runner import run_bench

    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    if args.quick:
        points = [p for p in quick_grid() if p.causal in causal and (not args.hdim or p.hdim in args.hdim)]
    else:
        points = standard_grid(hdims=args.hdim or HDIMS, causal=causal, seqlens=args.seqlen or SEQLENS)
    providers = None
    if fp8_upper_bound:
        from flashhopper.bench.providers import fp8_providers

        providers = fp8_providers(upper_bound=True)
    report = run_bench(points, dtype=args.dtype, json_path=args.json, backward=args.bwd,
                       overrides=overrides, rounds=args.rounds, providers=providers,
                       **({"allocations": args.allocations} if args.allocations else {}))
    if args.plot:
        from flashhopper.bench.plot import plot_report

        print(f"wrote {plot_report(report, args.plot)}")
    return 0


def _bench_varlen(args) -> int:
    """`bench --varlen`: the packed-sequence benchmark (flashhopper/bench/varlen.py)."""
    import torch

    from flashhopper.bench import varlen

    grid_only = (("--ablation", args.ablation), ("--plot", args.plot), ("--set", args.set),
                 ("--seqlen", args.seqlen))
    for flag, value in grid_only:  # checked first: a wrong command line needs no GPU to tell
        if value:
            what = "fixed by its packings" if flag == "--seqlen" else "a grid option"
            print(f"flashhopper bench: {flag} does not apply to --varlen ({what})", file=sys.stderr)
            return 2
    if args.dtype not in ("bf16", "fp16"):
        print(f"flashhopper bench: --varlen times bf16 or fp16, not --dtype {args.dtype} (FP8 has no varlen "
              "peer here)", file=sys.stderr)
        return 2
    hdims = sorted({d for d, _ in varlen.HDIMS})
    if args.hdim and (bad := sorted(set(args.hdim) - set(hdims))):
        print(f"flashhopper bench: --varlen --hdim {bad} not benchmarked; choose from {hdims} "
              "(192: q / k 192, v 128)", file=sys.stderr)
        return 2
    # the speed targets' method: a round per allocation (each round draws its inputs anew)
    rounds = _rounds(args, varlen.DEFAULT_ROUNDS)
    if rounds is None:
        return 2
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    backward = (True,) if args.bwd else (False, True)
    points = varlen.varlen_points(quick=args.quick, hdims=args.hdim, causal=causal, backward=backward)
    if not torch.cuda.is_available():
        print("flashhopper bench: needs a CUDA GPU (none visible)", file=sys.stderr)
        return 2
    varlen.run_varlen_bench(points, dtype=args.dtype, json_path=args.json, rounds=rounds)
    return 0


def _rounds(args, default: int) -> int | None:
    """--rounds (default `default`), or --allocations N as N rounds (each on fresh inputs); None after
    printing why the command line is refused."""
    rounds = default if args.rounds is None else args.rounds
    if args.allocations:
        if args.rounds is not None:
            print("flashhopper bench: --allocations replaces --rounds", file=sys.stderr)
            return None
        rounds = args.allocations
    if rounds < 1:
        print(f"flashhopper bench: --rounds takes N >= 1, got {rounds}", file=sys.stderr)
        return None
    return rounds


def _bench_decode(args) -> int:
    """`bench --decode`: decode over contiguous (and with --pages paged) KV caches, with --prefill chunked
    prefill through pages (flashhopper/bench/decode.py)."""
    import torch

    from flashhopper.bench import decode

    refused = (("--varlen", args.varlen, "a benchmark of its own: run one at a time"),
               ("--bwd", args.bwd, "decode is inference only: there is no backward"),
               ("--ablation", args.ablation, "a grid option"), ("--plot", args.plot, "a grid option"),
               ("--set", args.set, "a grid option"),
               ("--seqlen", args.seqlen, "fixed by its batch x context points"),
               ("--causal", args.causal != "both", "set by the query length: bottom-right for 4 queries"))
    for flag, given, why in refused:  # checked first: a wrong command line needs no GPU to tell
        if given:
            print(f"flashhopper bench: {flag} does not apply to --decode ({why})", file=sys.stderr)
            return 2
    if args.dtype not in ("bf16", "fp16"):
        print(f"flashhopper bench: --decode times bf16 or fp16 caches, not --dtype {args.dtype} "
              "(flash_attn_with_kvcache takes no FP8 cache yet)", file=sys.stderr)
        return 2
    hdims = sorted({d for _, _, d in decode.HEAD_CONFIGS})
    if args.hdim and (bad := sorted(set(args.hdim) - set(hdims))):
        print(f"flashhopper bench: --decode --hdim {bad} not benchmarked; choose from {hdims} (128: 32 query "
              "heads over 8 KV heads, 64: 32 over 32)", file=sys.stderr)
        return 2
    if args.pages and (bad := [p for p in args.pages if p < 1]):
        print(f"flashhopper bench: --pages takes page sizes >= 1, got {bad}", file=sys.stderr)
        return 2
    rounds = _rounds(args, decode.DEFAULT_ROUNDS)
    if rounds is None:
        return 2
    prefill = decode.prefill_points(hdims=args.hdim) if args.prefill else []
    if args.prefill and not prefill:
        print(f"flashhopper bench: --prefill times hdim {decode.PREFILL_HEADS[2]} only, not --hdim "
              f"{args.hdim}", file=sys.stderr)
        return 2
    points = decode.decode_points(quick=args.quick, hdims=args.hdim)
    if not points:  # --quick is hdim 128 only
        print(f"flashhopper bench: no decode point left: --quick is hdim 128 only, not --hdim {args.hdim}",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("flashhopper bench: needs a CUDA GPU (none visible)", file=sys.stderr)
        return 2
    decode.run_decode_bench(points, dtype=args.dtype, json_path=args.json, rounds=rounds,
                            allocations=bool(args.allocations), pages=tuple(dict.fromkeys(args.pages or ())),
                            prefill=prefill)
    return 0


def _cmd_plot(args) -> int:
    from flashhopper.bench.plot import MissingMatplotlib, plot_file

    try:
        print(f"wrote {plot_file(args.grid_json, args.out_png, dpi=args.dpi)}")
    except MissingMatplotlib as exc:
        print(f"flashhopper plot: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError, KeyError) as exc:  # missing file, bad JSON, not a grid report
        print(f"flashhopper plot: cannot plot {args.grid_json}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    from flashhopper.fuzz import STRATA

    parser = argparse.ArgumentParser(prog="flashhopper", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="compile a kernel for sm_90a (no GPU needed) and report its resources")
    p.add_argument("kernel", help="a name from flashhopper.hopper.KERNELS, e.g. fwd")
    p.add_argument("--dtype", choices=("bf16", "fp16", "e4m3"), default="bf16", help="e4m3: FP8 (fwd only)")
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra builder option, e.g. --set local=true (repeatable)")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("precompile", help="compile the dispatched kernels into the disk cache, in parallel "
                       "(no GPU needed)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "e4m3"), nargs="+",
                   help="default: all three (e4m3: FP8, forward only)")
    p.add_argument("--hdim", type=int, nargs="+", help="default: every supported head dim")
    p.add_argument("--bwd", action="store_true", help="also the backward kernels (the training set)")
    p.add_argument("--bwd-only", action="store_true", help="only the backward kernels")
    p.add_argument("--jobs", "-j", type=int, help="worker processes (default: one per CPU core)")
    p.add_argument("--decode", action="store_true",
                   help="also the 1-warpgroup decode kernels (taken with "
                        "FLASHHOPPER_EXPERIMENTAL_DECODE_TILE=1, which also adds them) and the decode "
                        "kernels with the split inside (taken with FLASHHOPPER_EXPERIMENTAL_DECODE_SPLIT=1, "
                        "which also adds them; with the paged kernels their paged ones too)")
    p.add_argument("--paged", action="store_true",
                   help="also the paged K / V kernels for pages of 16, 64, 128 and 256 rows (a paged KV "
                        "cache reads its pages with them)")
    p.add_argument("--list", action="store_true", help="print the kernels' configs; compile nothing")
    p.add_argument("--json", metavar="FILE", help="also write the counts and times as JSON")
    p.set_defaults(func=_cmd_precompile)

    p = sub.add_parser("cache", help="the kernel cache on disk: info (folder, fingerprint, entries) or clear")
    p.add_argument("action", choices=("info", "clear"))
    p.add_argument("--stale", action="store_true", help="clear: only folders of other fingerprints")
    p.add_argument("--json", action="store_true", help="info: print one JSON object")
    p.set_defaults(func=_cmd_cache)

    p = sub.add_parser("fuzz", help="random cases over the dispatched kernels, checked by the correctness "
                       "rule (GPU)")
    p.add_argument("--cases", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-bwd", action="store_true", help="the forward only")
    p.add_argument("--strata", choices=STRATA, default="all",
                   help="draw from every stratum (default); from flash_attn_func's and "
                   "flash_attn_varlen_func's only (the draws from before the decode strata); from "
                   "flash_attn_with_kvcache's only; or from the FP8 forward's only")
    p.add_argument("--experimental", action="store_true",
                   help="decode cases may also opt in to the split inside the attention kernel by its "
                   "variable (FLASHHOPPER_EXPERIMENTAL_DECODE_SPLIT; the default path since its GPU run, so "
                   "the same kernels); the rest drawn as without it")
    p.add_argument("--case", metavar="JSON", help="run the one case a failure printed")
    p.add_argument("--jobs", type=int, default=1, help="processes sharing the GPU, each a shard of the cases")
    p.add_argument("--shard", default="0/1", metavar="K/N", help="only cases i with i %% N == K")
    p.add_argument("--json", metavar="FILE", help="also write the counts as JSON")
    p.set_defaults(func=_cmd_fuzz)

    p = sub.add_parser("fp8-accuracy", help="FP8 output error against float64: FA3's Table 3 protocol and "
                       "error against sequence length (GPU)")
    p.add_argument("--seqlen", type=int, nargs="+", default=[1024, 4096, 16384, 65536, 131072])
    p.add_argument("--json", metavar="FILE", help="also write the tables as JSON")
    p.set_defaults(func=_cmd_fp8_accuracy)

    p = sub.add_parser("demo", help="run the kernels on Hopper; elsewhere inspect them")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("bench", help="forward (or --bwd backward) TFLOP/s against SDPA (FA2, cuDNN) and FA4; "
                       "--varlen: packed sequences against FA4 and FA2; --decode: flash_attn_with_kvcache "
                       "against FA4 and SDPA")
    p.add_argument("--quick", action="store_true", help="8 points: hdim 128/64, seqlen 1k/8k, causal or not")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--hdim", type=int, nargs="+", help="headdims (default 64 128 256)")
    p.add_argument("--seqlen", type=int, nargs="+", help="sequence lengths (default 512 .. 16384)")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp8", "e4m3"), default="bf16",
                   help="fp8 (= e4m3): the FP8 forward against cuDNN's FP8 SDPA (cudnn Python frontend) and "
                        "the FP8 GEMM rate (torch._scaled_mm) timed beside each point")
    p.add_argument("--bwd", action="store_true",
                   help="time the backward alone (forward run once, outside the timing); FLOPs 2.5 x forward")
    p.add_argument("--ablation", action="store_true",  # with --dtype fp8: the grid + V given transposed
                   help="instead of the grid: hdim 128, seqlen 8k with each scheduling switch off")
    p.add_argument("--plot", metavar="PNG", help="also draw the grid as a PNG (needs matplotlib)")
    p.add_argument("--rounds", type=int, metavar="N",
                   help="time each point (with --ablation: each configuration) N times, taking turns, and "
                        "report the median (min / max in the JSON): steadier on a machine whose clocks move; "
                        "default 1, with --varlen 3 (fresh inputs each round), with --decode 3")
    p.add_argument("--allocations", type=int, default=0, metavar="N",
                   help="the measuring method for speed targets (the grid, --varlen, --decode): each "
                        "point over N (>= 20 for a target) fresh allocations of every input, providers "
                        "interleaved; p10 / p50 / p90 per provider in the JSON, ratios of p50s, spread "
                        "p50 / p10 against the peers'")
    p.add_argument("--varlen", action="store_true",
                   help="instead of the grid: packed sequences (16 docs of 100-4000 tokens, 512 of 16-512), "
                        "flash_attn_varlen_func against FA4's and FA2's varlen, forward and backward (--bwd: "
                        "backward only); --quick: the 16 documents at hdim 128")
    p.add_argument("--decode", action="store_true",
                   help="instead of the grid: decode over KV caches, contiguous and with --pages paged (1 "
                        "and 4 query tokens; batch x context 1x8k, 1x32k, 1x128k, 8x32k, 64x4k, 128x8k; "
                        "heads 32:8 at hdim 128, "
                        "32:32 at hdim 64), flash_attn_with_kvcache against FA4's varlen and torch SDPA, in "
                        "us per call and as a fraction of the device copy rate; --quick: 1x8k, 8x32k, 64x4k, "
                        "1 query token, 32:8 at hdim 128")
    p.add_argument("--pages", type=int, nargs="+", metavar="P",
                   help="with --decode: also flash_attn_with_kvcache over a paged copy of each cache for "
                        "each page size P (e.g. --pages 1 16 64; a seeded shuffled page table), reported "
                        "as flashhopper-pageP with its time over the contiguous call's")
    p.add_argument("--prefill", action="store_true",
                   help="with --decode: also chunked prefill, a 2048-query chunk after 8k and 32k cached "
                        "tokens (batch 1 and 4, heads 32:8 at hdim 128, causal), flash_attn_with_kvcache "
                        "over pages of 64 (or the --pages sizes) against flash_attn_func on the contiguous "
                        "keys, in us per call, TFLOP/s and speed over the dense kernel")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="run flashhopper with this config field instead of the dispatched one (FwdConfig, "
                        "BwdConfig with --bwd), e.g. --set pingpong=false; repeatable; recorded in the JSON")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("plot", help="draw a `bench --json` result as TFLOP/s vs seqlen (needs matplotlib)")
    p.add_argument("grid_json", metavar="GRID.json")
    p.add_argument("out_png", metavar="OUT.png")
    p.add_argument("--dpi", type=int, default=90)
    p.set_defaults(func=_cmd_plot)
    return parser


def main(argv=None) -> int:
    # Before anything can import cutlass: the DSL fixes its target arch at import.
    ensure_arch_env()
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
