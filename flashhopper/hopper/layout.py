"""Register- and shared-memory layout views used by the Hopper kernels."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

# the kernels' element types by the config's dtype name (fp32: the split-KV merge's partials and output)
CUTE_DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "e4m3": cutlass.Float8E4M3FN,
               "fp32": cutlass.Float32}


def smem_struct(fields: dict):
    """A cute.struct from {name: MemRange / Align type}, built in plain Python: a kernel's class-body
    `if` would be traced (its annotations would not reach the struct), and the kernel modules'
    postponed annotations would reach cute.struct as strings."""
    return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))


def select_modes(t: cute.Tensor, modes: list[int]) -> cute.Tensor:
    """Same memory, modes reordered (e.g. (b, s, h, d) -> (s, d, h, b) so tiles index first)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, modes))


def smem_layout_row_major(dtype, rows: int, cols: int, stages: int | None = None):
    """Swizzled smem layout for a (rows, cols[, stages]) tile whose cols are contiguous in gmem.

    Q, K, V and O are all stored with the head dim contiguous; the widest swizzle that fits
    `cols` keeps both TMA writes and WGMMA/stmatrix accesses free of bank conflicts.
    """
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols), dtype
    )
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


def transpose_view(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of a smem tensor: sV (n, d, stages) seen as V^T (d, n, stages)."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def acc_layout_rows_cols(acc_layout: cute.Layout) -> cute.Layout:
    """WGMMA accumulator ((2, 2, V), M, N) viewed as (rows, cols) = ((2, M), (2, V, N)).

    In the m64nNk16 C layout a thread holds column pairs (mode 0.0) of two rows eight apart
    (mode 0.1), repeated every 8 columns (mode 0.2); row-wise softmax wants rows and columns
    as separate modes.
    """
    compact = cute.make_layout(acc_layout.shape)
    shape = (
        (compact.shape[0][1], compact.shape[1]),
        (compact.shape[0][0], compact.shape[0][2], compact.shape[2]),
    )
    stride = (
        (compact.stride[0][1], compact.stride[1]),
        (compact.stride[0][0], compact.stride[0][2], compact.stride[2]),
    )
    return cute.composition(acc_layout, cute.make_layout(shape, stride=stride))


def acc_rows_cols(acc: cute.Tensor) -> cute.Tensor:
    return cute.make_tensor(acc.iterator, acc_layout_rows_cols(acc.layout))


def acc_layout_as_operand_a(acc_layout: cute.Layout) -> cute.Layout:
    """fp32 S accumulator ((2, 2, N/8), M, 1) relabelled as the 16-bit A operand of P @ V.

    For 16-bit WGMMA the A fragment of m64nNk16 holds the same (row, column) pairs as the C
    fragment of two adjacent 8-column groups, so P can stay in registers: only the k-blocks
    (16 columns = two 8-column groups) have to become their own mode.
    """
    tiled = cute.logical_divide(acc_layout, ((None, None, 2), None, None))
    return cute.make_layout(
        (
            (tiled.shape[0][0], tiled.shape[0][1], tiled.shape[0][2][0]),
            tiled.shape[1],
            (tiled.shape[0][2][1], tiled.shape[2]),
        ),
        stride=(
            (tiled.stride[0][0], tiled.stride[0][1], tiled.stride[0][2][0]),
            tiled.stride[1],
            (tiled.stride[0][2][1], tiled.stride[2]),
        ),
    )


def acc_layout_as_operand_a_fp8(acc_layout: cute.Layout) -> cute.Layout:
    """fp32 S accumulator ((2, 2, N/8), M, 1) read as the 8-bit A operand of P @ V, ((4, 2, 2), M, N/32).

    The 8-bit A fragment of m64nNk32 holds, per row, k = 4q..4q+3 and 16+4q..16+4q+3 of each
    32-wide k-block (q = lane % 4), where the C fragment holds columns 2q, 2q+1 of each 8-column
    group. Reading the thread's C values of groups 2h, 2h+1 (h = 0..N/16-1) as its A bytes of
    16-column half h relabels the keys inside each 16: A position 4q + j is column
    2q + j % 2 + 8 (j // 2), no data moves between threads. V^T in shared memory is written in the
    same order (hopper/fp8.py: FP8_KEY_ORDER), so P @ V sums the same products.
    """
    groups = cute.size(acc_layout, mode=[0, 2])
    view = cute.make_layout((((2, 2), 2, 2), 1, groups // 4), stride=(((1, 4), 2, 8), 0, 16))
    return cute.composition(acc_layout, view)


@cute.jit
def zero_rows_from(tiles, rows_left, tidx, threads: cutlass.Constexpr[int]):
    """Rows [rows_left, rows) of each smem tile in `tiles` ((rows, cols) views of 16-bit elements) set to
    0 by `threads` threads (this one `tidx`) in 16-byte stores, then fenced for the async proxy (WGMMA
    reads them next); the caller's barrier follows. Varlen: the rows past a sequence's keys or used rows,
    which a tile loads and which may hold anything (0 x NaN is NaN in the GEMMs that read them)."""
    zero = cute.make_rmem_tensor((1, 8), tiles[0].element_type)
    zero.fill(0.0)
    for sX in tiles:
        per_row = cute.size(sX, mode=[1]) // 8
        items = cute.size(sX, mode=[0]) * per_row
        for i in cutlass.range_constexpr((items + threads - 1) // threads):
            item = tidx + i * threads
            row = item // per_row
            if row >= rows_left and item < items:
                cute.autovec_copy(zero, cute.local_tile(sX, (1, 8), (row, item % per_row)))
    cute.arch.fence_proxy("async.shared", space="cta")
