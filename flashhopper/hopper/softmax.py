"""Online softmax on the WGMMA accumulator, in registers.

Scores live in "raw" units (the S accumulator, or tanh of it under softcap); `scale_log2`
folds the softmax scale (or the softcap) and log2(e) into one multiply so that each element
costs one FFMA and one MUFU.EX2. A thread owns two rows of its warpgroup's 64; a row's
columns are spread over the 4 lanes of a quad, so row reductions end with two butterfly
shuffles.
"""

from __future__ import annotations

import math
import struct

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

LN2 = math.log(2.0)

# 2^f on [-0.5, 0.5], degree 3, fitted here for the least maximum relative error (7.5e-5, about
# 2% of a bf16 ulp of P; fp32 rounding adds ~1e-7)
_EXP2_POLY = (0.9999280737447878, 0.6932609894928453, 0.242611120525042, 0.05517164721459684)


def _f32_hex(v: float) -> str:
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", v))[0]


# x clamped to [-127, NaN-preserving]; n = round(x) by the 1.5 * 2^23 trick (t's low mantissa bits
# hold n); f = x - n in [-0.5, 0.5]; 2^x = poly(f) * 2^n, with 2^n built from t's bits:
# (bits(t) << 23) + bits(1.0) = (n + 127) << 23, the high bits of bits(t) shifted out. n = -127 gives
# exponent field 0, i.e. 2^n = 0 (what ex2.approx.ftz gives down there), and a NaN x stays NaN through
# the polynomial. Nine FMA / ALU-pipe instructions, no MUFU.
_EXP2_POLY_ASM = (
    "{\n.reg .f32 x, t, j, f, p, s;\n.reg .b32 b;\n"
    "max.NaN.f32 x, $1, 0fC2FE0000;\n"
    "add.rn.f32 t, x, 0f4B400000;\n"
    "sub.rn.f32 j, t, 0f4B400000;\n"
    "sub.rn.f32 f, x, j;\n"
    f"fma.rn.f32 p, f, {_f32_hex(_EXP2_POLY[3])}, {_f32_hex(_EXP2_POLY[2])};\n"
    f"fma.rn.f32 p, p, f, {_f32_hex(_EXP2_POLY[1])};\n"
    f"fma.rn.f32 p, p, f, {_f32_hex(_EXP2_POLY[0])};\n"
    "mov.b32 b, t;\n"
    "shl.b32 b, b, 23;\n"
    "add.s32 b, b, 0x3F800000;\n"
    "mov.b32 s, b;\n"
    "mul.rn.f32 $0, p, s;\n}"
)


@dsl_user_op
def exp2_poly(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^x on the FMA and ALU pipes instead of MUFU.EX2 (x <= 0 in the softmax; below -127 it gives
    0). Relative error <= 7.5e-5. Lets part of a block's exp2s run beside the MUFU ones."""
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], _EXP2_POLY_ASM, "=f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    ))




@cute.jit
def quad_allreduce_max(x: Float32) -> Float32:
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))
    return cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))


@cute.jit
def quad_allreduce_sum(x: Float32) -> Float32:
    x = x + cute.arch.shuffle_sync_bfly(x, offset=2)
    return x + cute.arch.shuffle_sync_bfly(x, offset=1)


def row_block_max(acc_S_rc: cute.Tensor, r: int, num_cols: int, chains: int) -> Float32:
    """Max of row r's columns: `chains` independent fmax chains (columns c, c + chains, ...), then
    a tree over the chains. One chain is the plain serial reduction; the value is the same.
    Plain Python, unrolled while tracing (called from the jitted softmax step)."""
    n = min(chains, num_cols)
    part = [acc_S_rc[r, c] for c in range(n)]
    for c in range(n, num_cols):
        part[c % n] = cute.arch.fmax(part[c % n], acc_S_rc[r, c])
    while len(part) > 1:
        part = [cute.arch.fmax(part[i], part[i + 1]) if i + 1 < len(part) else part[i]
                for i in range(0, len(part), 2)]
    return part[0]


