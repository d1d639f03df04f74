"""Every dispatched forward configuration fits the Hopper budgets; broken ones are refused by name."""

import dataclasses
import itertools

import pytest

from flashhopper import config, plan
from flashhopper.bench.ablation import ablation_switches
from flashhopper.config import (
    DTYPES,
    REGS_PER_SM,
    SMEM_CAPACITY,
    SUPPORTED_HDIMS,
    WARPGROUP_THREADS,
    FwdConfig,
    fwd_grid,
)
from flashhopper.plan import fwd_config

# causal and local are never both set: the runtime folds a causal window into `local`
MASKS = (
    {"causal": False, "local": False},
    {"causal": True, "local": False},
    {"causal": False, "local": True},
)
DISPATCHED = [
    (dtype, hdim, mask, softcap)
    for dtype, hdim, mask, softcap in itertools.product(DTYPES, SUPPORTED_HDIMS, MASKS, (False, True))
]


@pytest.mark.parametrize(("dtype", "hdim", "mask", "softcap"), DISPATCHED)
def test_dispatched_config_fits(dtype, hdim, mask, softcap):
    cfg = fwd_config(dtype, hdim, softcap=softcap, **mask)
    cfg.check()
    assert (cfg.dtype, cfg.hdim, cfg.causal, cfg.local, cfg.softcap) == (dtype, hdim, mask["causal"],
                                                                           mask["local"], softcap)
    # the budgets recomputed here rather than trusted to check()
    assert cfg.smem_bytes() <= SMEM_CAPACITY
    regs = WARPGROUP_THREADS * (cfg.producer_regs + cfg.consumer_regs * cfg.num_consumer_wg)
    assert regs <= config.register_pool(1 + cfg.num_consumer_wg) <= REGS_PER_SM
    assert cfg.accumulator_regs() < cfg.consumer_regs
    assert cfg.tile_m == 64 * cfg.num_consumer_wg and cfg.tile_n % 16 == 0
    assert cfg.num_threads == WARPGROUP_THREADS * (1 + cfg.num_consumer_wg)


def test_scheduling_switches_do_not_change_budgets():
    # the ablation turns them on and off on dispatched configs; that must never make one invalid
    switches = ablation_switches()
    for dtype, hdim, mask, softcap in DISPATCHED:
        base = fwd_config(dtype, hdim, softcap=softcap, **mask)
        for values in itertools.product((False, True), repeat=len(switches)):
            dataclasses.replace(base, **dict(zip(switches, values, strict=True))).check()


def test_rescale_o_before_pv_default():
    # FA3's RescaleOBeforeGemm: O rescaled under QK^T for hdim > 128 (every dtype and mask)
    for dtype, hdim, mask, softcap in DISPATCHED:
        assert fwd_config(dtype, hdim, softcap=softcap, **mask).rescale_o_before_pv == (hdim > 128)


def test_unsupported_hdim_is_refused():
    with pytest.raises(ValueError, match="hdim 80 not supported"):
        fwd_config("bf16", 80)


@pytest.mark.parametrize(
    ("overrides", "budget"),
    [
        ({"tile_n": 120}, "multiple of 16"),
        ({"tile_n": 8}, "multiple of 16"),
        ({"hdim": 256, "tile_n": 128}, "shared memory"),
        ({"tile_m": 128, "num_consumer_wg": 3}, "64 rows per consumer warpgroup"),
        ({"tile_m": 192, "num_consumer_wg": 2}, "64 rows per consumer warpgroup"),
        # fits shared memory with one stage, but S, P and O need more than 240 registers a thread
        ({"hdim": 256, "tile_n": 160, "num_stages": 1}, "accumulators need"),
        ({"dtype": "fp8"}, "dtype"),
        ({"num_consumer_wg": 4, "tile_m": 256}, "num_consumer_wg"),
        # ping-pong's turns are 256-thread barriers: one warpgroup would wait on them forever
        ({"num_consumer_wg": 1, "tile_m": 64}, "pingpong needs two or more consumer warpgroups"),
    ],
)
def test_invalid_configs_name_the_budget(overrides, budget):
    cfg = FwdConfig(**{"dtype": "bf16", "hdim": 128, **overrides})
    with pytest.raises(ValueError, match=budget):
        cfg.check()


def test_register_split_over_the_register_file(monkeypatch):
    # 128 * (24 + 2 * 248) = 66560 registers: more than one SM has
    monkeypatch.setitem(config.REG_SPLIT, 2, (248, 24))
    with pytest.raises(ValueError, match=r"register split 24/248 needs 66560 > 64512 registers"):
        FwdConfig(dtype="bf16", hdim=64).check()
    # 65536 fits the SM but not the CTA's launch pool of 384 x 168 (setmaxnreg.inc would wait forever)
    monkeypatch.setitem(config.REG_SPLIT, 2, (240, 32))
    with pytest.raises(ValueError, match=r"register split 32/240 needs 65536 > 64512 registers"):
        FwdConfig(dtype="bf16", hdim=64).check()
    with pytest.raises(ValueError, match=r"register split 32/240 needs 65536 > 64512 registers"):
        plan.bwd_config.__wrapped__("bf16", 128)  # not the cached config of an earlier test


def test_mask_kind_matches_the_reference_semantics():
    pytest.importorskip("cutlass")
    from flashhopper.plan import UNBOUNDED as _UNBOUNDED
    from flashhopper.plan import mask_kind as _mask_kind

    assert _mask_kind(False, (-1, -1)) == (False, False, _UNBOUNDED, _UNBOUNDED)
    assert _mask_kind(True, (-1, -1)) == (True, False, _UNBOUNDED, 0)
    assert _mask_kind(True, (-1, 5)) == (True, False, _UNBOUNDED, 0)  # causal wins on the right
    assert _mask_kind(True, (64, -1)) == (False, True, 64, 0)
    assert _mask_kind(False, (-1, 7)) == (False, True, _UNBOUNDED, 7)


