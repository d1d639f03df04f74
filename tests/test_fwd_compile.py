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
    assert sass["HGMMA_WAITS"] == _commit_groups(**MASKS[mask]), "ptxas serialized the WGMMAs"


def _commit_groups(causal=False, local=False, softcap=False):
    """One WGMMA wait per commit group: the peeled first QK^T, QK^T and P @ V in each of the
    mainloop's runs (edge-crossing blocks with causal/local, mask-free, left-window with local),
    and the last P @ V."""
    return 2 + 2 * (1 + (causal or local) + local)


@pytest.mark.parametrize("tile_n", [144, 160, 176])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_forward_wide_key_tiles(dtype, tile_n):
    """hdim 128 with the key-block widths scripts/tune_fwd.py times (FA3 runs 128 x 176): P has
    72-88 elements per thread, whose conversion must not leave 16-bit halves to be packed in
    front of each P @ V WGMMA (ptxas then waits on every one of them)."""
    report = inspect_kernel("fwd", dtype=dtype, hdim=128, tile_n=tile_n)
    sass = report["sass"]
    assert sass["HGMMA"] == 2 * (128 // 16 + tile_n // 16)
    assert sass["HGMMA_WAITS"] == _commit_groups()
    assert sass["LDL"] == 0 and sass["STL"] == 0 and report["spill_bytes"] == 0
    assert report["smem_bytes"] <= SMEM_CAPACITY
