"""Backward preprocess: D = rowsum(dO * O) in fp32 and the log2-domain LSE of the main kernel.

Both come out as (b, h, sq_pad) rows padded to whole query blocks, so the main kernel loads each
block's rows with one TMA and no bounds test: padded rows get D = 0 and LSE = +inf (P = 0), as do
rows that saw no key in the forward (LSE = -inf there).

One pass that reads O and dO once; it should run at HBM speed (16k tokens x 2048 of O and dO,
128 MiB, ~30 us on the H200). A group of `lanes_per_row` lanes shares a row, each lane loading
16-byte vectors (lane l of the group takes vectors l, l + lanes, ...: each load instruction of
the warp reads whole rows contiguously), and a butterfly shuffle within the group sums the row.
Every load of the CTA's rows is issued before the first product, so each thread has
ROWS_PER_CTA / rows_per_pass x 2 vectors in flight. (The first version, a warp per row with
2-byte loads and one row at a time, took 76 us at hdim 64 and 50 us at hdim 128:
docs/decisions.md.) O and dO are the main kernel's TMA operands, so they
are 16-byte aligned with 16-byte row strides here too.
"""

from __future__ import annotations

import math
import operator

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flashhopper.hopper import layout as L
from flashhopper.hopper.host import PRE_ROWS_PER_CTA

LOG2E = math.log2(math.e)
ROWS_PER_CTA = PRE_ROWS_PER_CTA
WARPS = 8
VEC = 8  # 16-bit elements per 16-byte load


def lanes_per_row(hdim: int) -> int:
    """Lanes sharing a row: the largest power of two (<= 32) that divides the row's 16-byte
    vectors, so every lane of the group loads the same number of them (64: 8, 96: 4, 128: 16,
    192: 8, 256: 32)."""
    vectors, lanes = hdim // VEC, 1
    while lanes < 32 and vectors % (2 * lanes) == 0:
        lanes *= 2
    return lanes


