"""Backward preprocess: D = rowsum(dO * O) in fp32 and the log2-domain LSE of the main kernel.

Both come out as (b, h, sq_pad) rows padded to whole query blocks, so the main kernel loads each
block's rows with one TMA and no bounds test: padded rows get D = 0 and LSE = +inf (P = 0), as do
rows that saw no key in the forward (LSE = -inf there).

Doing this in torch cost a fp32 copy of dO and of O plus their product: about 0.3 ms per call on
the benchmark grid's 16k tokens, a third of the whole backward at seqlen 1k. Here it is one pass
that reads O and dO once. One warp per row: lane l reads columns l, l + 32, ... so each load
instruction of the warp is one contiguous run, and a warp shuffle sums the row.
"""

from __future__ import annotations

import math
import operator

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32

from flashhopper.hopper import layout as L

LOG2E = math.log2(math.e)
ROWS_PER_CTA = 64
WARPS = 8


class BwdPreprocess:
    def __init__(self, dtype: str, hdim: int):
        if hdim % 32:
            raise ValueError(f"hdim {hdim} must be a multiple of 32 for the backward preprocess")
        self.dtype = L.CUTE_DTYPES[dtype]
        self.hdim = hdim

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,  # (b, sq, h, d)
        mdO: cute.Tensor,  # (b, sq, h, d)
        mLSE: cute.Tensor,  # (b, h, sq) fp32, natural log; -inf for rows that saw no key
        mLSE2: cute.Tensor,  # (b, h, sq_pad) fp32 out: LSE * log2(e), +inf for padded / key-less rows
        mD: cute.Tensor,  # (b, h, sq_pad) fp32 out
        stream: cuda.CUstream,
    ):
        grid = (cute.size(mD.shape[2]) // ROWS_PER_CTA, cute.size(mD.shape[1]), cute.size(mD.shape[0]))
        self.kernel(mO, mdO, mLSE, mLSE2, mD).launch(grid=grid, block=[32 * WARPS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
               mD: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32
        seqlen_q = mO.shape[1]
        rows_per_warp = ROWS_PER_CTA // WARPS
        for i in cutlass.range_constexpr(rows_per_warp):
            row = m_block * ROWS_PER_CTA + warp * rows_per_warp + i
            acc = Float32(0.0)
            if row < seqlen_q:
                for j in cutlass.range_constexpr(self.hdim // 32):
                    col = lane + 32 * j
                    acc += mO[batch, row, head, col].to(Float32) * mdO[batch, row, head, col].to(Float32)
            acc = cute.arch.warp_reduction(acc, operator.add)
            if lane == 0:
                lse2 = Float32(math.inf)
                if row < seqlen_q:
                    lse = mLSE[batch, head, row]
                    if lse != -math.inf:
                        lse2 = lse * LOG2E
                mLSE2[batch, head, row] = lse2
                mD[batch, head, row] = acc