@cute.jit
def online_softmax_step(
    acc_S_rc: cute.Tensor,
    row_max: cute.Tensor,
    row_sum: cute.Tensor,
    row_scale: cute.Tensor,
    scale_log2: Float32,
    is_first: cutlass.Constexpr[bool],
    max_chains: cutlass.Constexpr[int] = 1,
    sum_scaled_first: cutlass.Constexpr[bool] = False,
    sum_in_mma: cutlass.Constexpr[bool] = False,
    poly_every: cutlass.Constexpr[int] = 0,
):
    """Turn one block of scores (rows x cols view) into unnormalized probabilities in place.

    Updates the running max and sum and leaves in `row_scale` the factor by which the
    output accumulated so far must be multiplied. A row that has seen only masked keys
    keeps max = -inf; using 0 as its offset makes every exp2 give 0 instead of NaN.
    With `sum_in_mma` the row sums are left alone (a WGMMA of P with ones adds them up).
    """
    num_rows = cute.size(acc_S_rc, mode=[0])
    num_cols = cute.size(acc_S_rc, mode=[1])
    for r in cutlass.range_constexpr(num_rows):
        block_max = row_block_max(acc_S_rc, r, num_cols, max_chains)
        block_max = quad_allreduce_max(block_max)
        new_max = block_max
        if cutlass.const_expr(not is_first):
            new_max = cute.arch.fmax(row_max[r], block_max)
        offset = new_max * scale_log2
        if new_max == -Float32.inf:
            offset = Float32(0.0)
        if cutlass.const_expr(is_first):
            row_scale[r] = Float32(1.0)
        else:
            row_scale[r] = cute.math.exp2(row_max[r] * scale_log2 - offset, fastmath=True)
        row_max[r] = new_max
        block_sum = Float32(0.0)
        if cutlass.const_expr(sum_scaled_first and not is_first):
            block_sum = row_sum[r] * row_scale[r]
        for c in cutlass.range_constexpr(num_cols):
            x = acc_S_rc[r, c] * scale_log2 - offset
            p = Float32(0.0)
            if cutlass.const_expr(poly_every > 0 and c % poly_every == poly_every - 1):
                p = exp2_poly(x)
            else:
                p = cute.math.exp2(x, fastmath=True)
            acc_S_rc[r, c] = p
            if cutlass.const_expr(not sum_in_mma):
                block_sum += p
        if cutlass.const_expr(sum_in_mma):
            pass
        elif cutlass.const_expr(is_first or sum_scaled_first):
            row_sum[r] = block_sum
        else:
            row_sum[r] = row_sum[r] * row_scale[r] + block_sum


@cute.jit
def rescale_rows(acc_O_rc: cute.Tensor, row_scale: cute.Tensor):
    for r in cutlass.range_constexpr(cute.size(acc_O_rc, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(acc_O_rc, mode=[1])):
            acc_O_rc[r, c] = acc_O_rc[r, c] * row_scale[r]


@cute.jit
def finalize(row_max: cute.Tensor, row_sum: cute.Tensor, row_scale: cute.Tensor,
             lse: cute.Tensor, scale_log2: Float32, quad_sum: cutlass.Constexpr[bool] = True):
    """1/l into row_scale and the natural-log LSE; rows that saw no key get 0 and -inf.
    `quad_sum`: row_sum holds this lane's columns only, to be added over the quad."""
    for r in cutlass.range_constexpr(cute.size(row_sum)):
        total = row_sum[r]
        if cutlass.const_expr(quad_sum):
            total = quad_allreduce_sum(row_sum[r])
        empty = total == Float32(0.0) or total != total
        row_scale[r] = Float32(0.0) if empty else cute.arch.rcp_approx(total)
        lse[r] = (
            -Float32.inf
            if empty
            else (row_max[r] * scale_log2 + cute.math.log2(total, fastmath=True)) * Float32(LN2)
        )
