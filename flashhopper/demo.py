"""`flashhopper demo`: show what works on this machine.

On a Hopper GPU it runs the kernels and measures them; anywhere else it compiles them for sm_90a
and reads their SASS, and exercises the reference algorithms on the CPU.
"""

from __future__ import annotations

import time

import torch

from flashhopper.reference import (
    attention_bwd_ref,
    attention_ref,
    attention_tiled_bwd,
    attention_tiled_fwd,
)

# float32 block-wise vs float64 exact on O(1) inputs: anything above this is a bug, not rounding.
TILED_TOL = 1e-4


def hopper_present() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def run_demo() -> int:
    return _gpu_demo() if hopper_present() else _cpu_demo()


def _max_err(a, b) -> float:
    return (a.double() - b.double()).abs().nan_to_num(nan=float("inf")).max().item()


def _mean_err(a, b) -> float:
    return (a.double() - b.double()).abs().mean().item()


def _lse_err(a, b) -> float:
    # -inf == -inf is a match; the subtraction alone would give NaN.
    both_inf = torch.isinf(a) & torch.isinf(b) & (a == b)
    diff = (a.double() - b.double()).abs().masked_fill(both_inf, 0.0)
    return diff.nan_to_num(nan=float("inf")).max().item()


def _cpu_demo() -> int:
    print("No Hopper GPU here: compile-only inspection plus the CPU reference.\n", flush=True)
    failures = _inspect_kernels()
    failures += _reference_check()
    print(
        "\nOn a Hopper GPU (H100/H200) `make demo` also runs the kernels through flash_attn_func, "
        "reports their error against the float64 reference next to SDPA's, and times them against "
        "SDPA (FA2, cuDNN) and FA4 (`flashhopper bench`)."
    )
    return 1 if failures else 0


def _inspect_kernels() -> int:
    from flashhopper.compile import ensure_arch_env, inspect_kernel

    ensure_arch_env()
    print("== Kernels compiled for sm_90a (bf16, hdim 128, non-causal) ==", flush=True)
    try:
        from flashhopper.hopper import KERNELS, NOT_YET_VALIDATED
    except ImportError as exc:
        print(f"  flashhopper.hopper is not available yet ({exc}); nothing to inspect.", flush=True)
        return 0
    failures = 0
    for name in sorted(KERNELS):
        start = time.perf_counter()
        try:
            r = inspect_kernel(name, dtype="bf16", hdim=128, causal=False)
        except Exception as exc:  # report and go on to the next kernel
            print(f"  {name}: FAILED: {type(exc).__name__}: {exc}", flush=True)
            failures += 1
            continue
        s = r["sass"]
        print(
            f"  {name}: {r['registers']} regs (setmaxnreg {s['USETMAXREG'] or '-'}), "
            f"spill {r['spill_bytes']} B, smem {r['smem_bytes'] / 1024:.1f} KiB, "
            f"HGMMA {s['HGMMA']}, UTMALDG {s['UTMALDG']}, UTMASTG {s['UTMASTG']}, UTMAREDG {s['UTMAREDG']}, "
            f"MUFU.EX2 {s['MUFU.EX2']}, LDL/STL {s['LDL']}/{s['STL']} "
            f"({time.perf_counter() - start:.1f} s)"
            + (" [first version: not yet run on a GPU, not dispatched]" if name in NOT_YET_VALIDATED else ""),
            flush=True,
        )
    return failures


def _reference_check() -> int:
    batch, seqlen, heads, hdim, causal = 2, 256, 4, 64, True
    shape = f"b={batch}, s={seqlen}, h={heads}, d={hdim}, causal"
    print(f"\n== Reference attention on CPU ({shape}) ==", flush=True)
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(batch, seqlen, heads, hdim, generator=gen) for _ in range(4))
    attention_bwd_ref(q[:, :8], k[:, :8], v[:, :8], dout[:, :8])  # first-call setup out of the timing

    start = time.perf_counter()
    out, lse = attention_ref(q, k, v, causal=causal)
    dq, dk, dv = attention_bwd_ref(q, k, v, dout, causal=causal)
    t_exact = time.perf_counter() - start

    start = time.perf_counter()
    out_t, lse_t = attention_tiled_fwd(q, k, v, 128, 128, causal=causal)
    grads_t = attention_tiled_bwd(q, k, v, out_t, dout, lse_t, 128, 128, causal=causal)
    t_tiled = time.perf_counter() - start

    errors = {
        "out": _max_err(out_t, out), "lse": _lse_err(lse_t, lse),
        "dq": _max_err(grads_t[0], dq), "dk": _max_err(grads_t[1], dk), "dv": _max_err(grads_t[2], dv),
    }
    print(f"  exact float64 fwd+bwd: {t_exact * 1e3:.0f} ms; tiled float32 (128x128 blocks): "
          f"{t_tiled * 1e3:.0f} ms", flush=True)
    print("  tiled vs exact, max abs error: " + ", ".join(f"{k} {e:.1e}" for k, e in errors.items()))
    bad = [name for name, e in errors.items() if not e <= TILED_TOL]
    print(f"  {'FAILED: ' + ', '.join(bad) if bad else 'OK'} (tolerance {TILED_TOL:g})", flush=True)
    return len(bad)


def _accuracy_row(hdim: int, causal: bool) -> str:
    from flashhopper.interface import flash_attn_func

    q, k, v = (torch.randn(2, 1000, 8, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    ref, ref_lse = attention_ref(q, k, v, causal=causal)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
    errs = (_max_err(out, ref), _max_err(sdpa, ref), _mean_err(out, ref), _mean_err(sdpa, ref),
            _lse_err(lse, ref_lse))
    return f"{hdim:>4} {str(causal):>6} " + " ".join(f"{e:>9.2e}" for e in errs)


def _gpu_demo() -> int:
    print(f"Hopper GPU: {torch.cuda.get_device_name()}\n", flush=True)
    print("== flash_attn_func (sm_90a kernel) vs float64 reference, bf16, b=2 s=1000 h=8 ==", flush=True)
    # The max error is usually the bf16 rounding of the largest output, the same for any correct
    # kernel; the mean error is what separates a careful kernel from a sloppy one.
    print(f"{'hdim':>4} {'causal':>6} {'max err':>9} {'SDPA max':>9} {'mean err':>9} {'SDPA mean':>9} "
          f"{'lse err':>9}", flush=True)
    failures = 0
    for hdim in (64, 128, 256):
        for causal in (False, True):
            try:
                print(_accuracy_row(hdim, causal), flush=True)
            except Exception as exc:  # report and go on to the other shapes
                print(f"{hdim:>4} {str(causal):>6}  FAILED: {type(exc).__name__}: {exc}", flush=True)
                failures += 1
    print("\n== Speed (forward) ==", flush=True)
    from flashhopper.bench.grid import make_point
    from flashhopper.bench.runner import run_bench

    run_bench([make_point(s, 128, c) for s in (1024, 8192) for c in (False, True)])
    return 1 if failures else 0
