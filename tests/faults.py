"""Deliberate kernel faults for the GPU suite to catch (tests/test_faults_gpu.py), injected by wrapping
runtime.get_kernel: the launch path itself carries no test hook.

- "wrong_scale": the forward's scale 1% off;
- "unwritten_row": the forward launched on all query rows but the last, which keeps its poison
  (for lengths whose last tile keeps a row: the grid is the full length's);
- "dv_key_block": keys 128-255 of dV zeroed after the backward;
- "stale_workspace": the backward's preprocess not run, so the main kernel reads LSE / D rows and a
  dQ accumulator nobody wrote.
"""

from __future__ import annotations

from flashhopper.config import BwdConfig, BwdPreConfig, FwdConfig

FORWARD = ("wrong_scale", "unwritten_row")
BACKWARD = ("dv_key_block", "stale_workspace")
_DV = 9  # dV's position among the backward kernel's arguments (runtime.backward's launch)


def _faulty_forward(fn, fault: str):
    def launch(q, k, v, out, lse, counter, scale_log2, *rest):
        if fault == "unwritten_row":
            q, out, lse = q[:, :-1], out[:, :-1], lse[:, :, :-1]
        else:
            scale_log2 *= 1.01
        return fn(q, k, v, out, lse, counter, scale_log2, *rest)
    return launch


def _faulty_backward(fn):
    def launch(*args):
        fn(*args)
        dv = args[_DV]
        if not (hasattr(dv, "shape") and dv.shape == args[2].shape and dv is not args[2]):
            raise RuntimeError(f"argument {_DV} of the backward's launch is not dV: update faults._DV")
        dv[:, 128:256] = 0
    return launch


def inject(monkeypatch, runtime, fault: str) -> None:
    """Make runtime's launches carry `fault` for the rest of the test."""
    get = runtime.get_kernel

    def get_kernel(cfg):
        fn = get(cfg)
        if isinstance(cfg, FwdConfig) and fault in FORWARD:
            return _faulty_forward(fn, fault)
        if isinstance(cfg, BwdConfig) and fault == "dv_key_block":
            return _faulty_backward(fn)
        if isinstance(cfg, BwdPreConfig) and fault == "stale_workspace":
            return lambda *args: None
        return fn

    monkeypatch.setattr(runtime, "get_kernel", get_kernel)
