"""`flashhopper fp8-accuracy`: how much FP8 costs, measured against float64.

1. FlashAttention-3's Table 3 protocol: Q, K, V standard normal with 0.1% of the entries 10x larger,
   RMSE of the output against a float64 reference: bf16 inputs; e4m3 with one scale per tensor, per
   (batch, kv head), per block of 128 rows of Q and of K (V per (batch, kv head)), per block after the
   Hadamard rotation of Q and K (flashhopper.fp8); and cuDNN's FP8 SDPA on the per-tensor inputs where
   the cudnn Python frontend runs here (its O in e4m3, the only O it writes on Hopper).
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
    (q8, qd), (k8, kd) = (fp8.quantize(t, granularity, heads_k=k.shape[2]) for t in (q, k))
    v8, vd = fp8.quantize(v, "tensor" if granularity == "tensor" else "head")  # V: per (batch, kv head)
    return flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd)


def _run_cudnn(q, k, v, causal):
    """cuDNN's FP8 SDPA (the cudnn frontend's sdpa_fp8, bench/providers.py's graph) on per-tensor e4m3
    inputs, O in e4m3 scaled so that its largest magnitude (a first run's Amax_O) maps to 448, then
    dequantized; None where the frontend is not importable or does not take the call."""
    from flashhopper.bench.providers import (
        CUDNN_FP8_SCALES,
        _import_cudnn,
        build_cudnn_fp8_graph,
        heads_first,
    )

    try:
        cudnn = _import_cudnn()
        handle = cudnn.create_handle()
        cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
        (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize(t, "tensor", heads_k=k.shape[2]) for t in (q, k, v))
        graph, ports, size = build_cudnn_fp8_graph(cudnn, handle, q8, k8, causal)
    except Exception as exc:  # Unavailable, or the frontend refusing the graph (its own error types)
        print(f"fp8-accuracy: no cuDNN row ({exc})")
        return None
    workspace = torch.empty(size, device=q.device, dtype=torch.uint8)
    out, amax = torch.empty_like(q8), torch.empty(1, 1, 1, 1, device=q.device)
    scales = {**CUDNN_FP8_SCALES, "descale_q": qd[0, 0].item(), "descale_k": kd[0, 0].item(),
              "descale_v": vd[0, 0].item()}

    def run(scale_o: float):
        pack = {ports[name]: heads_first(t) for name, t in (("q", q8), ("k", k8), ("v", v8), ("o", out))}
        pack.update({ports[name]: torch.full((1, 1, 1, 1), value, device=q.device)
                     for name, value in {**scales, "scale_o": scale_o}.items()})
        pack[ports["amax_o"]] = amax
        graph.execute(pack, workspace, handle=handle)
        torch.cuda.synchronize()

    run(1.0)
    scale_o = fp8.E4M3_MAX / max(amax.item(), 1e-30)
    run(scale_o)
    return out.float() / scale_o


def table3(shape=TABLE3_SHAPE, causal=False, seed=0, device="cuda") -> list[dict]:
    """RMSE against float64 of each way to run the same outlier inputs."""
    from flashhopper import flash_attn_func

    q, k, v = _outlier_inputs(shape, seed, device)
    ref = attention_ref(q, k, v, causal=causal)[0]
    rows = [("bf16", flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=causal))]
    for name, granularity, rotate in (("fp8 per-tensor", "tensor", False), ("fp8 per-head", "head", False),
                                      ("fp8 per-block", "block", False),
                                      ("fp8 per-block + Hadamard", "block", True)):
        rows.append((name, _run_fp8(q, k, v, granularity, rotate, causal)))
    cudnn_out = _run_cudnn(q, k, v, causal)
    if cudnn_out is not None:
        rows.append(("cudnn fp8 per-tensor (e4m3 O)", cudnn_out))
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
