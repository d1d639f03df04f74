"""Time flashhopper against its peers on one GPU and print TFLOP/s, forward or backward.

Every number is from the same process and the same inputs, because absolute TFLOP/s drift 5-15%
between runs and machines: the ratio to the best peer is the figure that means something. FP8
(e4m3, forward only) is judged against cuDNN's FP8 SDPA and against the FP8 GEMM rate, the latter
timed beside every point for the same reason.
"""

from __future__ import annotations

import contextlib
import json
import random
import statistics
import sys

import torch

from flashhopper.bench import gpu_state
from flashhopper.bench.grid import Point
from flashhopper.bench.providers import Provider, default_providers, fp8_providers
from flashhopper.bench.summary import format_summary, peer_text, summarize

FP8 = torch.float8_e4m3fn
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "e4m3": FP8, "fp8": FP8}
# flashhopper is compared against the strongest of these at each point.
BEST_PEERS = ("cudnn", "fa4")
# FP8: cuDNN's FP8 SDPA is the one peer (the "cudnn" provider of fp8_providers)
FP8_PEERS = ("cudnn",)


def time_ms(fn, short: bool = False) -> float:
    """Median milliseconds per call: triton.testing.do_bench if available, else CUDA events.
    `short`: about a third of the time (the allocations mode times each point many times)."""
    try:
        from triton.testing import do_bench
    except ImportError:
        return _time_with_events(fn, *((5, 10) if short else ()))
    return float(do_bench(fn, warmup=10 if short else 25, rep=30 if short else 100, return_mode="median"))


def _time_with_events(fn, warmup: int = 10, iters: int = 30) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs)


def matmul_tflops(n: int = 8192, dtype=torch.bfloat16) -> float:
    """The machine's practical matmul ceiling (cuBLAS through torch), for the same run's context."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    return 2.0 * n**3 / time_ms(lambda: torch.matmul(a, b)) / 1e9


def randn(shape, dtype, device) -> torch.Tensor:
    """N(0, 1) values; float8 has no randn kernel, so those are drawn in bf16 and rounded."""
    if dtype == FP8:
        return torch.randn(shape, device=device, dtype=torch.bfloat16).to(FP8)
    return torch.randn(shape, device=device, dtype=dtype)


def scaled_mm_calls(n: int = 8192, device="cuda") -> dict:
    """The FP8 GEMM ceiling: torch._scaled_mm (cuBLAS) on n^3 e4m3 with unit scales and bf16 out, with
    and without fast accumulation, as {name: (call, FLOPs)}; each is called once here, so a torch
    without it fails before the grid, not in it."""
    a = randn((n, n), FP8, device)
    b = randn((n, n), FP8, device).t()  # cuBLAS takes FP8 B column-major only
    one = torch.ones((), device=device)

    def call(fast: bool):
        return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                        use_fast_accum=fast)

    calls = {"fast_accum": (call(True), 2.0 * n**3), "default": (call(False), 2.0 * n**3)}
    for fn, _ in calls.values():
        fn()
    return calls


def _short(exc: Exception) -> str:
    text = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return text[:200]


def percentiles(samples) -> dict:
    """p10 / p50 / p90 of a provider's throughputs (p10: the slow end)."""
    if len(samples) < 2:
        return {"p10": samples[0], "p50": samples[0], "p90": samples[0]}
    deciles = statistics.quantiles(samples, n=10, method="inclusive")
    return {"p10": deciles[0], "p50": statistics.median(samples), "p90": deciles[8]}


def _sample_allocations(point: Point, providers, dtype, device, backward, allocations, flops, errors,
                        seed: int = 0, states: dict | None = None) -> dict:
    """{provider: [TFLOP/s, one per allocation]}. Each allocation draws every input anew behind a
    spacer of random size, every earlier draw of the point still held (a freed block would come
    back: addresses would alternate between two sets), so that addresses and their alignment move
    (the libraries' per-call workspaces with them); the providers then take turns in an order
    rotated per allocation, each timed with a short do_bench median. `states` ({provider: []}): the
    GPU's state (gpu_state.read) after each sample, where NVML reads it."""
    shape = (point.batch, point.seqlen, point.heads, point.hdim)
    draw = random.Random(seed)
    samples = {p.name: [] for p in providers}
    live = list(providers)
    held = []
    index = torch.device(device).index or 0
    for i in range(allocations):
        spacer = torch.empty(draw.randrange(1, 64) << 20 | draw.randrange(0, 1 << 20, 256), dtype=torch.uint8,
                             device=device)
        q, k, v = (randn(shape, dtype, device) for _ in range(3))
        dout = randn(shape, dtype, device) if backward else None
        held.append((spacer, q, k, v, dout))
        turn = i % max(len(live), 1)
        for provider in live[turn:] + live[:turn]:
            try:
                with provider.context():
                    fn = provider.timed_call(q, k, v, point.causal, dout)
                    fn()
                    samples[provider.name].append(flops / time_ms(fn, short=True) / 1e9)
                    if states is not None and (state := gpu_state.read(index)) is not None:
                        states.setdefault(provider.name, []).append(state)
            except Exception as exc:  # one provider failing must not lose the rest of the row
                errors[provider.name] = _short(exc)
                live.remove(provider)
                samples[provider.name] = []
            fn = None
    del held
    return samples


def paired_ratio(samples: dict, peers) -> float | None:
    """The median over allocations of ours / the best peer's TFLOP/s in that allocation: samples taken
    moments apart share the clock, so a power-cap swing cancels (None without a full pairing)."""
    mine = samples.get("flashhopper") or []
    theirs = [samples[name] for name in peers if len(samples.get(name) or []) == len(mine)]
    if not mine or not theirs:
        return None
    return statistics.median(m / max(t[i] for t in theirs) for i, m in enumerate(mine))


def _state_summary(states: dict) -> dict:
    """Per provider: the SM clock's p10 / p50 / p90 and the fraction of samples under the power cap."""
    return {name: {"sm_mhz": percentiles([s["sm_mhz"] for s in got]),
                   "power_capped": sum(s["power_capped"] for s in got) / len(got)}
            for name, got in states.items() if got}


