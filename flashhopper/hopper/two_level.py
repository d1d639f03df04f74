"""FP8 two-level accumulation of O (FwdConfig.pv_two_level).

FP8 WGMMA adds into its accumulator below fp32 precision, so an O carried through every key block's
P @ V loses bits as the keys grow. Each block's P @ V instead starts a fresh accumulator (Ob), added
into the fp32 O once its WGMMA is done.

The online softmax multiplies O by each block's row scale s (exp2 of the old max minus the new). With
intra-warpgroup overlap that scale is known after the block's softmax, while the previous block's
P @ V is still in flight; in the mask-free steps (FwdConfig.pv_defer_scale) it is not multiplied into
O then but kept (`pending`, one register a row), and the next add applies it in the same FFMA:
O = O * pending + Ob, one FMUL per O element and block fewer. O then holds the output over the
pending scale until that add. The masked steps keep add-then-FMUL: the mask code needs the registers
(with `pending` live through them, the causal hdim 128 kernel spilled). A left-window run after the
mask-free one first takes the pending scale (`settle`); otherwise the tile's last add does.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from flashhopper.hopper.softmax import rescale_rows


class TwoLevelO:
    """O (fp32, row x column view), a block's P @ V accumulator, the softmax's row scale and the
    pending scale. Plain Python, built and called while tracing; its tensors live in registers."""

    def __init__(self, acc_O_rc: cute.Tensor, acc_Ob_rc: cute.Tensor, row_scale: cute.Tensor, num_rows: int,
                 _pending=None):
        self.acc_O_rc, self.acc_Ob_rc, self.row_scale = acc_O_rc, acc_Ob_rc, row_scale
        self.num_rows = num_rows
        self.pending = cute.make_rmem_tensor(num_rows, Float32) if _pending is None else _pending

    # carried through the DSL's run-time `if` / loops like the tensors it holds (as OnlineSoftmax)
    def _parts(self):
        return (self.acc_O_rc, self.acc_Ob_rc, self.row_scale, self.pending)

    def __extract_mlir_values__(self):
        self._counts = [len(cutlass.extract_mlir_values(x)) for x in self._parts()]
        return [v for x in self._parts() for v in cutlass.extract_mlir_values(x)]

    def __new_from_mlir_values__(self, values):
        rebuilt = []
        for x, n in zip(self._parts(), self._counts, strict=True):
            rebuilt.append(cutlass.new_from_mlir_values(x, values[:n]))
            values = values[n:]
        return TwoLevelO(*rebuilt[:3], self.num_rows, _pending=rebuilt[3])

    def add(self, deferred: bool):
        """O += this block's P @ V; `deferred`: O * pending + P @ V."""
        _add(self.acc_O_rc, self.acc_Ob_rc, self.pending, deferred)

    def start_deferring(self):
        """No scale pending yet (O is up to date): pending = 1."""
        self.pending.fill(1.0)

    def defer(self):
        """The step's row scale, left for the next add."""
        _copy(self.pending, self.row_scale)

    def settle(self):
        """O takes the pending scale now (before steps that do not defer)."""
        rescale_rows(self.acc_O_rc, self.pending)


@cute.jit
def _add(acc_O_rc: cute.Tensor, acc_Ob_rc: cute.Tensor, pending: cute.Tensor,
         deferred: cutlass.Constexpr[bool]):
    for r in cutlass.range_constexpr(cute.size(acc_O_rc, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(acc_O_rc, mode=[1])):
            if cutlass.const_expr(deferred):
                acc_O_rc[r, c] = acc_O_rc[r, c] * pending[r] + acc_Ob_rc[r, c]
            else:
                acc_O_rc[r, c] = acc_O_rc[r, c] + acc_Ob_rc[r, c]


@cute.jit
def _copy(dst: cute.Tensor, src: cute.Tensor):
    for r in cutlass.range_constexpr(cute.size(dst)):
        dst[r] = src[r]

