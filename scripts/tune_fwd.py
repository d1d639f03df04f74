"""Time forward-kernel variants (tiles, stages, consumer count, scheduling switches) on a GPU.

    python scripts/tune_fwd.py            # the built-in list; prints TFLOP/s per variant
    python scripts/tune_fwd.py persistent # one CTA per tile / persistent static / dynamic
    python scripts/tune_fwd.py persistent_wide  # hdim 192 / 256 causal: one CTA per tile vs dynamic
    python scripts/tune_fwd.py wg_epilogue      # per-warpgroup epilogue, carried ping-pong token
    python scripts/tune_fwd.py short256         # hdim 256 causal 512-2k: 80 vs 64 keys, persistent
    python scripts/tune_fwd.py fp16       # bf16 vs fp16, interleaved, three rounds
    python scripts/tune_fwd.py tiles      # hdim 128 non-causal: 128x128 vs 128x160 vs 128x176, 8k and 16k
    python scripts/tune_fwd.py tiles64    # hdim 64, short queries: 192 x 128 vs 128 x 128 rows
    python scripts/tune_fwd.py rescale    # O rescaled before P @ V (under QK^T) vs after its wait
    python scripts/tune_fwd.py overlap    # K released after the softmax (P @ V wait pinned) vs before
    python scripts/tune_fwd.py fa4sched   # FA4's step schedule (early K release, rescale among exp2s) vs ours
    python scripts/tune_fwd.py cluster    # 2x1 cluster with K/V multicast vs the dispatched kernel (no mask)
    python scripts/tune_fwd.py idle       # warpgroups with no rows below seqlen_q skip their work, or not
    python scripts/tune_fwd.py short      # the short grid points: 64 keys, 3 stages, overlap / ping-pong off
    python scripts/tune_fwd.py qring      # a Q ring of two (q_stages), short points and 8k
    python scripts/tune_fwd.py qring_limit  # hdim 64 512-4k: 1 Q + 2 K / V stages, 2 + 3, 2 + 4
    python scripts/tune_fwd.py oinv       # O staged in V's ring (o_in_v) vs Q's buffer, hdim 256 / 128
    python scripts/tune_fwd.py oinv2      # the same, and each warpgroup's part in its own V stage
    python scripts/tune_fwd.py oinv192    # hdim 192 with a part per V stage (not in the grid)
    python scripts/tune_fwd.py pingpong   # ping-pong on / off at every grid hdim (and 192), 2k / 8k
    python scripts/tune_fwd.py pingpong2  # the same at more lengths, 5 rounds; hdim 192 O in V without a mask
    python scripts/tune_fwd.py poly       # s21: every k-th exp2 as an FMA-pipe polynomial (d16cee2)
    python scripts/tune_fwd.py rowsum     # s21: row sums by a P @ ones WGMMA (c5982a2)
    python scripts/tune_fwd.py chains     # s21: the row max in 4 independent FMNMX chains, 5 rounds
    python scripts/tune_fwd.py ktry       # s22: the next K's barrier tested early (needs bc6dfc5)
    python scripts/tune_fwd.py rescale128 # s23: O rescaled before P @ V at hdim 64 / 128 vs the dispatch
    python scripts/tune_fwd.py lazy       # s23: lazy_max against the dispatch (hdim 64 / 96 / 128)
    python scripts/tune_fwd.py lazy64     # s24: hdim 64's 192 x 64 tile with lazy_max
    python scripts/tune_fwd.py lazy64_long|pingpong3  # s24: its long points; ping-pong without the overlap
    python scripts/tune_fwd.py stale      # s23: first block's max kept (360dc51's diag_stale_max)
    python scripts/tune_fwd.py gemmonly   # s22: the loads and GEMMs alone (no softmax) vs the dispatch
    python scripts/tune_fwd.py rskip      # s22: O's rescale skipped where no row max changed (needs 5d7631d)

Each variant is a FwdConfig override on top of the dispatched one; it is a tool for choosing
the defaults in flashhopper/config.py, not part of the library.
"""
import dataclasses
import math
import sys

import torch

sys.path.insert(0, ".")
from flashhopper.bench.grid import attention_flops  # noqa: E402
from flashhopper.bench.runner import time_ms  # noqa: E402
from flashhopper.hopper import runtime  # noqa: E402

