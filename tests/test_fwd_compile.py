"""Every forward variant we dispatch compiles for sm_90a without a GPU, with the structure the
design needs visible in its SASS and no register spills."""

from __future__ import annotations

import pytest

from flashhopper.compile import inspect_kernel
from flashhopper.config import SMEM_CAPACITY, SUPPORTED_HDIMS

MASKS = {
    "none": {},
    "causal": {"causal": True},
    "local": {"local": True},
    "softcap": {"softcap": True},
}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("hdim", SUPPORTED_HDIMS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_forward_variant_compiles(dtype, hdim, mask):
    report = inspect_kernel("fwd", dtype=dtype, hdim=hdim, **MASKS[mask])
    sass = report["sass"]
    assert sass["HGMMA"] > 0 and sass["QGMMA"] == 0
    assert sass["UTMALDG"] >= 3  # Q, K, V
    assert sass["UTMASTG"] >= 1  # O
    assert sass["SYNCS"] > 0  # mbarrier pipelines
    regs = sass["USETMAXREG"]
    assert min(regs) <= 56 and max(regs) >= 160, regs  # producer gives back, consumers take
    assert sass["LDL"] == 0 and sass["STL"] == 0 and report["spill_bytes"] == 0
    assert report["smem_bytes"] <= SMEM_CAPACITY
    assert (sass["MUFU.TANH"] > 0) == (mask == "softcap")
