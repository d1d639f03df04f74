"""Forward kernel against the float64 reference on an sm_90 GPU (skipped elsewhere).

Bound: our error is at most 2x the error of PyTorch's own attention in the same dtype on the
same inputs, plus the dtype's rounding at output magnitude (the FlashAttention test convention).
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from flashhopper import plan
from flashhopper.accuracy import check_forward

pytestmark = pytest.mark.gpu

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)

from flashhopper.hopper import forward  # noqa: E402

DEV = "cuda"


def run_case(b, sq, sk, hq, hk, d, dtype=torch.bfloat16, causal=False, window=(-1, -1), softcap=0.0,
             layout="bshd", growth=0.0):
    # a stable seed per case: hash() of a str differs per process, so a failure would not reproduce
    case = (b, sq, sk, hq, hk, d, causal, window, softcap, layout) + ((growth,) if growth else ())
    torch.manual_seed(zlib.crc32(repr(case).encode()))
    if growth:  # scores rising toward key 0 by about `growth` (scaled, natural units) over the keys
        u = torch.nn.functional.normalize(torch.randn(d, device=DEV), dim=0)
        ramp = torch.linspace(1.0, 0.0, sk, device=DEV)[None, :, None, None]
        amp = math.sqrt(growth * math.sqrt(d))
        q = (torch.randn(b, sq, hq, d, device=DEV) + amp * u).to(dtype)
        k = (torch.randn(b, sk, hk, d, device=DEV) + amp * ramp * u).to(dtype)
        v = torch.randn(b, sk, hk, d, device=DEV, dtype=dtype)
    elif layout == "packed":  # q, k, v sliced out of one (b, s, 3, h, d) tensor: strided heads
        assert sq == sk and hq == hk
        qkv = torch.randn(b, sq, 3, hq, d, device=DEV, dtype=dtype)
        q, k, v = qkv.unbind(2)
    else:
        q = torch.randn(b, sq, hq, d, device=DEV, dtype=dtype)
        k = torch.randn(b, sk, hk, d, device=DEV, dtype=dtype)
        v = torch.randn(b, sk, hk, d, device=DEV, dtype=dtype)
    scale = 1.0 / math.sqrt(d)
    out = torch.full((b, sq, hq, d), float("nan"), device=DEV, dtype=dtype)
    lse = torch.full((b, hq, sq), float("nan"), device=DEV, dtype=torch.float32)
    forward(q, k, v, scale, causal, window, softcap, out=out, lse=lse)
    torch.cuda.synchronize()
    check_forward(out, lse, q, k, v, scale, causal, window, softcap)


# Scores that keep rising over the key blocks (the kernel walks them from the last): the running max
# moves by up to 20 (a row scale per block) or 300 (beyond exp2's range between blocks) in scaled
# natural units; FwdConfig.lazy_max must redo those blocks exactly, not overflow
@pytest.mark.parametrize("growth", [20.0, 300.0])
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_rising_scores(growth, d, dtype, causal):
    run_case(1, 1000, 2100, 2, 2, d, dtype, causal=causal, growth=growth)


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_hdim_dtype(d, dtype, causal):
    run_case(2, 1000, 1000, 4, 4, d, dtype, causal=causal)


@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 17), (127, 127), (1000, 1000), (4097, 4097),
                                   (1, 4097), (4097, 1), (17, 1000), (1000, 17), (127, 4097)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_seqlens(sq, sk, causal, d):
    run_case(1, sq, sk, 2, 2, d, causal=causal)


@pytest.mark.parametrize("b", [1, 3, 8])
@pytest.mark.parametrize("hq,hk", [(8, 1), (8, 8), (16, 2)])
def test_batch_gqa(b, hq, hk):
    run_case(b, 300, 517, hq, hk, 64, causal=b == 3)


@pytest.mark.parametrize("window,causal", [((64, 0), False), ((100, -1), False), ((-1, 50), False),
                                           ((128, 32), False), ((200, -1), True), ((0, 0), False)])
@pytest.mark.parametrize("sq,sk", [(1000, 1000), (513, 1300), (1300, 513)])
def test_local(window, causal, sq, sk):
    run_case(2, sq, sk, 2, 1, 128, causal=causal, window=window)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap(d, causal):
    run_case(2, 777, 777, 2, 2, d, softcap=15.0, causal=causal)


@pytest.mark.parametrize("d", [64, 128])
def test_packed_qkv_strides(d):
    run_case(2, 1000, 1000, 4, 4, d, layout="packed", causal=True)
    run_case(2, 1000, 1000, 4, 4, d, layout="packed")


def test_no_recompile_across_shapes():
    from flashhopper.hopper import kernel_cache

    run_case(1, 100, 100, 2, 2, 128)
    n = kernel_cache.stats["compiled"] + kernel_cache.stats["disk"]
    run_case(3, 1500, 700, 4, 2, 128)
    assert kernel_cache.stats["compiled"] + kernel_cache.stats["disk"] == n


@pytest.mark.variant
@pytest.mark.parametrize("d,causal,window,softcap", [(128, False, (-1, -1), 0.0), (128, True, (-1, -1), 0.0),
                                                     (64, False, (-1, -1), 0.0), (64, True, (-1, -1), 0.0),
                                                     (256, True, (-1, -1), 0.0), (192, False, (-1, -1), 5.0),
                                                     (96, False, (100, 20), 0.0)])
def test_persistent(d, causal, window, softcap, monkeypatch):
    """One CTA per SM looping over tiles: K/V/Q pipelines and ping-pong carry across tiles."""
    from flashhopper.hopper import runtime

    with runtime.config_overrides(persistent=True):
        run_case(3, 1111, 1500, 8, 2, d, causal=causal, window=window, softcap=softcap)
        run_case(1, 17, 4097, 4, 4, d, causal=causal, window=window, softcap=softcap)
        monkeypatch.setattr(runtime, "persistent_ctas_cap", 3)  # every CTA walks many tiles
        run_case(2, 700, 333, 4, 1, d, causal=causal, window=window, softcap=softcap)


@pytest.mark.variant
@pytest.mark.parametrize("d,causal,window,softcap", [(128, False, (-1, -1), 0.0), (128, True, (-1, -1), 0.0),
                                                     (64, True, (-1, -1), 0.0), (256, True, (-1, -1), 0.0),
                                                     (96, False, (100, 20), 0.0)])
def test_persistent_dynamic_scheduler(d, causal, window, softcap, monkeypatch):
    """Tiles claimed from a global counter: every tile exactly once, in any interleaving."""
    from flashhopper.hopper import runtime

    with runtime.config_overrides(persistent=True, dynamic_sched=True):
        run_case(3, 1111, 1500, 8, 2, d, causal=causal, window=window, softcap=softcap)
        run_case(1, 17, 4097, 4, 4, d, causal=causal, window=window, softcap=softcap)
        monkeypatch.setattr(runtime, "persistent_ctas_cap", 3)  # a few CTAs claim many tiles each
        run_case(2, 700, 333, 4, 1, d, causal=causal, window=window, softcap=softcap)
        run_case(1, 1, 1, 1, 1, d, causal=causal, window=window, softcap=softcap)


def _counters_zero(runtime):
    """Every dynamic-scheduler counter (one per stream) is back at 0 once the GPU is idle."""
    torch.cuda.synchronize()
    assert runtime._tile_counters, "no counter was allocated"
    for key, counter in runtime._tile_counters.items():
        assert counter.shape == (2,) and not counter.any(), (key, counter.tolist())


@pytest.mark.variant
@pytest.mark.parametrize("persistent,cap", [(True, None), (True, 3), (False, None)])
@pytest.mark.parametrize("d,causal", [(128, False), (128, True), (64, True)])
def test_dynamic_scheduler_counter_reset(d, causal, cap, persistent, monkeypatch):
    """The kernel puts its tile counter back to 0 (no memset per launch): launches back to back,
    of different grid and tile counts, with no synchronization between them, each see a zero
    counter, so every output is the same as a lone launch's; then the counter reads 0. Also one
    CTA per tile with the dynamic scheduler (the ablation's `persistent` off) and two streams
    (one counter each) running at once."""
    from flashhopper.hopper import runtime

    monkeypatch.setattr(runtime, "persistent_ctas_cap", cap)
    with runtime.config_overrides(persistent=persistent, dynamic_sched=True):
        run_case(2, 700, 333, 4, 1, d, causal=causal)  # against the reference
        _counters_zero(runtime)
        torch.manual_seed(0)
        shapes = [(2, 1000, 1000, 4, 2), (1, 77, 300, 8, 8), (3, 511, 700, 2, 1)]
        inputs = [[torch.randn(b, s, h, d, device=DEV, dtype=torch.bfloat16)
                   for s, h in ((sq, hq), (sk, hk), (sk, hk))] for b, sq, sk, hq, hk in shapes]
        scale = 1.0 / math.sqrt(d)

        def launch(q, k, v):
            out = torch.full((*q.shape[:3], d), float("nan"), device=DEV, dtype=q.dtype)
            lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=DEV,
                             dtype=torch.float32)
            return forward(q, k, v, scale, causal, (-1, -1), 0.0, out=out, lse=lse)

        expected = []
        for q, k, v in inputs:  # one at a time, checked against the float64 reference
            out, lse = launch(q, k, v)
            torch.cuda.synchronize()
            check_forward(out, lse, q, k, v, scale, causal, (-1, -1), 0.0)
            expected.append((out, lse))
        _counters_zero(runtime)

        # back to back on one stream; each tile's result does not depend on which CTA ran it
        results = [(i, launch(*inputs[i])) for _ in range(4) for i in range(len(inputs))]
        _counters_zero(runtime)
        for i, (out, lse) in results:
            assert torch.equal(out, expected[i][0]) and torch.equal(lse, expected[i][1]), i

        # two streams at once, each with its own counter
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        results = []
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
        for _ in range(3):
            for j, s in enumerate(streams):
                with torch.cuda.stream(s):
                    for i in range(len(inputs)):
                        results.append((i, launch(*inputs[(i + j) % len(inputs)]), j))
        _counters_zero(runtime)
        assert len(runtime._tile_counters) >= 3  # the default stream's and one per side stream
        for i, (out, lse), j in results:
            e = expected[(i + j) % len(inputs)]
            assert torch.equal(out, e[0]) and torch.equal(lse, e[1]), (i, j)


@pytest.mark.variant
@pytest.mark.parametrize("tile_n", [160, 176])
@pytest.mark.parametrize("dtype,causal,window", [
    (torch.bfloat16, False, (-1, -1)), (torch.float16, False, (-1, -1)),
    (torch.bfloat16, True, (-1, -1)), (torch.bfloat16, False, (100, 20)),
])
def test_wide_key_tiles(tile_n, dtype, causal, window, monkeypatch):
    """hdim 128 with the key-block widths a config sweep times (not dispatched): P of
    80 / 88 elements per thread, ragged key ends, O staged in Q's buffer at 176."""
    from flashhopper.hopper import runtime

    with runtime.config_overrides(tile_n=tile_n):
        for sq, sk in [(1000, 1000), (17, 4097), (4097, 17), (1, 1), (300, 517)]:
            run_case(2, sq, sk, 4, 2, 128, dtype, causal=causal, window=window)
        monkeypatch.setattr(runtime, "persistent_ctas_cap", 3)  # every CTA walks many tiles
        run_case(2, 700, 333, 4, 1, 128, dtype, causal=causal, window=window)


@pytest.mark.variant
@pytest.mark.parametrize("rescale_early", [False, True])
@pytest.mark.parametrize("d,causal,window,overlap", [
    (128, False, (-1, -1), True), (128, True, (-1, -1), True), (128, False, (100, 20), True),
    (256, False, (-1, -1), True), (256, True, (-1, -1), True), (256, False, (100, 20), True),
    (256, True, (-1, -1), False), (128, True, (-1, -1), False), (64, True, (-1, -1), False),
])
def test_rescale_o_before_pv(d, causal, window, overlap, rescale_early, monkeypatch):
    """O multiplied by the row scale before P @ V is issued, under QK^T (FwdConfig.
    rescale_o_before_pv, dispatched for hdim > 128), or after the P @ V wait: the same result
    either way. Many blocks through the masked / mask-free / left-window loops, one block (the
    peeled block and the tail only), persistent tiles, and the serial step (no effect there)."""
    from flashhopper.hopper import runtime

    with runtime.config_overrides(rescale_o_before_pv=rescale_early, intra_wg_overlap=overlap):
        for sq, sk in [(1000, 1000), (17, 4097), (4097, 17), (1, 1), (300, 517), (100, 80)]:
            run_case(2, sq, sk, 4, 2, d, causal=causal, window=window)
        monkeypatch.setattr(runtime, "persistent_ctas_cap", 3)  # every CTA walks many tiles
        run_case(2, 700, 333, 4, 1, d, causal=causal, window=window)


@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_short_causal_hdim256(dtype, softcap, monkeypatch):
    """hdim 256 causal with both lengths <= 512 dispatches 64-key tiles on the persistent grid with
    the dynamic scheduler, <= 1024 the persistent grid, both with O in V's stages
    (plan.fwd_short_causal): ragged ends, more keys than queries and the other way round, one row,
    and CTAs walking many tiles."""
    from flashhopper import plan
    from flashhopper.hopper import runtime

    cases = [(512, 512), (1, 1), (17, 17), (1, 512), (512, 1), (300, 500), (500, 300), (65, 129)]
    mid = [(1024, 1024), (513, 513), (1000, 600), (600, 1000), (1024, 1), (81, 1024)]
    assert all(plan.fwd_short_causal(256, sq, sk, True) == 1 for sq, sk in cases)
    assert all(plan.fwd_short_causal(256, sq, sk, True) == 2 for sq, sk in mid)
    for sq, sk in cases + mid:
        run_case(2, sq, sk, 4, 2, 256, dtype, causal=True, softcap=softcap)
    monkeypatch.setattr(runtime, "persistent_ctas_cap", 3)  # every CTA walks many tiles
    run_case(3, 500, 500, 4, 1, 256, dtype, causal=True, softcap=softcap)
    run_case(3, 1000, 900, 4, 1, 256, dtype, causal=True, softcap=softcap)


@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_short_causal_hdim192(dtype, softcap, monkeypatch):
    """hdim 192 causal with both lengths <= 1024 dispatches the persistent grid with O in V's stages
    (plan.fwd_short_causal), with no override: ragged ends, more keys than queries and the other
    way round, one row, 1-, 2- and 3-block tiles, and CTAs walking many tiles."""
    from flashhopper.hopper import runtime

    cases = [(1024, 1024), (512, 512), (1, 1), (17, 17), (1, 1000), (1000, 1), (300, 700), (700, 300),
             (65, 129), (113, 224), (333, 200)]
    assert all(plan.fwd_short_causal(192, sq, sk, True) == 1 for sq, sk in cases)
    for sq, sk in cases:
        run_case(2, sq, sk, 4, 2, 192, dtype, causal=True, softcap=softcap)
    monkeypatch.setattr(runtime, "persistent_ctas_cap", 3)  # every CTA walks many tiles
    run_case(3, 500, 500, 4, 1, 192, dtype, causal=True, softcap=softcap)
    run_case(3, 1000, 900, 4, 2, 192, dtype, causal=True, softcap=softcap)


@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_short_nomask_hdim192(dtype, softcap, monkeypatch):
    """hdim 192 without a mask with both lengths <= 512 dispatches O in V's stages
    (plan.fwd_short_nomask), with no override: ragged ends, 1-, 2- and 3-block tiles, and CTAs
    walking many tiles."""
    from flashhopper.hopper import runtime

    cases = [(512, 512), (1, 1), (17, 17), (1, 500), (500, 1), (300, 200), (65, 129), (113, 224), (129, 337)]
    assert all(plan.fwd_short_nomask(192, sq, sk, False) for sq, sk in cases)
    for sq, sk in cases:
        run_case(2, sq, sk, 4, 2, 192, dtype, softcap=softcap)
    monkeypatch.setattr(runtime, "persistent_ctas_cap", 3)  # every CTA walks many tiles
    run_case(3, 500, 500, 4, 1, 192, dtype, softcap=softcap)
    run_case(3, 400, 300, 4, 2, 192, dtype, softcap=softcap)


def _cases_then_many_tiles_per_cta(lengths, monkeypatch, d, dtype, **mask):
    """Batch 2 at each (seqlen_q, seqlen_k), then persistent CTAs capped at 3 so that every CTA walks
    many tiles (GQA and batch 3 among them): where state carried from tile to tile would show."""
    from flashhopper.hopper import runtime

    for sq, sk in lengths:
        run_case(2, sq, sk, 4, 2, d, dtype, **mask)
    monkeypatch.setattr(runtime, "persistent_ctas_cap", 3)
    run_case(2, 700, 333, 4, 1, d, dtype, **mask)
    run_case(3, 1000, 1000, 2, 2, d, dtype, **mask)


@pytest.mark.variant
@pytest.mark.parametrize("d,dtype,causal,window,softcap,fields", [
    (128, torch.bfloat16, False, (-1, -1), 0.0, {}), (128, torch.bfloat16, True, (-1, -1), 0.0, {}),
    (128, torch.float16, False, (100, 20), 0.0, {}), (64, torch.bfloat16, False, (-1, -1), 0.0, {}),
    (64, torch.bfloat16, True, (-1, -1), 5.0, {}), (96, torch.bfloat16, True, (-1, -1), 0.0, {}),
    (256, torch.bfloat16, False, (-1, -1), 0.0, {}), (256, torch.bfloat16, True, (-1, -1), 0.0, {}),
    (192, torch.float16, False, (64, 64), 0.0, {}),
    (128, torch.bfloat16, True, (-1, -1), 0.0, {"intra_wg_overlap": False}),
    (128, torch.bfloat16, False, (-1, -1), 0.0, {"persistent": True, "dynamic_sched": False}),
])
def test_wg_epilogue(d, dtype, causal, window, softcap, fields, monkeypatch):
    """Per-warpgroup epilogue with the ping-pong token carried across tiles (FwdConfig.wg_epilogue):
    one-block tiles (no ping-pong section), ragged ends, the O part of a warpgroup whose rows are
    all past seqlen_q, persistent CTAs walking many tiles (where a token left unbalanced would
    deadlock or a part stored from the wrong rows would show), and the dynamic and static
    schedulers."""
    from flashhopper.hopper import runtime

    with runtime.config_overrides(wg_epilogue=True, **fields):
        _cases_then_many_tiles_per_cta(
            [(1000, 1000), (17, 4097), (4097, 17), (1, 1), (300, 517), (100, 80), (65, 65)], monkeypatch,
            d, dtype, causal=causal, window=window, softcap=softcap)


@pytest.mark.variant
@pytest.mark.parametrize("d,dtype,causal,window,softcap,fields", [
    (64, torch.bfloat16, False, (-1, -1), 0.0, {}), (64, torch.float16, True, (-1, -1), 0.0, {}),
    (64, torch.bfloat16, False, (100, 20), 0.0, {}), (64, torch.bfloat16, True, (-1, -1), 5.0, {}),
    (128, torch.bfloat16, False, (-1, -1), 0.0, {}), (256, torch.bfloat16, True, (-1, -1), 0.0, {}),
    (64, torch.bfloat16, False, (-1, -1), 0.0, {"wg_epilogue": False}),
    (256, torch.float16, False, (-1, -1), 0.0, {"wg_epilogue": False, "o_v_stages": False}),
    (64, torch.bfloat16, True, (-1, -1), 0.0, {"intra_wg_overlap": False}),
    (64, torch.bfloat16, False, (-1, -1), 0.0, {"pingpong": False}),
    (64, torch.bfloat16, False, (-1, -1), 0.0, {"persistent": False, "dynamic_sched": False}),
    (128, torch.bfloat16, False, (-1, -1), 0.0,
     {"cluster_m": 2, "persistent": False, "dynamic_sched": False}),
])
def test_skip_idle_wg(d, dtype, causal, window, softcap, fields, monkeypatch):
    """FwdConfig.skip_idle_wg: a warpgroup whose 64 rows are all past seqlen_q only walks the
    pipeline and ping-pong barriers. Query lengths that leave one and two of hdim 64's three
    warpgroups idle (512, 1000, 65, 17), one row, more keys than queries and the other way round,
    the shared epilogue (whose barrier counts the idle warpgroup), the serial step, no ping-pong,
    one CTA per tile, a cluster whose second CTA has no rows, and persistent CTAs walking many
    tiles (a turn or release missed by the idle path would deadlock or corrupt the next tile)."""
    from flashhopper.hopper import runtime

    with runtime.config_overrides(skip_idle_wg=True, **fields):
        _cases_then_many_tiles_per_cta(
            [(512, 512), (1000, 1000), (17, 4097), (4097, 17), (1, 1), (65, 300), (300, 517)], monkeypatch,
            d, dtype, causal=causal, window=window, softcap=softcap)


# FwdConfig.cluster_m = 2: two CTAs per cluster on adjacent query blocks share each K/V tile by TMA
# multicast (hopper/fwd_cluster.py). Query lengths with an odd number of query blocks (1, 17, 300,
# 4097 at 128 rows; 17, 500 at 192) leave the last pair's second CTA without rows: it still loads
# its half of K/V for its peer and must write nothing (out/lse are NaN-poisoned by run_case).
_CLUSTER_SEQLENS = [(1, 1), (17, 17), (1000, 1000), (4097, 4097), (17, 4097), (4097, 17), (300, 517),
                    (256, 1000), (500, 129)]


@pytest.mark.variant
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("d,dtype,softcap", [(128, torch.bfloat16, 0.0), (128, torch.float16, 0.0),
                                             (256, torch.bfloat16, 0.0), (256, torch.float16, 0.0),
                                             (64, torch.bfloat16, 0.0), (96, torch.bfloat16, 0.0),
                                             (192, torch.bfloat16, 0.0), (128, torch.bfloat16, 5.0)])
def test_cluster(d, dtype, softcap, persistent, monkeypatch):
    from flashhopper.hopper import runtime

    with runtime.config_overrides(cluster_m=2, persistent=persistent, dynamic_sched=False):
        for sq, sk in _CLUSTER_SEQLENS:
            run_case(2, sq, sk, 4, 2, d, dtype, softcap=softcap)
        run_case(1, 1111, 1500, 8, 1, d, dtype, softcap=softcap)  # GQA 8:1, 9 query blocks at 128 rows
        run_case(3, 640, 640, 2, 2, d, dtype, softcap=softcap)  # 5 query blocks at 128 rows, batch 3
        if persistent:
            # one cluster walks every pair of every (head, batch); then two clusters
            for cap in (1, 3, 4):
                monkeypatch.setattr(runtime, "persistent_ctas_cap", cap)
                run_case(2, 700, 333, 4, 1, d, dtype, softcap=softcap)
                run_case(1, 4097, 300, 3, 3, d, dtype, softcap=softcap)


@pytest.mark.variant
@pytest.mark.parametrize("persistent", [False, True])
def test_cluster_repeated_launches_are_identical(persistent, monkeypatch):
    """Many short clusters back to back (1-2 key blocks: the producer tail and the cluster
    barrier at start-up dominate): a teardown race would show as a hang or a changed result."""
    from flashhopper.hopper import runtime

    torch.manual_seed(0)
    q = torch.randn(4, 333, 16, 128, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(4, 200, 4, 128, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    with runtime.config_overrides(cluster_m=2, persistent=persistent, dynamic_sched=False):
        if persistent:
            monkeypatch.setattr(runtime, "persistent_ctas_cap", 8)
        first, first_lse = forward(q, k, v, 0.088, False, (-1, -1), 0.0)
        for _ in range(200):
            out, lse = forward(q, k, v, 0.088, False, (-1, -1), 0.0)
        torch.cuda.synchronize()
        assert torch.equal(out, first) and torch.equal(lse, first_lse)
        run_case(4, 333, 200, 16, 4, 128)  # and that shape against the reference


def test_cluster_refused_with_causal_or_the_dynamic_scheduler():
    from flashhopper.hopper import runtime

    q = torch.randn(1, 256, 2, 128, device=DEV, dtype=torch.bfloat16)
    with runtime.config_overrides(cluster_m=2, dynamic_sched=False):
        with pytest.raises(ValueError, match="causal/local"):
            forward(q, q, q, 0.088, True, (-1, -1), 0.0)
    with runtime.config_overrides(cluster_m=2, persistent=True, dynamic_sched=True):
        with pytest.raises(ValueError, match="static schedule"):
            forward(q, q, q, 0.088, False, (-1, -1), 0.0)


@pytest.mark.variant
@pytest.mark.parametrize("d,dtype,causal,window,softcap,fields", [
    (64, torch.bfloat16, True, (-1, -1), 0.0, {}), (64, torch.float16, False, (-1, -1), 0.0, {}),
    (64, torch.bfloat16, False, (100, 20), 0.0, {}), (64, torch.bfloat16, True, (-1, -1), 5.0, {}),
    (128, torch.bfloat16, True, (-1, -1), 0.0, {}), (128, torch.bfloat16, False, (-1, -1), 0.0, {}),
    (96, torch.bfloat16, True, (-1, -1), 0.0, {}),
    (64, torch.bfloat16, True, (-1, -1), 0.0, {"tile_m": 128, "num_consumer_wg": 2}),
    (64, torch.bfloat16, True, (-1, -1), 0.0, {"num_stages": 3}),
    (128, torch.bfloat16, True, (-1, -1), 0.0, {"wg_epilogue": False}),
    (128, torch.bfloat16, False, (-1, -1), 0.0, {"persistent": True, "dynamic_sched": False}),
    (128, torch.bfloat16, True, (-1, -1), 0.0, {"persistent": False, "dynamic_sched": False}),
])
def test_q_ring(d, dtype, causal, window, softcap, fields, monkeypatch):
    """FwdConfig.q_stages = 2: the next tile's Q lands in the other buffer while this tile reads its
    own. Persistent CTAs walking many tiles (the ring's phase carried from tile to tile: a stage
    read before it landed or overwritten while read would show), both schedulers, one CTA per
    tile, ragged lengths, both epilogues."""
    from flashhopper.hopper import runtime

    with runtime.config_overrides(q_stages=2, **fields):
        _cases_then_many_tiles_per_cta(
            [(512, 512), (1000, 1000), (17, 4097), (4097, 17), (1, 1), (65, 300), (300, 517)], monkeypatch,
            d, dtype, causal=causal, window=window, softcap=softcap)


_PERSISTENT = {"persistent": True, "dynamic_sched": True}


@pytest.mark.variant
@pytest.mark.parametrize("d,dtype,causal,window,softcap,fields", [
    (256, torch.bfloat16, False, (-1, -1), 0.0, {"o_v_stages": False}),
    (256, torch.bfloat16, True, (-1, -1), 0.0, _PERSISTENT),
    (256, torch.float16, True, (-1, -1), 5.0, {"tile_n": 64, **_PERSISTENT}),
    (256, torch.bfloat16, False, (100, 20), 0.0, {}), (192, torch.bfloat16, False, (-1, -1), 0.0, {}),
    (128, torch.bfloat16, False, (-1, -1), 0.0, {"num_stages": 3}),
    (128, torch.bfloat16, True, (-1, -1), 0.0, {"num_stages": 3}),
    (128, torch.float16, True, (-1, -1), 0.0, {"q_stages": 2}),
    (64, torch.bfloat16, True, (-1, -1), 0.0, {}), (64, torch.bfloat16, False, (100, 20), 0.0, {}),
    (256, torch.bfloat16, False, (-1, -1), 0.0, {"wg_epilogue": False, "o_v_stages": False}),
    (128, torch.bfloat16, False, (-1, -1), 0.0, {"persistent": True, "dynamic_sched": False}),
    (256, torch.bfloat16, True, (-1, -1), 0.0, {"persistent": False, "dynamic_sched": False}),
    (256, torch.bfloat16, False, (-1, -1), 0.0, {"o_v_stages": True}),
    (256, torch.bfloat16, True, (-1, -1), 0.0, {"o_v_stages": True, **_PERSISTENT}),
    (256, torch.float16, True, (-1, -1), 5.0, {"o_v_stages": True, "tile_n": 64, **_PERSISTENT}),
    (256, torch.bfloat16, False, (100, 20), 0.0, {"o_v_stages": True}),
    (192, torch.bfloat16, True, (-1, -1), 0.0, {"o_v_stages": True, **_PERSISTENT}),
    (128, torch.bfloat16, True, (-1, -1), 0.0, {"o_v_stages": True}),
    (128, torch.float16, False, (-1, -1), 0.0, {"o_v_stages": True, "persistent": True,
                                                 "dynamic_sched": False}),
])
def test_o_in_v(d, dtype, causal, window, softcap, fields, monkeypatch):
    """FwdConfig.o_in_v: O staged in V's ring, the next tile's V held until the O stores have read
    it (with o_v_stages each warpgroup's part in a V stage of its own). Persistent CTAs walking many
    tiles (a V load landing on O before its store read it, or O written over a V stage another
    warpgroup still reads, would show), tiles with no key block (more queries than keys under the
    causal mask, windows), one-block and two-block tiles back to back, idle warpgroups, both
    epilogues."""
    from flashhopper.hopper import runtime

    with runtime.config_overrides(o_in_v=True, **fields):
        _cases_then_many_tiles_per_cta(
            [(512, 512), (1000, 1000), (17, 4097), (4097, 17), (1, 1), (65, 300), (300, 517)], monkeypatch,
            d, dtype, causal=causal, window=window, softcap=softcap)
        for sk in (50, 130, 200):  # 1, 2 (1 under a 64-key tile: 3), 3 key blocks a tile, many tiles a CTA
            run_case(2, 1000, sk, 4, 2, d, dtype, causal=causal, window=window, softcap=softcap)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal,softcap", [(False, 0.0), (True, 0.0), (True, 5.0)])
def test_short_qring_hdim64(dtype, causal, softcap, monkeypatch):
    """The dispatched hdim 64 path for short sequences (plan.fwd_short_qring: Q ring of two, three
    K / V stages), with no override: ragged ends, more keys than queries and the other way round,
    one row, then persistent CTAs walking many tiles."""
    from flashhopper.hopper import runtime

    cases = [(1024, 1024), (512, 512), (1, 1), (17, 17), (1, 1000), (1000, 1), (300, 700), (700, 300),
             (65, 129)]
    assert all(plan.fwd_short_qring(64, sq, sk, False) for sq, sk in cases)
    for sq, sk in cases:
        run_case(2, sq, sk, 4, 2, 64, dtype, causal=causal, softcap=softcap)
    monkeypatch.setattr(runtime, "persistent_ctas_cap", 3)  # every CTA walks many tiles
    run_case(3, 1000, 1000, 4, 1, 64, dtype, causal=causal, softcap=softcap)


# (hdim, dv) = (192, 128): MLA prefill's head sizes (the backward: tests/test_bwd_gpu.py)
@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (False, (100, 20), 10.0)])
@pytest.mark.parametrize("sq,sk", [(1, 1), (300, 517), (1000, 1000), (4097, 4097)])
def test_split_head_dims(sq, sk, causal, window, softcap):
    torch.manual_seed(zlib.crc32(repr((sq, sk, causal, window, softcap)).encode()))
    q = torch.randn(2, sq, 4, 192, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(2, sk, 2, 192, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(2, sk, 2, 128, device=DEV, dtype=torch.bfloat16)
    out = torch.full((2, sq, 4, 128), float("nan"), device=DEV, dtype=torch.bfloat16)
    lse = torch.full((2, 4, sq), float("nan"), device=DEV)
    scale = 192 ** -0.5
    forward(q, k, v, scale, causal, window, softcap, out=out, lse=lse)
    torch.cuda.synchronize()
    check_forward(out, lse, q, k, v, scale, causal, window, softcap)
