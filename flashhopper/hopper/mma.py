"""WGMMA issue helpers shared by the kernels: the one place a GEMM's WGMMAs are issued."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup

from flashhopper.hopper import layout as L


@cute.jit
def issue_gemm(tiled_mma, acc, tCrA, tCrB, zero_init: cutlass.Constexpr[bool],
               k_begin: cutlass.Constexpr[int] = 0, k_end: cutlass.Constexpr[int] = -1, stage=None):
    """Issue a tile's WGMMAs (one per k slice; k slices [k_begin, k_end), k_end -1: all) as one
    commit group; no wait. `zero_init`: the first WGMMA overwrites acc instead of adding to it.
    `stage`: B's ring stage, indexed per k slice (tCrB[None, None, k, stage]; slicing the stage
    first gives other address arithmetic: 16-72 instructions fewer in every forward kernel, untimed).

    A fresh atom per call: its ACCUMULATE field is mutated while tracing.
    """
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    end = cute.size(tCrA, mode=[2]) if cutlass.const_expr(k_end < 0) else k_end
    for k in cutlass.range_constexpr(k_begin, end):
        b = tCrB[None, None, k] if cutlass.const_expr(stage is None) else tCrB[None, None, k, stage]
        cute.gemm(atom, acc, tCrA[None, None, k], b, acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


@cute.jit
def issue_gemm_pair(tiled_mma, acc, tCrA, tCrB, acc2, tCrA2, tCrB2, k_begin: cutlass.Constexpr[int],
                    k_end: cutlass.Constexpr[int]):
    """k slices [k_begin, k_end) of two accumulating GEMMs of one (RS) tiled MMA, into `acc` then
    `acc2`, as one commit group."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, True)
    for k in cutlass.range_constexpr(k_begin, k_end):
        cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
    for k in cutlass.range_constexpr(k_begin, k_end):
        cute.gemm(atom, acc2, tCrA2[None, None, k], tCrB2[None, None, k], acc2)
    warpgroup.commit_group()


@cute.jit
def acc_to_operand_a(acc: cute.Tensor, frag_a: cute.Tensor):
    """Convert an fp32 accumulator into the 16-bit A fragment `frag_a` (layout
    `layout.acc_layout_as_operand_a(acc.layout)`), one 16-wide k-block at a time; or into the e4m3
    fragment (`layout.acc_layout_as_operand_a_fp8`), one 32-wide k-block at a time.

    One `.to()` over the whole accumulator is a single vector truncation; for accumulators whose
    length is not a power of two (tile_n 112, 144, 160, 176, ...) it lowers to scalar `cvt.rn.bf16.f32`
    into 16-bit registers, and the pairs are only packed (PRMT) in front of each P @ V WGMMA. ptxas
    then injects a `warpgroup.arrive` before every such WGMMA (advisory C7519) and waits for each
    one (gsb0). Per k-block the vectors have 8 elements, which lower to packed
    `cvt.rn.bf16x2.f32` writing the 32-bit A registers directly. Same rounding either way.
    """
    if cutlass.const_expr(frag_a.element_type.width == 8):  # e4m3 P: keys relabelled (see the layout)
        acc_as_a = cute.make_tensor(acc.iterator, L.acc_layout_as_operand_a_fp8(acc.layout))
    else:
        acc_as_a = cute.make_tensor(acc.iterator, L.acc_layout_as_operand_a(acc.layout))
    for k in cutlass.range_constexpr(cute.size(frag_a, mode=[2])):
        frag_a[None, None, k].store(acc_as_a[None, None, k].load().to(frag_a.element_type))