def run_point(point: Point, providers: list[Provider], dtype=torch.bfloat16, device="cuda",
              backward: bool = False, rounds: int = 1, peers=BEST_PEERS,
              scaled_mm: dict | None = None, allocations: int = 0) -> dict:
    """TFLOP/s of each provider at one point: the forward, or with `backward` the backward alone.

    With `rounds` > 1 every provider is timed that many times, the providers taking turns within
    a round, and the median is reported (with min / max under "spread"): a clock or power swing
    then hits every provider alike instead of whichever ran during it. `ratio` is flashhopper over
    the best of `peers`. `scaled_mm` ({name: (call, FLOPs)}, see scaled_mm_calls) are timed in the
    same rounds after the providers and reported under "scaled_mm_tflops".

    `allocations` N > 0 (the measuring method every speed target uses): instead of rounds, N fresh
    allocations of every input (_sample_allocations); each provider's p10 / p50 / p90 go under
    "percentiles", "tflops" is the p50 and `ratio` ours over the best peer's p50."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if allocations:
        return _run_point_allocations(point, providers, dtype, device, backward, allocations, peers,
                                      scaled_mm)
    shape = (point.batch, point.seqlen, point.heads, point.hdim)
    q, k, v = (randn(shape, dtype, device) for _ in range(3))
    dout = randn(shape, dtype, device) if backward else None
    flops = point.bwd_flops if backward else point.flops
    errors, calls, samples = {}, {}, {}
    gemm_samples = {name: [] for name in scaled_mm or {}}
    for provider in providers:
        try:
            with provider.context():
                fn = provider.timed_call(q, k, v, point.causal, dout)
                fn()  # first call compiles / picks a kernel; keep it out of the timing
            calls[provider.name], samples[provider.name] = (provider, fn), []
        except Exception as exc:  # one provider failing must not lose the rest of the row
            errors[provider.name] = _short(exc)
    for _ in range(rounds):
        for name, (provider, fn) in list(calls.items()):
            try:
                with provider.context():
                    samples[name].append(flops / time_ms(fn) / 1e9)
            except Exception as exc:
                errors[name] = _short(exc)
                del calls[name]
        for name, (fn, gemm_flops) in (scaled_mm or {}).items():
            gemm_samples[name].append(gemm_flops / time_ms(fn) / 1e9)
    tflops = {p.name: statistics.median(samples[p.name]) if p.name in calls else None for p in providers}
    spread = {n: [min(samples[n]), max(samples[n])] for n in calls} if rounds > 1 else None
    rates = [tflops.get(name) for name in peers if tflops.get(name)]
    mine = tflops.get("flashhopper")
    ratio = mine / max(rates) if mine and rates else None
    row = {
        "hdim": point.hdim, "causal": point.causal, "seqlen": point.seqlen, "batch": point.batch,
        "heads": point.heads, "flops": flops, "tflops": tflops, "ratio": ratio, "errors": errors,
        **({"rounds": rounds, "spread": spread} if spread is not None else {}),
    }
    if scaled_mm:
        row["scaled_mm_tflops"] = {name: statistics.median(s) for name, s in gemm_samples.items()}
    return row


def _run_point_allocations(point, providers, dtype, device, backward, allocations, peers, scaled_mm) -> dict:
    flops = point.bwd_flops if backward else point.flops
    errors, states = {}, {}
    samples = _sample_allocations(point, providers, dtype, device, backward, allocations, flops, errors,
                                  states=states)
    pct = {name: percentiles(s) for name, s in samples.items() if s}
    tflops = {p.name: pct[p.name]["p50"] if p.name in pct else None for p in providers}
    rates = [tflops.get(name) for name in peers if tflops.get(name)]
    mine = tflops.get("flashhopper")
    row = {
        "hdim": point.hdim, "causal": point.causal, "seqlen": point.seqlen, "batch": point.batch,
        "heads": point.heads, "flops": flops, "tflops": tflops,
        "ratio": mine / max(rates) if mine and rates else None,
        "errors": errors, "allocations": allocations, "percentiles": pct, "samples": samples,
        "paired_ratio": paired_ratio(samples, peers), "gpu_state": _state_summary(states),
    }
    if scaled_mm:
        row["scaled_mm_tflops"] = {name: gemm_flops / time_ms(fn) / 1e9
                                   for name, (fn, gemm_flops) in scaled_mm.items()}
    return row


def spread(pct: dict | None) -> float | None:
    """p50 / p10 of a provider's throughputs: how much slower its slow allocations run."""
    return pct["p50"] / pct["p10"] if pct and pct["p10"] > 0 else None


def _cell(value, width=12, fmt="{:.1f}") -> str:
    return (fmt.format(value) if value is not None else "-").rjust(width)


def format_header(names, scaled_mm: bool = False, allocations: bool = False) -> str:
    cols = "".join(n.rjust(12) for n in names)
    gemm = f"{'mm fast':>9}{'mm dflt':>9}{'fh/mm':>7}" if scaled_mm else ""
    spreads = f"{'fh sprd':>9}{'peer sprd':>10}" if allocations else ""
    shape = f"{'hdim':>4} {'causal':>6} {'seqlen':>6} {'batch':>5} {'heads':>5}"
    return f"{shape}{cols}{'fh/best':>9}{spreads}{gemm}"


def point_spreads(row: dict, peers) -> tuple[float | None, float | None]:
    """(our p50 / p10, the widest of the peers' p50 / p10) of an allocations row."""
    pct = row.get("percentiles") or {}
    theirs = [s for s in (spread(pct.get(name)) for name in peers) if s]
    return spread(pct.get("flashhopper")), max(theirs) if theirs else None


def format_row(row: dict, names, peers=BEST_PEERS) -> str:
    cells = "".join(_cell(row["tflops"].get(n)) for n in names)
    causal = "yes" if row["causal"] else "no"
    ratio = _cell(row["ratio"], 9, "{:.2f}")
    if "percentiles" in row:
        ours, theirs = point_spreads(row, peers)
        ratio += _cell(ours, 9, "{:.3f}") + _cell(theirs, 10, "{:.3f}")
    shape = f"{row['hdim']:>4} {causal:>6} {row['seqlen']:>6} {row['batch']:>5} {row['heads']:>5}"
    gemm = ""
    if "scaled_mm_tflops" in row:
        fast, default = row["scaled_mm_tflops"]["fast_accum"], row["scaled_mm_tflops"]["default"]
        mine = row["tflops"].get("flashhopper")
        gemm = "".join((_cell(fast, 9, "{:.0f}"), _cell(default, 9, "{:.0f}"),
                        _cell(mine and mine / fast, 7, "{:.2f}")))
    return f"{shape}{cells}{ratio}{gemm}"


