"""The FP8 forward's data movement, on the CPU (no GPU, no kernel run): the layouts are evaluated
while tracing, the transposer's per-warp code (hopper/fp8.py: lane_roles, warp_units, unit_offsets,
transpose_warp, the same Python the kernel traces) runs on whole warps over a byte model of shared
memory, with ldmatrix.trans / stmatrix / prmt modelled lane by lane.

- P stays in registers: the fp32 S accumulator read as the e4m3 A operand of P @ V puts, for every
  thread, S's (row, column) where the WGMMA expects (row, position) with column = key_of_position.
- The transposer writes V^T so that position p of head-dim row d holds V[key_of_position(p), d],
  every byte of every stage once, for every head dim and key-block width the FP8 forward takes, its
  LDSM.T / STSM free of bank conflicts; the instruction models are the DSL copy atoms' lane layouts.
"""

from __future__ import annotations

import os

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

# make test-full (FH_TEST_FULL=1) checks every key-block width below; CI a covering subset of them
FULL = os.environ.get("FH_TEST_FULL") == "1"

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


@pytest.mark.parametrize("tile_n", [64, 128, 160, 224] if FULL else [64, 128])
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
    """Byte offsets of the swizzled (rows, cols, stages) row-major smem layout, as an array, and its
    swizzle's bits (fp8.swizzle_bits)."""
    def collect():
        lay = L.smem_layout_row_major(E4M3, rows, cols, stages)
        offs = [[[lay((r, c, s)) for c in range(cols)] for r in range(rows)] for s in range(stages)]
        return offs, F8.swizzle_bits(lay)

    offs, bits = _traced(collect)
    return np.array(offs, dtype=np.int64), bits


class _Smem:
    """Shared memory as bytes, with the transposer's warp-wide instructions: ldmatrix.trans / stmatrix
    (x4, b16) and prmt on (32,) arrays of lane values (their lane layouts checked against the DSL's
    copy atoms below); every instruction's 32 addresses logged for the bank model."""

    def __init__(self, size):
        self.bytes = np.zeros(size, dtype=np.uint8)
        self.written = np.zeros(size, dtype=np.int64)
        self.log = []

    def ldsm(self, addr, imm):
        """Lane 8m + r addresses row r (16 bytes) of matrix m; lane t (q = t % 4, j = t // 4) gets in
        register m the 16-bit column j of rows 2q (low half) and 2q + 1 of matrix m."""
        addr = addr + imm
        assert (addr % 16 == 0).all()
        self.log.append(("ld", addr))
        regs = np.zeros((4, 32), dtype=np.int64)
        for m in range(4):
            for t in range(32):
                q, j = t % 4, t // 4
                lo, hi = (int(addr[8 * m + 2 * q + h]) + 2 * j for h in range(2))
                pair = bytes(self.bytes[lo:lo + 2]) + bytes(self.bytes[hi:hi + 2])
                regs[m, t] = int.from_bytes(pair, "little")
        return tuple(regs)

    def stsm(self, addr, imm, words):
        """Lane 8m + i addresses row i of matrix m, which holds register m of lanes 4i..4i+3 in lane order."""
        addr = addr + imm
        assert (addr % 16 == 0).all()
        self.log.append(("st", addr))
        for m in range(4):
            for i in range(8):
                for q in range(4):
                    at = int(addr[8 * m + i]) + 4 * q
                    word = int(words[m][4 * i + q]).to_bytes(4, "little")
                    self.bytes[at:at + 4] = np.frombuffer(word, np.uint8)
                    self.written[at:at + 4] += 1

    @staticmethod
    def perm(a, b, sel):
        return np.array([F8.byte_perm(int(x), int(y), int(s)) for x, y, s in zip(a, b, sel, strict=True)],
                        dtype=np.int64)


# (tile_n, hdim): the FP8 forward's tiles (plan.py's FP8 tables) and a few more key-block widths: the
# wider candidates (plan.FP8_TILE_CANDIDATES; sV rows of 160 / 224 bytes take the 32-byte swizzle, 192
# the 64-byte)
ALL_SHAPES = [(128, 64), (192, 64), (128, 96), (96, 128), (64, 128), (128, 128), (128, 192), (96, 256),
              (64, 256), (160, 128), (224, 64), (192, 96), (224, 128), (160, 192)]
# CI (without FH_TEST_FULL=1): the per-head kernels' dispatched tiles (plan._FP8_TILES, _FP8_WIDE_TILES;
# the per-token kernels' 64-key blocks under a mask in the full set), and one candidate of the 32-byte swizzle
SHAPES = ALL_SHAPES if FULL else [(128, 64), (192, 64), (128, 96), (96, 128), (128, 128), (128, 192),
                                  (96, 256), (160, 128)]


