"""Time config variants of the forward (or --bwd backward) against each other on a GPU: each
--variant is a comma-separated list of FwdConfig / BwdConfig fields ("default" = the dispatch),
timed on every point with the variants taking turns for --rounds rounds; medians in TFLOP/s and
each variant's ratio to the first.

    python3 scripts/config_sweep.py --hdim 128 --seqlen 2048 8192 --variant default --variant pingpong=false
    python3 scripts/config_sweep.py --bwd --hdim 256 --causal yes --variant default --variant lpt=true
    python3 scripts/config_sweep.py --dtype fp8 --hdim 128 --variant default --variant tile_n=128 \\
        --variant tile_n=224,pv_two_level=false,producer_nreg=40
    python3 scripts/config_sweep.py --dtype fp8 --hdim 128 --candidates   # plan.FP8_TILE_CANDIDATES

--dtype fp8 (e4m3, forward only) calls ours as the bench does (flashhopper.bench.providers: unit
descales, the FP8 opt-in) and times cuDNN's FP8 SDPA in the same rounds, each variant's ratio to it
printed beside its ratio to the first variant (cuDNN writes e4m3 O, ours bf16). producer_nreg=N sets the
register split (the producer warpgroup's N, the consumers the rest: config.register_split).

Before the timing, every variant runs once on one set of inputs (which also compiles its kernel) and its
output (forward) or gradients (--bwd) are compared with the dispatch's: the largest absolute difference
is printed under each row, so that a variant that computes something else shows.

Points follow the benchmark grid (16k tokens, hidden 2048: flashhopper.bench.grid).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from flashhopper.bench.grid import make_point  # noqa: E402
from flashhopper.bench.runner import DTYPES, FP8, randn, time_ms  # noqa: E402
from flashhopper.config import parse_overrides  # noqa: E402
from flashhopper.hopper import runtime  # noqa: E402


def step(attention, q, k, v, causal: bool, dout=None):
    """What one timed call runs: the forward, or with `dout` the backward of one forward made here."""
    if dout is None:
        return lambda: attention(q, k, v, causal=causal)
    out = attention(q, k, v, causal=causal)
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def _tensors(result) -> list[torch.Tensor]:
    """The tensors of a call's result (out, (out, lse), or the gradients), in order."""
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for t in result if isinstance(t, torch.Tensor)]


def max_abs_diff(result, reference) -> float:
    """The largest |result - reference| over the tensors both return (nan where either has one)."""
    pairs = zip(_tensors(result), _tensors(reference), strict=False)
    return max((a.float() - b.float()).abs().max().item() for a, b in pairs)


class Ours:
    """flashhopper's call at one dtype: bf16 / fp16 through flash_attn_func (forward or backward), e4m3
    through the bench's FP8 provider (unit descales, under the FP8 opt-in)."""

    def __init__(self, dtype: torch.dtype, backward: bool):
        self.dtype, self.backward = dtype, backward
        self.fp8 = None
        if dtype == FP8:
            from flashhopper.bench.providers import flashhopper_fp8

            self.fp8 = flashhopper_fp8()

    def inputs(self, shape):
        """(q, k, v, dout or None)."""
        if not self.backward:
            return (*(randn(shape, self.dtype, "cuda") for _ in range(3)), None)
        return (*(randn(shape, self.dtype, "cuda").requires_grad_() for _ in range(3)),
                randn(shape, self.dtype, "cuda"))

    def context(self):
        return self.fp8.context() if self.fp8 else contextlib.nullcontext()

    def call(self, q, k, v, dout, causal: bool):
        if self.fp8:
            return self.fp8.make(q, k, v, causal)
        from flashhopper import flash_attn_func

        return step(flash_attn_func, q, k, v, causal, dout)


def cudnn_peer(dtype: torch.dtype):
    """cuDNN's FP8 SDPA (the bench's provider) for e4m3, else None; None too where it cannot run."""
    if dtype != FP8:
        return None
    from flashhopper.bench.providers import cudnn_fp8

    return cudnn_fp8()


