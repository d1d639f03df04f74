"""FlashAttention backward for Hopper (sm_90a), head dims 192 and 256: dK/dV split by head dim.

Over 800 lines because it is one kernel class with one step schedule; what it shares with bwd.py
is in bwd_common.py.

GPU-tested on the H200 (tests/test_bwd_gpu.py); every variant compiles in tests/test_bwd_compile.py.

Why not hopper/bwd.py: there each consumer warpgroup owns 64 keys and keeps 64 x hdim fp32 of
both dK and dV in registers, hdim registers per thread, which at hdim 192/256 leaves nothing of
the 240 (160 with three warpgroups) for S, dP and dQ. Here the products that accumulate over
query blocks are computed transposed, with the head dim as the WGMMA M dimension:

    dV^T (hdim x keys) += dO^T P        dK^T (hdim x keys) += Q^T dS

and the warpgroups split those rows, hdim / W each (64 or 128: a whole number of WGMMA M tiles,
so 192 takes W = 3, 256 W = 2). Per thread that is 2 * (hdim / W) * tile_n / 128 registers.
Both operands of these GEMMs come from shared memory (only A can live in registers, and here
it is dO^T / Q^T), so P and dS are written to smem, as dS already is in bwd.py for dQ.

One CTA owns `tile_n` keys of one (batch, KV head) and walks every query block of every query
head sharing that KV head (GQA needs no dK/dV reduction):

  warpgroup 0 (producer, setmaxnreg.dec): one warp loads K and V once, then Q and dO of each
      query block into rings of num_stages and do_stages stages (TMA, full/empty mbarriers), each
      with its LSE / D row.
  warpgroups 1..W (consumers, setmaxnreg.inc). Warpgroup w, per query block of 64 queries:
      S  = Q K_w^T, dP = dO V_w^T      (SS; M = queries, N = its tile_n / W keys, K = hdim)
      P  = exp2(S * scale_log2 - LSE_log2[q]) (masked), dS = P (dP - D[q])     (registers)
      P, dS -> smem (bf16); all consumers sync: every warpgroup reads all keys' P and dS
      dQ[:, cols_w] = dS K[:, cols_w]  (SS; N = its hdim / W columns) -> added to fp32 dQaccum
      dV^T[rows_w] += dO^T[rows_w] P,  dK^T[rows_w] += Q^T[rows_w] dS   (SS, under the dQ adds)
  end: dK^T * softmax_scale and dV^T stored transposed (stmatrix.trans) into K's and V's smem
      buffers, then two TMA stores. dQ is added with the scale; the caller casts.

Tile shape (BwdConfig tile_n, do_stages, dq_chunks; dispatched: hdim 256 at 64 x 80 with two Q
stages and one dO stage, 192 at 64 x 96 with two of each; with dkv_by_keys, dispatched at 192, two
warpgroups split dK^T / dV^T by keys instead, 48 each, over the whole head dim). tile_n / W keys per
warpgroup must be a multiple of 8 (WGMMA N of S and dP) and tile_n a multiple of 16 (K of dQ). Where
the warpgroup's keys are not a whole number of P's swizzle atoms (tile_n 80 or 48 at W = 2: 40 or 24
keys), P and dS use the unswizzled layout and two-matrix stmatrix (pds_smem_layout). At hdim 256 /
tile_n 80, dK^T + dV^T are 160 registers a thread and a whole 64-register dQ tile does not fit
beside them (ptxas spills and serializes every WGMMA), so dQ is computed in two 128-column chunks
through the same registers: chunk 0 is issued before dV^T and its adds run under dV^T, chunk 1
after them and its adds under dK^T. Two dO stages do not fit beside 80 keys of K and V (FA3 runs
this tile with one); with one dO stage it is released as soon as dV^T has read it, so the next
block's dO loads under dK^T.

How dQ reaches dQaccum: with BwdConfig.dq_tma off (the field default) by 8-byte fp32 atomics.
With dq_tma each warpgroup stores its dQ chunk(s) into its part of an fp32 smem tile and the producer
warpgroup's second warp adds every part with a TMA reduce-add (hopper/bwd.py's dq_per_wg hand-off).
The whole tile fits only beside FA4's smaller tiles; with dq_slots=1 only one part lives in smem and
the writer lends it to the warpgroups in part order, which fits the dispatched tiles with one P / dS
pair, and with dq_rows_interleaved the stores into it are free of bank conflicts. That combination is
dispatched at 192 and 256 (+10..+20%, then +4..+10%, docs/decisions.md); at 256 the
slot also goes round in two column halves (dq_slot_halves, +1..+2%) through
a ring of three half-size boxes (dq_slot_ring: +1..+4%); the atomics kernel
stays reachable as plan.BWD_WIDE_ATOMICS. docs/decisions.md has the step's
shared-memory budget.

At hdim 256 without softcap the step's S and dP are split by GEMM (sdp_by_gemm, dispatched in
+0.8% on the grid, +1.8% per MHz): S on warpgroup 0, dP and dS on warpgroup 1, each over
all keys; then dV^T / dK^T / dQ split by head dim as above. Two other splits tried with it
(dq_slot_per_wg, wg_roles) did not beat it and were removed (docs/decisions.md).
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

from flashhopper.config import BwdConfig
from flashhopper.hopper import layout as L
from flashhopper.hopper.barriers import BwdWideBarrier, sync_unaligned
from flashhopper.hopper.bwd_common import BwdKernelBase
from flashhopper.hopper.bwd_layout import _atom_cols, k_smem_layout
from flashhopper.hopper.layout import smem_struct
from flashhopper.hopper.mma import issue_gemm


class FlashBwdWideSm90(BwdKernelBase):
    def __init__(self, cfg: BwdConfig):
        if cfg.kv_split != "hdim":
            raise ValueError(f"FlashBwdWideSm90 takes kv_split='hdim' configs, got {cfg.kv_split!r}")
        if BwdWideBarrier.DQ_WG + 2 * cfg.num_consumer_wg > BwdWideBarrier.UNUSED_ROWS:
            raise ValueError(f"{cfg.num_consumer_wg} consumer warpgroups: their dQ barrier ids reach "
                             "UNUSED_ROWS")
        super().__init__(cfg)
        self.keys_per_wg = cfg.tile_n // cfg.num_consumer_wg
        self.dq_chunks = cfg.num_dq_chunks
        # dq_slot_halves: the slot goes round in column halves (the writer's TMA box is one half)
        self.dq_halves = 2 if cfg.dq_slot_halves else 1
        # dq_slot_ring: boxes of the slot's ring (the halves, or more of them); half-turn k of the
        # kernel (k counts every warpgroup's halves of every chunk of every step) uses box k % ring
        self.dq_ring = cfg.dq_slot_ring or self.dq_halves
        # warpgroups of the S / dP MMA: all (each its keys), or with sdp_by_gemm one (all keys)
        self.sdp_wgs = 1 if cfg.sdp_by_gemm else cfg.num_consumer_wg

    def pds_smem_layout(self):
        """(queries, keys, ds_stages) layout of the P and dS tiles, keys contiguous.

        The swizzle atom of the whole tile's width where it holds a whole number of each
        warpgroup's keys, since every warpgroup stores its own key columns (stmatrix, partitioned by
        the S / dP tiled MMA): 32 keys per warpgroup at tile_n 96 (the 64-byte atom). Otherwise (40
        keys of tile_n 80, 48 of 96 with two warpgroups, 32 of 64 whose tile-wide atom is the
        128-byte one) the interleaved (unswizzled) atom of 8 x 8 core matrices, as FA3 picks for
        64 x 80: each core matrix is 128 contiguous bytes, so stmatrix and WGMMA stay free of bank
        conflicts.
        """
        atom_cols = _atom_cols(self.dtype, self.tile_n)
        # one pair of buffers keeps the 2-D layout (and the dispatched kernels' code) unchanged
        stages = (self.cfg.ds_stages,) if self.cfg.ds_stages > 1 else ()
        if self.keys_per_wg % atom_cols == 0:
            return L.smem_layout_row_major(self.dtype, self.tile_m, self.tile_n, *stages)
        atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_INTER, self.dtype)
        shape = (self.tile_m, self.tile_n, *stages)
        return cute.tile_to_shape(atom, shape, order=tuple(range(len(shape))))

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
        mdQsem: cute.Tensor,  # (b, h, m_blocks) int32 zeros (deterministic), else any int32 tensor
        mdK: cute.Tensor,  # (b, sk, hk, d)
        mdV: cute.Tensor,  # (b, sk, hk, d)
        scale_log2: Float32,
        softcap_pre: Float32,
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        mCuQ: Optional[cute.Tensor],  # noqa: UP045  varlen: as hopper/bwd.py's
        mCuK: Optional[cute.Tensor],  # noqa: UP045
        mUsedQ: Optional[cute.Tensor],  # noqa: UP045
        mUsedK: Optional[cute.Tensor],  # noqa: UP045
        mPadQ: Optional[cute.Tensor],  # noqa: UP045
        max_seqlen_k: Optional[Int32],  # noqa: UP045
        seqused: Optional[Int32],  # noqa: UP045
        stream: cuda.CUstream,
    ):
        mQ, mK, mV, mdO, mdQaccum, mdK, mdV = [
            L.select_modes(t, [1, 3, 2, 0]) for t in (mQ, mK, mV, mdO, mdQaccum, mdK, mdV)
        ]
        mLSE, mD, mdQsem = [L.select_modes(t, [2, 1, 0]) for t in (mLSE, mD, mdQsem)]
        K_, MN_ = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        wgs = self.num_consumer_wg
        # S = Q K^T, dP = dO V^T: one WGMMA M (the 64 queries); the warpgroups split the keys (N)
        # (sdp_by_gemm: one warpgroup's MMA over all keys, S on warpgroup 0, dP on warpgroup 1)
        tiled_mma_sdp = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_, K_, Float32, atom_layout_mnk=(1, self.sdp_wgs, 1),
            tiler_mn=(64, self.tile_n // self.sdp_wgs))
        # dV^T = dO^T P, dK^T = Q^T dS: M = head dim (split across warpgroups), N = keys, K = queries.
        # A = dO^T / Q^T and B = P^T / dS^T views whose contiguous dim is M / N: both MN-major.
        # dkv_by_keys: the warpgroups split N (each its own keys_per_wg, the ones its S / dP cover)
        # and each runs all hdim / 64 M tiles.
        dkv_atoms, dkv_tiler = (wgs, 1, 1), (64, self.tile_n)
        if cutlass.const_expr(self.cfg.dkv_by_keys):
            dkv_atoms, dkv_tiler = (1, wgs, 1), (64, self.keys_per_wg)
        tiled_mma_dkv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, MN_, MN_, Float32, atom_layout_mnk=dkv_atoms, tiler_mn=dkv_tiler)
        # dQ = dS K: A = dS (keys contiguous: K-major), B = K^T view (head dim contiguous: MN-major);
        # per chunk of hdim / dq_chunks columns, split across the warpgroups
        tiled_mma_dq = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_, MN_, Float32, atom_layout_mnk=(1, wgs, 1),
            tiler_mn=(self.tile_m, self.hdim // wgs // self.dq_chunks))

        sQ_layout = L.smem_layout_row_major(self.dtype, self.tile_m, self.hdim, self.num_stages)
        sdO_layout = L.smem_layout_row_major(self.dtype, self.tile_m, self.hdim, self.do_stages)
        sK_layout = L.smem_layout_row_major(self.dtype, self.tile_n, self.hdim)
        if cutlass.const_expr(self.cfg.dkv_by_keys):
            # dQ's B operand K^T is split by head dim into hdim / W columns (96 at hdim 192 with two
            # warpgroups: 1.5 atoms of the 128-byte swizzle, which WGMMA cannot start inside)
            sK_layout = k_smem_layout(self.dtype, self.tile_n, self.hdim, wgs)
        sP_layout = self.pds_smem_layout()
        # per-query LSE (D) of each Q (dO) stage, loaded on the same barriers as Q (dO)
        sLSE_layout = cute.make_layout((self.tile_m, self.num_stages))
        sD_layout = cute.make_layout((self.tile_m, self.do_stages))

        # dq_tma: the fp32 dQ tile, each warpgroup part (and chunk) whole swizzle atoms; with
        # dq_slots one part, which every part passes through
        sdQ_layout = k_smem_layout(Float32, self.tile_m, self.hdim, self.num_dq_parts)
        if cutlass.const_expr(self.cfg.dq_slots):
            sdQ_layout = self.dq_part_layout(sdQ_layout)
            if cutlass.const_expr(self.dq_ring > self.dq_halves):
                # the ring's boxes side by side, each whole 128-byte swizzle atoms of fp32
                sdQ_layout = L.smem_layout_row_major(Float32, self.tile_m, self.dq_slot_cols * self.dq_ring)
        # dq_slots: one warpgroup's dQ MMA over one part (with dq_slot_halves one half of a part), to
        # partition the slot by thread % 128
        tiled_mma_dq_part = None
        if cutlass.const_expr(self.cfg.dq_slots):
            tiled_mma_dq_part = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, K_, MN_, Float32, atom_layout_mnk=(1, 1, 1),
                tiler_mn=(self.tile_m, self.dq_slot_cols))
            self.check_part_mma(tiled_mma_dq, tiled_mma_dq_part)
        SharedStorage = self.shared_storage(sQ_layout, sdO_layout, sK_layout, sP_layout, sLSE_layout,
                                            sD_layout, sdQ_layout)

        load_op = cpasync.CopyBulkTensorTileG2SOp()
        one_stage = cute.select(sQ_layout, mode=[0, 1])
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(load_op, mQ, one_stage, (self.tile_m, self.hdim))
        tma_atom_dO, tma_dO = cpasync.make_tiled_tma_atom(load_op, mdO, one_stage, (self.tile_m, self.hdim))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(load_op, mK, sK_layout, (self.tile_n, self.hdim))
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(load_op, mV, sK_layout, (self.tile_n, self.hdim))
        row_tile = cute.make_layout(self.tile_m)
        tma_atom_LSE, tma_LSE = cpasync.make_tiled_tma_atom(load_op, mLSE, row_tile, (self.tile_m,))
        tma_atom_D, tma_D = cpasync.make_tiled_tma_atom(load_op, mD, row_tile, (self.tile_m,))
        # dK / dV leave through K's and V's smem buffers (same (keys, hdim) tile as the loads)
        store_op = cpasync.CopyBulkTensorTileS2GOp()
        tma_atom_dK, tma_dK = cpasync.make_tiled_tma_atom(store_op, mdK, sK_layout, (self.tile_n, self.hdim))
        tma_atom_dV, tma_dV = cpasync.make_tiled_tma_atom(store_op, mdV, sK_layout, (self.tile_n, self.hdim))
        # dq_tma: the writer's TMA box is one part (a warpgroup's columns of one chunk)
        tma_atom_dQ, dQaccum = None, mdQaccum
        if cutlass.const_expr(self.cfg.dq_tma):
            tma_atom_dQ, dQaccum = cpasync.make_tiled_tma_atom(
                cpasync.CopyReduceBulkTensorTileS2GOp(),
                self.dq_rows_view(mdQaccum),
                self.dq_part_layout(sdQ_layout, self.dq_slot_cols),
                (self.tile_m, self.dq_slot_cols))

        grid = self.grid(mK, mUsedK, max_seqlen_k)
        self.kernel(
            tma_Q, tma_K, tma_V, tma_dO, tma_LSE, tma_D, dQaccum, mdQsem, tma_dK, tma_dV,
            tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE, tma_atom_D,
            tma_atom_dK, tma_atom_dV,
            scale_log2, softcap_pre, softmax_scale, window_left, window_right,
            sQ_layout, sdO_layout, sK_layout, sP_layout, sLSE_layout, sD_layout, tiled_mma_sdp,
            tiled_mma_dkv, tiled_mma_dq,
            SharedStorage, tma_atom_dQ, sdQ_layout, tiled_mma_dq_part,
            mCuQ, mCuK, mUsedQ, mUsedK, mPadQ, seqused, mdK if self.cfg.varlen else None,
            mdV if self.cfg.varlen else None,
        ).launch(grid=grid, block=[128 * (1 + wgs), 1, 1], stream=stream, min_blocks_per_mp=1,
                 use_pdl=self.cfg.pdl)

    @cute.kernel
    def kernel(self, mQ, mK, mV, mdO, mLSE, mD, mdQaccum, mdQsem, mdK, mdV,
               tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
               tma_atom_dO: cute.CopyAtom, tma_atom_LSE: cute.CopyAtom, tma_atom_D: cute.CopyAtom,
               tma_atom_dK: cute.CopyAtom, tma_atom_dV: cute.CopyAtom, scale_log2: Float32,
               softcap_pre: Float32, softmax_scale: Float32, window_left: Int32, window_right: Int32,
               sQ_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout,
               sLSE_layout: cute.Layout, sD_layout: cute.Layout, tiled_mma_sdp: cute.TiledMma,
               tiled_mma_dkv: cute.TiledMma, tiled_mma_dq: cute.TiledMma,
               SharedStorage: cutlass.Constexpr, tma_atom_dQ, sdQ_layout: cute.ComposedLayout,
               tiled_mma_dq_part, mCuQ, mCuK, mUsedQ, mUsedK, mPadQ, seqused, mdK_rows, mdV_rows):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE, tma_atom_D,
                         tma_atom_dK, tma_atom_dV):
                cpasync.prefetch_descriptor(atom)
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        sdS = storage.sdS.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        sLSE = storage.sLSE.get_tensor(sLSE_layout)
        sD = storage.sD.get_tensor(sD_layout)
        sdQ = None
        if cutlass.const_expr(self.cfg.dq_tma):
            sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)
            if warp_idx == 0:
                cpasync.prefetch_descriptor(tma_atom_dQ)

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
            tma_atom_LSE=tma_atom_LSE, tma_atom_D=tma_atom_D, tma_atom_dK=tma_atom_dK,
            tma_atom_dV=tma_atom_dV,
            scale_log2=scale_log2, softcap_pre=softcap_pre, softmax_scale=softmax_scale,
            window_left=window_left, window_right=window_right, tiled_mma_sdp=tiled_mma_sdp,
            tiled_mma_dkv=tiled_mma_dkv, tiled_mma_dq=tiled_mma_dq, tma_atom_dQ=tma_atom_dQ,
            tiled_mma_dq_part=tiled_mma_dq_part, warp_idx=warp_idx, tidx=tidx, sQ=sQ, sdO=sdO, sK=sK, sV=sV,
            sP=sP, sdS=sdS, sdQ=sdQ, sLSE=sLSE, sD=sD, pipe_kv=pipe_kv, pipe_q=pipe_q, pipe_do=pipe_do,
            work=work)
        if cutlass.const_expr(self.cfg.varlen):
            if self.has_keys(work.n_block, work.seqlen_k):  # else a key block past the sequence's end
                roles()
        else:
            roles()

    @cute.jit
    def roles(self, mQ, mK, mV, mdO, mLSE, mD, mdQaccum, mdQsem, mdK, mdV, tma_atom_Q, tma_atom_K, tma_atom_V,
              tma_atom_dO, tma_atom_LSE, tma_atom_D, tma_atom_dK, tma_atom_dV, scale_log2, softcap_pre,
              softmax_scale, window_left, window_right, tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq,
              tma_atom_dQ, tiled_mma_dq_part, warp_idx, tidx, sQ, sdO, sK, sV, sP, sdS, sdQ, sLSE, sD,
              pipe_kv, pipe_q, pipe_do, work):
        """The warps' roles for this CTA's key block (the producer warpgroup's warps, the consumer
        warpgroups)."""
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.cfg.producer_regs)
            if warp_idx == 0:
                self.produce(mQ, mK, mV, mdO, mLSE, mD, sQ, sK, sV, sdO, sLSE, sD, tma_atom_Q,
                             tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE, tma_atom_D, pipe_kv,
                             pipe_q, pipe_do, work)
            if cutlass.const_expr(self.cfg.dq_tma):
                if warp_idx == 1:
                    writer = self.write_dq_slot if self.cfg.dq_slots else self.write_dq
                    writer(mdQaccum, mdQsem, sdQ, tma_atom_dQ, work, window_left, window_right)
        else:
            cute.arch.setmaxregister_increase(self.cfg.consumer_regs)
            self.consume(sLSE, sD, mdQaccum, mdQsem, mdK, mdV, tma_atom_dK, tma_atom_dV, sQ, sK, sV, sdO, sP,
                         sdS, sdQ, tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, tiled_mma_dq_part, pipe_kv,
                         pipe_q, pipe_do,
                         tidx - 128, work, scale_log2, softcap_pre, softmax_scale, window_left, window_right)

    @cute.jit
    def consume(self, sLSE, sD, mdQaccum, mdQsem, mdK, mdV, tma_atom_dK, tma_atom_dV, sQ, sK, sV, sdO,
                sP, sdS, sdQ, tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, tiled_mma_dq_part, pipe_kv, pipe_q,
                pipe_do, tidx, work, scale_log2, softcap_pre, softmax_scale, window_left, window_right):
        n_block, head_kv, batch, ratio, m_min, num_m, num_steps, seqlen_q, seqlen_k, seq = (
            work.n_block, work.head_kv, work.batch, work.ratio, work.m_min, work.num_m, work.num_steps,
            work.seqlen_q, work.seqlen_k, work.seq)
        wg = cute.arch.make_warp_uniform(tidx // 128)
        if cutlass.const_expr(self.cfg.pdl and not self.cfg.dq_tma):
            cute.arch.griddepcontrol_wait()  # BwdConfig.pdl: the atomics add into the cleared dQaccum
        # smem descriptors depend only on the warpgroup; register partitions on the thread
        sdp_tidx = tidx % 128 if self.cfg.sdp_by_gemm else tidx
        wg_sdp = tiled_mma_sdp.get_slice(0 if self.cfg.sdp_by_gemm else wg * 128)
        wg_dkv = tiled_mma_dkv.get_slice(wg * 128)
        wg_dq = tiled_mma_dq.get_slice(wg * 128)
        thr_sdp = tiled_mma_sdp.get_slice(sdp_tidx)
        thr_dq = tiled_mma_dq.get_slice(tidx)

        # S = Q K^T, dP = dO V^T: A = Q / dO (stage), B = this warpgroup's rows of K / V
        tSrQ = wg_sdp.make_fragment_A(wg_sdp.partition_A(sQ))
        tSrK = wg_sdp.make_fragment_B(wg_sdp.partition_B(sK))
        tPrdO = wg_sdp.make_fragment_A(wg_sdp.partition_A(sdO))
        tPrV = wg_sdp.make_fragment_B(wg_sdp.partition_B(sV))
        # dV^T += dO^T P, dK^T += Q^T dS: A = (hdim, queries) views of dO / Q (stage),
        # B = (keys, queries) views of P / dS
        tVrdO = wg_dkv.make_fragment_A(wg_dkv.partition_A(L.transpose_view(sdO)))
        tVrP = wg_dkv.make_fragment_B(wg_dkv.partition_B(L.transpose_view(sP)))
        tKrQ = wg_dkv.make_fragment_A(wg_dkv.partition_A(L.transpose_view(sQ)))
        tKrdS = wg_dkv.make_fragment_B(wg_dkv.partition_B(L.transpose_view(sdS)))
        # dQ = dS K: A = dS (queries, keys), B = K^T (hdim, keys): this warpgroup's head-dim columns
        # (dq_chunks 2: chunk c is head-dim columns [c * hdim / 2, (c + 1) * hdim / 2), of which
        # warpgroup w adds the w-th hdim / (2 W))
        tQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))  # (..., ds_stages)
        dq_cols = self.hdim // self.dq_chunks
        sKt = L.transpose_view(sK)
        if cutlass.const_expr(self.dq_chunks > 1):
            tQrK = [wg_dq.make_fragment_B(wg_dq.partition_B(
                cute.local_tile(sKt, (dq_cols, self.tile_n), (c, 0)))) for c in range(self.dq_chunks)]
        else:
            tQrK = [wg_dq.make_fragment_B(wg_dq.partition_B(sKt))]

        shape_sdp = (self.tile_m, self.tile_n)
        acc_S = cute.make_rmem_tensor(tiled_mma_sdp.partition_shape_C(shape_sdp), Float32)
        # sdp_by_gemm: one accumulator, S on warpgroup 0 and dP on warpgroup 1
        acc_dP = acc_S if self.cfg.sdp_by_gemm else cute.make_rmem_tensor(
            tiled_mma_sdp.partition_shape_C(shape_sdp), Float32)
        acc_dV = cute.make_rmem_tensor(tiled_mma_dkv.partition_shape_C((self.hdim, self.tile_n)), Float32)
        acc_dK = cute.make_rmem_tensor(tiled_mma_dkv.partition_shape_C((self.hdim, self.tile_n)), Float32)
        acc_dQ = cute.make_rmem_tensor(tiled_mma_dq.partition_shape_C((self.tile_m, dq_cols)), Float32)
        acc_S_rc = L.acc_rows_cols(acc_S)
        acc_dP_rc = L.acc_rows_cols(acc_dP)
        # (query, key) of each S / dP register, within the tile
        coord_rc = L.acc_rows_cols(thr_sdp.partition_C(cute.make_identity_tensor(shape_sdp)))
        coord0_rc = None
        if cutlass.const_expr(self.cfg.sdp_by_gemm):
            coord0_rc = L.acc_rows_cols(tiled_mma_sdp.get_slice(0).partition_C(
                cute.make_identity_tensor(shape_sdp)))
        dq_coords = [thr_dq.partition_C(cute.make_identity_tensor((self.tile_m, self.hdim)))]
        if cutlass.const_expr(self.dq_chunks > 1):
            dq_coords = [thr_dq.partition_C(cute.local_tile(
                cute.make_identity_tensor((self.tile_m, self.hdim)), (self.tile_m, dq_cols), (0, c)))
                for c in range(self.dq_chunks)]
        tdQsdQ = None
        dq_copy = None
        rdQ_half = None
        if cutlass.const_expr(self.cfg.dq_tma):
            # dQ fragments to the smem tile as 8-byte stores (the WGMMA C layout's column pairs)
            st_dq = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=64)
            sdQ = self.dq_rows_smem(sdQ)  # with dq_rows_interleaved a half-warp's rows on distinct phases
            if cutlass.const_expr(self.cfg.dq_slots):
                # every part goes through the one slot: this thread's place in it is where the
                # same thread of warpgroup 0 would write part 0 (check_part_mma)
                dq_copy = cute.make_tiled_copy_C(st_dq, tiled_mma_dq_part).get_slice(tidx % 128)
                # dq_slot_halves: [half 0, half 1] of the slot, the same for every chunk; with a
                # longer ring the box is picked per half-turn (stage_dq), from the slot itself
                halves = [dq_copy.partition_D(cute.local_tile(sdQ, (self.tile_m, self.dq_slot_cols), (0, h)))
                          for h in range(self.dq_halves)]
                tdQsdQ = [halves] * self.dq_chunks
                if cutlass.const_expr(self.dq_ring > self.dq_halves):
                    tdQsdQ = [[sdQ] * self.dq_halves] * self.dq_chunks
                if cutlass.const_expr(self.dq_halves > 1):
                    # the registers one half goes out from, in the half MMA's fragment shape
                    rdQ_half = cute.make_rmem_tensor(
                        tiled_mma_dq_part.partition_shape_C((self.tile_m, self.dq_slot_cols)), Float32)
            else:
                dq_copy = cute.make_tiled_copy_C(st_dq, tiled_mma_dq).get_slice(tidx)
                tdQsdQ = [[dq_copy.partition_D(cute.local_tile(sdQ, (self.tile_m, dq_cols), (0, c)))]
                          for c in range(self.dq_chunks)]
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)
        # four 8 x 8 matrices (16 keys) per stmatrix where the warpgroup's keys come in 16s; two
        # (8 keys) at 40 or 24 keys per warpgroup (tile_n 80, 48)
        num_matrices = 4 if (self.tile_n // self.sdp_wgs) % 16 == 0 else 2
        st_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=num_matrices), self.dtype)
        st_copy = cute.make_tiled_copy_C(st_atom, tiled_mma_sdp).get_slice(sdp_tidx)
        tPsP = st_copy.partition_D(sP)
        tdSsdS = st_copy.partition_D(sdS)
        # sdp_by_gemm: warpgroup 1 reads P back into the registers that thread of warpgroup 0 held it in
        ld_atom, tPsP_ld = None, None
        if cutlass.const_expr(self.cfg.sdp_by_gemm):
            ld_atom = cute.make_copy_atom(
                cute.nvgpu.warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=num_matrices), self.dtype)
            ld_copy = cute.make_tiled_copy_C(ld_atom, tiled_mma_sdp).get_slice(sdp_tidx)
            tPsP_ld = (ld_copy, ld_copy.partition_S(sP))
        # ds_stages 2: step i writes P / dS buffer i % 2 (the last mode of every view above)
        pds = Int32(0)

        issue = issue_gemm
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_kv.consumer_wait(kv_state)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        # the dO ring's own state, used only when its depth differs from the Q ring's (an alias of
        # `state` made before the loop would be carried as a second, never advanced, state)
        do_ring = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.do_stages)
        if cutlass.const_expr(seq is not None):
            self.zero_unused_keys(sK, sV, n_block, seq, BwdWideBarrier.UNUSED_ROWS)
        diag = seqlen_k - seqlen_q
        num_rows = cute.size(acc_S_rc, mode=[0])
        num_cols = cute.size(acc_S_rc, mode=[1])
        for step in cutlass.range(num_steps, unroll=1):
            do_state = do_ring
            if cutlass.const_expr(self.do_stages == self.num_stages):
                do_state = state
            head = head_kv * ratio + step // num_m
            m_block = m_min + step % num_m
            if cutlass.const_expr(seq is not None):  # Q / dO rows past the sequence's seqused_q zeroed
                self.zero_unused_queries(sQ, sdO, pipe_q, state, pipe_do, do_state, m_block, seq,
                                         BwdWideBarrier.UNUSED_ROWS)
            pipe_q.consumer_wait(state)
            if cutlass.const_expr(self.cfg.sdp_by_gemm):
                pipe_do.consumer_wait(do_state)
                if wg == 0:
                    issue(tiled_mma_sdp, acc_S, tSrQ[None, None, None, state.index], tSrK, zero_init=True)
                else:
                    issue(tiled_mma_sdp, acc_S, tPrdO[None, None, None, do_state.index], tPrV, zero_init=True)
                lse, d_row, lo, hi = self.row_limits(coord_rc, sLSE, sD, state, do_state, m_block, n_block,
                                                     seqlen_k, diag, window_left, window_right, num_rows, seq)
                warpgroup.wait_group(0)
                tVrP_s = self.pds_buffer(tVrP, pds)
                tKrdS_s = self.pds_buffer(tKrdS, pds)
                tQrdS_s = self.pds_buffer(tQrdS, pds)
                if cutlass.const_expr(self.cfg.ds_stages == 1):
                    # every warpgroup's GEMMs of the previous query block are done with sP / sdS
                    cute.arch.barrier(barrier_id=BwdWideBarrier.PDS_FREE,
                                      number_of_threads=self.num_consumer_threads)
                if wg == 0:
                    # a thread's key columns are thread 0's (compile-time) plus one offset: the bounds
                    # shifted once per row, each element compared against an immediate (hopper/mask.py)
                    col_offset = coord_rc[0, 0][1] - coord0_rc[0, 0][1]
                    for r in cutlass.range_constexpr(num_rows):
                        for c in cutlass.range_constexpr(num_cols):
                            acc_S_rc[r, c] = self.prob(acc_S_rc[r, c], coord0_rc[r, c][1], lse[r],
                                                       lo[r] - col_offset, hi[r] - col_offset, scale_log2)
                    rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
                    rP.store(acc_S.load().to(self.dtype))
                    cute.copy(st_atom, st_copy.retile(rP), self.pds_buffer(tPsP, pds))
                    # generic-proxy smem writes, read next by WGMMA (async proxy) and by ldmatrix
                    cute.arch.fence_view_async_shared()
                    cute.arch.barrier_arrive(barrier_id=BwdWideBarrier.P_FULL,
                                             number_of_threads=self.num_consumer_threads)
                    # this warpgroup's dV^T reads what all its threads wrote
                    cute.arch.barrier(barrier_id=BwdWideBarrier.WG_PDS, number_of_threads=128)
                else:
                    cute.arch.barrier(barrier_id=BwdWideBarrier.P_FULL,
                                      number_of_threads=self.num_consumer_threads)
                issue(tiled_mma_dkv, acc_dV, tVrdO[None, None, None, do_state.index], tVrP_s, zero_init=False)
                if wg != 0:
                    # dS = P (dP - D), P as warpgroup 0's thread held it, under dV^T
                    ld_copy, tPsP_src = tPsP_ld
                    rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
                    cute.copy(ld_atom, self.pds_buffer(tPsP_src, pds), ld_copy.retile(rP))
                    rdS = self.ds_from_rounded_p(acc_S, rP, d_row, softmax_scale)
                    cute.copy(st_atom, st_copy.retile(rdS), self.pds_buffer(tdSsdS, pds))
                    cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=BwdWideBarrier.PDS_FULL,
                                  number_of_threads=self.num_consumer_threads)
                issue(tiled_mma_dq, acc_dQ, tQrdS_s, tQrK[0], zero_init=True)
                warpgroup.wait_group(0)
                # dV^T has read dO (and dP long before)
                pipe_do.consumer_release(do_state)
                self.emit_dq(acc_dQ, rdQ_half, dq_copy, tdQsdQ, dq_coords, 0, wg, mdQaccum, mdQsem, m_block,
                             n_block, head, batch, seqlen_q, seqlen_k, window_left, window_right, tidx,
                             softmax_scale, step)
                issue(tiled_mma_dq, acc_dQ, tQrdS_s, tQrK[1], zero_init=True)
                issue(tiled_mma_dkv, acc_dK, tKrQ[None, None, None, state.index], tKrdS_s, zero_init=False)
                warpgroup.wait_group(1)
                self.emit_dq(acc_dQ, rdQ_half, dq_copy, tdQsdQ, dq_coords, 1, wg, mdQaccum, mdQsem, m_block,
                             n_block, head, batch, seqlen_q, seqlen_k, window_left, window_right, tidx,
                             softmax_scale, step)
                warpgroup.wait_group(0)
                pipe_q.consumer_release(state)
            else:
                issue(tiled_mma_sdp, acc_S, tSrQ[None, None, None, state.index], tSrK, zero_init=True)
                pipe_do.consumer_wait(do_state)
                issue(tiled_mma_sdp, acc_dP, tPrdO[None, None, None, do_state.index], tPrV, zero_init=True)

                lse, d_row, lo, hi = self.row_limits(coord_rc, sLSE, sD, state, do_state, m_block, n_block,
                                                     seqlen_k, diag, window_left, window_right, num_rows, seq)

                warpgroup.wait_group(1)
                if cutlass.const_expr(self.has_softcap):
                    # only tanh before the dP wait: P and the tanh derivative are formed from it after,
                    # so (1 - tanh^2) never has to be held next to P
                    for j in cutlass.range(cute.size(acc_S), unroll_full=True):
                        acc_S[j] = cute.math.tanh(acc_S[j] * softcap_pre, fastmath=True)
                    warpgroup.wait_group(0)
                    for r in cutlass.range_constexpr(num_rows):
                        for c in cutlass.range_constexpr(num_cols):
                            t = acc_S_rc[r, c]
                            p = self.prob(t, coord_rc[r, c][1], lse[r], lo[r], hi[r], scale_log2)
                            acc_S_rc[r, c] = p
                            acc_dP_rc[r, c] = p * self.dp_minus_d(acc_dP_rc[r, c], d_row[r],
                                                                  softmax_scale) * (Float32(1.0) - t * t)
                else:
                    # P under the dP GEMM, dS once it lands
                    for r in cutlass.range_constexpr(num_rows):
                        for c in cutlass.range_constexpr(num_cols):
                            acc_S_rc[r, c] = self.prob(acc_S_rc[r, c], coord_rc[r, c][1], lse[r], lo[r],
                                                       hi[r], scale_log2)
                    warpgroup.wait_group(0)
                    for r in cutlass.range_constexpr(num_rows):
                        for c in cutlass.range_constexpr(num_cols):
                            acc_dP_rc[r, c] = acc_S_rc[r, c] * self.dp_minus_d(acc_dP_rc[r, c], d_row[r],
                                                                               softmax_scale)
                rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
                rP.store(acc_S.load().to(self.dtype))
                rdS = cute.make_rmem_tensor_like(acc_dP, self.dtype)
                rdS.store(acc_dP.load().to(self.dtype))

                # Every warpgroup reads every warpgroup's P and dS columns: overwrite them only once
                # all GEMMs of the previous query block are done (each warpgroup waited for its own
                # before coming here), and issue the GEMMs only once all of them are written. With
                # two buffers the first barrier goes: this step's buffer was last read two steps back,
                # and every warpgroup finished those GEMMs before it arrived at the last step's "full".
                if cutlass.const_expr(self.cfg.ds_stages == 1):
                    cute.arch.barrier(barrier_id=BwdWideBarrier.PDS_FREE,
                                      number_of_threads=self.num_consumer_threads)
                cute.copy(st_atom, st_copy.retile(rP), self.pds_buffer(tPsP, pds))
                cute.copy(st_atom, st_copy.retile(rdS), self.pds_buffer(tdSsdS, pds))
                # generic-proxy smem writes, read next by WGMMA (async proxy)
                cute.arch.fence_view_async_shared()
                tVrP_s = self.pds_buffer(tVrP, pds)
                tKrdS_s = self.pds_buffer(tKrdS, pds)
                tQrdS_s = self.pds_buffer(tQrdS, pds)
                cute.arch.barrier(barrier_id=BwdWideBarrier.PDS_FULL,
                                  number_of_threads=self.num_consumer_threads)
                # dQ first, so its atomics run under dV and dK
                issue(tiled_mma_dq, acc_dQ, tQrdS_s, tQrK[0], zero_init=True)
                issue(tiled_mma_dkv, acc_dV, tVrdO[None, None, None, do_state.index], tVrP_s,
                      zero_init=False)
                if cutlass.const_expr(self.dq_chunks == 2):
                    # dQ in two halves through the same registers: the first's atomics under dV^T, the
                    # second's under dK^T
                    warpgroup.wait_group(1)
                    self.emit_dq(acc_dQ, rdQ_half, dq_copy, tdQsdQ, dq_coords, 0, wg, mdQaccum, mdQsem,
                                 m_block, n_block, head, batch, seqlen_q, seqlen_k, window_left, window_right,
                                 tidx, softmax_scale, step)
                    issue(tiled_mma_dq, acc_dQ, tQrdS_s, tQrK[1], zero_init=True)
                    issue(tiled_mma_dkv, acc_dK, tKrQ[None, None, None, state.index], tKrdS_s,
                          zero_init=False)
                    warpgroup.wait_group(1)
                    # dV^T has read dO
                    pipe_do.consumer_release(do_state)
                    self.emit_dq(acc_dQ, rdQ_half, dq_copy, tdQsdQ, dq_coords, 1, wg, mdQaccum, mdQsem,
                                 m_block, n_block, head, batch, seqlen_q, seqlen_k, window_left, window_right,
                                 tidx, softmax_scale, step)
                    warpgroup.wait_group(0)
                    pipe_q.consumer_release(state)
                else:
                    issue(tiled_mma_dkv, acc_dK, tKrQ[None, None, None, state.index], tKrdS_s,
                          zero_init=False)
                    # dQ has landed (issued first)
                    warpgroup.wait_group(2)
                    self.emit_dq(acc_dQ, rdQ_half, dq_copy, tdQsdQ, dq_coords, 0, wg, mdQaccum, mdQsem,
                                 m_block, n_block, head, batch, seqlen_q, seqlen_k, window_left, window_right,
                                 tidx, softmax_scale, step)
                    if cutlass.const_expr(self.do_stages == 1):
                        # one dO stage: hand it back as soon as dV^T has read it (usually done under
                        # the atomics already), so the next block's dO loads under dK^T, not after it
                        warpgroup.wait_group(1)
                        pipe_do.consumer_release(do_state)
                        warpgroup.wait_group(0)
                        pipe_q.consumer_release(state)
                    else:
                        warpgroup.wait_group(0)
                        pipe_q.consumer_release(state)
                        pipe_do.consumer_release(do_state)
            state.advance()
            if cutlass.const_expr(self.do_stages != self.num_stages):
                do_ring.advance()
            if cutlass.const_expr(self.cfg.ds_stages == 2):
                pds = pds ^ 1

        self.epilogue(acc_dK, acc_dV, tidx, tiled_mma_dkv, sK, sV, mdK, mdV, tma_atom_dK, tma_atom_dV,
                      n_block, head_kv, batch, softmax_scale, seq, seqlen_k)

    @cute.jit
    def epilogue(self, acc_dK, acc_dV, tidx, tiled_mma_dkv, sK, sV, mdK, mdV, tma_atom_dK, tma_atom_dV,
                 n_block, head_kv, batch, softmax_scale, seq=None, seqlen_k=None):
        """dK^T, dV^T through K's and V's smem buffers and TMA stores, which also drop the rows past
        seqlen_k. dK carries the softmax scale: dS is the gradient of the scaled scores."""
        if cutlass.const_expr(seq is not None):
            tidx = self.consumer_tidx()
        rdK = cute.make_rmem_tensor_like(acc_dK, self.dtype)
        if cutlass.const_expr(self.cfg.scale_in_ds):
            rdK.store(acc_dK.load().to(self.dtype))  # dS carried the scale
        else:
            rdK.store((acc_dK.load() * softmax_scale).to(self.dtype))
        rdV = cute.make_rmem_tensor_like(acc_dV, self.dtype)
        rdV.store(acc_dV.load().to(self.dtype))
        # Every warpgroup's S / dP read all head-dim columns of its keys' K / V rows, and its dQ
        # all keys of its K columns: each has waited for its own GEMMs, this waits for the others'.
        cute.arch.barrier(barrier_id=BwdWideBarrier.EPILOGUE, number_of_threads=self.num_consumer_threads)
        # The fragments are (hdim, keys), the buffers (keys, hdim) with hdim contiguous: the
        # transposing stmatrix writes each 8 x 8 block into the (hdim, keys) view of the buffer.
        st_t_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
        st_t_copy = cute.make_tiled_copy_C(st_t_atom, tiled_mma_dkv).get_slice(tidx)
        cute.copy(st_t_atom, st_t_copy.retile(rdK), st_t_copy.partition_D(L.transpose_view(sK)))
        cute.copy(st_t_atom, st_t_copy.retile(rdV), st_t_copy.partition_D(L.transpose_view(sV)))
        # generic-proxy smem writes, read next by the TMA unit (async proxy)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=BwdWideBarrier.EPILOGUE, number_of_threads=self.num_consumer_threads)
        self.store_dkv(mdK, mdV, sK, sV, tma_atom_dK, tma_atom_dV, n_block, head_kv, batch, tidx, seq,
                       seqlen_k)

    @property
    def num_dq_parts(self) -> int:
        """dq_tma: TMA reduce-adds per step, one per (warpgroup, dQ chunk)."""
        return self.num_consumer_wg * self.dq_chunks

    @property
    def dq_part_cols(self) -> int:
        """dq_tma: head-dim columns of one part. Chunk c's tiled MMA covers columns
        [c * hdim / chunks, (c + 1) * hdim / chunks), warpgroup w the w-th 1 / W of those: part
        c * W + w, counting parts along the head dim."""
        return self.hdim // self.num_dq_parts

    @property
    def dq_slot_cols(self) -> int:
        """dq_tma: head-dim columns of one writer TMA box: a part, or with dq_slot_halves half of one."""
        return self.dq_part_cols // self.dq_halves

    def dq_part_layout(self, sdQ_layout, cols=None):
        """Part 0 (`cols` columns: a part by default) of the smem dQ tile, the TMA atom's smem side;
        the other parts are the same layout at offsets of whole swizzle periods (checked here, at
        trace time)."""
        parts = cute.zipped_divide(sdQ_layout.outer, (self.tile_m, cols or self.dq_part_cols))
        rest = cute.get(parts, mode=[1])
        for i in range(cute.size(rest)):
            if (rest(i) * 4) % 1024:
                raise ValueError(f"dq_tma: dQ part {i} starts at {rest(i)} fp32, not whole 1 KiB")
        return cute.make_composed_layout(sdQ_layout.inner, 0, cute.get(parts, mode=[0]))

    def shared_storage(self, sQ_layout, sdO_layout, sK_layout, sP_layout, sLSE_layout, sD_layout, sdQ_layout):
        """The kernel's shared memory (layout.smem_struct: built from a dict)."""
        mem, align = cute.struct.MemRange, cute.struct.Align
        fields = {
            "mbar_KV": mem[cutlass.Int64, 2],
            "mbar_Q": mem[cutlass.Int64, 2 * self.num_stages],
            "mbar_dO": mem[cutlass.Int64, 2 * self.do_stages],
            "sK": align[mem[self.dtype, cute.cosize(sK_layout)], 1024],
            "sV": align[mem[self.dtype, cute.cosize(sK_layout)], 1024],
            "sQ": align[mem[self.dtype, cute.cosize(sQ_layout)], 1024],
            "sdO": align[mem[self.dtype, cute.cosize(sdO_layout)], 1024],
            "sP": align[mem[self.dtype, cute.cosize(sP_layout)], 1024],
            "sdS": align[mem[self.dtype, cute.cosize(sP_layout)], 1024],
            "sLSE": align[mem[Float32, cute.cosize(sLSE_layout)], 128],
            "sD": align[mem[Float32, cute.cosize(sD_layout)], 128],
        }
        if self.cfg.dq_tma:  # last, so that the other buffers keep their offsets
            fields["sdQ"] = align[mem[Float32, cute.cosize(sdQ_layout)], 1024]
        return smem_struct(fields)

    def ring_box(self, step, c: int, wg, h: int):
        """dq_slot_ring: the slot's box of half-turn (step, chunk c, warpgroup wg, half h); the
        writer hands the boxes out in this order."""
        per_step = self.dq_chunks * self.num_consumer_wg * self.dq_halves
        return (step * per_step + (c * self.num_consumer_wg + wg) * self.dq_halves + h) % self.dq_ring

    @cute.jit
    def stage_dq(self, acc_dQ, rdQ_half, dq_copy, tdQsdQ_c, wg, softmax_scale,
                 first: cutlass.Constexpr[bool], last: cutlass.Constexpr[bool], step,
                 c: cutlass.Constexpr[int]):
        """dq_tma: this warpgroup's dQ chunk into its part of the smem tile, once the writer has
        read the previous step's (first chunk); hand the part over after the last chunk. With
        dq_slots every chunk waits for the slot's grant and hands it back, with dq_slot_halves
        one column half at a time (`tdQsdQ_c`: the destination of each half, or with a longer
        ring the slot, whose box `ring_box` picks)."""
        for h in cutlass.range_constexpr(self.dq_halves):
            dst = tdQsdQ_c[h]
            if cutlass.const_expr(self.dq_ring > self.dq_halves):
                box = self.ring_box(step, c, wg, h)
                dst = dq_copy.partition_D(
                    cute.local_tile(tdQsdQ_c[h], (self.tile_m, self.dq_slot_cols), (0, box)))
            if cutlass.const_expr(self.cfg.dq_slots):  # the writer waits at the grant in its own code
                sync_unaligned(BwdWideBarrier.DQ_WG + wg, 128 + 32)
            elif cutlass.const_expr(first):
                cute.arch.barrier(barrier_id=BwdWideBarrier.DQ_WG + wg, number_of_threads=128 + 32)
            if cutlass.const_expr(h == 0 and not self.cfg.scale_in_ds):
                acc_dQ.store(acc_dQ.load() * softmax_scale)  # so the host only casts dQaccum
            if cutlass.const_expr(self.dq_halves == 1):
                cute.copy(dq_copy, dq_copy.retile(acc_dQ), dst)
            else:
                # the half's values are a contiguous run of the chunk's fragment (check_part_mma)
                n = cute.size(rdQ_half)
                for i in cutlass.range_constexpr(n):
                    rdQ_half[i] = acc_dQ[h * n + i]
                cute.copy(dq_copy, dq_copy.retile(rdQ_half), dst)
            if cutlass.const_expr(last or self.cfg.dq_slots):
                # generic-proxy smem writes, read next by the TMA unit (async proxy)
                cute.arch.fence_view_async_shared()
                full = BwdWideBarrier.DQ_WG + self.num_consumer_wg + wg
                if cutlass.const_expr(self.cfg.dq_slots):
                    # the slot's hand-back as a barrier both sides wait at (the writer is already there):
                    # the slot passes between warpgroups through the writer, an ordering racecheck follows
                    # through barrier syncs, not through an arrive
                    sync_unaligned(full, 128 + 32)
                else:
                    cute.arch.barrier_arrive(barrier_id=full, number_of_threads=128 + 32)

    @cute.jit
    def row_limits(self, coord_rc, sLSE, sD, state, do_state, m_block, n_block, seqlen_k, diag, window_left,
                   window_right, num_rows: cutlass.Constexpr[int], seq=None):
        """A thread's S registers cover two query rows: their LSE and D, read once, and the visible
        key range [lo, hi) per row (offsets from this key block's start). The rows arrived with Q /
        dO; padded rows hold +inf / 0, so no bounds test. Varlen (`seq`): the sequence's lengths
        read here (SeqRows.lengths)."""
        if cutlass.const_expr(seq is not None):
            seqlen_q, seqlen_k = seq.lengths()
            diag = seqlen_k - seqlen_q
        lse = cute.make_rmem_tensor(num_rows, Float32)
        d_row = cute.make_rmem_tensor(num_rows, Float32)
        lo = cute.make_rmem_tensor(num_rows, Int32)
        hi = cute.make_rmem_tensor(num_rows, Int32)
        for r in cutlass.range_constexpr(num_rows):
            q_in_block = coord_rc[r, 0][0]
            q = m_block * self.tile_m + q_in_block
            lse[r] = sLSE[q_in_block, state.index]
            d_row[r] = sD[q_in_block, do_state.index]
            hi[r] = seqlen_k - n_block * self.tile_n
            lo[r] = Int32(0)
            if cutlass.const_expr(self.has_right):
                hi[r] = cutlass.min(hi[r], q + diag + window_right + 1 - n_block * self.tile_n)
            if cutlass.const_expr(self.has_left):
                lo[r] = q + diag - window_left - n_block * self.tile_n
        return lse, d_row, lo, hi

    @cute.jit
    def emit_dq(self, acc_dQ, rdQ_half, dq_copy, tdQsdQ, dq_coords, c: cutlass.Constexpr[int], wg, mdQaccum,
                mdQsem, m_block, n_block, head, batch, seqlen_q, seqlen_k, window_left, window_right, tidx,
                softmax_scale, step):
        """dQ chunk c out, through the smem slot (dq_tma) or by atomics (deterministic: the dQ turn
        taken before the first chunk and passed after the last)."""
        last = c == self.dq_chunks - 1
        if cutlass.const_expr(self.cfg.dq_tma):
            self.stage_dq(acc_dQ, rdQ_half, dq_copy, tdQsdQ[c], wg, softmax_scale, first=c == 0, last=last,
                          step=step, c=c)
        else:
            if cutlass.const_expr(self.cfg.deterministic and c == 0):
                self.dq_turn_wait(mdQsem, m_block, n_block, head, batch, seqlen_q, seqlen_k, window_left,
                                  window_right, tidx)
            self.add_dq(acc_dQ, dq_coords[c], mdQaccum, m_block, head, batch, seqlen_q, softmax_scale)
            if cutlass.const_expr(self.cfg.deterministic and last):
                self.dq_turn_pass(mdQsem, m_block, head, batch, tidx)

    @cute.jit
    def write_dq(self, mdQaccum, mdQsem, sdQ, tma_atom_dQ, work, window_left, window_right):
        """dq_tma, one warp of the producer warpgroup: each warpgroup's dQ part(s) of every step added
        into dQaccum by TMA reduce-adds (rows past seqlen_q clipped by the TMA unit), one bulk group
        per warpgroup in warpgroup order; a part is handed back once its group has been read."""
        n_block, head_kv, batch, ratio, m_min, num_m, num_steps, seqlen_q, seqlen_k, seq = (
            work.n_block, work.head_kv, work.batch, work.ratio, work.m_min, work.num_m, work.num_steps,
            work.seqlen_q, work.seqlen_k, work.seq)
        if cutlass.const_expr(self.cfg.pdl):
            cute.arch.griddepcontrol_wait()  # BwdConfig.pdl: the preprocess cleared dQaccum
        lane = cute.arch.lane_idx()
        wg_threads = 128 + 32
        num_wg = self.num_consumer_wg
        for step in cutlass.range(num_steps, unroll=1):
            head = head_kv * ratio + step // num_m
            m_block = m_min + step % num_m
            for w in cutlass.range_constexpr(num_wg):
                cute.arch.cp_async_bulk_wait_group(num_wg - 1 - w, read=True)
                cute.arch.barrier_arrive(barrier_id=BwdWideBarrier.DQ_WG + w, number_of_threads=wg_threads)
            if cutlass.const_expr(self.cfg.deterministic):
                sem = mdQsem[None, head, batch].iterator + m_block
                turn = self.dq_turn(m_block, n_block, seqlen_q, seqlen_k, window_left, window_right)
            for w in cutlass.range_constexpr(num_wg):
                cute.arch.barrier(barrier_id=BwdWideBarrier.DQ_WG + num_wg + w, number_of_threads=wg_threads)
                if cutlass.const_expr(self.cfg.deterministic and w == 0):
                    self.wait_turn(sem, turn)
                for c in cutlass.range_constexpr(self.dq_chunks):
                    p = c * num_wg + w
                    sdQ_p = cute.local_tile(sdQ, (self.tile_m, self.dq_part_cols), (0, p))
                    self.reduce_dq_part(tma_atom_dQ, mdQaccum, sdQ_p, head, batch, m_block, seqlen_q, p, seq)
                cute.arch.cp_async_bulk_commit_group()
            if cutlass.const_expr(self.cfg.deterministic):
                self.pass_turn_when_landed(sem, lane)
            cute.arch.sync_warp()
        # smem must outlive the last reads
        cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def write_dq_slot(self, mdQaccum, mdQsem, sdQ, tma_atom_dQ, work, window_left, window_right):
        """dq_slots 1: the one smem part goes to the warpgroups in part order (chunk 0 of warpgroup
        0, 1, .., then chunk 1 of each), each time once the previous part's reduce-add has read it;
        the grant and the hand-back are that warpgroup's own barriers."""
        n_block, head_kv, batch, ratio, m_min, num_m, num_steps, seqlen_q, seqlen_k, seq = (
            work.n_block, work.head_kv, work.batch, work.ratio, work.m_min, work.num_m, work.num_steps,
            work.seqlen_q, work.seqlen_k, work.seq)
        if cutlass.const_expr(self.cfg.pdl):
            cute.arch.griddepcontrol_wait()  # BwdConfig.pdl: the preprocess cleared dQaccum
        lane = cute.arch.lane_idx()
        wg_threads = 128 + 32
        num_wg = self.num_consumer_wg
        for step in cutlass.range(num_steps, unroll=1):
            head = head_kv * ratio + step // num_m
            m_block = m_min + step % num_m
            if cutlass.const_expr(self.cfg.deterministic):
                sem = mdQsem[None, head, batch].iterator + m_block
                turn = self.dq_turn(m_block, n_block, seqlen_q, seqlen_k, window_left, window_right)
            for c in cutlass.range_constexpr(self.dq_chunks):
                for w in cutlass.range_constexpr(num_wg):
                    for h in cutlass.range_constexpr(self.dq_halves):
                        # with halves the one before last used this half of the slot (an even count
                        # of half-turns a step, so half h is always slot half h); with a ring of R
                        # boxes the half-turn R back used this box
                        cute.arch.cp_async_bulk_wait_group(self.dq_ring - 1, read=True)
                        # the grant as a barrier both sides wait at (stage_dq: the hand-back too)
                        # (unaligned: the consumers reach both from their own code, stage_dq)
                        sync_unaligned(BwdWideBarrier.DQ_WG + w, wg_threads)
                        sync_unaligned(BwdWideBarrier.DQ_WG + num_wg + w, wg_threads)
                        if cutlass.const_expr(self.cfg.deterministic and c == 0 and w == 0 and h == 0):
                            self.wait_turn(sem, turn)
                        sdQ_h = sdQ
                        if cutlass.const_expr(self.dq_ring > self.dq_halves):
                            box = self.ring_box(step, c, w, h)
                            sdQ_h = cute.local_tile(sdQ, (self.tile_m, self.dq_slot_cols), (0, box))
                        elif cutlass.const_expr(self.dq_halves > 1):
                            sdQ_h = cute.local_tile(sdQ, (self.tile_m, self.dq_slot_cols), (0, h))
                        self.reduce_dq_part(tma_atom_dQ, mdQaccum, sdQ_h, head, batch, m_block, seqlen_q,
                                            (c * num_wg + w) * self.dq_halves + h, seq)
                        cute.arch.cp_async_bulk_commit_group()
            if cutlass.const_expr(self.cfg.deterministic):
                self.pass_turn_when_landed(sem, lane)
            cute.arch.sync_warp()
        # smem must outlive the last read
        cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def reduce_dq_part(self, tma_atom_dQ, mdQaccum, sdQ_p, head, batch, m_block, seqlen_q,
                       p: cutlass.Constexpr[int], seq=None):
        """dq_tma writer: TMA reduce-add of the smem part `sdQ_p` into dQ box p (a part, or with
        dq_slot_halves half of one, counted along the head dim) of query block m_block (rows past
        seqlen_q clipped by the TMA unit, or with dq_rows_interleaved added into the accumulator's
        padding rows). The whole warp runs the copy (it elects its issuing lane itself)."""
        mdQ_rows, m_tile = self.dq_rows_tile(mdQaccum, head, batch, m_block, seqlen_q, seq)
        gdQ = cute.local_tile(mdQ_rows, (self.tile_m, self.dq_slot_cols), (m_tile, p))
        tdQsdQ, tdQgdQ = cpasync.tma_partition(tma_atom_dQ, 0, cute.make_layout(1),
                                               cute.group_modes(sdQ_p, 0, 2), cute.group_modes(gdQ, 0, 2))
        cute.copy(tma_atom_dQ, tdQsdQ, tdQgdQ)

    def check_part_mma(self, tiled_mma_dq, tiled_mma_dq_part):
        """dq_slots: thread t of warpgroup w holds, in its part of the dQ chunk, the elements thread t
        of the one-warpgroup part MMA holds, in the same register order (checked at trace time on
        a few threads: the slot is partitioned by thread % 128). With dq_slot_halves the part MMA
        covers half a part, and half h must be the h-th contiguous run of the chunk's fragment."""
        cols, half_cols = self.dq_part_cols, self.dq_slot_cols
        chunk = cute.make_identity_tensor((self.tile_m, self.hdim // self.dq_chunks))
        one = cute.make_identity_tensor((self.tile_m, half_cols))
        for w in range(self.num_consumer_wg):
            for t in (0, 5, 31, 32, 77, 127):
                mine = tiled_mma_dq.get_slice(w * 128 + t).partition_C(chunk)
                ref = tiled_mma_dq_part.get_slice(t).partition_C(one)
                n = cute.size(ref)
                if cute.size(mine) != n * self.dq_halves:
                    raise ValueError("dq_slots: the part MMA's fragment differs in size")
                for h in range(self.dq_halves):
                    for i in range(n):
                        r, c = mine[h * n + i]
                        if (r, c - w * cols - h * half_cols) != tuple(ref[i]):
                            raise ValueError(f"dq_slots: thread {w * 128 + t} holds dQ ({r}, {c}) at "
                                             f"{h * n + i}, the part MMA {tuple(ref[i])} (half {h})")

    @cute.jit
    def ds_from_rounded_p(self, acc_dP, rP, d_row, softmax_scale):
        """sdp_by_gemm: dS = P (dP - D) in place of dP, P from the 16-bit copy read back from smem
        (element by element: a whole fp32 copy of P would not fit next to dK^T / dV^T); returned in
        the input dtype."""
        dp_rc, p_rc = L.acc_rows_cols(acc_dP), L.acc_rows_cols(rP)
        for r in cutlass.range_constexpr(cute.size(dp_rc, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(dp_rc, mode=[1])):
                dp_rc[r, c] = p_rc[r, c].to(Float32) * self.dp_minus_d(dp_rc[r, c], d_row[r], softmax_scale)
        rdS = cute.make_rmem_tensor_like(acc_dP, self.dtype)
        rdS.store(acc_dP.load().to(self.dtype))
        return rdS

    def dp_minus_d(self, dp, d, softmax_scale):
        """dP - D, or with scale_in_ds (D arrived times the scale) dP * scale - D: one FFMA."""
        if cutlass.const_expr(self.cfg.scale_in_ds):
            return dp * softmax_scale - d
        return dp - d

    def pds_buffer(self, t, pds):
        """P / dS buffer `pds` of a view whose last mode is ds_stages (only when there are two)."""
        if cutlass.const_expr(self.cfg.ds_stages == 2):
            return t[None, None, None, pds]
        return t

    @cute.jit
    def dq_turn_wait(self, mdQsem, m_block, n_block, head, batch, seqlen_q, seqlen_k, window_left,
                     window_right, tidx):
        """Deterministic mode: hold every consumer thread until the key blocks before this one
        (BwdKernelBase.dq_turn) have added their dQ of `m_block`, so the fp32 atomics of each dQ
        element always run in the same order. One thread polls; the barrier passes its acquire on."""
        if tidx == 0:
            sem = mdQsem[None, head, batch].iterator + m_block
            turn = self.dq_turn(m_block, n_block, seqlen_q, seqlen_k, window_left, window_right)
            self.wait_turn(sem, turn)
        cute.arch.barrier(barrier_id=BwdWideBarrier.DQ_TURN, number_of_threads=self.num_consumer_threads)

    @cute.jit
    def dq_turn_pass(self, mdQsem, m_block, head, batch, tidx):
        """Deterministic mode: once every consumer thread's dQ atomics of `m_block` are issued,
        pass the turn to the next key block (a gpu-scope release after the barrier covers the
        other threads' atomics too)."""
        cute.arch.barrier(barrier_id=BwdWideBarrier.DQ_TURN, number_of_threads=self.num_consumer_threads)
        if tidx == 0:
            cute.arch.fence_acq_rel_gpu()
            cute.arch.atomic_add(mdQsem[None, head, batch].iterator + m_block, Int32(1), sem="release",
                                 scope="gpu")

    @cute.jit
    def prob(self, s, key, lse, lo, hi, scale_log2):
        """P from a (softcapped) score; 0 where the key (offset in the block) is outside [lo, hi).

        A select, not a branch: a traced `if` would thread the accumulator through every test."""
        p = cute.math.exp2(s * scale_log2 - lse, fastmath=True)
        return Float32(0.0) if key >= hi or key < lo else p

    @cute.jit
    def add_dq(self, acc_dQ, dq_coords, mdQaccum, m_block, head, batch, seqlen_q, softmax_scale):
        """fp32 atomics of this warpgroup's dQ columns into dQaccum; rows past seqlen_q dropped.

        A thread holds two rows, each as pairs of adjacent columns: one bounds test and one
        64-bit row address per row, then one 8-byte vector atomic per pair at a constant offset
        (per-element 64-bit addresses were recomputed around every atomic)."""
        base = mdQaccum[None, None, head, batch].iterator
        row_stride = Int32(mdQaccum.layout.stride[0])
        acc_rc = L.acc_rows_cols(acc_dQ)
        crd_rc = L.acc_rows_cols(dq_coords)
        pair = cute.make_rmem_tensor(2, Float32)
        for r in cutlass.range_constexpr(cute.size(acc_rc, mode=[0])):
            row = m_block * self.tile_m + crd_rc[r, 0][0]
            if row < seqlen_q:
                row_ptr = base + row * row_stride
                for c in cutlass.range_constexpr(0, cute.size(acc_rc, mode=[1]), 2):
                    if cutlass.const_expr(self.cfg.scale_in_ds):  # dS carried the scale
                        pair[0] = acc_rc[r, c]
                        pair[1] = acc_rc[r, c + 1]
                    else:  # so the host only casts dQaccum
                        pair[0] = acc_rc[r, c] * softmax_scale
                        pair[1] = acc_rc[r, c + 1] * softmax_scale
                    cute.arch.atomic_add(row_ptr + crd_rc[r, c][1], pair.load())
