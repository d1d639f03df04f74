"""What the two backward kernels (hopper/bwd.py, hopper/bwd_wide.py) share: their static
config, the query-block range a key block sees, the TMA producer warp, and the dK/dV TMA store.
They differ in how the consumer warpgroups split the work (64 keys each vs head-dim rows)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, pipeline
from cutlass.cute.nvgpu import cpasync

from flashhopper.config import BwdConfig
from flashhopper.hopper import layout as L
from flashhopper.hopper import mask as M
from flashhopper.hopper.opaque import opaque

# BwdConfig.dq_rows_interleaved, per 8-row group: query row r0 + 4 r1 at tile row 2 r0 + r1 (the
# consumers' view), and tile row s0 + 2 s1 read back from query row 4 s0 + s1 (the TMA view);
# (shape, stride) of each, tests/test_bwd_compile.py checks that they are inverse
DQ_ROWS_SMEM = ((4, 2), (2, 1))
DQ_ROWS_GMEM = ((2, 4), (4, 1))


class SeqRows:
    """Varlen (BwdConfig.varlen): where this CTA's sequence starts in the packed Q / dO / dQaccum
    rows (q), the packed K / V / dK / dV rows (k), and the padded LSE / D rows (rows). Each is read
    from its int32 tensor where it is used rather than held in a register through the consumers'
    loop (at hdim 128 causal three held offsets spilled 16 bytes)."""

    def __init__(self, mCuQ, mCuK, mPadQ, mUsedQ, mUsedK, batch, seqused):
        self._cu_q, self._cu_k, self._pad_q, self._batch = mCuQ, mCuK, mPadQ, batch
        self._used_q, self._used_k, self._seqused = mUsedQ, mUsedK, seqused

    def lengths(self):
        """(seqlen_q, seqlen_k) read again: the masked steps take them from here rather than keep
        them in registers through the loop (kernel parameters in the dense kernels, they cost none
        there; held here, they spilled 8-16 bytes at hdim 128-256 with softcap and a window)."""
        b = opaque(self._batch)
        return self._used_q[b], self._used_k[b]

    def unused_rows(self):
        """(whether seqused_q was given, whether seqused_k was): the kernel argument `seqused` (bit 0, bit
        1), a kernel parameter (no register). Where it was, any tile row at or past the sequence's used
        length may hold anything, NaN too: the sequence's own unused rows, and past its packed end the
        next sequences' rows, which may be theirs (a sequence using all its rows has a tile running into
        the next one's unused rows). Without seqused every row a tile reads is some sequence's data."""
        return (self._seqused & 1) != 0, (self._seqused & 2) != 0

    @property
    def q(self):
        return self._cu_q[opaque(self._batch)]

    @property
    def k(self):
        return self._cu_k[opaque(self._batch)]

    @property
    def rows(self):
        return self._pad_q[opaque(self._batch)]


class CtaWork:
    """One backward CTA's work, fixed for its life: its key block, KV head and batch (with varlen the
    sequence, and `seq` its SeqRows, else None), the lengths (varlen: the sequence's used ones), the
    query heads per KV head, and its steps: num_m query blocks from m_min for each of the `ratio`
    query heads, num_steps in all, query block fastest. Run-time values read, never reassigned, inside
    the kernel's run-time `if` and loops: they need not carry it."""

    FIELDS = ("n_block", "head_kv", "batch", "seqlen_q", "seqlen_k", "ratio", "m_min", "num_m", "num_steps",
              "seq")

    def __init__(self, **values):
        if set(values) != set(self.FIELDS):
            raise TypeError(f"CtaWork takes {self.FIELDS}, got {sorted(values)}")
        for name, value in values.items():
            setattr(self, name, value)

    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self


class BwdKernelBase:
    def __init__(self, cfg: BwdConfig):
        cfg.check()
        self.cfg = cfg
        self.dtype = L.CUTE_DTYPES[cfg.dtype]
        self.tile_m, self.tile_n, self.hdim = cfg.tile_m, cfg.tile_n, cfg.hdim
        self.num_stages = cfg.num_stages
        self.do_stages = cfg.num_do_stages  # the Q ring's depth except in the wide kernel
        self.num_consumer_wg = cfg.num_consumer_wg
        self.num_consumer_threads = 128 * cfg.num_consumer_wg
        # which sides of the visibility rule are bounded, and its block arithmetic (mask.BlockInfo)
        self.blocks = M.BlockInfo.of(cfg, cfg.tile_m, cfg.tile_n)
        self.has_right, self.has_left = self.blocks.has_right, self.blocks.has_left
        self.has_softcap = cfg.softcap

    def dq_rows_view(self, mdQaccum):
        """The gmem side of the writer's TMA reduce-add: dQaccum, or with dq_rows_interleaved
        dQaccum (sq_pad, d, h, b) seen as (rows, d, h) with rows = (2, 4,
        sq_pad * b / 8): row 8g + j + 2i of the view (the smem tile's order) is query row 8g + 4j + i.
        Batch merges into the rows (the runtime allocates (b, sq_pad, h, d) contiguous), so the TMA
        descriptor keeps 5 dimensions: head dim, 2, 4, row groups, heads."""
        if not self.cfg.dq_rows_interleaved:
            return mdQaccum
        rs = mdQaccum.layout.stride[0]
        groups = mdQaccum.shape[0] * mdQaccum.shape[3] // 8
        (n0, n1), (d0, d1) = DQ_ROWS_GMEM
        return cute.make_tensor(mdQaccum.iterator, cute.make_layout(
            ((n0, n1, groups), mdQaccum.shape[1], mdQaccum.shape[2]),
            stride=((d0 * rs, d1 * rs, 8 * rs), mdQaccum.layout.stride[1], mdQaccum.layout.stride[2])))

    def dq_rows_smem(self, sdQ):
        """The consumers' view of the smem dQ tile: sdQ, or with dq_rows_interleaved query row r at
        tile row 8 (r / 8) + 2 (r % 4) + (r % 8) / 4 (dq_rows_view reads it back in query order)."""
        if not self.cfg.dq_rows_interleaved:
            return sdQ
        cols = cute.size(sdQ, mode=[1])
        (n0, n1), (d0, d1) = DQ_ROWS_SMEM
        return cute.composition(sdQ, cute.make_layout(((n0, n1, self.tile_m // 8), cols),
                                                      stride=((d0, d1, 8), self.tile_m)))

    @cute.jit
    def dq_rows_tile(self, mdQaccum, head, batch, m_block, seqlen_q, seq=None):
        """The writer's gmem side for query block m_block: mdQaccum[:, :, head, batch], or with
        dq_rows_interleaved the view's rows (batch b's query blocks after batch b - 1's, sq padded
        to whole blocks) and the block's index in them; varlen (`seq`): the sequence's packed rows
        (a tile's rows past the sequence add exact zeros into the next one's: their dS is 0)."""
        if cutlass.const_expr(self.cfg.dq_rows_interleaved):
            num_m_blocks = (seqlen_q + self.tile_m - 1) // self.tile_m
            return mdQaccum[None, None, head], batch * num_m_blocks + m_block
        return self.seq_rows(mdQaccum, head, batch, seq, "q"), m_block

    @cute.jit
    def seq_rows(self, mX, head, batch, seq, which: cutlass.Constexpr[str]):
        """(rows, dim) of one head: mX[:, :, head, batch], or varlen (`seq`, a SeqRows) the
        sequence's rows of the packed tensor (batch 1), `which` naming its offset ("q" or "k")."""
        if cutlass.const_expr(seq is None):
            return mX[None, None, head, batch]
        return cute.domain_offset((getattr(seq, which), 0), mX[None, None, head, 0])

    @cute.jit
    def seq_row_vector(self, mX, head, batch, seq):
        """LSE / D rows of one head: mX[:, head, batch], or varlen the sequence's padded rows."""
        if cutlass.const_expr(seq is None):
            return mX[None, head, batch]
        return cute.domain_offset((seq.rows,), mX[None, head, 0])

    def grid(self, mK, mUsedK, max_seqlen_k):
        """(key blocks, KV heads, batch): of the longest sequence and the sequences with varlen."""
        if cutlass.const_expr(self.cfg.varlen):
            return ((max_seqlen_k + self.tile_n - 1) // self.tile_n, cute.size(mK.shape[2]),
                    cute.size(mUsedK.shape[0]))
        return (cute.ceil_div(cute.size(mK.shape[0]), self.tile_n), cute.size(mK.shape[2]),
                cute.size(mK.shape[3]))

    def make_pipelines(self, storage, sK_layout, sQ_layout):
        """The K / V pipeline (one stage, both tiles on one barrier) and the Q and dO rings. Full
        barriers: one producer arrive + the TMA bytes; empty: one arrive per consumer warp. Each Q
        (dO) stage also carries its block's LSE (D) row."""
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_threads // 32)
        kv_bytes = cute.size_in_bytes(self.dtype, sK_layout)
        q_bytes = cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1])) + self.tile_m * 4
        pipe_kv = pipeline.PipelineTmaAsync.create(
            num_stages=1, producer_group=producer, consumer_group=consumers, tx_count=2 * kv_bytes,
            barrier_storage=storage.mbar_KV.data_ptr(), defer_sync=True)
        pipe_q = pipeline.PipelineTmaAsync.create(
            num_stages=self.num_stages, producer_group=producer, consumer_group=consumers,
            tx_count=q_bytes, barrier_storage=storage.mbar_Q.data_ptr(), defer_sync=True)
        pipe_do = pipeline.PipelineTmaAsync.create(
            num_stages=self.do_stages, producer_group=producer, consumer_group=consumers,
            tx_count=q_bytes, barrier_storage=storage.mbar_dO.data_ptr(), defer_sync=True)
        return pipe_kv, pipe_q, pipe_do

    @cute.jit
    def cta_work(self, mQ, mK, window_left, window_right, seqs=None) -> CtaWork:
        """This CTA's key block (launch order, or LPT's), its KV head and batch, and the query
        steps it walks: (query head in the group, query block) pairs, query block fastest.
        Varlen (`seqs`: cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, padded row offsets, the
        `seqused` bits) the batch is the sequence, the lengths its used ones, and `seq` its SeqRows (else
        None); a key block past the sequence's end comes out negative or >= its key blocks."""
        n_block, head_kv, batch = cute.arch.block_idx()
        seqlen_q = mQ.shape[0]
        seqlen_k = mK.shape[0]
        seq = None
        if cutlass.const_expr(seqs is not None):
            mCuQ, mCuK, mUsedQ, mUsedK, mPadQ, seqused = seqs
            seqlen_q, seqlen_k = mUsedQ[batch], mUsedK[batch]
            seq = SeqRows(mCuQ, mCuK, mPadQ, mUsedQ, mUsedK, batch, seqused)
        n_block = self.launch_order_n_block(n_block, seqlen_k)
        ratio = mQ.shape[2] // mK.shape[2]
        if cutlass.const_expr(self.cfg.lpt):
            n_block, head_kv, batch = self.lpt_launch_coords(n_block, head_kv, batch, seqlen_q, seqlen_k,
                                                             ratio)
        m_min, m_max = self.blocks.m_block_range(n_block, seqlen_q, seqlen_k, window_left, window_right)
        num_m = cutlass.max(m_max - m_min, 0)
        num_steps = num_m * ratio
        return CtaWork(n_block=n_block, head_kv=head_kv, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                       ratio=ratio, m_min=m_min, num_m=num_m, num_steps=num_steps, seq=seq)

    @cute.jit
    def consumer_tidx(self):
        """This thread's index among the consumer warpgroups', read again (an opaque move): what the
        epilogue computes from it is not held through the consumers' loop (varlen: held, two such
        values spilled at hdim 256 with softcap)."""
        return opaque(cute.arch.thread_idx()[0]) - 128

    @cute.jit
    def zero_unused_rows(self, tiles, rows_left, barrier_id):
        """Varlen: rows [rows_left, rows) of each smem tile in `tiles` ((rows, cols) views of 16-bit
        elements) set to 0 by all consumer threads in 16-byte stores, fenced for the async proxy
        (WGMMA reads them next), then one consumer barrier. For the tile rows past a sequence's used
        length when seqused was given (SeqRows.unused_rows): its own unused rows and the next
        sequences' rows past its end are loaded with the tile and may hold anything, NaN too, and
        0 x NaN is NaN in every GEMM that reads them (P, dS are 0 there, the +inf LSE / 0 D rows of
        the preprocess and the key mask): S, dP, dV, dK and dQ of the used rows alike."""
        L.zero_rows_from(tiles, rows_left, self.consumer_tidx(), self.num_consumer_threads)
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=self.num_consumer_threads)

    @cute.jit
    def zero_unused_keys(self, sK, sV, n_block, seq, barrier_id):
        """Varlen, after K and V have landed: with seqused_k given, the rows of this key block past the
        sequence's used keys (its unused keys, and past its end the next sequences' keys) zeroed
        (zero_unused_rows); the key mask already gives them P = 0."""
        _, unused_k = seq.unused_rows()
        keys_left = seq.lengths()[1] - n_block * self.tile_n
        if unused_k and keys_left < self.tile_n:
            self.zero_unused_rows((sK, sV), keys_left, barrier_id)

    @cute.jit
    def zero_unused_queries(self, sQ, sdO, pipe_q, q_state, pipe_do, do_state, m_block, seq, barrier_id):
        """Varlen, at the start of a step (no GEMM in flight): with seqused_q given, where query block
        m_block runs past the sequence's used queries, the rows past them of the step's Q and dO stages
        (its unused queries, and past its end the next sequences' rows) are zeroed (zero_unused_rows)
        once both have landed, before any GEMM reads them (the step waits for them again, at no cost);
        their LSE rows are +inf and D rows 0 (the sequence's padded rows), so P and dS are 0 there."""
        unused_q, _ = seq.unused_rows()
        rows_left = seq.lengths()[0] - m_block * self.tile_m
        if unused_q and rows_left < self.tile_m:
            pipe_q.consumer_wait(q_state)
            pipe_do.consumer_wait(do_state)
            self.zero_unused_rows((sQ[None, None, q_state.index], sdO[None, None, do_state.index]), rows_left,
                                  barrier_id)

    @cute.jit
    def has_keys(self, n_block, seqlen_k):
        """Varlen: whether key block n_block (from cta_work) holds keys of its sequence; the CTAs of
        the blocks past a shorter sequence's end do nothing."""
        return n_block >= 0 and n_block * self.tile_n < seqlen_k

    @cute.jit
    def produce(self, mQ, mK, mV, mdO, mLSE, mD, sQ, sK, sV, sdO, sLSE, sD, tma_atom_Q, tma_atom_K,
                tma_atom_V, tma_atom_dO, tma_atom_LSE, tma_atom_D, pipe_kv, pipe_q, pipe_do, work: CtaWork):
        """Warp 0: K and V of this key block once, then Q + LSE row and dO + D row of every
        (query head, query block) step into the two rings, query block fastest. The dO ring has
        its own depth (`do_stages`) only in the wide kernel; otherwise it steps with the Q ring.
        Varlen (`seq`): the tiles start at the sequence's rows; those past its end are the next
        sequence's (or TMA's zero fill), which the masks and the +inf LSE rows keep out (and, with
        seqused, the consumers zero in smem: zero_unused_rows)."""
        n_block, head_kv, batch, ratio, m_min, num_m, num_steps, seq = (
            work.n_block, work.head_kv, work.batch, work.ratio, work.m_min, work.num_m, work.num_steps,
            work.seq)
        one = cute.make_layout(1)
        kv_tile = (self.tile_n, self.hdim)
        gK = cute.local_tile(self.seq_rows(mK, head_kv, batch, seq, "k"), kv_tile, (n_block, 0))
        gV = cute.local_tile(self.seq_rows(mV, head_kv, batch, seq, "k"), kv_tile, (n_block, 0))
        tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, one, cute.group_modes(sK, 0, 2),
                                           cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, one, cute.group_modes(sV, 0, 2),
                                           cute.group_modes(gV, 0, 2))
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipe_kv.producer_acquire(kv_state)
        cute.copy(tma_atom_K, tKgK, tKsK, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
        cute.copy(tma_atom_V, tVgV, tVsV, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
        if cutlass.const_expr(self.cfg.pdl):
            # BwdConfig.pdl: K and V are inputs; the LSE / D rows are the preprocess's
            cute.arch.griddepcontrol_wait()

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        # the dO ring's own state, used only when its depth differs from the Q ring's (an alias of
        # `state` made before the loop would be carried as a second, never advanced, state)
        do_ring = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.do_stages)
        for step in cutlass.range(num_steps, unroll=1):
            do_state = do_ring
            if cutlass.const_expr(self.do_stages == self.num_stages):
                do_state = state
            head = head_kv * ratio + step // num_m
            m_block = m_min + step % num_m
            q_tile = (self.tile_m, self.hdim)
            gQ = cute.local_tile(self.seq_rows(mQ, head, batch, seq, "q"), q_tile, (m_block, 0))
            gdO = cute.local_tile(self.seq_rows(mdO, head, batch, seq, "q"), q_tile, (m_block, 0))
            tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, one, cute.group_modes(sQ, 0, 2),
                                               cute.group_modes(gQ, 0, 2))
            tdOsdO, tdOgdO = cpasync.tma_partition(tma_atom_dO, 0, one, cute.group_modes(sdO, 0, 2),
                                                   cute.group_modes(gdO, 0, 2))
            # the host pads the rows to whole query blocks, so the row tile never runs past them
            gLSE = cute.local_tile(self.seq_row_vector(mLSE, head, batch, seq), (self.tile_m,), (m_block,))
            gD = cute.local_tile(self.seq_row_vector(mD, head, batch, seq), (self.tile_m,), (m_block,))
            tLsL, tLgL = cpasync.tma_partition(tma_atom_LSE, 0, one, cute.group_modes(sLSE, 0, 1),
                                               cute.group_modes(gLSE, 0, 1))
            tDsD, tDgD = cpasync.tma_partition(tma_atom_D, 0, one, cute.group_modes(sD, 0, 1),
                                               cute.group_modes(gD, 0, 1))
            pipe_q.producer_acquire(state)
            cute.copy(tma_atom_Q, tQgQ, tQsQ[None, state.index],
                      tma_bar_ptr=pipe_q.producer_get_barrier(state))
            cute.copy(tma_atom_LSE, tLgL, tLsL[None, state.index],
                      tma_bar_ptr=pipe_q.producer_get_barrier(state))
            pipe_do.producer_acquire(do_state)
            cute.copy(tma_atom_dO, tdOgdO, tdOsdO[None, do_state.index],
                      tma_bar_ptr=pipe_do.producer_get_barrier(do_state))
            cute.copy(tma_atom_D, tDgD, tDsD[None, do_state.index],
                      tma_bar_ptr=pipe_do.producer_get_barrier(do_state))
            state.advance()
            if cutlass.const_expr(self.do_stages != self.num_stages):
                do_ring.advance()

    @cute.jit
    def store_dkv(self, mdK, mdV, sK, sV, tma_atom_dK, tma_atom_dV, n_block, head_kv, batch, tidx,
                  seq=None, seqlen_k=None):
        """Epilogue's last step, after dK and dV are in K's and V's smem buffers and fenced for the
        async proxy: one warp (the TMA copy elects its issuing lane itself) stores both with TMA,
        which drops the rows past seqlen_k, and waits for the reads of smem, which must outlive
        them. Varlen (`seq`): every consumer thread copies 16-byte pieces of the rows below the
        sequence's seqlen_k (a TMA box would write the next sequence's rows)."""
        if cutlass.const_expr(seq is not None):
            # the thread index and the length taken afresh, not held through the consumers' loop
            tidx = self.consumer_tidx()
            rows_left = seq.lengths()[1] - n_block * self.tile_n
            per_row = self.hdim // 8
            items = self.tile_n * per_row
            threads = self.num_consumer_threads
            for mX, sX in ((mdK, sK), (mdV, sV)):
                gX = cute.local_tile(self.seq_rows(mX, head_kv, batch, seq, "k"), (self.tile_n, self.hdim),
                                     (n_block, 0))
                for i in cutlass.range_constexpr((items + threads - 1) // threads):
                    item = tidx + i * threads
                    row = item // per_row
                    if row < rows_left and item < items:
                        piece = (row, item % per_row)
                        cute.autovec_copy(cute.local_tile(sX, (1, 8), piece),
                                          cute.local_tile(gX, (1, 8), piece))
        elif tidx < 32:
            for mX, sX, atom in ((mdK, sK, tma_atom_dK), (mdV, sV, tma_atom_dV)):
                gX = cute.local_tile(mX[None, None, head_kv, batch], (self.tile_n, self.hdim), (n_block, 0))
                tsX, tgX = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                                                 cute.group_modes(gX, 0, 2))
                cute.copy(atom, tsX, tgX)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def dq_turn(self, m_block, n_block, seqlen_q, seqlen_k, window_left, window_right):
        """Deterministic mode: how many key blocks add their dQ tile of `m_block` before `n_block`
        does. Descending with a right bound (causal/local): the key block on the query block's
        diagonal goes first, it reaches this query block before the lower key blocks do (they
        start lower); ascending otherwise."""
        turn = n_block - self.blocks.first_n_block(m_block, seqlen_q, seqlen_k, window_left)
        if cutlass.const_expr(self.has_right):
            turn = self.blocks.last_n_block(m_block, seqlen_q, seqlen_k, window_right) - n_block
        return turn

    @cute.jit
    def wait_turn(self, sem, turn):
        """Deterministic mode: spin (gpu-scope acquire) until query block's semaphore `sem` says
        the key blocks before this one have added their dQ (`turn`, from dq_turn)."""
        while cute.arch.load(sem, Int32, sem="acquire", scope="gpu") != turn:
            pass

    @cute.jit
    def pass_turn_when_landed(self, sem, lane):
        """Deterministic mode, dQ writer warp: the next key block's CTA may add its dQ of this
        query block only once every reduce-add this warp issued has landed in gmem."""
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_warp()
        if lane == 0:
            cute.arch.atomic_add(sem, Int32(1), sem="release", scope="gpu")

    @cute.jit
    def lpt_launch_coords(self, n_block, head_kv, batch, seqlen_q, seqlen_k, ratio):
        """BwdConfig.lpt: (key block, KV head, batch) of the CTA with this block index when the
        grid launches longest first (lpt_coords over lpt_section's L2-sized sections)."""
        num_n, num_heads, num_batch = cute.arch.grid_dim()
        linear = n_block + num_n * (head_kv + num_heads * batch)
        section = lpt_section(seqlen_q, seqlen_k, ratio, self.hdim, self.cfg.lpt_l2_kib, cutlass.max)
        n_block, pair = lpt_coords(linear, num_n, num_heads * num_batch, section, cutlass.min)
        return n_block, pair % num_heads, pair // num_heads

    @cute.jit
    def launch_order_n_block(self, n_block, seqlen_k):
        """Deterministic mode with a right bound: the CTA with the highest key block launches
        first, so a CTA only ever waits for CTAs already resident or done (dq_turn's order)."""
        if cutlass.const_expr(self.cfg.deterministic and self.has_right):
            n_block = (seqlen_k + self.tile_n - 1) // self.tile_n - 1 - n_block
        return n_block


def lpt_section(seqlen_q, seqlen_k, ratio, hdim, budget_kib, max_fn=max):
    """(head, batch) pairs per launch section for BwdConfig.lpt: as many as keep their Q, dO (2 B)
    and fp32 dQ accumulator per query row of each of `ratio` query heads, and K, V (2 B) per key
    row, within `budget_kib`; at least 1. Plain arithmetic: Python ints on the host (tests) and
    Int32 in the kernel (the budget is a compile-time constant)."""
    rows = 2 * seqlen_q * ratio + seqlen_k  # in units of 4 * hdim bytes
    section = (budget_kib * 1024 // (4 * hdim)) // rows
    return max_fn(section, 1)


def lpt_coords(linear, num_n, pairs, section, min_fn=min):
    """Launch index -> (key block, (head, batch) pair): sections of `section` pairs in order (the
    last may be smaller), key block slowest inside a section, so that each section launches its
    longest CTAs first and the grid ends on the shortest. A bijection of [0, num_n * pairs)."""
    first = linear // (section * num_n) * section
    size = min_fn(section, pairs - first)
    r = linear - first * num_n
    return r // size, first + r % size
