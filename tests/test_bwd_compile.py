"""Every backward variant compiles for sm_90a without a GPU, spill-free, with its structure in SASS."""

from __future__ import annotations

import dataclasses

import pytest
from smem_check import assert_smem

from flashhopper import plan
from flashhopper.compile import inspect_kernel
from flashhopper.config import BWD_HDIMS, SMEM_CAPACITY, BwdPreConfig
from flashhopper.hopper.barriers import BwdBarrier, BwdWideBarrier
from flashhopper.plan import BWD_WIDE, BWD_WIDE_ATOMICS, bwd_config

MASKS = {"none": {}, "causal": {"causal": True}, "local": {"local": True}, "softcap": {"softcap": True}}
KEYS_HDIMS = tuple(d for d in BWD_HDIMS if d not in BWD_WIDE)  # hopper/bwd.py (64 keys per warpgroup)


def _keys_hgmma(cfg) -> int:
    """WGMMAs per query block: S^T and dP^T (hdim / 16 k-blocks each), dV and dK (tile_m / 16
    each), dQ (tile_m / 64 M tiles x tile_n / 16 k-blocks; one M tile with dq_by_rows, and for
    dQ^T = K^T dS^T, whose M is the warpgroup's 64 head-dim rows)."""
    dq_m_tiles = 1 if cfg.dq_by_rows or cfg.dq_transposed else cfg.tile_m // 64
    return 2 * cfg.hdim // 16 + 2 * cfg.tile_m // 16 + dq_m_tiles * (cfg.tile_n // 16)


def _bodies(cfg) -> int:
    """Copies of the consumer step in the kernel: with mask_runs the masked and the mask-free one,
    except at hdim 128 + softcap with no right bound, where the mask-free step keeps the key <
    seqlen_k test (hopper/bwd.py) and so is the masked one."""
    if not cfg.mask_runs:
        return 1
    return 1 if cfg.softcap and cfg.hdim >= 128 and not (cfg.causal or cfg.local) else 2


