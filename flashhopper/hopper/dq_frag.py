"""The fp32 dQ accumulator in WGMMA fragment order (BwdConfig.dq_frag, the wide kernel at hdim 256).

The consumer threads add their dQ chunks with 16-byte vector atomics (red.global.add.v4.f32) straight
from registers: no smem slot, no writer warp, no grants. In the accumulator's (b, sq, h, d) row order a
thread's accumulator holds only pairs of adjacent columns, so one warp-wide atomic touches 8 rows with
32 bytes each. Here each 64 x 256 query block of one (batch, head) is stored in the order the threads
hold it instead: thread t of warpgroup w puts values 4j .. 4j + 3 of chunk c (its j-th 4-vector) at

    row (c * 2 + w) * 16 + t // 8,  column j * 32 + (t % 8) * 4

of that block, so a warp-wide atomic covers four whole 128-byte lines. The memory is still a
(b, sq_pad, h, 256) fp32 tensor (the backward preprocess clears it as it does the row-order one);
`unfrag` permutes it back into row order for the cast.

`mma_coord` is the WGMMA accumulator layout this assumes (m64nNk16, fp32: thread t holds rows
16 (t // 32) + (t % 32) // 4 and that + 8, columns 8 g + 2 (t % 4) and that + 1); the kernel checks it
against the tiled MMA's own partition at trace time.
"""

from __future__ import annotations

WGS, CHUNKS, HDIM, ROWS = 2, 2, 256, 64
COLS = HDIM // (WGS * CHUNKS)  # one warpgroup's columns of one chunk
VALUES = ROWS * COLS // 128  # fp32 a thread holds of a chunk (32)


def frag_slot(c: int, w: int, t: int, i: int) -> tuple[int, int]:
    """(row, column) in the query block's fragment-order storage of value i of thread t (of 128) of
    warpgroup w's chunk c."""
    return (c * WGS + w) * 16 + t // 8, (i // 4) * 32 + (t % 8) * 4 + i % 4


def mma_coord(c: int, w: int, t: int, i: int) -> tuple[int, int]:
    """(query row, head-dim column) in the 64 x 256 block of the same value: the WGMMA C layout."""
    warp, lane = t // 32, t % 32
    row = 16 * warp + lane // 4 + 8 * ((i // 2) % 2)
    col = c * WGS * COLS + w * COLS + 8 * (i // 4) + 2 * (lane % 4) + i % 2
    return row, col


def unfrag(acc):
    """(b, sq_pad, h, 256) torch tensor in fragment order -> a (b, sq_pad, h, 256) view in row order
    (permuted, not copied: the cast that follows makes the copy)."""
    b, sq_pad, h, d = acc.shape
    if d != HDIM or sq_pad % ROWS:
        raise ValueError(f"dq_frag accumulator must be (b, multiple of {ROWS}, h, {HDIM}), got "
                         f"{tuple(acc.shape)}")
    # storage: row = (c, w, t6, t5, t4, t3), column = (j, t2, t1, t0, e1, e0), where t = thread bits and
    # i = 4 j + 2 e1 + e0; the block's row is (t6, t5, e1, t4, t3, t2), its column (c, w, j, t1, t0, e0)
    v = acc.view(b, sq_pad // ROWS, 2, 2, 2, 2, 2, 2, h, 8, 2, 2, 2, 2, 2)
    v = v.permute(0, 1, 4, 5, 13, 6, 7, 10, 8, 2, 3, 9, 11, 12, 14)
    return v.reshape(b, sq_pad, h, d)
