"""Backward kernel on the GPU: errors against the float64 reference, then timings against peers.

    source .device/setup.sh && PYTHONPATH=$PWD python3 scripts/bwd_check.py [--no-bench] [--hdims 64,128]
        [--case-hdims 192,256] [--fp16] [--bwd-config tile_m=64,ds_stages=2]

--bwd-config replaces BwdConfig fields for every backward call (runtime.bwd_config_overrides), e.g.
`--case-hdims 64 --hdims 64 --bwd-config tile_m=64` for the 64-row kernel at hdim 64. Given more
than once, each configuration runs the cases in turn and the benchmark times every one of them
side by side (the peers once per point); `default` is the dispatched configuration. The wide
kernel's candidates at hdim 256 (docs/design.md "hdim 192 and 256"):

    --no-bench --case-hdims 256 --bwd-config tile_n=80,do_stages=1 --bwd-config do_stages=1 \
        --bwd-config tile_n=48 --bwd-config tile_n=48,do_stages=1 --bwd-config dq_chunks=2
    --no-cases --hdims 256 --seqlens 1024,8192 --bwd-config default --bwd-config do_stages=1 \
        --bwd-config tile_n=80,do_stages=1 --bwd-config tile_n=48 --bwd-config tile_n=48,do_stages=1 \
        --bwd-config dq_chunks=2

hdim 64 with dQ split by query rows (BwdConfig.dq_by_rows, docs/notes/bwd-keys-gap.md):

    --no-bench --case-hdims 64 --bwd-config dq_by_rows=True
    --no-cases --hdims 64 --seqlens 1024,8192 --bwd-config default --bwd-config dq_by_rows=True

hdim 64 / 96 / 128 with dK += dS^T Q taking dS^T from registers (BwdConfig.dk_rs, same note):

    --no-bench --case-hdims 64,128 --bwd-config dk_rs=True
    --no-cases --hdims 64,128 --seqlens 1024,8192 --bwd-config default --bwd-config dk_rs=True

hdim 64 / 96 / 128 with the per-warpgroup dQ hand-off (BwdConfig.dq_per_wg, same note):

    --no-bench --case-hdims 64,96,128 --bwd-config dq_per_wg=True
    --no-cases --hdims 64,128 --seqlens 1024,8192 --bwd-config default --bwd-config dq_per_wg=True

hdim 128 with 80 query rows per step (BwdConfig tile_m=80, dQ^T = K^T dS^T; FA3 / FA4's tile without
a mask; same note):

    --no-bench --case-hdims 128 --bwd-config tile_m=80 --bwd-config tile_m=80,dk_rs=True
    --no-cases --hdims 128 --seqlens 1024,8192 --bwd-config default --bwd-config tile_m=80 \
        --bwd-config tile_m=80,dk_rs=True

hdim 64 in FA3 / FA4's step order (BwdConfig.ds_then_dv: all of dS^T stored, then dV as one group;
same note):

    --no-bench --case-hdims 64 --bwd-config ds_then_dv=True
    --no-cases --hdims 64 --seqlens 1024,8192 --bwd-config default --bwd-config ds_then_dv=True

hdim 64 / 96 / 128 with masked steps only at the mask edges (BwdConfig.mask_runs, same note):

    --no-bench --case-hdims 64,96,128 --bwd-config mask_runs=True   (and again with --fp16)
    --no-cases --hdims 64,128 --seqlens 1024,8192 --bwd-config default --bwd-config mask_runs=True

Each case prints max |err| of dq, dk, dv next to PyTorch's own error (same dtype) and the bound
2 * err_pt + 1e-3. dk and dv are NaN-poisoned before the call so unwritten elements show.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import traceback

import torch

sys.path.insert(0, ".")
from flashhopper.bench.grid import attention_flops, make_point  # noqa: E402
from flashhopper.bench.runner import time_ms  # noqa: E402
from flashhopper.config import parse_overrides  # noqa: E402
from flashhopper.reference import attention_bwd_ref, attention_grads_in_dtype  # noqa: E402

CASES = [  # b, sq, sk, hq, hk, d, causal, window, softcap
    (2, 128, 128, 2, 2, 64, False, (-1, -1), 0.0),
    (2, 300, 517, 4, 2, 64, False, (-1, -1), 0.0),
    (1, 1000, 1000, 2, 1, 64, True, (-1, -1), 0.0),
    (2, 517, 300, 2, 2, 64, True, (-1, -1), 0.0),
    (1, 700, 700, 2, 2, 64, False, (100, 20), 0.0),
    (1, 333, 333, 2, 2, 64, False, (-1, -1), 10.0),
    (1, 1, 17, 2, 2, 64, False, (-1, -1), 0.0),
    (2, 256, 256, 2, 2, 128, False, (-1, -1), 0.0),
    (1, 1000, 1000, 4, 1, 128, True, (-1, -1), 0.0),
    (1, 17, 1000, 2, 2, 128, False, (-1, -1), 0.0),
    (1, 500, 500, 2, 2, 128, False, (64, 64), 5.0),
    # hdim 96: the 64-keys-per-warpgroup kernel with K in SW32 (hopper/bwd_layout.py)
    (2, 300, 517, 4, 2, 96, False, (-1, -1), 0.0),
    (1, 1000, 1000, 2, 1, 96, True, (-1, -1), 0.0),
    (1, 700, 700, 2, 2, 96, False, (100, 20), 0.0),
    (1, 333, 333, 2, 2, 96, False, (-1, -1), 10.0),
    # hdim 192 / 256: dK/dV split by head dim (hopper/bwd_wide.py; 3 and 2 consumer warpgroups)
    (2, 192, 192, 2, 2, 192, False, (-1, -1), 0.0),
    (2, 300, 517, 6, 2, 192, False, (-1, -1), 0.0),
    (1, 1000, 1000, 3, 1, 192, True, (-1, -1), 0.0),
    (2, 517, 300, 2, 2, 192, True, (-1, -1), 0.0),
    (1, 700, 700, 2, 2, 192, False, (100, 20), 0.0),
    (1, 333, 333, 2, 2, 192, False, (-1, -1), 10.0),
    (1, 1, 17, 2, 2, 192, False, (-1, -1), 0.0),
    (2, 128, 128, 2, 2, 256, False, (-1, -1), 0.0),
    (2, 300, 517, 4, 2, 256, False, (-1, -1), 0.0),
    (1, 1000, 1000, 4, 1, 256, True, (-1, -1), 0.0),
    (2, 517, 300, 4, 2, 256, True, (-1, -1), 0.0),
    (1, 17, 1000, 2, 2, 256, False, (-1, -1), 0.0),
    (1, 700, 700, 2, 2, 256, False, (100, 20), 0.0),
    (1, 500, 500, 2, 2, 256, False, (64, 64), 5.0),
    (1, 333, 333, 2, 2, 256, False, (-1, -1), 10.0),
]



def check(case, dtype=torch.bfloat16, deterministic=False):
    from flashhopper.hopper import forward, runtime

    b, sq, sk, hq, hk, d, causal, window, softcap = case
    torch.manual_seed(sq * 7 + sk + d)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    dout = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
    scale = 1 / math.sqrt(d)
    out, lse = forward(q, k, v, scale, causal, window, softcap)
    dk = torch.full_like(k, float("nan"))
    dv = torch.full_like(v, float("nan"))
    dq, dk, dv = runtime.backward(q, k, v, out, dout, lse, scale, causal, window, softcap, dk=dk, dv=dv,
                                  deterministic=deterministic)
    torch.cuda.synchronize()
    ref = attention_bwd_ref(q, k, v, dout, scale, causal, window, softcap)
    yard = attention_grads_in_dtype(q, k, v, dout, scale, causal, window, softcap)
    ok, parts = True, []
    for name, mine, exact, pt in zip("qkv", (dq, dk, dv), ref, yard, strict=True):
        nan = mine.isnan().sum().item()
        err = (mine.double() - exact).abs().max().item()
        err_pt = (pt.double() - exact).abs().max().item()
        good = nan == 0 and err <= 2 * err_pt + 1e-3
        ok &= good
        parts.append(f"d{name} {err:.2e}/{err_pt:.2e}{'' if good else ' FAIL'}{f' nan={nan}' if nan else ''}")
    return ok, "  ".join(parts)


def _grad_fn(o, inputs, dout):
    return lambda: torch.autograd.grad(o, inputs, dout, retain_graph=True)


def bench_point(d, s, causal, fa4, configs=({},), rounds=1):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashhopper.hopper import forward, runtime

    p = make_point(s, d, causal)
    flops = attention_flops(p.batch, p.heads, s, s, d, causal, backward=True)
    q, k, v, do = (torch.randn(p.batch, s, p.heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = 1 / math.sqrt(d)
    res = {}
    fh_names = ["fh"] if len(configs) == 1 else [f"fh{i}" for i in range(len(configs))]
    try:
        out, lse = forward(q, k, v, scale, causal, (-1, -1), 0.0)
    except Exception as exc:
        print("fh forward failed:", str(exc)[:200])
        configs = ()
    # flashhopper's configurations take turns over `rounds` (medians): a clock swing then hits
    # each alike; the peers are timed once
    samples = {}
    for _ in range(rounds):
        for name, overrides in zip(fh_names, configs, strict=False):
            if samples.get(name, ()) is None:
                continue
            try:
                with runtime.bwd_config_overrides(**overrides):
                    ms = time_ms(lambda: runtime.backward(q, k, v, out, do, lse, scale, causal,
                                                          (-1, -1), 0.0))
                samples.setdefault(name, []).append(ms)
            except Exception as exc:
                print(name, "failed:", str(exc)[:200])
                samples[name] = None
    res.update({n: statistics.median(t) for n, t in samples.items() if t})
    for name, be in (("fa2", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
            with sdpa_kernel(be):
                o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            res[name] = time_ms(_grad_fn(o, (qt, kt, vt), do.transpose(1, 2)))
        except Exception as exc:
            print(name, "failed:", str(exc)[:200])
    if fa4 is not None:
        try:
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            o = fa4(qq, kk, vv, causal=causal)
            o = o[0] if isinstance(o, tuple) else o
            res["fa4"] = time_ms(_grad_fn(o, (qq, kk, vv), do))
        except Exception as exc:
            print("fa4 failed:", str(exc)[:200])
    tf = {n: flops / ms / 1e9 for n, ms in res.items()}
    peers = [tf[n] for n in ("cudnn", "fa4") if n in tf]
    mine = [tf[n] for n in fh_names if n in tf]
    ratio = max(mine) / max(peers) if mine and peers else float("nan")  # the best configuration's
    cells = " ".join(f"{tf.get(n, float('nan')):8.1f}" for n in (*fh_names, "fa2", "cudnn", "fa4"))
    print(f"{d:>4} {'yes' if causal else 'no':>6} {s:>6} {cells} {ratio:6.2f}", flush=True)


def bench(hdims, seqlens, configs=({},), rounds=1, masks=(False, True)):
    try:
        from flash_attn.cute import flash_attn_func as fa4
    except Exception as exc:
        print("no FA4:", exc)
        fa4 = None
    fh_names = ["fh"] if len(configs) == 1 else [f"fh{i}" for i in range(len(configs))]
    if len(configs) > 1:
        for name, overrides in zip(fh_names, configs, strict=True):
            print(f"{name}: {overrides or 'default'}")
    names = " ".join(f"{n:>8}" for n in (*fh_names, "fa2", "cudnn", "fa4"))
    medians = f"; flashhopper: median of {rounds} rounds" if rounds > 1 else ""
    print(f"backward TFLOP/s (2.5x forward FLOPs){medians}")
    print(f"{'hdim':>4} {'causal':>6} {'seqlen':>6} {names} {'ratio':>6}")
    for d in hdims:
        for causal in masks:
            for s in seqlens:
                bench_point(d, s, causal, fa4, configs, rounds)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--no-cases", action="store_true")
    ap.add_argument("--hdims", default="64,128")
    ap.add_argument("--seqlens", default="1024,4096,16384")
    ap.add_argument("--fp16", action="store_true")
    ap.add_argument("--causal", choices=("both", "yes", "no"), default="both", help="timed masks")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time flashhopper's configurations N times, taking turns")
    ap.add_argument("--case-hdims", default="", help="correctness cases of these hdims only, e.g. 192,256")
    ap.add_argument("--no-softcap", action="store_true",
                    help="leave out the softcap cases (for configurations that exclude softcap)")
    ap.add_argument("--bwd-config", action="append", default=[],
                    help="BwdConfig overrides, e.g. tile_m=64,ds_stages=2 or tile_n=80,do_stages=1; "
                         "repeat to compare configurations ('default': none)")
    args = ap.parse_args()
    configs = [parse_overrides(text) for text in args.bwd_config] or [{}]
    if configs != [{}]:
        print("BwdConfig overrides:", "; ".join(str(c or "default") for c in configs), flush=True)
    return run(args, configs)


def run(args, configs=({},)):
    from flashhopper.hopper import runtime

    failures = 0
    cases = [] if args.no_cases else CASES
    if args.case_hdims:
        cases = [c for c in cases if c[5] in {int(x) for x in args.case_hdims.split(",")}]
    if getattr(args, "no_softcap", False):
        cases = [c for c in cases if not c[8]]
    for overrides in configs if cases else ():
        if len(configs) > 1:
            print("cases with", overrides or "default", flush=True)
        with runtime.bwd_config_overrides(**overrides):
            for case in cases:
                try:
                    ok, text = check(case, torch.float16 if args.fp16 else torch.bfloat16)
                except Exception:
                    ok, text = False, traceback.format_exc(limit=3)[-600:]
                failures += not ok
                print(f"{'ok  ' if ok else 'FAIL'} {case}: {text}", flush=True)
    if cases:
        print(f"{failures} of {len(cases) * len(configs)} cases failed", flush=True)
    if not args.no_bench:
        masks = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
        bench([int(x) for x in args.hdims.split(",")], [int(x) for x in args.seqlens.split(",")], configs,
              args.rounds, masks)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
