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


def paged_box_count(tile_n: int, page_size: int) -> tuple[int, int]:
    """(TMA boxes per K / V stage, rows per box) of the paged forward (FwdConfig.page_size): a key block
    of tile_n rows spans tile_n / page_size whole pages, or lies inside one page (one box of tile_n)."""
    if page_size < tile_n:
        return tile_n // page_size, page_size
    return 1, tile_n


def paged_row(page_table, page_start: int, position: int, used_k: int, page_size: int) -> int:
    """The paged cache's row (the cache viewed as (pages * page_size, heads_k, d)) that the forward
    kernel's box for key `position` of a sequence starts at (hopper/fwd.py page_row, the same formula):
    the sequence's pages are the flat page table's entries from `page_start` on, key p in entry
    p // page_size at slot p % page_size. Positions past the used keys (a key block's last pages past the
    sequence's end) take the entry of the last used key: a table entry past the pages in use is never
    read (it may be anything), and the rows loaded there are masked and their V zeroed."""
    entry = page_start + min(position, used_k - 1) // page_size
    return int(page_table[entry]) * page_size + position % page_size


def paged_block_rows(page_table, page_start: int, n_block: int, used_k: int, tile_n: int,
                     page_size: int) -> list[tuple[int, int, int]]:
    """Key block `n_block`'s TMA boxes as the kernel issues them: (first row in the stage, first row in
    the paged cache, rows) each."""
    boxes, rows = paged_box_count(tile_n, page_size)
    first = n_block * tile_n
    return [(j * rows, paged_row(page_table, page_start, first + j * rows, used_k, page_size), rows)
            for j in range(boxes)]
