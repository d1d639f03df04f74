"""Split-KV decode's merge kernel (hopper/combine.py) compiles for sm_90a without a GPU: no local memory,
no spill, its vector copies (cp.async of 16 bytes) in SASS, the block of its warps; and what the runtime
hands it (runtime.combine_config). CI compiles two configs (the kvcache's bf16 one, and fp32 partials of
3 vectors a lane into fp16); FH_TEST_FULL=1 every one `flashhopper precompile --decode` builds and the
fp32 outputs."""

from __future__ import annotations

import os

import pytest
import torch

from flashhopper.compile import ensure_arch_env, inspect_cubin
from flashhopper.config import CombineConfig
from flashhopper.hopper import combine_config
from flashhopper.plan import combine_kernels

ensure_arch_env()

FULL = os.environ.get("FH_TEST_FULL") == "1"
CI = [CombineConfig("bf16", 128, "bf16"), CombineConfig("fp32", 96, "fp16")]
ALL = combine_kernels() + [CombineConfig(dt, dv, "fp32") for dt in ("bf16", "fp16") for dv in (64, 128, 256)]


@pytest.mark.parametrize("cfg", ALL if FULL else CI, ids=repr)
def test_combine_compiles_clean(cfg):
    from flashhopper.hopper.combine import WARPS
    from flashhopper.hopper.runtime import kernel_cubin, kernel_launch

    launch = kernel_launch(cfg)
    report = inspect_cubin(kernel_cubin(cfg), smem_bytes=launch["smem"])
    sass = report["sass"]
    assert sass["LDL"] == 0 and sass["STL"] == 0 and report["spill_bytes"] == 0, repr(cfg)
    assert launch["block"] == [32 * WARPS, 1, 1] and 0 < launch["smem"] <= 16384, launch
    assert sass["LDS"] > 0 and sass["MUFU.EX2"] > 0, sass
    assert sass["ACQBULK"] == sass["PREEXIT"] == int(cfg.pdl)  # CombineConfig.pdl


def test_combine_kernels_are_what_kvcache_launches():
    configs = combine_kernels()
    assert {(c.dtype, c.out_dtype) for c in configs} == {("bf16", "bf16"), ("fp16", "fp16")}
    assert sorted({c.hdim for c in configs}) == [64, 96, 128, 192, 256]  # dv 128 serves (192, 128)
    with pytest.raises(ValueError):
        CombineConfig("e4m3", 128, "bf16").check()
    with pytest.raises(ValueError):
        CombineConfig("bf16", 100, "bf16").check()


def test_combine_config_takes_aligned_rows_only():
    """kvcache's views: the partials (b, splits, rows, heads, dv), the output's unpacking view; a row not of
    whole aligned 16-byte vectors, an unknown dtype or more splits than the kernel reads: None (torch)."""
    o = torch.empty(2 * 3 * 4, 8, 128, dtype=torch.bfloat16).view(2, 3, 4, 8, 128)
    out = torch.empty(2, 1, 32, 128, dtype=torch.bfloat16)
    rows = out[:, 0].unflatten(1, (8, 4)).transpose(1, 2)
    assert combine_config(o, rows, 3) == CombineConfig("bf16", 128, "bf16")
    assert combine_config(o, rows.float(), 3) == CombineConfig("bf16", 128, "fp32")
    assert combine_config(o, rows, 65) is None
    assert combine_config(o, torch.empty(2, 1, 32, 129, dtype=torch.bfloat16)[..., 1:][:, 0].unflatten(
        1, (8, 4)).transpose(1, 2), 3) is None
    assert combine_config(o.to(torch.float64), rows, 3) is None
