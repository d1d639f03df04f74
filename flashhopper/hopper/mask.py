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


class BlockInfo:
    """The rule above on a kernel's (tile_m x tile_n) blocks, with the bounds that exist fixed at compile
    time (`of`: causal is a right bound, a window either or both): which key blocks a query block visits
    (forward), which query blocks a key block visits (backward), and the runs of those that need the
    per-element mask. hopper/host.py holds the host twins the launch and the tests use."""

    def __init__(self, tile_m: int, tile_n: int, has_left: bool, has_right: bool):
        self.tile_m, self.tile_n = tile_m, tile_n
        self.has_left, self.has_right = has_left, has_right

    @staticmethod
    def of(cfg, tile_m: int, tile_n: int) -> BlockInfo:
        """From a FwdConfig / BwdConfig's mask kind (plan.mask_kind: causal, or local with a window)."""
        return BlockInfo(tile_m, tile_n, has_left=cfg.local, has_right=cfg.causal or cfg.local)

    @cute.jit
    def n_block_range(self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32, window_left: Int32,
                      window_right: Int32):
        """Forward: [n_min, n_max) key blocks that hold at least one key visible from query block m_block."""
        tile_m, tile_n = self.tile_m, self.tile_n
        n_max = (seqlen_k + tile_n - 1) // tile_n
        diag = seqlen_k - seqlen_q
        if cutlass.const_expr(self.has_right):
            last_row = cutlass.min((m_block + 1) * tile_m, seqlen_q) - 1
            n_max = cutlass.min(n_max, floor_div(last_row + diag + window_right, tile_n) + 1)
        n_min = Int32(0)
        if cutlass.const_expr(self.has_left):
            n_min = cutlass.max(Int32(0), floor_div(m_block * tile_m + diag - window_left, tile_n))
        return n_min, n_max

    @cute.jit
    def n_mask_runs(self, m_block: Int32, n_min: Int32, n_top: Int32, seqlen_q: Int32, seqlen_k: Int32,
                    window_left: Int32, window_right: Int32):
        """Forward, key blocks [n_min, n_top) walked from the top: (n_lo_right, n_hi_left), blocks
        [n_lo_right, n_top) cross the causal / right-window edge, [n_min, n_hi_left) the left one, and
        those between see every key of theirs from every row."""
        diag = seqlen_k - seqlen_q
        n_lo_right = n_top
        if cutlass.const_expr(self.has_right):
            n_lo_right = cutlass.max(n_min, floor_div(m_block * self.tile_m + diag + window_right + 1,
                                                      self.tile_n))
        n_hi_left = n_min
        if cutlass.const_expr(self.has_left):
            last_row_first_key = (m_block + 1) * self.tile_m - 1 + diag - window_left
            n_hi_left = cutlass.max(n_min, floor_div(last_row_first_key + self.tile_n - 1, self.tile_n))
        return n_lo_right, n_hi_left

    @cute.jit
    def m_block_range(self, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32, window_left: Int32,
                      window_right: Int32):
        """Backward: [m_min, m_max) query blocks with at least one query that sees a key of key block
        n_block (host twin: host.host_m_block_range)."""
        diag = seqlen_k - seqlen_q
        m_max = (seqlen_q + self.tile_m - 1) // self.tile_m
        m_min = Int32(0)
        if cutlass.const_expr(self.has_right):
            first_q = n_block * self.tile_n - diag - window_right  # lowest query that sees key n*N
            m_min = cutlass.max(m_min, first_q // self.tile_m if first_q > 0 else Int32(0))
        if cutlass.const_expr(self.has_left):
            last_q = (n_block + 1) * self.tile_n - 1 - diag + window_left  # highest query seeing the block
            m_max = cutlass.min(m_max, (last_q // self.tile_m + 1) if last_q >= 0 else Int32(0))
        return m_min, m_max

    @cute.jit
    def last_n_block(self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32, window_right: Int32):
        """Backward: the highest key block whose CTA visits query block m_block (consistent with
        m_block_range: key block n starts at query block (n * tile_n - diag - right) // tile_m)."""
        x = (m_block + 1) * self.tile_m + seqlen_k - seqlen_q + window_right
        num_n = (seqlen_k + self.tile_n - 1) // self.tile_n
        return cutlass.min((x + self.tile_n - 1) // self.tile_n - 1, num_n - 1)

    @cute.jit
    def first_n_block(self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32, window_left: Int32):
        """Backward: the lowest key block whose CTA visits query block m_block (consistent with
        m_block_range): only a left window cuts key blocks off below."""
        n_first = Int32(0)
        if cutlass.const_expr(self.has_left):
            lowest_key = m_block * self.tile_m + seqlen_k - seqlen_q - window_left
            n_first = lowest_key // self.tile_n if lowest_key > 0 else Int32(0)
        return n_first

    @cute.jit
    def m_mask_runs(self, n_block: Int32, m_min: Int32, num_m: Int32, diag: Int32, seqlen_k: Int32,
                    window_left: Int32, window_right: Int32):
        """Backward, query blocks [m_min, m_min + num_m) of key block n_block: (m_right, m_left),
        blocks [m_min, m_right) and [m_left, m_min + num_m) need the mask, those between see all of
        its keys. A query block needs it when its lowest query does not see the highest key (causal /
        right window) or its highest query does not see the lowest key (left window); in the ragged
        last key block every one does (keys past seqlen_k). Padded queries past seqlen_q need nothing:
        their LSE is +inf, so P is 0 there anyway."""
        m_end = m_min + num_m
        n0 = n_block * self.tile_n
        m_right = m_min
        if cutlass.const_expr(self.has_right):
            # lowest m with m * tile_m + diag + right >= n0 + tile_n - 1
            m_right = floor_div(n0 + self.tile_n - 1 - diag - window_right + self.tile_m - 1, self.tile_m)
            m_right = cutlass.max(m_min, cutlass.min(m_end, m_right))
        m_right = m_end if n0 + self.tile_n > seqlen_k else m_right
        m_left = m_end
        if cutlass.const_expr(self.has_left):
            # lowest m with (m + 1) * tile_m - 1 + diag - left > n0
            m_left = floor_div(n0 + 1 - diag + window_left, self.tile_m)
            m_left = cutlass.max(m_right, cutlass.min(m_end, m_left))
        return m_right, m_left


@cute.jit
def apply_mask(acc_S_rc: cute.Tensor, coord_rc: cute.Tensor, coord0_rc: cute.Tensor, m_block: Int32,
               n_block: Int32, seqlen_q: Int32, seqlen_k: Int32, window_left: Int32, window_right: Int32,
               tile_m: cutlass.Constexpr[int], tile_n: cutlass.Constexpr[int],
               has_left: cutlass.Constexpr[bool], has_right: cutlass.Constexpr[bool],
               mask_seqlen: cutlass.Constexpr[bool] = True, tokens: Int32 | None = None,
               keys: Int32 | None = None):
    """Set invisible scores to -inf; coord_rc gives each register's (row, col) in the tile.

    Only the highest key block can hold the ragged seqlen_k end, so the others skip that test.

    `tokens` (FwdConfig.token_rows): the rows pack several query tokens, row r standing for query
    (r % tokens) of `tokens` (seqlen_q); seqlen_k then counts the keys up to the item's end, for the
    diagonal, and `keys` the block walk's (the ragged end's).

    coord0_rc is thread 0's coord_rc: compile-time (row, col) values. A thread's columns are
    thread 0's plus one offset, so the bounds are shifted by that offset once per row and each
    element is compared against an immediate (as FA3 does). Comparing the thread's own columns
    instead had ptxas materialize a register per column index (a dozen or more live at once) while
    the WGMMAs were in flight, which pushed the 3-warpgroup (160-register) hdim-64 kernel into
    spills.
    """
    diag = seqlen_k - seqlen_q
    col_offset = coord_rc[0, 0][1] - coord0_rc[0, 0][1]
    end = seqlen_k if cutlass.const_expr(keys is None) else keys
    col_limit = end - n_block * tile_n if cutlass.const_expr(mask_seqlen) else Int32(tile_n)
    for r in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[0])):
        row = m_block * tile_m + coord_rc[r, 0][0]
        if cutlass.const_expr(tokens is not None):
            row = row % tokens
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