_default = runtime.fwd_config


def run(hdim, causal, seqlen, dtype=torch.bfloat16, window=(-1, -1), **override):
    def patched(*a, **k):
        cfg = dataclasses.replace(_default(*a, **k), **override)
        object.__setattr__(cfg, "check", lambda: None)  # try configs the budget heuristic rejects
        return cfg
    runtime.fwd_config = patched
    try:
        b, h = 16384 // seqlen, 2048 // hdim
        q, k, v = (torch.randn(b, seqlen, h, hdim, device="cuda", dtype=dtype) for _ in range(3))
        fn = lambda: runtime.forward(q, k, v, 1 / math.sqrt(hdim), causal, window, 0.0)  # noqa: E731
        fn()
        flops = attention_flops(b, h, seqlen, seqlen, hdim, causal)
        if window != (-1, -1):  # the (query, key) pairs a (left, 0) window sees
            flops = 4.0 * b * h * hdim * sum(min(i, window[0]) + 1 for i in range(seqlen))
        tf = flops / time_ms(fn) / 1e9
        name = str(dtype).removeprefix("torch.")
        win = "" if window == (-1, -1) else f" window {window}"
        print(f"hdim {hdim:3d} causal {causal!s:5}{win} s {seqlen:5d} {name:8} {override}: {tf:6.1f} TFLOP/s",
              flush=True)
    except Exception as exc:
        print(f"hdim {hdim} causal {causal} {override}: FAILED {type(exc).__name__}: {str(exc)[:200]}",
              flush=True)
    finally:
        runtime.fwd_config = _default


# the FlashAttention-3 paper's ablation (Table 2), at hdim 128, seqlen 8k
VARIANTS = [
    (128, False, 8192, {}), (128, False, 8192, {"pingpong": False}),
    (128, False, 8192, {"intra_wg_overlap": False}),
    (128, False, 8192, {"pingpong": False, "intra_wg_overlap": False}),
    (128, True, 8192, {}), (128, True, 8192, {"pingpong": False}),
    (128, True, 8192, {"intra_wg_overlap": False}),
    (128, True, 8192, {"pingpong": False, "intra_wg_overlap": False}),
]

# one CTA per tile vs persistent (static stride) vs persistent with the dynamic (atomic) scheduler,
# at the points where launch and prologue costs weigh most
PERSISTENT = [
    (hdim, causal, seqlen, over)
    for hdim, causal, seqlen in [(128, False, 8192), (128, True, 8192), (128, True, 1024), (128, False, 512),
                                 (64, False, 1024), (64, True, 512), (256, True, 2048), (256, False, 512)]
    for over in ({}, {"persistent": True}, {"persistent": True, "dynamic_sched": True})
]

# hdim 128 non-causal key-block width: the dispatched 128 against FA3's 176 (and 160 between), at 8k and
# 16k, interleaved over TILE_ROUNDS rounds so that clock drift shows as spread. 160 and 176 compile
# spill-free with one WGMMA wait per commit group since the P conversion is done per k-block
# (hopper/mma.py acc_to_operand_a); at 176 O is staged in Q's buffer (o_buffer False: no smem for
# its own tile), so the next tile's Q waits for the epilogue's store.
TILES = [(128, False, seqlen, {"tile_n": n}) for seqlen in (8192, 16384) for n in (128, 160, 176)]
TILE_ROUNDS = 2
# hdim 64, no mask / causal / local: 192 x 128 (3 consumer warpgroups) against 128 x 128 (2) where
# config.fwd_narrow_tile switches between them (short query lengths), interleaved
TILES64 = [
    (causal, window, seqlen, torch.bfloat16, over)
    for causal, window in ((False, (-1, -1)), (True, (-1, -1)), (False, (512, 0)))  # local: 512 back
    for seqlen in (512, 1024, 1536, 2048, 4096)
    for over in ({"tile_m": 192, "num_consumer_wg": 3}, {"tile_m": 128, "num_consumer_wg": 2})
]

