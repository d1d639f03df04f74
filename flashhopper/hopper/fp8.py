"""FP8 (e4m3) forward pieces: V transposed in shared memory by the producer warpgroup.

FP8 WGMMA reads both operands K-major. For O += P V the reduction runs over keys, so V must
sit in shared memory with the keys contiguous (V^T: head dim x keys), while users store V with
the head dim contiguous. The TMA brings each V tile as stored into a ring of its own (sVt); the
producer warpgroup's warps 1-3 (warp 0 issues the TMA) rewrite it into the V stage of the K/V
ring that the consumers' P @ V reads, one block behind the loads, through two pipelines:
sVt full/empty (TMA -> transposer) and sV full/empty (transposer -> consumers).

Keys are written in P's register order (layout.acc_layout_as_operand_a_fp8): inside each 16
keys, position 4q + j holds key 2q + j % 2 + 8 (j // 2), q = 0..3. So each 32-bit word of V^T
(4 positions of one head-dim row) comes from keys 2q, 2q+1, 2q+8, 2q+9 of one 16-key group:
a lane loads 8 bytes (8 head-dim columns) of each of those 4 key rows, rotates them, transposes
the two 4 x 4 byte blocks with byte permutes, and stores 8 words, one per head-dim row. A warp
takes 16 keys x 64 columns at once, laid out over its lanes so that neither its loads nor its
stores meet a bank conflict at 128-byte rows (tests/test_fp8_layouts.py models the banks).
"""

from __future__ import annotations

from functools import partial

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from flashhopper.config import FP8_KEY_ORDER, key_of_position  # noqa: F401 (the tests take it from here)

TRANSPOSER_WARPS = 3
TRANSPOSER_THREADS = 32 * TRANSPOSER_WARPS