class BwdPreprocess:
    """D = rowsum(dO * O) (BwdPreprocessScaled: times the softmax scale, BwdConfig.scale_in_ds)."""

    def __init__(self, dtype: str, hdim: int):
        if hdim % VEC:
            raise ValueError(f"hdim {hdim} must be a multiple of {VEC} for the backward preprocess")
        self.dtype = L.CUTE_DTYPES[dtype]
        self.hdim = hdim
        self.lanes = lanes_per_row(hdim)
        self.rows_per_pass = 32 * WARPS // self.lanes
        self.pdl = False  # BwdPreprocessZeroDq's option
        if ROWS_PER_CTA % self.rows_per_pass:
            raise ValueError(f"hdim {hdim}: {self.rows_per_pass} rows per pass do not divide {ROWS_PER_CTA}")

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
        self.rows(mO, mdO, mLSE, mLSE2, mD, None)

    @cute.jit
    def rows(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
             mD: cute.Tensor, d_scale, mdQaccum=None, seq=None):
        """`d_scale` None (a trace-time choice): D unscaled, the kernel unchanged. `mdQaccum`
        (b, sq, h, d) fp32: also cleared, row by row as O and dO are read (BwdPreprocessZeroDq).
        `seq` (varlen, BwdPreprocessVarlen): this sequence's (first packed row, used rows, first
        padded row, padded rows); the tensors' batch is 1 and the rows written are the padded
        ones (+inf / 0 past the used rows)."""
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        seqlen_q = mO.shape[1]
        in_row, out_row, out_rows = 0, 0, 0  # varlen: packed / padded row offsets, padded rows
        if cutlass.const_expr(seq is not None):
            in_row, seqlen_q, out_row, out_rows = seq
            batch = 0
        lanes = self.lanes
        passes = ROWS_PER_CTA // self.rows_per_pass
        vecs = self.hdim // VEC // lanes
        group_row = tidx // lanes
        lane = tidx % lanes
        rO = cute.make_rmem_tensor((VEC, vecs, passes), self.dtype)
        rdO = cute.make_rmem_tensor((VEC, vecs, passes), self.dtype)
        rLSE = cute.make_rmem_tensor((passes,), Float32)
        rO.fill(0.0)
        rdO.fill(0.0)
        rLSE.fill(-math.inf)
        for p in cutlass.range_constexpr(passes):
            row = m_block * ROWS_PER_CTA + p * self.rows_per_pass + group_row
            if row < seqlen_q:
                # the group's lanes read one address: one transaction
                rLSE[p] = mLSE[batch, head, in_row + row]
                gO = mO[batch, in_row + row, head, None]
                gdO = mdO[batch, in_row + row, head, None]
                for v in cutlass.range_constexpr(vecs):
                    cute.autovec_copy(cute.local_tile(gO, (VEC,), (lane + v * lanes,)), rO[None, v, p])
                    cute.autovec_copy(cute.local_tile(gdO, (VEC,), (lane + v * lanes,)), rdO[None, v, p])
        if cutlass.const_expr(self.pdl):
            # BwdConfig.pdl: the main kernel may launch now; it waits for this grid to complete
            # (griddepcontrol.wait) before it reads anything written below
            cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(mdQaccum is not None):
            # 16-byte stores of zeros while the loads above are in flight; the group's lanes write
            # contiguous vectors of the row, as they read O
            rZero = cute.make_rmem_tensor((VEC // 2,), Float32)
            rZero.fill(0.0)
            for p in cutlass.range_constexpr(passes):
                row = m_block * ROWS_PER_CTA + p * self.rows_per_pass + group_row
                if row < seqlen_q:
                    gdQ = mdQaccum[batch, row, head, None]
                    for v in cutlass.range_constexpr(2 * vecs):
                        cute.autovec_copy(rZero, cute.local_tile(gdQ, (VEC // 2,), (lane + v * lanes,)))
        for p in cutlass.range_constexpr(passes):
            row = m_block * ROWS_PER_CTA + p * self.rows_per_pass + group_row
            acc = Float32(0.0)
            for v in cutlass.range_constexpr(vecs):
                for e in cutlass.range_constexpr(VEC):
                    acc += rO[e, v, p].to(Float32) * rdO[e, v, p].to(Float32)
            acc = cute.arch.warp_reduction(acc, operator.add, threads_in_group=lanes)
            write = lane == 0
            if cutlass.const_expr(seq is not None):
                write = write and row < out_rows
            if write:
                # +inf for padded rows and rows that saw no key (their LSE stayed -inf)
                lse2 = Float32(math.inf)
                if rLSE[p] != -math.inf:
                    lse2 = rLSE[p] * LOG2E
                mLSE2[batch, head, out_row + row] = lse2
                if cutlass.const_expr(d_scale is not None):
                    acc = acc * d_scale
                mD[batch, head, out_row + row] = acc


class BwdPreprocessScaled(BwdPreprocess):
    """The preprocess for BwdConfig.scale_in_ds: D * softmax_scale."""

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
                 mD: cute.Tensor, d_scale: Float32, stream: cuda.CUstream):
        grid = (cute.size(mD.shape[2]) // ROWS_PER_CTA, cute.size(mD.shape[1]), cute.size(mD.shape[0]))
        self.kernel(mO, mdO, mLSE, mLSE2, mD, d_scale).launch(grid=grid, block=[32 * WARPS, 1, 1],
                                                              stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
               mD: cute.Tensor, d_scale: Float32):
        self.rows(mO, mdO, mLSE, mLSE2, mD, d_scale)


class BwdPreprocessZeroDq(BwdPreprocess):
    """The preprocess for BwdConfig.pre_zero_dq: also clears the fp32 dQ accumulator, each row as
    its O and dO rows are read, so the backward needs no fill kernel before it (`scale_d`: D times
    the softmax scale, as BwdPreprocessScaled)."""

    def __init__(self, dtype: str, hdim: int, scale_d: bool = False, pdl: bool = False):
        super().__init__(dtype, hdim)
        self.scale_d = scale_d
        self.pdl = pdl

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
                 mD: cute.Tensor, mdQaccum: cute.Tensor, d_scale: Float32, stream: cuda.CUstream):
        grid = (cute.size(mD.shape[2]) // ROWS_PER_CTA, cute.size(mD.shape[1]), cute.size(mD.shape[0]))
        self.kernel(mO, mdO, mLSE, mLSE2, mD, mdQaccum, d_scale).launch(grid=grid, block=[32 * WARPS, 1, 1],
                                                                        stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
               mD: cute.Tensor, mdQaccum: cute.Tensor, d_scale: Float32):
        if cutlass.const_expr(self.scale_d):
            self.rows(mO, mdO, mLSE, mLSE2, mD, d_scale, mdQaccum)
        else:
            self.rows(mO, mdO, mLSE, mLSE2, mD, None, mdQaccum)


class BwdPreprocessVarlen(BwdPreprocess):
    """The preprocess of the varlen backward (BwdConfig.varlen): O, dO (1, total_q, h, d) and LSE
    (1, h, total_q) packed; the LSE / D rows out in the main kernel's padded layout, sequence b's
    from row pad_q[b] up to pad_q[b + 1] (at least its used rows rounded up to whole query blocks).
    One CTA per (64-row block of the longest padded sequence, head, sequence); `scale_d`: D times
    the softmax scale (BwdConfig.scale_in_ds; d_scale is ignored without it)."""

    def __init__(self, dtype: str, hdim: int, scale_d: bool = False):
        super().__init__(dtype, hdim)
        self.scale_d = scale_d

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
                 mD: cute.Tensor, mCuQ: cute.Tensor, mUsedQ: cute.Tensor, mPadQ: cute.Tensor,
                 max_rows: Int32, d_scale: Float32, stream: cuda.CUstream):
        # mCuQ, mPadQ (batch + 1,), mUsedQ (batch,) int32; max_rows: the most padded rows a sequence has
        grid = ((max_rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA, cute.size(mD.shape[1]),
                cute.size(mUsedQ.shape[0]))
        self.kernel(mO, mdO, mLSE, mLSE2, mD, mCuQ, mUsedQ, mPadQ, d_scale).launch(
            grid=grid, block=[32 * WARPS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
               mD: cute.Tensor, mCuQ: cute.Tensor, mUsedQ: cute.Tensor, mPadQ: cute.Tensor, d_scale: Float32):
        _, _, batch = cute.arch.block_idx()
        seq = (mCuQ[batch], mUsedQ[batch], mPadQ[batch], mPadQ[batch + 1] - mPadQ[batch])
        if cutlass.const_expr(self.scale_d):
            self.rows(mO, mdO, mLSE, mLSE2, mD, d_scale, seq=seq)
        else:
            self.rows(mO, mdO, mLSE, mLSE2, mD, None, seq=seq)
