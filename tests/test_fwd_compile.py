"""Every forward variant we dispatch compiles for sm_90a without a GPU, with the structure the
design needs visible in its SASS and no register spills."""

from __future__ import annotations

import dataclasses

import pytest
from smem_check import assert_smem

from flashhopper import plan
from flashhopper.compile import TARGET_ARCH, ensure_arch_env, inspect_kernel
from flashhopper.config import SMEM_CAPACITY, SUPPORTED_HDIMS, FwdConfig
from flashhopper.plan import fwd_config

_PERSISTENT = {"persistent": True, "dynamic_sched": True}
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
    _check_forward(dtype, hdim, MASKS[mask])


# hdim 64 runs 3 consumer warpgroups at 160 registers with every mask, the tightest fit: the
# combined masks (tanh on top of the mask) are checked there too
@pytest.mark.parametrize("mask", ["causal", "local"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_forward_hdim64_mask_with_softcap_compiles(dtype, mask):
    _check_forward(dtype, 64, {**MASKS[mask], "softcap": True})


# hdim 64 where 192 rows would pad the query length (plan.fwd_narrow_tile): 128 x 128, 2 consumer
# warpgroups, every mask
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_forward_hdim64_narrow_tile_compiles(dtype, mask):
    _check_forward(dtype, 64, MASKS[mask], tile_m=128, num_consumer_wg=2)


# hdim 256 causal on short sequences (plan.fwd_short_causal): 64-key tiles on the persistent grid
# up to 512, 80-key tiles on it up to 1024, O in V's stages in both
@pytest.mark.parametrize("bracket", [1, 2])
@pytest.mark.parametrize("softcap", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_forward_hdim256_short_causal_compiles(dtype, softcap, bracket):
    cfg = fwd_config(dtype, 256, causal=True, softcap=softcap, short=bracket)
    assert cfg.o_v_stages and cfg.persistent and cfg.tile_n == (64 if bracket == 1 else 80)
    _check_forward(dtype, 256, {**MASKS["causal"], "softcap": softcap}, tile_n=cfg.tile_n,
                   persistent=cfg.persistent, dynamic_sched=cfg.dynamic_sched, o_in_v=True, o_v_stages=True)


# hdim 192 causal on short sequences: the persistent grid with O in V's stages
@pytest.mark.parametrize("softcap", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_forward_hdim192_short_causal_compiles(dtype, softcap):
    cfg = fwd_config(dtype, 192, causal=True, softcap=softcap, short=1)
    assert cfg.o_v_stages and cfg.persistent and cfg.dynamic_sched
    _check_forward(dtype, 192, {**MASKS["causal"], "softcap": softcap}, persistent=True, dynamic_sched=True,
                   o_in_v=True, o_v_stages=True)


# hdim 192 without a mask on short sequences: O in V's stages
@pytest.mark.parametrize("softcap", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_forward_hdim192_short_nomask_compiles(dtype, softcap):
    cfg = fwd_config(dtype, 192, softcap=softcap, short=True)
    assert cfg.o_v_stages and cfg.persistent
    _check_forward(dtype, 192, {**MASKS["softcap" if softcap else "none"]}, o_in_v=True, o_v_stages=True)


# each warpgroup's O part in a V stage of its own (FwdConfig.o_v_stages, dispatched at hdim 256 on the
# persistent grid): the same GEMMs and O stores as with O in Q's buffer, no spills, every mask, hdim
# 192 and 128 as the GPU tests run them
@pytest.mark.parametrize(("dtype", "hdim", "mask", "fields"), [
    ("bf16", 256, "none", {}), ("fp16", 256, "softcap", {}), ("bf16", 256, "local", {}),
    ("bf16", 256, "causal", _PERSISTENT), ("bf16", 192, "causal", _PERSISTENT), ("bf16", 128, "causal", {}),
])
def test_forward_o_v_stages_compiles(dtype, hdim, mask, fields):
    report = _check_forward(dtype, hdim, MASKS[mask], o_in_v=True, o_v_stages=True, **fields)
    # lazy_max (dispatched at hdim 128) does not take O in V: the comparison is without it too
    default = inspect_kernel("fwd", dtype=dtype, hdim=hdim, **MASKS[mask], **fields, o_in_v=False,
                             o_v_stages=False, lazy_max=False)["sass"]
    assert report["sass"]["HGMMA"] == default["HGMMA"] and report["sass"]["UTMASTG"] == default["UTMASTG"]


# hdim 64 on short sequences (plan.fwd_short_qring): a Q ring of two and three K / V stages, at
# both of hdim 64's query tiles (192 rows without a mask, 128 under a causal mask at 512 / 1k)
@pytest.mark.parametrize("mask", ["none", "causal", "softcap"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_forward_hdim64_short_qring_compiles(dtype, mask):
    cfg = fwd_config(dtype, 64, **MASKS[mask], narrow=mask == "causal", qring=True)
    assert (cfg.q_stages, cfg.num_stages) == (2, 3)
    _check_forward(dtype, 64, MASKS[mask], tile_m=cfg.tile_m, num_consumer_wg=cfg.num_consumer_wg,
                   q_stages=2, num_stages=3)

# K released right after the P @ V wait instead of after the softmax (late_k_release off, as FA4's
# schedule does); every hdim
FA4_SCHEDULE = {"late_k_release": False}


@pytest.mark.variant  # not dispatched (late_k_release is): make test-full
@pytest.mark.parametrize("mask", ["none", "causal", "local"])
@pytest.mark.parametrize("hdim", SUPPORTED_HDIMS)
def test_forward_fa4_schedule_compiles(hdim, mask):
    _check_forward("bf16", hdim, MASKS[mask], **FA4_SCHEDULE)


# lazy_max (the running max kept in mask-free steps, a warp-uniform exact redo): two P operands and a
# branch after the P @ V wait must leave every WGMMA asynchronous and spill nothing
@pytest.mark.parametrize(("dtype", "hdim", "mask"), [
    ("bf16", 128, "none"), ("bf16", 128, "causal"), ("fp16", 128, "local"), ("bf16", 128, "softcap"),
    ("bf16", 96, "none"), ("bf16", 64, "none"), ("bf16", 64, "causal")])
@pytest.mark.parametrize("tile", ["128x128", "192x64"])
def test_forward_lazy_max_compiles(dtype, hdim, mask, tile):
    # hdim 64: 128 x 128 tiles, or three warpgroups (160 registers) with 64-key blocks (not timed yet)
    if hdim != 64 and tile != "128x128":
        pytest.skip("hdim 64's tile variants")
    tile_m, tile_n = map(int, tile.split("x"))
    fields = {"tile_m": tile_m, "num_consumer_wg": tile_m // 64, "tile_n": tile_n} if hdim == 64 else {}
    _check_forward(dtype, hdim, MASKS[mask], lazy_max=True, **fields)


def test_lazy_max_takes_effect_only_where_it_fits():
    assert FwdConfig(dtype="bf16", hdim=128, lazy_max=True).lazy_max_active
    assert FwdConfig(dtype="bf16", hdim=64, lazy_max=True).lazy_max_active  # 128 x 128
    three_wg = {"tile_m": 192, "num_consumer_wg": 3}
    assert FwdConfig(dtype="bf16", hdim=64, **three_wg, tile_n=64, lazy_max=True).lazy_max_active
    assert not FwdConfig(dtype="bf16", hdim=64, **three_wg, tile_n=96, lazy_max=True).lazy_max_active
    for fields in ({"rescale_o_before_pv": True}, {"softcap": True}, {"intra_wg_overlap": False},
                   {"hdim": 256, "tile_n": 80}, {"hdim": 64, "tile_m": 192, "num_consumer_wg": 3},
                   {"tile_n": 144}, {"cluster_m": 2}, {"o_in_v": True}):
        assert not FwdConfig(**{"dtype": "bf16", "hdim": 128, "lazy_max": True, **fields}).lazy_max_active
    assert fwd_config("bf16", 128).lazy_max and fwd_config("bf16", 128, local=True).lazy_max
    assert fwd_config("fp16", 96).lazy_max and not fwd_config("bf16", 96, causal=True).lazy_max
    assert not fwd_config("bf16", 128, softcap=True).lazy_max and not fwd_config("bf16", 64).lazy_max


# rescale_o_before_pv against its default (on for hdim > 128): O rescaled between the QK^T and the
# P @ V issue must not serialize the WGMMAs or spill either way
@pytest.mark.parametrize("mask", ["none", "causal", "local"])
@pytest.mark.parametrize("hdim", [128, 256])
def test_forward_rescale_switch_flipped_compiles(hdim, mask):
    _check_forward("bf16", hdim, MASKS[mask], rescale_o_before_pv=hdim <= 128)


# per-warpgroup epilogue with the ping-pong token carried across tiles (FwdConfig.wg_epilogue,
# dispatched) against the shared epilogue: every hdim (3 consumer warpgroups at
# hdim 64; O staged in Q's buffer at 192 / 256), the serial step, no ping-pong; same WGMMA
# structure, one O store per 64-column box of each warpgroup's part
@pytest.mark.parametrize(("dtype", "hdim", "mask", "fields"), [
    ("bf16", 128, "none", {}), ("bf16", 128, "causal", {}), ("fp16", 128, "local", {}),
    ("bf16", 64, "none", {}), ("fp16", 64, "softcap", {}), ("bf16", 64, "causal", {}),
    ("bf16", 96, "none", {}), ("bf16", 192, "causal", {}), ("bf16", 256, "none", {}),
    ("fp16", 256, "causal", {}),
    ("bf16", 128, "causal", {"intra_wg_overlap": False}), ("bf16", 128, "none", {"pingpong": False}),
])
def test_forward_wg_epilogue_compiles(dtype, hdim, mask, fields):
    fields = {"o_in_v": False, "o_v_stages": False, **fields}  # both sides with O in Q's buffer at 256
    report = _check_forward(dtype, hdim, MASKS[mask], wg_epilogue=True, **fields)
    shared = {**fields, "wg_epilogue": False}
    default = inspect_kernel("fwd", dtype=dtype, hdim=hdim, **MASKS[mask], **shared)["sass"]
    sass = report["sass"]
    assert sass["HGMMA"] == default["HGMMA"] and sass["UTMALDG"] == default["UTMALDG"]
    # the whole tile's store was hdim / 64 boxes (128-byte swizzle rows); each warpgroup's part is
    # as many, issued from one code path whose warpgroup index is in a register
    assert sass["UTMASTG"] == default["UTMASTG"]


# FwdConfig.skip_idle_wg: the idle warpgroup's walk (waits, releases, ping-pong turns only) beside
# the full one; the same GEMMs, one WGMMA wait per commit group, no spills, with both epilogues
@pytest.mark.parametrize(("dtype", "hdim", "mask", "fields"), [
    ("bf16", 64, "none", {}), ("fp16", 64, "causal", {}), ("bf16", 64, "local", {}),
    ("bf16", 64, "softcap", {}), ("bf16", 128, "none", {}), ("bf16", 256, "causal", {}),
    ("bf16", 64, "none", {"wg_epilogue": False}), ("bf16", 64, "causal", {"intra_wg_overlap": False}),
    ("bf16", 128, "none", {"cluster_m": 2, "persistent": False, "dynamic_sched": False}),
])
def test_forward_skip_idle_wg_compiles(dtype, hdim, mask, fields):
    cfg = fwd_config(dtype, hdim, **MASKS[mask])
    fields = {"wg_epilogue": cfg.wg_epilogue, **fields}
    report = _check_forward(dtype, hdim, MASKS[mask], skip_idle_wg=True, **fields)
    default = inspect_kernel("fwd", dtype=dtype, hdim=hdim, **MASKS[mask], **fields)["sass"]
    assert report["sass"]["HGMMA"] == default["HGMMA"]


# FwdConfig.q_stages = 2 (a Q ring of two): the same GEMMs and one WGMMA wait per commit group, no
# spills, at every head dim whose O has its own smem tile
@pytest.mark.parametrize(("dtype", "hdim", "mask", "fields"), [
    ("bf16", 64, "none", {}), ("fp16", 64, "causal", {}), ("bf16", 64, "local", {}),
    ("bf16", 64, "softcap", {}), ("bf16", 128, "none", {}), ("bf16", 128, "causal", {}),
    ("bf16", 96, "causal", {}), ("bf16", 64, "causal", {"tile_m": 128, "num_consumer_wg": 2}),
])
def test_forward_q_ring_compiles(dtype, hdim, mask, fields):
    report = _check_forward(dtype, hdim, MASKS[mask], q_stages=2, **fields)
    default = inspect_kernel("fwd", dtype=dtype, hdim=hdim, **MASKS[mask], **fields)
    assert report["sass"]["HGMMA"] == default["sass"]["HGMMA"]
    q_tile = 2 * hdim * fields.get("tile_m", fwd_config(dtype, hdim, **MASKS[mask]).tile_m)
    # one more Q tile; its 2 mbarriers share the padding up to sQ's 1 KiB alignment, or add a KiB
    assert report["smem_bytes"] - default["smem_bytes"] - q_tile in (0, 1024)


# FwdConfig.o_in_v (O staged in V's ring, FA3's layout): the same GEMMs, one WGMMA wait per commit
# group, no spills, at every hdim and mask, both epilogues, with the Q ring and a third K / V stage
# at hdim 128 (which the freed O tile makes room for), and with the idle-warpgroup walk (hdim 64's
# 3 warpgroups; under a causal mask that spills 8 bytes at 160 registers, so not there)
@pytest.mark.parametrize(("dtype", "hdim", "mask", "fields"), [
    ("bf16", 256, "none", {}), ("fp16", 256, "causal", {}), ("bf16", 256, "local", {}),
    ("bf16", 256, "softcap", {}), ("bf16", 192, "none", {}), ("bf16", 128, "none", {"num_stages": 3}),
    ("bf16", 128, "causal", {"num_stages": 3}), ("bf16", 128, "none", {"q_stages": 2}),
    ("bf16", 64, "none", {}), ("bf16", 96, "none", {}),
    ("bf16", 256, "none", {"wg_epilogue": False}),
    ("bf16", 256, "causal", {"tile_n": 64, "persistent": True, "dynamic_sched": True}),
])
def test_forward_o_in_v_compiles(dtype, hdim, mask, fields):
    fields = {"o_v_stages": False, **fields}  # the one hand-off for all of sV (o_v_stages: below)
    report = _check_forward(dtype, hdim, MASKS[mask], o_in_v=True, **fields)
    cfg = fwd_config(dtype, hdim, **MASKS[mask])
    base = {"wg_epilogue": cfg.wg_epilogue, "skip_idle_wg": cfg.skip_idle_wg, **fields, "o_in_v": False,
            "lazy_max": False}  # lazy_max does not take O in V (hdim 96 / 128 dispatch it)
    default = inspect_kernel("fwd", dtype=dtype, hdim=hdim, **MASKS[mask], **base)
    assert report["sass"]["HGMMA"] == default["sass"]["HGMMA"]
    assert report["sass"]["UTMASTG"] == default["sass"]["UTMASTG"]
    # the O tile's smem, if it had one, is gone; two mbarriers more for the O-read hand-off, in the
    # padding up to the 1 KiB-aligned buffers or one KiB more
    o_tile = 2 * hdim * cfg.tile_m if default["smem_bytes"] - report["smem_bytes"] > 1024 else 0
    assert default["smem_bytes"] - report["smem_bytes"] - o_tile in (0, -1024)


def _check_forward(dtype, hdim, mask, **overrides):
    report = inspect_kernel("fwd", dtype=dtype, hdim=hdim, **mask, **overrides)
    sass = report["sass"]
    assert sass["HGMMA"] > 0 and sass["QGMMA"] == 0
    assert sass["UTMALDG"] >= 3  # Q, K, V
    assert sass["UTMASTG"] >= 1  # O
    assert sass["SYNCS"] > 0  # mbarrier pipelines
    regs = sass["USETMAXREG"]
    assert min(regs) <= 56 and max(regs) >= 160, regs  # producer gives back, consumers take
    assert sass["LDL"] == 0 and sass["STL"] == 0 and report["spill_bytes"] == 0
    assert report["smem_bytes"] <= SMEM_CAPACITY
    assert (sass["MUFU.TANH"] > 0) == mask.get("softcap", False)
    if overrides.get("intra_wg_overlap", True):
        # lazy_max: the mask-free run is an exact odd step and a loop of lazy step pairs
        cfg = dataclasses.replace(fwd_config(dtype, hdim, **mask), **overrides)
        extra = 4 if cfg.lazy_max_active else 0
        assert sass["HGMMA_WAITS"] == _commit_groups(**mask) + extra, "ptxas serialized the WGMMAs"
    return report


def _commit_groups(causal=False, local=False, softcap=False):
    """One WGMMA wait per commit group: the peeled first QK^T, QK^T and P @ V in each of the
    mainloop's runs (edge-crossing blocks with causal/local, mask-free, left-window with local),
    and the last P @ V."""
    return 2 + 2 * (1 + (causal or local) + local)


@pytest.mark.parametrize("tile_n", [144, 160, 176])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_forward_wide_key_tiles(dtype, tile_n):
    """hdim 128 with the key-block widths a config sweep times (FA3 runs 128 x 176): P has
    72-88 elements per thread, whose conversion must not leave 16-bit halves to be packed in
    front of each P @ V WGMMA (ptxas then waits on every one of them)."""
    report = inspect_kernel("fwd", dtype=dtype, hdim=128, tile_n=tile_n)
    sass = report["sass"]
    assert sass["HGMMA"] == 2 * (128 // 16 + tile_n // 16)
    assert sass["HGMMA_WAITS"] == _commit_groups()
    assert sass["LDL"] == 0 and sass["STL"] == 0 and report["spill_bytes"] == 0
    assert report["smem_bytes"] <= SMEM_CAPACITY


def test_mask_columns_are_thread0_columns_plus_one_offset():
    # mask.apply_mask compares thread 0's (compile-time) coordinates against bounds shifted by one
    # per-thread offset; that needs every thread's accumulator coordinates to be thread 0's plus a
    # constant, for each dispatched S tile (sampled threads: quad lanes, warps, warpgroups)
    ensure_arch_env()
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils

    from flashhopper.hopper import layout as L
    from flashhopper.plan import fwd_config

    tiles = sorted({(cfg.num_consumer_wg, cfg.tile_n) for cfg in (
        fwd_config("bf16", hdim, causal=True) for hdim in SUPPORTED_HDIMS)})
    coords = {}

    @cute.jit
    def trace():
        for wg, tile_n in tiles:
            mma = sm90_utils.make_trivial_tiled_mma(
                cutlass.BFloat16, cutlass.BFloat16, cute.nvgpu.OperandMajorMode.K,
                cute.nvgpu.OperandMajorMode.K, cutlass.Float32, atom_layout_mnk=(wg, 1, 1),
                tiler_mn=(64, tile_n))
            cS = cute.make_identity_tensor((64 * wg, tile_n))
            for t in (0, 1, 3, 4, 31, 32, 127, 128 * wg - 1):
                rc = L.acc_rows_cols(mma.get_slice(t).partition_C(cS))
                coords[wg, tile_n, t] = [rc[r, c] for r in range(cute.size(rc, mode=[0]))
                                         for c in range(cute.size(rc, mode=[1]))]

    # the arch as an option: an earlier test may have imported cutlass before ensure_arch_env()
    cute.compile(trace, options=f"--gpu-arch {TARGET_ARCH}")
    assert {wg for wg, _ in tiles} == {2, 3}
    for (wg, tile_n, t), rc in coords.items():
        rc0 = coords[wg, tile_n, 0]
        assert len(rc) == 64 * tile_n // 128
        offsets = {(a[0] - b[0], a[1] - b[1]) for a, b in zip(rc, rc0, strict=True)}
        assert len(offsets) == 1, (wg, tile_n, t, offsets)


# FwdConfig.cluster_m = 2 (hopper/fwd_cluster.py): 2x1 cluster along M, K/V tiles split in halves and
# multicast to both CTAs; the static schedule (the dynamic one is refused), no causal/local mask
CLUSTER = {"cluster_m": 2, "dynamic_sched": False}


@pytest.mark.parametrize("softcap", [False, True])
@pytest.mark.parametrize("hdim", SUPPORTED_HDIMS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_forward_cluster_compiles(dtype, hdim, softcap):
    mask = {"softcap": True} if softcap else {}
    if softcap and (dtype, hdim) != ("bf16", 128):
        pytest.skip("softcap checked once (bf16, hdim 128): it does not touch the loads")
    if dtype == "fp16" and hdim not in (128, 256):
        pytest.skip("fp16 checked at hdim 128 and 256: the loads do not depend on the dtype")
    sass = _check_forward(dtype, hdim, mask, **CLUSTER)["sass"]
    # 5 load sites (Q; first K, K and V in the loop, last V), each one TMA per swizzle-atom column
    # block of the tile: Q stays per CTA, all four K/V sites multicast
    boxes = sass["UTMALDG"] // 5
    assert sass["UTMALDG"] == 5 * boxes and sass["UTMALDG_MULTICAST"] == 4 * boxes
    # K and V consumer releases arrive through the cluster window (lane r -> rank r); Q's stays local
    assert sass["SYNCS_ARRIVE_RED"] >= 2
    assert sass["UCGABAR"] == 2  # barrier init made visible cluster-wide: one arrive, one wait


def test_forward_default_has_no_cluster_instructions():
    sass = inspect_kernel("fwd", dtype="bf16", hdim=128)["sass"]
    assert sass["UTMALDG_MULTICAST"] == 0 and sass["SYNCS_ARRIVE_RED"] == 0 and sass["UCGABAR"] == 0
    assert sass["ACQBULK"] == sass["PREEXIT"] == 0  # launched as no kernel's dependent (FwdConfig.pdl)


# FP8 (e4m3) forward: QGMMA only, V transposed by the producer warpgroup (hopper/fp8.py: per unit of 16 keys x
# 32 head-dim columns one LDSM.T x4, 4 PRMT and one STSM x4, each warp's units unrolled once; the epilogue's
# STSM besides), one QGMMA wait per commit group, no spills, the FP8 register split
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("hdim", [64, 96, 128, 192, 256])
def test_forward_fp8_compiles(hdim, mask):
    from flashhopper.hopper import fp8 as F8

    cfg = fwd_config("e4m3", hdim, **MASKS[mask])
    report = inspect_kernel("fwd", dtype="e4m3", hdim=hdim, **MASKS[mask])
    sass = report["sass"]
    assert sass["HGMMA"] == 0 and sass["QGMMA"] > 0
    assert sass["UTMALDG"] >= 3 and sass["UTMASTG"] >= 1
    units = F8.transpose_units(cfg.tile_n, hdim)
    assert sass["LDSM"] == units and sass["STSM"] > units and sass["PRMT"] >= 4 * units
    assert sass["LDL"] == 0 and sass["STL"] == 0 and report["spill_bytes"] == 0
    assert sorted(sass["USETMAXREG"]) == [cfg.producer_regs, cfg.consumer_regs]
    assert sass["HGMMA_WAITS"] == _commit_groups(**MASKS[mask]), "ptxas serialized the WGMMAs"
    assert (sass["MUFU.TANH"] > 0) == (mask == "softcap")
    assert report["smem_bytes"] <= SMEM_CAPACITY


# FP8 with per-token q / k descales (FwdConfig.qk_descale "token", hopper/fp8_descale.py): the producer
# warp reads each key block's k descales (LDG) and stages them in smem (STS), the consumers read theirs
# as 16-byte loads (tile_n / 16 a block, per step of the mainloop's runs) and keep the FP8 kernel's
# structure: QGMMA only, one wait per commit group, the FP8 register split, no spills. CI compiles two
# (hdim 128 masked: 64 keys a block; hdim 256 with softcap); every one under FH_TEST_FULL, and
# tests/test_dispatched.py compiles them all with `make test-full` (`flashhopper precompile` builds them)
_TOKEN_CI = {(128, "causal"), (256, "softcap")}


@pytest.mark.parametrize(("hdim", "mask"), [
    pytest.param(hdim, mask, marks=() if (hdim, mask) in _TOKEN_CI else pytest.mark.variant)
    for hdim in SUPPORTED_HDIMS for mask in MASKS])
def test_forward_fp8_token_descales_compile(hdim, mask):
    from flashhopper.compile import inspect_cubin
    from flashhopper.hopper.runtime import kernel_cubin, kernel_launch

    cfg = fwd_config("e4m3", hdim, qk_descale="token", **MASKS[mask])
    assert cfg.token_descales
    report = inspect_cubin(kernel_cubin(cfg), smem_bytes=kernel_launch(cfg)["smem"])
    sass = report["sass"]
    assert sass["HGMMA"] == 0 and sass["QGMMA"] > 0 and sass["UTMALDG"] >= 3 and sass["UTMASTG"] >= 1
    assert sass["LDS.128"] >= (cfg.tile_n // 16) * (2 + (mask in ("causal", "local")) + (mask == "local"))
    assert sass["LDG"] >= 2 * (cfg.tile_n // 32)  # the producer's k descales (first block, loop)
    assert sass["LDL"] == 0 and sass["STL"] == 0 and report["spill_bytes"] == 0
    assert sorted(sass["USETMAXREG"]) == [cfg.producer_regs, cfg.consumer_regs]
    assert sass["HGMMA_WAITS"] == _commit_groups(**MASKS[mask]), "ptxas serialized the WGMMAs"
    assert (sass["MUFU.TANH"] > 0) == (mask == "softcap")
    assert_smem(report, cfg)


# varlen (packed sequences): the dense kernel's WGMMA pipeline (one wait per commit group), no TMA
# store of O (16-byte row stores up to each sequence's end instead), no spills
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("hdim", SUPPORTED_HDIMS)
def test_forward_varlen_compiles(hdim, mask):
    from flashhopper.compile import inspect_cubin
    from flashhopper.hopper.runtime import kernel_cubin, kernel_launch
    from flashhopper.plan import fwd_config_varlen

    cfg = fwd_config_varlen("bf16", hdim, **MASKS[mask])
    report = inspect_cubin(kernel_cubin(cfg), smem_bytes=kernel_launch(cfg)["smem"])
    sass = report["sass"]
    assert sass["HGMMA"] > 0 and sass["UTMALDG"] >= 3 and sass["UTMASTG"] == 0
    assert sass["HGMMA_WAITS"] == _commit_groups(**MASKS[mask]) + (4 if cfg.lazy_max_active else 0)
    assert sass["LDL"] == 0 and sass["STL"] == 0 and report["spill_bytes"] == 0
    assert report["smem_bytes"] <= SMEM_CAPACITY


# FP8 ablation (FwdConfig.vt_in_gmem): V^T loaded as given, no transposer (no LDSM.T / STSM units)
@pytest.mark.variant
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hdim", [64, 128, 256])
def test_forward_fp8_vt_given_compiles(hdim, causal):
    cfg = dataclasses.replace(fwd_config("e4m3", hdim, causal=causal), vt_in_gmem=True)
    report = inspect_kernel("fwd", dtype="e4m3", hdim=hdim, causal=causal, vt_in_gmem=True)
    sass = report["sass"]
    assert sass["QGMMA"] > 0 and sass["HGMMA_WAITS"] == _commit_groups(causal=causal)
    assert sass["LDS"] <= 2 and sass["STS"] <= 2 and sass["LDSM"] == 0  # the epilogue's, no transposer
    assert sass["LDL"] == 0 and sass["STL"] == 0 and report["spill_bytes"] == 0
    assert report["smem_bytes"] < cfg.smem_bytes() + 3 * 1024


# FP8 two-level accumulation (FwdConfig.pv_two_level): a second O accumulator, no spills, the same
# WGMMA pipeline; where the registers allow it (hdim 64 / 96 at the FP8 tile, hdim 128 at 96 keys)
@pytest.mark.variant
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hdim,tile_n", [(64, 128), (96, 128), (128, 96)])
def test_forward_fp8_two_level_compiles(hdim, tile_n, causal):
    cfg = dataclasses.replace(fwd_config("e4m3", hdim, causal=causal), pv_two_level=True, tile_n=tile_n)
    report = inspect_kernel("fwd", dtype="e4m3", hdim=hdim, causal=causal, pv_two_level=True, tile_n=tile_n)
    sass = report["sass"]
    assert sass["QGMMA"] > 0 and sass["HGMMA_WAITS"] == _commit_groups(causal=causal)
    assert sass["LDL"] == 0 and sass["STL"] == 0 and report["spill_bytes"] == 0
    assert sorted(sass["USETMAXREG"]) == [cfg.producer_regs, cfg.consumer_regs]


# FP8 candidates (plan.FP8_TILE_CANDIDATES, not dispatched): wider key blocks and the 232 / 40 register split
# compile with no spills, one QGMMA wait per commit group and the split asked for, with no mask and causal
# (make test-full: no user is dispatched them)
@pytest.mark.variant
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("hdim", "fields"), [(hdim, text) for hdim, texts in plan.FP8_TILE_CANDIDATES.items()
                                              for text in texts])
def test_forward_fp8_tile_candidates_compile(hdim, fields, causal):
    from flashhopper.compile import inspect_cubin
    from flashhopper.config import parse_overrides
    from flashhopper.hopper import fp8 as F8
    from flashhopper.hopper.runtime import kernel_cubin, kernel_launch

    cfg = dataclasses.replace(fwd_config("e4m3", hdim, causal=causal), **parse_overrides(fields))
    cfg.check()
    report = inspect_cubin(kernel_cubin(cfg), smem_bytes=kernel_launch(cfg)["smem"])
    sass = report["sass"]
    assert sass["LDSM"] == F8.transpose_units(cfg.tile_n, hdim)
    assert sass["LDL"] == 0 and sass["STL"] == 0 and report["spill_bytes"] == 0
    assert sorted(sass["USETMAXREG"]) == [cfg.producer_regs, cfg.consumer_regs]
    assert sass["HGMMA_WAITS"] == _commit_groups(causal=causal), "ptxas serialized the WGMMAs"
    assert_smem(report, cfg)


# (hdim, dv) = (192, 128), MLA prefill's shape: S over 192, O over 128 (half the O registers of hdim 192)
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("mask", list(MASKS))
def test_forward_split_hdims_compile(mask, varlen):
    from flashhopper.compile import inspect_cubin
    from flashhopper.hopper.runtime import kernel_cubin, kernel_launch
    from flashhopper.plan import fwd_config_varlen

    cfg = (fwd_config_varlen if varlen else fwd_config)("bf16", 192, dv=128, **MASKS[mask])
    assert (cfg.hdim, cfg.hdim_v) == (192, 128)
    report = inspect_cubin(kernel_cubin(cfg), smem_bytes=kernel_launch(cfg)["smem"])
    sass = report["sass"]
    # S: 192 / 16 k-blocks; P @ V: tile_n / 16, each WGMMA N = 128
    assert sass["HGMMA"] % (192 // 16 + cfg.tile_n // 16) == 0 and sass["UTMALDG"] >= 3
    assert sass["HGMMA_WAITS"] == _commit_groups(**MASKS[mask])
    assert sass["LDL"] == 0 and sass["STL"] == 0 and report["spill_bytes"] == 0
    assert report["smem_bytes"] <= SMEM_CAPACITY


# The 1-warpgroup decode tile (plan.fwd_config_decode; kvcache's rearranged decode runs on it only with
# FLASHHOPPER_EXPERIMENTAL_DECODE_TILE=1): 64 rows, no ping-pong, the deep K / V ring. Every config
# (and causal ones, which the decode call never takes) compiles with one WGMMA wait per commit group, the
# 1-warpgroup register split, 256 threads, no spills and O stored row by row. Two in the default
# compile set (hdim 128; hdim 256 with softcap, the most registers); the rest with FH_TEST_FULL=1.
_DECODE_CHEAP = {("bf16", 128, False), ("bf16", 256, True)}


def _decode_params():
    from flashhopper.plan import decode_kernels, fwd_config_decode

    causal = [fwd_config_decode("bf16", hdim, causal=True, softcap=softcap)
              for hdim, softcap in ((64, False), (128, True), (256, False))]
    cheap = lambda cfg: (cfg.dtype, cfg.hdim, cfg.softcap) in _DECODE_CHEAP and not (cfg.causal or cfg.dv)  # noqa: E731
    return [pytest.param(cfg, id=f"{cfg.dtype}-{cfg.hdim}-{cfg.hdim_v}-{'causal-' * cfg.causal}"
                                 f"{'softcap' if cfg.softcap else 'none'}",
                         marks=() if cheap(cfg) else pytest.mark.variant)
            for cfg in decode_kernels() + causal]


@pytest.mark.parametrize("cfg", _decode_params())
def test_forward_decode_tile_compiles(cfg):
    from flashhopper.compile import inspect_cubin
    from flashhopper.hopper.runtime import kernel_cubin, kernel_launch

    launch = kernel_launch(cfg)
    report = inspect_cubin(kernel_cubin(cfg), smem_bytes=launch["smem"])
    sass = report["sass"]
    assert (cfg.tile_m, cfg.num_consumer_wg, cfg.pingpong, cfg.varlen) == (64, 1, False, True)
    assert launch["block"] == [256, 1, 1] and sass["USETMAXREG"] == [cfg.producer_regs, cfg.consumer_regs]
    # QK^T: hdim / 16 WGMMAs (N = tile_n), P @ V: tile_n / 16 (N = dv), in each of the mainloop's sites
    assert sass["HGMMA"] == (2 + cfg.causal) * (cfg.hdim // 16 + cfg.tile_n // 16)
    assert sass["HGMMA_WAITS"] == _commit_groups(causal=cfg.causal), "ptxas serialized the WGMMAs"
    assert sass["UTMALDG"] >= 3 and sass["UTMASTG"] == 0  # O row by row (varlen)
    assert sass["LDL"] == 0 and sass["STL"] == 0 and report["spill_bytes"] == 0
    assert_smem(report, cfg)  # within the SM (hdim 256's three 64-key stages: all of it), and the model
    assert (sass["MUFU.TANH"] > 0) == cfg.softcap


# Paged K / V (FwdConfig.page_size; flash_attn_with_kvcache reads a paged cache through it where the page
# size serves): every config `flashhopper precompile` builds
# (plan.paged_kernels: the varlen tiles of every mask, softcap or not, the decode tile; pages of 16 to 256
# rows)
# compiles with one WGMMA wait per commit group, its tile's register split, no spills, and the K / V
# boxes of a key block (tile_n / page_size boxes of whole pages, or one box inside a page) issued by one
# loop at each load site: UTMALDG as many as the unpaged kernel's, Q once and K, V at two sites each, one
# per swizzle-atom column chunk of the head dim (on the path a converged warp runs: the varlen producer's
# search of its walk table leaves ptxas unsure of that, and it adds copies for a diverged warp). Two in
# the default compile set (pages of 16 under the 128-key varlen tile, 8 boxes a stage; the decode tile at
# hdim 256, 4 boxes of 16 of 4 chunks each); the rest with FH_TEST_FULL=1.
_PAGED_CHEAP = {("bf16", 128, 16, 2, False), ("bf16", 256, 16, 1, False)}


def _paged_params():
    from flashhopper.plan import paged_kernels

    def key(cfg):
        return (cfg.dtype, cfg.hdim, cfg.page_size, cfg.num_consumer_wg, cfg.causal)

    def cheap(cfg):
        return key(cfg) in _PAGED_CHEAP and not (cfg.local or cfg.softcap or cfg.dv)

    return [pytest.param(cfg, id=f"{cfg.dtype}-{cfg.hdim}{f'-{cfg.dv}' if cfg.dv else ''}-"
                                 f"page{cfg.page_size}-n{cfg.tile_n}-"
                                 f"{'decode' if cfg.num_consumer_wg == 1 else 'varlen'}-"
                                 f"{'causal' if cfg.causal else 'local' if cfg.local else 'none'}"
                                 f"{'-softcap' if cfg.softcap else ''}",
                         marks=() if cheap(cfg) else pytest.mark.variant)
            for cfg in paged_kernels()]


def _tma_column_chunks(hdim: int) -> int:
    """TMA instructions per box: the head dim in swizzle-atom widths (128 bytes, 64 at hdim 96)."""
    return hdim // next(w for w in (64, 32, 16) if hdim % w == 0)


@pytest.mark.parametrize("cfg", _paged_params())
def test_forward_paged_compiles(cfg):
    from flashhopper.compile import inspect_cubin
    from flashhopper.hopper.runtime import kernel_cubin, kernel_launch

    report = inspect_cubin(kernel_cubin(cfg), smem_bytes=kernel_launch(cfg)["smem"])
    sass = report["sass"]
    assert cfg.varlen and (cfg.tile_n % cfg.page_size == 0 or cfg.page_size % cfg.tile_n == 0)
    # Q once, K at two sites (hdim columns), V at two sites (dv columns)
    loads = 3 * _tma_column_chunks(cfg.hdim) + 2 * _tma_column_chunks(cfg.dv or cfg.hdim)
    assert sass["UTMALDG"] - sass["UTMALDG_DIVERGED"] == loads
    assert sass["UTMASTG"] == 0
    waits = _commit_groups(causal=cfg.causal, local=cfg.local) + (4 if cfg.lazy_max_active else 0)
    assert sass["HGMMA_WAITS"] == waits
    assert sass["USETMAXREG"] == sorted([cfg.producer_regs, cfg.consumer_regs])
    assert sass["LDL"] == 0 and sass["STL"] == 0 and report["spill_bytes"] == 0
    assert_smem(report, cfg)  # the unpaged tile's buffers: the boxes land in its stages


# The split decode walk (FwdConfig.split_kv, flash_attn_with_kvcache's decode): the unmasked varlen tile (or
# the 1-warpgroup decode tile; causal over packed tokens with token_rows) on the persistent static stride,
# each tile's item, split and keys by arithmetic, O stored by TMA into the partials (or the output itself).
# The varlen kernel's WGMMA pipeline and register split, no spills, O's TMA store one instruction a
# swizzle-atom column chunk, the loads as the varlen kernel's (Q once, K and V at two sites each; paged: the
# boxes of a key block by one loop a site) on the path a converged warp runs. Default set: bf16 hdim 128
# unpaged, paged 16 (and causal over packed tokens), and on the decode tile; every config `flashhopper
# precompile --decode --paged` builds with FH_TEST_FULL=1.
# (dtype, hdim, page size, warpgroups, softcap or dv, causal over packed tokens)
_SPLIT_CHEAP = {("bf16", 128, 0, 2, False, False), ("bf16", 128, 16, 2, False, False),
                ("bf16", 128, 0, 1, False, False), ("bf16", 128, 16, 2, False, True)}


def _split_params():
    from flashhopper.plan import PAGED_PAGE_SIZES, fwd_plan_split, split_kernels

    tiles = [fwd_plan_split("bf16", hdim, softcap, page_size=page, decode_tile=True)
             for hdim, softcap, page in ((64, False, 0), (128, False, 0), (128, False, 16), (256, True, 0))]

    def key(cfg):
        return (cfg.dtype, cfg.hdim, cfg.page_size, cfg.num_consumer_wg, cfg.softcap or bool(cfg.dv),
                cfg.token_rows)

    return [pytest.param(cfg, id=f"{cfg.dtype}-{cfg.hdim}-{cfg.hdim_v}-page{cfg.page_size}-n{cfg.tile_n}-"
                                 f"{'decode' if cfg.num_consumer_wg == 1 else 'varlen'}-"
                                 f"{'softcap' if cfg.softcap else 'none'}"
                                 f"{'-tokens' if cfg.token_rows else ''}",
                         marks=() if key(cfg) in _SPLIT_CHEAP else pytest.mark.variant)
            for cfg in split_kernels(page_sizes=(0, *PAGED_PAGE_SIZES)) + tiles]


@pytest.mark.parametrize("cfg", _split_params())
def test_forward_split_kv_compiles(cfg):
    from flashhopper.compile import inspect_cubin
    from flashhopper.hopper.runtime import kernel_cubin, kernel_launch

    report = inspect_cubin(kernel_cubin(cfg), smem_bytes=kernel_launch(cfg)["smem"])
    sass = report["sass"]
    assert cfg.split_kv and cfg.varlen and cfg.persistent and not cfg.dynamic_sched
    waits = _commit_groups(causal=cfg.causal, softcap=cfg.softcap)  # (causal: over packed tokens)
    assert sass["HGMMA_WAITS"] == waits + (4 if cfg.lazy_max_active else 0)
    assert sass["UTMASTG"] == _tma_column_chunks(cfg.hdim_v)  # O (its partial) by one TMA store
    assert sass["UTMALDG"] - sass["UTMALDG_DIVERGED"] == (3 * _tma_column_chunks(cfg.hdim)
                                                          + 2 * _tma_column_chunks(cfg.hdim_v))
    assert sass["USETMAXREG"] == sorted([cfg.producer_regs, cfg.consumer_regs])
    assert sass["LDL"] == 0 and sass["STL"] == 0 and report["spill_bytes"] == 0
    assert (sass["MUFU.TANH"] > 0) == cfg.softcap
    # FwdConfig.pdl: one wait for the kernel before it, one early launch of the next
    assert cfg.pdl and sass["ACQBULK"] == sass["PREEXIT"] == 1
    assert_smem(report, cfg)