# rescale_o_before_pv (FA3's RescaleOBeforeGemm, dispatched for hdim > 128): on vs off at hdim 256
# (non-causal and causal) and hdim 128, 8k, interleaved over RESCALE_ROUNDS rounds
RESCALE = [(hdim, causal, 8192, {"rescale_o_before_pv": on})
           for hdim, causal in ((256, False), (256, True), (128, False), (128, True)) for on in (True, False)]
RESCALE_ROUNDS = 2

# late_k_release: K released after the softmax (pins the P @ V wait after every exp2) vs right
# after the QK^T wait, every hdim, 8k, interleaved
OVERLAP = [(hdim, causal, 8192, {"late_k_release": on})
           for hdim in (64, 128, 256) for causal in (False, True) for on in (True, False)]

# FA4's steady-state step schedule (docs/notes/fa4-schedule.md):
# K released and P @ V waited for right after the row max, O's rescale and P's conversion
# between the exp2s (row_sum_scaled_first makes ptxas issue the row-scale exp2 early), plus the
# SASS-only desc_stage_first / row_max_chains. 16k, hdim 64 and 128, interleaved.
_FA4_MIN = {"late_k_release": False, "row_sum_scaled_first": True}
_FA4_ALL = {**_FA4_MIN, "desc_stage_first": True, "row_max_chains": 4, "cvt_before_rescale": True}
FA4SCHED = [(hdim, causal, 16384, over) for hdim in (128, 64) for causal in (False, True)
            for over in ({}, _FA4_MIN, _FA4_ALL, {"desc_stage_first": True, "row_max_chains": 4})]

# hdim 192 / 256 with a causal mask run one CTA per tile (session 2's static persistent grid lost
# there); the dynamic scheduler with longest-first order may change that, most at short sequences
# where the grid's lowest point is (hdim 256 causal 512, 0.85 of cuDNN)
PERSISTENT_WIDE = [(hdim, True, seqlen, over) for hdim in (256, 192) for seqlen in (512, 1024, 2048, 8192)
                   for over in ({"persistent": False}, {"persistent": True, "dynamic_sched": True})]

# per-warpgroup epilogue + ping-pong token carried across tiles (FwdConfig.wg_epilogue) against
# the shared epilogue: the per-tile cost it removes weighs most where tiles are short
WG_EPILOGUE = [(hdim, causal, seqlen, {"wg_epilogue": on})
               for hdim, causal, seqlen in [(128, False, 512), (128, False, 1024), (128, False, 8192),
                                            (128, True, 1024), (128, True, 8192), (64, False, 512),
                                            (64, False, 8192), (64, True, 8192), (256, True, 512),
                                            (256, False, 8192)]
               for on in (False, True)]

# hdim 256 causal at 512-2k, the forward grid's lowest points (0.85 of cuDNN at 512): FA3's 80-key
# block against 64 keys (no partial block on the diagonal: 128-row query blocks end on a 64-key
# boundary; 193 KiB of smem, no spills), each one CTA per tile and persistent with the dynamic
# scheduler
SHORT256 = [(256, True, seqlen, over) for seqlen in (512, 1024, 2048)
            for over in ({}, {"tile_n": 64}, {"persistent": True, "dynamic_sched": True},
                         {"tile_n": 64, "persistent": True, "dynamic_sched": True})]

# FwdConfig.cluster_m = 2 (docs/notes/fwd-cluster.md): two CTAs on adjacent query blocks share each
# K/V tile by TMA multicast, on the static schedule (one cluster per pair of query blocks, or
# persistent clusters striding over pairs). The dispatched kernel (persistent, dynamic scheduler)
# and the same static schedules without the cluster separate the multicast from the schedule.
_STATIC = ({"persistent": False, "dynamic_sched": False}, {"persistent": True, "dynamic_sched": False})
CLUSTER = [(hdim, False, seqlen, over) for hdim in (128, 256) for seqlen in (2048, 8192, 16384)
           for over in ({}, *_STATIC, *({**o, "cluster_m": 2} for o in _STATIC))]