def _check_keys_report(report, cfg, mask):
    sass = report["sass"]
    bodies = _bodies(cfg)
    assert sass["HGMMA"] == bodies * _keys_hgmma(cfg)
    # one wait per commit group: S^T, dP^T, dV (two halves with ds_before_dv), dQ, dK
    assert sass["HGMMA_WAITS"] == bodies * (6 if cfg.ds_before_dv else 5), "ptxas serialized the WGMMAs"
    assert sass["LDL"] == 0 and sass["STL"] == 0 and report["spill_bytes"] == 0
    assert_smem(report, cfg)
    assert (sass["MUFU.TANH"] > 0) == (mask == "softcap")


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("hdim", KEYS_HDIMS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_backward_compiles_without_spills(dtype, hdim, mask):
    cfg = bwd_config(dtype, hdim, **MASKS[mask])
    # hdim 64 runs 128 query rows per step (FA4's order without a mask, dS^T to smem before the dV
    # GEMM with one), hdim 128 80 rows (dS^T before dV), hdim 96 64 rows
    masked = mask in ("causal", "local")
    assert (cfg.tile_m, cfg.dv_after_ds, cfg.ds_before_dv) == {
        64: (128, not masked and mask != "softcap", masked or mask == "softcap"),
        96: (64, False, False), 128: (80, False, True)}[hdim]
    report = inspect_kernel("bwd", dtype=dtype, hdim=hdim, **MASKS[mask])
    _check_keys_report(report, cfg, mask)
    sass = report["sass"]
    assert sass["UTMALDG"] >= 6  # K, V, Q, dO, LSE, D
    assert sass["UTMAREDG"] >= 1  # dQ tiles added into the fp32 accumulator by TMA
    assert sass["UTMASTG"] >= 2  # dK, dV
    assert sass["SYNCS"] > 0
    assert min(sass["USETMAXREG"]) <= 56 and max(sass["USETMAXREG"]) >= 160


@pytest.mark.parametrize("mask", list(MASKS))
def test_backward_hdim64_tile_m64_compiles(mask):
    # the 64-row order (dV issued before dS^T is stored), still reachable with tile_m=64
    cfg = bwd_config("bf16", 64, tile_m=64, **MASKS[mask])
    assert not cfg.ds_before_dv
    _check_keys_report(inspect_kernel("bwd", dtype="bf16", hdim=64, tile_m=64, **MASKS[mask]), cfg, mask)


@pytest.mark.parametrize(("hdim", "tile_m", "mask"), [
    (64, 128, "none"), (64, 128, "softcap"), (64, 64, "local"), (128, 64, "causal")])
def test_backward_double_buffered_ds_compiles(hdim, tile_m, mask):
    # ds_stages=2: one consumer barrier per step instead of two
    cfg = bwd_config("bf16", hdim, tile_m=tile_m, ds_stages=2, **MASKS[mask])
    report = inspect_kernel("bwd", dtype="bf16", hdim=hdim, tile_m=tile_m, ds_stages=2, **MASKS[mask])
    _check_keys_report(report, cfg, mask)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_backward_dq_by_rows_compiles(dtype, mask):
    # hdim 64 (128 rows): dQ split by query rows, one 64 x 64 tile per warpgroup: 8 WGMMAs of
    # N 64 each instead of 16 of N 32, still asynchronous and spill-free (dispatched; here
    # against the head-dim split, both with dK from smem)
    cfg = bwd_config(dtype, 64, dk_rs=False, **MASKS[mask])
    assert cfg.dq_by_rows
    report = inspect_kernel("bwd", dtype=dtype, hdim=64, dk_rs=False, **MASKS[mask])
    _check_keys_report(report, cfg, mask)
    by_cols = _keys_hgmma(dataclasses.replace(cfg, dq_by_rows=False))
    assert report["sass"]["HGMMA"] == _bodies(cfg) * (by_cols - 8)
    assert report["sass"]["UTMAREDG"] >= 1


def test_deterministic_backward_dq_by_rows_compiles():
    cfg = bwd_config("bf16", 64, causal=True, deterministic=True, dq_by_rows=True)
    report = inspect_kernel("bwd", dtype="bf16", hdim=64, causal=True, deterministic=True, dq_by_rows=True)
    assert report["spill_bytes"] == 0 and report["sass"]["UTMAREDG"] >= 1
    assert report["sass"]["HGMMA_WAITS"] == 6 * _bodies(cfg)


def test_backward_dq_by_rows_needs_one_m_tile_per_warpgroup():
    with pytest.raises(ValueError, match="dq_by_rows"):
        bwd_config("bf16", 128, dq_by_rows=True)
    with pytest.raises(ValueError, match="dq_by_rows"):
        bwd_config("bf16", 64, tile_m=64, dq_by_rows=True)
    with pytest.raises(ValueError, match="dq_by_rows"):
        bwd_config("bf16", 256, dq_by_rows=True)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("hdim", [64, 128])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_backward_dk_rs_compiles(dtype, hdim, mask):
    # dK += dS^T Q with dS^T from registers (RS, as dV with P^T): the same WGMMAs and commit groups
    # as the default kernel (hdim 64: dK's first half in dV's first group), still no spills
    cfg = bwd_config(dtype, hdim, dk_rs=True, **MASKS[mask])
    report = inspect_kernel("bwd", dtype=dtype, hdim=hdim, dk_rs=True, **MASKS[mask])
    _check_keys_report(report, cfg, mask)


@pytest.mark.parametrize(("hdim", "fields", "mask"), [
    (96, {}, "none"), (96, {}, "softcap"), (64, {"dq_by_rows": True}, "none"),
    (64, {"dq_by_rows": True}, "causal"), (64, {"tile_m": 64}, "local"), (128, {"ds_stages": 2}, "causal")])
def test_backward_dk_rs_variants_compile(hdim, fields, mask):
    cfg = bwd_config("bf16", hdim, dk_rs=True, **fields, **MASKS[mask])
    report = inspect_kernel("bwd", dtype="bf16", hdim=hdim, dk_rs=True, **fields, **MASKS[mask])
    _check_keys_report(report, cfg, mask)


def test_deterministic_backward_dk_rs_compiles():
    cfg = bwd_config("bf16", 64, causal=True, deterministic=True, dk_rs=True)
    report = inspect_kernel("bwd", dtype="bf16", hdim=64, causal=True, deterministic=True, dk_rs=True)
    assert report["spill_bytes"] == 0 and report["sass"]["LDL"] == 0
    assert report["sass"]["HGMMA_WAITS"] == 6 * _bodies(cfg)


def test_backward_dk_rs_needs_key_split():
    with pytest.raises(ValueError, match="dk_rs"):
        bwd_config("bf16", 256, dk_rs=True)
    with pytest.raises(ValueError, match="dk_rs"):
        bwd_config("bf16", 192, dk_rs=True)


def _dq_boxes(cfg) -> int:
    """TMA reduce-adds per step: one per swizzle-atom column of each dQ part (the smem dQ tile is
    bwd_layout.k_smem_layout: 32 fp32 columns, 16 at hdim 96 where a warpgroup's 48 columns are
    not whole 32-column atoms)."""
    def atom(cols):
        return next(w for w in (32, 16, 8) if cols % w == 0)

    wg = cfg.num_consumer_wg
    width, per_wg = atom(cfg.hdim), cfg.hdim // wg
    if per_wg % width and width % per_wg:
        width = atom(per_wg)
    if not cfg.dq_per_wg:
        return cfg.hdim // width
    return wg * (cfg.hdim if cfg.dq_by_rows else per_wg) // width


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("hdim", [64, 128])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_backward_dq_per_wg_compiles(dtype, hdim, mask):
    # per-warpgroup dQ hand-off (dispatched at hdim 64 / 96 / 128) against the shared one: the
    # consumer loop keeps its WGMMAs, commit groups and its two dQ barrier ops (their ids now in a
    # register); the writer warp waits / arrives once per warpgroup (2 more BAR than the shared
    # pair) and issues each warpgroup's part as its own TMA reduce-add
    cfg = bwd_config(dtype, hdim, dq_per_wg=True, **MASKS[mask])
    report = inspect_kernel("bwd", dtype=dtype, hdim=hdim, dq_per_wg=True, **MASKS[mask])
    _check_keys_report(report, cfg, mask)
    default = inspect_kernel("bwd", dtype=dtype, hdim=hdim, dq_per_wg=False, **MASKS[mask])["sass"]
    sass = report["sass"]
    assert sass["BAR"] == default["BAR"] + 2 * (cfg.num_consumer_wg - 1)
    assert sass["UTMAREDG"] == _dq_boxes(cfg)
    assert default["UTMAREDG"] == _dq_boxes(bwd_config(dtype, hdim, dq_per_wg=False, **MASKS[mask]))
    assert sass["HGMMA"] == default["HGMMA"] and sass["HGMMA_WAITS"] == default["HGMMA_WAITS"]


@pytest.mark.parametrize(("hdim", "fields", "mask"), [
    (96, {}, "none"), (64, {"tile_m": 64}, "causal"), (64, {"dq_by_rows": False}, "none"),
    (128, {"dk_rs": True}, "none"), (128, {"ds_stages": 2}, "causal")])
def test_backward_dq_per_wg_variants_compile(hdim, fields, mask):
    cfg = bwd_config("bf16", hdim, dq_per_wg=True, **fields, **MASKS[mask])
    report = inspect_kernel("bwd", dtype="bf16", hdim=hdim, dq_per_wg=True, **fields, **MASKS[mask])
    _check_keys_report(report, cfg, mask)
    assert report["sass"]["UTMAREDG"] == _dq_boxes(cfg)


@pytest.mark.parametrize(("hdim", "mask"), [(128, "causal"), (64, "local")])
def test_deterministic_backward_dq_per_wg_compiles(hdim, mask):
    cfg = bwd_config("bf16", hdim, deterministic=True, dq_per_wg=True, **MASKS[mask])
    report = inspect_kernel("bwd", dtype="bf16", hdim=hdim, deterministic=True, dq_per_wg=True, **MASKS[mask])
    _check_keys_report(report, cfg, mask)
    assert report["sass"]["UTMAREDG"] == _dq_boxes(cfg)


def test_backward_dq_per_wg_needs_key_split():
    with pytest.raises(ValueError, match="dq_per_wg"):
        bwd_config("bf16", 256, dq_per_wg=True)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_backward_80_rows_compiles(dtype, mask):
    # hdim 128 with FA3 / FA4's 80 query rows per step (dispatched): S^T / dP^T of 64 x 80,
    # dV / dK over 5 k-blocks (2 + 3, ds_before_dv), dQ^T = K^T dS^T as 8 WGMMAs of 64 x 80:
    # 34 WGMMAs in 6 commit groups with 208 accumulator registers, no spills
    cfg = bwd_config(dtype, 128, tile_m=80, **MASKS[mask])
    assert cfg.dq_transposed and cfg.ds_before_dv and cfg.dq_per_wg
    report = inspect_kernel("bwd", dtype=dtype, hdim=128, tile_m=80, **MASKS[mask])
    _check_keys_report(report, cfg, mask)
    assert report["sass"]["HGMMA"] == 34 * _bodies(cfg)
    assert report["sass"]["UTMAREDG"] == _dq_boxes(cfg)


@pytest.mark.parametrize(("fields", "mask"), [
    ({"dk_rs": True}, "none"), ({"dk_rs": True}, "softcap"), ({"ds_stages": 2}, "none"),
    ({"dq_per_wg": False}, "none"), ({"deterministic": True}, "causal"),
    ({"deterministic": True, "dq_per_wg": False}, "none")])
def test_backward_80_rows_variants_compile(fields, mask):
    cfg = bwd_config("bf16", 128, tile_m=80, **fields, **MASKS[mask])
    report = inspect_kernel("bwd", dtype="bf16", hdim=128, tile_m=80, **fields, **MASKS[mask])
    _check_keys_report(report, cfg, mask)
    assert report["sass"]["UTMAREDG"] == _dq_boxes(cfg)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_backward_short_causal_64_rows_compiles(dtype):
    # what runtime.backward dispatches at hdim 128 under a causal mask up to 1k tokens
    # (plan.bwd_per_call): 64 query rows with hdim 128's switches (dk_rs, dq_per_wg, mask_runs, ...)
    fields = plan.bwd_per_call(128, 1024, 1024, True, False)
    assert fields == {"tile_m": 64, "dq_rows_interleaved": True}
    cfg = bwd_config(dtype, 128, causal=True, **fields)
    assert not cfg.dq_transposed and cfg.dk_rs and cfg.mask_runs and cfg.scale_in_ds
    report = inspect_kernel("bwd", dtype=dtype, hdim=128, causal=True, **fields)
    _check_keys_report(report, cfg, "causal")


@pytest.mark.parametrize(("hdim", "overrides", "match"), [
    (64, {"tile_m": 80}, "tile_m 80 must be a multiple of 64"),
    (96, {"tile_m": 80}, "tile_m 80 must be a multiple of 64"),
    (128, {"tile_m": 48}, "tile_m 48 must be a multiple of 64"),
    (128, {"tile_m": 80, "dq_by_rows": True}, "dq_by_rows"),
    (256, {"tile_m": 80}, "tile_m 80 must be 64")])
def test_backward_80_rows_only_at_hdim128(hdim, overrides, match):
    with pytest.raises(ValueError, match=match):
        bwd_config("bf16", hdim, **overrides)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_backward_ds_then_dv_compiles(dtype, mask):
    # hdim 64 in FA3 / FA4's step order: all of dS^T stored before dV is issued as one group, so
    # one commit group and one wait fewer than ds_before_dv (S^T, dP^T, dV, dQ, dK) and the
    # WGMMAs still asynchronous (ptxas serialized them when dV went out before dS^T's conversion)
    # (mask_runs off on both sides: the comparison is of the step order alone)
    cfg = bwd_config(dtype, 64, ds_then_dv=True, mask_runs=False, **MASKS[mask])
    # softcap keeps ds_before_dv (it spilled in this order)
    assert cfg.tile_m == 128 and cfg.ds_before_dv == (mask == "softcap")
    report = inspect_kernel("bwd", dtype=dtype, hdim=64, ds_then_dv=True, mask_runs=False, **MASKS[mask])
    _check_keys_report(report, cfg, mask)
    default = inspect_kernel("bwd", dtype=dtype, hdim=64, ds_then_dv=False, mask_runs=False,
                             **MASKS[mask])["sass"]
    assert report["sass"]["HGMMA"] == default["HGMMA"]
    assert report["sass"]["BAR"] == default["BAR"]


@pytest.mark.parametrize(("fields", "mask"), [
    ({"dk_rs": False}, "none"), ({"dk_rs": False}, "causal"), ({"dq_by_rows": False}, "none"),
    ({"dq_per_wg": False}, "causal")])
def test_backward_ds_then_dv_variants_compile(fields, mask):
    cfg = bwd_config("bf16", 64, ds_then_dv=True, **fields, **MASKS[mask])
    report = inspect_kernel("bwd", dtype="bf16", hdim=64, ds_then_dv=True, **fields, **MASKS[mask])
    _check_keys_report(report, cfg, mask)


def test_deterministic_backward_ds_then_dv_compiles():
    cfg = bwd_config("bf16", 64, causal=True, deterministic=True, ds_then_dv=True)
    report = inspect_kernel("bwd", dtype="bf16", hdim=64, causal=True, deterministic=True, ds_then_dv=True)
    _check_keys_report(report, cfg, "causal")


def test_backward_ds_then_dv_needs_128_rows():
    for kwargs in ({"hdim": 128}, {"hdim": 256}, {"hdim": 64, "tile_m": 64}):
        hdim = kwargs.pop("hdim")
        with pytest.raises(ValueError, match="ds_then_dv"):
            bwd_config("bf16", hdim, ds_then_dv=True, **kwargs)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("hdim", KEYS_HDIMS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_backward_mask_runs_compiles(dtype, hdim, mask):
    # each step picks the masked or the mask-free body (a branch between whole steps): both keep
    # their WGMMAs asynchronous (one wait per commit group each), no spills
    cfg = bwd_config(dtype, hdim, mask_runs=True, **MASKS[mask])
    report = inspect_kernel("bwd", dtype=dtype, hdim=hdim, mask_runs=True, **MASKS[mask])
    _check_keys_report(report, cfg, mask)


@pytest.mark.parametrize(("hdim", "fields", "mask"), [
    (64, {"deterministic": True}, "causal"), (64, {"deterministic": True}, "local"),
    (128, {"deterministic": True}, "local"), (64, {"tile_m": 64}, "causal"), (64, {"tile_m": 64}, "local"),
    (64, {"dk_rs": False, "dq_per_wg": False}, "causal"), (128, {"ds_stages": 2}, "local"),
    (96, {"deterministic": True}, "causal")])
def test_backward_mask_runs_variants_compile(hdim, fields, mask):
    cfg = bwd_config("bf16", hdim, mask_runs=True, **fields, **MASKS[mask])
    report = inspect_kernel("bwd", dtype="bf16", hdim=hdim, mask_runs=True, **fields, **MASKS[mask])
    _check_keys_report(report, cfg, mask)


def test_backward_mask_runs_needs_key_split():
    with pytest.raises(ValueError, match="mask_runs"):
        bwd_config("bf16", 256, mask_runs=True)


@pytest.mark.parametrize("hdim", KEYS_HDIMS)
def test_deterministic_backward_compiles(hdim):
    report = inspect_kernel("bwd", dtype="bf16", hdim=hdim, local=True, deterministic=True)
    assert report["spill_bytes"] == 0 and report["sass"]["UTMAREDG"] >= 1


# CI: one mask per wide hdim (each compiles four kernels); make test-full: every mask
_WIDE_DETERMINISTIC_CI = {(192, "local"), (256, "causal")}


@pytest.mark.parametrize(("hdim", "mask"), [
    pytest.param(hdim, mask, marks=() if (hdim, mask) in _WIDE_DETERMINISTIC_CI else pytest.mark.variant)
    for hdim in sorted(BWD_WIDE) for mask in ("none", "causal", "local")])
def test_deterministic_wide_backward_compiles(hdim, mask):
    # dQ reduce-adds in key-block order: with the dispatched dQ slot the writer warp waits for the
    # query block's semaphore and passes the turn on, so the consumers' barriers do not change; with
    # the atomics (a per-query-block semaphore, one consumer barrier before and after a block's
    # atomics) there are two more. Either way the WGMMA structure of the default kernel, no spills.
    for fields, extra_bars in (({}, 0), (BWD_WIDE_ATOMICS[hdim], 2)):
        cfg = bwd_config("bf16", hdim, deterministic=True, **fields, **MASKS[mask])
        report = inspect_kernel("bwd", dtype="bf16", hdim=hdim, deterministic=True, **fields, **MASKS[mask])
        _check_wide_report(report, cfg, mask)
        default = inspect_kernel("bwd", dtype="bf16", hdim=hdim, **fields, **MASKS[mask])["sass"]
        assert report["sass"]["BAR"] == default["BAR"] + extra_bars


@pytest.mark.parametrize(("hdim", "mask"), [(64, "none"), (64, "causal"), (96, "softcap"), (128, "none"),
                                           (128, "local"), (192, "causal"), (256, "none"), (256, "softcap")])
def test_backward_scale_in_ds_compiles(hdim, mask):
    # the softmax scale carried by dS: the same WGMMAs and waits as the default kernel, no spills,
    # and fewer instructions (no scaling of the dQ tile per step, nor of dK at the end)
    # (dispatched at hdim 128: compared with scale_in_ds off)
    cfg = bwd_config("bf16", hdim, scale_in_ds=True, **MASKS[mask])
    report = inspect_kernel("bwd", dtype="bf16", hdim=hdim, scale_in_ds=True, **MASKS[mask])
    if hdim in BWD_WIDE:
        _check_wide_report(report, cfg, mask)
    else:
        _check_keys_report(report, cfg, mask)
    default = inspect_kernel("bwd", dtype="bf16", hdim=hdim, scale_in_ds=False, **MASKS[mask])
    assert report["sass"]["HGMMA_WAITS"] == default["sass"]["HGMMA_WAITS"]
    assert report["instructions"] < default["instructions"]


def test_backward_scaled_preprocess_compiles():
    """BwdConfig.scale_in_ds's preprocess (D times a runtime scale): one FMUL more than the
    default one, the same loads."""
    plain, scaled = (_pre_report(BwdPreConfig("bf16", 128, scale_d=scale_d)) for scale_d in (False, True))
    assert scaled["spill_bytes"] == 0 and scaled["sass"]["LDG.128"] == plain["sass"]["LDG.128"]
    assert scaled["instructions"] > plain["instructions"]


@pytest.mark.parametrize("hdim", [64, 96, 128, 192, 256])
def test_backward_preprocess_compiles(hdim):
    """O and dO are read with 16-byte loads, every one of a thread's rows before the first
    product: 2 tensors x rows per thread x vectors per lane of them (hopper/bwd_pre.py)."""
    from flashhopper.hopper.bwd_pre import ROWS_PER_CTA, VEC, WARPS, lanes_per_row

    lanes = lanes_per_row(hdim)
    rows_per_thread = ROWS_PER_CTA // (32 * WARPS // lanes)
    report = _pre_report(BwdPreConfig("bf16", hdim))
    assert report["spill_bytes"] == 0 and report["sass"]["LDL"] == 0
    assert report["sass"]["LDG.128"] == 2 * rows_per_thread * (hdim // VEC // lanes)


@pytest.mark.parametrize(("hdim", "scale_d"),
                         [(64, False), (96, False), (128, True), (192, False), (256, False)])
def test_backward_preprocess_zero_dq_compiles(hdim, scale_d):
    """BwdConfig.pre_zero_dq's preprocess: the same 16-byte loads as the plain one, and 16-byte
    stores of zeros covering each of its rows of the fp32 dQ accumulator (hdim / 4 per row)."""
    from flashhopper.hopper.bwd_pre import ROWS_PER_CTA, WARPS, lanes_per_row

    plain, zero = (_pre_report(BwdPreConfig("bf16", hdim, scale_d=scale_d, zero_dq=zero_dq))
                   for zero_dq in (False, True))
    lanes = lanes_per_row(hdim)
    rows_per_thread = ROWS_PER_CTA // (32 * WARPS // lanes)
    assert zero["spill_bytes"] == 0 and zero["sass"]["LDL"] == 0
    assert zero["sass"]["LDG.128"] == plain["sass"]["LDG.128"]
    assert plain["sass"]["STG.128"] == 0
    assert zero["sass"]["STG.128"] == rows_per_thread * (hdim // 4 // lanes)


def test_preprocess_lanes_per_row():
    from flashhopper.hopper.bwd_pre import lanes_per_row

    assert {d: lanes_per_row(d) for d in (64, 96, 128, 192, 256)} == {64: 8, 96: 4, 128: 16, 192: 8, 256: 32}


def _check_wide_report(report, cfg, mask):
    sass = report["sass"]
    # per query block and warpgroup: S and dP (hdim/16 k-blocks each), dV^T and dK^T (64-row M tiles
    # x 4 k-blocks each), dQ (tile_n/16 k-blocks per chunk)
    m_tiles = cfg.hdim // 64 if cfg.dkv_by_keys else cfg.hdim // cfg.num_consumer_wg // 64
    chunks = cfg.num_dq_chunks
    assert sass["HGMMA"] == 2 * (cfg.hdim // 16) + 2 * 4 * m_tiles + chunks * cfg.tile_n // 16
    # commit groups per query block: S, dP, dV^T, dK^T and each dQ chunk; more waits = serialized
    assert sass["HGMMA_WAITS"] <= 4 + chunks, "ptxas serialized the WGMMAs"
    assert sass["LDL"] == 0 and sass["STL"] == 0 and report["spill_bytes"] == 0
    assert_smem(report, cfg)
    assert (sass["MUFU.TANH"] > 0) == (mask == "softcap")
    assert sorted(sass["USETMAXREG"]) == [cfg.producer_regs, cfg.consumer_regs]


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("hdim", [192, 256])
def test_backward_wide_hdim_compiles_without_spills(hdim, dtype, mask):
    # dK/dV split by head dim (hopper/bwd_wide.py): 3 consumer warpgroups at 192, 2 at 256
    from flashhopper.plan import bwd_config

    cfg = bwd_config(dtype, hdim, **MASKS[mask])
    assert cfg.kv_split == "hdim"
    report = inspect_kernel("bwd", dtype=dtype, hdim=hdim, **MASKS[mask])
    _check_wide_report(report, cfg, mask)
    sass = report["sass"]
    boxes = hdim // 64  # 128-byte swizzle: one TMA box per 64 head-dim columns
    assert sass["UTMALDG"] >= 4 * boxes + 2  # K, V, Q, dO, and the LSE and D rows
    assert sass["UTMASTG"] >= 2 * boxes  # dK, dV from K's and V's smem buffers
    assert sass["SYNCS"] > 0


# tile shapes and dO ring depths of the wide kernel next to the dispatched ones (tests/test_config.py
# WIDE_CANDIDATES): hdim 256 dispatches FA3's 80 keys with one dO stage (dQ in two chunks);
# 64 keys with two dO stages was the default before; 48 is FA4's; 40 and 24 keys per warpgroup
# put P and dS in the unswizzled layout
WIDE_VARIANTS = [
    (256, {"tile_n": 64, "do_stages": 0}, "none"),
    (256, {"tile_n": 64, "do_stages": 0}, "causal"),
    (256, {"tile_n": 64, "do_stages": 1}, "causal"),
    (256, {"tile_n": 48, "do_stages": 0}, "none"),
    (256, {"tile_n": 48}, "softcap"),
    (256, {"tile_n": 64, "do_stages": 0, "dq_chunks": 2}, "none"),
    (192, {"do_stages": 1}, "causal"),
]


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("hdim", sorted(BWD_WIDE))
def test_backward_wide_two_pds_buffers_compile(hdim, mask):
    # ds_stages=2: P / dS buffer pairs alternate by step, so the "buffers free" barrier goes (one
    # BAR fewer in SASS); same WGMMAs and commit groups, no spills, smem within the limit
    # (formerly dispatched with dQ by atomics: compared with one pair here)
    base = {**BWD_WIDE_ATOMICS[hdim], **MASKS[mask]}
    cfg = bwd_config("bf16", hdim, **{**base, "ds_stages": 2})
    report = inspect_kernel("bwd", dtype="bf16", hdim=hdim, **{**base, "ds_stages": 2})
    _check_wide_report(report, cfg, mask)
    one = inspect_kernel("bwd", dtype="bf16", hdim=hdim, **{**base, "ds_stages": 1})
    _check_wide_report(one, bwd_config("bf16", hdim, **{**base, "ds_stages": 1}), mask)
    assert report["sass"]["BAR"] == one["sass"]["BAR"] - 1
    assert report["sass"]["HGMMA_WAITS"] == one["sass"]["HGMMA_WAITS"]


def test_deterministic_wide_two_pds_buffers_compile():
    fields = {**BWD_WIDE_ATOMICS[256], "ds_stages": 2}
    cfg = bwd_config("bf16", 256, causal=True, deterministic=True, **fields)
    report = inspect_kernel("bwd", dtype="bf16", hdim=256, causal=True, deterministic=True, **fields)
    _check_wide_report(report, cfg, "causal")


@pytest.mark.parametrize(("hdim", "fields", "mask"), WIDE_VARIANTS)
def test_backward_wide_variants_compile(hdim, fields, mask):
    fields = {**BWD_WIDE_ATOMICS[hdim], **fields}  # the candidates were measured with dQ by atomics
    cfg = bwd_config("bf16", hdim, **fields, **MASKS[mask])
    report = inspect_kernel("bwd", dtype="bf16", hdim=hdim, **fields, **MASKS[mask])
    _check_wide_report(report, cfg, mask)


# BwdConfig.lpt: longest-first launch order for masked backward grids (hopper/bwd_common.py)
def test_lpt_coords_is_a_bijection_longest_first():
    from flashhopper.hopper.bwd_common import lpt_coords, lpt_section

    # (the kernel's section may exceed the pairs: one section then)
    for num_n, pairs, section in [(4, 512, 64), (32, 64, 5), (7, 10, 3), (3, 1, 1), (5, 6, 6), (2, 9, 100)]:
        seen = [lpt_coords(i, num_n, pairs, section) for i in range(num_n * pairs)]
        assert sorted(seen) == [(n, p) for n in range(num_n) for p in range(pairs)]  # every CTA once
        # inside each section every pair's key block n starts before any pair's key block n + 1,
        # and sections follow each other: the grid ends on the last section's highest key blocks
        for first in range(0, pairs, section):
            blocks = [n for n, p in seen if first <= p < first + section]
            assert blocks == sorted(blocks)
        assert seen[-1][0] == num_n - 1
    # the section: what fits the budget, at least one pair
    assert lpt_section(4096, 4096, 1, 128, 24 * 1024) == 24 * 1024 * 1024 // (4 * 128) // (3 * 4096)
    assert lpt_section(512, 512, 1, 64, 24 * 1024) == 24 * 1024 * 1024 // 256 // 1536
    assert lpt_section(1 << 20, 1 << 20, 8, 256, 24 * 1024) == 1


@pytest.mark.parametrize(("hdim", "mask", "fields"), [
    (64, "causal", {}), (128, "causal", {}), (96, "local", {}), (256, "causal", {}),
    (192, "causal", {"lpt_l2_kib": 64})])
def test_backward_lpt_compiles(hdim, mask, fields):
    # a few integer ops at the start of the CTA: the same WGMMAs and waits, no spills
    cfg = bwd_config("bf16", hdim, lpt=True, **fields, **MASKS[mask])
    report = inspect_kernel("bwd", dtype="bf16", hdim=hdim, lpt=True, **fields, **MASKS[mask])
    if hdim in BWD_WIDE:
        _check_wide_report(report, cfg, mask)
    else:
        _check_keys_report(report, cfg, mask)
    default = inspect_kernel("bwd", dtype="bf16", hdim=hdim, **MASKS[mask])
    assert report["sass"]["HGMMA_WAITS"] == default["sass"]["HGMMA_WAITS"]
    assert report["sass"]["HGMMA"] == default["sass"]["HGMMA"]


# deterministic mode's dQ turns: the key blocks that visit a query block, counted on the host
def _brute_force_visits(sq, sk, tile_m, tile_n, has_right, has_left, wl, wr):
    from flashhopper.hopper.host import host_m_block_range

    num_m = -(-sq // tile_m)
    visits = [0] * num_m
    for n in range(-(-sk // tile_n)):
        lo, hi = host_m_block_range(n, sq, sk, tile_m, tile_n, has_right, has_left, wl, wr)
        for m in range(lo, hi):
            visits[m] += 1
    return visits


def test_visiting_key_blocks_match_the_key_blocks_that_visit():
    """BlockInfo.first_n_block .. last_n_block (deterministic mode's turns), by its host twin, against
    the visits of every key block's m_block_range."""
    import random

    from flashhopper.hopper.host import host_visiting_key_blocks

    rng = random.Random(7)
    big = 1 << 30  # runtime._UNBOUNDED
    shapes = [(1, 1), (17, 17), (1000, 17), (17, 1000), (4097, 4097), (517, 300), (300, 517)]
    shapes += [(rng.randint(1, 3000), rng.randint(1, 3000)) for _ in range(60)]
    masks = [(False, False, big, big), (True, False, big, 0), (True, True, 100, 20), (True, True, 256, 0),
             (True, True, 0, 0), (True, True, 64, 64), (True, True, big, 50), (True, True, 7, big)]
    checked = 0
    for sq, sk in shapes:
        for tile_m, tile_n in ((80, 128), (128, 128), (64, 128)):
            for has_right, has_left, wl, wr in masks:
                visits = _brute_force_visits(sq, sk, tile_m, tile_n, has_right, has_left, wl, wr)
                for m, v in enumerate(visits):
                    if v:
                        assert host_visiting_key_blocks(m, sq, sk, tile_m, tile_n, has_right, has_left, wl,
                                                        wr) == v
                        checked += 1
    assert checked > 10000


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize(("hdim", "fields"), [(192, {"num_consumer_wg": 2})])
def test_backward_wide_dkv_by_keys_compiles(hdim, fields, mask):
    """dK^T / dV^T split by keys (BwdConfig.dkv_by_keys): at hdim 192 FA4's 2 warpgroups x 48 keys
    at 240 registers (3 M tiles each) instead of 3 x 64 head-dim rows at 160; the same structure.
    (At hdim 256, 2 x 40 keys, ptxas spills 4 values: not offered there.) With dQ by atomics."""
    fields = {**BWD_WIDE_ATOMICS[hdim], **fields, "dkv_by_keys": True}
    cfg = bwd_config("bf16", hdim, **fields, **MASKS[mask])
    report = inspect_kernel("bwd", dtype="bf16", hdim=hdim, **fields, **MASKS[mask])
    _check_wide_report(report, cfg, mask)


def test_backward_wide_dkv_by_keys_deterministic_compiles():
    fields = {**BWD_WIDE_ATOMICS[192], "dkv_by_keys": True, "num_consumer_wg": 2}
    cfg = bwd_config("bf16", 192, causal=True, deterministic=True, **fields)
    report = inspect_kernel("bwd", dtype="bf16", hdim=192, causal=True, deterministic=True, **fields)
    _check_wide_report(report, cfg, "causal")


_NO_DQ_TMA = {"dq_tma": False, "dq_slots": 0}
_DQ_TMA = {192: {"num_consumer_wg": 2, "dkv_by_keys": True, "do_stages": 1, "ds_stages": 1, **_NO_DQ_TMA},
           256: {"tile_n": 64, "num_stages": 1, "do_stages": 1, "ds_stages": 1, **_NO_DQ_TMA}}


@pytest.mark.parametrize("mask", list(MASKS) + ["deterministic"])
@pytest.mark.parametrize("hdim", [192, 256])
def test_backward_wide_dq_tma_compiles(hdim, mask):
    """BwdConfig.dq_tma in FA4's tiles: no atomics, one TMA reduce-add per warpgroup part from the
    producer warpgroup's second warp; 240 registers, no spills, the WGMMAs asynchronous."""
    fields = {**_DQ_TMA[hdim], "dq_tma": True}
    masks = {**MASKS, "deterministic": {"causal": True, "deterministic": True}}[mask]
    cfg = bwd_config("bf16", hdim, **fields, **masks)
    report = inspect_kernel("bwd", dtype="bf16", hdim=hdim, **fields, **masks)
    _check_wide_report(report, cfg, "causal" if mask == "deterministic" else mask)
    assert report["sass"]["UTMAREDG"] > 0
    assert cfg.smem_bytes() - bwd_config("bf16", hdim, **_DQ_TMA[hdim], **masks).smem_bytes() == 64 * hdim * 4


# dq_slots: one fp32 dQ part in smem, lent to each warpgroup in turn, so that the dispatched tiles fit
# with one P / dS pair (256: 64 x 80, two Q stages; 192: FA4's split with two Q / dO stages); the
# dispatch
_DQ_SLOT = {192: {"num_consumer_wg": 2, "dkv_by_keys": True, "ds_stages": 1, **_NO_DQ_TMA},
            256: {"ds_stages": 1, **_NO_DQ_TMA}}


@pytest.mark.parametrize("mask", list(MASKS) + ["deterministic"])
@pytest.mark.parametrize("hdim", [192, 256])
def test_backward_wide_dq_slot_compiles(hdim, mask):
    fields = {**_DQ_SLOT[hdim], "dq_tma": True, "dq_slots": 1}
    masks = {**MASKS, "deterministic": {"causal": True, "deterministic": True}}[mask]
    cfg = bwd_config("bf16", hdim, **fields, **masks)
    assert cfg == bwd_config("bf16", hdim, **masks)
    assert (cfg.tile_n, cfg.num_stages) == ((96, 2) if hdim == 192 else (80, 2))
    report = inspect_kernel("bwd", dtype="bf16", hdim=hdim, **fields, **masks)
    _check_wide_report(report, cfg, "causal" if mask == "deterministic" else mask)
    assert report["sass"]["UTMAREDG"] > 0
    # one part: 64 x 96 fp32 at 192 (2 warpgroups, one chunk), 64 x 64 at 256 (2 x 2 chunks), there
    # as a ring of three half-part boxes except under a local window (dq_slot_ring)
    part = 64 * (96 if hdim == 192 else 64) * 4
    if cfg.dq_slot_ring:
        part = part // 2 * cfg.dq_slot_ring
    assert cfg.smem_bytes() - bwd_config("bf16", hdim, **_DQ_SLOT[hdim], **masks).smem_bytes() == part


# dq_rows_interleaved: query rows 0, 4, 1, 5, .. in each 8-row group of the smem dQ tile (the consumers'
# 8-byte stores free of bank conflicts), read back in query order by a 5-D TMA view of dQaccum
# (the keys kernel's dQ tile too, where it is written in row pairs: hdim 64 / 96, and 128 at 64 rows)
@pytest.mark.parametrize(("hdim", "mask", "fields"), [
    (192, "none", {}), (192, "causal", {}), (192, "local", {}), (256, "none", {}), (256, "softcap", {}),
    (256, "deterministic", {}), (192, "deterministic", {}),
    (256, "none", {"tile_n": 48, "do_stages": 1, "ds_stages": 1, "dq_slots": 0}),
    (64, "none", {}), (64, "causal", {}), (64, "deterministic", {}), (96, "local", {}), (96, "softcap", {}),
    (128, "causal", {"tile_m": 64})])
def test_backward_dq_rows_interleaved_compiles(hdim, mask, fields):
    masks = {**MASKS, "deterministic": {"causal": True, "deterministic": True}}[mask]
    cfg = bwd_config("bf16", hdim, dq_rows_interleaved=True, **fields, **masks)
    report = inspect_kernel("bwd", dtype="bf16", hdim=hdim, dq_rows_interleaved=True, **fields, **masks)
    check = _check_wide_report if hdim in BWD_WIDE else _check_keys_report
    check(report, cfg, "causal" if mask == "deterministic" else mask)
    plain = inspect_kernel("bwd", dtype="bf16", hdim=hdim, **fields, **masks)["sass"]
    for key in ("HGMMA", "HGMMA_WAITS", "BAR", "UTMAREDG"):
        assert report["sass"][key] == plain[key], key


def test_dq_rows_interleaved_permutations_are_inverse_and_conflict_free():
    from flashhopper.hopper.bwd_common import DQ_ROWS_GMEM, DQ_ROWS_SMEM

    def colex(layout, i):
        (n0, _), (d0, d1) = layout
        return (i % n0) * d0 + (i // n0) * d1

    tile_rows = [colex(DQ_ROWS_SMEM, r) for r in range(8)]
    assert sorted(tile_rows) == list(range(8))
    assert [colex(DQ_ROWS_GMEM, colex(DQ_ROWS_SMEM, r)) for r in range(8)] == list(range(8))
    # an 8-byte store of a WGMMA accumulator: lanes 0-15 hold rows 0-3, lanes 16-31 rows 4-7, 32 bytes
    # per row; in the 128-byte swizzle a tile row's 16-byte chunks are XORed with (row % 8), so the
    # four rows of a half-warp use disjoint chunk pairs when their tile rows differ in bits 1-2
    for half in (range(4), range(4, 8)):
        for group in range(4):  # the 8 columns a store covers: chunk pair `group` of the row
            chunks = [c ^ tile_rows[r] for r in half for c in (2 * group, 2 * group + 1)]
            assert sorted(chunks) == list(range(8))
    # the plain order (tile row = query row) puts rows r and r ^ 1 on the same chunks
    assert sorted(c ^ r for r in range(4) for c in (0, 1)) != list(range(8))


def test_dq_rows_interleaved_accumulator_is_padded():
    import torch

    from flashhopper.hopper import runtime

    q = torch.empty(2, 300, 4, 192)
    # whole 64-row query blocks: the TMA view's row groups run on into the next batch
    assert runtime._dq_accum(q, bwd_config("bf16", 192, dq_rows_interleaved=True), torch.empty).shape == \
        (2, 320, 4, 192)
    assert runtime._dq_accum(q, bwd_config("bf16", 192, dq_rows_interleaved=False), torch.empty).shape == \
        (2, 300, 4, 192)


def test_dq_rows_interleaved_is_dispatched_and_dropped_by_overrides_it_does_not_fit():
    # dispatched at hdim 64 (keys kernel) and 192 / 256 (the wide kernel's smem slot), not at 96 / 128
    assert [bwd_config("bf16", d).dq_rows_interleaved for d in (64, 96, 128, 192, 256)] == \
        [True, False, False, True, True]
    # an override that takes the smem dQ tile away drops it, unless it is asked for
    assert not bwd_config("bf16", 256, dq_tma=False, dq_slots=0).dq_rows_interleaved
    assert not bwd_config("bf16", 64, dq_accum_head_major=True).dq_rows_interleaved
    assert bwd_config("bf16", 64, tile_m=64).dq_rows_interleaved


def test_dq_rows_interleaved_is_refused_where_it_does_not_apply():
    with pytest.raises(ValueError, match="dq_rows_interleaved needs a smem dQ tile"):
        bwd_config("bf16", 256, **{**BWD_WIDE_ATOMICS[256], "dq_rows_interleaved": True})
    with pytest.raises(ValueError, match="dq_rows_interleaved needs a smem dQ tile"):
        bwd_config("bf16", 192, dq_accum_head_major=True, dq_rows_interleaved=True)
    with pytest.raises(ValueError, match="dq_rows_interleaved needs a smem dQ tile"):
        bwd_config("bf16", 128, dq_rows_interleaved=True)  # dQ^T: its 4-byte stores do not conflict


@pytest.mark.parametrize(("hdim", "mask", "waits"), [
    (64, "none", 2), (128, "causal", 2), (128, "deterministic", 2), (192, "none", 2), (256, "causal", 2)])
def test_backward_pdl_compiles(hdim, mask, waits):
    """BwdConfig.pdl: the main kernel waits for the preprocess (griddepcontrol.wait, SASS ACQBULK)
    only in the warps that read what it wrote: the producer (LSE / D rows) and the dQ writer (keys
    kernel) or the consumers' atomics (wide kernel); the rest of the kernel is unchanged."""
    masks = {**MASKS, "deterministic": {"causal": True, "deterministic": True}}[mask]
    cfg = bwd_config("bf16", hdim, pdl=True, **masks)
    report = inspect_kernel("bwd", dtype="bf16", hdim=hdim, pdl=True, **masks)
    plain = inspect_kernel("bwd", dtype="bf16", hdim=hdim, **masks)
    assert report["sass"]["ACQBULK"] == waits and plain["sass"]["ACQBULK"] == 0
    for key in ("HGMMA", "HGMMA_WAITS", "BAR", "SYNCS", "UTMAREDG"):
        assert report["sass"][key] == plain["sass"][key], key
    assert report["spill_bytes"] == 0 and report["registers"] == plain["registers"]
    assert cfg.pdl


def test_backward_preprocess_pdl_signals_dependents():
    from flashhopper.hopper.runtime import kernel_cubin

    def opcodes(pdl):
        return _sass_opcodes(kernel_cubin(BwdPreConfig("bf16", 128, zero_dq=True, pdl=pdl)))

    # griddepcontrol.launch_dependents is SASS PREEXIT
    assert opcodes(True).count("PREEXIT") == 1 and opcodes(False).count("PREEXIT") == 0


def _pre_report(cfg) -> dict:
    from flashhopper.compile import inspect_cubin
    from flashhopper.hopper.runtime import kernel_cubin

    return inspect_cubin(kernel_cubin(cfg))


def _sass_opcodes(cubin: bytes) -> list[str]:
    import os
    import subprocess
    import tempfile

    from flashhopper.compile import find_sass_tools, parse_sass

    cuobjdump, nvdisasm = find_sass_tools()
    env = dict(os.environ, PATH=os.path.dirname(nvdisasm) + os.pathsep + os.environ.get("PATH", ""))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        text = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, env=env,
                              check=True).stdout
    return [op for op, _ in parse_sass(text)]


@pytest.mark.parametrize("mask", ["none", "causal", "local", "softcap", "deterministic"])
def test_backward_wide_dq_tma_fa4_tile_256_compiles(mask):
    # FA4's hdim 256 tile: 64 x 48 (24 keys per warpgroup), two Q stages, one dO stage, one P / dS
    # pair and the whole 64 KiB fp32 dQ tile: 227,136 bytes of smem
    fields = {"tile_n": 48, "do_stages": 1, "ds_stages": 1, "dq_tma": True, "dq_slots": 0}
    masks = {**MASKS, "deterministic": {"causal": True, "deterministic": True}}[mask]
    cfg = bwd_config("bf16", 256, **fields, **masks)
    assert cfg.num_dq_chunks == 1 and cfg.smem_bytes() <= SMEM_CAPACITY
    report = inspect_kernel("bwd", dtype="bf16", hdim=256, **fields, **masks)
    _check_wide_report(report, cfg, "causal" if mask == "deterministic" else mask)


def test_dq_tma_only_in_the_wide_kernel():
    with pytest.raises(ValueError, match="dq_tma exists only"):
        bwd_config("bf16", 128, dq_tma=True)
    with pytest.raises(ValueError, match="dq_slots 1"):
        bwd_config("bf16", 256, ds_stages=1, dq_tma=False, dq_slots=1)
    with pytest.raises(ValueError, match="dq_slots 2"):
        bwd_config("bf16", 256, ds_stages=1, dq_tma=True, dq_slots=2)
    with pytest.raises(ValueError, match="shared memory"):
        # the whole dQ tile has no room in the dispatched 64 x 80 tile, even with one P / dS pair
        bwd_config("bf16", 256, dq_tma=True, dq_slots=0)


def test_dkv_by_keys_only_in_the_wide_kernel():
    with pytest.raises(ValueError, match="dkv_by_keys exists only"):
        bwd_config("bf16", 128, dkv_by_keys=True)
    with pytest.raises(ValueError, match="must split into 64-row WGMMA M tiles"):
        bwd_config("bf16", 192, num_consumer_wg=2, dkv_by_keys=False)  # the head-dim split needs 3 at 192
    assert bwd_config("bf16", 192, num_consumer_wg=2, dkv_by_keys=True).num_consumer_wg == 2


def test_dq_accum_head_major_is_a_permuted_view():
    # BwdConfig.dq_accum_head_major: the kernels get (b, sq, h, d) with (b, h, sq, d) memory
    import torch

    from flashhopper.hopper.runtime import _dq_accum

    q = torch.empty(2, 17, 3, 64)
    plain = _dq_accum(q, bwd_config("bf16", 64, dq_rows_interleaved=False), torch.zeros)
    head_major = _dq_accum(q, bwd_config("bf16", 64, dq_accum_head_major=True), torch.zeros)
    assert plain.shape == head_major.shape == q.shape and plain.is_contiguous()
    assert head_major.stride() == (3 * 17 * 64, 64, 17 * 64, 1)
    assert head_major.permute(0, 2, 1, 3).is_contiguous()


def test_dq_slot_halves_is_dispatched_at_256_and_dropped_by_overrides_it_does_not_fit():
    # hdim 256 lends its one dQ slot in two 32-column halves; 192's 96-column parts have no whole halves
    assert [bwd_config("bf16", d).dq_slot_halves for d in (64, 96, 128, 192, 256)] == \
        [False, False, False, False, True]
    assert bwd_config("bf16", 256, causal=True, deterministic=True).dq_slot_halves
    # not under a local window, where the kernel spills with them (16 bytes)
    assert not bwd_config("bf16", 256, local=True).dq_slot_halves
    assert bwd_config("bf16", 256, local=True, dq_slot_halves=True).dq_slot_halves
    # an override that takes the slot away drops the halves, unless they are asked for
    assert not bwd_config("bf16", 256, **BWD_WIDE_ATOMICS[256]).dq_slot_halves
    for hdim, fields in ((192, {}), (256, BWD_WIDE_ATOMICS[256]), (128, {})):
        with pytest.raises(ValueError, match="dq_slot_halves needs dq_slots=1"):
            bwd_config("bf16", hdim, **{**fields, "dq_slot_halves": True})


def test_dq_slot_ring_is_dispatched_at_256_where_the_slot_has_halves():
    # hdim 256 passes its dQ halves through a ring of three 8 KiB boxes; not under a local window
    # (no halves there), not at 192 (no halves)
    assert [bwd_config("bf16", d).dq_slot_ring for d in (64, 96, 128, 192, 256)] == [0, 0, 0, 0, 3]
    for dtype, kw in (("bf16", {"causal": True}), ("bf16", {"causal": True, "deterministic": True}),
                      ("bf16", {"softcap": True}), ("fp16", {})):
        assert bwd_config(dtype, 256, **kw).dq_slot_ring == 3
    assert bwd_config("bf16", 256, local=True).dq_slot_ring == 0
    # an override that takes the halves away takes the ring too
    assert bwd_config("bf16", 256, dq_slot_halves=False).dq_slot_ring == 0
    ring, halves = bwd_config("bf16", 256), bwd_config("bf16", 256, dq_slot_ring=0)
    assert ring.smem_bytes() - halves.smem_bytes() == 64 * 32 * 4 == 8192
    assert ring.smem_bytes() == 227136 <= SMEM_CAPACITY
    for ring_len in (1, 2):
        with pytest.raises(ValueError, match="dq_slot_ring"):
            dataclasses.replace(ring, dq_slot_ring=ring_len).check()
    with pytest.raises(ValueError, match="only with dq_slot_halves"):
        dataclasses.replace(bwd_config("bf16", 192), dq_slot_ring=3).check()


@pytest.mark.parametrize("mask", ["none", "causal", "deterministic", "softcap"])
def test_dq_slot_ring_compiles_the_same_step(mask):
    """The ring changes only which smem box each half-turn uses (a runtime offset on both sides) and
    how many of the writer's reduce-adds may still be reading (2 instead of 1): the same WGMMAs,
    barriers and reduce-add boxes, no spills."""
    masks = {**MASKS, "deterministic": {"causal": True, "deterministic": True}}[mask]
    cfg = bwd_config("bf16", 256, **masks)
    assert cfg.dq_slot_ring == 3
    report = inspect_kernel("bwd", dtype="bf16", hdim=256, **masks)
    halves = inspect_kernel("bwd", dtype="bf16", hdim=256, dq_slot_ring=0, **masks)
    _check_wide_report(report, cfg, "causal" if mask == "deterministic" else mask)
    for key in ("HGMMA", "HGMMA_WAITS", "BAR", "UTMAREDG", "UTMALDG"):
        assert report["sass"][key] == halves["sass"][key], key


@pytest.mark.parametrize("mask", ["none", "deterministic"])
def test_dq_slot_halves_compiles_with_twice_the_hand_offs(mask):
    masks = {**MASKS, "deterministic": {"causal": True, "deterministic": True}}[mask]
    masks = {**masks, "dq_slot_ring": 0}  # the two halves alone (the dispatch makes them a ring of three)
    on = bwd_config("bf16", 256, **masks)
    assert on.dq_slot_halves and on.smem_bytes() == bwd_config("bf16", 256, dq_slot_halves=False,
                                                              **masks).smem_bytes()
    report = inspect_kernel("bwd", dtype="bf16", hdim=256, **masks)
    off = inspect_kernel("bwd", dtype="bf16", hdim=256, dq_slot_halves=False, **masks)
    _check_wide_report(report, on, "causal" if mask == "deterministic" else mask)
    # the same 8 reduce-add boxes a step (a 64-column part was two 32-column boxes already), and one
    # more grant / hand-back barrier pair per part on each side
    assert report["sass"]["UTMAREDG"] == off["sass"]["UTMAREDG"] == 8
    assert report["sass"]["BAR"] > off["sass"]["BAR"]


def test_sdp_by_gemm_is_dispatched_at_256_without_softcap():
    # dispatched at hdim 256 in every mask but softcap; the same smem and accumulator
    # registers as the split by keys, which softcap keeps
    assert not any(bwd_config("bf16", d).sdp_by_gemm for d in (64, 96, 128, 192))
    for kw in ({}, {"causal": True}, {"local": True}, {"causal": True, "deterministic": True}):
        assert bwd_config("bf16", 256, **kw).sdp_by_gemm and bwd_config("fp16", 256, **kw).sdp_by_gemm
    assert not bwd_config("bf16", 256, softcap=True).sdp_by_gemm
    assert bwd_config("bf16", 256).smem_bytes() == bwd_config("bf16", 256, sdp_by_gemm=False).smem_bytes()
    for hdim, fields in ((256, {"softcap": True}), (192, {}), (128, {})):
        with pytest.raises(ValueError, match="sdp_by_gemm needs kv_split 'hdim'"):
            bwd_config("bf16", hdim, **{**fields, "sdp_by_gemm": True})
    # an override it cannot go with drops it unless it is asked for too
    assert not bwd_config("bf16", 256, dkv_by_keys=True, dq_chunks=2).sdp_by_gemm


@pytest.mark.parametrize("mask", ["none", "causal", "local", "deterministic"])
def test_sdp_by_gemm_compiles_with_the_exp2s_on_one_warpgroup(mask):
    masks = {**MASKS, "deterministic": {"causal": True, "deterministic": True}}[mask]
    cfg = bwd_config("bf16", 256, sdp_by_gemm=True, **masks)
    report = inspect_kernel("bwd", dtype="bf16", hdim=256, sdp_by_gemm=True, **masks)
    _check_wide_report(report, cfg, "causal" if mask == "deterministic" else mask)
    # warpgroup 0 exponentiates the whole 64 x tile_n S tile (the split by keys: half of it each)
    assert report["sass"]["MUFU.EX2"] == cfg.tile_m * cfg.tile_n // 128


# varlen (packed sequences): the dense kernel's WGMMA pipeline, K / V / Q / dO / LSE / D by TMA from
# each sequence's offsets, dQ by TMA reduce-adds, dK / dV by row stores (no TMA store), no spills
# CI: every hdim with one mask and every mask at least once (j = i mod 4); make test-full: all
@pytest.mark.parametrize(("hdim", "mask"), [
    pytest.param(hdim, mask, marks=() if j == i % len(MASKS) else pytest.mark.variant)
    for i, hdim in enumerate(BWD_HDIMS) for j, mask in enumerate(MASKS)])
def test_backward_varlen_compiles(hdim, mask):
    from flashhopper.compile import inspect_cubin
    from flashhopper.hopper.runtime import kernel_cubin, kernel_launch
    from flashhopper.plan import bwd_config_varlen

    cfg = bwd_config_varlen("bf16", hdim, **MASKS[mask])
    report = inspect_cubin(kernel_cubin(cfg), smem_bytes=kernel_launch(cfg)["smem"])
    sass = report["sass"]
    if cfg.kv_split == "keys":
        _check_keys_report(report, cfg, mask)
    else:  # the wide kernel: the same WGMMAs and waits as without varlen
        dense = dataclasses.replace(cfg, varlen=False)
        want = inspect_cubin(kernel_cubin(dense), smem_bytes=kernel_launch(dense)["smem"])["sass"]
        assert (sass["HGMMA"], sass["HGMMA_WAITS"]) == (want["HGMMA"], want["HGMMA_WAITS"])
    assert sass["UTMALDG"] >= 6 and sass["UTMAREDG"] >= 1 and sass.get("UTMASTG", 0) == 0
    assert sass["LDL"] == 0 and sass["STL"] == 0 and report["spill_bytes"] == 0
    # a sequence's rows past its seqused zeroed in smem: once for K / V before the loop, once for Q / dO
    # at the start of a step (outside the mask_runs bodies), each ending on the consumers' barrier
    assert _barrier_syncs(kernel_cubin(cfg)).count(int(BwdBarrier.UNUSED_ROWS)) == 2
    assert BwdBarrier.UNUSED_ROWS == BwdWideBarrier.UNUSED_ROWS
    pre = inspect_cubin(kernel_cubin(BwdPreConfig.of(cfg)))
    assert pre["spill_bytes"] == 0 and pre["sass"]["LDG.128"] > 0


def _barrier_syncs(cubin) -> list:
    """The immediate named-barrier ids of the kernel's BAR.SYNC instructions, in SASS order."""
    import os
    import tempfile

    from flashhopper.compile import _run, find_sass_tools, parse_sass

    cuobjdump, _ = find_sass_tools()
    with tempfile.TemporaryDirectory(prefix="flashhopper-") as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        instructions = parse_sass(_run([cuobjdump, "-sass", path], dict(os.environ)))
    return [int(args.split(",")[0], 16) for op, args in instructions
            if op.startswith("BAR.SYNC") and args.startswith("0x")]


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_split_head_dims_backward_compiles(dtype, varlen):
    """(192, 128)'s backward: hdim 192's main kernel (V and dO padded to 192 columns by the host, no
    config of its own) and a preprocess that forms D over 128 columns and leaves dQ to the host; it
    compiles spill-free with 16-byte loads."""
    from flashhopper.compile import inspect_cubin
    from flashhopper.hopper.runtime import kernel_cubin
    from flashhopper.plan import bwd_config_varlen

    for mask in MASKS.values():
        cfg = (bwd_config_varlen if varlen else bwd_config)(dtype, 192, **mask)
        pre_cfg = BwdPreConfig.of(cfg, 128)
        assert (pre_cfg.hdim, pre_cfg.zero_dq, pre_cfg.pdl, pre_cfg.varlen) == (128, False, False, varlen)
        assert pre_cfg.scale_d == cfg.scale_in_ds and BwdPreConfig.of(cfg, 192) == BwdPreConfig.of(cfg)
    pre = inspect_cubin(kernel_cubin(pre_cfg))
    assert pre["spill_bytes"] == 0 and pre["sass"]["LDL"] == 0 and pre["sass"]["LDG.128"] > 0
