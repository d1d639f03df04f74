"""Host-side twins of kernel arithmetic, in plain Python (no DSL import): the launch path and the
tests use them without loading the CuTe DSL."""

from __future__ import annotations

import math

# query rows per CTA of the backward preprocess (bwd_pre.py); the launch pads its rows to a multiple
PRE_ROWS_PER_CTA = 64


def softmax_constants(softmax_scale: float, softcap: float) -> tuple[float, float]:
    """(scale_log2, softcap_pre) as the kernels take them."""
    log2e = math.log2(math.e)
    if softcap > 0.0:
        return softcap * log2e, softmax_scale / softcap
    return softmax_scale * log2e, 0.0


def host_m_block_range(n_block: int, seqlen_q: int, seqlen_k: int, tile_m: int, tile_n: int, has_right: bool,
                       has_left: bool, window_left: int, window_right: int) -> tuple[int, int]:
    """mask.BlockInfo.m_block_range on the host (Python ints)."""
    diag = seqlen_k - seqlen_q
    m_max = (seqlen_q + tile_m - 1) // tile_m
    m_min = 0
    if has_right:
        first_q = n_block * tile_n - diag - window_right
        m_min = max(m_min, first_q // tile_m if first_q > 0 else 0)
    if has_left:
        last_q = (n_block + 1) * tile_n - 1 - diag + window_left
        m_max = min(m_max, (last_q // tile_m + 1) if last_q >= 0 else 0)
    return m_min, m_max


def every_q_block_visited(seqlen_q: int, seqlen_k: int, tile_m: int, tile_n: int, has_right: bool,
                          has_left: bool, window_left: int, window_right: int) -> bool:
    """Whether every query block is visited by some key block's CTA (BwdConfig.fused_dq_cast: a
    block nobody visits gets no dQ store, so the caller must zero dQ first). The key blocks' query
    ranges are nondecreasing in both ends and consecutive ones overlap or touch (windows >= 0), so
    their union is one interval: it is enough that the range of the first key block any query sees
    starts at 0 and that of the last one ends at the last query block."""
    num_m = (seqlen_q + tile_m - 1) // tile_m
    diag = seqlen_k - seqlen_q
    # keys some query sees: j in [i + diag - left, i + diag + right] for some i < seqlen_q
    first_key = max(0, diag - window_left) if has_left else 0
    last_key = min(seqlen_k - 1, seqlen_q - 1 + diag + window_right) if has_right else seqlen_k - 1
    if num_m == 0 or first_key > last_key:
        return num_m == 0
    args = (seqlen_q, seqlen_k, tile_m, tile_n, has_right, has_left, window_left, window_right)
    lo0, hi0 = host_m_block_range(first_key // tile_n, *args)
    lo1, hi1 = host_m_block_range(last_key // tile_n, *args)
    return lo0 < hi0 and lo0 == 0 and lo1 < hi1 and hi1 == num_m