# FwdConfig.skip_idle_wg: a consumer warpgroup whose rows all lie past seqlen_q skips its GEMMs and
# softmax. hdim 64's 192-row tile pads every grid length (512 -> 576 rows: the last block's third
# warpgroup is idle; 1024 -> 1152: two of three); hdim 128 at 8k / 16k never has an idle warpgroup
# (the control: the same kernel with the switch compiled in)
IDLE = [(hdim, causal, seqlen, {"skip_idle_wg": on})
        for hdim, causal, seqlen in [(64, False, 512), (64, False, 1024), (64, False, 2048),
                                     (64, False, 4096), (64, False, 16384), (64, True, 2048),
                                     (64, True, 4096), (64, True, 16384), (128, False, 16384),
                                     (128, True, 8192)]
        for on in (False, True)]

# the forward grid's short points below 1.0 of the best peer (session 10: hdim 64 causal 512 at 0.93, the
# only point under 0.95; 64 causal 1k 0.99; 256 non-causal 512 0.955; 128 non-causal 512 0.99), where a
# tile walks 1-4 key blocks: narrower key blocks (more, shorter steps to overlap), a third K / V
# stage (the producer runs further into the next tile), and the intra-warpgroup overlap or the
# ping-pong off (their pipeline fill and the turn-taking are paid per tile)
_SHORT_OVERS = ({}, {"tile_n": 64}, {"num_stages": 3}, {"intra_wg_overlap": False}, {"pingpong": False})
SHORT = [(hdim, causal, seqlen, over) for hdim, causal, seqlen in [(64, True, 512), (64, True, 1024),
                                                                    (128, False, 512), (256, False, 512)]
         for over in _SHORT_OVERS if not (hdim == 256 and "num_stages" in over)]  # 3 stages: 305 KiB

# a Q ring of two (FwdConfig.q_stages): with one Q buffer the next tile's Q can only load once this
# tile's last QK^T is done, so a tile of 1-4 key blocks may wait for its Q from DRAM; at hdim 64 also
# with a third K / V stage (the producer further ahead into the next tile)
_QRING_POINTS = [(64, [(True, 512), (True, 1024), (True, 2048), (False, 512), (False, 1024), (True, 8192)]),
                 (128, [(True, 512), (True, 1024), (False, 512), (False, 8192)])]
QRING = [(hdim, causal, seqlen, over) for hdim, points in _QRING_POINTS for causal, seqlen in points
         for over in ({}, {"q_stages": 2}, *([{"q_stages": 2, "num_stages": 3}] if hdim == 64 else []))]

# the dispatched Q ring at hdim 64 (config._SHORT_QRING) against the old path and a fourth K / V stage,
# across its length limit (1024)
_QRING_AB = ({"q_stages": 1, "num_stages": 2}, {"q_stages": 2, "num_stages": 3},
             {"q_stages": 2, "num_stages": 4})
QRING_LIMIT = [(64, causal, seqlen, over) for causal in (True, False) for seqlen in (512, 1024, 2048, 4096)
               for over in _QRING_AB]

# O staged in V's ring (FwdConfig.o_in_v, FA3's layout) against O in Q's buffer: with O in Q, the next
# tile's Q can only load once this tile's O store has read Q's buffer, a bubble per tile that weighs
# where tiles are short. hdim 256 without a mask (persistent), causal at 512 (the dispatched 64-key
# persistent path) and at 1k / 2k (one CTA per tile dispatched; persistent with and without o_in_v);
# hdim 128, where o_in_v frees O's own tile and makes room for a third K / V stage
_PERSIST = {"persistent": True, "dynamic_sched": True}
OINV = ([(256, False, seqlen, over) for seqlen in (512, 1024, 2048, 8192) for over in ({}, {"o_in_v": True})]
        + [(256, True, 512, over) for over in ({}, {"o_in_v": True})]
        + [(256, True, seqlen, over) for seqlen in (1024, 2048)
           for over in ({}, _PERSIST, {**_PERSIST, "o_in_v": True})]
        + [(128, causal, seqlen, over)
           for causal, seqlen in ((False, 512), (False, 8192), (True, 512), (True, 1024))
           for over in ({}, {"o_in_v": True}, {"o_in_v": True, "num_stages": 3})])

