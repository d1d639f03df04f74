"""WGMMA issue helper shared by the kernels."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup


@cute.jit
def issue_gemm(tiled_mma, acc, tCrA, tCrB, zero_init: cutlass.Constexpr[bool]):
    """Issue one tile's WGMMAs (one per k slice) as one commit group; no wait.

    A fresh atom per call: its ACCUMULATE field is mutated while tracing.
    """
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
        cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
