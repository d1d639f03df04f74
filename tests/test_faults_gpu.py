"""The GPU suite catches a broken kernel: each deliberate fault of runtime.fault, run through the
suite's own checks (test_fwd_gpu.run_case / test_bwd_gpu.run_case and the rule of flashhopper/accuracy.py),
must fail them; without the fault the same cases pass."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)

import test_bwd_gpu  # noqa: E402
import test_fwd_gpu  # noqa: E402

from flashhopper.hopper import runtime  # noqa: E402

FWD_CASE = (2, 300, 517, 4, 2, 128)  # no mask: a query row's output does not depend on sq
BWD_CASE = (2, 300, 517, 4, 2, 64)


@pytest.mark.parametrize("fault", [None, "wrong_scale", "unwritten_row"])
def test_forward_faults_fail_the_suite(fault, monkeypatch):
    monkeypatch.setattr(runtime, "fault", fault)
    if fault is None:
        test_fwd_gpu.run_case(*FWD_CASE)
        return
    with pytest.raises(AssertionError):
        test_fwd_gpu.run_case(*FWD_CASE)


@pytest.mark.parametrize("fault", [None, "dv_key_block", "stale_workspace"])
def test_backward_faults_fail_the_suite(fault, monkeypatch):
    monkeypatch.setattr(runtime, "fault", fault)
    if fault is None:
        test_bwd_gpu.run_case(*BWD_CASE)
        return
    with pytest.raises(AssertionError):
        test_bwd_gpu.run_case(*BWD_CASE)
