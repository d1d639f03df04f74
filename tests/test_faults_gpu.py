"""The GPU suite catches a broken kernel: each deliberate fault of tests/faults.py, run through the
suite's own checks (test_fwd_gpu.run_case / test_bwd_gpu.run_case and the rule of
flashhopper/accuracy.py), must fail them; without the fault the same cases pass."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)

import faults  # noqa: E402
import test_bwd_gpu  # noqa: E402
import test_fwd_gpu  # noqa: E402

from flashhopper.hopper import runtime  # noqa: E402

FWD_CASE = (2, 300, 517, 4, 2, 128)  # no mask: a query row's output does not depend on sq
BWD_CASE = (2, 300, 517, 4, 2, 64)


@pytest.mark.parametrize(("run_case", "case", "fault"), [
    *((test_fwd_gpu.run_case, FWD_CASE, f) for f in (None, *faults.FORWARD)),
    *((test_bwd_gpu.run_case, BWD_CASE, f) for f in (None, *faults.BACKWARD))])
def test_faults_fail_the_suite(run_case, case, fault, monkeypatch):
    if fault is None:
        run_case(*case)
        return
    faults.inject(monkeypatch, runtime, fault)
    with pytest.raises(AssertionError):
        run_case(*case)
