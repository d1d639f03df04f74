"""FP8 (e4m3) forward pieces: V transposed in shared memory by the producer warpgroup.

FP8 WGMMA reads both operands K-major. For O += P V the reduction runs over keys, so V must
sit in shared memory with the keys contiguous (V^T: head dim x keys), while users store V with
the head dim contiguous. The TMA brings each V tile as stored into a ring of its own (sVt); the
producer warpgroup's warps 1-3 (warp 0 issues the TMA) rewrite it into the V stage of the K/V
ring that the consumers' P @ V reads, one block behind the loads, through two pipelines:
sVt full/empty (TMA -> transposer) and sV full/empty (transposer -> consumers).

Keys are written in P's register order (layout.acc_layout_as_operand_a_fp8): inside each 16
keys, position 4q + j holds key 2q + j % 2 + 8 (j // 2), q = 0..3: the bytes ldmatrix.trans hands a
lane from two 8-key halves. A warp moves a unit of 16 keys x 32 head-dim columns (512 bytes) with
one LDSM.T x4, four PRMT and one STSM x4 per lane (FA3's scheme):

- LDSM.T x4 reads the fp8 tile as 16-bit elements, four 8 x 8 matrices of 8 keys x 16 bytes:
  lanes 0-15 address keys 0-15 of the unit's first 16 columns, lanes 16-31 those of the next 16
  (`lane_roles`). Lane (q = lane % 4, j = lane // 4) receives, of each matrix, keys 2q and 2q+1 of
  columns 2j and 2j+1;
- byte_perm of the keys-0-7 and keys-8-15 registers with selectors 0x6420 / 0x7531 gives the
  words of V^T's rows 2j and 2j+1 at positions 4q..4q+3 (keys 2q, 2q+1, 2q+8, 2q+9: P's order);
- STSM x4 writes each register as one matrix of 8 rows x 16 bytes (one 16-key group), row i from
  lanes 4i..4i+3. Lanes 16-31 swap their two words (the PRMT selector is a per-lane register), so
  a matrix holds head-dim rows 0, 2, 4, 6, 9, 11, 13, 15 (or 1, 3, 5, 7, 8, 10, 12, 14) of its 16:
  eight rows distinct mod 8, which each of the 32-, 64- and 128-byte swizzles puts in eight
  different 16-byte bank groups (without the swap: 2-way conflicts). The LDSM.T matrices are 8
  consecutive keys of one 16-byte column chunk, likewise. Neither meets a bank conflict: 4
  wavefronts per x4 instruction, the least for 512 bytes (tests/test_fp8_layouts.py models the banks).

Addresses. A swizzle XORs an offset's 16-byte chunk bits (bit 4 up to 6) with its row bits (bit 7 up
to 9), so it commutes with adding whole 8-row periods. A lane's row inside a unit is fixed; a unit
lies whole periods away from unit 0 (16 keys in sVt, 32 head-dim rows in sV), or whole column blocks,
plus a chunk offset inside the swizzled row. So a lane's offset in unit u is (its offset in unit 0)
XOR X(u) + K(u), X(u) the unit origin's chunk bits and K(u) the rest, both constants
(`unit_offsets`; the tests check every lane of every unit). Each thread computes its two base
addresses and selectors once (`lane_bases`); per V tile it adds the stage offsets (whole periods
too), takes one LOP3 per distinct X, and gives K as the LDSM / STSM immediate. For every X and K to
be constants each warp runs its own unrolled unit list (`warp_units`) behind a warp-uniform branch.
Two units' LDSM.T go before their PRMT / STSM (UNITS_PER_BATCH: 8 words in flight; the asm
statements keep their order, and in the SASS a batch's loads stay after the previous batch's stores);
one at a time where the producer runs below 48 registers (`units_per_batch`).

The stores are fenced for the consumers' WGMMA by fence.proxy.async.shared::cta before the
mbarrier arrive: the arrive's release orders the writes for generic-proxy readers only, and
WGMMA reads shared memory through the async proxy, so each writing thread needs the proxy fence.
ptxas emits it as MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S, as for the epilogue's fence before its TMA
store; PTX has no weaker form for generic writes.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from flashhopper.config import FP8_KEY_ORDER, key_of_position  # noqa: F401 (the tests take them from here)

TRANSPOSER_WARPS = 3
TRANSPOSER_THREADS = 32 * TRANSPOSER_WARPS
# a warp's unit of work: 16 keys (one group of P's key order) x 32 head-dim columns, 512 bytes
UNIT_KEYS, UNIT_COLS = 16, 32
# units whose LDSM.T are issued before their PRMT / STSM (4 words each in flight per lane): with 4, the
# producer's 48 registers spilled at hdim 96 and 192; with 2 at 40 registers, 8-24 bytes (hdim 96, 192,
# and 128 / 256 under some masks); one unit at a time compiles spill-free down to 32 (units_per_batch)
UNITS_PER_BATCH = 2


def units_per_batch(producer_regs: int) -> int:
    """UNITS_PER_BATCH at the producer's 48 registers or more, one unit at a time below."""
    return UNITS_PER_BATCH if producer_regs >= 48 else 1


