"""The split inside the attention kernel (FwdConfig.split_kv, runtime.forward_split; kvcache takes it with
FLASHHOPPER_EXPERIMENTAL_DECODE_SPLIT=1) on the CPU: the host twins of the kernel's arithmetic
(host.split_tile: the tile walk; host.split_keys: each split's keys, contiguous and paged) against brute
force, the configs, and which calls take it. The call itself against the reference backend, with a float64
model of the kernel that walks by those twins: tests/test_decode_launches.py."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest
import torch

from flashhopper import kvcache, plan, splitkv, validation
from flashhopper.config import SUPPORTED_HDIMS
from flashhopper.hopper import host, runtime


@pytest.mark.parametrize("m_blocks,heads,splits,batch", [(1, 8, 16, 1), (1, 32, 2, 8), (2, 1, 3, 5),
                                                         (3, 4, 1, 2), (1, 1, 1, 1), (1, 8, 64, 3)])
def test_split_tile_walks_every_tile_once_in_order(m_blocks, heads, splits, batch):
    """Tiles 0, 1, ... are the query block fastest, then the head, then the split, then the item, each
    (item, split, head, block) once; none past the last; a grid of any size striding over them walks each
    once."""
    promised = [(item, split, head, m) for item in range(batch) for split in range(splits)
                for head in range(heads) for m in range(m_blocks)]
    walked = [host.split_tile(t, m_blocks=m_blocks, heads=heads, splits=splits, batch=batch)
              for t in range(len(promised))]
    assert walked == promised
    for extra in (0, 1, 977):
        assert host.split_tile(len(promised) + extra, m_blocks=m_blocks, heads=heads, splits=splits,
                               batch=batch) is None
    for grid in (1, 7, 132, len(promised) + 5):  # each CTA from its index by the grid, until None
        strided = []
        for cta in range(grid):
            t = cta
            while (tile := host.split_tile(t, m_blocks=m_blocks, heads=heads, splits=splits,
                                           batch=batch)) is not None:
                strided.append(tile)
                t += grid
        assert sorted(strided) == promised
    # the causal configs' (token_rows) order: the query blocks from the last down, each tile once
    backwards = [host.split_tile(t, m_blocks=m_blocks, heads=heads, splits=splits, batch=batch,
                                 from_last=True) for t in range(len(promised))]
    assert backwards == [(item, split, head, m_blocks - 1 - m) for item, split, head, m in promised]


def _layouts(capacity, align):
    """(splits, chunk) as splitkv._chunks gives them for 1 .. 9 splits asked, and a few more."""
    return sorted({splitkv._chunks(capacity, n, align) for n in (*range(1, 10), 16, 64)})


@pytest.mark.parametrize("capacity", [700, 128, 8192, 4097])
def test_split_keys_cover_each_items_keys_once(capacity):
    """Contiguous caches: the splits' key rows, in split order, are exactly the item's keys [start, start +
    used + new), each split at most a chunk and the one at j * chunk starting there, none past the keys;
    for items at i * key_rows and at given starts (cache_batch_idx, cache_leftpad), lengths 0 to the
    capacity."""
    rng = random.Random(capacity)
    for splits, chunk in _layouts(capacity, splitkv.CHUNK_ALIGN):
        assert (splits - 1) * chunk < capacity <= splits * chunk or splits == 1
        batch = 5
        new = rng.choice((0, 1, 2))
        used = [0, capacity - new, 1, rng.randrange(capacity - new + 1), chunk - new if chunk > new else 0]
        starts = [rng.randrange(10 * capacity) for _ in range(batch)]
        for key_rows in (capacity, 0):
            for item in range(batch):
                first = starts[item] if key_rows == 0 else item * key_rows
                rows = []
                for split in range(splits):
                    start, count = host.split_keys(item, split, used=used, new_keys=new, starts=starts,
                                                   key_rows=key_rows, chunk=chunk)
                    assert 0 <= count <= chunk and start == first + split * chunk
                    rows += range(start, start + count)
                assert rows == list(range(first, first + used[item] + new))


@pytest.mark.parametrize("page_size", [16, 64, 128, 256])
def test_split_keys_paged(page_size):
    """Paged caches (chunks of whole pages, splitkv's alignment): each split's keys, read through the
    kernel's row rule (host.paged_row from the split's first table entry), are the item's positions [j *
    chunk, ...) at the rows its table row names, all of them once in order; a table row's entries past the
    pages in use are never read."""
    rng = random.Random(page_size)
    pages, batch = 23, 4
    capacity = pages * page_size
    align = math.lcm(splitkv.CHUNK_ALIGN, page_size)
    stride = pages + 3  # the table's row stride: its rows may be wider than the pages in use
    table = torch.randperm(batch * stride, generator=torch.Generator().manual_seed(page_size)).to(torch.int32)
    for splits, chunk in _layouts(capacity, align):
        assert chunk % page_size == 0
        used = [capacity, 0, 1, rng.randrange(capacity + 1)]
        for item in range(batch):
            want = [int(table[item * stride + p // page_size]) * page_size + p % page_size
                    for p in range(used[item])]
            rows = []
            for split in range(splits):
                entry, count = host.split_keys(item, split, used=used, new_keys=0, starts=None,
                                               key_rows=stride, chunk=chunk, page_size=page_size)
                assert entry == item * stride + split * chunk // page_size and 0 <= count <= chunk
                rows += [host.paged_row(table, entry, p, count, page_size) for p in range(count)]
            assert rows == want


def test_split_configs():
    """plan.fwd_plan_split: the unmasked varlen tile (or the decode tile) with the split walk on the
    persistent static stride, paged where the kernels serve the page size, causal only over packed tokens
    (token_rows), launched as a programmatic dependent (pdl); refused with the dynamic scheduler, a window,
    or outside varlen; pdl only there."""
    for hdim, dv, softcap, tile in itertools.product(SUPPORTED_HDIMS, (0, 128), (False, True), (False, True)):
        if dv and hdim != 192:
            continue
        cfg = plan.fwd_plan_split("bf16", hdim, softcap, dv, decode_tile=tile)
        config_of = plan.fwd_config_decode if tile else plan.fwd_config_varlen
        base = config_of("bf16", hdim, softcap=softcap, dv=dv)
        assert cfg == dataclasses.replace(base, split_kv=True, dynamic_sched=False, pdl=True)
        for page_size in (16, 64, 7):
            paged = plan.fwd_plan_split("bf16", hdim, softcap, dv, page_size, decode_tile=tile)
            served = plan.fwd_config_paged(base, page_size)
            assert paged == dataclasses.replace(served, split_kv=True, dynamic_sched=False, pdl=True)
    cfg = plan.fwd_plan_split("bf16", 128, False)
    for bad, match in (({"dynamic_sched": True}, "split_kv: needs persistent=True and dynamic_sched=False"),
                       ({"persistent": False}, "split_kv: needs persistent"),
                       ({"causal": True}, "split_kv: causal goes with token_rows"),
                       ({"token_rows": True}, "split_kv: causal goes with token_rows"),
                       ({"local": True}, "split_kv: no local window"),
                       ({"varlen": False}, "split_kv is a mode of the varlen kernel"),
                       ({"split_kv": False, "dynamic_sched": True, "token_rows": True},
                        "token_rows is a mode of the split"),
                       ({"split_kv": False, "dynamic_sched": True, "pdl": True}, "pdl is for the split")):
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(cfg, **bad).check()
    causal = plan.fwd_plan_split("bf16", 128, False, causal=True)
    assert causal.causal and causal.token_rows and (causal.tile_m, causal.tile_n) == (cfg.tile_m, cfg.tile_n)
    configs = plan.split_kernels(page_sizes=(0, 16))
    # dtypes, (hdim, dv), softcap, pages, unmasked or causal over packed tokens
    assert len(configs) == len(set(configs)) == 2 * 2 * (len(SUPPORTED_HDIMS) + 1) * 2 * 2
    assert all(cfg.split_kv and not cfg.dynamic_sched and cfg.causal == cfg.token_rows for cfg in configs)
    assert {cfg.page_size for cfg in configs} == {0, 16}


def test_split_taken_only_for_one_query_token_without_a_window(monkeypatch):
    """Where the split inside the kernel is on (by default, or opted in), the rearranged decode (one query
    token, no window; packed queries only one an item) and only it goes to runtime.forward_split; switched
    off, none
    does. (Several query tokens with several-token decode switched off: that path splits too, and has its
    own tests in tests/test_decode_qlen.py.)"""
    monkeypatch.setattr(validation, "DECODE_QLEN_GPU_VERIFIED", False)
    monkeypatch.delenv(validation.DECODE_QLEN_OPT_IN, raising=False)
    monkeypatch.setattr(validation, "require_hopper", lambda q, backend="hopper": None)
    monkeypatch.setattr(validation, "check_varlen_call", lambda *args, **kwargs: None)
    monkeypatch.setattr(splitkv, "_sm_count", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    taken = []

    def split(q, *args, out=None, lse=None, splits=1, **kwargs):
        taken.append("split")
        b, rows, heads, _ = q.shape
        if out is not None:
            return out[:, None], lse[:, None]
        return (torch.zeros(b, splits, rows, heads, args[1].shape[-1], dtype=q.dtype),
                torch.zeros(b, splits, heads, rows))

    def varlen(q, k, v, *args, **kwargs):
        taken.append("varlen")
        return torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype), torch.zeros(q.shape[1], q.shape[0])

    import flashhopper.hopper

    monkeypatch.setattr(flashhopper.hopper, "forward_split", split)
    monkeypatch.setattr(flashhopper.hopper, "forward_varlen", varlen)
    monkeypatch.setattr(flashhopper.hopper, "combine_splits", lambda *args: None)
    caches = [torch.zeros(2, 700, 2, 64, dtype=torch.bfloat16) for _ in range(2)]
    lens = torch.tensor([650, 7], dtype=torch.int32)
    calls = [(dict(q=torch.zeros(2, 1, 8, 64, dtype=torch.bfloat16)), True),
             (dict(q=torch.zeros(2, 1, 8, 64, dtype=torch.bfloat16), num_splits=1), True),
             (dict(q=torch.zeros(2, 1, 8, 64, dtype=torch.bfloat16), pack_gqa=False), True),
             (dict(q=torch.zeros(2, 1, 8, 64, dtype=torch.bfloat16), num_splits=1, pack_gqa=False), False),
             (dict(q=torch.zeros(2, 1, 8, 64, dtype=torch.bfloat16), window_size=(100, 0)), False),
             (dict(q=torch.zeros(2, 3, 8, 64, dtype=torch.bfloat16)), False),
             # packed queries, one an item (kvcache._uniform_tokens): as the (b, 1, hq, d) call
             (dict(q=torch.zeros(2, 8, 64, dtype=torch.bfloat16), cu_seqlens_q=torch.tensor([0, 1, 2],
                                                                                             dtype=torch.int32),
                   max_seqlen_q=1), True),
             # packed, not the same count in every item: the varlen kernel
             (dict(q=torch.zeros(2, 8, 64, dtype=torch.bfloat16), cu_seqlens_q=torch.tensor([0, 0, 2],
                                                                                             dtype=torch.int32),
                   max_seqlen_q=2), False)]
    # the default (verified), the opt-in where it is not, and neither
    for verified, opted in ((True, "0"), (False, "1"), (False, "0")):
        monkeypatch.setattr(validation, "DECODE_SPLIT_GPU_VERIFIED", verified)
        monkeypatch.setenv(validation.DECODE_SPLIT_OPT_IN, opted)
        for kw, split_kv in calls:
            kvcache.flash_attn_with_kvcache(k_cache=caches[0], v_cache=caches[1], cache_seqlens=lens,
                                            causal=True, **kw)
            enabled = verified or opted == "1"
            assert taken.pop() == ("split" if split_kv and enabled else "varlen") and not taken


def test_forward_split_checks_its_arguments():
    """runtime.forward_split refuses what its kernel cannot take before any launch: an out without its lse,
    an out with more than one split, key_rows 0 without key_starts, a page table whose row stride is not
    key_rows."""
    q = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)
    kv = torch.zeros(100, 2, 64, dtype=torch.bfloat16)
    lens = torch.zeros(1, dtype=torch.int32)
    out, lse = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16), torch.zeros(1, 2, 4)
    call = dict(softmax_scale=0.1, softcap=0.0, chunk=128)
    with pytest.raises(ValueError, match="out and lse together"):
        runtime.forward_split(q, kv, kv, lens, splits=1, key_rows=100, out=out, **call)
    with pytest.raises(ValueError, match="only with one split"):
        runtime.forward_split(q, kv, kv, lens, splits=2, key_rows=100, out=out, lse=lse, **call)
    with pytest.raises(ValueError, match="key_starts"):
        runtime.forward_split(q, kv, kv, lens, splits=2, key_rows=0, **call)
    table = torch.zeros(1, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="strides"):
        runtime.forward_split(q, kv, kv, lens, splits=1, key_rows=4, page_table=table, page_size=16, **call)
