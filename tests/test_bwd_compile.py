"""Every backward variant compiles for sm_90a without a GPU, spill-free, with its structure in SASS."""

from __future__ import annotations

import pytest

from flashhopper.compile import inspect_kernel
from flashhopper.config import BWD_HDIMS, SMEM_CAPACITY

MASKS = {"none": {}, "causal": {"causal": True}, "local": {"local": True}, "softcap": {"softcap": True}}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("hdim", BWD_HDIMS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_backward_compiles_without_spills(dtype, hdim, mask):
    report = inspect_kernel("bwd", dtype=dtype, hdim=hdim, **MASKS[mask])
    sass = report["sass"]
    assert sass["HGMMA"] >= 24  # per query block: S^T, dP^T, dV, dK and dQ WGMMAs
    assert sass["HGMMA_WAITS"] <= 6, "ptxas serialized the WGMMAs"  # one per commit group
    assert sass["UTMALDG"] >= 6  # K, V, Q, dO, LSE, D
    assert sass["UTMAREDG"] >= 1  # dQ tiles added into the fp32 accumulator by TMA
    assert sass["UTMASTG"] >= 2  # dK, dV
    assert sass["SYNCS"] > 0
    assert min(sass["USETMAXREG"]) <= 56 and max(sass["USETMAXREG"]) >= 160
    assert sass["LDL"] == 0 and sass["STL"] == 0 and report["spill_bytes"] == 0
    assert report["smem_bytes"] <= SMEM_CAPACITY
    assert (sass["MUFU.TANH"] > 0) == (mask == "softcap")


@pytest.mark.parametrize("hdim", BWD_HDIMS)
def test_deterministic_backward_compiles(hdim):
    report = inspect_kernel("bwd", dtype="bf16", hdim=hdim, local=True, deterministic=True)
    assert report["spill_bytes"] == 0 and report["sass"]["UTMAREDG"] >= 1


@pytest.mark.parametrize("hdim", [64, 96, 128, 192, 256])
def test_backward_preprocess_compiles(hdim):
    from flashhopper.hopper.runtime import compile_bwd_pre

    assert compile_bwd_pre("bf16", hdim, tvm_ffi=False) is not None
