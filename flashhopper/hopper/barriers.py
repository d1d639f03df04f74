"""Named-barrier ids (bar.sync / bar.arrive), one IntEnum per kernel class.

Id 0 is __syncthreads; the hardware has 16 per CTA. A member that ends in `_WG` is the first of a
range, one id per consumer warpgroup (the id is base + w); each kernel checks at trace time that its
ranges stay below 16.
"""

from __future__ import annotations

import enum

from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

NUM_NAMED_BARRIERS = 16


class FwdBarrier(enum.IntEnum):
    """hopper/fwd.py."""

    EPILOGUE = 1  # all consumers: O's staging buffer free / written
    PINGPONG_WG = 2  # ping-pong: warpgroup w's turn at the tensor cores (ids 2, 3)
    EPILOGUE_WG = 5  # FwdConfig.wg_epilogue: warpgroup w's own epilogue barrier (128 threads)
    V_ZERO = 8  # varlen: all consumers meet after zeroing V's rows past the sequence (zero_v_past_keys)


class BwdBarrier(enum.IntEnum):
    """hopper/bwd.py (kv_split "keys")."""

    DS = 1  # both consumer warpgroups: dS^T tile written / dQ GEMM done reading it
    DQ_EMPTY = 2  # dQ writer -> consumers: the smem dQ tile may be overwritten
    DQ_FULL = 3  # consumers -> dQ writer: the smem dQ tile holds this step's dQ
    # BwdConfig.dq_per_wg: warpgroup w's own pair instead of DQ_EMPTY / DQ_FULL, 128 + 32 threads each:
    # DQ_WG + w = its dQ part is empty (writer -> w), DQ_WG + num_consumer_wg + w = full (w -> writer)
    DQ_WG = 4
    # varlen, a sequence with unused rows: all consumers meet after zeroing them in smem (zero_unused_rows)
    UNUSED_ROWS = 15


class BwdWideBarrier(enum.IntEnum):
    """hopper/bwd_wide.py (kv_split "hdim"), over all consumer threads unless said."""

    PDS_FREE = 2  # every warpgroup's GEMMs of the previous query block are done reading sP / sdS
    PDS_FULL = 3  # this query block's P and dS are in smem
    EPILOGUE = 4  # dK / dV staging in K's and V's buffers: nobody reads K / V any more / tile written
    DQ_TURN = 5  # deterministic: this CTA's turn to add dQ of the query block came / is done
    WG_PDS = 6  # sdp_by_gemm: warpgroup 0's own P columns are in smem (its 128 threads)
    P_FULL = 8  # sdp_by_gemm: warpgroup 0's P is in smem (warpgroup 0 arrives, warpgroup 1 waits)
    # dq_tma: warpgroup w's dQ part of the smem tile is empty (writer -> w, DQ_WG + w) / full (w -> writer,
    # DQ_WG + W + w), 128 + 32 threads each; ids 9 .. 14 at W = 3
    DQ_WG = 9
    # varlen, a sequence with unused rows: all consumers meet after zeroing them in smem (zero_unused_rows)
    UNUSED_ROWS = 15


@dsl_user_op
def sync_unaligned(barrier_id, number_of_threads: int, *, loc=None, ip=None) -> None:
    """`barrier.sync` without `.aligned`: a named barrier its threads reach from different instructions
    (warp-specialized roles in different code, e.g. the wide backward's dQ writer and a consumer
    warpgroup). bar.sync (cute.arch.barrier) is the aligned form, which PTX requires every participating
    thread to reach at the same instruction; compute-sanitizer's synccheck reports the mix as divergent."""
    llvm.inline_asm(
        None, [Int32(barrier_id).ir_value(loc=loc, ip=ip), Int32(number_of_threads).ir_value(loc=loc, ip=ip)],
        "barrier.sync $0, $1;", "r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )
