"""Split-KV decode's merge: the partial outputs of a row's splits combined by their LSE, in one launch.

kvcache's split decode (flashhopper/splitkv.py) runs each item's key chunks as sequences of their own
and merges their partial outputs: out = sum_j exp(lse_j - m) o_j / sum_j exp(lse_j - m), m the largest
lse_j, and lse = m + log(sum_j exp(lse_j - m)). In torch that is nine small kernels (merge_by_lse);
here it is one, a warp per output row (batch item, packed row, head):

- the row's split LSEs, one a lane (max_splits / 32 a lane), their max and the sum of the weights
  exp(lse_j - m) by warp reductions (a split with no key, -inf, weighs 0; a row with no key in any
  split has m = -inf, taken as 0: weights 0, output 0, LSE -inf);
- the partial rows in 16-byte vectors: a group of `lanes` lanes covers a row (lane l of the group
  takes vectors l, l + lanes, ...), the warp's 32 / lanes groups take that many splits a pass, and a
  butterfly shuffle across the groups sums them; the loads carry no branch (a split past the last is
  read as the last, its weight 0), so the unrolled passes have their loads in flight together;
- the sum in fp32 times 1 / total (1 where no key), written in the output dtype by the first group, the
  LSE by lane 0.

The tensors are views with any strides but the head dim's (contiguous, 16-byte aligned rows of the
partials and the output): splitkv.combine passes the partials (b, splits, rows, heads, dv), their LSEs
(b, splits, rows, heads) and the unpacking views of the output and its LSE.
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import Float32
from cutlass.cute.nvgpu import cpasync

from flashhopper.config import CombineConfig
from flashhopper.hopper import layout as L

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
WARPS = 4  # rows (warps) a CTA: 8 CTAs for 32 rows, one item of 32 query heads
IN_FLIGHT = 8  # 16-byte vectors a lane loads before it sums them (passes a loop iteration: 8 / vectors)


def vector_elems(dtype: str) -> int:
    """Elements of a 16-byte vector of `dtype`."""
    return 16 // (L.CUTE_DTYPES[dtype].width // 8)


def lanes_per_row(vectors: int) -> int:
    """Lanes sharing a row of `vectors` 16-byte vectors: the largest power of two (<= 32) dividing it,
    so every lane of the group loads as many (bf16: dv 64: 8, 96: 4, 128: 16, 192: 8, 256: 32)."""
    lanes = 1
    while lanes < 32 and vectors % (2 * lanes) == 0:
        lanes *= 2
    return lanes


class CombineSplits:
    """One warp per output row: the merge of its splits' partial outputs by LSE (module docstring)."""

    def __init__(self, cfg: CombineConfig):
        cfg.check()
        self.cfg = cfg
        self.dtype = L.CUTE_DTYPES[cfg.dtype]
        self.out_dtype = L.CUTE_DTYPES[cfg.out_dtype]
        self.vec = vector_elems(cfg.dtype)
        vectors = cfg.hdim // self.vec
        self.lanes = lanes_per_row(vectors)
        self.vecs = vectors // self.lanes  # vectors a lane
        self.groups = 32 // self.lanes  # splits a pass
        self.unroll = max(1, IN_FLIGHT // self.vecs)  # passes a loop iteration
        self.lse_per_lane = cfg.max_splits // 32
        # the butterfly's offsets across the groups: lanes, 2 lanes, ... 16
        self.offsets = tuple(self.lanes << i for i in range(5) if self.lanes << i < 32)

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,  # (b, splits, rows, heads, dv) the partial outputs
        mLSE: cute.Tensor,  # (b, splits, rows, heads) fp32, natural log; -inf: no key in the split
        mOut: cute.Tensor,  # (b, rows, heads, dv) out
        mLSEOut: cute.Tensor,  # (b, rows, heads) fp32 out
        stream: cuda.CUstream,
    ):
        total = cute.size(mOut.shape[0]) * cute.size(mOut.shape[1]) * cute.size(mOut.shape[2])
        grid = ((total + WARPS - 1) // WARPS, 1, 1)
        self.kernel(mO, mLSE, mOut, mLSEOut).launch(grid=grid, block=[32 * WARPS, 1, 1], stream=stream,
                                                    use_pdl=self.cfg.pdl)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mLSE: cute.Tensor, mOut: cute.Tensor, mLSEOut: cute.Tensor):
        if cutlass.const_expr(self.cfg.pdl):  # CombineConfig.pdl: the partials are the previous kernel's
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32
        batch, splits, rows, heads = mLSE.shape
        lanes, vecs, vec, unroll = self.lanes, self.vecs, self.vec, self.unroll
        # each lane's 16-byte vectors of `unroll` passes, lanes' vectors side by side (no bank conflict)
        staged = cute.make_layout((vec, vecs, unroll, 32, WARPS),
                                  stride=(1, 32 * vec, 32 * vec * vecs, vec, 32 * vec * vecs * unroll))
        sO = cutlass.memory.SmemAllocator().allocate_tensor(self.dtype, staged, byte_alignment=16)
        sO = sO[None, None, None, lane, warp]
        row = bidx * WARPS + warp
        if row < batch * rows * heads:
            h = row % heads
            r = (row // heads) % rows
            b = row // (heads * rows)
            # the row's LSEs, one a lane (past the last split: the last one's read, taken as -inf);
            # their max; the weights, the sum of them
            rW = cute.make_rmem_tensor((self.lse_per_lane,), Float32)
            top = -math.inf
            for k in cutlass.range_constexpr(self.lse_per_lane):
                j = lane + 32 * k
                lse = mLSE[b, cutlass.min(j, splits - 1), r, h]
                rW[k] = Float32(cutlass.select_(j < splits, lse, Float32(-math.inf)))
                top = cute.arch.fmax(top, rW[k])
            top = cute.arch.warp_reduction_max(top)
            top = Float32(cutlass.select_(top == -math.inf, Float32(0.0), top))  # no key anywhere: 0
            total = Float32(0.0)
            for k in cutlass.range_constexpr(self.lse_per_lane):
                rW[k] = cute.math.exp2((rW[k] - top) * LOG2E, fastmath=True)  # -inf: 0
                total += rW[k]
            total = cute.arch.warp_reduction_sum(total)
            # the weighted partial rows: group g takes splits g, g + groups, ...; member m its vectors,
            # `unroll` passes' vectors copied to shared memory together (cp.async: all in flight; loads
            # into registers ptxas issues one at a time, each before its use)
            group = lane // lanes
            member = lane % lanes
            copy = cute.make_copy_atom(cpasync.CopyG2SOp(), self.dtype, num_bits_per_copy=128)
            acc = cute.make_rmem_tensor((vec, vecs), Float32)
            acc.fill(0.0)
            rO = cute.make_rmem_tensor((vec,), self.dtype)
            passes = (splits + self.groups - 1) // self.groups
            for p0 in cutlass.range((passes + unroll - 1) // unroll, unroll=1):
                for u in cutlass.range_constexpr(unroll):
                    # a split past the last: the last one's row copied again, weighed 0
                    gO = mO[b, cutlass.min((p0 * unroll + u) * self.groups + group, splits - 1), r, h, None]
                    for v in cutlass.range_constexpr(vecs):
                        cute.copy(copy, cute.local_tile(gO, (vec,), (member + v * lanes,)), sO[None, v, u])
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(0)
                for u in cutlass.range_constexpr(unroll):
                    j = (p0 * unroll + u) * self.groups + group
                    # split j's weight from lane j % 32 (j // 32 is the same for the warp's lanes)
                    base = (p0 * unroll + u) * self.groups // 32
                    w = rW[0]
                    for k in cutlass.range_constexpr(1, self.lse_per_lane):
                        w = Float32(cutlass.select_(base == k, rW[k], w))
                    w = cute.arch.shuffle_sync(w, j % 32)
                    w = Float32(cutlass.select_(j < splits, w, Float32(0.0)))
                    for v in cutlass.range_constexpr(vecs):
                        cute.autovec_copy(sO[None, v, u], rO)
                        for e in cutlass.range_constexpr(vec):
                            # weight 0: the row is not taken into the sum (it may hold anything)
                            term = w * rO[e].to(Float32)
                            acc[e, v] += Float32(cutlass.select_(w > 0.0, term, Float32(0.0)))
            for i in cutlass.range_constexpr(len(self.offsets)):  # the groups' sums
                for v in cutlass.range_constexpr(vecs):
                    for e in cutlass.range_constexpr(vec):
                        acc[e, v] += cute.arch.shuffle_sync_bfly(acc[e, v], self.offsets[i])
            if group == 0:
                scale = 1.0 / cute.arch.fmax(total, Float32(1.0))  # 0 / 1 where no key anywhere
                rOut = cute.make_rmem_tensor((vec, vecs), self.out_dtype)
                for v in cutlass.range_constexpr(vecs):
                    for e in cutlass.range_constexpr(vec):
                        rOut[e, v] = (acc[e, v] * scale).to(self.out_dtype)
                gOut = mOut[b, r, h, None]
                for v in cutlass.range_constexpr(vecs):
                    cute.autovec_copy(rOut[None, v], cute.local_tile(gOut, (vec,), (member + v * lanes,)))
                if lane == 0:  # log 0 = -inf: no key anywhere
                    mLSEOut[b, r, h] = top + cute.math.log2(total, fastmath=True) * LN2


def fake_args(cfg: CombineConfig):
    """The compile's stand-ins: symbolic extents shared by the four tensors, symbolic strides (the head
    dim's 1, the others whole 16-byte vectors for the partials and the output)."""
    b, s, rows, heads = (cute.sym_int() for _ in range(4))
    dt, out_dt = L.CUTE_DTYPES[cfg.dtype], L.CUTE_DTYPES[cfg.out_dtype]

    def strides(n, dtype=None):
        if dtype is None:
            return tuple(cute.sym_int64() for _ in range(n))
        return tuple(cute.sym_int64(divisibility=16 * 8 // dtype.width) for _ in range(n - 1)) + (1,)

    o = cute.runtime.make_fake_tensor(dt, (b, s, rows, heads, cfg.hdim), strides(5, dt), assumed_align=16)
    lse = cute.runtime.make_fake_tensor(Float32, (b, s, rows, heads), strides(4), assumed_align=4)
    out = cute.runtime.make_fake_tensor(out_dt, (b, rows, heads, cfg.hdim), strides(4, out_dt),
                                        assumed_align=16)
    lse_out = cute.runtime.make_fake_tensor(Float32, (b, rows, heads), strides(3), assumed_align=4)
    return o, lse, out, lse_out