@pytest.mark.parametrize("hdim", config.BWD_HDIMS)
@pytest.mark.parametrize("mask", MASKS)
def test_backward_configs_fit(hdim, mask):
    cfg = plan.bwd_config("bf16", hdim, **mask)
    cfg.check()
    assert cfg.smem_bytes() <= SMEM_CAPACITY
    regs = WARPGROUP_THREADS * (cfg.producer_regs + cfg.consumer_regs * cfg.num_consumer_wg)
    assert regs <= config.register_pool(1 + cfg.num_consumer_wg) <= REGS_PER_SM
    if hdim in plan.BWD_WIDE:
        # head-dim split: whole 64-row WGMMA M tiles per warpgroup, P and dS tiles in smem
        assert cfg.kv_split == "hdim"
        # whole 64-row WGMMA M tiles per warpgroup: head-dim rows, or keys (hdim 192, FA4's split)
        assert cfg.dkv_by_keys == (hdim == 192)
        assert cfg.dkv_by_keys or (cfg.hdim // cfg.num_consumer_wg) % 64 == 0
        assert cfg.tile_m == 64
        kv = 2 * cfg.tile_n * hdim * 2
        q_do = (cfg.num_stages + cfg.num_do_stages) * cfg.tile_m * hdim * 2
        p_ds = 2 * cfg.tile_m * cfg.tile_n * 2
        lse_d = (cfg.num_stages + cfg.num_do_stages) * cfg.tile_m * 4
        assert cfg.smem_bytes() >= kv + q_do + p_ds + lse_d
        # hdim 256 at FA3's 64 x 80 with one dO stage (dQ in two chunks); 192 at 64 x 96, 2 stages,
        # 2 warpgroups; dQ by TMA reduce-adds through one smem part, one P / dS pair
        expected = {256: (80, 1, 2, 2), 192: (96, 2, 1, 2)}[hdim]
        assert (cfg.tile_n, cfg.num_do_stages, cfg.num_dq_chunks, cfg.num_consumer_wg) == expected
        assert cfg.num_stages == 2 and cfg.ds_stages == 1 and cfg.dq_tma and cfg.dq_slots == 1
    else:
        assert cfg.kv_split == "keys"
        # 128 query rows per step at hdim 64 (FA3's tile), 64 at 96, FA3 / FA4's 80 at 128 (dQ
        # computed transposed)
        assert cfg.tile_m == {64: 128, 96: 64, 128: 80}[hdim]
        assert cfg.dq_transposed == (hdim == 128)
        # hdim 64: FA4's step order without a mask, masked steps only at the edges with one
        masked = bool(mask.get("causal") or mask.get("local"))
        assert cfg.dv_after_ds == (hdim == 64 and not masked and not mask.get("softcap"))
        assert cfg.ds_before_dv == (hdim in (64, 128) and not cfg.dv_after_ds)
        assert cfg.mask_runs == (hdim == 128 or (masked and hdim in (64, 96)))


@pytest.mark.parametrize(
    ("overrides", "budget"),
    [
        ({"hdim": 192, "num_consumer_wg": 2, "tile_n": 64}, "64-row WGMMA M tiles"),
        # S / dP WGMMA N is tile_n / W keys: a multiple of 8; dQ's K (and dV^T's N) a multiple of 16
        ({"hdim": 256, "num_consumer_wg": 2, "tile_n": 72}, "multiple of 8 keys"),
        ({"hdim": 192, "num_consumer_wg": 3, "tile_n": 80}, "multiple of 8 keys"),
        ({"hdim": 192, "num_consumer_wg": 3, "tile_n": 72}, "multiple of 16"),
        ({"hdim": 256, "num_consumer_wg": 2, "tile_n": 272, "do_stages": 1}, "up to 256"),
        # 80 keys of K and V next to two Q and two dO stages: 235600 B (FA3 runs 64 x 80 with one dO stage)
        ({"hdim": 256, "num_consumer_wg": 2, "tile_n": 80}, "shared memory 235600 B"),
        ({"hdim": 256, "num_consumer_wg": 2, "tile_n": 80, "do_stages": 2}, "shared memory"),
        # a whole 64-register dQ tile next to 160 of dK^T + dV^T: ptxas spilled 320 B and serialized
        # all 53 WGMMAs, hence dQ in two chunks (the default there)
        ({"hdim": 256, "num_consumer_wg": 2, "tile_n": 80, "do_stages": 1, "dq_chunks": 1},
         r"accumulators need 224 .*dQ chunk 64"),
        # 192 of dK^T + dV^T and 48 of S + dP leave nothing (ptxas: 384 B of spills, 60 of 60 WGMMAs
        # serialized even with dQ in chunks)
        ({"hdim": 256, "num_consumer_wg": 2, "tile_n": 96, "do_stages": 1},
         r"accumulators need 240 .*dK\^T \+ dV\^T 192"),
        ({"hdim": 256, "num_consumer_wg": 2, "tile_n": 64, "dq_chunks": 3}, "dq_chunks 3"),
        # 96-column chunks would split a 64-column swizzle atom of K (CuTe cannot tile it)
        ({"hdim": 192, "num_consumer_wg": 3, "tile_n": 96, "dq_chunks": 2}, "dq_chunks 2"),
        ({"hdim": 256, "num_consumer_wg": 2, "tile_n": 64, "do_stages": 1, "num_stages": 0},
         "must be >= 1"),
        ({"hdim": 256, "num_consumer_wg": 2, "tile_n": 64, "tile_m": 128}, "tile_m 128 must be 64"),
        # 2 * 128 * 128 / 128 fp32 of dK^T + dV^T and 64 of dQ: no room left in 240
        ({"hdim": 256, "num_consumer_wg": 2, "tile_n": 128}, "accumulators need"),
        ({"hdim": 256, "num_consumer_wg": 2, "tile_n": 64, "kv_split": "rows"}, "kv_split"),
        # the key-split kernel's tiles at hdim 256 (K, V of 128 keys, 2-stage Q and dO) overflow smem
        ({"hdim": 256, "num_consumer_wg": 2, "tile_n": 128, "kv_split": "keys"}, "shared memory"),
        # key split: 128 query rows only at hdim 64 (S^T + dP^T + dK + dV = tile_m + hdim fp32;
        # one stage so that the smem check passes first)
        ({"hdim": 96, "tile_n": 128, "tile_m": 128, "num_stages": 1, "kv_split": "keys"},
         "accumulators need 224"),
        ({"hdim": 64, "tile_n": 128, "tile_m": 96, "kv_split": "keys"}, "multiple of 64"),
        # the dO ring depth and dQ chunks are kv_split "hdim" (hopper/bwd_wide.py) switches
        ({"hdim": 128, "tile_n": 128, "do_stages": 1, "kv_split": "keys"}, "only for kv_split 'hdim'"),
        ({"hdim": 128, "tile_n": 128, "dq_chunks": 2, "kv_split": "keys"}, "only for kv_split 'hdim'"),
    ],
)
def test_invalid_backward_configs_name_the_budget(overrides, budget):
    cfg = config.BwdConfig(**{"dtype": "bf16", "hdim": 256, "kv_split": "hdim", **overrides})
    with pytest.raises(ValueError, match=budget):
        cfg.check()


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_hdim64_consumer_warpgroups_per_mask(dtype, mask):
    # 192 x 128 as in FA3 without a mask and causal (it compiles without spills since the mask
    # compares compile-time columns; tests/test_fwd_compile.py checks the spills); 128 x 128 with a
    # local window and for short causal query lengths (measured, plan._TILES_LOCAL / _TILES_NARROW)
    cfg = fwd_config(dtype, 64, **mask)
    wide = not mask.get("local")
    assert (cfg.tile_m, cfg.tile_n, cfg.num_consumer_wg) == ((192, 128, 3) if wide else (128, 128, 2))
    assert (cfg.consumer_regs, cfg.producer_regs) == ((160, 32) if wide else (240, 24))
    narrow = fwd_config(dtype, 64, narrow=True, **mask)
    expect = (128, 128, 2) if mask.get("causal") or mask.get("local") else (192, 128, 3)
    assert (narrow.tile_m, narrow.tile_n, narrow.num_consumer_wg) == expect
    assert narrow.persistent == cfg.persistent and narrow.dtype == dtype


def test_narrow_tile_only_where_the_wide_one_pads():
    # causal: 192 query rows pad 512 / 1024 queries by 12.5% (measured 13-14% slower than 128 rows
    # there); at 1536 / 2048 they pad 0-3% and were faster. Never without a mask.
    narrow = {s for s in range(1, 20000) if plan.fwd_narrow_tile(64, s, causal=True)}
    assert {1, 17, 128, 512, 1000, 1024} <= narrow
    assert not {192, 1536, 2048, 4096, 4097, 8192, 16384} & narrow
    for s in (384, 768, 1152, 4032):  # multiples of 192 never pad
        assert s not in narrow
    assert not any(plan.fwd_narrow_tile(64, s, causal=False) for s in range(1, 5000))
    assert not any(plan.fwd_narrow_tile(hdim, 512, causal=True) for hdim in (96, 128, 192, 256))
    for s in range(1, 5000, 7):
        wide, thin = -(-s // 192) * 192, -(-s // 128) * 128
        assert plan.fwd_narrow_tile(64, s, causal=True) == (wide > 1.06 * thin)


# the wide-kernel candidates for GPU timing (docs/design.md "hdim 192 and 256"): (hdim, overrides,
# dynamic smem bytes, dQ chunks). Each compiles spill-free with the WGMMAs asynchronous
# (tests/test_bwd_compile.py::test_backward_wide_variants_compile).
WIDE_CANDIDATES = [
    (256, {}, 223040, 2, 1),  # formerly dispatched: tile_n 80, one dO stage, two P / dS pairs
    (256, {"ds_stages": 1}, 202560, 2, 1),
    (256, {"tile_n": 64, "do_stages": 0}, 215120, 1, 2),
    (256, {"tile_n": 64}, 182080, 1, 1),
    (256, {"tile_n": 48, "do_stages": 0}, 194640, 1, 2),
    (256, {"tile_n": 48}, 161600, 1, 1),
    (256, {"tile_n": 64, "do_stages": 0, "dq_chunks": 2}, 215120, 2, 2),
    (192, {}, 223312, 1, 2),  # formerly dispatched: two P / dS buffer pairs
    (192, {"ds_stages": 1}, 198736, 1, 2),
    (192, {"do_stages": 1}, 173888, 1, 1),
    (192, {"tile_n": 48}, 149584, 1, 2),
]


@pytest.mark.parametrize(("hdim", "overrides", "smem", "chunks", "do_stages"), WIDE_CANDIDATES)
@pytest.mark.parametrize("mask", MASKS)
def test_wide_backward_candidates_fit(hdim, overrides, smem, chunks, do_stages, mask):
    # the candidates as measured then (dQ by atomics), with one P / dS buffer pair unless the row
    # says otherwise
    base = plan.BWD_WIDE_ATOMICS[hdim]
    fields = {**base, "ds_stages": 1, **overrides} if overrides else base
    cfg = plan.bwd_config("bf16", hdim, **mask, **fields)
    assert cfg.kv_split == "hdim" and cfg.smem_bytes() == smem <= SMEM_CAPACITY
    assert cfg.num_dq_chunks == chunks
    assert cfg.num_do_stages == do_stages
    # smem recomputed: K, V; Q and dO rings with their LSE / D rows; P and dS; barriers; alignment
    stages = cfg.num_stages + cfg.num_do_stages
    assert smem == (1024 + 2 * cfg.tile_n * hdim * 2 + stages * 64 * (hdim * 2 + 4)
                    + cfg.ds_stages * 2 * 64 * cfg.tile_n * 2 + 8 * (2 + 2 * stages))
    # registers: dK^T + dV^T, then the larger of S + dP and a dQ chunk, with 32 to spare
    wg = cfg.num_consumer_wg
    dkv = 2 * (hdim // wg) * cfg.tile_n // WARPGROUP_THREADS
    sdp = 2 * 64 * (cfg.tile_n // wg) // WARPGROUP_THREADS
    dq = 64 * (hdim // wg) // chunks // WARPGROUP_THREADS
    assert dkv + max(sdp, dq) + 32 <= cfg.consumer_regs


def test_do_stages_default_follows_num_stages():
    cfg = plan.bwd_config("bf16", 192)
    assert cfg.do_stages == 0 and cfg.num_do_stages == cfg.num_stages == 2
    one = dataclasses.replace(cfg, num_stages=1)
    assert one.num_do_stages == 1 and one.smem_bytes() < cfg.smem_bytes()


@pytest.mark.parametrize("mask", MASKS)
def test_backward_80_rows_config(mask):
    # hdim 128 at FA3 / FA4's 80 query rows (dispatched): dQ computed transposed, the
    # 208-register accumulator exception, LSE / D stages 128-byte aligned for their TMA
    cfg = plan.bwd_config("bf16", 128, **mask)
    assert cfg == plan.bwd_config("bf16", 128, tile_m=80, **mask)
    assert cfg.dq_transposed and cfg.ds_before_dv and not cfg.dq_by_rows
    assert cfg.tile_m + cfg.hdim == 208 and cfg.row_stride == 96
    stages = cfg.num_stages + cfg.num_do_stages
    kv, q_do, ds, dq = 2 * 128 * 128 * 2, stages * 80 * 128 * 2, 128 * 80 * 2, 80 * 128 * 4
    assert cfg.smem_bytes() == 1024 + kv + q_do + stages * 96 * 4 + ds + dq + 8 * (2 + 2 * stages)
    assert dataclasses.replace(cfg, ds_stages=2).smem_bytes() <= SMEM_CAPACITY
    # whole 32-row multiples keep their rows unpadded
    assert all(plan.bwd_config("bf16", d).row_stride == plan.bwd_config("bf16", d).tile_m
               for d in config.BWD_HDIMS if d != 128)


@pytest.mark.parametrize(("overrides", "match"), [
    ({"hdim": 64, "tile_m": 80}, r"one of \(hdim, tile_m\) \[\(128, 80\)\]"),
    ({"hdim": 128, "tile_m": 48}, "must be a multiple of 64"),
    ({"hdim": 128, "tile_m": 80, "dq_by_rows": True}, "dq_by_rows needs tile_m 128"),
    ({"hdim": 128, "tile_m": 80, "num_consumer_wg": 1, "tile_n": 64}, "64 head-dim rows"),
])
def test_backward_80_rows_refused_elsewhere(overrides, match):
    cfg = config.BwdConfig(**{"dtype": "bf16", **overrides})
    with pytest.raises(ValueError, match=match):
        cfg.check()


def test_cluster_is_off_in_every_dispatched_config():
    for dtype, hdim, mask, softcap in DISPATCHED:
        assert fwd_config(dtype, hdim, softcap=softcap, **mask).cluster_m == 1


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("softcap", [False, True])
@pytest.mark.parametrize("hdim", SUPPORTED_HDIMS)
def test_cluster_m2_valid_without_mask_on_the_static_schedule(hdim, softcap, persistent):
    cfg = dataclasses.replace(fwd_config("bf16", hdim, softcap=softcap), cluster_m=2, persistent=persistent,
                              dynamic_sched=False)
    cfg.check()
    # the cluster shares K/V through the same smem: no budget changes (O in Q's buffer, also where
    # the dispatch stages it in V's ring: hdim 256)
    o_in_q = dataclasses.replace(cfg, cluster_m=1, o_in_v=False, o_v_stages=False)
    assert cfg.smem_bytes() == o_in_q.smem_bytes()


@pytest.mark.parametrize(("overrides", "message"), [
    ({"causal": True}, "cluster_m=2 needs no causal/local mask"),
    ({"local": True}, "cluster_m=2 needs no causal/local mask"),
    ({"persistent": True, "dynamic_sched": True}, "cluster_m=2 takes the static schedule only"),
    ({"cluster_m": 4}, r"cluster_m 4 not in \(1, 2\)"),
    ({"cluster_m": 0}, r"cluster_m 0 not in \(1, 2\)"),
])
def test_cluster_refusals_name_the_reason(overrides, message):
    base = FwdConfig(dtype="bf16", hdim=128, cluster_m=2)
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(base, **overrides).check()


def test_cluster_grid_rounds_query_blocks_to_pairs():
    one = FwdConfig(dtype="bf16", hdim=128)
    two = dataclasses.replace(one, cluster_m=2)
    # one CTA per tile; 4097 queries are 33 blocks of 128 -> 17 pairs (the last CTA has no rows)
    assert fwd_grid(one, 4097, 6, None) == 33 * 6
    assert fwd_grid(two, 4097, 6, None) == 2 * 17 * 6
    assert fwd_grid(two, 1, 1, None) == 2
    assert fwd_grid(two, 256, 3, None) == 2 * 3
    # persistent: whole clusters, at least one, never more than the tiles
    assert fwd_grid(one, 4097, 6, 132) == 132
    assert fwd_grid(two, 4097, 6, 132) == 132
    assert fwd_grid(two, 4097, 6, 3) == 2
    assert fwd_grid(two, 4097, 6, 1) == 2
    assert fwd_grid(two, 100, 1, 132) == 2


def test_forward_wg_epilogue_dispatch():
    # the per-warpgroup epilogue everywhere but hdim 64's 192-row causal tile with softcap (spills)
    for hdim in SUPPORTED_HDIMS:
        for causal, local, softcap in itertools.product((False, True), (False, True), (False, True)):
            cfg = plan.fwd_config("bf16", hdim, causal=causal, local=local, softcap=softcap)
            assert cfg.wg_epilogue == (not (softcap and causal and cfg.tile_m == 192))
    assert not plan.fwd_config("bf16", 64, causal=True, softcap=True).wg_epilogue


def test_wide_backward_two_pds_buffers_fit():
    # hdim 192 / 256 with two P / dS buffer pairs (BwdConfig.ds_stages=2, hopper/bwd_wide.py), dQ by
    # atomics (formerly dispatched)
    for hdim in plan.BWD_WIDE:
        base = plan.BWD_WIDE_ATOMICS[hdim]
        one = plan.bwd_config("bf16", hdim, **{**base, "ds_stages": 1})
        two = plan.bwd_config("bf16", hdim, **base)
        assert two.ds_stages == 2
        assert two.smem_bytes() - one.smem_bytes() == 2 * one.tile_m * one.tile_n * 2
        assert two.smem_bytes() <= SMEM_CAPACITY
    with pytest.raises(ValueError, match="ds_stages 3"):
        plan.bwd_config("bf16", 256, ds_stages=3)


def test_wide_backward_dq_slot_dispatch_fits():
    # the dispatch: one fp32 dQ part (tile_m x hdim / (warpgroups x chunks)) in the
    # smem of the second P / dS pair; at 256 a ring of three half-part boxes (not
    # under a local window, which keeps the part whole)
    for hdim, part in ((192, 64 * 96 * 4), (256, 64 * 64 * 4)):
        for mask in MASKS:
            cfg = plan.bwd_config("bf16", hdim, **mask)
            plain = plan.bwd_config("bf16", hdim, **mask, dq_tma=False, dq_slots=0)
            ring = part // 2 * 3 if cfg.dq_slot_ring else part
            assert cfg.dq_slot_ring == (3 if hdim == 256 and not mask.get("local") else 0)
            assert cfg.smem_bytes() - plain.smem_bytes() == ring
            assert cfg.smem_bytes() <= SMEM_CAPACITY
            # and the part is why one pair: two would not fit next to it
            pair = 2 * cfg.tile_m * cfg.tile_n * 2
            assert plain.smem_bytes() + pair + part > SMEM_CAPACITY


def test_short_causal_hdim256_only_up_to_1024():
    # hdim 256 causal with queries and keys <= 512: 64-key tiles, persistent + dynamic scheduler
    # (measured +11 / +13% at 512, even or lower from 1024: plan._SHORT_CAUSAL); <= 1024: the
    # persistent grid (+4.5% at 1k, -4.6% at 2k); O in V's stages in both
    short = plan.fwd_short_causal
    assert short(256, 512, 512, True) == short(256, 1, 1, True) == short(256, 17, 500, True) == 1
    assert short(256, 513, 512, True) == short(256, 512, 513, True) == short(256, 1024, 1024, True) == 2
    assert not short(256, 1025, 1024, True) and not short(256, 1, 1025, True)
    assert not short(256, 512, 512, False) and not short(256, 0, 0, True)
    assert not any(short(hdim, 512, 512, True) for hdim in (64, 96, 128))
    for dtype, softcap in itertools.product(("bf16", "fp16"), (False, True)):
        cfg = plan.fwd_config(dtype, 256, causal=True, softcap=softcap, short=True)
        mid = plan.fwd_config(dtype, 256, causal=True, softcap=softcap, short=2)
        base = plan.fwd_config(dtype, 256, causal=True, softcap=softcap)
        assert (cfg.tile_n, cfg.persistent, cfg.dynamic_sched, cfg.o_v_stages) == (64, True, True, True)
        assert (mid.tile_n, mid.persistent, mid.dynamic_sched, mid.o_v_stages) == (80, True, True, True)
        assert (base.tile_n, base.persistent, base.dynamic_sched, base.o_in_v) == (80, False, False, False)
        assert cfg.smem_bytes() <= SMEM_CAPACITY and mid.smem_bytes() <= SMEM_CAPACITY
    # a local window keeps its own dispatch; no mask ignores `short`
    local = plan.fwd_config("bf16", 256, local=True)
    assert plan.fwd_config("bf16", 256, local=True, short=True) == local
    assert plan.fwd_config("bf16", 256, short=True) == plan.fwd_config("bf16", 256)


def test_short_causal_hdim192_only_up_to_1024():
    # hdim 192 causal with queries and keys <= 1024: the persistent grid with O in V's stages
    # (plan._SHORT_CAUSAL: +23.5% at 512, +9.4% at 1k, -6.5% at 2k over one CTA per tile)
    short = plan.fwd_short_causal
    assert short(192, 1024, 1024, True) == short(192, 1, 1, True) == short(192, 17, 1000, True) == 1
    assert not short(192, 1025, 1024, True) and not short(192, 1, 1025, True)
    assert not short(192, 512, 512, False)
    for dtype, softcap in itertools.product(("bf16", "fp16"), (False, True)):
        cfg = plan.fwd_config(dtype, 192, causal=True, softcap=softcap, short=1)
        base = plan.fwd_config(dtype, 192, causal=True, softcap=softcap)
        assert (cfg.tile_n, cfg.persistent, cfg.dynamic_sched, cfg.o_v_stages) == (112, True, True, True)
        assert cfg.o_per_stage and cfg.smem_bytes() <= SMEM_CAPACITY
        assert (base.persistent, base.o_in_v) == (False, False)
    assert plan.fwd_config("bf16", 192, local=True, short=1) == plan.fwd_config("bf16", 192, local=True)


def test_short_nomask_hdim192_only_up_to_512():
    # hdim 192 without a mask, queries and keys <= 512: O in V's stages (plan._SHORT_NOMASK: +7.5 /
    # +8.7% at 512, -2.4 / -2.6% at 1k); nowhere else, and never under a mask
    short = plan.fwd_short_nomask
    assert short(192, 512, 512, False) and short(192, 1, 1, False) and short(192, 17, 500, False)
    assert not short(192, 513, 512, False) and not short(192, 512, 513, False)
    assert not short(192, 512, 512, True) and not short(192, 0, 0, False)
    assert not any(short(hdim, 512, 512, False) for hdim in (64, 96, 128, 256))
    for dtype, softcap in itertools.product(("bf16", "fp16"), (False, True)):
        cfg = plan.fwd_config(dtype, 192, softcap=softcap, short=True)
        base = plan.fwd_config(dtype, 192, softcap=softcap)
        assert (cfg.persistent, cfg.o_v_stages, cfg.o_per_stage) == (True, True, True)
        assert dataclasses.replace(cfg, o_in_v=False, o_v_stages=False) == base
        assert cfg.smem_bytes() <= SMEM_CAPACITY


def test_short_qring_hdim64_only_up_to_1024():
    # hdim 64 with queries and keys <= 1024 and no window: Q ring of two, three K / V stages
    # (plan._SHORT_QRING: +2..+9% at 512-1k, -1.3% at causal 8k)
    ring = plan.fwd_short_qring
    assert ring(64, 1024, 1024, False) and ring(64, 1, 1, False) and ring(64, 17, 1000, False)
    assert not ring(64, 1025, 1024, False) and not ring(64, 1024, 1025, False)
    assert not ring(64, 512, 512, True)
    assert not any(ring(hdim, 512, 512, False) for hdim in (96, 128, 192, 256))
    for dtype, causal, softcap in itertools.product(("bf16", "fp16"), (False, True), (False, True)):
        narrow = plan.fwd_narrow_tile(64, 512, causal)
        cfg = plan.fwd_config(dtype, 64, causal=causal, softcap=softcap, narrow=narrow, qring=True)
        base = plan.fwd_config(dtype, 64, causal=causal, softcap=softcap, narrow=narrow)
        assert (cfg.q_stages, cfg.num_stages, cfg.tile_m) == (2, 3, base.tile_m)
        assert (base.q_stages, base.num_stages) == (1, 2)
        assert cfg.o_buffer and cfg.smem_bytes() <= SMEM_CAPACITY
    # a local window keeps its own dispatch
    assert plan.fwd_config("bf16", 64, local=True, qring=True) == plan.fwd_config("bf16", 64, local=True)

def test_backward_lpt_is_refused_with_deterministic():
    assert plan.bwd_config("bf16", 128, causal=True, lpt=True).lpt
    with pytest.raises(ValueError, match="lpt and deterministic"):
        plan.bwd_config("bf16", 128, causal=True, deterministic=True, lpt=True)
    with pytest.raises(ValueError, match="lpt_l2_kib 0"):
        plan.bwd_config("bf16", 128, causal=True, lpt=True, lpt_l2_kib=0)


def test_backward_pre_zero_dq_is_dispatched_everywhere():
    # timed on the H200 in (docs/decisions.md): no fill kernel before the backward
    for hdim in config.BWD_HDIMS:
        for causal in (False, True):
            assert plan.bwd_config("bf16", hdim, causal=causal).pre_zero_dq
    assert not plan.bwd_config("bf16", 128, causal=True, pre_zero_dq=False).pre_zero_dq


def test_backward_per_call_fields_only_where_timed():
    # hdim 128 causal up to 1k tokens takes 64-row steps (+5.0% at 512 on the H200) with the dQ tile's
    # rows interleaved (+2.6 / +4.0% at 512 / 1k), 2k-8k lpt
    per_call = plan.bwd_per_call
    short = {"tile_m": 64, "dq_rows_interleaved": True}
    assert per_call(128, 512, 512, True, False) == short
    assert per_call(128, 17, 1024, True, False) == short
    assert plan.bwd_config("bf16", 128, causal=True, **short).dq_rows_fit()
    assert per_call(128, 1025, 1025, True, False) == {}
    assert per_call(128, 2048, 2048, True, False) == {"lpt": True}
    assert per_call(128, 512, 512, False, False) == {}  # no mask: -1..-3% at 1k / 2k
    assert per_call(128, 512, 512, True, True) == {}  # deterministic: not timed
    assert per_call(128, 512, 512, True, False, softcap=True) == {}  # spills with softcap
    assert not any(per_call(hdim, 512, 512, True, False) for hdim in (64, 96, 192, 256))


def test_register_pool_is_what_setmaxnreg_can_move():
    # 384 threads get 168 each at launch (64512, not 65536): 24 + 2 x 240 fits, 32 + 2 x 240 does not
    assert config.register_pool(3) == 168 * 384
    assert config.register_pool(4) == 65536
    assert 128 * (24 + 2 * 240) <= config.register_pool(3) < 128 * (32 + 2 * 240)
    for wg, (cons, prod) in config.REG_SPLIT.items():
        assert 128 * (prod + wg * cons) <= config.register_pool(1 + wg)


def test_register_split_by_producer_registers():
    """FwdConfig.producer_nreg: the producer warpgroup's registers, the consumers the rest of the CTA's pool
    in steps of 8 (two consumer warpgroups: 504 per thread of a warpgroup); 0 keeps the tables' splits."""
    assert config.register_split(2) == config.REG_SPLIT[2]
    assert config.register_split(2, fp8=True) == config.FP8_REG_SPLIT[2]
    assert [config.register_split(2, True, p) for p in (24, 32, 40, 48, 56)] == \
        [(240, 24), (232, 32), (232, 40), (224, 48), (224, 56)]
    for wg in (1, 2, 3):
        for p in range(24, 257, 8):
            cons, prod = config.register_split(wg, False, p)
            assert prod == p and cons % 8 == 0 and cons <= 256
            assert 128 * (prod + wg * cons) <= config.register_pool(1 + wg)
    cfg = dataclasses.replace(fwd_config("e4m3", 128), producer_nreg=40)
    cfg.check()
    assert (cfg.consumer_regs, cfg.producer_regs) == (232, 40)
    assert dataclasses.replace(cfg, producer_nreg=0).consumer_regs == config.FP8_REG_SPLIT[2][0]
    for bad in (20, 36, 264):
        with pytest.raises(ValueError, match=f"producer_nreg {bad}: setmaxnreg takes a multiple of 8"):
            dataclasses.replace(cfg, producer_nreg=bad).check()


def test_backward_lpt_per_call_only_where_timed():
    # causal, hdim 128 from 2k to 8k tokens and hdim 256 from 1k to 2k (plan._BWD_LPT_CAUSAL): +2..+5%
    # on the H200
    lpt = plan.bwd_lpt
    assert lpt(128, 2048, 2048, True, False) and lpt(128, 8192, 8192, True, False)
    assert lpt(128, 100, 3000, True, False)
    assert not lpt(128, 2047, 2047, True, False) and not lpt(128, 8193, 8193, True, False)
    assert lpt(256, 1024, 1024, True, False) and lpt(256, 2048, 2048, True, False)
    assert not lpt(256, 1023, 1023, True, False) and not lpt(256, 2049, 2049, True, False)
    assert not lpt(128, 2048, 2048, False, False)  # no mask: -1..-3%
    assert not lpt(128, 2048, 2048, True, True)  # deterministic launches in its own order
    assert not any(lpt(hdim, 2048, 2048, True, False) for hdim in (64, 96, 192))
    assert plan.bwd_config("bf16", 128, causal=True, lpt=True).lpt


def test_q_ring_budget():
    cfg = FwdConfig(dtype="bf16", hdim=128, q_stages=2)
    cfg.check()  # 128 x 128 at two K / V stages: 225 KiB with O's own tile
    assert cfg.o_buffer and cfg.smem_bytes() - FwdConfig(dtype="bf16", hdim=128).smem_bytes() == 32768 + 16
    # hdim 256 stages O in Q's buffer: a second Q tile has nowhere to go
    with pytest.raises(ValueError, match="shared memory|O's own smem tile"):
        FwdConfig(dtype="bf16", hdim=256, tile_n=80, q_stages=2).check()
    with pytest.raises(ValueError, match="O's own smem tile"):
        FwdConfig(dtype="bf16", hdim=64, q_stages=2, o_in_q=True).check()
    with pytest.raises(ValueError, match="q_stages 3"):
        FwdConfig(dtype="bf16", hdim=64, q_stages=3).check()


def test_o_v_stages_dispatched_at_hdim256_on_the_persistent_grid():
    # +0.6..+3.3% without a mask (512-8k); masks on one CTA per tile keep O in Q's buffer
    for dtype, softcap in itertools.product(("bf16", "fp16"), (False, True)):
        cfg = plan.fwd_config(dtype, 256, softcap=softcap)
        assert cfg.persistent and cfg.o_in_v and cfg.o_v_stages and cfg.o_in_q_buffer is False
    for mask in ({"causal": True}, {"local": True}):
        cfg = plan.fwd_config("bf16", 256, **mask)
        assert not cfg.persistent and not cfg.o_in_v and cfg.o_in_q_buffer
    assert not any(plan.fwd_config("bf16", hdim).o_in_v for hdim in (64, 96, 128, 192))
    assert plan.fwd_config("bf16", 256).o_per_stage
    # without what a part per stage needs it falls back to one hand-off for all of sV (the ablation
    # turns wg_epilogue off on dispatched configs)
    on = {"o_in_v": True, "o_v_stages": True, "wg_epilogue": True}
    for cfg in (FwdConfig(dtype="bf16", hdim=256, tile_n=80, **{**on, "wg_epilogue": False}),
                FwdConfig(dtype="bf16", hdim=128, num_stages=3, **on),
                FwdConfig(dtype="bf16", hdim=64, tile_m=192, num_consumer_wg=3, **on)):
        cfg.check()
        assert cfg.o_in_v and not cfg.o_per_stage
    with pytest.raises(ValueError, match="o_v_stages needs o_in_v"):
        FwdConfig(dtype="bf16", hdim=256, tile_n=80, o_v_stages=True, wg_epilogue=True).check()


def test_o_in_v_budget():
    # a third K / V stage at hdim 128 leaves no room for O's own tile: without o_in_v, O falls back
    # to Q's buffer; with it, O goes to V's ring and Q is free after the last QK^T
    assert FwdConfig(dtype="bf16", hdim=128, num_stages=3).o_in_q_buffer
    cfg = FwdConfig(dtype="bf16", hdim=128, num_stages=3, o_in_v=True)
    cfg.check()
    assert not cfg.o_buffer and not cfg.o_in_q_buffer
    assert cfg.smem_bytes() == FwdConfig(dtype="bf16", hdim=128, num_stages=3, o_in_q=True).smem_bytes() + 16
    # hdim 256: the same smem as O in Q's buffer (two more mbarriers), and room for a Q ring is still
    # not there; O's 128 rows fit in two 80-key V stages, not in one
    wide = FwdConfig(dtype="bf16", hdim=256, tile_n=80, o_in_v=True)
    wide.check()
    assert wide.smem_bytes() == FwdConfig(dtype="bf16", hdim=256, tile_n=80).smem_bytes() + 16
    with pytest.raises(ValueError, match="shared memory"):
        FwdConfig(dtype="bf16", hdim=256, tile_n=80, o_in_v=True, q_stages=2).check()
    with pytest.raises(ValueError, match="do not fit in V's ring"):
        FwdConfig(dtype="bf16", hdim=256, tile_n=80, num_stages=1, o_in_v=True).check()
    with pytest.raises(ValueError, match="o_in_q and o_in_v"):
        FwdConfig(dtype="bf16", hdim=128, o_in_v=True, o_in_q=True).check()
    # a cluster's peer multicasts into sV: there O goes back to Q's buffer
    clustered = FwdConfig(dtype="bf16", hdim=256, tile_n=80, o_in_v=True, cluster_m=2)
    clustered.check()
    assert not clustered.o_in_v_ring and clustered.o_in_q_buffer
    # the Q ring only needs O out of Q's buffer
    FwdConfig(dtype="bf16", hdim=128, o_in_v=True, q_stages=2).check()


def test_fp8_two_level_budget():
    """FwdConfig.pv_two_level: e4m3 only; its second O accumulator fits hdim 64 / 96 at the FP8 tile and
    hdim 128 at 96 or 128 keys (S, P, two O: 208 of 224 registers, compiled spill-free), not hdim 128 at
    160 keys (228; ptxas spilled 64-136 bytes) nor 192 / 256."""
    for hdim, tile_n in ((64, 128), (96, 128), (128, 96), (128, 64), (128, 128)):
        dataclasses.replace(fwd_config("e4m3", hdim), pv_two_level=True, tile_n=tile_n).check()
    for hdim, tile_n in ((128, 160), (192, 128), (256, 96)):
        with pytest.raises(ValueError, match="accumulators need"):
            dataclasses.replace(fwd_config("e4m3", hdim), pv_two_level=True, tile_n=tile_n).check()
    with pytest.raises(ValueError, match="pv_two_level, pv_row_sum and qk_descale are for e4m3"):
        dataclasses.replace(fwd_config("bf16", 64), pv_two_level=True).check()


def test_fp8_row_sum_config():
    """FwdConfig.pv_row_sum: e4m3 only, with the transposer and the dense kernel, P @ V's N = the head dim
    plus the ones rows, the fewest multiple of 8 keeping a V stage whole KiB (16 at hdim 64 x 192 keys, 32
    at hdim 128 x 96; whole swizzle periods, 1 KiB at 128 keys, 512 bytes at 192, 256 at 96, would take 8);
    counted in shared memory and in the accumulators (both O accumulators with two-level)."""
    for hdim, tile_n, rows in ((64, 192, 16), (64, 128, 8), (96, 128, 8), (128, 128, 8), (192, 128, 8),
                               (128, 96, 32)):
        base = dataclasses.replace(fwd_config("e4m3", hdim), tile_n=tile_n, pv_two_level=False,
                                   producer_nreg=40)
        cfg = dataclasses.replace(base, pv_row_sum=True)
        assert cfg.row_sum_rows == rows and cfg.pv_n == hdim + rows and base.pv_n == hdim
        assert (cfg.pv_n * tile_n) % 1024 == 0
        assert cfg.smem_bytes() == base.smem_bytes() + cfg.num_stages * tile_n * rows
        assert cfg.accumulator_regs() == base.accumulator_regs() + 64 * rows // 128
    with pytest.raises(ValueError, match="pv_row_sum and qk_descale are for e4m3"):
        dataclasses.replace(fwd_config("bf16", 64), pv_row_sum=True).check()
    for bad in ({"vt_in_gmem": True}, {"hdim": 256, "tile_n": 96, "pv_two_level": False}):
        with pytest.raises(ValueError, match="pv_row_sum needs"):
            dataclasses.replace(fwd_config("e4m3", 128), pv_row_sum=True, producer_nreg=40, **bad).check()


def test_fp8_row_sum_only_without_the_lse():
    """plan.fp8_row_sum: FP8 calls that return no LSE run the tensor cores' row sums where _FP8_ROW_SUM
    has them (hdim 64, and hdim 128 without a mask on the 40-register producer), the same config but for
    that otherwise; never with a window, softcap, per-token descales or 16-bit inputs."""
    for hdim in SUPPORTED_HDIMS:
        for causal in (False, True):
            with_lse = plan.fwd_plan("e4m3", hdim, 2048, 2048, causal, (-1, -1), False)[0]
            without = plan.fwd_plan("e4m3", hdim, 2048, 2048, causal, (-1, -1), False, need_lse=False)[0]
            assert not with_lse.pv_row_sum
            fields = plan._FP8_ROW_SUM.get((hdim, causal))
            assert without == (with_lse if fields is None
                               else dataclasses.replace(with_lse, pv_row_sum=True, **fields))
            without.check()
    for kw in ({"window_size": (64, 0)}, {"softcap": True}, {"qk_descale": "token"}):
        args = {"window_size": (-1, -1), "softcap": False, **kw}
        cfg = plan.fwd_plan("e4m3", 64, 2048, 2048, False, args.pop("window_size"), args.pop("softcap"),
                            need_lse=False, **args)[0]
        assert not cfg.pv_row_sum
    assert not plan.fwd_plan("bf16", 64, 2048, 2048, False, (-1, -1), False, need_lse=False)[0].pv_row_sum


@pytest.mark.parametrize("hdim", SUPPORTED_HDIMS)
def test_fp8_token_descale_configs(hdim):
    """FwdConfig.qk_descale "token": e4m3 only, one of QK_DESCALES; the k-descale ring (a stage per K
    stage, 4 rows of tile_n / 4 words and their padding, two mbarriers a stage) counted in shared memory;
    the dispatched one is the per-head config but for the descale form and its key block: the per-hdim
    one (not the per-head kernel's wider blocks without a window or softcap), with a mask at hdim 128 and
    256 64 keys."""
    for mask in ({}, {"causal": True}, {"local": True}):
        for softcap in (False, True):
            head = fwd_config("e4m3", hdim, softcap=softcap, **mask)
            token = fwd_config("e4m3", hdim, softcap=softcap, qk_descale="token", **mask)
            token.check()
            assert token.token_descales and not head.token_descales
            narrower = mask and hdim in (128, 256)
            tile_n = 64 if narrower else plan._FP8_TILES[hdim][1]
            assert token == dataclasses.replace(head, qk_descale="token", tile_n=tile_n)
            same_tile = dataclasses.replace(head, qk_descale="token")
            ring = head.num_stages * (4 * 4 * (head.tile_n // 4 + config.KD_ROW_PAD) + 16)
            assert same_tile.smem_bytes() == head.smem_bytes() + ring
    with pytest.raises(ValueError, match="qk_descale 'row' not in"):
        dataclasses.replace(fwd_config("e4m3", hdim), qk_descale="row").check()
    with pytest.raises(ValueError, match="qk_descale are for e4m3"):
        dataclasses.replace(fwd_config("bf16", hdim), qk_descale="token").check()
    with pytest.raises(ValueError, match="descales go with e4m3"):
        fwd_config("bf16", hdim, qk_descale="token")


def test_decode_tile_configs_fit():
    """plan.fwd_config_decode: 64 rows on one warpgroup without ping-pong, at the 1-warpgroup register
    split, the varlen kernel otherwise, and the K / V ring as deep as shared memory allows."""
    cfgs = plan.decode_kernels()
    assert len(cfgs) == 2 * (len(SUPPORTED_HDIMS) + 1) * 2  # dtypes x (hdim, dv) pairs x softcap
    for cfg in cfgs:
        cfg.check()
        varlen = plan.fwd_config_varlen(cfg.dtype, cfg.hdim, softcap=cfg.softcap, dv=cfg.dv)
        assert (cfg.tile_m, cfg.num_consumer_wg, cfg.pingpong, cfg.intra_wg_overlap) == (64, 1, False, True)
        assert (cfg.consumer_regs, cfg.producer_regs) == config.REG_SPLIT[1] and cfg.varlen
        assert dataclasses.replace(cfg, tile_m=varlen.tile_m, num_consumer_wg=varlen.num_consumer_wg,
                                   tile_n=varlen.tile_n, num_stages=varlen.num_stages, pingpong=True,
                                   lazy_max=varlen.lazy_max, skip_idle_wg=varlen.skip_idle_wg) == varlen
        assert cfg.num_stages >= 3 and 128 % cfg.tile_n == 0  # splitkv's 128-key chunks: whole blocks
        with pytest.raises(ValueError, match="shared memory"):
            dataclasses.replace(cfg, num_stages=cfg.num_stages + 1).check()
    assert plan.fwd_plan_decode("bf16", 128, False) == plan.fwd_config_decode("bf16", 128)
    assert plan.fwd_config_decode("fp16", 192, dv=192) == plan.fwd_config_decode("fp16", 192)


def test_varlen_configs_walk_on_the_persistent_dynamic_scheduler():
    """Every varlen config (dispatched, split head dims, decode tile, paged) runs on the persistent grid
    whose dynamic scheduler walks the sequences' tiles (hopper/tile_scheduler.py); one without it is
    refused. Causal with lazy_max releases K early (the late release spills with the sequence's bounds
    in registers); its ring holds one slot of a tile's record (config.VARLEN_RECORD_WORDS)."""
    cfgs = [plan.fwd_config_varlen(dtype, hdim, **mask, softcap=softcap)
            for dtype, hdim, mask, softcap in DISPATCHED]
    cfgs += plan.decode_kernels() + plan.paged_kernels() + [plan.fwd_config_varlen("bf16", 192, dv=128)]
    for cfg in cfgs:
        assert cfg.varlen and cfg.persistent and cfg.dynamic_sched, cfg
        assert cfg.late_k_release == (not (cfg.causal and cfg.lazy_max)), cfg
        # the ring: one slot of a record (two mbarriers) and the claimed tile, for two slots of an index
        ring = config.VARLEN_SCHED_STAGES * (16 + 4 * config.VARLEN_RECORD_WORDS) + 4
        assert cfg.smem_bytes() == dataclasses.replace(cfg, varlen=False).smem_bytes() - 2 * (16 + 4) + ring
    assert any(cfg.causal and cfg.lazy_max for cfg in cfgs)
    for off in ({"persistent": False}, {"dynamic_sched": False}, {"persistent": False,
                                                                   "dynamic_sched": False}):
        with pytest.raises(ValueError, match="varlen: needs persistent=True and dynamic_sched=True"):
            dataclasses.replace(plan.fwd_config_varlen("bf16", 128), **off).check()
