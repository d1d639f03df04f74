"""`flashhopper fp8-accuracy`: how much FP8 costs, measured against float64.

1. FlashAttention-3's Table 3 protocol: Q, K, V standard normal with 0.1% of the entries 10x larger,
   RMSE of the output against a float64 reference: bf16 inputs; e4m3 with one scale per tensor, per
   (batch, kv head), per (batch, kv head) after the Hadamard rotation of Q and K (flashhopper.fp8).
2. Error against sequence length on inputs that expose FP8 WGMMA's reduced-precision accumulation
   (vllm#23813): V = 1 + N(0, 1) (a nonzero mean, which zero-mean V hides) and peaked attention; the
   relative RMSE of the output at each length, the float64 reference blocked over queries so that
   128k fits.
"""

from __future__ import annotations

import math

import torch

from flashhopper import fp8
from flashhopper.reference import attention_ref, dequantize_fp8

TABLE3_SHAPE = (2, 4096, 16, 128)  # batch, seqlen, heads, head dim
SEQLENS = (1024, 4096, 16384, 65536, 131072)


def _outlier_inputs(shape, seed=0, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(3):
        x = torch.randn(*shape, device=device, generator=g)
        big = torch.rand(*shape, device=device, generator=g) < 1e-3
        out.append(torch.where(big, 10 * x, x))
    return out


def _rmse(x, ref) -> float:
    return (x.double() - ref).pow(2).mean().sqrt().item()


def _run_fp8(q, k, v, granularity, rotate, causal):
    from flashhopper import flash_attn_func

    if rotate:
        q, k = fp8.hadamard(q), fp8.hadamard(k)
    (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize(t, granularity, heads_k=k.shape[2]) for t in (q, k, v))
    return flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)


def table3(shape=TABLE3_SHAPE, causal=False, seed=0, device="cuda") -> list[dict]:
    """RMSE against float64 of each way to run the same outlier inputs."""
    from flashhopper import flash_attn_func

    q, k, v = _outlier_inputs(shape, seed, device)
    ref = attention_ref(q, k, v, causal=causal)[0]
    rows = [("bf16", flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=causal))]
    for name, granularity, rotate in (("fp8 per-tensor", "tensor", False), ("fp8 per-head", "head", False),
                                      ("fp8 per-head + Hadamard", "head", True)):
        rows.append((name, _run_fp8(q, k, v, granularity, rotate, causal)))
    return [{"variant": name, "rmse": _rmse(out, ref)} for name, out in rows]


def _blocked_ref(q, k, v, causal, block=2048):
    """float64 attention, query block by query block (each block sees every key at once)."""
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    sq, sk = q.shape[1], k.shape[1]
    for start in range(0, sq, block):
        stop = min(sq, start + block)
        if causal:  # this block's last query sees keys up to stop - 1 + sk - sq
            keys = stop + sk - sq
            sub = attention_ref(q[:, start:stop], k[:, :keys], v[:, :keys], causal=True)[0]
        else:
            sub = attention_ref(q[:, start:stop], k, v)[0]
        out[:, start:stop] = sub
    return out


def seqlen_sweep(seqlens=SEQLENS, heads=2, hdim=128, causal=False, seed=0, device="cuda") -> list[dict]:
    """Relative RMSE of the FP8 output (per-head scales) against float64 at each length, on V = 1 + N(0,1)
    and scores peaked by a shared direction in Q and K."""
    rows = []
    for n in seqlens:
        g = torch.Generator(device=device).manual_seed(seed + n)
        u = torch.nn.functional.normalize(torch.randn(hdim, device=device, generator=g), dim=0)
        q = torch.randn(1, n, heads, hdim, device=device, generator=g) + 2.0 * u
        k = torch.randn(1, n, heads, hdim, device=device, generator=g) + 2.0 * u
        v = 1.0 + torch.randn(1, n, heads, hdim, device=device, generator=g)
        (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize(t) for t in (q, k, v))
        from flashhopper import flash_attn_func

        out = flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)
        ref = _blocked_ref(*dequantize_fp8(q8, k8, v8, (qd, kd, vd)), causal)
        rows.append({"seqlen": n, "relative_rmse": _rmse(out, ref) / ref.pow(2).mean().sqrt().item()})
        del q, k, v, out, ref
        torch.cuda.empty_cache()
    return rows


def format_rows(rows: list[dict]) -> list[str]:
    keys = list(rows[0])
    lines = [" | ".join(keys), " | ".join("---" for _ in keys)]
    for row in rows:
        lines.append(" | ".join(f"{v:.3g}" if isinstance(v, float) and not math.isnan(v) else str(v)
                                for v in row.values()))
    return lines