def precompile_variants(dtype, hdims, seqlens, causal_modes, variants, jobs: int) -> None:
    """The forward kernels every (point, variant) launches (the dispatch's plan under the variant's
    overrides; FP8 with (batch, heads_k) descales and no LSE asked, as the bench's provider calls it),
    compiled in parallel."""
    from flashhopper.precompile import precompile

    configs = set()
    for hdim in hdims:
        for causal in causal_modes:
            for seqlen in seqlens:
                p = make_point(seqlen, hdim, causal)
                for _, fields in variants:
                    with runtime.config_overrides(**fields):
                        plan = runtime._fwd_plan_uncached(dtype, hdim, p.batch, seqlen, seqlen, p.heads,
                                                          causal, (-1, -1), False, need_lse=dtype != FP8)
                    configs.add(plan[0])
    precompile(sorted(configs, key=repr), jobs=jobs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bwd", action="store_true")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp8", "e4m3"), default="bf16")
    parser.add_argument("--hdim", type=int, nargs="+", default=[128])
    parser.add_argument("--seqlen", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--variant", action="append", default=[], metavar="FIELDS")
    parser.add_argument("--candidates", action="store_true",
                        help="with --dtype fp8 and one --hdim: the dispatch and plan.FP8_TILE_CANDIDATES of "
                             "the head dim first, then any --variant")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=0,
                        help="forward: compile every variant's kernels first, this many worker processes at "
                             "a time (flashhopper precompile's pool), instead of one by one on first call")
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    if dtype == FP8 and args.bwd:
        parser.error("--dtype fp8 is forward only")
    if args.candidates:
        if dtype != FP8 or len(args.hdim) != 1:
            parser.error("--candidates takes --dtype fp8 and one --hdim")
        from flashhopper.plan import FP8_TILE_CANDIDATES

        args.variant = ["default", *FP8_TILE_CANDIDATES[args.hdim[0]], *args.variant]
    if not args.variant:
        parser.error("give --variant FIELDS (or --candidates)")
    variants = [(text, parse_overrides(text)) for text in args.variant]
    overrides = runtime.bwd_config_overrides if args.bwd else runtime.config_overrides
    ours, peer = Ours(dtype, args.bwd), cudnn_peer(dtype)

    causal_modes = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    if args.jobs and not args.bwd:
        precompile_variants(dtype, args.hdim, args.seqlen, causal_modes, variants, args.jobs)
    width = 22 if peer else 18
    legend = "TFLOP/s (x first variant, x cuDNN FP8)" if peer else "TFLOP/s (x first variant)"
    print(f"{args.dtype} {'backward' if args.bwd else 'forward'}: {legend}; max|d|: the largest absolute "
          "difference of the variant's output from the dispatch's on the same inputs")
    for i, (text, _) in enumerate(variants):
        print(f"  [{i}] {text}")
    head = "  ".join(f"{f'[{i}]':>{width}}" for i in range(len(variants)))
    head += f"  {'cudnn':>8}" if peer else ""
    print(f"{'hdim':>4} {'causal':>6} {'seqlen':>6}  {head}")
    for hdim in args.hdim:
        for causal in causal_modes:
            for seqlen in args.seqlen:
                p = make_point(seqlen, hdim, causal)
                flops = p.bwd_flops if args.bwd else p.flops
                shape = (p.batch, seqlen, p.heads, hdim)
                # one set of inputs through the dispatch and every variant: the check, and each variant's
                # compile kept out of the timing
                q, k, v, dout = ours.inputs(shape)
                with ours.context():
                    reference = ours.call(q, k, v, dout, causal)()
                    diffs = {}
                    for text, fields in variants:
                        with overrides(**fields):
                            diffs[text] = max_abs_diff(ours.call(q, k, v, dout, causal)(), reference)
                if peer:  # cuDNN builds its graph for the shape on its first call
                    try:
                        peer.make(q, k, v, causal)()
                    except Exception as exc:  # cuDNN absent or refusing the shape: ours still timed
                        print(f"(cuDNN FP8 not timed: {type(exc).__name__}: {str(exc)[:160]})", flush=True)
                        peer = None
                del q, k, v, dout, reference
                times = {text: [] for text, _ in variants}
                peer_times = []
                for _ in range(args.rounds):
                    for text, fields in variants:  # fresh inputs each turn
                        q, k, v, dout = ours.inputs(shape)
                        with ours.context(), overrides(**fields):
                            times[text].append(time_ms(ours.call(q, k, v, dout, causal)))
                    if peer:
                        q, k, v, _ = ours.inputs(shape)
                        peer_times.append(time_ms(peer.make(q, k, v, causal)))
                tflops = {t: flops / statistics.median(ms) / 1e9 for t, ms in times.items()}
                theirs = flops / statistics.median(peer_times) / 1e9 if peer_times else None
                base = tflops[variants[0][0]]
                cells = []
                for t, _ in variants:
                    vs_peer = f", {tflops[t] / theirs:4.2f}c" if theirs else ""
                    cells.append(f"{tflops[t]:7.1f} ({tflops[t] / base:5.3f}x{vs_peer})")
                row = "  ".join(f"{c:>{width}}" for c in cells) + (f"  {theirs:8.1f}" if theirs else "")
                print(f"{hdim:>4} {'yes' if causal else 'no':>6} {seqlen:>6}  {row}", flush=True)
                checks = "  ".join(f"{diffs[t]:>{width}.2e}" for t, _ in variants)
                print(f"{'':>4} {'':>6} {'max|d|':>6}  {checks}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