# the same with each warpgroup's O part in a V stage of its own (FwdConfig.o_v_stages: no meeting of
# the consumers at the tile's end, the next tile's first V load held only for warpgroup 0's part)
_OV = {"o_in_v": True}
_OVS = {"o_in_v": True, "o_v_stages": True}
OINV2 = ([(256, False, seqlen, over) for seqlen in (512, 1024, 2048, 8192) for over in ({}, _OV, _OVS)]
         + [(256, True, 512, over) for over in ({}, _OV, _OVS)]
         + [(256, True, seqlen, over) for seqlen in (1024, 2048)
            for over in ({}, {**_PERSIST, **_OV}, {**_PERSIST, **_OVS})]
         + [(128, causal, seqlen, over) for causal, seqlen in ((False, 512), (False, 8192), (True, 1024))
            for over in ({}, _OV, _OVS)])

# hdim 192 (128 x 112 tiles, O in Q's buffer today) with a part per V stage: the same boundary as hdim 256
OINV192 = ([(192, False, seqlen, over) for seqlen in (512, 1024, 2048, 8192) for over in ({}, _OVS)]
           + [(192, True, seqlen, over) for seqlen in (512, 1024, 2048)
              for over in ({}, _PERSIST, {**_PERSIST, **_OVS})])

# ping-pong on / off on the dispatched kernels: per MHz it did not pay at hdim 128 8k (session 13), and
# FA3 turns it off above hdim 128; hdim 192 / 256 were last timed without it in session 2
PINGPONG = ([(hdim, causal, seqlen, over) for hdim in (64, 128) for causal in (False, True)
             for seqlen in (2048, 8192) for over in ({}, {"pingpong": False})]
            + [(hdim, causal, 8192, over) for hdim in (192, 256) for causal in (False, True)
               for over in ({}, {"pingpong": False})])

# where `pingpong` leaned to ping-pong off (hdim 128 causal 8k +4.3%, hdim 192 +1.5..+2.1%), at more
# lengths and rounds; and hdim 192 without a mask with O in V's stages (+7.5% at 512, -6.8% at 8k there)
_NOPP = {"pingpong": False}
PINGPONG2 = ([(128, True, seqlen, over) for seqlen in (4096, 8192, 16384) for over in ({}, _NOPP)]
             + [(128, False, 16384, over) for over in ({}, _NOPP)]
             + [(192, causal, seqlen, over) for causal in (False, True) for seqlen in (2048, 16384)
                for over in ({}, _NOPP)]
             + [(64, True, seqlen, over) for seqlen in (8192, 16384) for over in ({}, _NOPP)]
             + [(192, False, seqlen, over) for seqlen in (512, 1024, 8192) for over in ({}, _OVS)])

# every k-th exp2 of a mask-free block on the FMA / ALU pipes (FwdConfig.exp2_poly_every): at hdim 64 a
# step's MUFU.EX2 cycles equal its tensor cycles (3 warps an SM sub-partition, 66 EX2 each at 4 lanes a
# cycle: 1,584 cycles against 1,536 of WGMMA per three warpgroup steps), at hdim 128 they are half
POLY = ([(64, causal, seqlen, {"exp2_poly_every": k} if k else {}) for causal, seqlens in
         ((False, (2048, 8192, 16384)), (True, (8192, 16384))) for seqlen in seqlens for k in (0, 8, 4, 2)]
        + [(128, causal, seqlen, {"exp2_poly_every": k} if k else {})
           for causal, seqlen in ((False, 8192), (False, 16384), (True, 16384)) for k in (0, 8, 4)]
        + [(256, False, 8192, {"exp2_poly_every": k} if k else {}) for k in (0, 8, 4)])

# row sums by the tensor cores (FwdConfig.rowsum_mma): the steady step loses its 64 FADDs a thread (hdim 64:
# 441 -> 406 instructions, hdim 128: 498 -> 459) for 8 small WGMMAs; it releases K right after the S wait,
# so late_k_release=False is timed too
RSUM = [(hdim, causal, seqlen, over) for hdim, points in
        ((64, ((False, 2048), (False, 8192), (False, 16384), (True, 8192), (True, 16384))),
         (128, ((False, 8192), (False, 16384), (True, 8192), (True, 16384))))
        for causal, seqlen in points
        for over in ({}, {"late_k_release": False}, {"rowsum_mma": True})]

