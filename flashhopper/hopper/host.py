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


# ---- the varlen forward's walk (tile_scheduler.FwdTileScheduler.varlen_tile; hopper/varlen_walk.py builds
# its table on the device)

WARP = 32


def varlen_m_blocks(len_q: int, tile_m: int) -> int:
    """Query blocks of a sequence with `len_q` used queries: its tiles per head (varlen_walk.walk_table's
    rule, the same formula)."""
    return (len_q + tile_m - 1) // tile_m


def section_coords(tile: int, *, num_m_blocks: int, num_pairs: int, l2_section: int,
                   from_last: bool) -> tuple[int, int]:
    """tile_scheduler.section_coords on the host: tile index -> (m_block, pair), pairs taken
    `l2_section` at a time, the pair fastest inside a section, m from the last block down with
    `from_last`."""
    per_section = num_m_blocks * l2_section
    section = tile // per_section
    local = tile - section * per_section
    pairs_here = min(l2_section, num_pairs - section * l2_section)
    m_idx = local // pairs_here
    pair = section * l2_section + local - m_idx * pairs_here
    return (num_m_blocks - 1 - m_idx if from_last else m_idx), pair


def varlen_find(ends, unit: int) -> tuple[int, int, int] | None:
    """tile_scheduler.VarlenWalk.find on the host, lane by lane: the first position whose entry of the
    non-decreasing `ends` exceeds `unit`, as (position, the entry before it or 0, its entry), or None
    where none does. Each round the warp's 32 lanes load the last entry of 32 equal chunks of the range
    left (a lane past the range its last entry, then -1 in its place), and the first chunk whose entry
    exceeds `unit` is the next range: ceil(log32(len)) rounds of one load per lane."""
    lo, n, below, found = 0, len(ends), 0, None
    while n > 0:
        step = (n + WARP - 1) // WARP
        loaded = [ends[lo + min((lane + 1) * step, n) - 1] for lane in range(WARP)]
        probes = [value if lane * step < n else -1 for lane, value in enumerate(loaded)]
        hits = [lane for lane in range(WARP) if probes[lane] > unit]
        if not hits:
            break
        f = hits[0]
        below = probes[f - 1] if f > 0 else below
        top = probes[f]
        lo += f * step
        if step == 1:
            found = (lo, below, top)
            break
        n = min(step, n - f * step)
    return found


def varlen_tile(tile: int, table, *, heads: int, l2_section: int,
                from_last: bool) -> tuple[int, int, int] | None:
    """FwdTileScheduler.varlen_tile on the host: tile index -> (sequence, head, m_block) on the walk
    table (varlen_walk.walk_table: the cumulative query blocks of the sequences in walk order, then the
    sequences' ids), or None past the last tile. Sequence i of the walk holds tiles heads * ends[i - 1]
    up to heads * ends[i], taken as section_coords takes a dense launch's with its heads as the pairs."""
    batch = len(table) // 2
    found = varlen_find(table[:batch], tile // heads)
    if found is None:
        return None
    pos, below, top = found
    m_block, head = section_coords(tile - below * heads, num_m_blocks=top - below, num_pairs=heads,
                                   l2_section=l2_section, from_last=from_last)
    return table[batch + pos], head, m_block


# ---- the split decode walk (FwdConfig.split_kv: tile_scheduler.FwdTileScheduler.coords with one pair a
# section, hopper/fwd.py split_keys)


def split_tile(tile: int, *, m_blocks: int, heads: int, splits: int, batch: int,
               from_last: bool = False) -> tuple[int, int, int, int] | None:
    """The split walk's tile index -> (item, split, head, m_block), or None past the last tile: coords'
    order with one pair a section (the query block fastest, then the head, then the split, then the item;
    `from_last`: the query blocks from the last down, the causal configs' order: FwdConfig.token_rows);
    the partial output the tile writes is item * splits + split."""
    if tile >= m_blocks * heads * splits * batch:
        return None
    m_block, pair = section_coords(tile, num_m_blocks=m_blocks, num_pairs=heads * splits * batch,
                                   l2_section=1, from_last=from_last)
    part = pair // heads
    return part // splits, part % splits, pair % heads, m_block


def split_keys(item: int, split: int, *, used, new_keys: int, starts, key_rows: int, chunk: int,
               page_size: int = 0) -> tuple[int, int]:
    """A split tile's keys as the kernel takes them (hopper/fwd.py split_keys, the same formula): (where they
    start, how many). The item's keys start at row item * key_rows of the cache (paged: its pages at that
    entry of the flat page table), or at starts[item] where key_rows is 0; it holds used[item] + new_keys;
    split j takes its positions [j * chunk, min((j + 1) * chunk, that)), none past it. The start moves by
    j * chunk rows, or paged by j * chunk / page_size entries (chunks of whole pages)."""
    first = int(starts[item]) if key_rows == 0 else item * key_rows
    lo = split * chunk
    count = min(max(int(used[item]) + new_keys - lo, 0), chunk)
    return first + (lo // page_size if page_size else lo), count
