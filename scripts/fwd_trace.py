"""Timeline of the forward main loop from SM clock stamps (FwdConfig.trace), on a GPU.

    python scripts/fwd_trace.py [--out DIR] [CASE ...]     # CASE: hdim:seqlen[:k=v,...], e.g. 128:8192

Each consumer warp's first tile writes the SM clock at 8 points of every overlapped step (entry, K
ready, ping-pong token, V ready, GEMMs issued, S ready, softmax done, P @ V done). This prints, per
case, the median phase lengths of warp 0 of each consumer warpgroup over the steady steps of every
CTA, and the tensor pipe's cadence: with the GEMMs back to back, consecutive S-ready stamps of
alternating warpgroups are one P @ V plus one QK^T apart, (2 x 64 x tile_n x hdim x 2 FLOP) / 4096
FLOP a cycle. Time beyond that is either a late issue (the next warpgroup took its token after the
pipe ran dry: `idle before issue`) or slower GEMMs (`excess with issue on time`).
"""
import argparse
import dataclasses
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, ".")
from flashhopper.bench.grid import attention_flops  # noqa: E402
from flashhopper.bench.runner import time_ms  # noqa: E402
from flashhopper.config import parse_overrides  # noqa: E402
from flashhopper.hopper import fwd as F  # noqa: E402
from flashhopper.hopper import runtime  # noqa: E402

EVENTS = ("entry", "k_ready", "token", "v_ready", "issued", "s_ready", "softmax", "pv_done")
FLOP_PER_CYCLE = 4096  # dense bf16 / fp16 WGMMA per SM


