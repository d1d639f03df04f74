"""Which calls can be captured in a CUDA graph (torch.cuda.graph): each case in its own process,
since a failed capture can leave the process unusable. Session 28: the tiny training step of
host_overhead.py --graph failed to capture while tests/test_torch_compile_gpu.py's step did.

    source .device/setup.sh && PYTHONPATH=$PWD python3 scripts/graph_capture_probe.py [CASE...]
"""
import subprocess
import sys

import torch

CASES = {  # name: (b, sq, sk, h, hk, d, grad, backward, kwargs, config overrides)
    "fwd_nograd_h64": (1, 128, 128, 1, 1, 64, False, False, {}, {}),
    "fwd_grad_h64": (1, 128, 128, 1, 1, 64, True, False, {}, {}),
    "step_h64": (1, 128, 128, 1, 1, 64, True, True, {}, {}),
    "step_h64_static_sched": (1, 128, 128, 1, 1, 64, True, True, {}, {"dynamic_sched": False}),
    "step_h64_det": (1, 128, 128, 1, 1, 64, True, True, {"deterministic": True}, {}),
    "step_h128_test": (2, 700, 333, 4, 2, 128, True, True, {"causal": True, "deterministic": True}, {}),
    "step_h128_test_nondet": (2, 700, 333, 4, 2, 128, True, True, {"causal": True}, {}),
    "step_h128_tiny": (1, 128, 128, 1, 1, 128, True, True, {}, {}),
    # the leaves first used in a differentiable op (a view) on the legacy default stream, before the
    # warm-up: autograd then hands their gradients to that stream; ours and SDPA's (FA2)
    "step_h64_views_first": (1, 128, 128, 1, 1, 64, True, True, {"views_first": True}, {}),
    "sdpa_step_h64_views_first": (1, 128, 128, 1, 1, 64, True, True, {"views_first": True, "sdpa": True}, {}),
    "sdpa_step_h64": (1, 128, 128, 1, 1, 64, True, True, {"sdpa": True}, {}),
}


def run_case(name):
    sys.path.insert(0, ".")
    from flashhopper import flash_attn_func
    from flashhopper.hopper import runtime

    b, sq, sk, h, hk, d, grad, backward, kwargs, overrides = CASES[name]
    kwargs = dict(kwargs)
    views_first, use_sdpa = kwargs.pop("views_first", False), kwargs.pop("sdpa", False)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
            for _ in range(2))
    w = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)

    # kept alive: a leaf holds its gradient accumulator weakly, so dropped views would let the
    # accumulator be made again (on the warm-up's stream)
    views = [t.transpose(1, 2) for t in (q, k, v)] if views_first else []

    def attn(q, k, v):
        if use_sdpa:
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                views = (t.transpose(1, 2) for t in (q, k, v))
                out = torch.nn.functional.scaled_dot_product_attention(*views)
            return out.transpose(1, 2)
        return flash_attn_func(q, k, v, **kwargs)

    def fn():
        out = attn(q, k, v)
        if backward:
            return torch.autograd.grad((out * w).sum(), (q, k, v))
        return out

    with runtime.config_overrides(**overrides):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        assert views_first == bool(views)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        torch.cuda.synchronize()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        run_case(sys.argv[2])
        sys.exit(0)
    for name in sys.argv[1:] or CASES:
        r = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True)
        log = (r.stdout + r.stderr).splitlines()
        lines = [ln for ln in log if "Error" in ln or "error" in ln]
        where = [ln.strip() for ln in log if 'File "' in ln and "flashhopper" in ln]
        detail = ""
        if r.returncode:
            detail = (f" | {lines[0][:160] if lines else '-'} | last flashhopper frame: "
                      f"{where[-1][:160] if where else '-'}")
        print(f"{name}: {'captured' if r.returncode == 0 else 'FAILED'}{detail}", flush=True)