def _transpose(tile_n, hdim, stages=2, per_batch=F8.UNITS_PER_BATCH, extra_rows=0):
    """`stages` stages of random V through the transposer's own Python (lane_roles, lane bases as
    lane_bases computes them, warp_units, unit_offsets, transpose_warp) on a _Smem holding sV and, after
    it, sVt (1 KiB-aligned, as fwd.py's struct places them). Returns (V, sV read as V^T per stage, smem)."""
    vt_off, vt_bits = _offsets(tile_n, hdim, stages)
    v_off, v_bits = _offsets(hdim + extra_rows, tile_n, stages)  # extra_rows: FwdConfig.pv_row_sum's ones
    assert sorted(vt_off.ravel()) == list(range(vt_off.size))  # a bijection onto the buffer
    v_base, vt_base = 0, -(-v_off.size // 1024) * 1024
    smem = _Smem(vt_base + vt_off.size)
    v = np.random.default_rng(tile_n * hdim).integers(0, 256, size=(stages, tile_n, hdim), dtype=np.uint8)
    smem.bytes[vt_base + vt_off] = v
    roles = zip(*map(F8.lane_roles, range(32)), strict=True)
    ld_key, ld_col, st_row, sel0, sel1 = (np.array(c, dtype=np.int64) for c in roles)
    plans = [[F8.unit_offsets(key, col, lambda k, d: int(vt_off[0, k, d]), lambda d, p: int(v_off[0, d, p]),
                              vt_bits, v_bits) for key, col in F8.warp_units(w, tile_n, hdim)]
             for w in range(F8.TRANSPOSER_WARPS)]
    for stage in range(stages):
        vt_step, v_step = int(vt_off[1 % stages, 0, 0]) * stage, int(v_off[1 % stages, 0, 0]) * stage
        ld_addr = vt_base + vt_off[0, ld_key, ld_col] + vt_step
        st_addr = v_base + v_off[0, st_row, 0] + v_step
        for units in plans:
            F8.transpose_warp(units, ld_addr, st_addr, sel0, sel1, smem.ldsm, smem.stsm, smem.perm, per_batch)
    return v, smem.bytes[v_base + v_off], smem


def _p_order(v):
    """V^T (head dim x keys) with the keys in P's order: what the P @ V WGMMA must read."""
    return v[[F8.key_of_position(p) for p in range(v.shape[0])]].T


@pytest.mark.parametrize(("tile_n", "hdim"), SHAPES)
def test_transposer_writes_v_transposed_in_p_order(tile_n, hdim):
    v, got, smem = _transpose(tile_n, hdim)
    v_bytes = got.size
    assert (smem.written[:v_bytes] == 1).all() and not smem.written[v_bytes:].any()  # sV once, nothing else
    for stage in range(v.shape[0]):
        np.testing.assert_array_equal(got[stage], _p_order(v[stage]))
    # per warp and V tile: one LDSM.T x4 and one STSM x4 per unit, the units split evenly
    per_warp = [len(F8.warp_units(w, tile_n, hdim)) for w in range(F8.TRANSPOSER_WARPS)]
    assert sum(per_warp) == F8.transpose_units(tile_n, hdim) and max(per_warp) - min(per_warp) <= 1


@pytest.mark.parametrize(("tile_n", "hdim"),
                         [(192, 64), (128, 64), (128, 96), (128, 128), (96, 128), (64, 128)])
def test_ones_rows_under_v_transposed(tile_n, hdim):
    """FwdConfig.pv_row_sum: sV holds row_sum_rows more rows, a stage stays whole swizzle periods, the
    transposer's model on that layout writes V^T into the head dim's rows exactly as without them, and
    fp8.ones_runs covers exactly the rest of every stage. Also with 8 rows at every swizzle width (what whole
    periods would allow where the config takes whole KiB)."""
    from flashhopper.config import FwdConfig

    for rows in sorted({8, FwdConfig(dtype="e4m3", hdim=hdim, tile_n=tile_n, pv_row_sum=True).row_sum_rows}):
        _check_ones_rows(tile_n, hdim, rows)


def _check_ones_rows(tile_n, hdim, rows):
    stages = 2
    v_off, v_bits = _offsets(hdim + rows, tile_n, stages)
    period = 1 << v_bits[1].bit_length()  # fp8.swizzle_period: 1 KiB at 128 keys, 512 bytes at 192, 256 at 96
    assert int(v_off[1, 0, 0]) % period == 0
    v, got, smem = _transpose(tile_n, hdim, stages=stages, extra_rows=rows)
    for stage in range(stages):
        np.testing.assert_array_equal(got[stage][:hdim], _p_order(v[stage]))
    head_rows = set(v_off[:, :hdim].ravel().tolist())
    assert {i for i in range(v_off.size) if smem.written[i]} == head_rows  # V^T's rows, once, nothing else
    runs = F8.ones_runs(lambda c: int(v_off[c[2], c[0], c[1]]), hdim, rows, tile_n, stages)
    ones = {x for start, n in runs for x in range(start, start + n)}
    assert ones == set(v_off[:, hdim:].ravel().tolist()) and not ones & head_rows


@pytest.mark.parametrize(("tile_n", "hdim"), [(224, 128), (128, 96)] if FULL else [(128, 96)])
def test_transposer_one_unit_at_a_time(tile_n, hdim):
    """units_per_batch below the producer's 48 registers: each unit's LDSM.T before its own stores only,
    the same bytes written, and the instructions in load, store order."""
    assert F8.units_per_batch(48) == F8.UNITS_PER_BATCH and F8.units_per_batch(40) == 1
    v, got, smem = _transpose(tile_n, hdim, per_batch=1)
    for stage in range(v.shape[0]):
        np.testing.assert_array_equal(got[stage], _p_order(v[stage]))
    kinds = "".join(kind[0] for kind, _ in smem.log)
    assert kinds == "ls" * F8.transpose_units(tile_n, hdim) * v.shape[0]


def test_transposer_model_fails_a_wrong_key_order(monkeypatch):
    """The check above sees a wrong permutation: keys 2q, 8 + 2q, 2q + 1, 9 + 2q instead of P's order."""
    monkeypatch.setattr(F8, "SEL_EVEN", 0x6240)
    monkeypatch.setattr(F8, "SEL_ODD", 0x7351)
    v, got, _ = _transpose(128, 128, stages=1)
    wrong = got[0] != _p_order(v[0])
    assert wrong[:, 1::4].all(axis=0).any() and not wrong[:, 0::4].any()  # positions 4q+1, 4q+2 swapped


def _wavefronts(addr) -> int:
    """Shared-memory wavefronts of one LDSM / STSM x4: a phase per 8 x 16-byte matrix (lanes 8m..8m+7),
    32 banks of 4 bytes, a bank serving one word per wavefront."""
    total = 0
    for m in range(4):
        banks: dict = {}
        for lane in range(8 * m, 8 * m + 8):
            for word in range(int(addr[lane]) // 4, int(addr[lane]) // 4 + 4):
                banks.setdefault(word % 32, set()).add(word)
        total += max(map(len, banks.values()))
    return total


@pytest.mark.parametrize(("tile_n", "hdim"), SHAPES)
def test_transposer_bank_conflict_free(tile_n, hdim):
    """A model of the banks from the real layouts and the transposer's addresses, every instruction of
    every warp: 4 wavefronts per LDSM.T x4 and per STSM x4 (512 bytes each), the least possible."""
    _, _, smem = _transpose(tile_n, hdim, stages=1)
    assert {kind: {_wavefronts(a) for k, a in smem.log if k == kind} for kind in ("ld", "st")} == \
        {"ld": {4}, "st": {4}}


def test_bank_model_sees_stores_without_the_lane_swap(monkeypatch):
    """Without lanes 16-31 swapping their words, an STSM matrix holds head-dim rows 0, 2, .., 14: two
    per row mod 8, 2-way bank conflicts at the 128-byte swizzle (the data still right)."""
    roles = F8.lane_roles

    def unswapped(lane):
        ld_key, ld_col, _, _, _ = roles(lane)
        return ld_key, ld_col, 16 * (lane // 16) + 2 * (lane % 8) + (lane // 8) % 2, F8.SEL_EVEN, F8.SEL_ODD

    monkeypatch.setattr(F8, "lane_roles", unswapped)
    v, got, smem = _transpose(128, 128, stages=1)
    np.testing.assert_array_equal(got[0], _p_order(v[0]))
    assert {_wavefronts(a) for k, a in smem.log if k == "st"} == {8}


def test_ldmatrix_models_match_the_dsl_copy_atoms():
    """_Smem's lane layouts of ldmatrix.trans and stmatrix are the DSL's own (LdMatrix8x8x16bOp with
    transpose, StMatrix8x8x16bOp without; elements of 16 bits, matrix m's (row, column) at 64 m + 8 row +
    column; value v of a lane sits in register v // 2, half v % 2)."""
    def collect():
        ld = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4),
                                 cutlass.Float16)
        st = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                 cutlass.Float16)
        return {name: [[tv((t, v)) for v in range(8)] for t in range(32)]
                for name, tv in (("ld_addr", ld.layout_src_tv), ("ld_regs", ld.layout_dst_tv),
                                 ("st_regs", st.layout_src_tv), ("st_addr", st.layout_dst_tv))}

    tv = _traced(collect)
    for t in range(32):
        q, j = t % 4, t // 4
        # the lane addresses row t % 8 of matrix t // 8 (8 contiguous elements)
        assert tv["ld_addr"][t] == tv["st_addr"][t] == [8 * t + v for v in range(8)]
        for v in range(8):
            m, half = v // 2, v % 2
            assert tv["ld_regs"][t][v] == 64 * m + 8 * (2 * q + half) + j  # rows 2q, 2q + 1 of column j
            assert tv["st_regs"][t][v] == 64 * m + 8 * j + 2 * q + half  # row j, columns 2q, 2q + 1


@pytest.mark.parametrize("tile_n", [64, 96, 128, 160, 224] if FULL else [96, 128])
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
