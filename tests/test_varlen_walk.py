"""The varlen forward's walk on the CPU: the walk table (hopper/varlen_walk.py, the same torch code the
launch runs on the GPU) read by the host twin of the kernel's lookup (host.varlen_tile, which follows
tile_scheduler.VarlenWalk.find and section_coords step by step) against a brute-force list of the real
tiles in the promised order; the search against bisect; the grid's bound."""

from __future__ import annotations

import bisect
import itertools
import random

import pytest
import torch

from flashhopper.hopper import host
from flashhopper.hopper.varlen_walk import uniform_walk_table, walk_grid, walk_table


def _packing(name: str) -> list[int]:
    rng = random.Random(name)
    return {
        "edges": [0, 1, 17, 127, 128, 129, 4097, 0, 300],
        "512 short": [rng.randrange(16, 512) for _ in range(512)],
        "equal": [1024] * 8,
        "one": [257],
        "empty": [0, 0, 0],
        "ties": [5, 300, 5, 300, 64, 64, 1],
        "many": [rng.choice((0, 1, 2, 63, 64, 65, 200)) for _ in range(1100)],
    }[name]


PACKINGS = ["edges", "512 short", "equal", "one", "empty", "ties", "many"]


def _promised(used_q, used_k, tile_m, heads, l2_section, from_last):
    """The walk as promised: sequences by used keys, longest first (ties in their own order); each one's
    ceil(used_q / tile_m) query blocks for its heads, `l2_section` heads at a time, the head fastest
    inside a section, m from the last block down with `from_last`."""
    walk = []
    for seq in sorted(range(len(used_q)), key=lambda s: -used_k[s]):
        blocks = -(-used_q[seq] // tile_m)
        for first_head in range(0, heads, l2_section):
            section = range(first_head, min(first_head + l2_section, heads))
            for m_idx in range(blocks):
                m_block = blocks - 1 - m_idx if from_last else m_idx
                walk += [(seq, head, m_block) for head in section]
    return walk


def _walked(table, heads, l2_section, from_last, beyond=3):
    """host.varlen_tile for tile 0, 1, ... until it says the walk is over, and a few tiles past that."""
    tiles = []
    while (coords := host.varlen_tile(len(tiles), table, heads=heads, l2_section=l2_section,
                                      from_last=from_last)) is not None:
        tiles.append(coords)
    for extra in range(1, beyond + 1):
        assert host.varlen_tile(len(tiles) + extra * 977, table, heads=heads, l2_section=l2_section,
                                from_last=from_last) is None
    return tiles


@pytest.mark.parametrize("name", PACKINGS)
@pytest.mark.parametrize("tile_m", [64, 128, 192])
def test_every_real_tile_once_longest_sequence_first(name, tile_m):
    used_q = _packing(name)
    rng = random.Random(f"{name}-{tile_m}")
    used_k = [max(0, n + rng.randrange(-40, 400)) for n in used_q]  # sq != sk, ties and zeros among them
    table = walk_table(torch.tensor(used_q, dtype=torch.int32), torch.tensor(used_k, dtype=torch.int32),
                       tile_m=tile_m)
    assert table.dtype == torch.int32 and table.shape == (2 * len(used_q),)
    table = table.tolist()
    walks = [(16, 5, True), (3, 1, False)]  # heads, heads a section, m from the last block
    if len(used_q) < 100:  # the long packings: two walks are enough (and keep the test short)
        walks += [(1, 1, False), (4, 4, True), (16, 1, False), (2, 3, True)]
    for heads, l2_section, from_last in walks:
        l2_section = min(l2_section, heads)
        walked = _walked(table, heads, l2_section, from_last)
        assert walked == _promised(used_q, used_k, tile_m, heads, l2_section, from_last)
        real = {(s, h, m) for s, n in enumerate(used_q) for h in range(heads) for m in range(-(-n // tile_m))}
        assert len(walked) == len(set(walked)) == len(real) and set(walked) == real
        keys = [used_k[s] for s, _, _ in walked]
        assert keys == sorted(keys, reverse=True)


def test_seqused_shorter_than_the_packing_counts_only_the_used_rows():
    # the table reads the used lengths it is given (seqused_q), not the packed ones
    used_q, used_k = [250, 0, 129], [400, 50, 1]
    table = walk_table(torch.tensor(used_q, dtype=torch.int32), torch.tensor(used_k, dtype=torch.int32),
                       tile_m=128).tolist()
    assert table == [2, 2, 4, 0, 1, 2]  # sequence 0 (2 blocks), 1 (none), 2 (2 blocks)
    assert _walked(table, 1, 1, True) == [(0, 0, 1), (0, 0, 0), (2, 0, 1), (2, 0, 0)]


@pytest.mark.parametrize("batch,rows,tile_m", [(1, 1, 128), (6, 4, 128), (48, 200, 64), (5, 0, 128),
                                               (3, 129, 128)])
def test_uniform_table_is_the_walk_of_equal_sequences_in_their_order(batch, rows, tile_m):
    table = uniform_walk_table(batch, rows, tile_m=tile_m, device="cpu")
    blocks = -(-rows // tile_m)
    assert table.tolist() == [blocks * (i + 1) for i in range(batch)] + list(range(batch))
    used = [rows] * batch
    assert _walked(table.tolist(), 2, 2, True) == _promised(used, used, tile_m, 2, 2, True)


@pytest.mark.parametrize("length", [0, 1, 2, 31, 32, 33, 63, 1023, 1024, 1025, 40000])
def test_the_search_finds_what_bisect_finds(length):
    rng = random.Random(length)
    ends = list(itertools.accumulate(rng.choice((0, 0, 1, 2, 7)) for _ in range(length)))
    units = range(-1, (ends[-1] if ends else 0) + 3)
    if len(units) > 3000:
        units = sorted(rng.sample(units, 3000))
    for unit in units:
        pos = bisect.bisect_right(ends, unit)  # the first entry above `unit`
        want = None if pos == length else (pos, ends[pos - 1] if pos else 0, ends[pos])
        assert host.varlen_find(ends, unit) == want, (length, unit)


def test_the_search_takes_ceil_log32_rounds():
    # one load a lane a round: 32 entries in one round, 1024 in two, 32768 in three (the first entry
    # sought: its chunk is a full one every round)
    class Ends(list):
        reads = 0

        def __getitem__(self, i):
            self.reads += 1
            return super().__getitem__(i)

    for length, rounds in ((32, 1), (33, 2), (1024, 2), (1025, 3), (32768, 3)):
        ends = Ends(range(1, length + 1))
        assert host.varlen_find(ends, 0) == (0, 0, 1)
        assert ends.reads == 32 * rounds, (length, ends.reads)


@pytest.mark.parametrize("name", PACKINGS)
@pytest.mark.parametrize("tile_m", [64, 128, 192])
def test_the_grid_bounds_the_tiles_from_what_the_host_knows(name, tile_m):
    lens = _packing(name)
    heads = 3
    tiles = heads * sum(-(-n // tile_m) for n in lens)
    total_q = sum(lens) + 17  # rows past the sequences: a packing's tail, or past seqused_q
    grid = {ctas: walk_grid(tile_m=tile_m, total_q=total_q, batch=len(lens), max_seqlen_q=max(lens),
                            heads=heads, max_ctas=ctas) for ctas in (132, 1 << 30)}
    assert grid[1 << 30] >= max(tiles, 1) and grid[132] == min(132, grid[1 << 30])
    # one sequence: exactly its tiles (both bounds are)
    assert walk_grid(tile_m=tile_m, total_q=1000, batch=1, max_seqlen_q=1000, heads=heads,
                     max_ctas=1 << 30) == heads * -(-1000 // tile_m)
    # no query at all still launches one CTA, which finds no tile
    assert walk_grid(tile_m=tile_m, total_q=0, batch=4, max_seqlen_q=0, heads=heads, max_ctas=132) == 1


@pytest.mark.parametrize("name", ["edges", "512 short", "ties", "empty", "one"])
def test_backward_launch_order_longest_first(name):
    """runtime.longest_first: the varlen backward's per-sequence values (each read at the sequence's grid
    index) permuted together, longest used query length first, ties in the caller's order; every
    sequence once, its five values kept together."""
    from flashhopper.hopper.runtime import longest_first

    lens = _packing(name)
    batch = len(lens)
    used_q = torch.tensor(lens, dtype=torch.int32)
    used_k = used_q.flip(0).contiguous()  # (any values: they travel with their sequence)
    cu_q = torch.nn.functional.pad(used_q.cumsum(0, dtype=torch.int32), (1, 0))
    cu_k = torch.nn.functional.pad(used_k.cumsum(0, dtype=torch.int32), (1, 0))
    pad_q = cu_q + 7 * torch.arange(batch + 1, dtype=torch.int32)
    got = longest_first(cu_q, cu_k, used_q, used_k, pad_q)
    want = sorted(range(batch), key=lambda i: (-lens[i], i))
    columns = torch.stack((cu_q[:batch], cu_k[:batch], used_q, used_k, pad_q[:batch]))
    for position, seq in enumerate(want):
        assert [int(t[position]) for t in got] == columns[:, seq].tolist()
    assert all(t.shape == (batch,) and t.dtype == torch.int32 and t.stride() == (1,) for t in got)
