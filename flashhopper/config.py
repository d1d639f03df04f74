"""Tile, stage and register choices for the Hopper kernels, with the budget arithmetic.

Everything here is plain Python so that CPU tests can check that every configuration we
dispatch fits the hardware before any kernel is compiled.

Over 800 lines because it is the one place for what a kernel configuration is: three frozen
dataclasses (forward, backward, backward preprocess), each field with the line that says what it
does, and their budget checks beside the fields they read. Which configuration a call gets is
flashhopper/plan.py; why, docs/decisions.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

SUPPORTED_HDIMS = (64, 96, 128, 192, 256)
# (query / key head dim, value head dim) pairs other than equal ones: DeepSeek's MLA prefill, which vLLM
# and SGLang run through FA3. The backward of a pair runs the query head dim's kernel on V and dO padded
# with zero columns to that head dim (hopper/runtime.py, _pad_value_dim; BwdPreConfig.of's `dv`)
SPLIT_HDIMS = ((192, 128),)
DTYPES = ("bf16", "fp16")
# FP8 inputs (forward only): e4m3 Q, K, V with fp32 descales, bf16 output (FA3's convention)
FP8_DTYPES = ("e4m3",)
# fp8 P is exp2(x - max + FP8_P_SHIFT_LOG2): in [0, 256], inside e4m3's 448, fewer underflows (FA3)
FP8_P_SHIFT_LOG2 = 8
# FP8 q / k descales (FwdConfig.qk_descale): "head", one per (batch, kv head), folded into the score scale
# (FA3's convention); "token", one per (batch, head, row) of Q and of K, applied per query row and per key
# (hopper/fp8_descale.py), which any per-block quantization is (the block's scale repeated over its rows)
QK_DESCALES = ("head", "token")
# "token": a ring stage holds one key block's k descales as 4 rows of tile_n / 4 (row q: the columns a
# consumer thread with lane % 4 == q holds, in its accumulator's order), each row padded by this many
# floats so that the four rows' 16-byte reads fall on different banks
KD_ROW_PAD = 4
# FP8 V^T holds the keys in P's register order (hopper/fp8.py, layout.acc_layout_as_operand_a_fp8): key
# offsets inside a 16-key group for positions 4q + j, j = 0..3
FP8_KEY_ORDER = (0, 1, 8, 9)


def key_of_position(pos: int) -> int:
    """The key whose V row sits at position `pos` of FP8 V^T (and whose P is A operand column `pos`)."""
    return 16 * (pos // 16) + 2 * ((pos % 16) // 4) + FP8_KEY_ORDER[pos % 4]

# The dynamic scheduler's ring (hopper/tile_scheduler.py): slots of a tile index; with varlen one slot of a
# tile's record (m_block, head, sequence, query offset, used queries, used keys), whose phase both sides
# take from Q's one stage (one record a tile: no state of its own to carry)
SCHED_STAGES = 2
VARLEN_SCHED_STAGES = 1
VARLEN_RECORD_WORDS = 6

# Hopper: 227 KiB of dynamic shared memory per CTA, 64 Ki 32-bit registers per SM.
SMEM_CAPACITY = 232448
# and 1 KiB more the SM reserves per CTA, which the cubin's static shared memory counts (a launch of
# SMEM_CAPACITY + 1 KiB dynamic + static ran on an H100: tests/smem_check.py)
SMEM_RESERVED_PER_CTA = 1024
# FwdConfig.lazy_max: a block whose row sum (with the stale max) exceeds 2^this is redone exactly;
# it bounds every P by 256, inside fp16's range with room for the row sums
LAZY_MAX_LOG2 = 8
REGS_PER_SM = 65536
WARPGROUP_THREADS = 128

# (consumer, producer) registers per thread after setmaxnreg, by number of consumer warpgroups.
# The producer only issues TMA, so it keeps the minimum; the consumers hold the accumulators.
REG_SPLIT = {1: (256, 56), 2: (240, 24), 3: (160, 32)}
# FP8: the producer warpgroup also transposes V in shared memory (hopper/fp8.py: two units' 8 loaded
# words in flight per thread, the per-thread addresses and selectors held through its loop)
FP8_REG_SPLIT = {2: (224, 48)}
# FwdConfig.check's registers beside the accumulators for FP8 (16-bit: 32). Compiled for sm_90a, these FP8
# tiles left 16-28 registers and neither spilled nor serialized a WGMMA: hdim 128 x 128 keys two-level (208
# of 224 / 232), hdim 96 x 192 two-level (216 of 232), hdim 128 x 224 (204 of 232); these spilled: 64 x 256
# two-level (224 of 232: 40 bytes), 128 x 160 two-level (228 of 232: 64 bytes)
FP8_REG_SLACK = 16
# setmaxnreg's bounds and step (PTX: a multiple of 8 in [24, 256])
SETMAXNREG_MIN, SETMAXNREG_MAX = 24, 256


def register_split(num_consumer_wg: int, fp8: bool = False, producer: int = 0) -> tuple[int, int]:
    """(consumer, producer) registers per thread after setmaxnreg: the table's (FP8_REG_SPLIT for FP8
    inputs, else REG_SPLIT) or, with `producer` (FwdConfig.producer_nreg), that many for the producer
    warpgroup and for each consumer warpgroup the rest of the CTA's pool, in steps of 8, at most 256
    (two consumer warpgroups: 24 -> 240, 32 / 40 -> 232, 48 / 56 -> 224)."""
    if not producer:
        return (FP8_REG_SPLIT if fp8 else REG_SPLIT)[num_consumer_wg]
    rest = register_pool(1 + num_consumer_wg) // WARPGROUP_THREADS - producer
    return min(rest // num_consumer_wg // 8 * 8, SETMAXNREG_MAX), producer


def register_pool(num_warpgroups: int) -> int:
    """Registers a CTA of `num_warpgroups` warpgroups owns: what each thread is given at launch
    (the file split evenly, in steps of 8, at most 255), times the threads. setmaxnreg moves
    registers only inside this pool (USETMAXREG ... CTAPOOL): a split that adds up to the whole
    64K file but not to the pool leaves the consumers' setmaxnreg.inc waiting forever (a fused
    dQ-cast build with 32 producer registers next to 240 hung so on the H200, earlier)."""
    threads = WARPGROUP_THREADS * num_warpgroups
    return min(REGS_PER_SM // threads // 8 * 8, 248) * threads


@dataclass(frozen=True)
class _KernelConfig:
    """What every kernel is specialized on: dtype, head dim and the mask kind."""

    dtype: str
    hdim: int
    causal: bool = False
    local: bool = False
    softcap: bool = False

    @property
    def consumer_regs(self) -> int:
        return REG_SPLIT[self.num_consumer_wg][0]

    @property
    def producer_regs(self) -> int:
        return REG_SPLIT[self.num_consumer_wg][1]

    def _check_register_split(self) -> None:
        total = WARPGROUP_THREADS * (self.producer_regs + self.consumer_regs * self.num_consumer_wg)
        pool = register_pool(1 + self.num_consumer_wg)
        if total > pool:
            raise ValueError(f"register split {self.producer_regs}/{self.consumer_regs} needs {total} > "
                             f"{pool} registers (the CTA's pool)")


@dataclass(frozen=True)
class FwdConfig(_KernelConfig):
    tile_m: int = 128
    tile_n: int = 128
    num_stages: int = 2
    num_consumer_wg: int = 2
    # scheduling switches (each can be turned off alone for the ablation); pingpong needs two or more
    # consumer warpgroups (one: plan.fwd_config_decode's 64-row tile, intra_wg_overlap only)
    intra_wg_overlap: bool = True
    pingpong: bool = True
    # one CTA per SM looping over tiles (otherwise one CTA per tile)
    persistent: bool = False
    # with `persistent`: CTAs claim their next tile from a global counter (atomicAdd) instead of
    # striding by the grid size, so the longest-first order holds across the whole grid
    dynamic_sched: bool = False
    # setmaxnreg: the producer warpgroup gives registers back, the consumers take them. Off, every
    # thread keeps the launch share (65536 / threads), so the consumers' accumulators spill.
    reg_realloc: bool = True
    # With intra_wg_overlap: multiply O by the previous block's row scale in the next step, after
    # QK^T is issued and before P @ V is (O is not in flight then), so the FMULs run under the
    # QK^T GEMM; the tail does it before the last P @ V. FA3's RescaleOBeforeGemm (hdim > 128).
    # Off: O is rescaled at the end of the step, after the P @ V wait. No effect without
    # intra_wg_overlap (the serial step already rescales right before its P @ V).
    rescale_o_before_pv: bool = False
    # With intra_wg_overlap: release K(n) after the softmax, behind a condition on the row sums,
    # which pins the P @ V wait after every exp2 (ptxas otherwise hoists it into the softmax).
    # Off: K is released right after the QK^T wait, as before (kept to time the two against
    # each other).
    late_k_release: bool = True
    # Each consumer warpgroup writes and stores its own 64 rows of O (own named barrier, own TMA
    # store) instead of all consumers meeting at one epilogue barrier, and the ping-pong token is
    # primed once per CTA and carried from tile to tile instead of being primed and taken back per
    # tile. Then warpgroup 0 starts the next tile while warpgroup 1 finishes this one (its last
    # P @ V and epilogue), instead of both re-aligning at every tile end: the half-step ping-pong
    # offset is paid once per CTA, not once per tile (docs/decisions.md).
    wg_epilogue: bool = False
    # 2: thread-block clusters of two CTAs on adjacent query blocks of one (head, batch); each CTA
    # loads half of every K and V tile and multicasts it to both, halving L2->SM traffic for K/V
    # (hopper/fwd_cluster.py, docs/decisions.md). No causal/local mask, static schedule only.
    cluster_m: int = 1
    # A consumer warpgroup whose 64 rows all lie past seqlen_q (the last query block when the
    # tile pads the length: hdim 64's 192 rows cover 512 queries with 576) skips its GEMMs,
    # softmax and O store, and only keeps the pipeline and ping-pong barriers in step, so the
    # tensor cores and the other warpgroups' turns are not spent on rows that are never written.
    skip_idle_wg: bool = False
    # O staged in Q's smem buffer even where its own tile would fit (FA3 / FA4 alias O with V / Q):
    # 32 KiB less smem at hdim 128, which makes room for a third K / V stage there.
    o_in_q: bool = False
    # O staged in V's smem ring (FA3's layout) instead of Q's buffer: Q is then free once the tile's
    # last QK^T is done, so the next tile's Q loads under the last P @ V and the epilogue instead of
    # after the O store has read Q's buffer. All consumers meet once after their last P @ V (the O
    # rows land on the last V stage another warpgroup may still read), and the producer holds the
    # next tile's V loads until the O stores have read sV (a one-stage mbarrier hand-off per tile).
    o_in_v: bool = False
    # With o_in_v: each consumer warpgroup stages its 64 O rows at the base of one V stage of its own,
    # (v + w) % 2 for warpgroup w, v the stage the next tile's first V load goes to, and the producer
    # holds each of the next tile's first two V loads only until the O part in its stage is read. No
    # all-consumer meeting (only after a one-block tile, whose first stage may still hold the other
    # warpgroup's last part): warpgroup 0 waits only until its stage's last V is released, which is
    # V(last - 1)'s, normally long done. Takes effect with two consumer warpgroups, two K / V stages,
    # one Q stage, 64 or more keys a block and wg_epilogue (o_per_stage); otherwise (e.g. the ablation
    # turning wg_epilogue off) O is staged in V with one hand-off for all of sV, as o_in_v alone.
    o_v_stages: bool = False
    # Q buffers: 2 lets the producer load the next tile's Q while this tile still reads its own
    # (with one, the next Q waits for this tile's last QK^T, and a tile of 1-4 key blocks has little
    # time left to hide that load under). Needs O's own smem tile (O is otherwise staged in Q's).
    q_stages: int = 1
    # Lazy row max, in the mask-free overlapped steps: P = exp2((S - m) * scale) with the running max m
    # left as it is, so the step has no row max, shuffles, row-scale exp2 or O rescale (P may exceed 1;
    # 16-bit P has the range). A warp any of whose rows has a block sum above 2^LAZY_MAX_LOG2 (or no
    # max yet) redoes the block exactly from S, which stays in its registers: lazy steps go in pairs,
    # each writing the P @ V operand the other reads. Where it takes effect: lazy_max_active.
    lazy_max: bool = False
    # FP8 (dtype e4m3): stages of the ring the TMA loads V into as users store it (keys x head dim),
    # from which the producer warpgroup's transposer warps write V^T (head dim x keys, keys
    # contiguous: FP8 WGMMA reads B K-major only) into the K/V ring's V stages
    vt_stages: int = 2
    # FP8 ablation: V given as V^T (batch, heads_k, head dim, keys padded to 16, keys in P's order:
    # hopper/runtime.py fp8_transposed_v) and loaded by the TMA into sV as it is, with no transposer: the
    # upper bound the in-kernel transpose is measured against (flashhopper bench --dtype fp8 --ablation)
    vt_in_gmem: bool = False
    # FP8: two-level accumulation. FP8 WGMMA adds into its accumulator below fp32 precision, so an O
    # carried through every key block's P @ V loses bits as the keys grow (vllm#23813); with this each
    # block's P @ V starts a fresh accumulator, added into the fp32 O once it is done (hopper/two_level.py)
    pv_two_level: bool = False
    # with pv_two_level and intra-warpgroup overlap (no rescale_o_before_pv): a mask-free step's row scale
    # is not multiplied into O at once but by the next block's add, O * scale + P @ V in one FFMA (one
    # FMUL per O element and block fewer: +1..+7% on an H100); off: FADD, then FMUL (the A / B of it)
    pv_defer_scale: bool = True
    # FP8: each row's sum of P by the tensor cores instead of an FADD a score. sV holds row_sum_rows rows of
    # e4m3 ones under V^T (written once a CTA; the transposer writes only the head dim's rows), so P @ V's
    # accumulator carries the row sums of the e4m3 P in its last columns, rescaled and added (two-level) as O
    # is. O is then normalized by the sum of the P it was made from; the LSE from that sum is off by up to
    # e4m3's rounding of P (2^-4 relative), so the plan takes it only for calls that return no LSE
    pv_row_sum: bool = False
    # Variable-length sequences packed along the token dimension (flash_attn_varlen_func): the persistent
    # dynamic scheduler walks each sequence's real tiles, longest sequence first (hopper/tile_scheduler.py),
    # each tile's query and key bounds come from cu_seqlens / seqused, and O is stored row by row up to
    # the sequence's end (a TMA box would write the next one's rows)
    varlen: bool = False
    # the value (and output) head dim when it differs from the query / key one (SPLIT_HDIMS); 0: hdim
    dv: int = 0
    # Varlen over a paged KV cache (0: not paged): K and V are the cache's rows (pages * page_size,
    # heads_k, d), read by the TMA straight from the pages the page table names (hopper/fwd.py
    # load_stage_paged). A key block spans tile_n / page_size pages (that many boxes of page_size rows
    # into one stage, on the stage's one mbarrier) or lies inside one page (one box of tile_n rows).
    page_size: int = 0
    # FP8: how the q / k descales come (QK_DESCALES). "token": q's per (batch, query head, query row), k's
    # per (batch, kv head, key); the producer warp stages each key block's k descales in shared memory
    # (one ring stage per K stage) and the consumers multiply S by them before the row max (one FMUL
    # per score), q's folded into a per-row score scale (hopper/fp8_descale.py)
    qk_descale: str = "head"
    # Varlen, kvcache's decode with the split inside the kernel (flashhopper/kvcache.py `_split_call`):
    # every item has the same query rows (one query token: its query heads, or a KV head's group of them
    # packed as rows, PackGQA), read from q's own (batch, rows, heads, d) view; the tile index maps to
    # (query block, head, item, split) by arithmetic (no walk table), each split's keys
    # [split * chunk, min((split + 1) * chunk, used)) of the item read from cache_seqlens in the kernel
    # (the chunk and the split count runtime scalars), O and LSE stored to (batch * splits, rows, heads)
    # partials for the merge kernel (hopper/combine.py), or to the output itself with one split. The
    # tiles are alike, so the persistent grid strides over them (dynamic_sched off: no tile counter);
    # no mask (one query at the end of its keys), or causal over packed tokens (token_rows)
    split_kv: bool = False
    # split_kv with causal: each item's query rows pack the query heads of a KV head's group for each of its
    # `tokens` newest query tokens (the kernel's split_tokens), row j * tokens + t the j-th head of token t,
    # and row r sees the keys of token r % tokens: those up to the item's last key minus (tokens - 1 - t),
    # in the item's positions across its splits (several-token decode: kvcache._qlen_call). Every key of a
    # split is seen by its last token's rows, so the key blocks are the unmasked walk's; the mask
    # is applied in the blocks that hold the item's last tokens - 1 keys
    token_rows: bool = False
    # the producer warpgroup's registers after setmaxnreg (a multiple of 8, at least 24); the consumer
    # warpgroups get the rest of the CTA's pool (config.register_split). 0: the table's split for the
    # dtype (FP8_REG_SPLIT, REG_SPLIT)
    producer_nreg: int = 0
    # Programmatic dependent launch (split_kv only): the kernel is launched so that it may start while the
    # stream's previous kernel finishes (the previous decode call's merge kernel, which lets it), waits for
    # that kernel (griddepcontrol.wait) before touching global memory, and at once lets the next kernel
    # (its merge kernel, CombineConfig.pdl) launch the same way: each kernel boundary of a decode step
    # overlaps a launch and a prologue instead of idling through them
    pdl: bool = False

    @property
    def hdim_v(self) -> int:
        return self.dv or self.hdim

    @property
    def row_sum_rows(self) -> int:
        """pv_row_sum: the rows of ones under V^T in each sV stage, the fewest (a multiple of 8) that keep
        a stage a whole number of KiB; else 0. The transposer's stage offsets must commute with the swizzle,
        for which whole periods of its width would do (hopper/fp8.py swizzle_period: 8 rows at 192 or 96
        keys, where whole KiB take 16 or 32); that form has not run on a GPU yet."""
        if not self.pv_row_sum:
            return 0
        rows = 8
        while (self.hdim_v + rows) * self.tile_n % 1024:
            rows += 8
        return rows

    @property
    def pv_n(self) -> int:
        """P @ V's N: the head dim, and with pv_row_sum the rows of ones."""
        return self.hdim_v + self.row_sum_rows

    @property
    def sched_ring(self) -> tuple[int, int]:
        """The tile scheduler's smem ring (hopper/tile_scheduler.py): (stages, Int32 words a stage): a tile
        index a stage, or with varlen a tile's record."""
        return (VARLEN_SCHED_STAGES, VARLEN_RECORD_WORDS) if self.varlen else (SCHED_STAGES, 1)

    @property
    def is_fp8(self) -> bool:
        return self.dtype in FP8_DTYPES

    @property
    def token_descales(self) -> bool:
        """FP8 with per-token q / k descales (qk_descale "token")."""
        return self.is_fp8 and self.qk_descale == "token"

    @property
    def kd_stage_floats(self) -> int:
        """fp32 words of one stage of the k-descale ring (token_descales; KD_ROW_PAD)."""
        return 4 * (self.tile_n // 4 + KD_ROW_PAD)

    @property
    def elem_bytes(self) -> int:
        """Bytes of a Q, K, V element."""
        return 1 if self.is_fp8 else 2

    @property
    def o_elem_bytes(self) -> int:
        """Bytes of an O element: bf16 for FP8 inputs, else the input type."""
        return 2

    @property
    def consumer_regs(self) -> int:
        return register_split(self.num_consumer_wg, self._transposer_regs, self.producer_nreg)[0]

    @property
    def producer_regs(self) -> int:
        return register_split(self.num_consumer_wg, self._transposer_regs, self.producer_nreg)[1]

    @property
    def _transposer_regs(self) -> bool:
        """FP8's register split (FP8_REG_SPLIT: the producer's transposer warps hold V^T's addresses), not
        for the ablation fed V^T (vt_in_gmem: no transposer, the producer only issues TMA; with the FP8
        split its causal hdim 128 consumers spilled once the row scale was deferred)."""
        return self.is_fp8 and not self.vt_in_gmem

    @property
    def num_threads(self) -> int:
        return WARPGROUP_THREADS * (1 + self.num_consumer_wg)

    def _smem_bytes(self, o_buffer: bool) -> int:
        q = self.q_stages * self.tile_m * self.hdim * self.elem_bytes
        k = self.num_stages * self.tile_n * self.hdim * self.elem_bytes
        v = self.num_stages * self.tile_n * self.pv_n * self.elem_bytes
        o_bytes = self.tile_m * self.hdim_v * self.o_elem_bytes
        o = o_bytes if o_buffer else 0
        if not o_buffer and not self.o_in_v_ring:
            q = max(q, o_bytes)  # O staged in Q's buffer (with FP8 inputs, wider than Q)
        o_reads = (self.num_stages if self.o_per_stage else 1) if self.o_in_v_ring else 0  # O-read hand-offs
        barriers = 8 * (2 * self.q_stages + 4 * self.num_stages + 2 * o_reads)
        # the dynamic scheduler's ring (always allocated): two mbarriers and a slot's words a stage; varlen:
        # and the producer's claimed next tile
        stages, words = self.sched_ring
        scheduler = stages * (2 * 8 + 4 * words) + (4 if self.varlen else 0)
        if self.is_fp8 and not self.vt_in_gmem:  # the ring V arrives in before it is transposed
            v += self.vt_stages * self.tile_n * self.hdim_v + 8 * 2 * self.vt_stages
        if self.token_descales:  # the k-descale ring and its mbarriers
            k += self.num_stages * (4 * self.kd_stage_floats + 8 * 2)
        return 1024 + q + k + v + o + barriers + scheduler  # + up to 1 KiB lost to alignment

    @property
    def o_buffer(self) -> bool:
        """O gets its own smem tile when it fits, so the next Q can load during the epilogue;
        otherwise (hdim 192, 256), or with o_in_q, O is staged in Q's buffer once Q is no longer read
        (or in V's ring with o_in_v)."""
        return not self.o_in_q and not self.o_in_v_ring and self._smem_bytes(True) <= SMEM_CAPACITY

    @property
    def lazy_max_active(self) -> bool:
        """lazy_max in effect: the overlapped step without softcap or rescale_o_before_pv (its steps leave
        O unscaled), at hdim <= 128 with two consumer warpgroups and at most 128 keys a block (three
        warpgroups: at most 64 keys), not with a cluster or O in V's ring. Elsewhere S, O and two P
        operands do not fit the registers: hdim 192 / 256, the cluster, O in V and 144+ keys spill;
        hdim 64's 192-row tile spills at 96 keys and serializes its WGMMAs at 112 / 128."""
        keys = self.tile_n <= (128 if self.num_consumer_wg == 2 else 64)
        return (self.lazy_max and self.intra_wg_overlap and not self.softcap and not self.rescale_o_before_pv
                and self.hdim_v <= 128 and self.num_consumer_wg <= 3 and keys
                and self.cluster_m == 1 and not self.o_in_v_ring)

    @property
    def o_in_v_ring(self) -> bool:
        """o_in_v in effect: not with a cluster, whose peer multicasts into this CTA's sV while O could
        be staged there (O then goes to Q's buffer, as without o_in_v)."""
        return self.o_in_v and self.cluster_m == 1

    @property
    def o_per_stage(self) -> bool:
        """o_v_stages in effect: each warpgroup's O part in a V stage of its own."""
        return (self.o_in_v_ring and self.o_v_stages and self.wg_epilogue and self.num_consumer_wg == 2
                and self.num_stages == 2 and self.q_stages == 1 and self.tile_n >= 64)

    @property
    def o_in_q_buffer(self) -> bool:
        """O is staged in Q's buffer: Q is freed only after the epilogue's store has read it."""
        return not self.o_buffer and not self.o_in_v_ring

    def smem_bytes(self) -> int:
        """Dynamic shared memory: Q, K and V rings, O (own tile or Q's), mbarriers."""
        return self._smem_bytes(self.o_buffer)

    def accumulator_regs(self) -> int:
        """fp32 registers per consumer thread for the S and O accumulators and P."""
        rows_per_wg = 64
        s = rows_per_wg * self.tile_n // WARPGROUP_THREADS
        o = rows_per_wg * self.pv_n // WARPGROUP_THREADS
        o = 2 * o if self.pv_two_level else o
        return s + o + s * self.elem_bytes // 4

    def check(self) -> None:
        """Raise ValueError naming the first budget this configuration breaks."""
        if self.dtype not in DTYPES + FP8_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not in {DTYPES + FP8_DTYPES}")
        if self.hdim not in SUPPORTED_HDIMS:
            raise ValueError(f"hdim {self.hdim} not in {SUPPORTED_HDIMS}")
        if self.page_size:
            self._check_paged()
        if self.dv and (self.hdim, self.dv) not in SPLIT_HDIMS:
            raise ValueError(f"(hdim, dv) = ({self.hdim}, {self.dv}) not in {SPLIT_HDIMS}")
        if self.dv and self.is_fp8:
            raise ValueError("e4m3: a value head dim other than the query's is not supported")
        split = FP8_REG_SPLIT if self.is_fp8 else REG_SPLIT
        if self.num_consumer_wg not in split:
            raise ValueError(f"num_consumer_wg {self.num_consumer_wg} not in {sorted(split)} "
                             f"for {self.dtype}")
        p = self.producer_nreg
        if p and (p % 8 or not SETMAXNREG_MIN <= p <= SETMAXNREG_MAX):
            raise ValueError(f"producer_nreg {p}: setmaxnreg takes a multiple of 8 in "
                             f"[{SETMAXNREG_MIN}, {SETMAXNREG_MAX}]")
        if self.is_fp8:
            self._check_fp8()
        elif self.vt_in_gmem or self.pv_two_level or self.pv_row_sum or self.qk_descale != "head":
            raise ValueError("vt_in_gmem, pv_two_level, pv_row_sum and qk_descale are for e4m3 inputs "
                             "(16-bit WGMMA reads V as stored and accumulates in fp32; 16-bit inputs take no "
                             "descales)")
        if self.varlen:
            self._check_varlen()
        elif self.split_kv:
            raise ValueError("split_kv is a mode of the varlen kernel (varlen=True)")
        if self.token_rows and not self.split_kv:
            raise ValueError("token_rows is a mode of the split decode walk (split_kv=True)")
        if self.pdl and not self.split_kv:
            raise ValueError("pdl is for the split decode walk (split_kv=True)")
        if self.tile_m != 64 * self.num_consumer_wg:
            raise ValueError(f"tile_m {self.tile_m} must be 64 rows per consumer warpgroup")
        if self.pingpong and self.num_consumer_wg < 2:
            # its turns are 256-thread named barriers (this warpgroup's and the next one's): one
            # warpgroup alone would wait on them forever (the 1-warpgroup decode tile runs without)
            raise ValueError("pingpong needs two or more consumer warpgroups to take turns")
        if self.tile_n % 16 or not 16 <= self.tile_n <= 256:
            raise ValueError(f"tile_n {self.tile_n} must be a multiple of 16 in [16, 256] "
                             "(WGMMA N and P @ V k-blocks)")
        if self.num_stages < 1:
            raise ValueError("num_stages must be >= 1")
        if self.q_stages not in (1, 2):
            raise ValueError(f"q_stages {self.q_stages} not in (1, 2)")
        if self.smem_bytes() > SMEM_CAPACITY:
            raise ValueError(f"shared memory {self.smem_bytes()} B exceeds {SMEM_CAPACITY} B")
        if self.o_in_v:
            if self.o_in_q:
                raise ValueError("o_in_q and o_in_v both set: O is staged in one buffer")
            if self.tile_m > self.num_stages * self.tile_n:
                raise ValueError(f"o_in_v: O's {self.tile_m} rows do not fit in V's ring of "
                                 f"{self.num_stages} x {self.tile_n} rows")
        if self.o_v_stages and not self.o_in_v:
            raise ValueError("o_v_stages needs o_in_v (it says where in V's ring O is staged)")
        if self.q_stages > 1 and self.o_in_q_buffer:
            raise ValueError("q_stages 2 needs O's own smem tile (o_in_q off and room for it) or O in "
                             "V's ring (o_in_v): O is otherwise staged in Q's buffer")
        self._check_cluster()
        self._check_register_split()
        cons = self.consumer_regs
        # leave ~32 registers for addresses, softmax state and temporaries (FP8: 16, FP8_REG_SLACK). This
        # only rejects the hopeless; ptxas has the last word (the compile tests require zero spills).
        if self.accumulator_regs() + (FP8_REG_SLACK if self.is_fp8 else 32) > cons:
            raise ValueError(
                f"accumulators need {self.accumulator_regs()} registers per thread, "
                f"too many for {cons} consumer registers"
            )


    def _check_fp8(self) -> None:
        """What the FP8 forward (in-kernel V transpose, P in e4m3 registers) is built for."""
        if self.qk_descale not in QK_DESCALES:
            raise ValueError(f"qk_descale {self.qk_descale!r} not in {QK_DESCALES}")
        if self.tile_n % 32:
            raise ValueError(f"e4m3: tile_n {self.tile_n} must be a multiple of 32 (the P @ V k-block)")
        if self.vt_stages < 1:
            raise ValueError("vt_stages must be >= 1")
        if self.vt_in_gmem and self.varlen:
            raise ValueError("e4m3: vt_in_gmem is the dense ablation")
        unsupported = {"cluster_m": self.cluster_m != 1, "o_in_v": self.o_in_v, "lazy_max": self.lazy_max,
                       "q_stages": self.q_stages != 1, "o_in_q": self.o_in_q}
        if bad := [name for name, on in unsupported.items() if on]:
            raise ValueError(f"e4m3: {', '.join(bad)} not supported with FP8 inputs")
        if self.pv_row_sum and (self.vt_in_gmem or self.varlen or self.pv_n > 256):
            # the ones rows are written by the transposer, once: the ablation's TMA has no transposer, the
            # varlen kernel zeroes V^T's columns past a sequence (ones rows included); WGMMA's N <= 256
            raise ValueError("e4m3: pv_row_sum needs the transposer, the dense kernel and head dim + "
                             f"{self.row_sum_rows} <= 256")
        if self.wg_epilogue and not self.o_buffer:
            # a warpgroup's 64 bf16 O rows staged in the fp8 Q buffer cover the other warpgroup's Q
            # rows, which its last QK^T may still read: the shared epilogue's all-consumer barrier
            raise ValueError("e4m3: wg_epilogue needs O's own smem tile")

    def _check_varlen(self) -> None:
        """What the varlen forward (its tiles walked by the persistent dynamic scheduler, the shared
        epilogue; split_kv: by the persistent static stride) is built for."""
        if self.split_kv:
            self._check_split_kv()
        elif not (self.persistent and self.dynamic_sched):
            raise ValueError("varlen: needs persistent=True and dynamic_sched=True (the scheduler walks each "
                             "sequence's tiles from the walk table)")
        unsupported = {"e4m3": self.is_fp8, "cluster_m": self.cluster_m != 1, "o_in_v": self.o_in_v,
                       "wg_epilogue": self.wg_epilogue, "q_stages": self.q_stages != 1}
        if bad := [name for name, on in unsupported.items() if on]:
            raise ValueError(f"varlen: {', '.join(bad)} not supported with packed sequences")

    def _check_split_kv(self) -> None:
        """What the split decode walk (split_kv) is built for: the varlen kernel's on the persistent static
        stride, no mask, or causal over packed tokens (token_rows)."""
        if not self.persistent or self.dynamic_sched:
            raise ValueError("split_kv: needs persistent=True and dynamic_sched=False (the grid strides over "
                             "tiles it maps by arithmetic; no tile counter)")
        if self.local:
            raise ValueError("split_kv: no local window (a window is not split)")
        if self.causal != self.token_rows:
            raise ValueError("split_kv: causal goes with token_rows (the rows of several query tokens "
                             "packed, each seeing its own keys), and token_rows with causal")

    def _check_paged(self) -> None:
        """What the paged K / V path (first version: the varlen kernel, 16-bit inputs) is built for."""
        p = self.page_size
        if not self.varlen:
            raise ValueError(f"page_size {p}: a paged KV cache is read by the varlen kernel only "
                             "(varlen=True)")
        if self.is_fp8 or self.vt_in_gmem:
            raise ValueError(f"page_size {p}: the paged K / V path takes bf16 / fp16 inputs; e4m3 (and its "
                             "V-transposing producer) is not supported with a paged cache yet")
        if p < 0 or p % 8:
            raise ValueError(f"page_size {p} must be a positive multiple of 8 (a TMA box of whole 8-row "
                             "swizzle atoms)")
        if self.tile_n % p and p % self.tile_n:
            raise ValueError(f"page_size {p} and tile_n {self.tile_n}: one must divide the other (a key "
                             "block spans whole pages, or lies inside one page)")
        if not self.intra_wg_overlap:
            raise ValueError(f"page_size {p}: needs intra_wg_overlap (the peeled first block zeroes V's rows "
                             "past the keys: a page's unused rows may hold NaN)")

    def _check_cluster(self) -> None:
        if self.cluster_m == 1:
            return
        if self.cluster_m != 2:
            raise ValueError(f"cluster_m {self.cluster_m} not in (1, 2)")
        if self.causal or self.local:
            raise ValueError("cluster_m=2 needs no causal/local mask: the two query blocks of a cluster "
                             "must visit the same key blocks")
        if self.dynamic_sched:
            raise ValueError("cluster_m=2 takes the static schedule only (one cluster per pair of query "
                             "blocks, or persistent=True with dynamic_sched=False): the dynamic scheduler "
                             "claims tiles per CTA, not per cluster")
        # each CTA loads tile_n / 2 rows of K and V: whole 8-row swizzle atoms since tile_n % 16 == 0


def fwd_grid(cfg: FwdConfig, seqlen_q: int, num_pairs: int, max_ctas: int | None) -> int:
    """CTAs to launch: one per tile, or at most `max_ctas` (persistent). With cluster_m = 2 a tile
    is a pair of query blocks (an odd count rounds up: the last pair's second CTA computes a block
    past seqlen_q and writes nothing) and the grid is whole clusters."""
    m = cfg.cluster_m
    num_tiles = -(-seqlen_q // (cfg.tile_m * m)) * num_pairs
    if max_ctas is not None:
        num_tiles = min(num_tiles, max(1, max_ctas // m))
    return num_tiles * m


# Backward (first version): one CTA per 128-key block, two consumer warpgroups of 64 keys,
# 64-query blocks (128 at hdim 64: _BWD_TILE_M); dK, dV, S^T, dP^T, dQ accumulators and P^T in
# registers, dS^T through smem. Every dtype and mask at hdim 64, 96, 128 compiles without spills.
# hdim 96 keeps K in SW32 so dQ's 48 columns per warpgroup are whole swizzle atoms
# (hopper/bwd_layout.py).
BWD_HDIMS = (64, 96, 128, 192, 256)
# kv_split "hdim": registers per consumer thread beyond the fp32 accumulators (BwdConfig.
# _check_hdim_split). 32 is what hdim 256 at tile_n 64 leaves (128 + 64 of 240; SASS tops out at R223);
# at tile_n 80 a whole 64-register dQ tile next to 160 of dK^T + dV^T made ptxas spill and
# serialize all 53 WGMMAs, hence BwdConfig.dq_chunks.
_BWD_HDIM_REG_SLACK = 32
# kv_split "keys": most fp32 accumulator registers per consumer thread for S^T + dP^T + dK + dV
# (tile_m + hdim), see BwdConfig._check_key_split
_BWD_KEYS_ACC_REGS = 192
# query-row steps that are not a multiple of 64 (WGMMA M of dQ = dS K): dQ runs transposed,
# dQ^T = K^T dS^T (BwdConfig.dq_transposed), with the head dim as M. hdim -> (tile_m, accumulator
# registers it was compile-probed to fit in): FA3 / FA4's 80-row step at hdim 128 without a mask,
# 208 = 40 + 40 (S^T, dP^T) + 64 + 64 (dK, dV), 16 over _BWD_KEYS_ACC_REGS. It runs in the
# ds_before_dv order (S^T / dP^T die k-block by k-block under dV's first half) and compiles with
# 6 commit groups and no spills for every dtype, mask, ds_stages, dk_rs and dq_per_wg setting
# (docs/decisions.md); not dispatched: unmeasured
_BWD_KEYS_DQ_T = {128: (80, 208)}


@dataclass(frozen=True)
class BwdConfig(_KernelConfig):
    tile_m: int = 64
    tile_n: int = 128
    num_stages: int = 2
    num_consumer_wg: int = 2
    # dQ tiles of one query block are added in key-block order: bitwise reproducible dQ
    deterministic: bool = False
    # "keys": each consumer warpgroup owns 64 keys of dK and dV (hopper/bwd.py); "hdim": each owns
    # hdim / num_consumer_wg head-dim rows of dK^T and dV^T (hopper/bwd_wide.py)
    kv_split: str = "keys"
    # dS^T smem buffers for kv_split "keys" (P and dS buffer pairs for "hdim"): with 2, step i
    # writes buffer i % 2 and the consumer warpgroups sync once per step instead of twice
    ds_stages: int = 1
    # kv_split "keys", dQ = dS K: the consumer warpgroups split the query rows (each a 64 x hdim
    # tile, one WGMMA M tile with N = hdim) instead of the head dim (each tile_m x hdim / wg, so
    # tile_m / 64 M tiles with N = hdim / wg). Needs tile_m = 64 * num_consumer_wg (hdim 64's 128
    # rows). At hdim 64 that is 8 WGMMAs of N 64 per warpgroup instead of 16 of N 32, with a third
    # less shared memory read per dQ FLOP (A: dS, is read once per M tile); FA3 / FA4 split dQ this
    # way at hdim 64 (AtomLayoutMdQ = 2).
    dq_by_rows: bool = False
    # kv_split "keys", dK += dS^T Q: the A operand from registers (the bf16 / fp16 dS^T fragment
    # converted from dP^T, as dV takes P^T) instead of re-reading this warpgroup's dS^T from smem
    # (RS instead of SS, as FA3 / FA4). dS^T is still written to smem for dQ = dS K; its fragment
    # stays live until the dK GEMM has finished (docs/decisions.md).
    dk_rs: bool = False
    # kv_split "keys": per-warpgroup dQ hand-off (FA3 / FA4). Each consumer warpgroup hands its part
    # of the fp32 dQ smem tile (its head-dim columns; its 64 query rows with dq_by_rows) to the dQ
    # writer warp through its own dQ-empty / dQ-full named-barrier pair (128 + 32 threads), and the
    # writer adds each part with its own TMA reduce-add, instead of both warpgroups and the writer
    # meeting on one pair of 288-thread barriers every step (docs/decisions.md).
    dq_per_wg: bool = False
    # kv_split "keys" at 128-row steps (hdim 64): FA3 / FA4's step order instead of ds_before_dv.
    # All of dS^T is formed, converted and written to smem, then dV is issued as one group, and
    # the wait that frees P^T (dV done) comes after the dQ issue instead of inside the dS^T loop,
    # so this warpgroup's tensor work never drains mid-step; dO's stage goes back to the producer
    # at that wait rather than at the end of the step (docs/decisions.md, earlier).
    ds_then_dv: bool = False
    # kv_split "keys": only the steps whose query block crosses the causal / right-window edge or
    # the left-window edge of this CTA's key block (and every step of the last, ragged key block)
    # take the masked body, the others one with no mask code (as the forward's runs of key
    # blocks); the masked body compares thread 0's compile-time coordinates against one limit per
    # key row. Same step order (docs/decisions.md).
    mask_runs: bool = False
    # The softmax scale applied to dS once, for free, instead of to dQ and dK: the preprocess stores
    # D * scale, and dS = P (dP * scale - D * scale) turns the subtraction into an FFMA, so the
    # per-step scaling of the dQ tile (32 FMUL a thread at hdim 64 / 128, 64 at 256: before the
    # dQ hand-off, or before each atomic in hopper/bwd_wide.py) and dK's at the end go away.
    # Rounds dS * scale instead of dS to bf16 / fp16 (the same relative error).
    scale_in_ds: bool = False
    # Causal / local: CTAs launch longest first (LPT). A key block's work falls with its index under
    # a causal mask (key block n sees the query blocks from about n on), and the launch order
    # (key block fastest, then KV head, then batch) puts the last (head, batch) pair's longest
    # CTAs into the last wave. With lpt the launch order runs over sections of (head, batch) pairs
    # whose Q, dO, dQ accumulator, K and V fit in lpt_l2_kib, key block slowest inside a section,
    # so the last CTAs to start are the shortest (FA3's backward LPT scheduler does the same). Not
    # with deterministic (its dQ order needs its own launch order).
    lpt: bool = False
    # lpt's section budget: half the H100's 50 MB L2, so that the pairs of the resident CTAs stay
    # in L2 on the H100 and the H200 (tests set it small to get many sections)
    lpt_l2_kib: int = 24 * 1024
    # The backward preprocess (hopper/bwd_pre.py) also clears the fp32 dQ accumulator, each row as
    # it reads that row's O and dO, instead of a fill kernel before it: one kernel and its launch
    # gap fewer; the bytes written are the same (BwdPreprocessZeroDq).
    pre_zero_dq: bool = False
    # dO (and D row) ring depth for kv_split "hdim"; 0 means num_stages (the Q ring's depth). FA3
    # runs hdim 256 at 64 x 80 with one dO stage: two would not fit next to 80 keys of K and V.
    do_stages: int = 0

    # kv_split "hdim": the warpgroups split dK^T and dV^T by keys (WGMMA N: tile_n / W keys each, all
    # hdim rows as M tiles) instead of by head-dim rows, FA4's shape at hdim 192 (2 warpgroups at 240
    # registers, 64 x 96; docs/decisions.md). The accumulator count is the same; the M split
    # needs hdim / W to be whole 64-row tiles (so 3 warpgroups at 192), this one does not.
    dkv_by_keys: bool = False
    # kv_split "hdim": dQ = dS K in this many column chunks, one after the other in the same
    # registers (hopper/bwd_wide.py); 0 picks 1, or 2 where the whole dQ tile would not fit next
    # to dK^T and dV^T (_check_hdim_split's arithmetic: hdim 256 from tile_n 80)
    dq_chunks: int = 0
    # kv_split "hdim": dQ leaves through an fp32 smem tile (tile_m x hdim) that the producer
    # warpgroup's second warp adds to the accumulator with TMA reduce-adds, one per warpgroup part
    # (and dQ chunk), on per-warpgroup empty / full named barriers, as hopper/bwd.py's dq_per_wg and
    # FA4 at hdim 192 / 256, instead of 8-byte fp32 atomics from the consumers. The tile needs the
    # smem of a dO stage and a P / dS pair at hdim 192, and FA4's 64 x 64 tile with single Q / dO
    # stages at 256 (docs/decisions.md). On the H200: +8..+24% over the atomics in
    # those tiles, but the tiles lose more to the dispatched ones (net -3..-5% at 192, -11..-19% at
    # 256); not dispatched.
    dq_tma: bool = False
    # with dq_tma: smem for the whole fp32 dQ tile (0), or for one part (1: tile_m x hdim / (W x
    # dq_chunks), 16 KiB at 192 / 256) that the writer lends to one warpgroup at a time in part order
    # (per-warpgroup barriers, so the warpgroups never meet on one), so that the dispatched tiles fit
    # with one P / dS pair; the hand-offs of a step then run one after the other.
    dq_slots: int = 0
    # with dq_slots 1: the slot lent in two column halves (64 x 32 fp32, 8 KiB each) that the writer
    # reduce-adds one after the other, so a warpgroup's stores into one half run while the TMA unit
    # still reads the other, and the next grant waits only for the half-turn before last instead of
    # the whole previous part (34% of the hdim 256 kernel's stall samples sat at the
    # slot's grant). Same smem; twice the hand-offs, each half as long.
    dq_slot_halves: bool = False
    # with dq_slot_halves: the slot as a ring of this many half-size boxes (0: the two halves), so
    # that more of the writer's reduce-adds read smem at once while the warpgroups store the next
    # halves; each box is used again dq_slot_ring half-turns later. On the H200: hdim 256
    # with no dQ reduce-add at all ran 13-16% faster, with a plain TMA store in its place 1-4%, and
    # the slot's grants held ~24% of the warps' stall samples: the hand-offs are latency-bound, not
    # bound by the reduction. 3 boxes take 8 KiB more smem at hdim 256 (227,136 B).
    dq_slot_ring: int = 0
    # kv_split "hdim" at hdim 256 (two warpgroups, dQ in two chunks): S = Q K^T and dP = dO V^T split
    # by GEMM instead of by keys: warpgroup 0 computes S and P over all tile_n keys, warpgroup 1 dP
    # and, with P read back from smem (bf16), dS. Each S / dP WGMMA then has N = tile_n (80) instead
    # of tile_n / 2 (40, whose operands need 166 B of smem a tensor cycle against the 128 smem
    # delivers) and Q and dO are read once a step instead of twice: ~-8% of the step's smem
    # wavefronts (docs/decisions.md). dV^T is issued as soon as P is in smem.
    # dS is formed from the rounded P. Not with softcap (dS needs tanh's derivative of S).
    sdp_by_gemm: bool = False
    # with dq_tma: each 8-row group of the smem dQ tile holds query rows 0, 4, 1, 5, 2, 6, 3, 7, and the
    # TMA reduce-add reads it through a gmem view of dQaccum with those rows interleaved back. The
    # consumers' 8-byte stores of a WGMMA accumulator put rows 0-3 in one half-warp; in a 128-byte
    # swizzled fp32 tile rows r and r ^ 1 fall on the same banks, so each store took 4 wavefronts
    # instead of 2 (ncu, all 85M bank conflicts of the hdim 192 kernel; FA4: 4.6M). With
    # the rows interleaved a half-warp's four rows sit at swizzle phases 0, 2, 4, 6. dQaccum is then
    # allocated with seqlen_q padded to whole query blocks (the view merges batch into the rows).
    dq_rows_interleaved: bool = False
    # Programmatic dependent launch: the main kernel is launched so that it may start while the
    # preprocess (pre_zero_dq's, which signals once its O / dO rows are read) is still finishing, and
    # only the warps that read what the preprocess writes (LSE / D rows, the cleared dQ accumulator)
    # wait for it (griddepcontrol.wait): the launch and the prologue (barrier init, descriptor
    # prefetch, K / V loads) run under the preprocess's tail, as FA4 does. A few microseconds a call;
    # most visible at short sequences.
    pdl: bool = False
    # The fp32 dQ accumulator in (batch, head, seqlen, hdim) memory order instead of q's (batch,
    # seqlen, head, hdim), passed to the same kernels as a permuted view (their strides are runtime
    # values): a query block's tile is then one contiguous tile_m x hdim block instead of rows
    # h x hdim x 4 bytes apart, closer to FA4's flat accumulator, for the reduce-adds' L2 / DRAM
    # locality (docs/decisions.md). The cast to dQ writes q's order. A runtime choice only:
    # the kernels compiled for it are the same.
    dq_accum_head_major: bool = False
    # Variable-length sequences packed along the token dimension (flash_attn_varlen_func): one CTA per
    # (key block of the longest sequence, KV head, sequence), the blocks past a sequence's end idle;
    # Q, dO, K, V by TMA from the sequence's first row; LSE / D rows in a per-sequence padded layout
    # (each sequence's rows from a multiple of tile_m, +inf / 0 past its end: P and dS are 0 there);
    # dQ tiles reduce-added into the packed accumulator (rows past the sequence add exact zeros); dK,
    # dV stored row by row (a TMA box would write the next sequence's rows).
    varlen: bool = False

    @property
    def num_do_stages(self) -> int:
        return self.do_stages or self.num_stages

    def _hdim_split_regs(self, dq_chunks: int) -> tuple[int, int, int]:
        """fp32 accumulator registers per consumer thread for kv_split "hdim": (dK^T + dV^T,
        S + dP, one dQ chunk)."""
        wg = self.num_consumer_wg
        dkv = 2 * (self.hdim // wg) * self.tile_n // WARPGROUP_THREADS
        sdp = 2 * self.tile_m * (self.tile_n // wg) // WARPGROUP_THREADS
        dq = self.tile_m * (self.hdim // wg) // dq_chunks // WARPGROUP_THREADS
        return dkv, sdp, dq

    @property
    def num_dq_chunks(self) -> int:
        if self.dq_chunks:
            return self.dq_chunks
        return 1 if self._hdim_fits(1) else 2

    def _hdim_fits(self, dq_chunks: int) -> bool:
        dkv, sdp, dq = self._hdim_split_regs(dq_chunks)
        return dkv + max(sdp, dq) + _BWD_HDIM_REG_SLACK <= self.consumer_regs

    @property
    def dq_transposed(self) -> bool:
        """kv_split "keys" with a query-row step that is no multiple of 64 (80 at hdim 128):
        hopper/bwd.py computes dQ^T = K^T dS^T, the warpgroups splitting the head dim as M."""
        return self.kv_split == "keys" and self.tile_m % 64 != 0

    @property
    def ds_before_dv(self) -> bool:
        """hopper/bwd.py's per-step order at 128 queries: dS^T to smem (k-block by k-block from
        the fp32 accumulator) before the dV GEMM is issued, instead of after."""
        return self.kv_split == "keys" and self.tile_m > 64 and not self.dv_after_ds

    @property
    def dv_after_ds(self) -> bool:
        """ds_then_dv where it applies: not with softcap, whose P^T and dS^T are both formed
        after the dP^T wait from tanh (one more fp32 tile live: 28 bytes of spills in that order)."""
        return self.ds_then_dv and self.kv_split == "keys" and self.tile_m > 64 and not self.softcap

    @property
    def row_stride(self) -> int:
        """fp32 elements between the LSE (and D) rows of two ring stages in smem: a TMA
        destination must be 128-byte aligned, so 80 rows (320 B) take 96."""
        return -(-self.tile_m // 32) * 32

    def smem_bytes(self) -> int:
        """K, V once (their buffers also stage dK, dV for the TMA stores); Q and dO rings with the
        LSE / D rows of each stage; dS^T (and P for "hdim"); mbarriers; 1 KiB alignment; for "keys"
        also the fp32 dQ tile."""
        stages = self.num_stages + self.num_do_stages  # Q stages + dO stages
        kv = 2 * self.tile_n * self.hdim * 2
        q_do = stages * self.tile_m * self.hdim * 2
        rows = stages * self.row_stride * 4
        ds = self.tile_n * self.tile_m * 2 * (2 if self.kv_split == "hdim" else 1) * self.ds_stages
        dq = self.tile_m * self.hdim * 4 if self.kv_split == "keys" or self.dq_tma else 0
        if self.dq_tma and self.dq_slots:
            dq //= self.num_consumer_wg * self.num_dq_chunks
            if self.dq_slot_ring:  # ring boxes of half a part each
                dq = dq // 2 * self.dq_slot_ring
        return 1024 + kv + q_do + rows + ds + dq + 8 * (2 + 2 * stages)

    def dq_halves_fit(self) -> bool:
        """Whether the dQ slot can be lent in column halves (dq_slot_halves): one slot, whole
        64-column parts."""
        return (self.dq_slots == 1 and self.dq_tma and self.kv_split == "hdim"
                and (self.hdim // (self.num_consumer_wg * self.num_dq_chunks)) % 64 == 0)

    def sdp_by_gemm_fits(self) -> bool:
        """Whether S and dP can be split by GEMM (sdp_by_gemm): two warpgroups splitting dK^T / dV^T by
        head dim, dQ in two chunks (hdim 256), no softcap."""
        return (self.kv_split == "hdim" and self.num_consumer_wg == 2 and self.num_dq_chunks == 2
                and not (self.softcap or self.dkv_by_keys))

    def dq_rows_fit(self) -> bool:
        """Whether the dQ tile's rows can be interleaved in smem (dq_rows_interleaved)."""
        return not (self.dq_accum_head_major or self.dq_transposed
                    or (self.kv_split == "hdim" and not self.dq_tma))

    def check(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not in {DTYPES}")
        if self.hdim not in BWD_HDIMS:
            raise ValueError(f"backward hdim {self.hdim} not in {BWD_HDIMS} (first version)")
        if self.kv_split == "hdim":
            self._check_hdim_split()
        elif self.kv_split != "keys":
            raise ValueError(f"kv_split {self.kv_split!r} not in ('keys', 'hdim')")
        elif self.tile_n != 64 * self.num_consumer_wg:
            raise ValueError(f"tile_n {self.tile_n} must be 64 keys per consumer warpgroup")
        elif self.num_do_stages != self.num_stages:
            raise ValueError(f"do_stages {self.do_stages} != num_stages {self.num_stages}: a separate "
                             "dO ring depth exists only for kv_split 'hdim'")
        elif self.dq_chunks > 1:
            raise ValueError(f"dq_chunks {self.dq_chunks}: dQ chunks exist only for kv_split 'hdim'")
        if self.dq_by_rows and self.kv_split != "keys":
            raise ValueError("dq_by_rows exists only for kv_split 'keys'")
        if self.dk_rs and self.kv_split != "keys":
            raise ValueError("dk_rs exists only for kv_split 'keys' (hdim 64 / 96 / 128, hopper/bwd.py); "
                             "kv_split 'hdim' computes dK^T = Q^T dS with dS from smem")
        if self.ds_then_dv and (self.kv_split != "keys" or self.tile_m % 128):
            raise ValueError("ds_then_dv exists only for kv_split 'keys' with tile_m 128 (hdim 64's "
                             "128-row step; 64-row steps already issue dV after dS, and at 80 rows "
                             "ptxas serialized every WGMMA and spilled)")
        if self.dkv_by_keys and self.kv_split != "hdim":
            raise ValueError("dkv_by_keys exists only for kv_split 'hdim' (hdim 192 / 256, "
                             "hopper/bwd_wide.py); kv_split 'keys' splits dK and dV by keys already")
        if self.dq_tma and self.kv_split != "hdim":
            raise ValueError("dq_tma exists only for kv_split 'hdim' (hdim 192 / 256, hopper/bwd_wide.py); "
                             "kv_split 'keys' always adds dQ by TMA reduce-adds")
        if self.dq_slots not in (0, 1) or (self.dq_slots and not self.dq_tma):
            raise ValueError(f"dq_slots {self.dq_slots}: 0 (the whole dQ tile in smem) or 1 (one part at a "
                             "time), and only with dq_tma")
        if self.dq_slot_halves and not self.dq_halves_fit():
            raise ValueError("dq_slot_halves needs dq_slots=1 (kv_split 'hdim', dq_tma) and dQ parts of a "
                             "multiple of 64 columns (each half whole 128-byte swizzle atoms of fp32)")
        if self.dq_slot_ring and (self.dq_slot_ring < 3 or not self.dq_slot_halves):
            raise ValueError(f"dq_slot_ring {self.dq_slot_ring}: 0 (the slot's two halves) or >= 3 half-size "
                             "boxes, and only with dq_slot_halves")
        if self.sdp_by_gemm and not self.sdp_by_gemm_fits():
            raise ValueError("sdp_by_gemm needs kv_split 'hdim' with two consumer warpgroups splitting "
                             "dK^T / dV^T by head dim, dQ in two chunks (hdim 256), and no softcap or "
                             "dkv_by_keys")
        if self.dq_rows_interleaved and not self.dq_rows_fit():
            raise ValueError("dq_rows_interleaved needs a smem dQ tile written in row pairs (dq_tma in the "
                             "wide kernel; not dq_transposed, whose stores do not conflict), the (b, sq, h, "
                             "d) accumulator (its view merges batch into the rows)")
        if self.mask_runs and self.kv_split != "keys":
            raise ValueError("mask_runs exists only for kv_split 'keys' (hdim 64 / 96 / 128, hopper/bwd.py)")
        if self.dq_per_wg and self.kv_split != "keys":
            raise ValueError("dq_per_wg exists only for kv_split 'keys' (hdim 64 / 96 / 128, hopper/bwd.py); "
                             "kv_split 'hdim' adds dQ with atomics from the consumer warpgroups")
        if self.num_stages < 1 or self.num_do_stages < 1:
            raise ValueError(f"num_stages {self.num_stages} and do_stages {self.do_stages} must be >= 1")
        if self.hdim % (8 * self.num_consumer_wg):
            raise ValueError(f"hdim {self.hdim} must split into WGMMA N tiles across warpgroups for dQ")
        if self.ds_stages not in (1, 2):
            raise ValueError(f"ds_stages {self.ds_stages} not in (1, 2)")
        if self.lpt_l2_kib < 1:
            raise ValueError(f"lpt_l2_kib {self.lpt_l2_kib} must be >= 1")
        if self.lpt and self.deterministic:
            raise ValueError("lpt and deterministic: deterministic mode launches the key blocks in the order "
                             "its dQ accumulation waits in; one of the two")
        if self.smem_bytes() > SMEM_CAPACITY:
            raise ValueError(f"shared memory {self.smem_bytes()} B exceeds {SMEM_CAPACITY} B")
        self._check_register_split()
        if self.kv_split == "keys":
            self._check_key_split()
        if self.varlen:
            self._check_varlen()

    def _check_varlen(self) -> None:
        """What the varlen backward (first version: one CTA per key block, no launch reordering) is
        built for."""
        unsupported = {"lpt": self.lpt, "pdl": self.pdl,
                       "pre_zero_dq": self.pre_zero_dq, "dq_rows_interleaved": self.dq_rows_interleaved,
                       "dq_accum_head_major": self.dq_accum_head_major,
                       "kv_split 'hdim' without dq_tma": self.kv_split == "hdim" and not self.dq_tma}
        if bad := [name for name, on in unsupported.items() if on]:
            raise ValueError(f"varlen: {', '.join(bad)} not supported with packed sequences")

    def _check_key_split(self) -> None:
        if self.dq_by_rows and self.tile_m != 64 * self.num_consumer_wg:
            raise ValueError(f"dq_by_rows needs tile_m {64 * self.num_consumer_wg} (64 query rows per "
                             f"consumer warpgroup), not {self.tile_m}")
        cap = _BWD_KEYS_ACC_REGS
        if self.dq_transposed:
            self._check_dq_transposed()
            cap = _BWD_KEYS_DQ_T[self.hdim][1]
        elif self.tile_m % 64:
            raise ValueError(f"tile_m {self.tile_m} must be a multiple of 64 (WGMMA M of dQ)")
        # per thread: S^T + dP^T (64 keys x tile_m, twice) and dK + dV (64 keys x hdim, twice) are
        # tile_m + hdim fp32 registers, all live while the S^T / dP^T GEMMs run. hdim 64 at
        # tile_m 128 (192) is the most that ptxas fits in 240 with the WGMMAs kept asynchronous
        # (hopper/bwd.py, ds_before_dv); beyond that it serializes them or spills.
        if self.tile_m + self.hdim > cap:
            raise ValueError(f"accumulators need {self.tile_m + self.hdim} registers per thread "
                             f"(S^T, dP^T, dK, dV), more than {cap} of "
                             f"{self.consumer_regs}")

    def _check_dq_transposed(self) -> None:
        """tile_m not a multiple of 64: only the compile-probed shape (_BWD_KEYS_DQ_T)."""
        probed = {d: m for d, (m, _) in _BWD_KEYS_DQ_T.items()}
        if probed.get(self.hdim) != self.tile_m:
            raise ValueError(f"tile_m {self.tile_m} must be a multiple of 64 (WGMMA M of dQ), or with dQ "
                             f"computed transposed (dQ^T = K^T dS^T) one of (hdim, tile_m) "
                             f"{sorted(probed.items())}, not ({self.hdim}, {self.tile_m})")
        if self.hdim != 64 * self.num_consumer_wg:
            raise ValueError(f"tile_m {self.tile_m}: dQ^T = K^T dS^T needs 64 head-dim rows (WGMMA M) per "
                             f"consumer warpgroup, hdim {self.hdim} with {self.num_consumer_wg}")

    def _check_hdim_split(self) -> None:
        wg = self.num_consumer_wg
        if wg not in REG_SPLIT:
            raise ValueError(f"num_consumer_wg {wg} not in {sorted(REG_SPLIT)}")
        if self.tile_m != 64:
            raise ValueError(f"tile_m {self.tile_m} must be 64 (one WGMMA M for S and dP)")
        if self.hdim % (64 if self.dkv_by_keys else 64 * wg):
            raise ValueError(f"hdim {self.hdim} must split into 64-row WGMMA M tiles across {wg} "
                             "warpgroups for dK^T and dV^T (whole 64-row tiles with dkv_by_keys)")
        if self.tile_n % (8 * wg) or self.tile_n % 16 or self.tile_n > 256:
            raise ValueError(f"tile_n {self.tile_n} must give each of the {wg} warpgroups a multiple "
                             "of 8 keys (WGMMA N of S and dP) and be a multiple of 16 up to 256 (WGMMA "
                             "K of dQ, N of dV^T and dK^T)")
        chunks = self.num_dq_chunks
        # a chunk is whole 64-column atoms of K's 128-byte swizzle (its K^T view is dQ's B operand)
        if chunks not in (1, 2) or (chunks > 1 and (self.hdim // chunks) % 64):
            raise ValueError(f"dq_chunks {chunks} must be 1, or 2 where hdim / 2 is a multiple of 64 "
                             "(whole swizzle atoms of K)")
        # dK^T + dV^T, plus the larger of S + dP and one dQ chunk (never live together), plus
        # _BWD_HDIM_REG_SLACK for addresses, row statistics, loop state and temporaries
        dkv, sdp, dq = self._hdim_split_regs(chunks)
        if dkv + max(sdp, dq) + _BWD_HDIM_REG_SLACK > self.consumer_regs:
            raise ValueError(f"accumulators need {dkv + max(sdp, dq)} registers per thread (dK^T + "
                             f"dV^T {dkv}, S + dP {sdp}, dQ chunk {dq}), too many for "
                             f"{self.consumer_regs} consumer registers")


def parse_overrides(text: str) -> dict:
    """Config fields from the command line / environment: 'tile_n=80,do_stages=1' ->
    {'tile_n': 80, 'do_stages': 1}; 'dq_by_rows=True' -> {'dq_by_rows': True} (true / false in any
    case); 'default' or '' -> {}. For the tuning scripts and the test hook, not the call path."""
    if text.strip() in ("", "default"):
        return {}
    fields = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, value = (x.strip() for x in item.split("=", 1))
        fields[key] = value.lower() == "true" if value.lower() in ("true", "false") else int(value)
    return fields


def bwd_with_overrides(cfg: BwdConfig, **overrides) -> BwdConfig:
    """`cfg` with `overrides` (tests, tuning) replacing its fields; a field that `cfg` chose itself
    (by head dim or per call) and that an override rules out is dropped, one that was asked for is
    checked."""
    cfg = dataclasses.replace(cfg, **overrides)
    # dq_by_rows needs 64 query rows per warpgroup: a tile_m override drops it unless asked for,
    if cfg.dq_by_rows and "dq_by_rows" not in overrides and cfg.tile_m != 64 * cfg.num_consumer_wg:
        cfg = dataclasses.replace(cfg, dq_by_rows=False)
    # and FA4's step order exists only at 128-row steps
    if cfg.ds_then_dv and "ds_then_dv" not in overrides and cfg.tile_m % 128:
        cfg = dataclasses.replace(cfg, ds_then_dv=False)
    # and the interleaved dQ rows only with a smem dQ tile of row pairs (an override to atomics,
    # a transposed or head-major dQ drops them)
    if cfg.dq_rows_interleaved and "dq_rows_interleaved" not in overrides and not cfg.dq_rows_fit():
        cfg = dataclasses.replace(cfg, dq_rows_interleaved=False)
    # and S / dP split by GEMM only where its check holds (two warpgroups by head dim, dQ in two
    # chunks, not dkv_by_keys)
    if cfg.sdp_by_gemm and "sdp_by_gemm" not in overrides and not cfg.sdp_by_gemm_fits():
        cfg = dataclasses.replace(cfg, sdp_by_gemm=False)
    # and the slot's halves only with one slot of whole 64-column parts
    if cfg.dq_slot_halves and "dq_slot_halves" not in overrides and not cfg.dq_halves_fit():
        cfg = dataclasses.replace(cfg, dq_slot_halves=False)
    # and the slot's ring only where it goes round in halves (asked for or not: not under a local
    # window, where the dispatch keeps the slot whole)
    if cfg.dq_slot_ring and not cfg.dq_slot_halves:
        cfg = dataclasses.replace(cfg, dq_slot_ring=0)
    cfg.check()
    return cfg


@dataclass(frozen=True)
class BwdPreConfig:
    """The backward preprocess (D = rowsum(dO * O), LSE in log2 units) a BwdConfig launches before
    its main kernel: `scale_d` D times the softmax scale (BwdConfig.scale_in_ds); `zero_dq` it also
    clears the fp32 dQ accumulator (BwdConfig.pre_zero_dq); `pdl` it lets the main kernel launch
    once its rows are read (BwdConfig.pdl); `varlen` packed sequences (BwdConfig.varlen): O, dO and
    LSE packed, the rows out in the main kernel's per-sequence padded layout."""

    dtype: str
    hdim: int
    scale_d: bool = False
    zero_dq: bool = False
    pdl: bool = False
    varlen: bool = False

    @classmethod
    def of(cls, cfg: BwdConfig, dv: int = 0) -> BwdPreConfig:
        """The preprocess `cfg` launches. `dv`: a (cfg.hdim, dv) pair's value head dim (SPLIT_HDIMS),
        whose main kernel takes V and dO padded to cfg.hdim: D is formed from O and dO as they are
        (dv wide, no padded copy of O), and the host clears the dQ accumulator (cfg.hdim wide), so
        this preprocess neither clears it nor launches the main kernel early (pdl)."""
        if dv and dv != cfg.hdim:
            return cls(cfg.dtype, dv, scale_d=cfg.scale_in_ds, varlen=cfg.varlen)
        return cls(cfg.dtype, cfg.hdim, scale_d=cfg.scale_in_ds, zero_dq=cfg.pre_zero_dq, pdl=cfg.pdl,
                   varlen=cfg.varlen)


# split-KV decode's merge (hopper/combine.py): the partial outputs' and the output's dtypes it is built for
COMBINE_DTYPES = ("bf16", "fp16", "fp32")
COMBINE_MAX_SPLITS = 64  # also the most splits splitkv.plan chooses (splitkv.MAX_SPLITS)


@dataclass(frozen=True)
class CombineConfig:
    """The merge of split-KV decode's partial outputs by their LSE (hopper/combine.py): `dtype` the
    partial outputs' (the varlen kernel writes them in the input dtype), `hdim` their head dim (the value
    head dim), `out_dtype` the output's, `max_splits` the most splits a row has (the LSEs of a row are
    read one per lane, max_splits / 32 a lane)."""

    dtype: str
    hdim: int
    out_dtype: str
    max_splits: int = COMBINE_MAX_SPLITS
    # launched as a programmatic dependent of the split kernel before it (FwdConfig.pdl): it waits for it
    # (griddepcontrol.wait) before reading anything, and lets the next kernel launch early in turn
    pdl: bool = True

    def check(self) -> None:
        for name in ("dtype", "out_dtype"):
            if getattr(self, name) not in COMBINE_DTYPES:
                raise ValueError(f"CombineConfig.{name} {getattr(self, name)!r}; accepted: {COMBINE_DTYPES}")
        width = 4 if self.dtype == "fp32" else 2
        if self.hdim <= 0 or self.hdim * width % 16:
            raise ValueError(f"CombineConfig.hdim {self.hdim}: rows of whole 16-byte vectors")
        if self.max_splits < 32 or self.max_splits % 32:
            raise ValueError(f"CombineConfig.max_splits {self.max_splits}: a positive multiple of 32")
