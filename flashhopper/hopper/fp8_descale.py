"""FP8 per-token q / k descales (FwdConfig.qk_descale "token"): the scores are
S[i, j] = (Q K^T of the stored e4m3 values)[i, j] * q_descale[i] * k_descale[j], q's per (batch, query
head, query row), k's per (batch, kv head, key). Any per-block quantization is this with each block's
scale repeated over its rows (flashhopper.fp8.quantize "block"), so the block size is independent of the
kernel's tiles.

- k, staged by the producer warp: for each key block, every lane reads tile_n / 32 descales from global
  memory (any strides, 0 too; a key past seqlen_k reads the last key's: its score is masked) before it
  waits for K's stage to be free, so the latency hides under that wait, writes them into the k-descale
  ring's stage of the same index once the block's K (and the next V) load is issued, and arrives on that
  stage's full mbarrier (32 arrivals), after waiting on the stage's empty mbarrier, on which every
  consumer thread arrives once it has read its descales (an idle warpgroup's threads wait for the stage
  to be full and arrive unread).
  K's stage would guard the stage alone (the consumers read it before they release K's), but through one
  lane's release after a warp sync, an ordering compute-sanitizer's racecheck does not follow.
- a stage's layout: 4 rows of tile_n / 4 words (+ config.KD_ROW_PAD); row q holds, in the order of the
  thread's accumulator columns, the columns 8 g + 2 q + e (g < tile_n / 8, e < 2) that the WGMMA C
  fragment gives a consumer thread with lane % 4 == q. A consumer thread reads its tile_n / 4 descales
  with 16-byte loads (tile_n / 16 LDS.128 a key block, no bank conflicts), CHUNK at a time, and
  multiplies its scores by them right after the QK^T wait, before softcap, mask and row max: one FMUL
  per score.
- q, read by each consumer thread once per tile for its rows (a row past seqlen_q reads the last row's)
  and folded into a per-row scale: scale_log2 * q_descale without softcap (the online softmax's per-row
  scale, hopper/softmax.py), softcap_pre * q_descale with it (tanh's argument). The LSE is that of the
  true scaled scores.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flashhopper.config import KD_ROW_PAD

# a consumer thread reads and applies its k descales CHUNK columns at a time (two 16-byte loads), each
# chunk after its own test of the stage's full barrier (complete by then: a test and a branch): all
# tile_n / 4 read at once spilled in the masked kernels at 128 keys a block (hdim 96, 192: 8-16 bytes)
CHUNK = 8


def kd_row_words(tile_n: int) -> int:
    """Words of one row of a ring stage (tile_n / 4 descales and the padding)."""
    return tile_n // 4 + KD_ROW_PAD


def kd_position(col: int, tile_n: int) -> int:
    """The word of a ring stage that holds column `col` of the key block (plain Python: the tests'
    twin of stage_k_descales and the consumers' read)."""
    return ((col % 8) // 2) * kd_row_words(tile_n) + 2 * (col // 8) + col % 2


def lane_word(lane, i: int, tile_n: int):
    """The word of a ring stage the producer's lane `lane` writes its value i to (key lane + 32 i of the
    block): kd_position of that column, written for a lane index that is a Python int or a traced one."""
    return ((lane % 8) // 2) * kd_row_words(tile_n) + 2 * (lane // 8) + lane % 2 + 8 * i


def kd_layout(tile_n: int, stages: int) -> cute.Layout:
    """The ring: (word of a row, row q, stage)."""
    row = kd_row_words(tile_n)
    return cute.make_layout((row, 4, stages), stride=(1, row, 4 * row))


@cute.jit
def fetch_k_descales(mKd_t: cute.Tensor, n_block: Int32, seqlen_k: Int32, tile_n: cutlass.Constexpr[int]):
    """Producer warp: this lane's tile_n / 32 descales of key block `n_block` (keys lane + 32 i), from
    mKd_t (this (batch, kv head)'s keys), clamped into [0, seqlen_k): an empty tile asks for block -1."""
    lane = cute.arch.lane_idx()
    vals = cute.make_rmem_tensor(tile_n // 32, Float32)
    for i in cutlass.range_constexpr(tile_n // 32):
        key = n_block * tile_n + lane + 32 * i
        vals[i] = mKd_t[cutlass.max(cutlass.min(key, seqlen_k - 1), Int32(0))]
    return vals


@cute.jit
def stage_k_descales(vals: cute.Tensor, sKd: cute.Tensor, stage: Int32, tile_n: cutlass.Constexpr[int]):
    """Producer warp: fetch_k_descales' values into ring stage `stage` at kd_position (the caller then
    arrives on the stage's full barrier from every lane)."""
    lane = cute.arch.lane_idx()
    stage_words = sKd[None, None, stage]
    for i in cutlass.range_constexpr(tile_n // 32):
        stage_words[lane_word(lane, i, tile_n)] = vals[i]


@cute.jit
def load_k_descales(sKd: cute.Tensor, stage: Int32, chunk: cutlass.Constexpr[int]):
    """Consumer thread: the descales of its accumulator columns' chunk `chunk` (CHUNK of them) of the
    key block in ring stage `stage` (the caller has waited on the stage's full barrier): 16-byte loads.
    Its row of the stage from the lane register (lane % 4 = the thread's % 4), which ptxas reads again
    where needed rather than holding the thread index through the mainloop."""
    mine = cute.local_tile(sKd[None, cute.arch.lane_idx() % 4, stage], (CHUNK,), (chunk,))
    frag = cute.make_rmem_tensor(CHUNK, Float32)
    cute.autovec_copy(mine, frag)
    return frag


@cute.jit
def load_q_descales(mQd_t: cute.Tensor, coord_rc: cute.Tensor, m_block: Int32, seqlen_q: Int32,
                    tile_m: cutlass.Constexpr[int]):
    """Consumer thread: the descales of its rows (mQd_t: this (batch, query head)'s rows), a row past
    seqlen_q reading the last row's."""
    num_rows = cute.size(coord_rc, mode=[0])
    qd = cute.make_rmem_tensor(num_rows, Float32)
    for r in cutlass.range_constexpr(num_rows):
        row = m_block * tile_m + coord_rc[r, 0][0]
        qd[r] = mQd_t[cutlass.min(row, seqlen_q - 1)]
    return qd


@cute.jit
def scaled_rows(qd: cute.Tensor, scale: Float32):
    """scale * q_descale for each of the thread's rows."""
    rows = cute.make_rmem_tensor(cute.size(qd), Float32)
    for r in cutlass.range_constexpr(cute.size(qd)):
        rows[r] = scale * qd[r]
    return rows


@cute.jit
def apply_k_descales(acc_S_rc: cute.Tensor, kd: cute.Tensor, chunk: cutlass.Constexpr[int]):
    """S *= k_descale for the columns of chunk `chunk` (load_k_descales' values)."""
    for r in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[0])):
        for c in cutlass.range_constexpr(CHUNK):
            acc_S_rc[r, chunk * CHUNK + c] = acc_S_rc[r, chunk * CHUNK + c] * kd[c]


@cute.jit
def softcap_rows(acc_S_rc: cute.Tensor, row_pre: cute.Tensor):
    """Softcap with per-token descales, S already times its k descales: tanh(S * (softcap_pre * the
    row's q descale)) in place."""
    for r in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[1])):
            acc_S_rc[r, c] = cute.math.tanh(acc_S_rc[r, c] * row_pre[r], fastmath=True)
