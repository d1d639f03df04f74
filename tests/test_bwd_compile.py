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


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_backward_hdim96_compiles(dtype, mask):
    # the 64-keys-per-warpgroup kernel; K in SW32 so dQ's 48 head-dim columns per warpgroup are
    # whole swizzle atoms (hopper/bwd_layout.py). Softcap spills 8 bytes (1 value, 2 LDL/STL).
    report = inspect_kernel("bwd", dtype=dtype, hdim=96, **MASKS[mask])
    sass = report["sass"]
    assert sass["HGMMA"] >= 24
    assert report["smem_bytes"] <= SMEM_CAPACITY
    assert report["spill_bytes"] <= (8 if mask == "softcap" else 0)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("hdim", [192, 256])
def test_backward_wide_hdim_compiles_without_spills(hdim, dtype, mask):
    # dK/dV split by head dim (hopper/bwd_wide.py): 3 consumer warpgroups at 192, 2 at 256
    from flashhopper.config import bwd_config

    cfg = bwd_config(dtype, hdim, **MASKS[mask])
    assert cfg.kv_split == "hdim"
    report = inspect_kernel("bwd", dtype=dtype, hdim=hdim, **MASKS[mask])
    sass = report["sass"]
    # per query block and warpgroup: S and dP (hdim/16 k-blocks each), dV^T and dK^T (64-row M tiles
    # x 4 k-blocks each), dQ (tile_n/16 k-blocks)
    m_tiles = hdim // cfg.num_consumer_wg // 64
    assert sass["HGMMA"] == 2 * (hdim // 16) + 2 * 4 * m_tiles + cfg.tile_n // 16
    assert sass["UTMALDG"] >= 4  # K, V, Q, dO
    assert sass["SYNCS"] > 0
    assert sorted(sass["USETMAXREG"]) == [cfg.producer_regs, cfg.consumer_regs]
    assert sass["LDL"] == 0 and sass["STL"] == 0 and report["spill_bytes"] == 0
    assert report["smem_bytes"] == cfg.smem_bytes() <= SMEM_CAPACITY
    assert (sass["MUFU.TANH"] > 0) == (mask == "softcap")
