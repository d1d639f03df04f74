"""Which keys a query row sees: the key-length bound, causal (bottom-right aligned) and the
local window, both as per-element masks and as ranges of key blocks to visit.

Key j is visible from query i iff j < seqlen_k, and with d = seqlen_k - seqlen_q:
j <= i + d + window_right (causal is window_right = 0) and j >= i + d - window_left.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32


@cute.jit
def floor_div(a: Int32, b: cutlass.Constexpr[int]) -> Int32:
    q = a // b
    if a < 0 and q * b != a:
        q = q - 1
    return q


@cute.jit
def n_block_range(m_block: Int32, seqlen_q: Int32, seqlen_k: Int32, window_left: Int32,
                  window_right: Int32, tile_m: cutlass.Constexpr[int], tile_n: cutlass.Constexpr[int],
                  has_left: cutlass.Constexpr[bool], has_right: cutlass.Constexpr[bool]):
    """[n_min, n_max) key blocks that hold at least one key visible from this query tile."""
    n_max = (seqlen_k + tile_n - 1) // tile_n
    diag = seqlen_k - seqlen_q
    if cutlass.const_expr(has_right):
        last_row = cutlass.min((m_block + 1) * tile_m, seqlen_q) - 1
        n_max = cutlass.min(n_max, floor_div(last_row + diag + window_right, tile_n) + 1)
    n_min = Int32(0)
    if cutlass.const_expr(has_left):
        n_min = cutlass.max(Int32(0), floor_div(m_block * tile_m + diag - window_left, tile_n))
    return n_min, n_max


@cute.jit
def apply_mask(acc_S_rc: cute.Tensor, coord_rc: cute.Tensor, coord0_rc: cute.Tensor, m_block: Int32,
               n_block: Int32, seqlen_q: Int32, seqlen_k: Int32, window_left: Int32, window_right: Int32,
               tile_m: cutlass.Constexpr[int], tile_n: cutlass.Constexpr[int],
               has_left: cutlass.Constexpr[bool], has_right: cutlass.Constexpr[bool],
               mask_seqlen: cutlass.Constexpr[bool] = True):
    """Set invisible scores to -inf; coord_rc gives each register's (row, col) in the tile.

    Only the highest key block can hold the ragged seqlen_k end, so the others skip that test.

    coord0_rc is thread 0's coord_rc: compile-time (row, col) values. A thread's columns are
    thread 0's plus one offset, so the bounds are shifted by that offset once per row and each
    element is compared against an immediate (as FA3 does). Comparing the thread's own columns
    instead had ptxas materialize a register per column index (a dozen or more live at once) while
    the WGMMAs were in flight, which pushed the 3-warpgroup (160-register) hdim-64 kernel into
    spills.
    """
    diag = seqlen_k - seqlen_q
    col_offset = coord_rc[0, 0][1] - coord0_rc[0, 0][1]
    col_limit = seqlen_k - n_block * tile_n if cutlass.const_expr(mask_seqlen) else Int32(tile_n)
    for r in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[0])):
        row = m_block * tile_m + coord_rc[r, 0][0]
        hi = col_limit
        if cutlass.const_expr(has_right):
            hi = cutlass.min(hi, row + diag + window_right + 1 - n_block * tile_n)
        hi = hi - col_offset
        lo = Int32(0)
        if cutlass.const_expr(has_left):
            lo = row + diag - window_left - n_block * tile_n - col_offset
        for c in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[1])):
            col = coord0_rc[r, c][1]
            # a select, not a branch: a traced `if` would thread the whole accumulator through
            # every element's condition
            acc_S_rc[r, c] = -Float32.inf if col >= hi or col < lo else acc_S_rc[r, c]