# the row max as 4 independent FMNMX chains instead of one 31-deep chain (row_max_chains; same result): at
# hdim 64 the largest stall is `wait` (fixed-latency dependencies), and the row max is the chain every
# softmax starts with, before its first exp2 (~150 cycles serial, ~60 as 4 chains at the ALU's issue rate)
CHAINS = [(hdim, causal, seqlen, over) for hdim, points in
          ((64, ((False, 2048), (False, 8192), (False, 16384), (True, 2048), (True, 8192), (True, 16384))),
           (128, ((False, 8192), (False, 16384), (True, 8192), (True, 16384))), (256, ((False, 8192),)))
          for causal, seqlen in points for over in ({}, {"row_max_chains": 4})]

# O's rescale skipped by a warp when none of its rows got a new max (rescale_skip; exact): with random
# scores a row's max changes in 1 / j of the blocks at block j, so most late steps drop hdim / 2 FMULs
# from the serial tail after the P @ V wait (at hdim 256 from the issue of the next P @ V)
RSKIP = [(hdim, causal, seqlen, over) for hdim, points in
         ((64, ((False, 2048), (False, 8192), (False, 16384), (True, 8192), (True, 16384))),
          (128, ((False, 2048), (False, 8192), (False, 16384), (True, 8192), (True, 16384))),
          (256, ((False, 8192), (True, 8192))))
         for causal, seqlen in points for over in ({}, {"rescale_skip": True})]

# the next K's barrier tested right after the softmax and the result carried to the next step
# (k_try_wait): the trace (scripts/fwd_trace.py) put ~100-170 cycles of try_wait latency on the path
# from the softmax to the next QK^T issue, where hdim 128's warpgroups come ~240 cycles late
KTRY = [(hdim, causal, seqlen, over) for hdim, points in
        ((64, ((False, 8192), (True, 8192))),
         (128, ((False, 2048), (False, 8192), (False, 16384), (True, 8192), (True, 16384))),
         (256, ((False, 8192),)))
        for causal, seqlen in points for over in ({}, {"k_try_wait": True})]

# O's rescale before P @ V (rescale_o_before_pv, dispatched only above hdim 128) at hdim 64 / 128: the
# timeline (s22_b) has the 64 / 32 FMULs of the rescale in the serial tail between the P @ V wait and the
# next QK^T issue, on the path where hdim 128's warpgroups come ~250 cycles late; moved under the QK^T
RESCALE128 = [(hdim, causal, seqlen, over) for hdim, points in
              ((64, ((False, 8192), (False, 16384), (True, 8192))),
               (128, ((False, 2048), (False, 8192), (False, 16384), (True, 8192), (True, 16384))))
              for causal, seqlen in points for over in ({}, {"rescale_o_before_pv": True})]

# s24_a: hdim 64 with lazy_max on its 192-row tile, which takes it only with 64-key blocks, against the
# dispatch at 1k-16k (1k: the Q-ring bracket) and, at 8k, the same tile without it
LAZY64 = [(64, causal, seqlen, over) for causal in (False, True) for seqlen in (1024, 2048, 4096, 8192, 16384)
          for over in ({}, {"tile_n": 64, "lazy_max": True}) + (({"tile_n": 64},) if seqlen == 8192 else ())]

# s24_b: the long points of LAZY64 again, 5 rounds (s24_a: +3.7% at 4k and +3.8% at causal 16k, -0.4..+0.5% at
# 8k / 16k, -3..-6% at 1k / 2k)
LAZY64_LONG = [(64, causal, seqlen, over) for causal in (False, True) for seqlen in (4096, 8192, 16384)
               for over in ({}, {"tile_n": 64, "lazy_max": True})]

# s24_b: ping-pong with and without the intra-warpgroup overlap at hdim 128, 8k (the ablation, s24_a, has
# ping-pong off -0.5..+0.2%: does it pay where the overlap is off? s24_b: no, off was 1-5% faster there)
PINGPONG3 = [(128, causal, 8192, over) for causal in (False, True)
             for over in ({}, {"pingpong": False}, {"intra_wg_overlap": False},
                          {"intra_wg_overlap": False, "pingpong": False})]

