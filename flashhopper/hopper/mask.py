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
def needs_mask(n_block: Int32, n_last: Int32, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32,
               window_left: Int32, window_right: Int32, tile_m: cutlass.Constexpr[int],
               tile_n: cutlass.Constexpr[int], has_left: cutlass.Constexpr[bool],
               has_right: cutlass.Constexpr[bool]):
    """Whether some element of block (m_block, n_block) is masked (the rest run mask-free)."""
    diag = seqlen_k - seqlen_q
    need = n_block == n_last
    if cutlass.const_expr(has_right):
        # the first row's last visible key falls inside or before this block
        need = need or (n_block + 1) * tile_n - 1 > m_block * tile_m + diag + window_right
    if cutlass.const_expr(has_left):
        last_row = (m_block + 1) * tile_m - 1
        need = need or n_block * tile_n < last_row + diag - window_left
    return need


@cute.jit
def apply_mask(acc_S_rc: cute.Tensor, coord_rc: cute.Tensor, m_block: Int32, n_block: Int32,
               seqlen_q: Int32, seqlen_k: Int32, window_left: Int32, window_right: Int32,
               tile_m: cutlass.Constexpr[int], tile_n: cutlass.Constexpr[int],
               has_left: cutlass.Constexpr[bool], has_right: cutlass.Constexpr[bool]):
    """Set invisible scores to -inf; coord_rc gives each register's (row, col) in the tile."""
    diag = seqlen_k - seqlen_q
    col_limit = seqlen_k - n_block * tile_n
    for r in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[0])):
        row = m_block * tile_m + coord_rc[r, 0][0]
        hi = col_limit
        if cutlass.const_expr(has_right):
            hi = cutlass.min(hi, row + diag + window_right + 1 - n_block * tile_n)
        lo = Int32(0)
        if cutlass.const_expr(has_left):
            lo = row + diag - window_left - n_block * tile_n
        for c in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[1])):
            col = coord_rc[r, c][1]
            if col >= hi or col < lo:
                acc_S_rc[r, c] = -Float32.inf
