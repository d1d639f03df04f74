"""A value the compiler can neither look into nor move (keeps per-use address arithmetic out of loops)."""

from __future__ import annotations

from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def opaque(x: Int32, *, loc=None, ip=None) -> Int32:
    """x, passed through a side-effecting asm `mov` that LLVM can neither look into nor move: what
    is computed from the result stays where it is used instead of being hoisted out of loops."""
    return Int32(llvm.inline_asm(
        T.i32(), [Int32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    ))