# diagnostic (needs 360dc51): the peeled first block's running max kept as the exp2 offset (diag_stale_max:
# no row max, shuffles, row-scale exp2 or O rescale in the overlapped steps; exact on the random inputs
# used here), the most a lazy max with an overflow fix-up could gain
STALE = [(hdim, causal, seqlen, over) for hdim, points in
         ((64, ((False, 8192), (False, 16384), (True, 8192))),
          (128, ((False, 2048), (False, 8192), (False, 16384), (True, 8192), (True, 16384))),
          (256, ((False, 8192), (True, 16384))))
         for causal, seqlen in points for over in ({}, {"diag_stale_max": True})]

# lazy_max (the running max kept in mask-free steps, exact redo by a warp whose block sum passes 2^8)
# against the dispatch; hdim 64 on 128 x 128 tiles (its 192-row tile has no registers for a second P),
# with and without lazy_max
LAZY_128 = {"tile_m": 128, "num_consumer_wg": 2}
LAZY = [(hdim, causal, seqlen, over) for hdim, points, overs in
        ((128, ((False, 2048), (False, 8192), (False, 16384), (True, 8192), (True, 16384)),
          ({}, {"lazy_max": True})),
         (96, ((False, 8192),), ({}, {"lazy_max": True})),
         (64, ((False, 8192), (False, 16384), (True, 8192)),
          ({}, LAZY_128, {**LAZY_128, "lazy_max": True})))
        for causal, seqlen in points for over in overs]

# diagnostic: the loads and GEMMs alone (gemm_only: no softmax, wrong results) against the dispatch, for
# the rate the tensor pipe sustains with this kernel's feed
GEMMONLY = [(hdim, False, seqlen, over) for hdim in (64, 128, 256) for seqlen in (8192, 16384)
            for over in ({}, {"gemm_only": True})]

# fp16 vs bf16 (issue 4: within 3%), interleaved and repeated so clock drift shows as spread
# rather than as a dtype difference
DTYPE_ROUNDS = 3

# modes that repeat an interleaved list of (hdim, causal, seqlen, override) for some rounds
INTERLEAVED = {"persistent_wide": (PERSISTENT_WIDE, 2), "short256": (SHORT256, 2),
               "wg_epilogue": (WG_EPILOGUE, 2),
               "fa4sched": (FA4SCHED, RESCALE_ROUNDS),
               "overlap": (OVERLAP, RESCALE_ROUNDS), "rescale": (RESCALE, RESCALE_ROUNDS),
               "tiles": (TILES, TILE_ROUNDS), "cluster": (CLUSTER, 2), "idle": (IDLE, 3),
               "short": (SHORT, 2), "qring": (QRING, 3),
               "qring_limit": (QRING_LIMIT, 3), "oinv": (OINV, 3), "oinv2": (OINV2, 3),
               "oinv192": (OINV192, 3), "pingpong": (PINGPONG, 3),
               "pingpong2": (PINGPONG2, 5), "poly": (POLY, 3), "rowsum": (RSUM, 3), "chains": (CHAINS, 5),
               "rskip": (RSKIP, 5), "ktry": (KTRY, 5),
               "gemmonly": (GEMMONLY, 3), "rescale128": (RESCALE128, 5),
               "stale": (STALE, 3), "lazy": (LAZY, 3),
               "lazy64": (LAZY64, 3), "lazy64_long": (LAZY64_LONG, 5), "pingpong3": (PINGPONG3, 3)}

if __name__ == "__main__":
    mode = next((m for m in INTERLEAVED if m in sys.argv), None)
    if "tiles64" in sys.argv:
        for causal, window, seqlen, dtype, over in TILES64:
            run(64, causal, seqlen, dtype, window, **over)
    elif mode:
        points, rounds = INTERLEAVED[mode]
        for _ in range(rounds):
            for hdim, causal, seqlen, override in points:
                run(hdim, causal, seqlen, **override)
    elif "fp16" in sys.argv:
        for _ in range(DTYPE_ROUNDS):
            for hdim in (64, 128, 256):
                for dtype in (torch.bfloat16, torch.float16):
                    run(hdim, False, 8192, dtype)
    else:
        for hdim, causal, seqlen, override in PERSISTENT if "persistent" in sys.argv else VARIANTS:
            run(hdim, causal, seqlen, **override)
