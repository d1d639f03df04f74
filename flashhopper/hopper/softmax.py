"""Online softmax on the WGMMA accumulator, in registers.

Scores live in "raw" units (the S accumulator, or tanh of it under softcap); `scale_log2`
folds the softmax scale (or the softcap) and log2(e) into one multiply so that each element
costs one FFMA and one MUFU.EX2. It is one value, or one per row (FP8 with per-token descales:
each row's q descale folded in, hopper/fp8_descale.py). A thread owns two rows of its warpgroup's 64; a row's
columns are spread over the 4 lanes of a quad, so row reductions end with two butterfly
shuffles.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

LN2 = math.log(2.0)


@cute.jit
def quad_allreduce_max(x: Float32) -> Float32:
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))
    return cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))


@cute.jit
def quad_allreduce_sum(x: Float32) -> Float32:
    x = x + cute.arch.shuffle_sync_bfly(x, offset=2)
    return x + cute.arch.shuffle_sync_bfly(x, offset=1)


def scale_of_row(scale_log2, r: int):
    """Row r's scale_log2: the one value, or row r's of a per-row tensor. Plain Python (tracing)."""
    return scale_log2[r] if isinstance(scale_log2, cute.Tensor) else scale_log2


def row_block_max(acc_S_rc: cute.Tensor, r: int, num_cols: int) -> Float32:
    """Max of row r's columns, one serial fmax chain. Plain Python, unrolled while tracing (called
    from the jitted softmax step)."""
    block_max = acc_S_rc[r, 0]
    for c in range(1, num_cols):
        block_max = cute.arch.fmax(block_max, acc_S_rc[r, c])
    return block_max


@cute.jit
def online_softmax_step(
    acc_S_rc: cute.Tensor,
    row_max: cute.Tensor,
    row_sum: cute.Tensor,
    row_scale: cute.Tensor,
    scale_log2: Float32 | cute.Tensor,
    is_first: cutlass.Constexpr[bool],
    shift: cutlass.Constexpr[float] = 0.0,
    sums: cutlass.Constexpr[bool] = True,
):
    """Turn one block of scores (rows x cols view) into unnormalized probabilities in place.

    Updates the running max and sum and leaves in `row_scale` the factor by which the
    output accumulated so far must be multiplied. A row that has seen only masked keys
    keeps max = -inf; using 0 as its offset makes every exp2 give 0 instead of NaN. `shift`:
    probabilities are exp2(x - max + shift) (FP8: up to 2^8 inside e4m3's range), the sums too;
    finalize takes the same shift out of the LSE. `sums` off: no running sum (FwdConfig.pv_row_sum: the
    tensor cores sum P beside O).
    """
    num_rows = cute.size(acc_S_rc, mode=[0])
    num_cols = cute.size(acc_S_rc, mode=[1])
    for r in cutlass.range_constexpr(num_rows):
        scale = scale_of_row(scale_log2, r)
        block_max = row_block_max(acc_S_rc, r, num_cols)
        block_max = quad_allreduce_max(block_max)
        new_max = block_max
        if cutlass.const_expr(not is_first):
            new_max = cute.arch.fmax(row_max[r], block_max)
        offset = new_max * scale
        if new_max == -Float32.inf:
            offset = Float32(0.0)
        if cutlass.const_expr(is_first):
            row_scale[r] = Float32(1.0)
        else:
            row_scale[r] = cute.math.exp2(row_max[r] * scale - offset, fastmath=True)
        if cutlass.const_expr(shift != 0.0):
            offset = offset - Float32(shift)
        row_max[r] = new_max
        block_sum = Float32(0.0)
        for c in cutlass.range_constexpr(num_cols):
            p = cute.math.exp2(acc_S_rc[r, c] * scale - offset, fastmath=True)
            acc_S_rc[r, c] = p
            if cutlass.const_expr(sums):
                block_sum += p
        if cutlass.const_expr(sums and is_first):
            row_sum[r] = block_sum
        elif cutlass.const_expr(sums):
            row_sum[r] = row_sum[r] * row_scale[r] + block_sum


@cute.jit
def lazy_softmax_block(acc_S_rc: cute.Tensor, p_rc: cute.Tensor, row_max: cute.Tensor,
                       block_sum: cute.Tensor, scale_log2: Float32, limit: Float32):
    """One block's probabilities against the running max as it is (FwdConfig.lazy_max), into
    `p_rc`; S stays in `acc_S_rc` for the exact step. Leaves the per-row block sums (not yet added
    to the running sums) and returns whether this thread's rows need the exact step: a row without
    a max yet, or a block sum above `limit` (also catches an exp2 that overflowed)."""
    need = row_max[0] == -Float32.inf
    for r in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[0])):
        offset = row_max[r] * scale_log2
        if row_max[r] == -Float32.inf:
            offset = Float32(0.0)
        s = Float32(0.0)
        for c in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[1])):
            p = cute.math.exp2(acc_S_rc[r, c] * scale_log2 - offset, fastmath=True)
            p_rc[r, c] = p
            s += p
        block_sum[r] = s
        need = need | (row_max[r] == -Float32.inf) | (s > limit)
    return need


@cute.jit
def rescale_rows(acc_O_rc: cute.Tensor, row_scale: cute.Tensor):
    for r in cutlass.range_constexpr(cute.size(acc_O_rc, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(acc_O_rc, mode=[1])):
            acc_O_rc[r, c] = acc_O_rc[r, c] * row_scale[r]


@cute.jit
def finalize(row_max: cute.Tensor, row_sum: cute.Tensor, row_scale: cute.Tensor,
             lse: cute.Tensor, scale_log2: Float32 | cute.Tensor, shift: cutlass.Constexpr[float] = 0.0,
             out_scale: Float32 | None = None, quad: cutlass.Constexpr[bool] = True):
    """1/l (times `out_scale` if given: FP8's V descale) into row_scale and the natural-log LSE;
    rows that saw no key get 0 and -inf. `shift`: online_softmax_step's. `quad` off: row_sum holds whole
    rows' sums already (not a quad's part of them)."""
    for r in cutlass.range_constexpr(cute.size(row_sum)):
        scale = scale_of_row(scale_log2, r)
        total = quad_allreduce_sum(row_sum[r]) if cutlass.const_expr(quad) else row_sum[r]
        empty = total == Float32(0.0) or total != total
        if cutlass.const_expr(out_scale is None):
            row_scale[r] = Float32(0.0) if empty else cute.arch.rcp_approx(total)
        else:
            row_scale[r] = Float32(0.0) if empty else cute.arch.rcp_approx(total) * out_scale
        if cutlass.const_expr(shift == 0.0):
            lse[r] = (
                -Float32.inf
                if empty
                else (row_max[r] * scale + cute.math.log2(total, fastmath=True)) * Float32(LN2)
            )
        else:
            lse[r] = (
                -Float32.inf
                if empty
                else (row_max[r] * scale + cute.math.log2(total, fastmath=True) - Float32(shift))
                * Float32(LN2)
            )


class OnlineSoftmax:
    """The online softmax of the rows one thread owns: running max and sum, and `row_scale`, the
    factor by which the output accumulated so far must be multiplied after the last step (1 / l
    after `finalize`). Plain Python over the jitted steps above: built and called while tracing,
    its tensors live in registers. `scale_log2` folds the softmax scale (or softcap) and log2(e), one
    value or one per row (a tensor: FP8's per-token q descales, not with lazy_block);
    `shift`: FP8's (online_softmax_step); `sums` off: the row sums come to `finalize` from elsewhere
    (FwdConfig.pv_row_sum)."""

    def __init__(self, num_rows: int, scale_log2: Float32 | cute.Tensor, shift: float = 0.0, _tensors=None,
                 sums: bool = True):
        if _tensors is None:
            _tensors = tuple(cute.make_rmem_tensor(num_rows, Float32) for _ in range(3))
        self.row_max, self.row_sum, self.row_scale = _tensors
        self.num_rows = num_rows
        self.scale_log2 = scale_log2
        self.shift = shift
        self.sums = sums

    # carried through the DSL's run-time `if` / loops like the tensors it holds
    def __extract_mlir_values__(self):
        parts = (self.row_max, self.row_sum, self.row_scale, self.scale_log2)
        self._counts = [len(cutlass.extract_mlir_values(x)) for x in parts]
        return [v for x in parts for v in cutlass.extract_mlir_values(x)]

    def __new_from_mlir_values__(self, values):
        parts, rebuilt = (self.row_max, self.row_sum, self.row_scale, self.scale_log2), []
        for x, n in zip(parts, self._counts, strict=True):
            rebuilt.append(cutlass.new_from_mlir_values(x, values[:n]))
            values = values[n:]
        return OnlineSoftmax(self.num_rows, rebuilt[3], self.shift, _tensors=tuple(rebuilt[:3]),
                             sums=self.sums)

    def reset(self):
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    def step(self, acc_S_rc: cute.Tensor, is_first: bool):
        """One block of scores into probabilities (online_softmax_step)."""
        online_softmax_step(acc_S_rc, self.row_max, self.row_sum, self.row_scale, self.scale_log2,
                            is_first=is_first, shift=self.shift, sums=self.sums)

    def rescale(self, acc_O_rc: cute.Tensor):
        """The output so far times this step's row scale."""
        rescale_rows(acc_O_rc, self.row_scale)

    def lazy_block(self, acc_S_rc: cute.Tensor, p_rc: cute.Tensor, block_sum: cute.Tensor, limit: Float32):
        """lazy_softmax_block against the running max."""
        return lazy_softmax_block(acc_S_rc, p_rc, self.row_max, block_sum, self.scale_log2, limit)

    def finalize(self, lse: cute.Tensor, out_scale: Float32 | None = None, totals=None):
        """1/l (times out_scale) into row_scale, the LSE into `lse` (finalize). `totals`: without `sums`, a
        function of the row giving its whole sum (the P @ V accumulator's column of them)."""
        if totals is not None:
            for r in range(self.num_rows):
                self.row_sum[r] = totals(r)
        finalize(self.row_max, self.row_sum, self.row_scale, lse, self.scale_log2, shift=self.shift,
                 out_scale=out_scale, quad=totals is None)
