"""FlashAttention forward for Hopper (sm_90a): warp-specialized TMA + WGMMA kernel.

Over 800 lines because it is one kernel class: the producer, the consumers' schedules and the
epilogue share one set of pipelines and barriers, and splitting them would scatter one schedule.

One CTA computes one (tile_m x hdim) output tile for one (batch, head):

  warpgroup 0 (producer, setmaxnreg.dec): one warp issues TMA loads of Q once and of K, V
      into a `num_stages` shared-memory ring, each stage guarded by full/empty mbarriers.
  warpgroups 1..W (consumers, setmaxnreg.inc): 64 query rows each. Per key block:
      S = Q K^T (WGMMA, both operands in smem) -> mask -> online softmax in registers ->
      P converted in registers and used as the register A operand of O += P V (WGMMA).
  epilogue: O / l in registers -> stmatrix into O's own tile, the (now free) Q buffer, or
      V's stages (FwdConfig.o_in_v) -> TMA store; LSE from registers.

Key blocks are visited from the last one down, so that the blocks that need masking (the
ragged seqlen_k end, the causal diagonal) come first and the rest run without a mask.

Paged KV (FwdConfig.page_size, varlen only): K and V are a paged cache's rows, and each key block
reaches its stage as tile_n / page_size TMA boxes of whole pages (or one box inside a page) at the
rows the page table names, all completing on the stage's one full barrier (load_stage_paged).
"""

from __future__ import annotations

from functools import partial

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup

from flashhopper.config import (
    FP8_P_SHIFT_LOG2,
    LAZY_MAX_LOG2,
    SCHED_STAGES,
    FwdConfig,
)
from flashhopper.hopper import fp8 as F8
from flashhopper.hopper import fp8_descale as KD
from flashhopper.hopper import fwd_cluster as C
from flashhopper.hopper import layout as L
from flashhopper.hopper import mask as M
from flashhopper.hopper import softmax as S
from flashhopper.hopper.barriers import NUM_NAMED_BARRIERS, FwdBarrier
from flashhopper.hopper.host import paged_box_count
from flashhopper.hopper.mma import acc_to_operand_a, issue_gemm
from flashhopper.hopper.opaque import opaque as _opaque
from flashhopper.hopper.tile_scheduler import FwdTileScheduler, VarlenWalk
from flashhopper.hopper.two_level import TwoLevelO


