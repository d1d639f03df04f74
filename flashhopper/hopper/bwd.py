"""FlashAttention backward for Hopper (sm_90a), hdim 64/96/128 (192/256: hopper/bwd_wide.py).

Over 800 lines because it is one kernel class with one step schedule; what it shares with
bwd_wide.py is in bwd_common.py.

One CTA owns one block of `tile_n` keys of one (batch, KV head) and walks every query block
(of every query head sharing that KV head, so GQA needs no dK/dV reduction) that can see it:

  warpgroup 0 (producer, setmaxnreg.dec): one warp loads K and V once, then Q and dO of each
      query block into a 2-stage ring (TMA, full/empty mbarriers).
  warpgroups 1..2 (consumers, setmaxnreg.inc): 64 keys each. Per query block (tile_m rows: 128
      at hdim 64, 64 otherwise), with the transposed products so that the key dimension is the
      WGMMA M:
        S^T  = K Q^T        (SS)     P^T = exp2(S^T * scale_log2 - LSE_log2[q])
        dP^T = V dO^T       (SS)     dS^T = P^T * (dP^T - D[q])
        dV  += P^T dO       (RS: P^T stays in registers as the A operand)
        dK  += dS^T Q       (SS: dS^T from smem, where dQ needs it anyway; with BwdConfig.dk_rs
                             RS from the dS^T fragment, as FA3 / FA4)
        dS^T -> smem;  dQ(q-block) = dS K (SS, both warpgroups' keys) -> fp32 tile in smem
      (at 128 rows dS^T goes to smem before the dV GEMM is issued: BwdConfig.ds_before_dv, k-block
      by k-block with dV in halves, or all of it first with BwdConfig.ds_then_dv as FA3 / FA4;
      the warpgroups split dQ by head dim, or by query rows with BwdConfig.dq_by_rows; with
      80 rows at hdim 128, BwdConfig.dq_transposed, they compute dQ^T = K^T dS^T, 80 not being
      a WGMMA M, and store it as columns of the fp32 dQ tile)
  warp 1 (dQ writer): TMA reduce-add of each dQ tile into the fp32 dQaccum, so the consumers
      only pay a shared-memory store; with `deterministic` it adds the tiles of one query
      block in key-block order (a per-query-block semaphore), so dQ is bitwise reproducible.
      With BwdConfig.dq_per_wg each warpgroup hands its own part of the tile over (its own
      named-barrier pair with the writer) and each part gets its own TMA reduce-add.
  end: dK * softmax_scale and dV written to gmem (TMA). dQ tiles carry the scale; the caller
  casts dQaccum.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup

from flashhopper.hopper import layout as L
from flashhopper.hopper.barriers import NUM_NAMED_BARRIERS, BwdBarrier
from flashhopper.hopper.bwd_common import BwdKernelBase
from flashhopper.hopper.bwd_layout import k_smem_layout
from flashhopper.hopper.layout import smem_struct
from flashhopper.hopper.mma import issue_gemm, issue_gemm_pair


class FlashBwdSm90(BwdKernelBase):

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, sq, h, d)
        mK: cute.Tensor,  # (b, sk, hk, d)
        mV: cute.Tensor,  # (b, sk, hk, d)
        mdO: cute.Tensor,  # (b, sq, h, d)
        mLSE: cute.Tensor,  # (b, h, sq_pad) fp32: LSE * log2(e); +inf for padded / key-less rows
        mD: cute.Tensor,  # (b, h, sq_pad) fp32: rowsum(dO * O), 0 for padded rows
        mdQaccum: cute.Tensor,  # (b, sq, h, d) fp32, zero on entry
        mdQsem: cute.Tensor,  # (b, h, m_blocks) int32 zeros (deterministic), else any
        mdK: cute.Tensor,  # (b, sk, hk, d)
        mdV: cute.Tensor,  # (b, sk, hk, d)
        scale_log2: Float32,
        softcap_pre: Float32,
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        mCuQ: Optional[cute.Tensor],  # noqa: UP045  varlen: (batch + 1,) int32 cumulative query / key rows
        mCuK: Optional[cute.Tensor],  # noqa: UP045
        mUsedQ: Optional[cute.Tensor],  # noqa: UP045  varlen: (batch,) int32 used rows of each sequence
        mUsedK: Optional[cute.Tensor],  # noqa: UP045
        mPadQ: Optional[cute.Tensor],  # noqa: UP045  varlen: (batch + 1,) int32 first LSE / D row of each
        max_seqlen_k: Optional[Int32],  # noqa: UP045  varlen: the longest key length (the grid's key blocks)
        seqused: Optional[Int32],  # noqa: UP045  varlen: bit 0 seqused_q given, bit 1 seqused_k (rows past
        # the used lengths may hold anything: SeqRows.unused_rows)
        stream: cuda.CUstream,
    ):
        """Dense: (b, s, h, d) tensors, LSE / D (b, h, sq_pad). Varlen (BwdConfig.varlen): batch 1,
        the sequences packed along s; LSE / D rows in the padded layout mPadQ gives; the dQaccum
        rows packed as Q's; the semaphores (sequences, h, query blocks of the longest)."""
        mQ, mK, mV, mdO, mdQaccum, mdK, mdV = [
            L.select_modes(t, [1, 3, 2, 0]) for t in (mQ, mK, mV, mdO, mdQaccum, mdK, mdV)
        ]
        mLSE, mD, mdQsem = [L.select_modes(t, [2, 1, 0]) for t in (mLSE, mD, mdQsem)]
        K_, MN_ = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        atoms = (self.num_consumer_wg, 1, 1)
        # keys are the M dimension of S^T, dP^T, dK, dV; the warpgroups split the keys
        tiled_mma_sdp = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_, K_, Float32, atom_layout_mnk=atoms, tiler_mn=(64, self.tile_m))
        tiled_mma_dkv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_, MN_, Float32, atom_layout_mnk=atoms, tiler_mn=(64, self.hdim),
            a_source=warpgroup.OperandSource.RMEM)
        # dK += dS^T Q reads dS^T from smem (it has to be there for dQ anyway): no register copy
        tiled_mma_dk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_, MN_, Float32, atom_layout_mnk=atoms, tiler_mn=(64, self.hdim))
        # dQ (tile_m x d) = dS (tile_m x tile_n) K: the warpgroups split the head dim, or with
        # dq_by_rows the query rows (64 each, WGMMA N = the whole head dim)
        if cutlass.const_expr(self.cfg.dq_transposed):
            # tile_m 80 is no WGMMA M: dQ^T (d x tile_m) = K^T dS^T, the warpgroups split the head
            # dim as M (64 rows each), N = the query rows
            tiled_mma_dq = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, MN_, MN_, Float32, atom_layout_mnk=atoms, tiler_mn=(64, self.tile_m))
        elif cutlass.const_expr(self.cfg.dq_by_rows):
            tiled_mma_dq = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, MN_, MN_, Float32, atom_layout_mnk=atoms, tiler_mn=(64, self.hdim))
        else:
            tiled_mma_dq = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, MN_, MN_, Float32, atom_layout_mnk=(1, self.num_consumer_wg, 1),
                tiler_mn=(64, self.hdim // self.num_consumer_wg))

        sQ_layout = L.smem_layout_row_major(self.dtype, self.tile_m, self.hdim, self.num_stages)
        sK_layout = k_smem_layout(self.dtype, self.tile_n, self.hdim, self.num_consumer_wg)
        # with 2 dS^T buffers, step i writes buffer i % 2 (see consume)
        sdS_layout = L.smem_layout_row_major(self.dtype, self.tile_n, self.tile_m,
                                             self.cfg.ds_stages if self.cfg.ds_stages > 1 else None)
        # the warpgroups store dQ by head-dim halves: those must be whole swizzle atoms too
        # (with dq_by_rows by 64-row halves, which any row-major layout splits cleanly)
        sdQ_layout = k_smem_layout(Float32, self.tile_m, self.hdim, self.num_consumer_wg)
        # per-query LSE and D of each Q / dO stage ride on the same TMA barriers as Q and dO
        # (stages 128-byte aligned: TMA destinations)
        sRow_layout = cute.make_layout((self.tile_m, self.num_stages), stride=(1, self.cfg.row_stride))

        SharedStorage = self.shared_storage(sQ_layout, sK_layout, sdS_layout, sdQ_layout, sRow_layout)

        load_op = cpasync.CopyBulkTensorTileG2SOp()
        one_stage = cute.select(sQ_layout, mode=[0, 1])
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(load_op, mQ, one_stage, (self.tile_m, self.hdim))
        tma_atom_dO, tma_dO = cpasync.make_tiled_tma_atom(load_op, mdO, one_stage, (self.tile_m, self.hdim))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(load_op, mK, sK_layout, (self.tile_n, self.hdim))
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(load_op, mV, sK_layout, (self.tile_n, self.hdim))
        row_tile = cute.make_layout(self.tile_m)
        tma_atom_LSE, tma_LSE = cpasync.make_tiled_tma_atom(load_op, mLSE, row_tile, (self.tile_m,))
        tma_atom_D, tma_D = cpasync.make_tiled_tma_atom(load_op, mD, row_tile, (self.tile_m,))
        store_op = cpasync.CopyBulkTensorTileS2GOp()
        tma_atom_dK, tma_dK = cpasync.make_tiled_tma_atom(store_op, mdK, sK_layout, (self.tile_n, self.hdim))
        tma_atom_dV, tma_dV = cpasync.make_tiled_tma_atom(store_op, mdV, sK_layout, (self.tile_n, self.hdim))
        # the writer's TMA box: the whole dQ tile, or with dq_per_wg one warpgroup's part of it
        tma_dQ_layout = sdQ_layout
        if cutlass.const_expr(self.cfg.dq_per_wg):
            tma_dQ_layout = self.dq_part_layout(sdQ_layout, tiled_mma_dq)
        tma_atom_dQ, tma_dQ = cpasync.make_tiled_tma_atom(
            cpasync.CopyReduceBulkTensorTileS2GOp(),
            self.dq_rows_view(mdQaccum), tma_dQ_layout, self.dq_part_shape())

        grid = self.grid(mK, mUsedK, max_seqlen_k)
        self.kernel(
            tma_Q, tma_K, tma_V, tma_dO, tma_LSE, tma_D, tma_dQ, mdQsem, tma_dK, tma_dV,
            tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE, tma_atom_D, tma_atom_dQ,
            tma_atom_dK, tma_atom_dV,
            scale_log2, softcap_pre, softmax_scale, window_left, window_right,
            sQ_layout, sK_layout, sdS_layout, sdQ_layout, sRow_layout,
            tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dk, tiled_mma_dq,
            SharedStorage,
            mCuQ, mCuK, mUsedQ, mUsedK, mPadQ, seqused, mdK if self.cfg.varlen else None,
            mdV if self.cfg.varlen else None,
        ).launch(grid=grid, block=[128 * (1 + self.num_consumer_wg), 1, 1], stream=stream,
                 min_blocks_per_mp=1, use_pdl=self.cfg.pdl)

    def shared_storage(self, sQ_layout, sK_layout, sdS_layout, sdQ_layout, sRow_layout):
        """The kernel's shared memory (layout.smem_struct: built from a dict)."""
        mem, align = cute.struct.MemRange, cute.struct.Align
        fields = {
            "mbar_KV": mem[cutlass.Int64, 2],
            "mbar_Q": mem[cutlass.Int64, 2 * self.num_stages],
            "mbar_dO": mem[cutlass.Int64, 2 * self.num_stages],
            "sK": align[mem[self.dtype, cute.cosize(sK_layout)], 1024],
            "sV": align[mem[self.dtype, cute.cosize(sK_layout)], 1024],
            "sQ": align[mem[self.dtype, cute.cosize(sQ_layout)], 1024],
            "sdO": align[mem[self.dtype, cute.cosize(sQ_layout)], 1024],
            "sdS": align[mem[self.dtype, cute.cosize(sdS_layout)], 1024],
            "sdQ": align[mem[Float32, cute.cosize(sdQ_layout)], 1024],
            "sLSE": align[mem[Float32, cute.cosize(sRow_layout)], 128],
            "sD": align[mem[Float32, cute.cosize(sRow_layout)], 128],
        }
        return smem_struct(fields)

    @cute.kernel
    def kernel(self, mQ, mK, mV, mdO, mLSE, mD, mdQaccum, mdQsem, mdK, mdV,
               tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
               tma_atom_dO: cute.CopyAtom, tma_atom_LSE: cute.CopyAtom, tma_atom_D: cute.CopyAtom,
               tma_atom_dQ: cute.CopyAtom, tma_atom_dK: cute.CopyAtom, tma_atom_dV: cute.CopyAtom,
               scale_log2: Float32,
               softcap_pre: Float32, softmax_scale: Float32, window_left: Int32, window_right: Int32,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sdS_layout: cute.ComposedLayout, sdQ_layout: cute.ComposedLayout, sRow_layout: cute.Layout,
               tiled_mma_sdp: cute.TiledMma,
               tiled_mma_dkv: cute.TiledMma, tiled_mma_dk: cute.TiledMma, tiled_mma_dq: cute.TiledMma,
               SharedStorage: cutlass.Constexpr,
               mCuQ, mCuK, mUsedQ, mUsedK, mPadQ, seqused, mdK_rows, mdV_rows):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE, tma_atom_D,
                         tma_atom_dQ, tma_atom_dK, tma_atom_dV):
                cpasync.prefetch_descriptor(atom)
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)
        sLSE = storage.sLSE.get_tensor(sRow_layout)
        sD = storage.sD.get_tensor(sRow_layout)

        pipe_kv, pipe_q, pipe_do = self.make_pipelines(storage, sK_layout, sQ_layout)
        pipeline.pipeline_init_arrive(is_relaxed=True)
        pipeline.pipeline_init_wait()

        seqs = None
        if cutlass.const_expr(self.cfg.varlen):
            seqs = (mCuQ, mCuK, mUsedQ, mUsedK, mPadQ, seqused)
        work = self.cta_work(mQ, mK, window_left, window_right, seqs)
        roles = partial(
            self.roles, mQ=mQ, mK=mK, mV=mV, mdO=mdO, mLSE=mLSE, mD=mD, mdQaccum=mdQaccum, mdQsem=mdQsem,
            mdK=mdK_rows if cutlass.const_expr(self.cfg.varlen) else mdK,
            mdV=mdV_rows if cutlass.const_expr(self.cfg.varlen) else mdV,
            tma_atom_Q=tma_atom_Q, tma_atom_K=tma_atom_K, tma_atom_V=tma_atom_V, tma_atom_dO=tma_atom_dO,
            tma_atom_LSE=tma_atom_LSE, tma_atom_D=tma_atom_D, tma_atom_dQ=tma_atom_dQ,
            tma_atom_dK=tma_atom_dK, tma_atom_dV=tma_atom_dV, scale_log2=scale_log2, softcap_pre=softcap_pre,
            softmax_scale=softmax_scale, window_left=window_left, window_right=window_right,
            tiled_mma_sdp=tiled_mma_sdp, tiled_mma_dkv=tiled_mma_dkv, tiled_mma_dk=tiled_mma_dk,
            tiled_mma_dq=tiled_mma_dq, warp_idx=warp_idx, tidx=tidx, sQ=sQ, sdO=sdO, sK=sK, sV=sV, sdS=sdS,
            sdQ=sdQ, sLSE=sLSE, sD=sD, pipe_kv=pipe_kv, pipe_q=pipe_q, pipe_do=pipe_do,
            work=work)
        if cutlass.const_expr(self.cfg.varlen):
            if self.has_keys(work.n_block, work.seqlen_k):  # else a key block past the sequence's end
                roles()
        else:
            roles()

    @cute.jit
    def roles(self, mQ, mK, mV, mdO, mLSE, mD, mdQaccum, mdQsem, mdK, mdV, tma_atom_Q, tma_atom_K, tma_atom_V,
              tma_atom_dO, tma_atom_LSE, tma_atom_D, tma_atom_dQ, tma_atom_dK, tma_atom_dV, scale_log2,
              softcap_pre, softmax_scale, window_left, window_right, tiled_mma_sdp, tiled_mma_dkv,
              tiled_mma_dk, tiled_mma_dq, warp_idx, tidx, sQ, sdO, sK, sV,
              sdS, sdQ, sLSE, sD, pipe_kv, pipe_q, pipe_do, work):
        """The warps' roles for this CTA's key block (the producer warpgroup's warps, the consumer
        warpgroups)."""
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.cfg.producer_regs)
            if warp_idx == 0:
                self.produce(mQ, mK, mV, mdO, mLSE, mD, sQ, sK, sV, sdO, sLSE, sD, tma_atom_Q,
                             tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE, tma_atom_D, pipe_kv,
                             pipe_q, pipe_do, work)
            if warp_idx == 1:
                if cutlass.const_expr(self.cfg.dq_per_wg):
                    self.write_dq_per_wg(mdQaccum, mdQsem, sdQ, tma_atom_dQ, work, window_left, window_right)
                else:
                    self.write_dq(mdQaccum, mdQsem, sdQ, tma_atom_dQ, work, window_left, window_right)
        else:
            cute.arch.setmaxregister_increase(self.cfg.consumer_regs)
            self.consume(sLSE, sD, mdK, mdV, tma_atom_dK, tma_atom_dV, sQ, sK, sV, sdO, sdS, sdQ,
                         tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dk, tiled_mma_dq, pipe_kv, pipe_q, pipe_do,
                         tidx - 128, work, scale_log2, softcap_pre, softmax_scale, window_left, window_right)

    @cute.jit
    def write_dq(self, mdQaccum, mdQsem, sdQ, tma_atom_dQ, work, window_left, window_right):
        """One warp: add each step's smem dQ tile into dQaccum with a TMA reduce (rows past
        seqlen_q are clipped by the TMA unit)."""
        n_block, head_kv, batch, ratio, m_min, num_m, num_steps, seqlen_q, seqlen_k, seq = (
            work.n_block, work.head_kv, work.batch, work.ratio, work.m_min, work.num_m, work.num_steps,
            work.seqlen_q, work.seqlen_k, work.seq)
        if cutlass.const_expr(self.cfg.pdl):
            cute.arch.griddepcontrol_wait()  # BwdConfig.pdl: the preprocess cleared dQaccum
        lane = cute.arch.lane_idx()
        dq_threads = self.num_consumer_threads + 32
        for step in cutlass.range(num_steps, unroll=1):
            head = head_kv * ratio + step // num_m
            m_block = m_min + step % num_m
            cute.arch.barrier_arrive(barrier_id=BwdBarrier.DQ_EMPTY, number_of_threads=dq_threads)
            cute.arch.barrier(barrier_id=BwdBarrier.DQ_FULL, number_of_threads=dq_threads)
            # the whole warp runs the copy (it elects its issuing lane itself: calling it from one
            # lane leaves the election waiting for the other 31 forever)
            mdQ_rows, m_tile = self.dq_rows_tile(mdQaccum, head, batch, m_block, seqlen_q, seq)
            gdQ = cute.local_tile(mdQ_rows, (self.tile_m, self.hdim), (m_tile, 0))
            tdQsdQ, tdQgdQ = cpasync.tma_partition(tma_atom_dQ, 0, cute.make_layout(1),
                                                   cute.group_modes(sdQ, 0, 2), cute.group_modes(gdQ, 0, 2))
            if cutlass.const_expr(self.cfg.deterministic):
                sem = mdQsem[None, head, batch].iterator + m_block
                turn = self.dq_turn(m_block, n_block, seqlen_q, seqlen_k, window_left, window_right)
                self.wait_turn(sem, turn)
            cute.copy(tma_atom_dQ, tdQsdQ, tdQgdQ)
            cute.arch.cp_async_bulk_commit_group()
            if cutlass.const_expr(self.cfg.deterministic):
                self.pass_turn_when_landed(sem, lane)
            else:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.sync_warp()

    @cute.jit
    def write_dq_per_wg(self, mdQaccum, mdQsem, sdQ, tma_atom_dQ, work, window_left, window_right):
        """BwdConfig.dq_per_wg: warpgroup w's part of each step's dQ tile (dq_part_shape) is added
        with its own TMA reduce-add as soon as w has written it (its dQ-full barrier), and w may
        overwrite it once that TMA has read it (its dQ-empty barrier): the warpgroups meet the
        writer, not each other. Deterministic: one semaphore turn per query block covers all parts,
        issued in warpgroup order, and is handed on once all of them have landed in gmem."""
        n_block, head_kv, batch, ratio, m_min, num_m, num_steps, seqlen_q, seqlen_k, seq = (
            work.n_block, work.head_kv, work.batch, work.ratio, work.m_min, work.num_m, work.num_steps,
            work.seqlen_q, work.seqlen_k, work.seq)
        if cutlass.const_expr(self.cfg.pdl):
            cute.arch.griddepcontrol_wait()  # BwdConfig.pdl: the preprocess cleared dQaccum
        lane = cute.arch.lane_idx()
        wg_threads = 128 + 32
        num_wg = self.num_consumer_wg
        part = self.dq_part_shape()
        for step in cutlass.range(num_steps, unroll=1):
            head = head_kv * ratio + step // num_m
            m_block = m_min + step % num_m
            # part w of the previous step has been read (one bulk group per part, oldest first):
            # warpgroup w may write its next part
            for w in cutlass.range_constexpr(num_wg):
                cute.arch.cp_async_bulk_wait_group(num_wg - 1 - w, read=True)
                cute.arch.barrier_arrive(barrier_id=BwdBarrier.DQ_WG + w, number_of_threads=wg_threads)
            if cutlass.const_expr(self.cfg.deterministic):
                sem = mdQsem[None, head, batch].iterator + m_block
                turn = self.dq_turn(m_block, n_block, seqlen_q, seqlen_k, window_left, window_right)
            for w in cutlass.range_constexpr(num_wg):
                cute.arch.barrier(barrier_id=BwdBarrier.DQ_WG + num_wg + w, number_of_threads=wg_threads)
                if cutlass.const_expr(self.cfg.deterministic and w == 0):
                    self.wait_turn(sem, turn)
                # the whole warp runs the copy (it elects its issuing lane itself)
                mdQ_rows, m_tile = self.dq_rows_tile(mdQaccum, head, batch, m_block, seqlen_q, seq)
                gdQ = cute.local_tile(mdQ_rows, part, self.dq_part_coord(m_tile, w))
                sdQ_w = cute.local_tile(sdQ, part, self.dq_part_coord(0, w))
                tdQsdQ, tdQgdQ = cpasync.tma_partition(tma_atom_dQ, 0, cute.make_layout(1),
                                                       cute.group_modes(sdQ_w, 0, 2),
                                                       cute.group_modes(gdQ, 0, 2))
                cute.copy(tma_atom_dQ, tdQsdQ, tdQgdQ)
                cute.arch.cp_async_bulk_commit_group()
            if cutlass.const_expr(self.cfg.deterministic):
                self.pass_turn_when_landed(sem, lane)
            cute.arch.sync_warp()
        # smem must outlive the last reads
        cute.arch.cp_async_bulk_wait_group(0, read=True)

    def dq_part_shape(self) -> tuple[int, int]:
        """(rows, cols) of the smem dQ tile that one TMA reduce-add covers: the whole tile, or with
        dq_per_wg one warpgroup's part (its head-dim columns; its query rows with dq_by_rows)."""
        if not self.cfg.dq_per_wg:
            return (self.tile_m, self.hdim)
        if self.cfg.dq_by_rows:
            return (self.tile_m // self.num_consumer_wg, self.hdim)
        return (self.tile_m, self.hdim // self.num_consumer_wg)

    def dq_acc_shape(self) -> tuple[int, int]:
        """(M, N) of the dQ GEMM: (tile_m, hdim), or (hdim, tile_m) for dQ^T (dq_transposed)."""
        if self.cfg.dq_transposed:
            return (self.hdim, self.tile_m)
        return (self.tile_m, self.hdim)

    def dq_part_coord(self, m_block, w: int):
        """Tile coordinate, in dq_part_shape units, of warpgroup w's part of query block m_block."""
        if self.cfg.dq_by_rows:
            return (m_block * self.num_consumer_wg + w, 0)
        return (m_block, w)

    def dq_part_layout(self, sdQ_layout, tiled_mma_dq):
        """Warpgroup 0's part of the smem dQ tile, the TMA atom's smem side for dq_per_wg. The
        other parts are the same layout at an offset; it must be whole swizzle periods (1 KiB at
        most) for one atom to serve them all. Both are checked here, at trace time, and so is
        that a thread of each warp of warpgroup w holds dQ accumulator elements only in part w."""
        if BwdBarrier.DQ_WG + 2 * self.num_consumer_wg > min(NUM_NAMED_BARRIERS, BwdBarrier.UNUSED_ROWS):
            raise ValueError(f"dq_per_wg: {self.num_consumer_wg} warpgroups need more than 16 named barriers")
        shape = self.dq_part_shape()
        ident = cute.make_identity_tensor(self.dq_acc_shape())
        for w in range(self.num_consumer_wg):
            r0, c0 = (x * n for x, n in zip(self.dq_part_coord(0, w), shape, strict=True))
            for t in (0, 31, 32, 77, 127):
                coords = tiled_mma_dq.get_slice(w * 128 + t).partition_C(ident)
                for i in range(cute.size(coords)):
                    r, c = coords[i]
                    if self.cfg.dq_transposed:
                        r, c = c, r
                    if not (r0 <= r < r0 + shape[0] and c0 <= c < c0 + shape[1]):
                        raise ValueError(f"dq_per_wg: warpgroup {w} holds dQ ({r}, {c}), outside its part")
        parts = cute.zipped_divide(sdQ_layout.outer, shape)
        rest = cute.get(parts, mode=[1])
        for i in range(cute.size(rest)):
            if (rest(i) * 4) % 1024:
                raise ValueError(f"dq_per_wg: dQ part {i} starts at {rest(i)} fp32, not whole 1 KiB")
        return cute.make_composed_layout(sdQ_layout.inner, 0, cute.get(parts, mode=[0]))

    @cute.jit
    def consume(self, sLSE, sD, mdK, mdV, tma_atom_dK, tma_atom_dV, sQ, sK, sV, sdO, sdS, sdQ,
                tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dk, tiled_mma_dq, pipe_kv, pipe_q, pipe_do, tidx,
                work, scale_log2, softcap_pre, softmax_scale, window_left, window_right):
        n_block, head_kv, batch, m_min, num_m, num_steps, seqlen_q, seqlen_k, seq = (
            work.n_block, work.head_kv, work.batch, work.m_min, work.num_m, work.num_steps, work.seqlen_q,
            work.seqlen_k, work.seq)
        wg = cute.arch.make_warp_uniform(tidx // 128)
        wg_sdp = tiled_mma_sdp.get_slice(wg * 128)
        wg_dkv = tiled_mma_dkv.get_slice(wg * 128)
        wg_dq = tiled_mma_dq.get_slice(wg * 128)
        thr_sdp = tiled_mma_sdp.get_slice(tidx)

        # S^T = K Q^T and dP^T = V dO^T: A = K / V rows of this warpgroup, B = Q / dO (stage)
        tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))
        tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))
        tPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))
        tPrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
        # dV += P^T dO, dK += dS^T Q: B = dO^T / Q^T views (head dim contiguous: MN-major)
        tVrdO = wg_dkv.make_fragment_B(wg_dkv.partition_B(L.transpose_view(sdO)))
        if cutlass.const_expr(self.cfg.dk_rs):
            # dK as dV: dS^T from registers (tKrdS_a below), dV's tiled MMA
            tKrdS = None
            tKrQ = wg_dkv.make_fragment_B(wg_dkv.partition_B(L.transpose_view(sQ)))
        else:
            wg_dk = tiled_mma_dk.get_slice(wg * 128)
            tKrdS = wg_dk.make_fragment_A(wg_dk.partition_A(sdS))
            tKrQ = wg_dk.make_fragment_B(wg_dk.partition_B(L.transpose_view(sQ)))
        if cutlass.const_expr(self.cfg.dq_transposed):
            # dQ^T = K^T dS^T: A = K^T (head dim, keys), B = the dS^T tile seen as (queries, keys),
            # both MN-major: the same smem views as dQ = dS K with the operands swapped
            tQrK = wg_dq.make_fragment_A(wg_dq.partition_A(L.transpose_view(sK)))
            tQrdS = wg_dq.make_fragment_B(wg_dq.partition_B(L.transpose_view(sdS)))
        else:
            # dQ = dS K: A = dS^T tile seen as (queries, keys), B = K^T (head dim, keys)
            tQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(L.transpose_view(sdS)))
            tQrK = wg_dq.make_fragment_B(wg_dq.partition_B(L.transpose_view(sK)))

        shape_sdp = (self.tile_n, self.tile_m)
        acc_S = cute.make_rmem_tensor(tiled_mma_sdp.partition_shape_C(shape_sdp), Float32)
        acc_dP = cute.make_rmem_tensor(tiled_mma_sdp.partition_shape_C(shape_sdp), Float32)
        acc_dV = cute.make_rmem_tensor(tiled_mma_dkv.partition_shape_C((self.tile_n, self.hdim)), Float32)
        acc_dK = cute.make_rmem_tensor(tiled_mma_dkv.partition_shape_C((self.tile_n, self.hdim)), Float32)
        acc_dQ = cute.make_rmem_tensor(tiled_mma_dq.partition_shape_C(self.dq_acc_shape()), Float32)
        tPrP = cute.make_rmem_tensor(L.acc_layout_as_operand_a(acc_S.layout), self.dtype)
        tPrP_as_acc = cute.make_tensor(tPrP.iterator, acc_S.layout)
        tKrdS_a = rdS_dk = None
        if cutlass.const_expr(self.cfg.dk_rs):
            # dS^T in 16 bits in dK's A operand layout (as P^T for dV), written through the
            # accumulator layout by the conversion and read through it by stmatrix (same registers)
            tKrdS_a = cute.make_rmem_tensor(L.acc_layout_as_operand_a(acc_dP.layout), self.dtype)
            rdS_dk = cute.make_tensor(tKrdS_a.iterator, acc_dP.layout)
        acc_S_rc = L.acc_rows_cols(acc_S)
        acc_dP_rc = L.acc_rows_cols(acc_dP)
        coord_rc = L.acc_rows_cols(thr_sdp.partition_C(cute.make_identity_tensor(shape_sdp)))
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)
        dS_copy_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        dS_copy = cute.make_tiled_copy_C(dS_copy_atom, tiled_mma_sdp).get_slice(tidx)
        tdSsdS = dS_copy.partition_D(sdS)
        if cutlass.const_expr(self.cfg.dq_transposed):
            # a thread's dQ^T column pairs are adjacent query rows of the row-major fp32 tile:
            # 4-byte stores (per warp and register 8 head-dim columns x 4 rows two apart, which
            # the 128-byte swizzle spreads over all 32 banks)
            dQ_copy = cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=32),
                tiled_mma_dq).get_slice(tidx)
            tdQsdQ = dQ_copy.partition_D(L.transpose_view(sdQ))
        else:
            # dQ fragments to smem as 8-byte stores: the WGMMA C layout gives each thread column pairs
            dQ_copy = cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=64),
                tiled_mma_dq).get_slice(tidx)
            tdQsdQ = dQ_copy.partition_D(self.dq_rows_smem(sdQ))
        acc_S_as_a = tdSrdP = tdSrdS = None
        if cutlass.const_expr(self.cfg.ds_before_dv):
            # k-block k of P^T (the dV GEMM's A operand) and stmatrix k of dS^T cover the same
            # accumulator registers: columns (queries) [k * chunk_cols, (k + 1) * chunk_cols)
            acc_S_as_a = cute.make_tensor(acc_S.iterator, tPrP.layout)
            tdSrdP = dS_copy.retile(acc_dP)
            if cutlass.const_expr(self.cfg.dk_rs):
                tdSrdS = dS_copy.retile(rdS_dk)
            else:
                tdSrdS = dS_copy.retile(cute.make_rmem_tensor_like(acc_dP, self.dtype))
            num_chunks = cute.size(tPrP, mode=[2])
            chunk_cols = cute.size(acc_S_rc, mode=[1]) // num_chunks
            self.check_chunks(acc_S_rc.layout, tPrP.layout, tdSrdP.layout, num_chunks, chunk_cols)

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_kv.consumer_wait(kv_state)
        if cutlass.const_expr(seq is not None):
            self.zero_unused_keys(sK, sV, n_block, seq, BwdBarrier.UNUSED_ROWS)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        diag = seqlen_k - seqlen_q
        # varlen: a step's Q / dO rows past the sequence's seqused_q zeroed before it starts
        zero_queries = partial(self.zero_unused_queries, sQ=sQ, sdO=sdO, pipe_q=pipe_q, pipe_do=pipe_do,
                               seq=seq, barrier_id=BwdBarrier.UNUSED_ROWS)

        run_step = partial(self.consumer_step, pipe_q=pipe_q, pipe_do=pipe_do, wg=wg,
                           tiled_mma_sdp=tiled_mma_sdp, tiled_mma_dkv=tiled_mma_dkv,
                           tiled_mma_dk=tiled_mma_dk, tiled_mma_dq=tiled_mma_dq, acc_S=acc_S, acc_dP=acc_dP,
                           acc_dV=acc_dV, acc_dK=acc_dK, acc_dQ=acc_dQ, acc_S_rc=acc_S_rc,
                           acc_dP_rc=acc_dP_rc, coord_rc=coord_rc, sLSE=sLSE, sD=sD, tSrK=tSrK, tSrQ=tSrQ,
                           tPrV=tPrV, tPrdO=tPrdO, tVrdO=tVrdO, tKrQ=tKrQ, tKrdS=tKrdS, tQrdS=tQrdS,
                           tQrK=tQrK, tPrP=tPrP, tPrP_as_acc=tPrP_as_acc, tKrdS_a=tKrdS_a, rdS_dk=rdS_dk,
                           acc_S_as_a=acc_S_as_a, tdSrdP=tdSrdP, tdSrdS=tdSrdS, dS_copy_atom=dS_copy_atom,
                           dS_copy=dS_copy, tdSsdS=tdSsdS, dQ_copy=dQ_copy, tdQsdQ=tdQsdQ,
                           softcap_pre=softcap_pre, softmax_scale=softmax_scale)
        if cutlass.const_expr(not self.cfg.mask_runs):
            legacy_probs = partial(self.legacy_probs, acc_S_rc=acc_S_rc, coord_rc=coord_rc, n_block=n_block,
                                   diag=diag, seqlen_k=seqlen_k, window_left=window_left,
                                   window_right=window_right, scale_log2=scale_log2)
            for step in cutlass.range(num_steps, unroll=1):
                m_block = m_min + step % num_m
                if cutlass.const_expr(seq is not None):
                    zero_queries(q_state=state, do_state=state, m_block=m_block)
                run_step(step, m_block, state, legacy_probs)
                state.advance()
        else:
            self.check_coord_offsets(tiled_mma_sdp, shape_sdp, self.num_consumer_threads)
            # thread 0's coordinates, compile-time values; a thread's are these plus one runtime
            # (key, query) offset (as in the forward's apply_mask, and for the same reason)
            ident = cute.make_identity_tensor(shape_sdp)
            coord0_rc = L.acc_rows_cols(tiled_mma_sdp.get_slice(0).partition_C(ident))
            key_off = coord_rc[0, 0][0] - coord0_rc[0, 0][0]
            query_off = coord_rc[0, 0][1] - coord0_rc[0, 0][1]
            limits = partial(self.row_limits, coord0_rc=coord0_rc, n_block=n_block, key_off=key_off,
                             query_off=query_off, diag=diag, seqlen_k=seqlen_k, window_left=window_left,
                             window_right=window_right, seq=seq)
            probs = partial(self.run_probs, coord_rc=coord_rc, coord0_rc=coord0_rc, scale_log2=scale_log2)
            masked_test = "edges" if cutlass.const_expr(self.has_right) else "keys"
            # hdim 128 + softcap: with no test at all ptxas scheduled the free body's exp2 / dS
            # math so that it spilled 16-24 bytes (4-6 loop scalars around the dV GEMM); with
            # the per-row key < seqlen_k select of the old body it does not
            free_test = "keys" if cutlass.const_expr(self.has_softcap and self.hdim >= 128) else "none"
            masked_probs = partial(self.make_probs, limits=limits, probs=probs, test=masked_test)
            free_probs = partial(self.make_probs, limits=limits, probs=probs, test=free_test)
            m_right, m_left = self.blocks.m_mask_runs(n_block, m_min, num_m, diag, seqlen_k, window_left,
                                                   window_right)
            # Per query head of the group: [m_min, m_right) masked (the causal / right-window edge;
            # every step of the ragged last key block), [m_right, m_left) mask-free, [m_left, m_end)
            # masked (the left-window edge), ascending as before, so the producer, the dQ writer and
            # deterministic mode's turns see the same steps. One loop with a warp-uniform branch
            # between whole steps rather than one loop per run: at hdim 128 the nested
            # (query head, run) loops carried two more counters than ptxas had registers for.
            # without a right bound only the ragged last key block is masked, every step of it
            ragged = (n_block + 1) * self.tile_n > seqlen_k
            for step in cutlass.range(num_steps, unroll=1):
                m_block = m_min + step % num_m
                if cutlass.const_expr(seq is not None):
                    zero_queries(q_state=state, do_state=state, m_block=m_block)
                masked = ragged
                if cutlass.const_expr(self.has_right):
                    masked = m_block < m_right
                if cutlass.const_expr(self.has_left):
                    masked = masked or m_block >= m_left
                if cutlass.const_expr(masked_test == free_test):
                    run_step(step, m_block, state, masked_probs)
                elif not masked:
                    # the mask-free body first: ptxas keeps the loop-invariant WGMMA descriptor
                    # values in uniform registers for the body placed first and rebuilds them in
                    # the other one (+60 uniform instructions a step), and most steps are free
                    run_step(step, m_block, state, free_probs)
                else:
                    run_step(step, m_block, state, masked_probs)
                state.advance()

        # dK, dV through smem (K and V's buffers, free once every warpgroup's last dQ GEMM is
        # done) and TMA stores, which also drop the rows past seqlen_k. dK carries the softmax
        # scale: dS is the gradient of the scaled scores.
        if cutlass.const_expr(seq is not None):
            tidx = self.consumer_tidx()
        rdK = cute.make_rmem_tensor_like(acc_dK, self.dtype)
        if cutlass.const_expr(self.cfg.scale_in_ds):
            rdK.store(acc_dK.load().to(self.dtype))  # dS carried the scale
        else:
            rdK.store((acc_dK.load() * softmax_scale).to(self.dtype))
        rdV = cute.make_rmem_tensor_like(acc_dV, self.dtype)
        rdV.store(acc_dV.load().to(self.dtype))
        cute.arch.barrier(barrier_id=BwdBarrier.DS, number_of_threads=self.num_consumer_threads)
        st_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                      self.dtype)
        st_copy = cute.make_tiled_copy_C(st_atom, tiled_mma_dkv).get_slice(tidx)
        cute.copy(st_atom, st_copy.retile(rdK), st_copy.partition_D(sK))
        cute.copy(st_atom, st_copy.retile(rdV), st_copy.partition_D(sV))
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=BwdBarrier.DS, number_of_threads=self.num_consumer_threads)
        self.store_dkv(mdK, mdV, sK, sV, tma_atom_dK, tma_atom_dV, n_block, head_kv, batch, tidx, seq,
                       seqlen_k)

    @cute.jit
    def consumer_step(self, step, m_block, state, make_to_probs, pipe_q, pipe_do, wg,
                      tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dk, tiled_mma_dq, acc_S, acc_dP, acc_dV,
                      acc_dK, acc_dQ, acc_S_rc, acc_dP_rc, coord_rc, sLSE, sD, tSrK, tSrQ, tPrV, tPrdO,
                      tVrdO, tKrQ, tKrdS, tQrdS, tQrK, tPrP, tPrP_as_acc, tKrdS_a, rdS_dk, acc_S_as_a,
                      tdSrdP, tdSrdS, dS_copy_atom, dS_copy, tdSsdS, dQ_copy, tdQsdQ, softcap_pre,
                      softmax_scale):
        """One step: the query block m_block (of one query head) against this CTA's keys. Every
        WGMMA it issues is waited for inside it, so the mask_runs runs may pick a different body
        per step with no branch between an issue and its wait."""
        if cutlass.const_expr(self.cfg.ds_before_dv):
            num_chunks = cute.size(tPrP, mode=[2])
            chunk_cols = cute.size(acc_S_rc, mode=[1]) // num_chunks
        dq_threads = self.num_consumer_threads + 32
        tdSsdS_i, tKrdS_i, tQrdS_i = tdSsdS, tKrdS, tQrdS
        if cutlass.const_expr(self.cfg.ds_stages > 1):
            ds_buf = step % self.cfg.ds_stages
            tdSsdS_i = tdSsdS[None, None, None, ds_buf]
            if cutlass.const_expr(not self.cfg.dk_rs):
                tKrdS_i = tKrdS[None, None, None, ds_buf]
            tQrdS_i = tQrdS[None, None, None, ds_buf]
        pipe_q.consumer_wait(state)
        issue_gemm(tiled_mma_sdp, acc_S, tSrK, tSrQ[None, None, None, state.index], zero_init=True)
        pipe_do.consumer_wait(state)
        issue_gemm(tiled_mma_sdp, acc_dP, tPrV, tPrdO[None, None, None, state.index], zero_init=True)
        warpgroup.wait_group(1)

        to_probs = make_to_probs(m_block, sLSE[None, state.index])
        p_ds = partial(self.p_ds_element, acc_S_rc=acc_S_rc, acc_dP_rc=acc_dP_rc, to_probs=to_probs,
                       ds_scale=softmax_scale if self.cfg.scale_in_ds else None)
        if cutlass.const_expr(self.has_softcap):
            # only tanh here, under the dP GEMM: keeping (1 - tanh^2) in registers until
            # dS would spill, so P and dS are both formed after the wait from tanh
            for j in cutlass.range(cute.size(acc_S), unroll_full=True):
                acc_S[j] = cute.math.tanh(acc_S[j] * softcap_pre, fastmath=True)
        else:
            # P^T = exp2(S^T * scale_log2 - LSE_log2[query]) under the dP GEMM
            for c in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[1])):
                for r in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[0])):
                    acc_S_rc[r, c] = to_probs(r=r, c=c, s=acc_S_rc[r, c])
        warpgroup.wait_group(0)
        if cutlass.const_expr(self.cfg.ds_before_dv):
            # 128 queries: S^T and dP^T take 64 + 64 fp32 registers, too many to also hold
            # the bf16 P^T and dS^T while the whole dV GEMM runs. So, as in FA3, dS^T goes to
            # smem first, one 16-query k-block at a time (dS^T, then that k-block of P^T and
            # dS^T in bf16 from the fp32 values, so both die at once), and the dV GEMM
            # follows in two halves: k-blocks 0-3 under the second half of the dS^T work.
            self.ds_free_barrier()
            tVrdO_i = tVrdO[None, None, None, state.index]
            for k in cutlass.range_constexpr(num_chunks):
                self.form_ds(p_ds, acc_S_rc, coord_rc, sD, state, range(k * chunk_cols, (k + 1) * chunk_cols))
                tPrP[None, None, k].store(acc_S_as_a[None, None, k].load().to(self.dtype))
                rdS_k = tdSrdS[(None, k), None, None]
                rdS_k.store(tdSrdP[(None, k), None, None].load().to(self.dtype))
                cute.copy(dS_copy_atom, rdS_k, tdSsdS_i[(None, k), None, None])
                if cutlass.const_expr(k == num_chunks // 2 - 1 and self.cfg.dk_rs):
                    # dK's first half rides with dV's (dS^T k-blocks 0-3 are in registers)
                    issue_gemm_pair(tiled_mma_dkv, acc_dV, tPrP, tVrdO_i, acc_dK, tKrdS_a,
                                    tKrQ[None, None, None, state.index], 0, num_chunks // 2)
                elif cutlass.const_expr(k == num_chunks // 2 - 1):
                    issue_gemm(tiled_mma_dkv, acc_dV, tPrP, tVrdO_i, zero_init=False, k_end=num_chunks // 2)
                if cutlass.const_expr(k == num_chunks - 1 and self.cfg.dk_rs):
                    # that group done: the first half of P^T and dS^T leave the registers before
                    # the dQ accumulator needs them (with all of dS^T held to the end, ptxas
                    # spilled 16-24 bytes in the loop, every mask but softcap)
                    warpgroup.wait_group(0)
            cute.arch.fence_view_async_shared()
            issue_gemm(tiled_mma_dkv, acc_dV, tPrP, tVrdO_i, zero_init=False, k_begin=num_chunks // 2,
                       k_end=num_chunks)
        elif cutlass.const_expr(self.cfg.dv_after_ds):
            # 128 queries in FA3 / FA4's order: P^T and dS^T both in 16 bits before any of
            # this step's dV / dK work is queued, so no in-flight WGMMA pins the fp32 S^T / dP^T
            # registers they come from (with dV issued before dS^T's conversion, ptxas
            # serialized every WGMMA for lack of registers, C7512)
            self.form_ds(p_ds, acc_S_rc, coord_rc, sD, state)
            tPrP_as_acc.store(acc_S.load().to(self.dtype))
            rdS = self.ds_operand(rdS_dk, acc_dP)
            self.ds_free_barrier()
            cute.copy(dS_copy_atom, dS_copy.retile(rdS), tdSsdS_i)
            issue_gemm(tiled_mma_dkv, acc_dV, tPrP, tVrdO[None, None, None, state.index], zero_init=False)
            cute.arch.fence_view_async_shared()
        else:
            # dS^T = P^T (dP^T - D[query])
            self.form_ds(p_ds, acc_S_rc, coord_rc, sD, state)
            tPrP_as_acc.store(acc_S.load().to(self.dtype))
            issue_gemm(tiled_mma_dkv, acc_dV, tPrP, tVrdO[None, None, None, state.index], zero_init=False)
            rdS = self.ds_operand(rdS_dk, acc_dP)

            # dS^T to smem, for dK (this warpgroup's keys) and dQ = dS K (both warpgroups' keys)
            self.ds_free_barrier()
            cute.copy(dS_copy_atom, dS_copy.retile(rdS), tdSsdS_i)
            cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=BwdBarrier.DS, number_of_threads=self.num_consumer_threads)
        if cutlass.const_expr(self.cfg.dk_rs and not self.cfg.ds_before_dv and not self.cfg.dv_after_ds):
            # dV done (it ran under the dS^T stores and the barrier): P^T leaves the registers
            # before the dQ accumulator joins dS^T (fp16 + softcap at hdim 128 spilled 16 bytes
            # without this wait)
            warpgroup.wait_group(0)
        if cutlass.const_expr(self.cfg.dq_transposed):
            issue_gemm(tiled_mma_dq, acc_dQ, tQrK, tQrdS_i, zero_init=True)
        else:
            issue_gemm(tiled_mma_dq, acc_dQ, tQrdS_i, tQrK, zero_init=True)
        if cutlass.const_expr(self.cfg.dv_after_ds):
            # dV done while dQ is queued behind it: the tensor pipe keeps this warpgroup's work,
            # P^T's registers are free before dK's issue, and dO's stage is no longer read
            warpgroup.wait_group(1)
            pipe_do.consumer_release(state)
        if cutlass.const_expr(self.cfg.dk_rs and self.cfg.ds_before_dv):
            # the second half of dK; the first went with dV's first half
            issue_gemm(tiled_mma_dkv, acc_dK, tKrdS_a, tKrQ[None, None, None, state.index], zero_init=False,
                       k_begin=num_chunks // 2, k_end=num_chunks)
        elif cutlass.const_expr(self.cfg.dk_rs):
            # dS^T from registers: they stay live until the wait_group(0) below
            issue_gemm(tiled_mma_dkv, acc_dK, tKrdS_a, tKrQ[None, None, None, state.index], zero_init=False)
        else:
            issue_gemm(tiled_mma_dk, acc_dK, tKrdS_i, tKrQ[None, None, None, state.index], zero_init=False)
        warpgroup.wait_group(1)  # dQ done; dK still running
        # hand dQ to the writer warp once it has finished reading the previous tile (with
        # dq_per_wg: this warpgroup's part, on this warpgroup's barriers)
        if cutlass.const_expr(self.cfg.dq_per_wg):
            cute.arch.barrier(barrier_id=BwdBarrier.DQ_WG + wg, number_of_threads=128 + 32)
        else:
            cute.arch.barrier(barrier_id=BwdBarrier.DQ_EMPTY, number_of_threads=dq_threads)
        if cutlass.const_expr(not self.cfg.scale_in_ds):
            acc_dQ.store(acc_dQ.load() * softmax_scale)  # so the host only casts dQaccum
        cute.copy(dQ_copy, dQ_copy.retile(acc_dQ), tdQsdQ)
        cute.arch.fence_view_async_shared()
        if cutlass.const_expr(self.cfg.dq_per_wg):
            cute.arch.barrier_arrive(barrier_id=BwdBarrier.DQ_WG + self.num_consumer_wg + wg,
                                     number_of_threads=128 + 32)
        else:
            cute.arch.barrier_arrive(barrier_id=BwdBarrier.DQ_FULL, number_of_threads=dq_threads)
        warpgroup.wait_group(0)
        pipe_q.consumer_release(state)
        if cutlass.const_expr(not self.cfg.dv_after_ds):
            pipe_do.consumer_release(state)

    @staticmethod
    def form_ds(p_ds, acc_S_rc, coord_rc, sD, state, cols=None):
        """dS^T (and with softcap P^T) in place over the accumulator columns `cols` (all of them
        by default): each column is one query, whose D row is read once."""
        for c in cols if cols is not None else range(cute.size(acc_S_rc, mode=[1])):
            d_row = sD[coord_rc[0, c][1], state.index]
            for r in range(cute.size(acc_S_rc, mode=[0])):  # plain Python: unrolled at trace time
                p_ds(r=r, c=c, d_row=d_row)

    def ds_operand(self, rdS_dk, acc_dP):
        """dS^T in 16 bits: into dK's register A operand with dk_rs, else a fresh fragment."""
        rdS = rdS_dk if cutlass.const_expr(self.cfg.dk_rs) else cute.make_rmem_tensor_like(acc_dP, self.dtype)
        rdS.store(acc_dP.load().to(self.dtype))
        return rdS

    @cute.jit
    def ds_free_barrier(self):
        """Wait until the dS^T buffer this step writes is no longer read. With one buffer: the
        previous step's dQ / dK GEMMs of both warpgroups have finished once everybody is here. With
        two, the buffer's last readers are two steps back: each warpgroup waited for its GEMMs
        (wait_group 0) before arriving at the previous step's "written" barrier, which this
        warpgroup has passed, so no barrier is needed."""
        if cutlass.const_expr(self.cfg.ds_stages == 1):
            cute.arch.barrier(barrier_id=BwdBarrier.DS, number_of_threads=self.num_consumer_threads)

    @staticmethod
    def check_chunks(rc_layout, a_layout, st_layout, num_chunks: int, chunk_cols: int):
        """Trace-time check that k-block k of the A operand, stmatrix k and accumulator columns
        [k * chunk_cols, (k + 1) * chunk_cols) name the same registers."""
        rows = cute.size(rc_layout, mode=[0])
        for k in range(num_chunks):
            cols = range(k * chunk_cols, (k + 1) * chunk_cols)
            from_cols = {rc_layout((r, c)) for r in range(rows) for c in cols}
            from_a = {a_layout((v, 0, k)) for v in range(cute.size(a_layout, mode=[0]))}
            from_st = {st_layout(((v, k), 0, 0)) for v in range(cute.size(st_layout, mode=[0, 0]))}
            if not from_cols == from_a == from_st:
                raise ValueError(f"k-block {k}: columns {sorted(from_cols)}, A {sorted(from_a)}, "
                                 f"stmatrix {sorted(from_st)}")

    @cute.jit
    def p_ds_element(self, r: cutlass.Constexpr[int], c: cutlass.Constexpr[int], d_row, acc_S_rc, acc_dP_rc,
                     to_probs, ds_scale=None):
        """dS^T[r, c] = P^T (dP^T - D[query]) in place of dP^T; with softcap P^T is formed here
        from tanh (in place of it) and dS^T takes the tanh derivative. `ds_scale` (scale_in_ds,
        a trace-time choice): d_row is D * scale and dS^T comes out times the scale, one FFMA."""
        if cutlass.const_expr(self.has_softcap):
            t = acc_S_rc[r, c]
            p = to_probs(r=r, c=c, s=t)
            acc_S_rc[r, c] = p
            acc_dP_rc[r, c] = p * self.dp_minus_d(acc_dP_rc[r, c], d_row, ds_scale) * (Float32(1.0) - t * t)
        else:
            acc_dP_rc[r, c] = acc_S_rc[r, c] * self.dp_minus_d(acc_dP_rc[r, c], d_row, ds_scale)

    @staticmethod
    def dp_minus_d(dp, d_row, ds_scale):
        """dP^T - D, or with scale_in_ds (D arrived times the scale) dP^T * scale - D: one FFMA."""
        if cutlass.const_expr(ds_scale is None):
            return dp - d_row
        return dp * ds_scale - d_row

    def legacy_probs(self, m_block, sLSE, **fields):
        """to_probs of one step without mask_runs: every element tests its own coordinates."""
        return partial(self.scores_to_probs, sLSE=sLSE, m_block=m_block, **fields)

    def make_probs(self, m_block, sLSE, limits, probs, test: str):
        """to_probs of one step of a mask_runs run; `test` (run_probs) picks the body."""
        return partial(probs, sLSE=sLSE, limits=None if test == "none" else limits(m_block), test=test)

    @staticmethod
    def check_coord_offsets(tiled_mma, shape, num_threads: int):
        """Trace-time check for mask_runs: every thread's accumulator coordinates are thread 0's
        plus one (row, column) offset, so comparing thread 0's compile-time ones against limits
        shifted by that offset tests the thread's own."""
        ident = cute.make_identity_tensor(shape)
        coords0 = tiled_mma.get_slice(0).partition_C(ident)
        for t in (t for t in (1, 3, 4, 31, 32, 77, 127, 128, 161, 255, 383) if t < num_threads):
            coords = tiled_mma.get_slice(t).partition_C(ident)
            offsets = {tuple(a - b for a, b in zip(coords[i], coords0[i], strict=True))
                       for i in range(cute.size(coords))}
            if len(offsets) != 1:
                raise ValueError(f"mask_runs: thread {t}'s accumulator coordinates are not thread 0's "
                                 f"plus one offset ({sorted(offsets)})")

    @cute.jit
    def row_limits(self, m_block, coord0_rc, n_block, key_off, query_off, diag, seqlen_k, window_left,
                   window_right, seq=None):
        """mask_runs, one masked step: per key row r of the thread, query column c (thread 0's,
        a compile-time value) sees the key iff lo[r] <= c (right bound; set past every column for
        keys past seqlen_k) and c <= hi[r] (left bound); without a right bound in[r] says whether
        the key is below seqlen_k. Two rows a thread, against 32 or 16 columns: the per-row limits
        cost a few instructions, each element one compare with an immediate (two with a left
        bound) and its select. Varlen (`seq`): the sequence's lengths read here (SeqRows.lengths)."""
        if cutlass.const_expr(seq is not None):
            seqlen_q, seqlen_k = seq.lengths()
            diag = seqlen_k - seqlen_q
        # (key - query) of this thread's element (row 0, column 0 of thread 0's coordinates) - diag
        base = n_block * self.tile_n + key_off - m_block * self.tile_m - query_off - diag
        keys_in = seqlen_k - n_block * self.tile_n - key_off
        lo, hi, row_in = [], [], []
        for r in cutlass.range_constexpr(cute.size(coord0_rc, mode=[0])):
            key0 = coord0_rc[r, 0][0]
            inside = keys_in > key0
            row_in.append(inside)
            if cutlass.const_expr(self.has_right):
                lo_r = base + key0 - window_right
                lo.append(lo_r if inside else Int32(self.tile_m))
            if cutlass.const_expr(self.has_left):
                hi.append(base + key0 + window_left)
        return lo, hi, row_in

    @cute.jit
    def run_probs(self, r: cutlass.Constexpr[int], c: cutlass.Constexpr[int], s, coord_rc, coord0_rc, sLSE,
                  scale_log2, limits, test: cutlass.Constexpr[str]):
        """P^T[r, c] in a mask_runs step. test "none": no test (a mask-free step); "keys": only
        key < seqlen_k, a per-row predicate; "edges": the compile-time column against the row's
        limits (row_limits), which also hold the seqlen_k bound."""
        p = cute.math.exp2(s * scale_log2 - sLSE[coord_rc[0, c][1]], fastmath=True)
        if cutlass.const_expr(test != "none"):
            lo, hi, row_in = limits
            col = coord0_rc[r, c][1]
            visible = row_in[r]
            if cutlass.const_expr(test == "edges"):
                visible = lo[r] <= col
                if cutlass.const_expr(self.has_left):
                    visible = visible and hi[r] >= col
            p = p if visible else Float32(0.0)
        return p

    @cute.jit
    def scores_to_probs(self, r: cutlass.Constexpr[int], c: cutlass.Constexpr[int], s, acc_S_rc, coord_rc,
                        sLSE, m_block, n_block, diag, seqlen_k, window_left, window_right,
                        scale_log2):
        """P^T[r, c] from its (softcapped) score; 0 where the key is invisible to the query.

        LSE is padded to whole query blocks on the host (+inf where P must be 0: padding, and
        rows that saw no key), so the TMA'd smem row needs no bounds test."""
        q = m_block * self.tile_m + coord_rc[0, c][1]
        key = n_block * self.tile_n + coord_rc[r, c][0]
        visible = key < seqlen_k
        if cutlass.const_expr(self.has_right):
            visible = visible and key <= q + diag + window_right
        if cutlass.const_expr(self.has_left):
            visible = visible and key >= q + diag - window_left
        p = cute.math.exp2(s * scale_log2 - sLSE[coord_rc[0, c][1]], fastmath=True)
        return p if visible else Float32(0.0)