def run_case(hdim, seqlen, over, out_dir):
    tokens, hidden = 16384, 2048
    b, h = max(1, tokens // seqlen), hidden // hdim
    q, k, v = (torch.randn(b, seqlen, h, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale = 1.0 / math.sqrt(hdim)

    def plain():
        return runtime.forward(q, k, v, scale, False, (-1, -1), 0.0)

    with runtime.config_overrides(**over):
        ms = time_ms(plain)
        cfg = runtime.fwd_config("bf16", hdim)
        cfg = dataclasses.replace(cfg, **over)
        buf = torch.zeros(F.trace_words(), dtype=torch.int32, device="cuda")
        lse = buf.view(torch.float32)[: b * h * seqlen].view(b, h, seqlen)
        with runtime.config_overrides(trace=True):
            traced = time_ms(lambda: runtime.forward(q, k, v, scale, False, (-1, -1), 0.0, lse=lse))
            buf.zero_()
            runtime.forward(q, k, v, scale, False, (-1, -1), 0.0, lse=lse)
            torch.cuda.synchronize()
    tflops = attention_flops(b, h, seqlen, seqlen, hdim, False) / ms / 1e9
    nwg = cfg.num_consumer_wg
    t = buf.cpu().numpy().view(np.uint32)[: F._TRACE_JUNK * F._TRACE_STEPS * F._TRACE_EVENTS]
    max_ctas = F._TRACE_JUNK // (nwg * 4)
    t = t[: max_ctas * nwg * 4 * F._TRACE_STEPS * F._TRACE_EVENTS]
    t = t.reshape(max_ctas, nwg, 4, F._TRACE_STEPS, F._TRACE_EVENTS)[:, :, 0]
    ctas = int((t[:, 0, 1:, 0] != 0).any(axis=1).sum())
    t = t[:ctas].astype(np.int64)
    steps = seqlen // cfg.tile_n  # blocks of the tile; the peeled block 0 is not stamped
    lo, hi = 3, steps - 2  # steady steps: past the fill, before the tail
    # a warpgroup with no rows left (skip_idle_wg: hdim 64's 192-row tiles end past seqlen) stamps nothing
    full = (t[:, :, lo:hi + 1] != 0).all(axis=(1, 2, 3))
    t, ctas = t[full], int(full.sum())
    base = t[:, :, lo, 0].min(axis=1)[:, None, None, None]
    t = (t - base) % (1 << 32)  # clock words wrap at 2^32
    ideal = 2 * 2 * 64 * cfg.tile_n * hdim / FLOP_PER_CYCLE  # one warpgroup's QK^T + P @ V
    if out_dir:
        tag = "_".join(f"{a}{b}" for a, b in over.items())
        np.save(os.path.join(out_dir, f"trace_h{hdim}_s{seqlen}_{tag}.npy"), t[:, :, :steps].astype(np.int32))
    st = t[:, :, lo:hi]
    phase = {}
    for i in range(1, len(EVENTS)):
        phase[f"{EVENTS[i - 1]}->{EVENTS[i]}"] = np.median(st[..., i] - st[..., i - 1])
    phase["pv_done->next entry"] = np.median(t[:, :, lo + 1:hi + 1, 0] - st[..., 7])
    phase["step (entry to entry)"] = np.median(t[:, :, lo + 1:hi + 1, 0] - st[..., 0])
    # the tensor pipe's cadence across warpgroups: S-ready stamps in order (w0 j, w1 j, ..., w0 j+1)
    s_ready = st[..., 5].transpose(0, 2, 1).reshape(ctas, -1)  # (cta, step * nwg)
    token = st[..., 2].transpose(0, 2, 1).reshape(ctas, -1)
    order = np.argsort(s_ready, axis=1)  # the tensor pipe's order of the GEMM pairs
    s_ready, token = np.take_along_axis(s_ready, order, 1), np.take_along_axis(token, order, 1)
    gaps = np.diff(s_ready, axis=1)
    # pipe free for the next warpgroup's QK^T ~ previous warpgroup's S ready + its P @ V
    pv = ideal / 2
    late = np.maximum(0, token[:, 1:] - (s_ready[:, :-1] + pv))
    excess = np.maximum(0, gaps - ideal) - late
    total = s_ready[:, -1] - s_ready[:, 0]
    report = {
        "case": f"hdim {hdim} seqlen {seqlen} {over or ''}", "tflops": round(tflops, 1),
        "traced_tflops": round(attention_flops(b, h, seqlen, seqlen, hdim, False) / traced / 1e9, 1),
        "ctas": ctas, "ideal_gemm_pair": ideal,
        "median_gap": float(np.median(gaps)), "mean_gap": float(gaps.mean()),
        "pipe_busy_est": float(ideal * gaps.shape[1] / total.mean()),
        "idle_before_issue_frac": float(late.sum() / total.sum()),
        "excess_on_time_frac": float(excess.clip(0).sum() / total.sum()),
        "gap_p10_p50_p90": [float(x) for x in np.percentile(gaps, [10, 50, 90])],
        "phases": {k: float(v) for k, v in phase.items()},
    }
    return report


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*",
                    default=["128:8192", "128:8192:pingpong=false", "64:8192", "256:8192"])
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args()
    for case in args.cases:
        parts = case.split(":")
        hdim, seqlen = int(parts[0]), int(parts[1])
        over = parse_overrides(parts[2]) if len(parts) > 2 else {}
        r = run_case(hdim, seqlen, over, args.out)
        print(f"== {r['case']}: {r['tflops']} TFLOP/s ({r['traced_tflops']} traced), {r['ctas']} CTAs")
        print(f"   GEMM pair ideal {r['ideal_gemm_pair']:.0f} cycles; S-ready gap median "
              f"{r['median_gap']:.0f}, mean {r['mean_gap']:.0f}, p10/50/90 {r['gap_p10_p50_p90']}")
        print(f"   pipe busy (est.) {r['pipe_busy_est']:.3f}; idle before a late issue "
              f"{r['idle_before_issue_frac']:.3f}; excess with the issue on time "
              f"{r['excess_on_time_frac']:.3f}")
        print("   phases (median cycles, warp 0 of each consumer warpgroup, steady steps):")
        for k_, v_ in r["phases"].items():
            print(f"     {k_:>24}: {v_:7.0f}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