class FlashFwdSm90:
    def __init__(self, cfg: FwdConfig):
        cfg.check()
        self.cfg = cfg
        self.dtype = L.CUTE_DTYPES[cfg.dtype]
        # FP8 inputs (hopper/fp8.py): V transposed in smem by the producer, P in e4m3, bf16 output
        self.fp8 = cfg.is_fp8
        self.o_dtype = cutlass.BFloat16 if self.fp8 else self.dtype
        self.p_shift = float(FP8_P_SHIFT_LOG2) if self.fp8 else 0.0
        # FP8 with V as users store it: producer warps 1-3 transpose it (else cfg.vt_in_gmem, the ablation)
        self.transposer = self.fp8 and not cfg.vt_in_gmem
        # FP8 with per-token q / k descales (hopper/fp8_descale.py): the producer warp stages K's in smem
        self.token = cfg.token_descales
        self.tile_m, self.tile_n = cfg.tile_m, cfg.tile_n
        self.hdim, self.hdim_v = cfg.hdim, cfg.hdim_v
        # P @ V's N: the head dim, and with pv_row_sum (FP8) rows of ones under V^T whose columns of O
        # are each row's sum of P
        self.row_sum, self.pv_n = cfg.pv_row_sum, cfg.pv_n
        self.num_stages = cfg.num_stages
        self.num_consumer_wg = cfg.num_consumer_wg
        self.num_consumer_threads = 128 * cfg.num_consumer_wg
        self.num_threads = cfg.num_threads
        # which sides of the visibility rule are bounded, and its block arithmetic (mask.BlockInfo)
        self.blocks = M.BlockInfo.of(cfg, cfg.tile_m, cfg.tile_n)
        self.has_right, self.has_left = self.blocks.has_right, self.blocks.has_left
        # two-level O (FP8): the mask-free overlapped steps fold their row scale into the next block's
        # add (hopper/two_level.py)
        self.defers_row_scale = (cfg.pv_two_level and cfg.pv_defer_scale and cfg.intra_wg_overlap
                                 and not cfg.rescale_o_before_pv)
        self.has_softcap = cfg.softcap
        self.cluster_m = cfg.cluster_m
        # O stores per tile: one per consumer warpgroup with wg_epilogue, else one for the tile
        self.o_parts = cfg.num_consumer_wg if cfg.wg_epilogue else 1
        # o_in_v: the O-read hand-off's stages (one per V stage with o_v_stages)
        self.o_stages = cfg.num_stages if cfg.o_per_stage else 1

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, sq, h, d)
        mK: cute.Tensor,  # (b, sk, hk, d)
        mV: cute.Tensor,  # (b, sk, hk, dv)
        mO: cute.Tensor,  # (b, sq, h, dv)
        mLSE: cute.Tensor,  # (b, h, sq) fp32
        mTileCounter: cute.Tensor,  # (2,) int32: tile counter, retired CTAs; zero on entry and on exit
        scale_log2: Float32,  # softmax scale * log2(e), or softcap * log2(e) with softcap
        softcap_pre: Float32,  # softmax scale / softcap (unused without softcap)
        window_left: Int32,
        window_right: Int32,
        num_ctas: Int32,  # grid size: all tiles, or one CTA per SM when persistent
        l2_section: Int32,  # (head, batch) pairs whose tiles are interleaved (FwdTileScheduler.coords)
        mQd: cute.Tensor | None,  # FP8: (b, hk) fp32 descales of Q, K, V (any strides); else None. Per-token
        # (cfg.qk_descale "token"): Q's (b, h, sq), K's (b, hk, sk), V's (b, hk)
        mKd: cute.Tensor | None,
        mVd: cute.Tensor | None,
        mCuQ: cute.Tensor | None,  # varlen: (batch + 1,) int32 cumulative query / key offsets
        mCuK: cute.Tensor | None,  # (paged: each sequence's first entry in mPageTable)
        mUsedQ: cute.Tensor | None,  # varlen: (batch,) int32 lengths of each sequence's used part
        mUsedK: cute.Tensor | None,
        mWalk: cute.Tensor | None,  # varlen: the walk table (hopper/varlen_walk.py), int32 (2 batch,)
        mPageTable: cute.Tensor | None,  # paged (cfg.page_size): the page table, flat int32; K / V the
        # cache's rows (1, pages * page_size, hk, d); key p of sequence b in entry mCuK[b] + p // page_size
        # split_kv (unused otherwise): Q (b, rows, heads, d) each item's own rows; O (b * splits, rows,
        # heads, dv) and LSE (b * splits, heads, rows) the partials of item i's split j at i * splits + j;
        # mUsedK (b,) each item's cache length, mCuK (b,) its first key row (paged: table entry) where
        # key_rows is 0
        num_splits: Int32,
        split_chunk: Int32,  # positions of an item a split takes (paged: whole pages)
        new_keys: Int32,  # keys each item holds past mUsedK's count (the append's)
        key_rows: Int32,  # item i's keys from row (paged: entry) i * key_rows; 0: from mCuK[i]
        split_tokens: Int32,  # token_rows: the query tokens an item's rows pack (1 otherwise)
        stream: cuda.CUstream,
    ):
        # tile coordinates first: (seqlen, dim, head, batch); V^T given (vt_in_gmem): (dim, keys, head, batch)
        mQ, mK, mO = [L.select_modes(t, [1, 3, 2, 0]) for t in (mQ, mK, mO)]
        mV = L.select_modes(mV, [2, 3, 1, 0] if self.cfg.vt_in_gmem else [1, 3, 2, 0])
        mLSE = L.select_modes(mLSE, [2, 1, 0])

        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            Float32, atom_layout_mnk=(self.num_consumer_wg, 1, 1), tiler_mn=(64, self.tile_n),
        )
        tiled_mma_pv = self.make_mma_pv(self.num_consumer_wg)

        sQ_layout = L.smem_layout_row_major(self.dtype, self.tile_m, self.hdim)
        q_stages = self.cfg.q_stages
        if cutlass.const_expr(q_stages > 1):  # a Q ring: sQ gets a stage mode, the TMA box stays one tile
            sQ_layout = L.smem_layout_row_major(self.dtype, self.tile_m, self.hdim, q_stages)
        sQ_tile = self.q_tile(sQ_layout)
        sK_layout = L.smem_layout_row_major(self.dtype, self.tile_n, self.hdim, self.num_stages)
        sV_layout = L.smem_layout_row_major(self.dtype, self.tile_n, self.hdim_v, self.num_stages)
        sVt_layout = None
        if cutlass.const_expr(self.fp8):  # P @ V reads V^T (head dim x keys) from sV
            sV_layout = L.smem_layout_row_major(self.dtype, self.pv_n, self.tile_n, self.num_stages)
        if cutlass.const_expr(self.transposer):  # the TMA lands V as stored in sVt's ring
            sVt_layout = L.smem_layout_row_major(self.dtype, self.tile_n, self.hdim_v, self.cfg.vt_stages)
        sO_layout = L.smem_layout_row_major(self.o_dtype, self.tile_m, self.hdim_v)
        if cutlass.const_expr(self.cfg.o_per_stage):
            # one warpgroup's 64 rows, contiguous, at the base of each V stage (see store_o)
            part = L.smem_layout_row_major(self.o_dtype, 64, self.hdim_v)
            stage_step = cute.make_layout(self.num_stages, stride=self.tile_n * self.hdim_v)
            sO_layout = cute.make_composed_layout(part.inner, 0, cute.append(part.outer, stage_step))

        o_in_v = self.cfg.o_in_v_ring
        # O staged in Q's buffer, in Q's elements (FP8: 2 bytes of O per byte of Q)
        sO_in_q = 0
        if cutlass.const_expr(self.cfg.o_in_q_buffer):
            sO_in_q = cute.cosize(sO_layout) * (self.o_dtype.width // self.dtype.width)

        mem, align = cute.struct.MemRange, cute.struct.Align
        sched_stages, sched_words = self.cfg.sched_ring
        fields = {
            # with o_in_v, the O-read hand-off's barriers follow Q's (see pipe_o)
            "mbar_Q": mem[cutlass.Int64, 2 * q_stages + (2 * self.o_stages if o_in_v else 0)],
            "mbar_K": mem[cutlass.Int64, 2 * self.num_stages],
            "mbar_V": mem[cutlass.Int64, 2 * self.num_stages],
            # dynamic scheduler: the producer hands each claimed tile index to the consumers
            "mbar_sched": mem[cutlass.Int64, 2 * sched_stages],
            # varlen: a tile's record (FwdTileScheduler.publish_record)
            "sTile": mem[Int32, sched_stages * sched_words],
        }
        if cutlass.const_expr(self.cfg.varlen):  # the producer's next tile, kept through a tile's loads
            fields["sClaimed"] = mem[Int32, 1]
        if cutlass.const_expr(self.transposer):  # the ring V is loaded into as stored: its mbarriers
            fields["mbar_Vt"] = mem[cutlass.Int64, 2 * self.cfg.vt_stages]
        fields |= {
            "sQ": align[mem[self.dtype, max(cute.cosize(sQ_layout), sO_in_q)], 1024],
            "sK": align[mem[self.dtype, cute.cosize(sK_layout)], 1024],
            "sV": align[mem[self.dtype, max(cute.cosize(sV_layout), cute.cosize(sO_layout) if o_in_v else 0)],
                        1024],
            # O's own tile when it fits (else O is staged in sQ); 8 elements is a placeholder
            "sO": align[mem[self.o_dtype, cute.cosize(sO_layout) if self.cfg.o_buffer else 8], 1024],
        }
        if cutlass.const_expr(self.transposer):
            fields["sVt"] = align[mem[self.dtype, cute.cosize(sVt_layout)], 1024]
        if cutlass.const_expr(self.token):  # the k-descale ring (one stage per K stage) and its mbarriers
            fields["mbar_Kd"] = mem[cutlass.Int64, 2 * self.num_stages]
            fields["sKd"] = align[mem[Float32, self.cfg.kd_stage_floats * self.num_stages], 16]
        SharedStorage = L.smem_struct(fields)

        load_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(load_op, mQ, sQ_tile, (self.tile_m, self.hdim))
        if cutlass.const_expr(self.cluster_m > 1):
            # each CTA of the cluster loads 1/cluster_m of a K/V tile and multicasts it
            kv_op = C.kv_tma_op(self.cluster_m)
            tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
                kv_op, mK, cute.select(sK_layout, mode=[0, 1]), (self.tile_n, self.hdim),
                num_multicast=self.cluster_m)
            tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
                kv_op, mV, cute.select(sV_layout, mode=[0, 1]), (self.tile_n, self.hdim_v),
                num_multicast=self.cluster_m)
        elif cutlass.const_expr(self.cfg.page_size):
            # paged: a box of whole pages' rows (tile_n / page_size of them fill a stage) or of one key
            # block inside a page; each lands on whole 8-row swizzle atoms of the stage
            _, box_rows = paged_box_count(self.tile_n, self.cfg.page_size)
            tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
                load_op, mK, L.smem_layout_row_major(self.dtype, box_rows, self.hdim), (box_rows, self.hdim))
            tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
                load_op, mV, L.smem_layout_row_major(self.dtype, box_rows, self.hdim_v),
                (box_rows, self.hdim_v))
        else:
            tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
                load_op, mK, cute.select(sK_layout, mode=[0, 1]), (self.tile_n, self.hdim)
            )
            if cutlass.const_expr(self.cfg.vt_in_gmem):  # V^T tiles straight into sV
                tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
                    load_op, mV, cute.select(sV_layout, mode=[0, 1]), (self.hdim_v, self.tile_n))
            else:
                tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
                    load_op, mV, cute.select(sVt_layout if self.fp8 else sV_layout, mode=[0, 1]),
                    (self.tile_n, self.hdim_v)
                )
        if cutlass.const_expr(self.cfg.o_per_stage):
            tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mO, cute.select(sO_layout, mode=[0, 1]), (64, self.hdim_v)
            )
        elif cutlass.const_expr(self.cfg.wg_epilogue):
            # one warpgroup's 64 rows: the other parts are the same layout at whole-KiB offsets
            tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mO, self.o_part_layout(sO_layout), (64, self.hdim_v)
            )
        else:
            tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mO, sO_layout, (self.tile_m, self.hdim_v)
            )

        split_args = ((num_splits, split_chunk, new_keys, key_rows, split_tokens) if self.cfg.split_kv
                      else (None,) * 5)
        kernel = self.kernel(
            tma_Q, tma_K, tma_V, tma_O, mLSE, mTileCounter,
            tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O,
            scale_log2, softcap_pre, window_left, window_right, l2_section,
            sQ_layout, sK_layout, sV_layout, sO_layout,
            tiled_mma_qk, tiled_mma_pv, SharedStorage, mQd, mKd, mVd, sVt_layout,
            mCuQ, mCuK, mUsedQ, mUsedK, mWalk,
            mO if self.cfg.varlen and not self.cfg.split_kv else None, mPageTable, *split_args,
        )
        if cutlass.const_expr(self.cluster_m > 1):  # num_ctas: a multiple of cluster_m (config.fwd_grid)
            kernel.launch(grid=(num_ctas, 1, 1), block=[self.num_threads, 1, 1],
                          cluster=(self.cluster_m, 1, 1), stream=stream, min_blocks_per_mp=1)
        else:
            kernel.launch(grid=(num_ctas, 1, 1), block=[self.num_threads, 1, 1], stream=stream,
                          min_blocks_per_mp=1, use_pdl=self.cfg.pdl)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mTileCounter: cute.Tensor,
        tma_atom_Q: cute.CopyAtom,
        tma_atom_K: cute.CopyAtom,
        tma_atom_V: cute.CopyAtom,
        tma_atom_O: cute.CopyAtom,
        scale_log2: Float32,
        softcap_pre: Float32,
        window_left: Int32,
        window_right: Int32,
        l2_section: Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
        mQd: cute.Tensor | None,
        mKd: cute.Tensor | None,
        mVd: cute.Tensor | None,
        sVt_layout: cute.ComposedLayout | None,
        mCuQ: cute.Tensor | None,
        mCuK: cute.Tensor | None,
        mUsedQ: cute.Tensor | None,
        mUsedK: cute.Tensor | None,
        mWalk: cute.Tensor | None,
        mO_rows: cute.Tensor | None,  # varlen: O itself (mO is TMA's view of it), stored row by row
        mPageTable: cute.Tensor | None,
        num_splits: Int32 | None,  # split_kv: the split walk's scalars (__call__), else None
        split_chunk: Int32 | None,
        new_keys: Int32 | None,
        key_rows: Int32 | None,
        split_tokens: Int32 | None,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        if cutlass.const_expr(self.cfg.o_buffer):
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        elif cutlass.const_expr(self.cfg.o_in_v_ring):
            sO = storage.sV.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        else:
            sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner, dtype=self.o_dtype)

        # Full barriers: one producer arrive + TMA bytes. Empty barriers: one arrive per
        # consumer warp (the pipeline signals from lane 0 of each warp).
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_threads // 32)
        sQ_tile = self.q_tile(sQ_layout)
        pipe_q = pipeline.PipelineTmaAsync.create(
            num_stages=self.cfg.q_stages, producer_group=producer, consumer_group=consumers,
            tx_count=cute.size_in_bytes(self.dtype, sQ_tile),
            barrier_storage=storage.mbar_Q.data_ptr(), defer_sync=True,
        )
        cluster = self.cluster_m > 1
        # with a cluster the K/V empty barriers also count the peer's consumer warps (their lane 1
        # arrives remotely), and the full barriers still expect the whole tile (both halves land)
        kv_consumers, kv_cluster = consumers, None
        if cutlass.const_expr(cluster):
            kv_consumers = C.kv_consumer_group(self.cluster_m, self.num_consumer_threads)
            kv_cluster = C.cta_layout_vmnk(self.cluster_m)
        pipe_k = pipeline.PipelineTmaAsync.create(
            num_stages=self.num_stages, producer_group=producer, consumer_group=kv_consumers,
            tx_count=cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1])),
            barrier_storage=storage.mbar_K.data_ptr(), cta_layout_vmnk=kv_cluster, defer_sync=True,
        )
        pipe_vt = None
        if cutlass.const_expr(self.transposer):
            # V reaches the consumers through the transposer warps (hopper/fp8.py): the TMA fills sVt
            # (released by the transposer warps), the transposer fills sV (every thread arrives)
            pipe_vt = pipeline.PipelineTmaAsync.create(
                num_stages=self.cfg.vt_stages, producer_group=producer,
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, F8.TRANSPOSER_WARPS),
                tx_count=cute.size_in_bytes(self.dtype, cute.select(sVt_layout, mode=[0, 1])),
                barrier_storage=storage.mbar_Vt.data_ptr(), defer_sync=True,
            )
            pipe_v = pipeline.PipelineAsync.create(
                num_stages=self.num_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, F8.TRANSPOSER_THREADS),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_threads),
                barrier_storage=storage.mbar_V.data_ptr(), defer_sync=True,
            )
        else:
            pipe_v = pipeline.PipelineTmaAsync.create(
                num_stages=self.num_stages, producer_group=producer, consumer_group=kv_consumers,
                tx_count=cute.size_in_bytes(self.dtype, cute.select(sV_layout, mode=[0, 1])),
                barrier_storage=storage.mbar_V.data_ptr(), cta_layout_vmnk=kv_cluster, defer_sync=True,
            )
        pipe_o = None
        if cutlass.const_expr(self.cfg.o_in_v_ring):
            # O staged in sV: each O part's storing thread "produces" the news that its TMA store has
            # read sV, the producer warp "consumes" it before the next tile's first V load. One stage
            # (o_v_stages: one per V stage, each from the one warpgroup whose part is there), its state
            # following from the tile's parity (see o_read_state)
            pipe_o = pipeline.PipelineAsync.create(
                num_stages=self.o_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                         1 if self.cfg.o_per_stage else self.o_parts),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                barrier_storage=storage.mbar_Q.data_ptr() + 2 * self.cfg.q_stages, defer_sync=True,
            )
        dynamic = self.cfg.dynamic_sched
        pipe_sched, sTile = None, None
        if cutlass.const_expr(dynamic or self.cfg.varlen):  # (split_kv: the record ring, on a static walk)
            # every consumer thread arrives on release (plain mbarrier arrives, one per thread); with
            # FP8 the transposer threads read each tile too
            readers = self.num_consumer_threads + (F8.TRANSPOSER_THREADS if self.transposer else 0)
            pipe_sched = pipeline.PipelineAsync.create(
                num_stages=self.cfg.sched_ring[0], producer_group=producer,
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, readers),
                barrier_storage=storage.mbar_sched.data_ptr(), defer_sync=True,
            )
            if cutlass.const_expr(self.cfg.varlen):  # a record a slot (FwdTileScheduler.publish_record)
                sTile = storage.sTile.get_tensor(cute.make_layout(self.cfg.sched_ring[::-1]))
            else:
                sTile = storage.sTile.get_tensor(cute.make_layout(self.cfg.sched_ring[0]))
        kd_ring = None
        if cutlass.const_expr(self.token):
            # per-token k descales (hopper/fp8_descale.py): the producer warp's 32 lanes fill a stage and
            # arrive on its full barrier; every consumer thread arrives on its empty barrier once it has
            # read its descales (the producer waits on it before refilling the stage)
            lanes = pipeline.CooperativeGroup(pipeline.Agent.Thread, 32)
            readers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_threads)
            pipe_kd = pipeline.PipelineAsync.create(
                num_stages=self.num_stages, producer_group=lanes, consumer_group=readers,
                barrier_storage=storage.mbar_Kd.data_ptr(), defer_sync=True,
            )
            kd_ring = (storage.sKd.get_tensor(KD.kd_layout(self.tile_n, self.num_stages)), pipe_kd)
        # with a cluster: no producer may multicast into the peer, nor arrive on its barriers,
        # before the peer's barriers are initialized (cluster-wide arrive / wait)
        pipeline.pipeline_init_arrive(cluster_shape_mn=kv_cluster, is_relaxed=True)
        pipeline.pipeline_init_wait(cluster_shape_mn=kv_cluster)
        if cutlass.const_expr(self.cfg.pdl):
            # FwdConfig.pdl: nothing above touched global memory (barriers, descriptor prefetch); from here
            # on everything may, once the stream's previous kernel is done. The next may launch now: it
            # waits for this one the same way
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()

        seqlen_q = mQ.shape[0]
        seqlen_k = mK.shape[0]
        num_heads = mQ.shape[2]
        varlen, split = self.cfg.varlen, self.cfg.split_kv
        walk, num_m_blocks, num_pairs = None, None, None
        if cutlass.const_expr(varlen and not split):  # each sequence's real tiles, from the walk table
            walk = VarlenWalk(mWalk, mUsedQ.shape[0])
        else:
            num_m_blocks = (seqlen_q + self.tile_m - 1) // self.tile_m
            # split_kv: a pair is (head, item * splits + split), the host's l2_section 1 (coords: the
            # query block fastest, then the head, then the split, then the item)
            num_pairs = num_heads * mQ.shape[3] * (num_splits if cutlass.const_expr(split) else 1)
        seq_bounds = partial(self.seq_bounds, mCuQ=mCuQ, mCuK=mCuK, mUsedQ=mUsedQ, mUsedK=mUsedK)
        varlen_blocks = partial(self.blocks.n_block_range, window_left=window_left, window_right=window_right)
        bidx, _, _ = cute.arch.block_idx()
        grid_size = cute.arch.grid_dim()[0]
        block_range = partial(self.blocks.n_block_range, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                              window_left=window_left, window_right=window_right)
        # this CTA's tiles (a cluster tile is a pair of query blocks; both CTAs of a cluster walk
        # the same pairs)
        claimed = None
        if cutlass.const_expr(varlen and not split):
            claimed = storage.sClaimed.get_tensor(cute.make_layout(1))
        sched = FwdTileScheduler(has_right=self.has_right, cluster_m=self.cluster_m if cluster else 1,
                                 num_m_blocks=num_m_blocks, num_pairs=num_pairs, num_heads=num_heads,
                                 l2_section=l2_section, bidx=bidx, grid_size=grid_size, counter=mTileCounter,
                                 pipe=pipe_sched, slots=sTile, walk=walk, claimed=claimed)
        num_tiles, rank = sched.num_tiles, sched.rank

        # Both roles walk the same tiles: the static sequence (tile = blockIdx.x, += gridDim.x), or the
        # producer warp's claims handed to the consumers through sTile (dynamic; varlen: with each tile's
        # sequence bounds). The pipeline states carry over from tile to tile.
        if warp_idx < 4:
            if cutlass.const_expr(self.cfg.reg_realloc):
                cute.arch.setmaxregister_decrease(self.cfg.producer_regs)
            if warp_idx == 0:
                head_ratio = num_heads // mK.shape[2]
                q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.cfg.q_stages)
                k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
                # FP8: the TMA fills sVt's ring (the transposer warps then fill sV's)
                sV_loaded, pipe_v_loaded, v_ring = sV, pipe_v, self.num_stages
                if cutlass.const_expr(self.transposer):
                    sV_loaded = storage.sVt.get_tensor(sVt_layout.outer, swizzle=sVt_layout.inner)
                    pipe_v_loaded, v_ring = pipe_vt, self.cfg.vt_stages
                v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, v_ring)
                tile = bidx
                if cutlass.const_expr(split):
                    # the split walk: the grid strides over the tiles; each one's record carries its
                    # partial's index (item * splits + split) and its keys
                    lane = cute.arch.lane_idx()
                    tile = sched.first
                    while tile < num_tiles:
                        m_block, head, part = sched.coords(tile)
                        item = part // num_splits
                        split_idx = part - item * num_splits
                        off_k, len_k = self.split_keys(item, split_idx, split_chunk, mUsedK, new_keys, mCuK,
                                                       key_rows)
                        # token_rows: the record's query-offset slot (0 in the split walk) carries the keys
                        # from this split's start to the item's end (the mask's diagonal)
                        to_end = Int32(0)
                        if cutlass.const_expr(self.cfg.token_rows):
                            to_end = mUsedK[item] + new_keys - split_idx * split_chunk
                        sched.publish_record(q_state, (m_block, head, part, to_end, seqlen_q, len_k), lane)
                        n_min, n_max = self.split_blocks(m_block, seqlen_q, len_k, varlen_blocks)
                        pages = None
                        if cutlass.const_expr(self.cfg.page_size):  # off_k: its first table entry
                            pages = (mPageTable, off_k, len_k)
                        q_state, k_state, v_state = self.produce(
                            mQ, mK, mV, sQ, sK, sV_loaded, tma_atom_Q, tma_atom_K, tma_atom_V, pipe_q, pipe_k,
                            pipe_v_loaded, m_block, head, head // head_ratio, item, n_min, n_max, q_state,
                            k_state, v_state, pipe_o=pipe_o, offsets=(None, off_k), pages=pages, kv_batch=0)
                        tile += sched.stride
                    end = (Int32(0), Int32(0), Int32(-1), Int32(0), Int32(0), Int32(0))
                    sched.publish_record(q_state, end, lane)
                elif cutlass.const_expr(varlen):
                    # the walk table's tiles, each published with its sequence's bounds (the consumers
                    # read them from smem); FP8, whose transposer warps would need them too, has no varlen
                    lane = cute.arch.lane_idx()
                    m_block, head, seq = sched.varlen_tile(tile)
                    while seq >= 0:
                        off_q, len_q, off_k, len_k = seq_bounds(seq)
                        sched.publish_record(q_state, (m_block, head, seq, off_q, len_q, len_k), lane)
                        sched.claim_ahead(lane)
                        n_min, n_max = varlen_blocks(m_block, seqlen_q=len_q, seqlen_k=len_k)
                        pages = None
                        if cutlass.const_expr(self.cfg.page_size):  # off_k: its first table entry
                            pages = (mPageTable, off_k, len_k)
                        q_state, k_state, v_state = self.produce(
                            mQ, mK, mV, sQ, sK, sV_loaded, tma_atom_Q, tma_atom_K, tma_atom_V, pipe_q, pipe_k,
                            pipe_v_loaded, m_block, head, head // head_ratio, 0, n_min, n_max, q_state,
                            k_state, v_state, pipe_o=pipe_o, offsets=(off_q, off_k), pages=pages)
                        tile = sched.claimed(lane)
                        m_block, head, seq = sched.varlen_tile(tile)
                    sched.retire(lane)  # the last claim is done (its tile is past the walk's end)
                    # the end marker (sequence -1) lets the consumers leave
                    end = (Int32(0), Int32(0), Int32(-1), Int32(0), Int32(0), Int32(0))
                    sched.publish_record(q_state, end, lane)
                elif cutlass.const_expr(dynamic):
                    lane = cute.arch.lane_idx()
                    sched_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                               SCHED_STAGES)
                    while tile < num_tiles:
                        sched.publish(sched_state, tile, lane)
                        sched_state.advance()
                        # claim the next tile now: the atomic's latency hides under this tile's loads
                        nxt = sched.claim(lane)
                        m_block, head, batch = sched.coords(tile)
                        n_min, n_max = block_range(m_block)
                        q_state, k_state, v_state = self.produce(
                            mQ, mK, mV, sQ, sK, sV_loaded, tma_atom_Q, tma_atom_K, tma_atom_V, pipe_q, pipe_k,
                            pipe_v_loaded, m_block, head, head // head_ratio, batch, n_min, n_max,
                            q_state, k_state, v_state, pipe_o=pipe_o,
                            kd=None if kd_ring is None else (mKd, *kd_ring))
                        tile = nxt
                    # this CTA's last claim is done (it returned an index past the last tile)
                    sched.retire(lane)
                    # the end marker (an index past the last tile) lets the consumers leave
                    sched.publish(sched_state, tile, lane)
                else:
                    tile = sched.first
                    while tile < num_tiles:
                        m_block, head, batch = sched.coords(tile)
                        n_min, n_max = block_range(m_block)
                        q_state, k_state, v_state = self.produce(
                            mQ, mK, mV, sQ, sK, sV_loaded, tma_atom_Q, tma_atom_K, tma_atom_V, pipe_q,
                            pipe_k, pipe_v_loaded, m_block, head, head // head_ratio, batch, n_min, n_max,
                            q_state, k_state, v_state, rank=rank, pipe_o=pipe_o,
                            kd=None if kd_ring is None else (mKd, *kd_ring))
                        tile += sched.stride
                    if cutlass.const_expr(cluster):
                        # the peer's consumers arrive on our empty barriers until they release
                        # their last stage: stay until every stage is empty again
                        pipe_k.producer_tail(k_state)
                        pipe_v.producer_tail(v_state)
            if cutlass.const_expr(self.transposer):
                if warp_idx > 0:
                    # warps 1-3: V^T for the consumers, block by block in the order the TMA loads V
                    self.transpose_tiles(storage, sVt_layout, sV_layout, pipe_vt, pipe_v, sched, tidx - 32,
                                         block_range)
        else:
            if cutlass.const_expr(self.cfg.reg_realloc):
                cute.arch.setmaxregister_increase(self.cfg.consumer_regs)
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.q_stages)
            k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
            v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
            consumer_wg = cute.arch.make_warp_uniform((tidx - 128) // 128)
            head_ratio = num_heads // mK.shape[2]
            if cutlass.const_expr(self.cfg.wg_epilogue):
                # the ping-pong token, primed once and carried across tiles (taken back at the end)
                self.pingpong_prime(consumer_wg, True)
            tile = bidx
            if cutlass.const_expr(varlen):
                # the producer's records: the tile and its sequence's bounds, sequence -1 at the end
                m_block, head, seq, off_q, len_q, len_k = sched.read_record(q_state)
                while seq >= 0:
                    n_min, n_max = self.split_blocks(m_block, len_q, len_k, varlen_blocks)
                    packed = None
                    if cutlass.const_expr(self.cfg.token_rows):
                        packed = (split_tokens, off_q)  # (the producer's record: the keys to the end)
                    # split_kv: the partial `seq` of O / LSE as a dense batch (TMA clips the rows past
                    # the item's); else the sequence's rows of the packed O, row by row
                    q_state, k_state, v_state = self.consume(
                        mO, mLSE, sQ, sK, sV, sO, tma_atom_O, tiled_mma_qk, tiled_mma_pv, pipe_q, pipe_k,
                        pipe_v, tidx - 128, m_block, head, seq if cutlass.const_expr(split) else 0, n_min,
                        n_max, len_q, len_k, scale_log2, softcap_pre, window_left, window_right, q_state,
                        k_state, v_state, pipe_o=pipe_o,
                        varlen_out=None if cutlass.const_expr(split) else (mO_rows, off_q), packed=packed)
                    m_block, head, seq, off_q, len_q, len_k = sched.read_record(q_state)
            elif cutlass.const_expr(dynamic):
                sched_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, SCHED_STAGES)
                tile = sched.read(sched_state)
                sched_state.advance()
                while tile < num_tiles:
                    m_block, head, batch = sched.coords(tile)
                    n_min, n_max = block_range(m_block)
                    q_state, k_state, v_state = self.consume(
                        mO, mLSE, sQ, sK, sV, sO, tma_atom_O, tiled_mma_qk, tiled_mma_pv, pipe_q, pipe_k,
                        pipe_v, tidx - 128, m_block, head, batch, n_min, n_max, seqlen_q, seqlen_k,
                        scale_log2, softcap_pre, window_left, window_right, q_state, k_state, v_state,
                        pipe_o=pipe_o, descales=(mQd, mKd, mVd, head_ratio), kd_ring=kd_ring)
                    tile = sched.read(sched_state)
                    sched_state.advance()
            else:
                tile = sched.first
                while tile < num_tiles:
                    m_block, head, batch = sched.coords(tile)
                    n_min, n_max = block_range(m_block)
                    q_state, k_state, v_state = self.consume(
                        mO, mLSE, sQ, sK, sV, sO, tma_atom_O, tiled_mma_qk, tiled_mma_pv, pipe_q, pipe_k,
                        pipe_v, tidx - 128, m_block, head, batch, n_min, n_max, seqlen_q, seqlen_k,
                        scale_log2, softcap_pre, window_left, window_right, q_state, k_state, v_state,
                        pipe_o=pipe_o, descales=(mQd, mKd, mVd, head_ratio), kd_ring=kd_ring)
                    tile += sched.stride
            if cutlass.const_expr(self.cfg.wg_epilogue):
                self.pingpong_finish(consumer_wg, True)
                if (tidx - 128) % 128 < 32:
                    # each warpgroup's first warp issued its own O stores
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
            else:
                if tidx < 128 + 32:
                    # the last tile's O store must finish reading smem before the CTA exits
                    cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def transpose_tiles(self, storage, sVt_layout, sV_layout, pipe_vt, pipe_v, sched, tid, block_range):
        """FP8, warps 1-3 of the producer warpgroup (`tid` 0..95): every V block of this CTA's tiles
        from sVt into sV as V^T (hopper/fp8.py), in the tile order of the producer warp and its V
        order (highest key block first)."""
        vt_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.vt_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        # each thread's addresses in the first unit of stage 0 and its PRMT selectors, once: every
        # other address is one of these XOR / plus a constant (hopper/fp8.py)
        bases = F8.lane_bases(sVt_layout, storage.sVt.data_ptr().toint(), sV_layout,
                              storage.sV.data_ptr().toint(), tid % 32)
        if cutlass.const_expr(self.row_sum):
            # the ones rows under V^T, once: fenced for the consumers' WGMMA with the first V^T they read
            runs = F8.ones_runs(sV_layout, self.hdim_v, self.cfg.row_sum_rows, self.tile_n, self.num_stages)
            F8.fill_ones_rows(runs, storage.sV.data_ptr().toint(), tid, F8.TRANSPOSER_THREADS)
        warp = cute.arch.make_warp_uniform(tid // 32)
        tile_blocks = partial(self.transpose_tile, coords=sched.coords, block_range=block_range,
                              sVt_layout=sVt_layout, sV_layout=sV_layout, bases=bases, warp=warp,
                              pipe_vt=pipe_vt, pipe_v=pipe_v)
        if cutlass.const_expr(self.cfg.dynamic_sched):
            sched_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, SCHED_STAGES)
            tile = sched.read(sched_state)
            sched_state.advance()
            while tile < sched.num_tiles:
                vt_state, v_state = tile_blocks(tile, vt_state=vt_state, v_state=v_state)
                tile = sched.read(sched_state)
                sched_state.advance()
        else:
            tile = sched.first
            while tile < sched.num_tiles:
                vt_state, v_state = tile_blocks(tile, vt_state=vt_state, v_state=v_state)
                tile += sched.stride

    @cute.jit
    def transpose_tile(self, tile, coords, block_range, sVt_layout, sV_layout, bases, warp, pipe_vt, pipe_v,
                       vt_state, v_state):
        """Every V block of one tile, in the producer's order; returns the advanced states."""
        m_block, _, _ = coords(tile)
        n_min, n_max = block_range(m_block)
        for _ in cutlass.range(cutlass.max(n_max - n_min, 0), unroll=1):
            self.transpose_block(sVt_layout, sV_layout, bases, warp, pipe_vt, pipe_v, vt_state, v_state)
            vt_state.advance()
            v_state.advance()
        return vt_state, v_state

    @cute.jit
    def transpose_block(self, sVt_layout, sV_layout, bases, warp, pipe_vt, pipe_v, vt_state, v_state):
        """One V block: wait for its TMA load and for a free V stage, write V^T, fence the writes
        for the consumers' WGMMA (async proxy), hand the stage over, free the sVt stage."""
        pipe_vt.consumer_wait(vt_state)
        pipe_v.producer_acquire(v_state)
        F8.transpose_stage(sVt_layout, sV_layout, bases, vt_state.index, v_state.index, warp, self.tile_n,
                           self.hdim_v, F8.units_per_batch(self.cfg.producer_regs))
        # generic-proxy writes read by WGMMA (async proxy): the proxy fence, then the arrive (hopper/fp8.py)
        cute.arch.fence_proxy("async.shared", space="cta")
        pipe_v.producer_commit(v_state)
        cute.arch.sync_warp()  # every lane's reads of sVt are done before lane 0 frees it
        pipe_vt.consumer_release(vt_state)

    @cute.jit
    def seq_bounds(self, batch, mCuQ, mCuK, mUsedQ, mUsedK):
        """Varlen: sequence `batch`'s (query offset, used query length, key offset, used key length)
        in the packed tensors."""
        off_q, off_k = mCuQ[batch], mCuK[batch]
        return off_q, mUsedQ[batch], off_k, mUsedK[batch]

    def split_blocks(self, m_block, rows, keys, varlen_blocks):
        """The varlen walk's key blocks [n_min, n_max) of a tile (producer and consumers alike), `keys` of
        them. With token_rows (split_kv, causal over packed tokens) every key of a split is seen by its last
        token's rows: all of them. Plain Python, called while tracing."""
        if cutlass.const_expr(self.cfg.token_rows):
            return Int32(0), (keys + self.tile_n - 1) // self.tile_n
        return varlen_blocks(m_block, seqlen_q=rows, seqlen_k=keys)

    @cute.jit
    def split_keys(self, item, split, chunk, mUsedK, new_keys, mStarts, key_rows):
        """split_kv, producer warp: (where split `split` of item `item`'s keys start, how many): the item's
        keys from row (paged: table entry) item * key_rows, or mStarts[item] where key_rows is 0, its
        mUsedK[item] + new_keys of them; the split's positions [split * chunk, min((split + 1) * chunk,
        that)), moved by as many rows (paged: whole pages). host.split_keys is its twin."""
        first = item * key_rows
        if key_rows == 0:
            first = mStarts[item]
        lo = split * chunk
        count = cutlass.min(cutlass.max(mUsedK[item] + new_keys - lo, 0), chunk)
        if cutlass.const_expr(self.cfg.page_size):
            lo = lo // self.cfg.page_size
        return first + lo, count

    @cute.jit
    def produce(self, mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V,
                pipe_q, pipe_k, pipe_v, m_block, head, head_kv, batch, n_min, n_max,
                q_state, k_state, v_state, rank=0, pipe_o=None, offsets=None, pages=None, kd=None,
                kv_batch=None):
        """One tile's loads: Q, and K / V block by block. `kd` (per-token FP8 descales): (mKd, sKd,
        pipe_kd), each K block's k descales staged in sKd's stage of the same index
        (hopper/fp8_descale.py). `offsets`: varlen, (Q's, K's) rows of this sequence in the packed tensors
        (Q's None: split_kv, Q's batch its item); `kv_batch`: K / V's batch where it is not Q's."""
        mQ_t = mQ[None, None, head, batch]
        kv_b = batch if cutlass.const_expr(kv_batch is None) else kv_batch
        mK_t, mV_t = mK[None, None, head_kv, kv_b], mV[None, None, head_kv, kv_b]
        if cutlass.const_expr(offsets is not None):  # varlen: this sequence's rows of the packed tensors
            if cutlass.const_expr(offsets[0] is not None):
                mQ_t = cute.domain_offset((offsets[0], 0), mQ_t)
            if cutlass.const_expr(pages is None):  # (paged: K / V rows come from the page table)
                mK_t = cute.domain_offset((offsets[1], 0), mK_t)
                mV_t = cute.domain_offset((offsets[1], 0), mV_t)
        gQ = cute.local_tile(mQ_t, (self.tile_m, self.hdim), (m_block, 0))
        if cutlass.const_expr(pages is not None):
            tQsQ, tQgQ = cpasync.tma_partition(
                tma_atom_Q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
            load_k, load_v = self.paged_loads(mK_t, mV_t, sK, sV, tma_atom_K, tma_atom_V, pipe_k, pipe_v,
                                              pages)
        else:
            gK = cute.local_tile(mK_t, (self.tile_n, self.hdim), (None, 0))
            if cutlass.const_expr(self.cfg.vt_in_gmem):  # V^T: (head dim, keys) tiles, key block last
                gV = cute.local_tile(mV_t, (self.hdim_v, self.tile_n), (0, None))
            else:
                gV = cute.local_tile(mV_t, (self.tile_n, self.hdim_v), (None, 0))
            no_cluster = cute.make_layout(1)
            # K/V: with a cluster, this CTA's slice of each tile (rank of cluster_m), multicast
            kv_cluster = no_cluster
            if cutlass.const_expr(self.cluster_m > 1):
                kv_cluster = cute.make_layout(self.cluster_m)
            tQsQ, tQgQ = cpasync.tma_partition(
                tma_atom_Q, 0, no_cluster, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
            tKsK, tKgK = cpasync.tma_partition(
                tma_atom_K, rank, kv_cluster, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
            tVsV, tVgV = cpasync.tma_partition(
                tma_atom_V, rank, kv_cluster, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
            load_k = partial(self.load_stage, tma_atom_K, tKgK, tKsK, pipe_k)
            load_v = partial(self.load_stage, tma_atom_V, tVgV, tVsV, pipe_v)

        # K of block n goes out before V of block n+1: the consumers need K(n) first (QK^T of
        # block n is issued before P @ V of block n+1), so V never holds K back. The first K
        # goes before Q: Q waits for the previous tile to free its buffer, K need not.
        # (states advance here, not inside load_stage: the tracer only threads loop-carried
        # values rebound in the loop body itself)
        tile_count = q_state.count  # tiles this CTA has produced before this one
        if cutlass.const_expr(kd is not None):
            # per-token k descales: read before each K load (under its stage wait), staged after it and
            # after the next load (Q's, or V's below), so that no TMA issue waits for them
            mKd_t, seqlen_k = kd[0][batch, head_kv, None], mK.shape[0]
            fetch_kd = partial(KD.fetch_k_descales, mKd_t, seqlen_k=seqlen_k, tile_n=self.tile_n)
            stage_kd = partial(self.stage_k_descales, sKd=kd[1], pipe_kd=kd[2])
            kd_vals, kd_stage, kd_phase = fetch_kd(n_max - 1), k_state.index, k_state.phase
        if n_max > n_min:
            load_k(n_max - 1, k_state)
            k_state.advance()
        pipe_q.producer_acquire(q_state)
        if cutlass.const_expr(self.cfg.q_stages > 1):
            cute.copy(tma_atom_Q, tQgQ, tQsQ[None, q_state.index],
                      tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
        else:
            cute.copy(tma_atom_Q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
        q_state.advance()
        if cutlass.const_expr(kd is not None):
            if n_max > n_min:
                stage_kd(kd_vals, kd_stage, kd_phase)
        if cutlass.const_expr(self.cfg.o_in_v_ring):
            # the same order; the tile's first V load (first two with o_v_stages) waits until the last
            # tile's O is out of the stage it goes to, and a tile with fewer V loads than that still
            # takes its hand-offs, so that each is taken once per tile
            num_blocks = n_max - n_min
            for i in cutlass.range(num_blocks, unroll=1):
                if i < num_blocks - 1:
                    load_k(n_max - 2 - i, k_state)
                    k_state.advance()
                if i < self.o_stages:
                    self.wait_o_read(pipe_o, tile_count, v_state.index)
                load_v(n_max - 1 - i, v_state)
                v_state.advance()
            for j in cutlass.range_constexpr(self.o_stages):
                if j >= num_blocks:  # the stage the j-th V load would have gone to
                    self.wait_o_read(pipe_o, tile_count, (v_state.index + j - num_blocks) % self.num_stages)
        else:
            if n_max > n_min:
                for i in cutlass.range(n_max - n_min - 1, unroll=1):
                    if cutlass.const_expr(kd is not None):  # (names of the body's own: not loop-carried)
                        block_kd = fetch_kd(n_max - 2 - i)
                        block_stage, block_phase = k_state.index, k_state.phase
                    load_k(n_max - 2 - i, k_state)
                    k_state.advance()
                    load_v(n_max - 1 - i, v_state)
                    v_state.advance()
                    if cutlass.const_expr(kd is not None):
                        stage_kd(block_kd, block_stage, block_phase)
                load_v(n_min, v_state)
                v_state.advance()
        return q_state, k_state, v_state

    @cute.jit
    def stage_k_descales(self, vals, stage, phase, sKd, pipe_kd):
        """Producer warp: a K block's k descales (KD.fetch_k_descales' values) into the ring's stage
        `stage` (K's stage and producer phase, its K load issued) once every consumer thread has read
        what the stage held, then every lane arrives on its full barrier."""
        state = pipeline.PipelineState(self.num_stages, Int32(0), stage, phase)
        pipe_kd.producer_acquire(state)
        KD.stage_k_descales(vals, sKd, stage, self.tile_n)
        pipe_kd.producer_commit(state)

    # O staged in sV (FwdConfig.o_in_v): one hand-off per tile, every tile (also those with no key
    # block, which still stage their zeros in sV), so tile t's state follows from t's parity.
    # It is a two-way hand-off: the storing threads of tile t + 1 acquire the stage the producer
    # released for tile t, so they can never complete a phase the producer has not waited for.
    def o_read_state(self, tile_parity, stage, producer: cutlass.Constexpr[bool]):
        """pipe_o's state for V stage `stage` (0 without o_v_stages) in a tile of this CTA whose
        number has parity `tile_parity`: each stage's phase flips per tile; a producer state starts
        at phase 1."""
        phase = tile_parity
        if cutlass.const_expr(producer):
            phase = 1 - phase
        index = stage if cutlass.const_expr(self.cfg.o_per_stage) else Int32(0)
        return pipeline.PipelineState(self.o_stages, Int32(0), index, phase)

    @cute.jit
    def wait_o_read(self, pipe_o, tile_count, stage):
        """Producer warp: the previous tile's O stores have read V stage `stage` (sV without
        o_v_stages); nothing to wait for before the first tile."""
        if tile_count > 0:
            state = self.o_read_state((tile_count - 1) % 2, stage, producer=False)
            pipe_o.consumer_wait(state)
            if cute.arch.lane_idx() == 0:
                pipe_o.consumer_release(state)

    @cute.jit
    def signal_o_read(self, pipe_o, tile_parity, stage):
        """One thread per O part: this tile's part has been read out of sV (out of V stage `stage`
        with o_v_stages)."""
        state = self.o_read_state(tile_parity, stage, producer=True)
        pipe_o.producer_acquire(state)
        pipe_o.producer_commit(state)

    @cute.jit
    def load_stage(self, tma_atom, tXgX, tXsX, pipe, n_block, state):
        pipe.producer_acquire(state)
        if cutlass.const_expr(self.cluster_m > 1):
            cute.copy(tma_atom, tXgX[None, n_block], tXsX[None, state.index],
                      tma_bar_ptr=pipe.producer_get_barrier(state), mcast_mask=C.mcast_mask(self.cluster_m))
        else:
            cute.copy(tma_atom, tXgX[None, n_block], tXsX[None, state.index],
                      tma_bar_ptr=pipe.producer_get_barrier(state))

    def paged_loads(self, mK_t, mV_t, sK, sV, tma_atom_K, tma_atom_V, pipe_k, pipe_v, pages):
        """Paged K / V (FwdConfig.page_size): load_k, load_v of this tile's sequence, each (n_block,
        state) as load_stage's. The cache's rows (mK_t, mV_t: this KV head's) in boxes of whole pages or
        of one key block inside a page (paged_box_count); each stage's smem split into as many boxes."""
        _, box_rows = paged_box_count(self.tile_n, self.cfg.page_size)
        no_cluster = cute.make_layout(1)

        def partition(atom, mX_t, sX, d):
            gX = cute.local_tile(mX_t, (box_rows, d), (None, 0))  # (rows, d, row blocks of one box)
            sX_boxes = cute.flat_divide(sX, (box_rows, d))  # (rows, d, boxes, 1, stages)
            return cpasync.tma_partition(atom, 0, no_cluster, cute.group_modes(sX_boxes, 0, 2),
                                         cute.group_modes(gX, 0, 2))

        tKsK, tKgK = partition(tma_atom_K, mK_t, sK, self.hdim)
        tVsV, tVgV = partition(tma_atom_V, mV_t, sV, self.hdim_v)
        load_k = partial(self.load_stage_paged, tma_atom_K, tKgK, tKsK, pipe_k, pages=pages)
        load_v = partial(self.load_stage_paged, tma_atom_V, tVgV, tVsV, pipe_v, pages=pages)
        return load_k, load_v

    @cute.jit
    def page_row(self, mPageTable, page_start, position, used_k):
        """The paged cache's row that key `position` of a sequence (pages from flat entry `page_start`
        on, `used_k` keys) is read from; past the used keys, a row of the last used page (the entry
        past it may be anything). host.paged_row is its Python twin."""
        page_size = self.cfg.page_size
        entry = page_start + cutlass.min(position, used_k - 1) // page_size
        return mPageTable[entry] * page_size + position % page_size

    @cute.jit
    def load_stage_paged(self, tma_atom, tXgX, tXsX, pipe, n_block, state, pages):
        """load_stage from a paged cache: the key block's boxes (host.paged_block_rows) into
        consecutive row slices of the stage, all on the stage's one full barrier, whose expected bytes
        are the whole tile's. With several boxes lane j reads box j's table entry (one load for the
        block) and each box's row reaches the issuing lane by a shuffle: the producer's few registers
        hold one row, not one per box."""
        mPageTable, page_start, used_k = pages
        boxes, box_rows = paged_box_count(self.tile_n, self.cfg.page_size)
        first = n_block * self.tile_n
        if cutlass.const_expr(boxes > 1):
            lane_box = cutlass.min(cute.arch.lane_idx(), boxes - 1)
            first = first + lane_box * box_rows
        # the box's row in units of boxes (gX's tile index): a row is a multiple of box_rows
        box = self.page_row(mPageTable, page_start, first, used_k) // box_rows
        pipe.producer_acquire(state)
        if cutlass.const_expr(boxes > 1):
            # a loop, not unrolled: unrolled, the boxes' TMA operands fill the uniform registers and
            # the producer's 24 registers spill
            for j in cutlass.range(boxes, unroll=1):
                cute.copy(tma_atom, tXgX[None, cute.arch.shuffle_sync(box, j)], tXsX[None, j, 0, state.index],
                          tma_bar_ptr=pipe.producer_get_barrier(state))
        else:
            cute.copy(tma_atom, tXgX[None, box], tXsX[None, 0, 0, state.index],
                      tma_bar_ptr=pipe.producer_get_barrier(state))

    @cute.jit
    def consume(self, mO, mLSE, sQ, sK, sV, sO, tma_atom_O, tiled_mma_qk, tiled_mma_pv,
                pipe_q, pipe_k, pipe_v, tidx, m_block, head, batch, n_min, n_max,
                seqlen_q, seqlen_k, scale_log2, softcap_pre, window_left, window_right,
                q_state, k_state, v_state, pipe_o=None, descales=None, varlen_out=None, kd_ring=None,
                packed=None):
        """One tile. `packed` (FwdConfig.token_rows): (tokens, the keys from this split's start to the item's
        end): the mask's rows are the tokens (M.apply_mask), its diagonal at the item's end; seqlen_k is the
        split's keys (the walk's, the ragged end's)."""
        wg = cute.arch.make_warp_uniform(tidx // 128)
        v_descale = None
        if cutlass.const_expr(self.fp8):
            # FP8: S = (Q K^T in e4m3 units) * q_descale * k_descale, folded into the score scale
            # (before tanh with softcap); V's descale multiplies 1 / l at the end
            mQd, mKd, mVd, head_ratio = descales
            head_kv = head // head_ratio
            if cutlass.const_expr(not self.token):  # per-token q / k descales: below (hopper/fp8_descale.py)
                qk_descale = mQd[batch, head_kv] * mKd[batch, head_kv]
                v_descale = mVd[batch, head_kv]
                if cutlass.const_expr(self.has_softcap):
                    softcap_pre = softcap_pre * qk_descale
                else:
                    scale_log2 = scale_log2 * qk_descale
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        wg_mma_qk = tiled_mma_qk.get_slice(wg * 128)
        wg_mma_pv = tiled_mma_pv.get_slice(wg * 128)
        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
        if cutlass.const_expr(self.cfg.q_stages > 1):
            tSrQ = tSrQ[None, None, None, q_state.index]
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
        # P @ V's B operand (N = head dim, K = keys): V read as V^T, or (FP8) sV holds V^T
        tOrV = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sV if self.fp8 else L.transpose_view(sV)))

        acc_S = cute.make_rmem_tensor(tiled_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        acc_O = cute.make_rmem_tensor(tiled_mma_pv.partition_shape_C((self.tile_m, self.pv_n)), Float32)
        if cutlass.const_expr(self.fp8):
            p_shape = tiled_mma_pv.partition_shape_A((self.tile_m, self.tile_n))
            tOrP = cute.make_rmem_tensor(p_shape, self.dtype)
        else:
            tOrP = cute.make_rmem_tensor(L.acc_layout_as_operand_a(acc_S.layout), self.dtype)
        acc_S_rc = L.acc_rows_cols(acc_S)
        acc_O_rc = L.acc_rows_cols(acc_O)
        cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
        coord_rc = L.acc_rows_cols(thr_mma_qk.partition_C(cS))
        # thread 0's coordinates, known at compile time (the mask compares against them)
        coord0_rc = L.acc_rows_cols(tiled_mma_qk.get_slice(0).partition_C(cS))

        num_rows = cute.size(acc_S_rc, mode=[0])
        row_pre, load_kd = None, None
        if cutlass.const_expr(self.token):
            # q's descales folded into a per-row scale (softcap: tanh's argument; else the softmax's).
            # The rows from an opaque tidx: else the row index is kept from here to the LSE store (one
            # register through the mainloop: hdim 128 spilled)
            coord_q = L.acc_rows_cols(tiled_mma_qk.get_slice(_opaque(tidx)).partition_C(cS))
            qd = KD.load_q_descales(mQd[batch, head, None], coord_q, m_block, seqlen_q, self.tile_m)
            rows = KD.scaled_rows(qd, softcap_pre if self.has_softcap else scale_log2)
            if cutlass.const_expr(self.has_softcap):
                row_pre = rows
            else:
                scale_log2 = rows
            load_kd = partial(self.k_descales, acc_S_rc=acc_S_rc, kd_ring=kd_ring)
        softmax = S.OnlineSoftmax(num_rows, scale_log2, shift=self.p_shift, sums=not self.row_sum)
        softmax.reset()
        acc_O.fill(0.0)

        pipe_q.consumer_wait(q_state)

        # the mask's bounds: the tile's (block m_block of seqlen_q rows over seqlen_k keys), or with packed
        # tokens, rows folded onto the tokens (block 0 for the runs: every tile holds token 0 .. tokens - 1)
        mask_bounds = (m_block, seqlen_q, seqlen_k)
        mask_rows = {}
        if cutlass.const_expr(packed is not None):
            mask_bounds = (Int32(0), packed[0], packed[1])
            mask_rows = {"tokens": packed[0], "keys": seqlen_k}
        to_probs = partial(
            self.scores_to_probs, acc_S=acc_S, acc_S_rc=acc_S_rc, coord_rc=coord_rc, coord0_rc=coord0_rc,
            softmax=softmax, m_block=m_block, seqlen_q=mask_bounds[1], seqlen_k=mask_bounds[2],
            window_left=window_left, window_right=window_right, softcap_pre=softcap_pre, row_pre=row_pre,
            load_kd=load_kd, **mask_rows,
        )
        lazy = None
        if cutlass.const_expr(self.cfg.lazy_max_active):
            # the lazy steps' P (fp32, converted as it goes) and a second P @ V operand: lazy steps go
            # in pairs, each writing the operand the other's P @ V reads, so no P @ V in flight has
            # its registers written; S stays in acc_S for the exact redo
            acc_P = cute.make_rmem_tensor(acc_S.layout, Float32)
            tOrP_alt = cute.make_rmem_tensor(tOrP.layout, self.dtype)
            block_sum = cute.make_rmem_tensor(num_rows, Float32)
            lazy = (partial(self.lazy_probs, acc_S=acc_S, acc_S_rc=acc_S_rc, acc_P=acc_P, softmax=softmax,
                            block_sum=block_sum),
                    partial(self.lazy_settle, acc_S=acc_S, acc_S_rc=acc_S_rc, acc_O_rc=acc_O_rc,
                            softmax=softmax, block_sum=block_sum),
                    block_sum,
                    partial(self.issue_gemm, tiled_mma_pv, acc_O, tCrB=tOrV, zero_init=False),
                    tOrP_alt)
        issue_qk = partial(self.issue_gemm, tiled_mma_qk, acc_S, tSrQ, tSrK, zero_init=True)
        if cutlass.const_expr(self.cfg.pv_two_level):
            # each block's P @ V into a fresh accumulator, added into O after its wait (TwoLevelO)
            acc_Ob = cute.make_rmem_tensor(acc_O.layout, Float32)
            issue_pv = partial(self.issue_gemm, tiled_mma_pv, acc_Ob, tOrP, tOrV, zero_init=True)
            two_level = TwoLevelO(acc_O_rc, L.acc_rows_cols(acc_Ob), softmax.row_scale, num_rows)
        else:
            issue_pv = partial(self.issue_gemm, tiled_mma_pv, acc_O, tOrP, tOrV, zero_init=False)
            two_level = None
        loop = partial(self.mainloop, lazy=lazy, pipe_q=pipe_q, pipe_k=pipe_k, pipe_v=pipe_v,
                       issue_qk=issue_qk, issue_pv=issue_pv, to_probs=to_probs, acc_S=acc_S,
                       acc_O_rc=acc_O_rc, tOrP=tOrP, two_level=two_level,
                       softmax=softmax, wg=wg, m_block=m_block, n_min=n_min,
                       n_max=n_max, seqlen_q=seqlen_q, seqlen_k=seqlen_k, window_left=window_left,
                       window_right=window_right, q_state=q_state, sV=sV if self.cfg.varlen else None,
                       tidx=tidx, pipe_kd=kd_ring[1] if self.token else None, mask_bounds=mask_bounds)
        if cutlass.const_expr(self.cfg.skip_idle_wg):
            # warp-uniform: every row of this warpgroup lies past the end of the queries
            idle_wg = m_block * self.tile_m + wg * 64 >= seqlen_q
            if idle_wg:
                k_state, v_state = loop(k_state=k_state, v_state=v_state, idle=True)
            else:
                k_state, v_state = loop(k_state=k_state, v_state=v_state, idle=False)
        else:
            k_state, v_state = loop(k_state=k_state, v_state=v_state, idle=False)

        if cutlass.const_expr(self.token):
            # read after the mainloop: held through it (or read before the last P @ V) it was one register
            # too many (hdim 256 spilled)
            v_descale = mVd[batch, head_kv]
        lse = cute.make_rmem_tensor(num_rows, Float32)
        sO_wg, signal_o, wait_v_free = sO, None, None
        if cutlass.const_expr(self.cfg.o_in_v_ring):
            sO_wg, signal_o, wait_v_free = self.o_in_v_staging(sO, pipe_v, pipe_o, q_state, v_state, wg,
                                                               n_min, n_max)
        coord_lse = coord_rc
        if cutlass.const_expr(self.token or self.defers_row_scale):
            # the rows computed here, per tile (as coord_q, above): held through the mainloop they were
            # one register too many (the per-token kernels; hdim 128's deferred row scale: 8 bytes spilled)
            coord_lse = L.acc_rows_cols(tiled_mma_qk.get_slice(_opaque(tidx)).partition_C(cS))
        tiled_mma_o, totals = tiled_mma_pv, None
        if cutlass.const_expr(self.row_sum):
            # the epilogue's O: the accumulator's first hdim_v columns (its first registers, in the order of a
            # head-dim-wide MMA's fragment); each row's sum sits in the first ones column, in every thread
            # of the row's quad (column hdim_v + 2 * (lane % 4): all ones rows)
            tiled_mma_o = self.make_mma_pv(self.num_consumer_wg, self.hdim_v)
            acc_O = cute.make_tensor(acc_O.iterator, cute.make_layout(
                tiled_mma_o.partition_shape_C((self.tile_m, self.hdim_v))))
            sum_col, acc_rc = self.hdim_v // 4, acc_O_rc
            totals = lambda r: acc_rc[r, sum_col]  # noqa: E731
            acc_O_rc = L.acc_rows_cols(acc_O)
        epilogue = partial(self.finish_tile, acc_O, acc_O_rc, lse, softmax, coord_lse, mO, mLSE, sO_wg,
                           tma_atom_O, tiled_mma_o, tidx, m_block, head, batch, seqlen_q, signal_o=signal_o,
                           before_smem=wait_v_free, v_descale=v_descale, varlen_out=varlen_out, totals=totals)
        if cutlass.const_expr(self.cfg.skip_idle_wg and self.cfg.wg_epilogue):
            # an idle warpgroup has no rows to store, and its own barrier and store part to skip
            # (the shared epilogue's barrier counts every consumer: there it stores its clipped rows)
            if not idle_wg:
                epilogue()
            elif cutlass.const_expr(self.cfg.o_in_v_ring):
                if tidx % 128 == 0:  # its part of the hand-off, with nothing to store
                    signal_o()
        else:
            epilogue()
        if cutlass.const_expr(self.cfg.o_in_q_buffer):
            pipe_q.consumer_release(q_state)  # O has been read out of Q's buffer
        q_state.advance()
        return q_state, k_state, v_state

    @cute.jit
    def o_in_v_staging(self, sO, pipe_v, pipe_o, q_state, v_state, wg, n_min, n_max):
        """With O in V's ring: this warpgroup's O buffer, its part of the O-read hand-off to the
        producer (`signal_o`), and with o_v_stages the wait before O may be written (`wait_v_free`,
        else None). Called after the tile's last P @ V."""
        # this tile's number mod 2, from Q's consumer state (already live, where the count is not:
        # one register more spilled at hdim 64): its phase with one Q stage, its index with two
        parity = q_state.phase if cutlass.const_expr(self.cfg.q_stages == 1) else q_state.index
        sO_wg, o_stage, wait_v_free = sO, Int32(0), None
        if cutlass.const_expr(self.cfg.o_per_stage):
            # warpgroup w's part goes to V stage (v + w) % 2, v the next tile's first V stage
            # (v_state has moved past this tile's last block). That stage held V(last - 1) for
            # warpgroup 0, V(last) for warpgroup 1: wait until every consumer released it. After
            # a one-block tile warpgroup 0's stage was not reloaded since the other warpgroup
            # staged its last part there, which only a meeting of both ensures has been read.
            o_stage = (v_state.index + wg) % 2
            if n_max - n_min == 1:
                cute.arch.barrier(barrier_id=FwdBarrier.EPILOGUE, number_of_threads=self.num_consumer_threads)
            sO_wg = sO[None, None, o_stage]
            # the stage's last fill: one ring turn back for warpgroup 0, one step for warpgroup 1
            # (in phase with v only when v is 1)
            v_parity = v_state.phase
            if not (v_state.index == 1 and wg == 1):
                v_parity = 1 - v_parity
            wait_v_free = partial(pipe_v.sync_object_empty.wait, o_stage, v_parity)
        elif cutlass.const_expr(self.cfg.wg_epilogue):
            # O's rows land on the last V stage, which another warpgroup's last P @ V may still
            # read (the shared epilogue's barrier already counts every consumer)
            cute.arch.barrier(barrier_id=FwdBarrier.EPILOGUE, number_of_threads=self.num_consumer_threads)
        return sO_wg, partial(self.signal_o_read, pipe_o, parity, o_stage), wait_v_free

    @cute.jit
    def finish_tile(self, acc_O, acc_O_rc, lse, softmax, coord_rc, mO, mLSE, sO, tma_atom_O, tiled_mma_pv,
                    tidx, m_block, head, batch, seqlen_q, signal_o=None, before_smem=None, v_descale=None,
                    varlen_out=None, totals=None):
        softmax.finalize(lse, out_scale=v_descale, totals=totals)
        softmax.rescale(acc_O_rc)
        self.epilogue(acc_O, lse, coord_rc, mO, mLSE, sO, tma_atom_O, tiled_mma_pv, tidx,
                      m_block, head, batch, seqlen_q, signal_o=signal_o, before_smem=before_smem,
                      varlen_out=varlen_out)

    @cute.jit
    def mainloop(self, pipe_q, pipe_k, pipe_v, issue_qk, issue_pv, to_probs, acc_S, acc_O_rc, tOrP,
                 softmax, wg, m_block, n_min, n_max, seqlen_q, seqlen_k, window_left,
                 window_right, q_state, k_state, v_state, idle: cutlass.Constexpr[bool], lazy=None, sV=None,
                 tidx=None, two_level=None, pipe_kd=None, mask_bounds=None):
        """Every key block of the tile, highest first. `idle` (FwdConfig.skip_idle_wg): the same
        walk with only the waits, releases and ping-pong barriers, no GEMM and no softmax (per-token
        FP8: `pipe_kd`, the k-descale ring, released with K, its descales unread)."""
        if cutlass.const_expr(idle):
            step = partial(self.step_idle, pipe_k=pipe_k, pipe_v=pipe_v, wg=wg, pipe_kd=pipe_kd)
        elif cutlass.const_expr(self.cfg.intra_wg_overlap):
            step = partial(self.step_overlap, lazy=lazy, pipe_k=pipe_k, pipe_v=pipe_v,
                           issue_qk=issue_qk, issue_pv=issue_pv, to_probs=to_probs, acc_S=acc_S,
                           acc_O_rc=acc_O_rc, tOrP=tOrP, softmax=softmax, wg=wg, two_level=two_level)
        else:
            step = partial(self.step_serial, pipe_k=pipe_k, pipe_v=pipe_v, issue_qk=issue_qk,
                           issue_pv=issue_pv, to_probs=to_probs, acc_S=acc_S, acc_O_rc=acc_O_rc,
                           tOrP=tOrP, softmax=softmax, wg=wg, two_level=two_level)
        # The first (highest) block carries the ragged seqlen_k end and the diagonal: it is
        # always fully masked. With intra-warpgroup overlap it is peeled: its QK^T and softmax
        # run alone, its P @ V is issued in the next step.
        num_blocks = n_max - n_min
        if cutlass.const_expr(self.cfg.intra_wg_overlap):
            if num_blocks > 0:
                pipe_k.consumer_wait(k_state)
                if cutlass.const_expr(not idle):
                    issue_qk(k_state.index)
                    warpgroup.wait_group(0)
                if cutlass.const_expr(self.token):  # K's stage released once its k descales are read
                    if cutlass.const_expr(not idle):
                        to_probs(n_block=n_max - 1, is_first=True, mask=True, mask_seqlen=True,
                                 k_state=k_state)
                        acc_to_operand_a(acc_S, tOrP)
                    else:
                        self.release_kd_unread(pipe_kd, k_state)
                    pipe_k.consumer_release(k_state)
                    k_state.advance()
                else:
                    pipe_k.consumer_release(k_state)
                    k_state.advance()
                    if cutlass.const_expr(not idle):
                        to_probs(n_block=n_max - 1, is_first=True, mask=True, mask_seqlen=True)
                        acc_to_operand_a(acc_S, tOrP)
                if cutlass.const_expr(sV is not None):  # varlen (idle warpgroups too: they arrive)
                    self.zero_v_past_keys(pipe_v, v_state, sV, seqlen_k - (n_max - 1) * self.tile_n, tidx,
                                          idle)
        n_top = n_max - 1 if cutlass.const_expr(self.cfg.intra_wg_overlap) else n_max
        # decided once: the serial path moves n_top below, and a prime without its finish leaves
        # a hand-off pending that deadlocks the next persistent tile (1-block causal tiles)
        pingpong_active = n_top > n_min
        if cutlass.const_expr(not self.cfg.wg_epilogue):
            self.pingpong_prime(wg, pingpong_active)
        if cutlass.const_expr(not self.cfg.intra_wg_overlap):
            if num_blocks > 0:
                step(n_block=n_max - 1, k_state=k_state, v_state=v_state, mask=True, mask_seqlen=True)
                k_state.advance()
                v_state.advance()
                n_top = n_max - 1

        # Remaining blocks, highest first, in three runs so that no runtime branch sits between
        # a WGMMA issue and its wait (ptxas would serialize the pipeline there):
        # blocks crossing the causal/right-window edge, mask-free blocks, left-window blocks.
        # (mask_bounds: the mask's block, rows and keys: the tile's, or packed tokens' (consume))
        mask_m, mask_rows, mask_keys = mask_bounds
        n_lo_right, n_hi_left = self.blocks.n_mask_runs(mask_m, n_min, n_top, mask_rows, mask_keys,
                                                        window_left, window_right)
        count_right = cutlass.max(n_top - n_lo_right, 0)
        if cutlass.const_expr(self.has_right):
            for i in cutlass.range(count_right, unroll=1):
                step(n_block=n_top - 1 - i, k_state=k_state, v_state=v_state, mask=True, mask_seqlen=False)
                k_state.advance()
                v_state.advance()
        n_cur = n_top - count_right
        count_free = cutlass.max(n_cur - n_hi_left, 0)
        if cutlass.const_expr(lazy is not None and not idle):
            # an odd block first, exact (it reads and writes tOrP), then pairs of lazy steps: the
            # first reads tOrP and writes the other operand, the second the other way round
            odd = count_free % 2
            for i in cutlass.range(odd, unroll=1):
                step(n_block=n_cur - 1 - i, k_state=k_state, v_state=v_state, mask=False, mask_seqlen=False)
                k_state.advance()
                v_state.advance()
            for i in cutlass.range(count_free // 2, unroll=1):
                n_pair = n_cur - 1 - odd - 2 * i
                step(n_block=n_pair, k_state=k_state, v_state=v_state, mask=False, mask_seqlen=False,
                     p_cur=tOrP, p_next=lazy[4])
                k_state.advance()
                v_state.advance()
                step(n_block=n_pair - 1, k_state=k_state, v_state=v_state, mask=False, mask_seqlen=False,
                     p_cur=lazy[4], p_next=tOrP)
                k_state.advance()
                v_state.advance()
        else:
            # two-level O with overlap: the mask-free steps defer their row scale into the next block's
            # add (TwoLevelO); the masked ones keep the FMUL, whose registers the mask code needs
            defer = self.defers_row_scale and not idle
            step_free = step
            if cutlass.const_expr(defer):
                two_level.start_deferring()
                step_free = partial(step, defer=True)
            for i in cutlass.range(count_free, unroll=1):
                step_free(n_block=n_cur - 1 - i, k_state=k_state, v_state=v_state, mask=False,
                          mask_seqlen=False)
                k_state.advance()
                v_state.advance()
            if cutlass.const_expr(defer and self.has_left):
                two_level.settle()
        n_cur = n_cur - count_free
        if cutlass.const_expr(self.has_left):
            for i in cutlass.range(n_cur - n_min, unroll=1):
                step(n_block=n_cur - 1 - i, k_state=k_state, v_state=v_state, mask=True, mask_seqlen=False)
                k_state.advance()
                v_state.advance()
        if cutlass.const_expr(not self.cfg.wg_epilogue):
            self.pingpong_finish(wg, pingpong_active)

        if cutlass.const_expr(not self.cfg.o_in_q_buffer):
            # every QK^T of this tile is complete: the producer may bring the next tile's Q now,
            # under the last P @ V and the epilogue
            pipe_q.consumer_release(q_state)
        if cutlass.const_expr(self.cfg.intra_wg_overlap):
            if num_blocks > 0:
                if cutlass.const_expr(self.cfg.rescale_o_before_pv and not idle):
                    # the last block's row scale (the last step left it for the next one)
                    softmax.rescale(acc_O_rc)
                pipe_v.consumer_wait(v_state)
                if cutlass.const_expr(not idle):
                    issue_pv(v_state.index)
                    warpgroup.wait_group(0)
                    if cutlass.const_expr(two_level is not None):
                        # the mask-free run's last row scale, still pending unless a left run followed
                        two_level.add(deferred=self.defers_row_scale and not self.has_left)
                pipe_v.consumer_release(v_state)
                v_state.advance()
        return k_state, v_state

    @cute.jit
    def zero_v_past_keys(self, pipe_v, v_state, sV, keys_left, tidx, idle: cutlass.Constexpr[bool]):
        """Varlen, the highest key block: V's rows past the sequence's keys (the next sequence's, or
        what lies past seqused_k) get probability 0, but 0 x NaN is NaN in P @ V. The consumers zero
        them in smem (each thread its share), fence the writes for the WGMMAs (async proxy) and meet
        before the block's first P @ V; ping-pong has not started yet (the peeled block). An idle
        warpgroup reads no V: it only arrives (its stores released to the waiting ones), so the
        barrier has one waiting site. It cannot arrive again for the next tile before the waiting
        warpgroups have passed: that tile's Q needs this one's Q released (one Q stage: varlen refuses
        q_stages 2, FwdConfig._check_varlen), which they do after the barrier."""
        if keys_left < self.tile_n:
            pipe_v.consumer_wait(v_state)  # waited again, at no cost, where P @ V is issued
            L.zero_rows_from((sV[None, None, v_state.index],), keys_left, _opaque(tidx),
                             self.num_consumer_threads)
            if cutlass.const_expr(idle):
                cute.arch.barrier_arrive(barrier_id=FwdBarrier.V_ZERO,
                                         number_of_threads=self.num_consumer_threads)
            else:
                cute.arch.barrier(barrier_id=FwdBarrier.V_ZERO, number_of_threads=self.num_consumer_threads)

    @cute.jit
    def step_idle(self, n_block, k_state, v_state, mask: cutlass.Constexpr[bool],
                  mask_seqlen: cutlass.Constexpr[bool], pipe_k, pipe_v, wg, pipe_kd=None):
        """An idle warpgroup's step (FwdConfig.skip_idle_wg): the waits, releases and ping-pong
        turns of step_overlap / step_serial in their order, and nothing else (`pipe_kd`: per-token
        FP8's k-descale ring, released with K)."""
        pipe_k.consumer_wait(k_state)
        if cutlass.const_expr(pipe_kd is not None):
            self.release_kd_unread(pipe_kd, k_state)
        self.pingpong_sync(wg)
        if cutlass.const_expr(self.cfg.intra_wg_overlap):
            pipe_v.consumer_wait(v_state)
            self.pingpong_arrive(wg)
            pipe_k.consumer_release(k_state)
            pipe_v.consumer_release(v_state)
        else:
            self.pingpong_arrive(wg)
            pipe_k.consumer_release(k_state)
            pipe_v.consumer_wait(v_state)
            self.pingpong_sync(wg)
            self.pingpong_arrive(wg)
            pipe_v.consumer_release(v_state)

    @cute.jit
    def release_kd_unread(self, pipe_kd, k_state):
        """An idle warpgroup's turn on the k-descale ring: it waits for the stage to be full before it
        arrives on its empty barrier, as a reading thread does. The early arrive alone cannot free a
        stage before the readers (each round's empty phase needs every reader), but compute-sanitizer's
        synccheck reports an arrive on a phase the thread never waited for ("Missing wait")."""
        pipe_kd.consumer_wait(k_state)
        pipe_kd.consumer_release(k_state)

    def scale_by_k_descales(self, load_kd, k_state):
        """Per-token FP8 descales (`load_kd` given): S times the k descales of K stage k_state's block.
        Plain Python, called while tracing."""
        if load_kd is not None:
            load_kd(k_state)

    @cute.jit
    def k_descales(self, k_state, acc_S_rc, kd_ring):
        """S times its columns' k descales from K stage k_state's ring stage, once the producer has
        staged them: KD.CHUNK columns at a time, each after a wait on the stage's full barrier."""
        sKd, pipe_kd = kd_ring
        for chunk in cutlass.range_constexpr(self.tile_n // 4 // KD.CHUNK):
            pipe_kd.consumer_wait(k_state)
            kd = KD.load_k_descales(sKd, k_state.index, chunk)
            KD.apply_k_descales(acc_S_rc, kd, chunk)
        # this thread's reads of the stage are done: its own arrive (a release racecheck follows, where
        # one lane's arrive after a warp sync was not)
        pipe_kd.consumer_release(k_state)

    @cute.jit
    def issue_gemm(self, tiled_mma, acc, tCrA, tCrB, stage, zero_init: cutlass.Constexpr[bool]):
        """One block's WGMMAs with B from its ring stage `stage`, as one commit group (mma.issue_gemm)."""
        issue_gemm(tiled_mma, acc, tCrA, tCrB, zero_init, stage=stage)


    @cute.jit
    def scores_to_probs(self, n_block, is_first: cutlass.Constexpr[bool], mask: cutlass.Constexpr[bool],
                        mask_seqlen: cutlass.Constexpr[bool], acc_S, acc_S_rc, coord_rc, coord0_rc,
                        softmax, m_block, seqlen_q, seqlen_k, window_left, window_right, softcap_pre,
                        row_pre=None, load_kd=None, k_state=None, tokens=None, keys=None):
        """One block's scores into probabilities: softcap, mask, online softmax step. Per-token FP8
        descales (`load_kd`): S times its k descales from K stage `k_state`'s ring stage first (then
        tanh's argument takes `row_pre`: softcap_pre times each row's q descale)."""
        if cutlass.const_expr(load_kd is not None):
            self.scale_by_k_descales(load_kd, k_state)
            if cutlass.const_expr(self.has_softcap):
                KD.softcap_rows(acc_S_rc, row_pre)
        elif cutlass.const_expr(self.has_softcap):
            for j in cutlass.range(cute.size(acc_S), unroll_full=True):
                acc_S[j] = cute.math.tanh(acc_S[j] * softcap_pre, fastmath=True)
        if cutlass.const_expr(mask):
            M.apply_mask(acc_S_rc, coord_rc, coord0_rc, m_block, n_block, seqlen_q, seqlen_k,
                         window_left, window_right, self.tile_m, self.tile_n, self.has_left,
                         self.has_right, mask_seqlen, tokens=tokens, keys=keys)
        softmax.step(acc_S_rc, is_first=is_first)

    @cute.jit
    def step_overlap(self, n_block, k_state, v_state, mask: cutlass.Constexpr[bool],
                     mask_seqlen: cutlass.Constexpr[bool], pipe_k, pipe_v, issue_qk, issue_pv, to_probs,
                     acc_S, acc_O_rc, tOrP, softmax, wg, lazy=None,
                     p_cur=None, p_next=None, two_level=None,
                     defer: cutlass.Constexpr[bool] = False):
        """QK^T of block n and P @ V of block n+1 in flight together; softmax of n while P V runs.

        O is multiplied by block n+1's row scale before P @ V(n+1) accumulates into it: with
        `rescale_o_before_pv` here, after QK^T(n) is issued (under that GEMM; the row scale still
        holds block n+1's scale, the previous step waited for its P @ V), otherwise at the end of
        the previous step (the peeled first block's scale is 1 and O is 0).
        """
        pipe_k.consumer_wait(k_state)
        self.pingpong_sync(wg)
        issue_qk(k_state.index)
        if cutlass.const_expr(self.cfg.rescale_o_before_pv):
            softmax.rescale(acc_O_rc)
        pipe_v.consumer_wait(v_state)
        if cutlass.const_expr(p_cur is not None):
            lazy[3](tCrA=p_cur, stage=v_state.index)
        else:
            issue_pv(v_state.index)
        self.pingpong_arrive(wg)
        warpgroup.wait_group(1)
        # (per-token FP8 descales: K's stage is released after its k descales are read, in to_probs)
        early_k_release = not self.cfg.late_k_release and not self.token
        if cutlass.const_expr(early_k_release):
            pipe_k.consumer_release(k_state)
        # FwdConfig.lazy_max: mask-free steps only (a masked step may leave a row without a max)
        lazy_step = p_next is not None
        need_exact = None
        if cutlass.const_expr(lazy_step):
            need_exact = lazy[0](p_next=p_next)
        elif cutlass.const_expr(self.token):
            to_probs(n_block=n_block, is_first=False, mask=mask, mask_seqlen=mask_seqlen, k_state=k_state)
            if cutlass.const_expr(not self.cfg.late_k_release):
                pipe_k.consumer_release(k_state)
        else:
            to_probs(n_block=n_block, is_first=False, mask=mask, mask_seqlen=mask_seqlen)
        # K(n) is released here, after the softmax and through a condition on the new row sums
        # that always holds: ptxas keeps an mbarrier arrive ahead of a later wgmma.wait_group, but
        # otherwise hoists the P @ V wait (WARPGROUP.DEPBAR) to where its latency model expects the
        # GEMM to be done, in the middle of the exp2s (or before them). Tying the arrive to the
        # exp2 results keeps the wait after all of them, so they run under this warpgroup's P @ V.
        if cutlass.const_expr(self.cfg.late_k_release):
            self.release_after(pipe_k, k_state, softmax.row_sum, lazy[2] if lazy_step else None)
        warpgroup.wait_group(0)
        if cutlass.const_expr(two_level is not None):
            two_level.add(deferred=defer)  # (deferred: O times the previous step's row scale) + P @ V(n+1)
        pipe_v.consumer_release(v_state)
        if cutlass.const_expr(lazy_step):
            lazy[1](need_exact=need_exact, p_next=p_next)
        else:
            if cutlass.const_expr(defer):
                two_level.defer()  # this block's row scale: applied by the next flush
            elif cutlass.const_expr(not self.cfg.rescale_o_before_pv):
                softmax.rescale(acc_O_rc)
            acc_to_operand_a(acc_S, tOrP)

    @cute.jit
    def lazy_probs(self, p_next, acc_S, acc_S_rc, acc_P, softmax, block_sum):
        """FwdConfig.lazy_max, before the previous P @ V is waited for: P against the running max as
        it is, converted into the next P @ V operand; returns whether this thread needs the exact
        step (the caller votes after that wait)."""
        need = softmax.lazy_block(acc_S_rc, L.acc_rows_cols(acc_P), block_sum, Float32(2.0 ** LAZY_MAX_LOG2))
        acc_to_operand_a(acc_P, p_next)
        return need

    @cute.jit
    def lazy_settle(self, need_exact, p_next, acc_S, acc_S_rc, acc_O_rc, softmax, block_sum):
        """After the previous P @ V is done: a warp with a row that needs it redoes the block exactly
        from S (new max, O rescaled, P converted again); the others add their block sums. The
        vote keeps the branch warp-uniform; no WGMMA is in flight here."""
        if cute.arch.vote_any_sync(need_exact):
            # keep `old` alive into this branch (a mask that is 0, unknown to the compiler): otherwise
            # ptxas sinks the lazy conversion into the other branch and recomputes half the exp2s
            # there rather than holding the fp32 P across the vote
            p_words = cute.recast_tensor(p_next, Int32)
            old = p_words.load()
            keep_old = Int32(0)
            if softmax.row_sum[0] < Float32(0.0):
                keep_old = Int32(-1)
            softmax.step(acc_S_rc, is_first=False)  # lazy_max is not built for FP8: shift 0
            softmax.rescale(acc_O_rc)
            acc_to_operand_a(acc_S, p_next)
            for j in cutlass.range_constexpr(cute.size(p_words)):
                p_words[j] = p_words[j] ^ ((old[j] ^ p_words[j]) & keep_old)
        else:
            for r in cutlass.range_constexpr(cute.size(softmax.row_sum)):
                softmax.row_sum[r] = softmax.row_sum[r] + block_sum[r]

    @cute.jit
    def release_after(self, pipe, state, row_sum, block_sum=None):
        """`pipe.consumer_release(state)`, issued only once every row sum is computed: the sums
        are never negative (NaN fails `< 0` too), so the condition holds but ptxas cannot know.
        With `block_sum` (lazy_max's, not yet in the running sums) the condition takes both: a sum
        of exp2s alone the compiler knows is not negative, and it would drop the condition."""
        total = row_sum[0]
        for r in cutlass.range_constexpr(1, cute.size(row_sum)):
            total = total + row_sum[r]
        if cutlass.const_expr(block_sum is not None):
            for r in cutlass.range_constexpr(cute.size(block_sum)):
                total = total + block_sum[r]
        if not total < Float32(0.0):
            pipe.consumer_release(state)

    @cute.jit
    def step_serial(self, n_block, k_state, v_state, mask: cutlass.Constexpr[bool],
                    mask_seqlen: cutlass.Constexpr[bool], pipe_k, pipe_v, issue_qk, issue_pv, to_probs,
                    acc_S, acc_O_rc, tOrP, softmax, wg, two_level=None):
        """One block without intra-warpgroup overlap: QK^T, wait, softmax, P @ V, wait."""
        pipe_k.consumer_wait(k_state)
        self.pingpong_sync(wg)
        issue_qk(k_state.index)
        self.pingpong_arrive(wg)
        warpgroup.wait_group(0)
        if cutlass.const_expr(self.token):  # K's stage released once its k descales are read
            to_probs(n_block=n_block, is_first=False, mask=mask, mask_seqlen=mask_seqlen, k_state=k_state)
            pipe_k.consumer_release(k_state)
        else:
            pipe_k.consumer_release(k_state)
            to_probs(n_block=n_block, is_first=False, mask=mask, mask_seqlen=mask_seqlen)
        softmax.rescale(acc_O_rc)
        acc_to_operand_a(acc_S, tOrP)
        pipe_v.consumer_wait(v_state)
        self.pingpong_sync(wg)
        issue_pv(v_state.index)
        self.pingpong_arrive(wg)
        warpgroup.wait_group(0)
        if cutlass.const_expr(two_level is not None):
            two_level.add(deferred=False)
        pipe_v.consumer_release(v_state)

    def q_tile(self, sQ_layout):
        """One Q tile of sQ's layout (the TMA box and the bytes a Q stage's load brings): the layout
        itself, or its first stage with a Q ring (q_stages > 1)."""
        return sQ_layout if self.cfg.q_stages == 1 else cute.select(sQ_layout, mode=[0, 1])

    # Ping-pong: warpgroup w waits on barrier (base + w) before issuing its GEMMs and then
    # arrives on the next warpgroup's barrier, so the consumers take turns on the tensor cores
    # and one's softmax runs under the other's GEMMs. The first warpgroup starts with the token
    # (it arrives on its own barrier) and takes back the last hand-off at the end, so every
    # barrier is balanced when the tile ends.
    @cute.jit
    def pingpong_prime(self, wg, active):
        if cutlass.const_expr(self.cfg.pingpong):
            if wg == 0 and active:
                cute.arch.barrier_arrive(barrier_id=FwdBarrier.PINGPONG_WG, number_of_threads=2 * 128)

    @cute.jit
    def pingpong_finish(self, wg, active):
        if cutlass.const_expr(self.cfg.pingpong):
            if wg == 0 and active:
                cute.arch.barrier(barrier_id=FwdBarrier.PINGPONG_WG, number_of_threads=2 * 128)

    @cute.jit
    def pingpong_sync(self, wg):
        if cutlass.const_expr(self.cfg.pingpong):
            cute.arch.barrier(barrier_id=FwdBarrier.PINGPONG_WG + wg, number_of_threads=2 * 128)

    @cute.jit
    def pingpong_arrive(self, wg):
        if cutlass.const_expr(self.cfg.pingpong):
            nxt = wg + 1
            if nxt == self.num_consumer_wg:
                nxt = 0
            cute.arch.barrier_arrive(barrier_id=FwdBarrier.PINGPONG_WG + nxt, number_of_threads=2 * 128)

    @cute.jit
    def epilogue(self, acc_O, lse, coord_rc, mO, mLSE, sO, tma_atom_O, tiled_mma_pv, tidx,
                 m_block, head, batch, seqlen_q, signal_o=None, before_smem=None, varlen_out=None):
        # LSE: the thread holding column 0 of a row writes it
        if coord_rc[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = m_block * self.tile_m + coord_rc[r, 0][0]
                if row < seqlen_q:
                    if cutlass.const_expr(varlen_out is not None):  # varlen: the sequence's rows
                        mLSE[varlen_out[1] + row, head, batch] = lse[r]
                    else:
                        mLSE[row, head, batch] = lse[r]

        rO = cute.make_rmem_tensor_like(acc_O, self.o_dtype)
        rO.store(acc_O.load().to(self.o_dtype))
        self.store_o(rO, mO, sO, tma_atom_O, tiled_mma_pv, tidx, m_block, head, batch, signal_o=signal_o,
                     before_smem=before_smem,
                     varlen_rows=None if varlen_out is None else (*varlen_out, seqlen_q))

    @cute.jit
    def o_to_smem(self, rO, sO, tiled_mma_pv, tidx):
        """stmatrix this thread's O fragment into sO, fenced for a TMA store."""
        smem_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                        self.o_dtype)
        # The stmatrix addresses depend only on the thread: LLVM hoists them out of the tile loop
        # and they sit in 4 registers through every mainloop. At 160 registers (3 consumer
        # warpgroups, hdim 64) that made fp16 local + softcap spill. Through _opaque they are
        # computed here, once per tile.
        smem_copy = cute.make_tiled_copy_C(smem_atom, tiled_mma_pv).get_slice(_opaque(tidx))
        cute.copy(smem_atom, smem_copy.retile(rO), smem_copy.partition_D(sO))
        # make the generic-proxy smem writes visible to the TMA (async proxy) before the store
        cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def store_o(self, rO, mO, sO, tma_atom_O, tiled_mma_pv, tidx, m_block, head, batch, signal_o=None,
                before_smem=None, varlen_rows=None):
        """O through sO and a TMA store. Shared epilogue: the whole tile, all consumers meeting on
        one barrier. FwdConfig.wg_epilogue: this warpgroup's 64 rows through its own part of sO and
        its own TMA store, synchronized on its own barrier only; the rows are the ones its QK^T
        read from Q, so with O staged in Q's buffer no other warpgroup still needs them. With O in V's
        stages (FwdConfig.o_v_stages) sO is this warpgroup's own part, the caller has waited for its
        V stage to be free (`before_smem`), and `signal_o` tells the producer once it has been read."""
        if cutlass.const_expr(self.cfg.wg_epilogue):
            part = cute.arch.make_warp_uniform(tidx // 128)
            rows, row_block = 64, m_block * self.num_consumer_wg + part
            barrier_id, threads = FwdBarrier.EPILOGUE_WG + part, 128
            first_warp = tidx % 128 < 32
        else:
            part, rows, row_block = 0, self.tile_m, m_block
            barrier_id, threads = FwdBarrier.EPILOGUE, self.num_consumer_threads
            first_warp = tidx < 32
        if cutlass.const_expr(self.cfg.o_buffer):
            if first_warp:  # the previous store from this part of sO must be done reading it
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        if cutlass.const_expr(before_smem is not None):
            before_smem()
        # nobody writes sO before that, nor (when sO is Q's buffer) before the warpgroups that read
        # those rows of Q are done with their QK^T
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
        if cutlass.const_expr(self.cfg.o_per_stage):
            # sO is this warpgroup's own 64-row part: its threads write it as warpgroup 0's would
            self.o_to_smem(rO, sO, self.one_wg_mma_pv(), tidx % 128)
        else:
            self.o_to_smem(rO, sO, tiled_mma_pv, tidx)
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
        if cutlass.const_expr(varlen_rows is not None):
            # varlen (shared epilogue): every consumer thread copies 16-byte pieces of the sequence's
            # rows; a TMA box would also write the rows past its end, the next sequence's
            self.store_o_rows(sO, *varlen_rows, head, m_block, tidx)
        elif first_warp:
            gO = cute.local_tile(mO[None, None, head, batch], (rows, self.hdim_v), (row_block, 0))
            sO_part = sO
            if cutlass.const_expr(self.cfg.wg_epilogue and not self.cfg.o_per_stage):
                sO_part = cute.local_tile(sO, (rows, self.hdim_v), (part, 0))
            tOsO, tOgO = cpasync.tma_partition(tma_atom_O, 0, cute.make_layout(1),
                                               cute.group_modes(sO_part, 0, 2), cute.group_modes(gO, 0, 2))
            cute.copy(tma_atom_O, tOsO, tOgO)
            cute.arch.cp_async_bulk_commit_group()
            if cutlass.const_expr(not self.cfg.o_buffer):
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            if cutlass.const_expr(self.cfg.o_in_v_ring):
                if tidx % 32 == 0:  # this part is out of sV: the producer may load V there again
                    signal_o()
        if cutlass.const_expr(self.cfg.o_in_q_buffer):
            # these rows of Q's buffer are free for the next tile once the store has read them
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)

    @cute.jit
    def store_o_rows(self, sO, mO, offset_q, seqlen_q, head, m_block, tidx):
        """Varlen: this tile's O rows below seqlen_q from sO to the packed output, 8 elements at a time."""
        gO = cute.local_tile(cute.domain_offset((offset_q, 0), mO[None, None, head, 0]),
                             (self.tile_m, self.hdim_v), (m_block, 0))
        rows_left = seqlen_q - m_block * self.tile_m
        per_row = self.hdim_v // 8
        items = self.tile_m * per_row
        threads = self.num_consumer_threads
        tidx = _opaque(tidx)  # the addresses computed here, per tile, not held through the mainloop
        for i in cutlass.range_constexpr((items + threads - 1) // threads):
            item = tidx + i * threads
            row = item // per_row
            if row < rows_left and item < items:
                piece = (row, item % per_row)
                cute.autovec_copy(cute.local_tile(sO, (1, 8), piece), cute.local_tile(gO, (1, 8), piece))

    def one_wg_mma_pv(self):
        """The P @ V tiled MMA of one warpgroup: its C partition maps a warpgroup's threads onto a
        64-row tile, the same fragment each thread of any warpgroup holds."""
        return self.make_mma_pv(1)

    def make_mma_pv(self, warpgroups: int, n: int | None = None):
        """O += P V over `warpgroups` x 64 rows, P from registers. V is B (N = head dim, K = keys):
        16-bit WGMMA reads it as stored (MN-major), FP8 only K-major (sV holds V^T). `n`: N, by default
        pv_n (the head dim, with pv_row_sum and the ones rows; the epilogue's view takes the head dim)."""
        b_major = cute.nvgpu.OperandMajorMode.K if self.fp8 else cute.nvgpu.OperandMajorMode.MN
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, b_major,
            Float32, atom_layout_mnk=(warpgroups, 1, 1), tiler_mn=(64, n or self.pv_n),
            a_source=warpgroup.OperandSource.RMEM,
        )

    def o_part_layout(self, sO_layout):
        """One warpgroup's 64 rows of the sO layout (the TMA store's smem side with wg_epilogue).
        The other parts must be the same layout at whole-KiB offsets, so that the swizzle, which
        acts on address bits, lines up for every part; checked at trace time."""
        if FwdBarrier.EPILOGUE_WG + self.num_consumer_wg > NUM_NAMED_BARRIERS:
            raise ValueError(f"wg_epilogue: {self.num_consumer_wg} warpgroups need more than 16 "
                             "named barriers")
        parts = cute.zipped_divide(sO_layout.outer, (64, self.hdim_v))
        rest = cute.get(parts, mode=[1])
        for i in range(cute.size(rest)):
            if (rest(i) * self.cfg.o_elem_bytes) % 1024:
                raise ValueError(f"wg_epilogue: O part {i} starts at element {rest(i)}, not a whole KiB")
        return cute.make_composed_layout(sO_layout.inner, 0, cute.get(parts, mode=[0]))
