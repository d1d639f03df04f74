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

Varlen walks only the real tiles, on the dynamic walk of a persistent grid: the sequences longest
first (hopper/varlen_walk.py builds the walk's table on the device before the launch), each
sequence's ceil(used queries / tile_m) x heads tiles together, taken as a dense launch's with the
sequence's heads as the pairs (`section_coords`: m from the last block down under a right bound).
The producer warp finds a tile's sequence in the table (`VarlenWalk.find`, a warp-wide search) and
hands the consumers the tile with its sequence's bounds (`publish_record`: a one-slot ring whose
phase both sides take from Q's), so they read nothing from global memory to start it. The host sizes
the grid (config.fwd_grid: the SM count for the persistent kernels; varlen_walk.walk_grid for varlen).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, pipeline

from flashhopper.config import VARLEN_RECORD_WORDS, VARLEN_SCHED_STAGES


@cute.jit
def section_coords(tile, num_m_blocks, num_pairs, l2_section, from_last: cutlass.Constexpr[bool]):
    """tile index -> (m_block, pair) over num_m_blocks query blocks of num_pairs pairs: the pairs are taken
    `l2_section` at a time, the pair fastest inside a section; m from the last block down with
    `from_last` (host.section_coords is its twin)."""
    per_section = num_m_blocks * l2_section
    section = tile // per_section
    local = tile - section * per_section
    pairs_here = cutlass.min(l2_section, num_pairs - section * l2_section)
    m_idx = local // pairs_here
    pair = section * l2_section + local - m_idx * pairs_here
    m_block = m_idx
    if cutlass.const_expr(from_last):
        m_block = num_m_blocks - 1 - m_idx
    return m_block, pair


class VarlenWalk:
    """Varlen: which sequence a tile falls in, from the walk table (hopper/varlen_walk.py: the cumulative
    query blocks of the sequences in walk order, then their ids). Called by a whole warp."""

    def __init__(self, table, batch):
        self.table, self.batch = table, batch

    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self

    @cute.jit
    def find(self, unit):
        """(sequence id, the cumulative count before it, its own) of the first walk position whose
        cumulative query blocks exceed `unit` (tile // heads); sequence -1 past the last. Each round the
        32 lanes load the last entry of 32 equal chunks of the range left, and a ballot picks the first
        chunk whose entry exceeds `unit` as the next range: ceil(log32(batch)) rounds, one load per
        lane each (host.varlen_find is the twin)."""
        lane = cute.arch.lane_idx()
        lo, n, below, top, pos = Int32(0), self.batch, Int32(0), Int32(0), Int32(-1)
        while n > 0:
            step = (n + 31) // 32
            # every lane loads (a lane past the range reads its last entry) and the ones past it drop
            # theirs by a select, not a branch on the lane
            probe = self.table[lo + cutlass.min((lane + 1) * step, n) - 1]
            probe = probe if lane * step < n else Int32(-1)
            hits = cute.arch.vote_ballot_sync(probe > unit)
            if hits == 0:
                n = Int32(0)
            else:
                first = Int32(cute.arch.clz(cute.arch.brev(hits)))
                before = cute.arch.shuffle_sync(probe, cutlass.max(first - 1, 0))
                if first > 0:
                    below = before
                top = cute.arch.shuffle_sync(probe, first)
                lo = lo + first * step
                if step == 1:
                    pos = lo
                    n = Int32(0)
                else:
                    n = cutlass.min(step, n - first * step)
        seq = Int32(-1)
        if pos >= 0:
            seq = self.table[self.batch + pos]
        return seq, below, top


class FwdTileScheduler:
    """One CTA's walk, built once in the kernel from run-time values that stay fixed for its life (a
    run-time `if` or loop reads them, it need not carry them)."""

    def __init__(self, *, has_right: bool, cluster_m: int, num_m_blocks, num_pairs, num_heads, l2_section,
                 bidx, grid_size, counter=None, pipe=None, slots=None, walk: VarlenWalk | None = None,
                 claimed=None):
        self.has_right, self.cluster_m = has_right, cluster_m
        self.num_pairs, self.num_heads, self.l2_section = num_pairs, num_heads, l2_section
        self.grid_size, self.counter, self.pipe, self.slots = grid_size, counter, pipe, slots
        # varlen: the walk, and an smem word for the claimed next tile (claim_ahead)
        self.num_m_blocks, self.walk, self.claimed_slot = num_m_blocks, walk, claimed
        # varlen: the walk knows where the tiles end (num_m_blocks / num_pairs None)
        self.num_tiles = None if walk is not None else num_m_blocks * num_pairs
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
        m_block, pair = section_coords(tile, self.num_m_blocks, self.num_pairs, self.l2_section,
                                       self.has_right)
        if cutlass.const_expr(self.cluster_m > 1):
            m_block = m_block * self.cluster_m + self.rank
        return m_block, pair % self.num_heads, pair // self.num_heads

    @cute.jit
    def varlen_tile(self, tile):
        """Varlen, producer warp: tile index -> (m_block, head, sequence) on the walk (host.varlen_tile is
        the twin); sequence -1 past the last tile. The sequence's tiles are coords' with its heads as
        the pairs: its query blocks heads at a time per L2 section, m from the last down under a right
        bound."""
        seq, below, top = self.walk.find(tile // self.num_heads)
        m_block, head = Int32(0), Int32(0)
        if seq >= 0:
            m_block, head = section_coords(tile - below * self.num_heads, top - below, self.num_heads,
                                           self.l2_section, self.has_right)
        return m_block, head, seq

    # Varlen: one record a tile through a one-slot ring, whose state on either side is Q's there (one Q
    # stage, one load / one wait a tile; the producer publishes a tile's record before its Q, the
    # consumers read it before they wait for that Q): neither side carries a state of its own for it
    @staticmethod
    def record_state(q_state):
        return pipeline.PipelineState(VARLEN_SCHED_STAGES, Int32(0), Int32(0), q_state.phase)

    @cute.jit
    def publish_record(self, q_state, record, lane):
        """Varlen, producer warp: hand the next tile (Q not yet loaded: `q_state`) to the consumers as
        its record (m_block, head, sequence, query offset, used queries, used keys:
        VARLEN_RECORD_WORDS; sequence -1 ends the walk)."""
        assert len(record) == VARLEN_RECORD_WORDS
        state = self.record_state(q_state)
        if lane == 0:
            self.pipe.producer_acquire(state)
            for i in cutlass.range_constexpr(len(record)):
                self.slots[i, 0] = record[i]
            self.pipe.producer_commit(state)

    @cute.jit
    def read_record(self, q_state):
        """Varlen, consumers: the next tile's record (its Q not yet waited for: `q_state`), (m_block,
        head, sequence, query offset, used queries, used keys)."""
        state = self.record_state(q_state)
        self.pipe.consumer_wait(state)
        record = []
        for i in cutlass.range_constexpr(VARLEN_RECORD_WORDS):
            record.append(self.slots[i, 0])
        self.pipe.consumer_release(state)
        return tuple(record)

    @cute.jit
    def publish(self, state, tile, lane):
        """Dynamic, producer warp: hand `tile` to the consumers (one lane; mbarrier arrives count
        threads)."""
        if lane == 0:
            self.pipe.producer_acquire(state)
            self.slots[state.index] = tile
            self.pipe.producer_commit(state)

    @cute.jit
    def claim_ahead(self, lane):
        """Varlen, producer warp: claim the next tile before this one's loads (the atomic's latency
        under them), kept in smem through them (`claimed`): the producer's registers are full there."""
        if lane == 0:
            self.claimed_slot[0] = cute.arch.atomic_add(self.counter.iterator, Int32(1)) + self.grid_size

    @cute.jit
    def claimed(self, lane):
        """Varlen, producer warp: the tile claim_ahead claimed, in every lane. Lane 0 wrote the word
        and reads it back; the others take it by shuffle (no lane reads what another lane wrote)."""
        claimed = Int32(0)
        if lane == 0:
            claimed = self.claimed_slot[0]
        return cute.arch.shuffle_sync(claimed, 0)

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