@dsl_user_op
def ld_shared_v2(addr: Int32, *, loc=None, ip=None) -> tuple[Int32, Int32]:
    """Two 32-bit words from a shared-memory byte address (8-byte aligned)."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32(), T.i32()]), [Int32(addr).ir_value(loc=loc, ip=ip)],
        "ld.shared.v2.b32 {$0, $1}, [$2];", "=r,=r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )
    return (Int32(llvm.extractvalue(T.i32(), res, [0], loc=loc, ip=ip)),
            Int32(llvm.extractvalue(T.i32(), res, [1], loc=loc, ip=ip)))


@dsl_user_op
def st_shared(addr: Int32, value: Int32, *, loc=None, ip=None) -> None:
    """One 32-bit word to a shared-memory byte address (4-byte aligned)."""
    llvm.inline_asm(
        None, [Int32(addr).ir_value(loc=loc, ip=ip), Int32(value).ir_value(loc=loc, ip=ip)],
        "st.shared.b32 [$0], $1;", "r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    )


@dsl_user_op
def _prmt(a: Int32, b: Int32, selector: int, *, loc=None, ip=None) -> Int32:
    return Int32(llvm.inline_asm(
        T.i32(), [Int32(a).ir_value(loc=loc, ip=ip), Int32(b).ir_value(loc=loc, ip=ip)],
        f"prmt.b32 $0, $1, $2, {selector:#x};", "=r,r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    ))


def byte_perm(a, b, selector: int):
    """prmt.b32: byte i of the result is byte (selector >> 4i) & 7 of {b, a} (a: bytes 0-3). On
    Python ints (the CPU tests' model of the transposer) computed here."""
    if isinstance(a, int) and isinstance(b, int):
        pool = (a & 0xFFFFFFFF) | ((b & 0xFFFFFFFF) << 32)
        return sum(((pool >> (8 * ((selector >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
    return _prmt(a, b, selector)


def transpose_4x4(r0, r1, r2, r3):
    """Words r0..r3 (row i: bytes c0..c3) -> words out0..out3 (out c: byte i of row i)."""
    t0, t1 = byte_perm(r0, r1, 0x5140), byte_perm(r0, r1, 0x7362)  # r0.c0 r1.c0 r0.c1 r1.c1 | c2, c3
    t2, t3 = byte_perm(r2, r3, 0x5140), byte_perm(r2, r3, 0x7362)
    return (byte_perm(t0, t2, 0x5410), byte_perm(t0, t2, 0x7632),
            byte_perm(t1, t3, 0x5410), byte_perm(t1, t3, 0x7632))


@dsl_user_op
def _shf_r(lo: Int32, hi: Int32, bits: Int32, *, loc=None, ip=None) -> Int32:
    return Int32(llvm.inline_asm(
        T.i32(), [Int32(lo).ir_value(loc=loc, ip=ip), Int32(hi).ir_value(loc=loc, ip=ip),
                  Int32(bits).ir_value(loc=loc, ip=ip)],
        "shf.r.wrap.b32 $0, $1, $2, $3;", "=r,r,r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    ))


def rotate_bytes(lo, hi, n):
    """The 8 bytes hi:lo rotated right by n bytes (0 <= n < 8): byte i of the result is byte
    (i + n) % 8 of the input. On Python ints computed here."""
    swap = (n >> 2) & 1
    keep = swap - 1  # all ones when n < 4, else 0
    lo, hi = (lo & keep) | (hi & ~keep), (hi & keep) | (lo & ~keep)
    bits = (n & 3) * 8
    if isinstance(lo, int) and isinstance(hi, int) and isinstance(bits, int):
        pair = ((hi & 0xFFFFFFFF) << 32) | (lo & 0xFFFFFFFF)
        pair = ((pair >> bits) | (pair << (64 - bits))) & 0xFFFFFFFFFFFFFFFF
        return pair & 0xFFFFFFFF, pair >> 32
    return _shf_r(lo, hi, bits), _shf_r(hi, lo, bits)


def transpose_item(load2, store, vt_offset, v_offset, g, q, c, col):
    """One lane's work: 8 head-dim columns col..col+7 of the 4 keys 16 g + 2 q + (0, 1, 8, 9), i.e.
    V^T's word 4 g + q (positions 16 g + 4 q .. +3) in rows col..col+7. The 8-byte rows are rotated
    by c bytes before the 4 x 4 byte transposes, so that the lane's i-th store goes to row
    col + (i + c) % 8: the 8 lanes of a word (c = 0..7) then store to 8 different rows mod 8, which
    the swizzle puts in different banks. `vt_offset(key, d)` / `v_offset(d, position)`: byte offsets
    in sVt / sV; `load2(offset)`: two words; `store(offset, word)`. Plain Python: traced into the
    kernel, or run by the CPU tests on ints."""
    key0 = 16 * g + 2 * q
    rows = [rotate_bytes(*load2(vt_offset(key0 + off, col)), c) for off in FP8_KEY_ORDER]
    for half in range(2):  # the first 4 stores before the second transpose: 4 words fewer live
        out = transpose_4x4(*(r[half] for r in rows))
        for i in range(4):
            store(v_offset(col + (4 * half + i + c) % 8, 16 * g + 4 * q), out[i])


def transpose_units(tile_n: int, hdim_v: int) -> int:
    """Warp-sized pieces of one V tile: 16 keys x 64 head-dim columns (the last one narrower at hdim 96)."""
    return (tile_n // 16) * (-(-hdim_v // 64))


def lane_item(warp, lane, rnd, tile_n: int):
    """(unit, g, q, c, col) of a transposer lane in round `rnd`: warp w takes units w, w + 3, ...;
    lane = q + 4 c. A unit's lanes read 16 distinct 8-byte bank pairs per half warp (q varies the
    key row mod 8, c the column and its half of a 16-byte swizzle chunk) and store 32 distinct banks
    (see transpose_item)."""
    unit = warp + rnd * TRANSPOSER_WARPS
    g, cb = unit % (tile_n // 16), unit // (tile_n // 16)
    q, c = lane % 4, lane // 4
    return unit, g, q, c, 64 * cb + 8 * c


@cute.jit
def transpose_stage(sVt_layout: cute.ComposedLayout, vt_base: Int32, vt_stage: Int32,
                    sV_layout: cute.ComposedLayout, v_base: Int32, v_stage: Int32, tid: Int32,
                    tile_n: cutlass.Constexpr[int], hdim_v: cutlass.Constexpr[int]):
    """One V tile: sVt[key, d] (stage vt_stage) -> sV[d, position] (stage v_stage), keys in P's
    order, by the TRANSPOSER_THREADS threads (`tid` in [0, TRANSPOSER_THREADS)). Byte addresses:
    `*_base` + the swizzled layouts' offsets (1-byte elements)."""
    units = transpose_units(tile_n, hdim_v)
    item = partial(transpose_item, lambda off: ld_shared_v2(vt_base + off),
                   lambda off, word: st_shared(v_base + off, word),
                   lambda key, d: sVt_layout((key, d, vt_stage)),
                   lambda d, pos: sV_layout((d, pos, v_stage)))
    warp, lane = tid // 32, tid % 32
    for r in cutlass.range_constexpr(-(-units // TRANSPOSER_WARPS)):
        unit, g, q, c, col = lane_item(warp, lane, r, tile_n)
        whole_round = (r + 1) * TRANSPOSER_WARPS <= units
        if cutlass.const_expr(whole_round and hdim_v % 64 == 0):
            item(g=g, q=q, c=c, col=col)
        else:
            if unit < units and col < hdim_v:  # the last round's spare warps; hdim 96's last 32 columns
                item(g=g, q=q, c=c, col=col)