# PRMT selectors: V^T's word of head-dim column 2j (SEL_EVEN) / 2j+1 (SEL_ODD) from an LDSM.T register of
# keys 0-7 (bytes 0-3) and one of keys 8-15 (bytes 4-7)
SEL_EVEN, SEL_ODD = 0x6420, 0x7531


@dsl_user_op
def ldsm_x4_trans(addr: Int32, offset: int, *, loc=None, ip=None) -> tuple[Int32, Int32, Int32, Int32]:
    """ldmatrix.trans of four 8 x 8 b16 matrices; this lane addresses row lane % 8 of matrix lane // 8
    at shared byte address `addr` + `offset` (a constant, the instruction's immediate)."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4), [Int32(addr).ir_value(loc=loc, ip=ip)],
        f"ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{$0, $1, $2, $3}}, [$4+{offset}];", "=r,=r,=r,=r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )
    return tuple(Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def stsm_x4(addr: Int32, offset: int, words, *, loc=None, ip=None) -> None:
    """stmatrix of four 8 x 8 b16 matrices (register i: matrix i); this lane addresses row lane % 8
    of matrix lane // 8 at shared byte address `addr` + `offset` (a constant)."""
    llvm.inline_asm(
        None, [Int32(addr).ir_value(loc=loc, ip=ip), *(Int32(w).ir_value(loc=loc, ip=ip) for w in words)],
        f"stmatrix.sync.aligned.m8n8.x4.shared.b16 [$0+{offset}], {{$1, $2, $3, $4}};", "r,r,r,r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )


@dsl_user_op
def _prmt(a: Int32, b: Int32, selector: Int32, *, loc=None, ip=None) -> Int32:
    return Int32(llvm.inline_asm(
        T.i32(), [Int32(a).ir_value(loc=loc, ip=ip), Int32(b).ir_value(loc=loc, ip=ip),
                  Int32(selector).ir_value(loc=loc, ip=ip)],
        "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    ))


def byte_perm(a, b, selector):
    """prmt.b32: byte i of the result is byte (selector >> 4i) & 7 of {b, a} (a: bytes 0-3); the
    selector may differ per lane. On Python ints (the CPU tests' model) computed here."""
    if isinstance(a, int) and isinstance(b, int) and isinstance(selector, int):
        pool = (a & 0xFFFFFFFF) | ((b & 0xFFFFFFFF) << 32)
        return sum(((pool >> (8 * ((selector >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
    return _prmt(a, b, selector)


def transpose_units(tile_n: int, hdim_v: int) -> int:
    """Units (16 keys x 32 head-dim columns) of one V tile."""
    assert tile_n % UNIT_KEYS == 0 and hdim_v % UNIT_COLS == 0, (tile_n, hdim_v)
    return (tile_n // UNIT_KEYS) * (hdim_v // UNIT_COLS)


def warp_units(warp: int, tile_n: int, hdim_v: int) -> list[tuple[int, int]]:
    """(first key, first head-dim column) of each unit of transposer warp `warp`, in its order: the
    units numbered column-block fastest, each warp a contiguous third (which keeps the distinct XORs
    of its addresses few)."""
    blocks = hdim_v // UNIT_COLS
    units = transpose_units(tile_n, hdim_v)
    return [(UNIT_KEYS * (u // blocks), UNIT_COLS * (u % blocks))
            for u in range(warp * units // TRANSPOSER_WARPS, (warp + 1) * units // TRANSPOSER_WARPS)]


def lane_roles(lane):
    """What lane `lane` (0..31, run-time or int) addresses in a unit: (key, column) of its LDSM.T row
    in sVt, head-dim row of its STSM row in sV (at the unit's first position), and the selectors of
    the PRMTs that make STSM registers 0 / 1 (2 / 3 alike) of the first / second 16 columns."""
    half = lane // 16  # lanes 16-31 hold columns 8-15 of each 16 and swap their two words
    ld_key, ld_col = lane % 16, 16 * half
    # STSM matrix m = lane // 8, its row i = lane % 8 comes from lanes 4i..4i+3: head-dim row
    # 16 (m // 2) + 2i + (m % 2 xor i // 4)
    st_row = 16 * half + 2 * (lane % 8) + (lane // 8 + lane // 4) % 2
    swap = half * (SEL_EVEN ^ SEL_ODD)
    return ld_key, ld_col, st_row, SEL_EVEN ^ swap, SEL_ODD ^ swap


# e4m3 1.0 in each byte of a word: the ones rows under V^T (FwdConfig.pv_row_sum)
ONES_WORD = 0x38383838


@dsl_user_op
def _sts128(addr: Int32, word: int, *, loc=None, ip=None) -> None:
    """st.shared.v4.b32 of one constant word four times at shared byte address `addr`."""
    w = Int32(word).ir_value(loc=loc, ip=ip)
    llvm.inline_asm(
        None, [Int32(addr).ir_value(loc=loc, ip=ip), w],
        "st.shared.v4.b32 [$0], {$1, $1, $1, $1};", "r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )


def ones_runs(sV_layout: cute.ComposedLayout, first_row: int, rows: int, tile_n: int, stages: int):
    """The byte ranges (start, length) of sV rows [first_row, first_row + rows) over every stage, merged
    where contiguous. The rows are whole 8-row swizzle atoms, so the swizzle only moves 16-byte chunks
    inside them; each chunk's offset comes from the layout. Plain Python, while tracing."""
    starts = sorted(sV_layout((r, c, st)) for st in range(stages) for r in range(first_row, first_row + rows)
                    for c in range(0, tile_n, 16))
    runs = []
    for x in starts:
        assert x % 16 == 0, x
        if runs and runs[-1][0] + runs[-1][1] == x:
            runs[-1][1] += 16
        else:
            runs.append([x, 16])
    assert sum(n for _, n in runs) == rows * tile_n * stages, runs
    return [tuple(r) for r in runs]


@cute.jit
def fill_ones_rows(runs: cutlass.Constexpr, v_base: Int32, tid: Int32, threads: cutlass.Constexpr[int]):
    """FwdConfig.pv_row_sum: e4m3 ones into sV's rows under V^T (`runs`: ones_runs), by `threads` threads
    (`tid` 0..threads-1), 16 bytes a store. Once a CTA: the transposer writes only the head dim's rows."""
    for k in cutlass.range_constexpr(len(runs)):
        start, chunks = runs[k][0], runs[k][1] // 16
        for j in cutlass.range_constexpr((chunks + threads - 1) // threads):
            i = tid + threads * j
            if i < chunks:
                _sts128(v_base + start + 16 * i, ONES_WORD)


def swizzle_bits(layout: cute.ComposedLayout) -> tuple[int, int]:
    """(the offset bits a swizzled smem layout XORs: 16-byte chunk bits, the bits it XORs them with:
    row bits inside the swizzle's period)."""
    sw = layout.inner
    chunk = ((1 << sw.num_bits) - 1) << sw.num_base
    return chunk, chunk << sw.num_shift


def swizzle_period(layout: cute.ComposedLayout) -> int:
    """Bytes after which a swizzled smem layout's XOR pattern repeats: an offset that is a multiple of it
    has neither chunk nor row bits (swizzle_bits)."""
    row_bits = swizzle_bits(layout)[1]
    return 1 << row_bits.bit_length()


def unit_offsets(key: int, col: int, vt_offset, v_offset, vt_bits, v_bits) -> tuple[int, int, int, int]:
    """(X, K) of the unit at (key, col) for the LDSM.T (sVt) and the STSM (sV): a lane whose offset in
    the unit at (0, 0) is o has o ^ X + K in this one. `vt_offset(key, column)` / `v_offset(row,
    position)`: stage-0 byte offsets (ints); `*_bits`: swizzle_bits of the layouts. X is the unit
    origin's chunk bits, K the rest; the origin is on a swizzle period (no row bits), so that the
    swizzle of a lane's row inside the unit is that of its row in unit (0, 0)."""
    o_ld, o_st = vt_offset(key, col), v_offset(col, key)
    assert not (o_ld & vt_bits[1] or o_st & v_bits[1]), (key, col, o_ld, o_st)
    return o_ld & vt_bits[0], o_ld & ~vt_bits[0], o_st & v_bits[0], o_st & ~v_bits[0]


def transpose_warp(units, ld_addr, st_addr, sel0, sel1, ldsm, stsm, perm=byte_perm,
                   per_batch: int = UNITS_PER_BATCH) -> None:
    """One warp's units of one V tile. `units`: unit_offsets of each; `ld_addr` / `st_addr`: the lane's
    address in unit (0, 0) of this stage's sVt / sV; `sel0`, `sel1`: lane_roles' selectors;
    `ldsm(addr, imm)` -> 4 words, `stsm(addr, imm, words)`, `perm(a, b, selector)`; `per_batch` units
    loaded before their stores. Plain Python: traced into the kernel per thread, run by the CPU tests on
    whole warps (tests/test_fp8_layouts.py)."""
    based = {}

    def xored(addr, x, side):
        if (side, x) not in based:  # one LOP3 per distinct X of the warp
            based[side, x] = addr ^ x if x else addr
        return based[side, x]

    for first in range(0, len(units), per_batch):
        batch = units[first:first + per_batch]
        loaded = [ldsm(xored(ld_addr, x_ld, "ld"), k_ld) for x_ld, k_ld, _, _ in batch]
        for (_, _, x_st, k_st), (r0, r1, r2, r3) in zip(batch, loaded, strict=True):
            words = (perm(r0, r1, sel0), perm(r0, r1, sel1), perm(r2, r3, sel0), perm(r2, r3, sel1))
            stsm(xored(st_addr, x_st, "st"), k_st, words)


def lane_bases(sVt_layout: cute.ComposedLayout, vt_base, sV_layout: cute.ComposedLayout, v_base, lane):
    """Once per thread: (LDSM.T address in sVt's unit (0, 0) of stage 0, STSM address likewise in sV,
    PRMT selectors 0 / 1). `*_base`: the buffers' shared byte addresses."""
    ld_key, ld_col, st_row, sel0, sel1 = lane_roles(lane)
    return (vt_base + sVt_layout((ld_key, ld_col, 0)), v_base + sV_layout((st_row, 0, 0)), sel0, sel1)


def stage_plans(sVt_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout, tile_n: int, hdim_v: int):
    """unit_offsets of each transposer warp's units, from the layouts (stage 0), while tracing."""
    def vt_offset(key, col):
        return sVt_layout((key, col, 0))

    def v_offset(row, pos):
        return sV_layout((row, pos, 0))

    vt_bits, v_bits = swizzle_bits(sVt_layout), swizzle_bits(sV_layout)
    return [[unit_offsets(key, col, vt_offset, v_offset, vt_bits, v_bits)
             for key, col in warp_units(w, tile_n, hdim_v)] for w in range(TRANSPOSER_WARPS)]


@cute.jit
def transpose_stage(sVt_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout, bases, vt_stage: Int32,
                    v_stage: Int32, warp: Int32, tile_n: cutlass.Constexpr[int],
                    hdim_v: cutlass.Constexpr[int], per_batch: cutlass.Constexpr[int] = UNITS_PER_BATCH):
    """One V tile: sVt[key, d] (stage vt_stage) -> sV[d, position] (stage v_stage), keys in P's
    order, by transposer warp `warp` (0..TRANSPOSER_WARPS-1, warp-uniform) with `bases` from
    lane_bases; `per_batch`: units_per_batch of the producer's registers."""
    ld_base, st_base, sel0, sel1 = bases
    vt_step, v_step = sVt_layout((0, 0, 1)), sV_layout((0, 0, 1))
    # a stage is a whole number of swizzle periods: its offset commutes with the units' XORs
    assert not (vt_step % swizzle_period(sVt_layout) or v_step % swizzle_period(sV_layout)), (vt_step, v_step)
    plans = stage_plans(sVt_layout, sV_layout, tile_n, hdim_v)
    ld_addr, st_addr = ld_base + vt_stage * vt_step, st_base + v_stage * v_step
    for w in cutlass.range_constexpr(TRANSPOSER_WARPS):
        if warp == w:
            transpose_warp(plans[w], ld_addr, st_addr, sel0, sel1, ldsm_x4_trans, stsm_x4,
                           per_batch=per_batch)
