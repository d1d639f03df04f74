"""First-call compile time and per-call host overhead of flash_attn_func on a tiny problem; with
--sdpa, the tiny training step and a forward without grad against PyTorch's SDPA (FA2) taking turns;
with --bwd, that and the backward's host time per call (runtime.backward at hdim 64 / 128 / 256, tiny
and grid-sized), cProfiles and the torch profiler's op table of the step; with --graph, the tiny step
captured in a CUDA graph, ours and SDPA's, replayed (host time and back-to-back period).

    source .device/setup.sh && PYTHONPATH=$PWD python3 scripts/host_overhead.py [--sdpa | --bwd | --graph]

(docs/decisions.md): 42-73 us of host time per backward call, the step at 1.8x SDPA's.
the captured step replays in 16.2 us back to back (SDPA's 20.1), 3.8 us of host time.
"""
import cProfile
import io
import math
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from flashhopper import flash_attn_func  # noqa: E402
from flashhopper.config import FwdConfig  # noqa: E402
from flashhopper.hopper import kernel_cache, runtime  # noqa: E402


def host_us(fn, n=500) -> float:
    """Host time per call with the launch queue far from full (no sync inside the loop)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


def forward_overhead():
    q, k, v = (torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    t0 = time.perf_counter()
    flash_attn_func(q, k, v)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for _ in range(50):
        flash_attn_func(q, k, v)
    torch.cuda.synchronize()
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        flash_attn_func(q, k, v)
    host = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        flash_attn_func(q, k, v)
    end.record()
    torch.cuda.synchronize()
    per_call = start.elapsed_time(end) / n * 1e3
    print(f"first call (trace + compile + launch): {first:.2f} s; compile alone: "
          f"{sum(kernel_cache.compile_seconds.values()):.2f} s")
    print(f"per-call host time (no sync, tiny problem): {host * 1e6:.1f} us; "
          f"back-to-back period {per_call:.1f} us")
    # the launch alone: the DSL's compiled function (a kwargs wrapper in front) against its raw
    # tvm_ffi.Function, same positional arguments
    cfg, entry = next((key, e) for key, e in kernel_cache._memory.items() if isinstance(key, FwdConfig))
    fn = entry.fn
    seen = []
    entry.fn = lambda *a: seen.append(a)  # the arguments runtime.forward launches with
    runtime.forward(q, k, v, 0.125, False, (-1, -1), 0.0)
    entry.fn = fn
    args = seen[0]
    raw = fn.__tvm_ffi_object__() if hasattr(fn, "__tvm_ffi_object__") else fn
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    print(f"launch: compiled function {host_us(lambda: fn(*args)):.1f} us, raw tvm_ffi.Function "
          f"{host_us(lambda: raw(*args)):.1f} us, raw with q, k, v requiring grad "
          f"{host_us(lambda: raw(qg, kg, vg, *args[3:])):.1f} us", flush=True)


def backward_overhead():
    shapes = [(1, 128, 1), (8, 512, 8)]  # tiny; a 512-token grid point's shape at a smaller batch
    for d in (64, 128, 256):
        for causal in (False, True):
            for b, s, h in shapes:
                q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                scale = 1 / math.sqrt(d)
                out, lse = runtime.forward(q, k, v, scale, causal, (-1, -1), 0.0)

                def call(q=q, k=k, v=v, out=out, do=do, lse=lse, scale=scale, causal=causal):
                    return runtime.backward(q, k, v, out, do, lse, scale, causal, (-1, -1), 0.0)

                n = 100 if s > 128 else 500
                print(f"backward host time, hdim {d} causal {causal!s:>5} (b, s, h) = {(b, s, h)}: "
                      f"{host_us(call, n):7.1f} us a call", flush=True)


def tiny_step():
    """The tiny problem's leaves, its output gradient and one training step's attention through autograd."""
    q, k, v = (torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)

    def step():
        out = flash_attn_func(q, k, v)
        return torch.autograd.grad(out, (q, k, v), do)

    return q, k, v, do, step


def against_sdpa():
    """Host time of the tiny step and of a forward without grad, ours and SDPA's (FA2) taking turns."""
    q, k, v, do, step = tiny_step()
    qd, kd, vd = (t.detach() for t in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # SDPA's (b, h, s, d) views of the same leaves
    qdt, kdt, vdt = (t.transpose(1, 2) for t in (qd, kd, vd))
    dot = do.transpose(1, 2)

    def sdpa_step():
        return torch.autograd.grad(sdpa(qt, kt, vt), (q, k, v), dot)

    # the host is shared and its speed drifts: 5 rounds, medians
    pairs = {"step": (step, sdpa_step),
             "forward, no grad": (lambda: flash_attn_func(qd, kd, vd), lambda: sdpa(qdt, kdt, vdt))}
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        for name, (ours, theirs) in pairs.items():
            times = [(host_us(ours, 200), host_us(theirs, 200)) for _ in range(5)]
            print(f"{name}: flashhopper {statistics.median(t[0] for t in times):.1f} us, SDPA (FA2) "
                  f"{statistics.median(t[1] for t in times):.1f} us a call (medians of 5 rounds)", flush=True)


def step_profiles():
    """Where the tiny step's host time goes: GPU period, cProfile, the torch profiler's op table; then
    cProfiles of runtime.backward / runtime.forward and the cost of an allocation, a fill, a cast."""
    q, k, v, do, step = tiny_step()
    with torch.no_grad():
        out, lse = runtime.forward(q, k, v, 0.125, False, (-1, -1), 0.0)

    def bwd():
        return runtime.backward(q, k, v, out, do, lse, 0.125, False, (-1, -1), 0.0)

    qd, kd, vd = (t.detach() for t in (q, k, v))

    def bwd_detached():
        return runtime.backward(qd, kd, vd, out, do, lse, 0.125, False, (-1, -1), 0.0)

    print(f"torch {torch.__version__}, DLPack C exchange API: "
          f"{hasattr(torch.Tensor, '__dlpack_c_exchange_api__')}", flush=True)
    print(f"GPU period back to back: step {gpu_us(step):.1f} us, runtime.backward alone {gpu_us(bwd):.1f} us"
          f" (host {host_us(bwd):.1f} us; q, k, v detached {host_us(bwd_detached):.1f} us)", flush=True)
    profile("autograd step (tiny, hdim 64)", step)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(50):
            step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), flush=True)
    # the Python side of runtime.backward / runtime.forward (hdim 256, tiny problem)
    q, k, v, do = (torch.randn(1, 128, 1, 256, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = runtime.forward(q, k, v, 1 / 16, False, (-1, -1), 0.0)
    profile("runtime.backward", lambda: runtime.backward(q, k, v, out, do, lse, 1 / 16, False, (-1, -1), 0.0))
    profile("runtime.forward", lambda: runtime.forward(q, k, v, 1 / 16, False, (-1, -1), 0.0))
    acc = torch.empty(q.shape, dtype=torch.float32, device="cuda")
    f32 = {"dtype": torch.float32, "device": "cuda"}
    print(f"torch.empty (b, h, s) fp32: {host_us(lambda: torch.empty((1, 1, 128), **f32)):.1f} us; "
          f"torch.zeros: {host_us(lambda: torch.zeros((1, 1, 128), **f32)):.1f} us; "
          f"fp32 -> bf16 .to(): {host_us(lambda: acc.to(torch.bfloat16)):.1f} us", flush=True)


def graph_steps():
    """The tiny step captured in a CUDA graph, ours and SDPA's (FA2), replayed: a replay's host time
    and the back-to-back period, against the eager step's period, 5 rounds taking turns."""
    q, k, v, do, step = tiny_step()
    dot = do.transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    # SDPA's (b, h, s, d) views are made inside its step: a leaf's first differentiable use fixes the
    # stream autograd hands its gradient to, and views made here, on the legacy default stream, made
    # the capture fail in the autograd engine ("operation would make the legacy stream depend on a
    # capturing blocking stream")
    def sdpa_step():
        out = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return torch.autograd.grad(out, (q, k, v), dot)

    steps = {"flashhopper": step, "SDPA (FA2)": sdpa_step}
    graphs = {}
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        for name, fn in steps.items():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture, as PyTorch's recipe asks
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            graphs[name] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[name]):
                fn()
        rows = {name: [] for name in steps}
        for _ in range(5):
            for name, fn in steps.items():
                g = graphs[name]
                rows[name].append((host_us(g.replay, 200), gpu_us(g.replay), gpu_us(fn)))
    for name, times in rows.items():
        host, period, eager = (statistics.median(t[i] for t in times) for i in range(3))
        print(f"graph step: {name} replay {host:.1f} us host, {period:.1f} us period; eager step period "
              f"{eager:.1f} us (medians of 5 rounds)", flush=True)


def gpu_us(fn, n=200) -> float:
    """Back-to-back period per call by CUDA events: the GPU's time when the host keeps up."""
    for _ in range(20):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1e3


def profile(name, fn, n=300):
    host_us(fn, 50)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
    print(f"--- cProfile of {n} calls of {name}")
    print(text.getvalue(), flush=True)


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv):
        print(__doc__)
        sys.exit(0)
    forward_overhead()
    if "--sdpa" in sys.argv or "--bwd" in sys.argv:
        against_sdpa()
    if "--bwd" in sys.argv:
        backward_overhead()
        step_profiles()
    if "--graph" in sys.argv:
        graph_steps()
