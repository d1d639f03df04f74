"""Shared-memory layout choices specific to the backward kernels."""

from __future__ import annotations

import math

import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

from flashhopper.hopper import layout as L


def _atom_cols(dtype, cols: int) -> int:
    """Width in elements of the swizzle atom `smem_layout_row_major` picks for `cols` columns."""
    bits = cols * dtype.width
    for width_bits in (1024, 512, 256):  # SW128, SW64, SW32
        if bits % width_bits == 0:
            return width_bits // dtype.width
    return 128 // dtype.width  # interleaved


def k_smem_layout(dtype, rows: int, hdim: int, num_wg: int):
    """(rows, hdim) K tile that dQ = dS K can also read as its B operand K^T, split by head dim.

    Each warpgroup's B is hdim / num_wg columns read MN-major; the WGMMA descriptor takes that as
    whole swizzle atoms or a part of one, not e.g. 1.5 atoms (hdim 96: 48 columns of a 32-wide
    SW64 atom). Then the widest atom that divides both widths is used instead (SW32 at hdim 96,
    still free of bank conflicts for WGMMA's 8 x 16-byte core matrices); other hdims keep the
    forward kernel's choice.
    """
    per_wg = hdim // num_wg
    width = _atom_cols(dtype, hdim)
    if per_wg % width == 0 or width % per_wg == 0:
        return L.smem_layout_row_major(dtype, rows, hdim)
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, math.gcd(hdim, per_wg)), dtype
    )
    return cute.tile_to_shape(atom, (rows, hdim), order=(0, 1))