def run_bench(points: list[Point], dtype: str = "bf16", json_path: str | None = None,
              providers: list[Provider] | None = None, out=sys.stdout, backward: bool = False,
              overrides: dict | None = None, rounds: int = 1, allocations: int = 0) -> dict:
    """Time every provider at every point (with `backward`, the backward alone); print the table.
    `overrides`: config fields flashhopper's kernels run with instead of the dispatched ones
    (FwdConfig, or BwdConfig with `backward`), recorded in the report. `rounds`: see run_point.
    dtype "e4m3" (or "fp8"): the FP8 forward against cuDNN's, with the FP8 GEMM timed beside each point.
    `allocations` N: each point over N fresh allocations (run_point), p10 / p50 / p90 per provider."""
    fp8 = DTYPES[dtype] == FP8
    if fp8 and backward:
        raise ValueError("FP8 is forward only: there is no FP8 backward to time")
    providers = providers if providers is not None else (fp8_providers() if fp8 else default_providers())
    peers = FP8_PEERS if fp8 else BEST_PEERS
    names = [p.name for p in providers]
    ceiling = matmul_tflops()
    report = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": dtype,
        "direction": "bwd" if backward else "fwd", "matmul_tflops": ceiling, "providers": names,
        "peers": list(peers), "overrides": dict(overrides or {}), "rounds": rounds,
        "allocations": allocations, "results": [],
    }
    print(f"{report['device']}, torch {report['torch']}, {dtype}; bf16 matmul 8192^3: {ceiling:.0f} TFLOP/s",
          file=out, flush=True)
    scaled_mm = None
    if fp8:
        try:
            scaled_mm = scaled_mm_calls()
        except Exception as exc:  # the attention numbers still mean something without it
            print(f"(FP8 GEMM not measured: {_short(exc)})", file=out, flush=True)
        else:
            print("fp8 GEMM: torch._scaled_mm 8192^3 e4m3 timed beside every point; mm fast / mm dflt: "
                  "with / without fast accumulation; fh/mm = flashhopper / mm fast", file=out, flush=True)
    applied = contextlib.nullcontext()
    if overrides:
        from flashhopper.hopper import runtime  # imports the DSL: only when asked

        print(f"flashhopper config overrides: {overrides}", file=out, flush=True)
        applied = (runtime.bwd_config_overrides if backward else runtime.config_overrides)(**overrides)
    what = "backward TFLOP/s (FLOPs = 2.5 x forward, backward alone)" if backward else "forward TFLOP/s"
    print(f"{what}; fh/best = flashhopper / {peer_text(peers)}", file=out, flush=True)
    if allocations:
        print(f"each point over {allocations} fresh allocations, providers interleaved: TFLOP/s are p50s; "
              "sprd = p50 / p10 (ours; the widest peer's)", file=out, flush=True)
    print(format_header(names, scaled_mm=bool(scaled_mm), allocations=bool(allocations)), file=out,
          flush=True)
    fp8_args = {"peers": peers, "scaled_mm": scaled_mm} if fp8 else {}
    with applied:
        for point in points:
            row = run_point(point, providers, DTYPES[dtype], backward=backward, rounds=rounds,
                            **({"allocations": allocations} if allocations else {}), **fp8_args)
            report["results"].append(row)
            print(format_row(row, names, peers), file=out, flush=True)
            for name, message in row["errors"].items():
                print(f"    {name}: {message}", file=out, flush=True)
    report["provider_info"] = {p.name: p.info for p in providers if p.info}
    report["summary"] = summarize(report)
    # the targets in summary.py are the forward's (issue 4); the backward has none yet
    for line in format_summary(report["summary"], peers, targets=not backward):
        print(line, file=out, flush=True)
    write_json(report, json_path, out)
    return report


def write_json(report: dict, json_path, out) -> None:
    """The report to `json_path` (if given), saying so on `out`."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {json_path}", file=out, flush=True)
