"""The first backward kernel compiles for sm_90a without a GPU, with its structure in SASS.

It has not been run on a GPU yet (see flashhopper/hopper/bwd.py). hdim 128 spills 24-32 bytes
without a causal/local mask, so there only the masked variants must be spill-free.
"""

from __future__ import annotations

import pytest

from flashhopper.compile import inspect_kernel
from flashhopper.config import SMEM_CAPACITY

MASKS = {"none": {}, "causal": {"causal": True}, "local": {"local": True}, "softcap": {"softcap": True}}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_backward_hdim64_compiles_without_spills(dtype, mask):
    report = inspect_kernel("bwd", dtype=dtype, hdim=64, **MASKS[mask])
    sass = report["sass"]
    # per query block: S^T, dP^T, dV, dK (64x64) and dQ (64x32 per warpgroup) WGMMAs
    assert sass["HGMMA"] >= 24
    assert sass["UTMALDG"] >= 4  # K, V, Q, dO
    assert sass["SYNCS"] > 0
    assert min(sass["USETMAXREG"]) <= 56 and max(sass["USETMAXREG"]) >= 160
    assert sass["LDL"] == 0 and sass["STL"] == 0 and report["spill_bytes"] == 0
    assert report["smem_bytes"] <= SMEM_CAPACITY
    assert (sass["MUFU.TANH"] > 0) == (mask == "softcap")


@pytest.mark.parametrize("mask", list(MASKS))
def test_backward_hdim128_compiles(mask):
    report = inspect_kernel("bwd", dtype="bf16", hdim=128, **MASKS[mask])
    assert report["sass"]["HGMMA"] >= 24
    if mask in ("causal", "local"):
        assert report["spill_bytes"] == 0
