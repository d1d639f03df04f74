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


def host_visiting_key_blocks(m_block: int, seqlen_q: int, seqlen_k: int, tile_m: int, tile_n: int,
                             has_right: bool, has_left: bool, window_left: int, window_right: int) -> int:
    """How many key blocks' CTAs visit query block `m_block`: mask.BlockInfo.first_n_block ..
    last_n_block on the host (Python ints), which deterministic mode's dQ turns count on; meaningful
    where the count is positive (a visited block)."""
    num_n = (seqlen_k + tile_n - 1) // tile_n
    last = num_n - 1
    if has_right:
        x = (m_block + 1) * tile_m + seqlen_k - seqlen_q + window_right
        last = min((x + tile_n - 1) // tile_n - 1, num_n - 1)
    first = 0
    if has_left:
        lowest_key = m_block * tile_m + seqlen_k - seqlen_q - window_left
        first = max(lowest_key, 0) // tile_n
    return last - first + 1
