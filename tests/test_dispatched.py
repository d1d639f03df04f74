"""Every kernel a user can reach (flashhopper.plan.dispatched_kernels: 92 bf16 / fp16, 30 e4m3, 3 e4m3
without the LSE (the tensor cores' row sums) and 30 e4m3 with per-token q / k descales, 60 varlen and 24
(192, 128) forward, 130 + 120 varlen backward, 10 + 10 varlen preprocess configs and 2 + 2 of (192, 128),
whose backward runs hdim 192's main kernel)
compiles for sm_90a without a GPU with its structure in SASS: WGMMA (or the preprocess's 16-byte
loads) present, register hand-off where there are warpgroups to hand off to, no local memory, no
spill, the shared memory its launch requests (read from the compiled host code) within the SM's
capacity, and the block of the config's warpgroups.

`make test` compiles a covering subset: configs taken in the planner's order while each adds a value
not yet covered of one of its class's fields in plan.COVER (head dim, dtype, mask kind, softcap,
deterministic, tiles, stages, schedule): every hdim, dtype, mask kind and schedule at least once.
`make test-full` (FH_TEST_FULL=1) compiles every one; run it before a kernel change lands.
"""

from __future__ import annotations

import os

import pytest
from smem_check import assert_smem

from flashhopper.compile import ensure_arch_env, inspect_cubin
from flashhopper.config import BwdConfig, BwdPreConfig, FwdConfig
from flashhopper.plan import covering_subset, dispatched_kernels, features

ensure_arch_env()

ALL = dispatched_kernels()
FULL = os.environ.get("FH_TEST_FULL") == "1"


CHOSEN = ALL if FULL else covering_subset(ALL)


def test_the_set_is_what_users_reach():
    kinds = [type(c) for c in ALL]
    counts = (kinds.count(FwdConfig), kinds.count(BwdConfig), kinds.count(BwdPreConfig))
    # forward: dense, e4m3 (per-head descales with and without the LSE, per-token), varlen, (192, 128) dense +
    # varlen; backward and its preprocess: dense + varlen, and (192, 128)'s preprocess (D over 128 columns)
    # dense + varlen
    assert counts == (92 + 30 + 3 + 30 + 60 + 24, 130 + 120, 10 + 10 + 2 + 2)
    assert len(set(ALL)) == len(ALL)
    subset = covering_subset(ALL)
    assert set().union(*map(features, subset)) == set().union(*map(features, ALL))
    assert len(subset) < len(ALL) // 3


def _id(cfg) -> str:  # stable across processes (pytest-xdist workers must collect the same ids)
    return f"{type(cfg).__name__}-{cfg.dtype}-{cfg.hdim}-{ALL.index(cfg)}"


@pytest.mark.parametrize("cfg", CHOSEN, ids=_id)
def test_dispatched_kernel_compiles_clean(cfg):
    from flashhopper.hopper.runtime import kernel_cubin, kernel_launch

    launch = kernel_launch(cfg)  # what the compiled host code asks of the launch
    report = inspect_cubin(kernel_cubin(cfg), smem_bytes=launch["smem"])
    sass = report["sass"]
    assert sass["LDL"] == 0 and sass["STL"] == 0 and report["spill_bytes"] == 0, repr(cfg)
    if isinstance(cfg, BwdPreConfig):
        assert sass["LDG.128"] > 0 and launch["smem"] == 0
        return
    assert launch["block"] == [128 * (1 + cfg.num_consumer_wg), 1, 1], (repr(cfg), launch)  # + producer
    assert_smem(report, cfg)
    assert sass["HGMMA"] + sass["QGMMA"] > 0 and sass["UTMALDG"] >= 3 and sass["SYNCS"] > 0, repr(cfg)
    assert (sass["QGMMA"] > 0) == (cfg.dtype == "e4m3") and (sass["HGMMA"] > 0) != (cfg.dtype == "e4m3")
    assert (sass["MUFU.TANH"] > 0) == cfg.softcap, repr(cfg)
    regs = sass["USETMAXREG"]
    assert min(regs) < max(regs), (repr(cfg), regs)  # the producer gives registers to the consumers
