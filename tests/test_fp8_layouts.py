"""The FP8 forward's data movement, on the CPU (no GPU, no kernel run): the layouts are evaluated
while tracing, the transposer's per-item code (hopper/fp8.py: transpose_item, the same Python the
kernel traces) runs on a byte model of shared memory.

- P stays in registers: the fp32 S accumulator read as the e4m3 A operand of P @ V puts, for every
  thread, S's (row, column) where the WGMMA expects (row, position) with column = key_of_position.
- The transposer writes V^T so that position p of head-dim row d holds V[key_of_position(p), d],
  every word of every stage once, for every head dim and key-block width the FP8 forward takes.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from flashhopper.compile import ensure_arch_env

ensure_arch_env()

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.utils.hopper_helpers as sm90_utils  # noqa: E402
from cutlass.cute.nvgpu import warpgroup  # noqa: E402

from flashhopper.hopper import fp8 as F8  # noqa: E402
from flashhopper.hopper import layout as L  # noqa: E402

E4M3 = cutlass.Float8E4M3FN


def _traced(fn):
    """Run `fn` while tracing a host function (layouts need the DSL's context); its result."""
    box = []

    @cute.jit
    def host():
        box.append(fn())

    cute.compile(host)
    return box[0]


def _mma(n, b_major, a_source=None, warpgroups=2):
    kw = {"a_source": a_source} if a_source is not None else {}
    return sm90_utils.make_trivial_tiled_mma(E4M3, E4M3, cute.nvgpu.OperandMajorMode.K, b_major,
                                             cutlass.Float32, atom_layout_mnk=(warpgroups, 1, 1),
                                             tiler_mn=(64, n), **kw)


@pytest.mark.parametrize("tile_n", [64, 128, 160])
def test_p_in_registers_is_s_with_keys_relabelled(tile_n):
    def collect():
        mma_qk = _mma(tile_n, cute.nvgpu.OperandMajorMode.K)
        mma_pv = _mma(128, cute.nvgpu.OperandMajorMode.K, warpgroup.OperandSource.RMEM)
        ident = cute.make_identity_tensor((128, tile_n))
        pairs = []
        for t in range(256):
            c_s = mma_qk.get_slice(t).partition_C(ident)
            c_a = mma_pv.get_slice(t).partition_A(ident)
            view = cute.make_tensor(c_s.iterator, L.acc_layout_as_operand_a_fp8(c_s.layout))
            assert cute.size(view) == cute.size(c_a) == cute.size(c_s)
            pairs += [(tuple(view[j]), tuple(c_a[j])) for j in range(cute.size(c_a))]
        return pairs

    pairs = _traced(collect)
    assert len(pairs) == 128 * tile_n
    for (row_s, col_s), (row_a, pos) in pairs:
        assert row_s == row_a and col_s == F8.key_of_position(pos), ((row_s, col_s), (row_a, pos))
    # every (row, column) of S is used exactly once
    assert len({p[0] for p in pairs}) == 128 * tile_n


def _offsets(rows, cols, stages):
    """Byte offsets of the swizzled (rows, cols, stages) row-major smem layout, as an array."""
    def collect():
        lay = L.smem_layout_row_major(E4M3, rows, cols, stages)
        return [[[lay((r, c, s)) for c in range(cols)] for r in range(rows)] for s in range(stages)]

    return np.array(_traced(collect), dtype=np.int64)


def _run_transposer(tile_n, hdim, load2, store, vt_off, v_off, stage):
    """Every transposer lane's items of one stage, as transpose_stage walks them: (warp, round,
    lane) per call, through the same lane_item / transpose_item the kernel traces."""
    units = F8.transpose_units(tile_n, hdim)
    for warp in range(F8.TRANSPOSER_WARPS):
        for rnd in range(-(-units // F8.TRANSPOSER_WARPS)):
            for lane in range(32):
                unit, g, q, c, col = F8.lane_item(warp, lane, rnd, tile_n)
                if unit < units and col < hdim:
                    who = (warp, rnd, lane)
                    F8.transpose_item(partial(load2, who=who), partial(store, who=who),
                                      lambda key, d: int(vt_off[stage, key, d]),
                                      lambda d, pos: int(v_off[stage, d, pos]), g, q, c, col)


SHAPES = [(128, 64), (128, 96), (128, 128), (128, 192), (96, 256), (64, 128)]


@pytest.mark.parametrize(("tile_n", "hdim"), SHAPES)
def test_transposer_writes_v_transposed_in_p_order(tile_n, hdim):
    stages = 2
    vt_off, v_off = _offsets(tile_n, hdim, stages), _offsets(hdim, tile_n, stages)
    assert sorted(vt_off.ravel()) == list(range(vt_off.size))  # a bijection onto the buffer
    rng = np.random.default_rng(tile_n * hdim)
    v = rng.integers(0, 256, size=(stages, tile_n, hdim), dtype=np.uint8)
    smem_vt = np.zeros(vt_off.size, dtype=np.uint8)
    smem_vt[vt_off] = v
    smem_v = np.zeros(v_off.size, dtype=np.uint8)
    written = np.zeros(v_off.size, dtype=np.int64)

    def load2(off, who):
        assert off % 8 == 0
        return tuple(int(x) for x in smem_vt[off:off + 8].view("<u4"))

    def store(off, word, who):
        assert off % 4 == 0
        smem_v[off:off + 4] = np.array([word], dtype="<u4").view(np.uint8)
        written[off:off + 4] += 1

    for stage in range(stages):
        _run_transposer(tile_n, hdim, load2, store, vt_off, v_off, stage)
    assert (written == 1).all()
    keys = np.array([F8.key_of_position(p) for p in range(tile_n)])
    for stage in range(stages):
        got = smem_v[v_off[stage]]  # (hdim, tile_n): V^T as the P @ V WGMMA reads it
        np.testing.assert_array_equal(got, v[stage][keys].T)


def _wavefronts(lane_addresses: dict, width: int) -> int:
    """Shared-memory wavefronts of one warp instruction: 32 banks of 4 bytes; 4-byte accesses in one
    phase of 32 lanes, 8-byte ones in two of 16; a bank serves one word per wavefront."""
    phases = [range(32)] if width == 4 else [range(16), range(16, 32)]
    total = 0
    for phase in phases:
        banks: dict = {}
        for lane in phase:
            if lane in lane_addresses:
                for word in range(lane_addresses[lane] // 4, (lane_addresses[lane] + width) // 4):
                    banks.setdefault(word % 32, set()).add(word)
        total += max(map(len, banks.values()), default=0)
    return total


# (tile_n, hdim) -> the most wavefronts one 8-byte load / 4-byte store instruction takes (ideal: 2 / 1).
# Over a tile, loads + stores: 640 -> 256 wavefronts at (128, 128) against one word per lane of a row
# (4-way conflicted loads), 1408 -> 384 at (96, 256), about 1.5-2x fewer elsewhere. hdim 64 and 192:
# their 64-byte swizzle reaches half the banks from one key-row parity, so loads stay 2-way.
BANKS = {(128, 64): (4, 1), (128, 96): (4, 1), (128, 128): (2, 1), (128, 192): (4, 1), (96, 256): (2, 1),
         (64, 128): (2, 1)}


@pytest.mark.parametrize(("tile_n", "hdim"), SHAPES)
def test_transposer_bank_conflicts(tile_n, hdim):
    """A model of the banks from the real layouts (the transposer's addresses, as the kernel computes
    them, for every lane of every warp instruction): wavefronts per instruction as in BANKS."""
    vt_off, v_off = _offsets(tile_n, hdim, 1), _offsets(hdim, tile_n, 1)
    loads, stores, counts = {}, {}, {}

    def load2(off, who):
        n = counts[who, "ld"] = counts.get((who, "ld"), -1) + 1
        loads.setdefault((who[:2], n), {})[who[2]] = off
        return 0, 0

    def store(off, word, who):
        n = counts[who, "st"] = counts.get((who, "st"), -1) + 1
        stores.setdefault((who[:2], n), {})[who[2]] = off

    _run_transposer(tile_n, hdim, load2, store, vt_off, v_off, 0)
    load_fronts = max(_wavefronts(a, 8) for a in loads.values())
    store_fronts = max(_wavefronts(a, 4) for a in stores.values())
    assert (load_fronts, store_fronts) == BANKS[tile_n, hdim]


@pytest.mark.parametrize("tile_n", [64, 96, 128])
def test_k_descale_ring_holds_each_threads_columns_in_accumulator_order(tile_n):
    """Per-token k descales (hopper/fp8_descale.py): the word a consumer thread reads for its accumulator
    column slot c (row lane % 4 of the ring stage, word c; the same for both of its rows) is the one the
    producer lanes write that column's descale to, every column of the block exactly once; and the four
    rows' 16-byte reads of one instruction fall on 16 different banks."""
    from flashhopper.hopper import fp8_descale as KD

    def collect():
        mma_qk = _mma(tile_n, cute.nvgpu.OperandMajorMode.K)
        ident = cute.make_identity_tensor((128, tile_n))
        cols = []
        for t in range(256):
            c = L.acc_rows_cols(mma_qk.get_slice(t).partition_C(ident))
            cols.append([[c[r, j][1] for j in range(cute.size(c, mode=[1]))] for r in range(2)])
        return cols

    row_words = KD.kd_row_words(tile_n)
    for t, (row0, row1) in enumerate(_traced(collect)):
        assert row0 == row1 and len(row0) == tile_n // 4
        for slot, col in enumerate(row0):
            assert KD.kd_position(col, tile_n) == (t % 4) * row_words + slot, (t, slot, col)
    written = {KD.lane_word(lane, i, tile_n): lane + 32 * i
               for lane in range(32) for i in range(tile_n // 32)}
    assert len(written) == tile_n
    assert all(KD.kd_position(col, tile_n) == word for word, col in written.items())
    for chunk in range(tile_n // 4 // KD.CHUNK):
        for quad in range(KD.CHUNK // 4):
            start = chunk * KD.CHUNK + 4 * quad
            banks = {(q * row_words + start + w) % 32 for q in range(4) for w in range(4)}
            assert len(banks) == 16
