"""The varlen forward's walk table, built on the device before each launch, and its grid (host side; the
kernel's half is tile_scheduler.VarlenWalk, host.varlen_tile its twin).

The walk visits the sequences longest first (by used keys: a tile's work is the key blocks it sees, and
a sequence's heaviest tile sees all of them), and each sequence's tiles together. Its table, int32
(2 batch,): for each position of the walk the query blocks of the sequences up to it (a cumulative sum:
sequence i of the walk holds tiles heads * table[i - 1] up to heads * table[i]), then the sequence ids
in walk order. A few torch operations on the lengths' device: no device-to-host copy, so a CUDA graph
captures them and a replay walks the lengths it is given.
"""

from __future__ import annotations

import torch

from flashhopper.hopper.host import varlen_m_blocks


def walk_table(used_q: torch.Tensor, used_k: torch.Tensor, *, tile_m: int) -> torch.Tensor:
    """The table for int32 (batch,) used query / key lengths and `tile_m`-row query blocks: the sequences
    sorted by used keys, longest first (stable), then their query blocks summed in that order. About
    eight small kernels on CUDA: the stable sort (two or three), the ids' copy, a gather, the round up
    (two) and a cumulative sum."""
    batch = used_q.shape[0]
    table = torch.empty(2 * batch, dtype=torch.int32, device=used_q.device)
    order = torch.argsort(used_k, descending=True, stable=True)
    table[batch:].copy_(order)
    blocks = used_q.index_select(0, order)
    blocks = (blocks + (tile_m - 1)).div_(tile_m, rounding_mode="floor")  # host.varlen_m_blocks, elementwise
    torch.cumsum(blocks, 0, dtype=torch.int32, out=table[:batch])
    return table


def uniform_walk_table(batch: int, rows: int, *, tile_m: int, device) -> torch.Tensor:
    """The table of a walk that takes every sequence as `rows` queries long, in its own order: two
    kernels and no read of the lengths. For kvcache's rearranged decode, whose sequences all have the
    same rows (one query token, or a KV head's query heads); correct for any packing whose sequences
    have at most `rows` queries (a sequence's tiles past its used queries store nothing), but those tiles
    are walked for nothing."""
    blocks = varlen_m_blocks(rows, tile_m)
    table = torch.empty(2 * batch, dtype=torch.int32, device=device)
    if blocks:
        torch.arange(blocks, (batch + 1) * blocks, blocks, out=table[:batch])
    else:
        table[:batch].zero_()
    torch.arange(batch, out=table[batch:])
    return table


def walk_grid(*, tile_m: int, total_q: int, batch: int, max_seqlen_q: int, heads: int, max_ctas: int) -> int:
    """CTAs of a varlen launch: `max_ctas` (the SM count), or fewer where the tiles cannot fill them. The
    host bounds the tiles without reading the lengths: each sequence's query blocks are at most
    max_seqlen_q's, and all of them at most total_q's plus one partial block a sequence. A bound that
    is too low (max_seqlen_q below a sequence's length) only makes fewer CTAs walk every tile."""
    blocks = min(batch * varlen_m_blocks(max_seqlen_q, tile_m), (total_q + batch * (tile_m - 1)) // tile_m)
    return max(1, min(max_ctas, blocks * heads))
