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
a thread loads 8 bytes (8 head-dim columns) of each of those 4 key rows, transposes the two
4 x 4 byte blocks with byte permutes, and stores 8 words, one per head-dim row. Threads of a warp
take consecutive words of one row of V^T (stores of a warp fill whole rows).
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


def transpose_item(load2, store, vt_offset, v_offset, item, tile_n: int):
    """Work item `item`: word w = item % (tile_n / 4) of V^T's rows d0..d0+7, d0 = 8 (item // (tile_n / 4)).
    `vt_offset(key, d)` / `v_offset(d, position)`: byte offsets in sVt / sV; `load2(offset)`: two
    words; `store(offset, word)`. Plain Python: traced into the kernel, or run by the CPU tests."""
    words_per_row = tile_n // 4
    word = item % words_per_row
    col = (item // words_per_row) * 8  # the first of the 8 head-dim columns
    key0 = (word // 4) * 16 + (word % 4) * 2
    rows = [load2(vt_offset(key0 + off, col)) for off in FP8_KEY_ORDER]
    out = transpose_4x4(*(r[0] for r in rows)) + transpose_4x4(*(r[1] for r in rows))
    for i in range(8):
        store(v_offset(col + i, word * 4), out[i])


def transpose_items(tile_n: int, hdim_v: int) -> int:
    """Work items of one V tile: a word of V^T per 8 head-dim rows."""
    return (tile_n // 4) * (hdim_v // 8)


@cute.jit
def transpose_stage(sVt_layout: cute.ComposedLayout, vt_base: Int32, vt_stage: Int32,
                    sV_layout: cute.ComposedLayout, v_base: Int32, v_stage: Int32, tid: Int32,
                    tile_n: cutlass.Constexpr[int], hdim_v: cutlass.Constexpr[int]):
    """One V tile: sVt[key, d] (stage vt_stage) -> sV[d, position] (stage v_stage), keys in P's
    order, by the TRANSPOSER_THREADS threads (`tid` in [0, TRANSPOSER_THREADS)). Byte addresses:
    `*_base` + the swizzled layouts' offsets (1-byte elements)."""
    items = transpose_items(tile_n, hdim_v)
    item_of = partial(transpose_item, lambda off: ld_shared_v2(vt_base + off),
                      lambda off, word: st_shared(v_base + off, word),
                      lambda key, d: sVt_layout((key, d, vt_stage)),
                      lambda d, pos: sV_layout((d, pos, v_stage)))
    for r in cutlass.range_constexpr((items + TRANSPOSER_THREADS - 1) // TRANSPOSER_THREADS):
        item = tid + r * TRANSPOSER_THREADS
        if cutlass.const_expr((r + 1) * TRANSPOSER_THREADS <= items):
            item_of(item=item, tile_n=tile_n)
        else:
            if item < items:  # the last round: whole warps in or out (items is a multiple of 32)
                item_of(item=item, tile_n=tile_n)
