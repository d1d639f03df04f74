"""Which output tiles a forward CTA computes, and in what order.

A tile is one query block of one (head, batch) pair; tile indices map to (m_block, head, batch) in
L2 sections (`coords`). Two walks over the indices:

  static: CTA b takes tiles b, b + grid, b + 2 grid, ... (with a 2x1 cluster, a cluster tile is a
      pair of adjacent query blocks and the clusters stride over the pairs; hopper/fwd_cluster.py);
  dynamic (FwdConfig.dynamic_sched): the first `grid` tiles are the CTAs' own, the rest are claimed
      from a global counter by the producer warp, which hands each index to the consumers (and the
      FP8 transposer warps) through a small shared-memory ring; an index past the last tile ends
      the walk. The last CTA to finish claiming puts the counter back to zero (`retire`), so the
      next launch needs no memset.

Varlen walks every sequence as if it were the longest (a tile past its sequence's end is skipped by
the kernel). The host sizes the grid (config.fwd_grid: the SM count for the persistent kernels).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

SCHED_STAGES = 2  # tile indices the dynamic scheduler's producer may run ahead of the consumers


class FwdTileScheduler:
    """One CTA's walk, built once in the kernel from run-time values that stay fixed for its life (a
    run-time `if` or loop reads them, it need not carry them)."""

    def __init__(self, *, has_right: bool, cluster_m: int, num_m_blocks, num_pairs, num_heads, l2_section,
                 bidx, grid_size, counter=None, pipe=None, slots=None):
        self.has_right, self.cluster_m = has_right, cluster_m
        self.num_pairs, self.num_heads, self.l2_section = num_pairs, num_heads, l2_section
        self.grid_size, self.counter, self.pipe, self.slots = grid_size, counter, pipe, slots
        self.num_m_blocks = num_m_blocks
        self.num_tiles = num_m_blocks * num_pairs
        self.first, self.stride, self.rank = bidx, grid_size, 0
        if cluster_m > 1:  # cluster tiles: pairs of query blocks of one (head, batch)
            self.rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            self.num_m_blocks = (num_m_blocks + cluster_m - 1) // cluster_m
            self.first, self.stride = bidx // cluster_m, grid_size // cluster_m
            self.num_tiles = self.num_m_blocks * num_pairs

    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self

    @cute.jit
    def coords(self, tile):
        """tile index -> (m_block, head, batch); with a cluster, this CTA's block of the pair.

        (head, batch) pairs are taken `l2_section` at a time (sized on the host so that their K
        and V fit in L2 together); inside a section the pair varies fastest. Without a right
        bound (no causal/window) the section is 1 pair, i.e. m fastest. With one, m runs from
        the last query block down: those tiles see the most keys, so the longest go first.
        """
        per_section = self.num_m_blocks * self.l2_section
        section = tile // per_section
        local = tile - section * per_section
        pairs_here = cutlass.min(self.l2_section, self.num_pairs - section * self.l2_section)
        m_idx = local // pairs_here
        pair = section * self.l2_section + local - m_idx * pairs_here
        m_block = m_idx
        if cutlass.const_expr(self.has_right):
            m_block = self.num_m_blocks - 1 - m_idx
        if cutlass.const_expr(self.cluster_m > 1):
            m_block = m_block * self.cluster_m + self.rank
        return m_block, pair % self.num_heads, pair // self.num_heads

    @cute.jit
    def publish(self, state, tile, lane):
        """Dynamic, producer warp: hand `tile` to the consumers (one lane; mbarrier arrives count
        threads)."""
        if lane == 0:
            self.pipe.producer_acquire(state)
            self.slots[state.index] = tile
            self.pipe.producer_commit(state)

    @cute.jit
    def claim(self, lane):
        """Dynamic, producer warp: this CTA's next tile, handed out in order by the global counter
        past the first grid_size tiles."""
        claimed = Int32(0)
        if lane == 0:
            claimed = cute.arch.atomic_add(self.counter.iterator, Int32(1))
        return cute.arch.shuffle_sync(claimed, 0) + self.grid_size

    @cute.jit
    def retire(self, lane):
        """Dynamic, producer warp: put the counter back to zero for the next launch, instead of a
        memset before each one.

        Called once per CTA, by the lane that claims tiles, after its last claim. Slot 1 counts
        the CTAs done claiming; the last one zeroes both slots: every other CTA has made its last
        atomic on slot 0 before its increment of slot 1 (acq_rel, gpu scope: those claims happen
        before the last CTA's stores), and none touches the counter again in this launch."""
        if lane == 0:
            retired = cute.arch.atomic_add(self.counter.iterator + 1, Int32(1), sem="acq_rel", scope="gpu")
            if retired == self.grid_size - 1:
                self.counter[0] = Int32(0)
                self.counter[1] = Int32(0)

    @cute.jit
    def read(self, state):
        """Dynamic, consumers: the next tile index from the producer."""
        self.pipe.consumer_wait(state)
        tile = self.slots[state.index]
        self.pipe.consumer_release(state)
        return tile
