"""The paged K / V path (FwdConfig.page_size) on the CPU: the config checks and which page sizes the
dispatch serves, the host twin of the kernel's page-table row arithmetic (hopper/host.py paged_row, the
formula of hopper/fwd.py page_row) against kvcache's rows, and flash_attn_with_kvcache's paged kernel
path end to end with the kernel emulated from its arguments as documented (float64), against the
reference backend. The kernels themselves: tests/test_fwd_compile.py (compiled), tests/test_paged_gpu.py
(run)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest
import torch

from flashhopper import flash_attn_with_kvcache, kvcache, plan, splitkv, validation
from flashhopper.config import DTYPES, SUPPORTED_HDIMS, CombineConfig, FwdConfig
from flashhopper.hopper import runtime
from flashhopper.hopper.host import paged_block_rows, paged_box_count, paged_row, varlen_tile
from flashhopper.reference import attention_ref

# ---------------------------------------------------------------- config checks and dispatch


@pytest.mark.parametrize("bad,match", [
    ({"page_size": 12}, "multiple of 8"),
    ({"page_size": -16}, "positive multiple of 8"),
    ({"page_size": 24}, "one must divide the other"),  # 128 keys a block
    ({"page_size": 48}, "one must divide the other"),
    ({"page_size": 16, "intra_wg_overlap": False}, "intra_wg_overlap"),
])
def test_bad_page_sizes_are_refused(bad, match):
    cfg = dataclasses.replace(plan.fwd_config_varlen("bf16", 128), **bad)
    with pytest.raises(ValueError, match=match):
        cfg.check()


def test_paged_needs_the_varlen_kernel_and_16_bit_inputs():
    with pytest.raises(ValueError, match="varlen kernel only"):
        dataclasses.replace(plan.fwd_config("bf16", 128), page_size=16).check()
    with pytest.raises(ValueError, match="e4m3 .* not supported with a paged cache"):
        FwdConfig(dtype="e4m3", hdim=128, varlen=True, page_size=16).check()
    with pytest.raises(ValueError, match="e4m3"):
        dataclasses.replace(plan.fwd_config("e4m3", 128), varlen=True, page_size=128).check()


def test_dispatched_kernels_are_unpaged():
    """The field's default leaves every dispatched kernel as it was (scripts/cubin_hashes.py checks the
    SASS); the paged ones are only in paged_kernels while they are gated."""
    dispatched = plan.dispatched_kernels(forward=True, backward=False)
    assert all(getattr(cfg, "page_size", 0) == 0 for cfg in dispatched)
    assert FwdConfig(dtype="bf16", hdim=128).page_size == 0


@pytest.mark.parametrize("hdim", SUPPORTED_HDIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_page_sizes_the_varlen_plan_serves(hdim, causal):
    """fwd_plan_varlen(page_size=P): the varlen config with P where a key block is whole pages or part of
    one, at 64 keys a block where the tile's own (hdim 192's 112, 256's 80) fit neither; the plain varlen
    config for other page sizes (the caller gathers)."""
    plain, wl, wr = plan.fwd_plan_varlen("bf16", hdim, causal, (-1, -1), False)
    for page_size in (8, 16, 32, 64, 128, 256, 512, 1, 3, 24, 100, 1000):
        cfg, wl2, wr2 = plan.fwd_plan_varlen("bf16", hdim, causal, (-1, -1), False, page_size=page_size)
        assert (wl2, wr2) == (wl, wr)
        own = plan.page_size_served(plain.tile_n, page_size)
        fallback = plan.page_size_served(64, page_size)
        if own or fallback:
            want_n = plain.tile_n if own else 64
            assert cfg == dataclasses.replace(plain, page_size=page_size, tile_n=want_n)
        else:
            assert cfg == plain
    assert plan.fwd_plan_varlen("bf16", hdim, causal, (-1, -1), False, page_size=16)[0].tile_n == plain.tile_n


def test_decode_plan_serves_pages_on_its_tile():
    for hdim in SUPPORTED_HDIMS:
        tile = plan.fwd_config_decode("bf16", hdim)
        for page_size in (16, 64, 128, 256):
            cfg = plan.fwd_plan_decode("bf16", hdim, False, page_size=page_size)
            assert cfg == dataclasses.replace(tile, page_size=page_size)
        assert plan.fwd_plan_decode("bf16", hdim, False, page_size=24) == tile


def test_paged_kernels_to_precompile():
    configs = plan.paged_kernels()
    # per value head dim: 3 masks x softcap or not; and the decode tile
    per_hdim = {hdim: len(plan.value_hdims(hdim)) * 6 + 1 for hdim in SUPPORTED_HDIMS}
    per_dtype = len(plan.PAGED_PAGE_SIZES) * sum(per_hdim.values())
    assert len(configs) == len(set(configs)) == len(DTYPES) * per_dtype
    for cfg in configs:
        cfg.check()
        assert cfg.varlen and cfg.page_size in plan.PAGED_PAGE_SIZES
        assert cfg.num_consumer_wg > 1 or not (cfg.causal or cfg.local or cfg.softcap)  # the decode tile
    assert not set(configs) & set(plan.dispatched_kernels(forward=True, backward=False))


# ---------------------------------------------------------------- the row arithmetic's host twin


def _random_table(rng, batch, max_pages, num_pages, used_pages):
    """A (batch, max_pages) table of distinct pages for the used entries, garbage past them (entries that
    would give a negative or far-off row, so that a row computed from one is caught)."""
    pages = rng.sample(range(num_pages), sum(used_pages))
    table = []
    for n in used_pages:
        row = [pages.pop() for _ in range(n)]
        table.append(row + [rng.choice([-1, -(10 ** 6), 10 ** 9]) for _ in range(max_pages - n)])
    return table


@pytest.mark.parametrize("seed", range(6))
def test_paged_row_maps_positions_as_kvcache_rows(seed):
    """host.paged_row (the kernel's page_row) gives kvcache._cache_rows' row for every used position,
    and past the used keys a row of the last used page: a table entry past the pages in use is never
    read. Random page sizes, tables and lengths."""
    rng = random.Random(seed)
    page_size = rng.choice([8, 16, 24, 64, 128, 256])
    batch, max_pages = rng.randint(1, 5), rng.randint(1, 9)
    lens = [rng.randint(1, max_pages * page_size) for _ in range(batch)]
    used_pages = [-(-n // page_size) for n in lens]
    num_pages = sum(used_pages) + rng.randint(0, 4)
    table = _random_table(rng, batch, max_pages, num_pages, used_pages)
    flat = [e for row in table for e in row]
    positions = torch.arange(max_pages * page_size).expand(batch, -1)
    # the kvcache rows of positions inside the used pages (garbage entries past them made non-negative)
    safe = torch.tensor([[max(e, 0) for e in row] for row in table], dtype=torch.int32)
    rows = kvcache._cache_rows(positions, None, safe, page_size)
    for i, n in enumerate(lens):
        start = i * max_pages
        for p in range(max_pages * page_size):
            got = paged_row(flat, start, p, n, page_size)
            if p < n:
                assert got == rows[i, p]
            else:
                assert got // page_size == table[i][(n - 1) // page_size] and 0 <= got < num_pages * page_size


@pytest.mark.parametrize("tile_n", [64, 80, 112, 128])
@pytest.mark.parametrize("seed", range(3))
def test_paged_boxes_cover_each_key_block(tile_n, seed):
    """host.paged_block_rows (the boxes the kernel issues for a key block): consecutive stage rows, each
    box inside one page, every used key of the block at kvcache's row, for every page size the kernel
    serves at this tile, the sequence starting mid-table (a split decode's chunk)."""
    rng = random.Random(seed * 1000 + tile_n)
    for page_size in [p for p in range(8, 513, 8) if plan.page_size_served(tile_n, p)]:
        max_pages = rng.randint(1, 6) * max(1, tile_n // page_size)
        n = rng.randint(1, max_pages * page_size)
        num_pages = max_pages + 3
        offset = rng.randint(0, 3)  # the sequence's first entry in the flat table
        table = [rng.choice([-1, 10 ** 9]) for _ in range(offset)] + _random_table(
            rng, 1, max_pages, num_pages, [-(-n // page_size)])[0]
        safe = torch.tensor([[max(e, 0) for e in table[offset:]]], dtype=torch.int32)
        rows = kvcache._cache_rows(torch.arange(max_pages * page_size)[None], None, safe, page_size)[0]
        boxes, box_rows = paged_box_count(tile_n, page_size)
        assert boxes * box_rows == tile_n and box_rows % 8 == 0
        for n_block in range(-(-n // tile_n)):
            got = paged_block_rows(table, offset, n_block, n, tile_n, page_size)
            assert [s for s, _, _ in got] == list(range(0, tile_n, box_rows))
            for smem_row, row, count in got:
                assert count == box_rows and row % box_rows == 0 and 0 <= row < num_pages * page_size
                assert row // page_size == (row + count - 1) // page_size  # inside one page
                for r in range(count):
                    p = n_block * tile_n + smem_row + r
                    if p < n:
                        assert row + r == rows[p]


# ---------------------------------------------------------------- flash_attn_with_kvcache, kernel emulated

LOG2E = math.log2(math.e)


def _emulated_kernel(cfg, launched):
    """The varlen kernel as its arguments document it, in float64: sequence b's query rows cu_q[b] ..
    + used_q[b] against its used_k[b] keys, at rows cu_k[b] + p, or paged (cfg.page_size) at
    host.paged_row(table, cu_k[b], p, ...): the flat table's entries from cu_k[b] on. The walk table is
    walked as the kernel walks it (host.varlen_tile): every used row's query block must be among its
    tiles, for every head. The split-KV merge kernel (CombineConfig) as merge_by_lse in float64."""
    if isinstance(cfg, CombineConfig):
        return _emulated_merge

    def run(q, k, v, out, lse, counter, scale_log2, softcap_pre, wl, wr, num_ctas, section, qd, kd, vd,
            cu_q, cu_k, used_q, used_k, walk, table, *split):
        launched.append(cfg)
        assert cfg.local is False and (table is not None) == bool(cfg.page_size)
        assert not cfg.split_kv and split == (0, 0, 0, 0, 1)  # the split walk's scalars, unused
        heads, walk = q.shape[2], walk.tolist()
        walked = (varlen_tile(t, walk, heads=heads, l2_section=section, from_last=cfg.causal)
                  for t in itertools.count())
        tiles = set(itertools.takewhile(lambda t: t is not None, walked))
        need = {(b, h, m) for b in range(used_q.shape[0]) for h in range(heads)
                for m in range(-(-int(used_q[b]) // cfg.tile_m))}
        assert need <= tiles and num_ctas >= 1
        q, k, v, out, lse = q[0], k[0], v[0], out[0], lse[0]
        softcap = scale_log2 / LOG2E if cfg.softcap else 0.0
        scale = softcap_pre * softcap if cfg.softcap else scale_log2 / LOG2E
        flat = table.tolist() if table is not None else None
        for b in range(used_k.shape[0]):
            rows = slice(int(cu_q[b]), int(cu_q[b]) + int(used_q[b]))
            n = int(used_k[b])
            if cfg.page_size:
                keys = [paged_row(flat, int(cu_k[b]), p, n, cfg.page_size) for p in range(n)]
            else:
                keys = list(range(int(cu_k[b]), int(cu_k[b]) + n))
            if rows.stop == rows.start:
                continue
            if not keys:
                out[rows], lse[:, rows] = 0.0, float("-inf")
                continue
            assert min(keys) >= 0 and max(keys) < k.shape[0]
            o, l_ = attention_ref(q[None, rows], k[None, keys], v[None, keys], scale, cfg.causal, (-1, -1),
                                  softcap)
            out[rows], lse[:, rows] = o[0].to(out.dtype), l_[0]
    return run


def _emulated_merge(o, lse, out, lse_out):
    """hopper/combine.py's kernel on its documented arguments: the splits (dim 1) merged by their LSE."""
    merged, merged_lse = splitkv.merge_by_lse(o.double(), lse.double(), dim=1)
    out.copy_(merged)
    if lse_out is not None:
        lse_out.copy_(merged_lse)


@pytest.fixture()
def emulated(monkeypatch):
    """flash_attn_with_kvcache's kernel path on CPU tensors (132 SMs), every launch emulated; returns the
    configs launched."""
    launched = []
    monkeypatch.setattr(validation, "require_hopper", lambda q, backend="hopper": None)
    monkeypatch.setattr(validation, "check_varlen_call", lambda *args, **kwargs: None)
    monkeypatch.setattr(splitkv, "_sm_count", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(runtime, "_tile_counter", lambda device, capturing=None: None)
    monkeypatch.setattr(runtime, "_sm_count", lambda index: 132)
    monkeypatch.setattr(runtime, "get_kernel", lambda cfg: _emulated_kernel(cfg, launched))
    monkeypatch.setenv(validation.PAGED_TMA_OPT_IN, "1")
    # decode arranged around the varlen kernel (emulated here); the split inside the kernel reads pages
    # through the same table arithmetic (tests/test_decode_launches.py, split_kernels)
    monkeypatch.setattr(validation, "DECODE_SPLIT_GPU_VERIFIED", False)
    return launched


def _paged_case(page_size, sq, lens, hq=4, hk=2, d=64, s_new=0, seed=0, extra_pages=3):
    g = torch.Generator().manual_seed(seed)
    b = len(lens)
    max_pages = -(-(max(lens) + s_new) // page_size) + 1
    num_pages = b * max_pages + extra_pages
    order = torch.randperm(num_pages, generator=g)
    table = order[: b * max_pages].view(b, max_pages).to(torch.int32).clone()
    k_paged, v_paged = (torch.randn(num_pages, page_size, hk, d, generator=g).to(torch.bfloat16)
                        for _ in range(2))
    for i, n in enumerate(lens):
        used = -(-(n + s_new) // page_size)
        table[i, used:] = -7  # garbage past the pages in use
        for t in (k_paged, v_paged):  # slots past the item's keys: NaN
            for p in range(n + s_new, used * page_size):
                t[table[i, p // page_size], p % page_size] = float("nan")
    q = torch.randn(b, sq, hq, d, generator=g).to(torch.bfloat16)
    new = None
    if s_new:
        new = tuple(torch.randn(b, s_new, hk, d, generator=g).to(torch.bfloat16) for _ in range(2))
    return q, k_paged, v_paged, table, torch.tensor(lens, dtype=torch.int32), new


def _both(q, k_paged, v_paged, table, lens, new, **kw):
    """(the kernel path's out, lse), (the reference backend's), each on its own copy of the cache."""
    results = []
    for backend in ("hopper", "reference"):
        k, v = (None, None) if new is None else new
        results.append(flash_attn_with_kvcache(q, k_paged.clone(), v_paged.clone(), k, v, cache_seqlens=lens,
                                               page_table=table, return_lse=True, backend=backend, **kw))
    return results


def _close(got, want):
    (o, lse), (o_ref, lse_ref) = got, want
    torch.testing.assert_close(o.float(), o_ref.float(), atol=2e-2, rtol=2e-2)
    finite = torch.isfinite(lse_ref)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse[finite], lse_ref[finite], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("page_size", [16, 64, 128, 256])
@pytest.mark.parametrize("case", ["decode", "decode-split", "prefill", "append"])
def test_kvcache_reads_pages_in_the_kernel(emulated, page_size, case):
    """With FLASHHOPPER_EXPERIMENTAL_PAGED_TMA=1 and a page size the kernels serve, every launch is the
    paged config (no gathered copy) and the call equals the reference backend: decode rearranged
    (PackGQA, and split-KV whose chunks start mid-row of the item's table), prefill (causal), an append
    across pages."""
    sq, lens, hints, s_new = {"decode": (1, [1, 300, 129], {"num_splits": 1}, 0),
                              "decode-split": (1, [700, 1, 1025], {"num_splits": 0}, 0),
                              "prefill": (70, [200, 70, 333], {}, 0),
                              "append": (5, [10, 250, 0], {}, 5)}[case]
    q, k_paged, v_paged, table, lens_t, new = _paged_case(page_size, sq, lens, s_new=s_new, seed=page_size)
    got, want = _both(q, k_paged, v_paged, table, lens_t, new, causal=True, **hints)
    _close(got, want)
    assert emulated and all(cfg.page_size == page_size for cfg in emulated)
    layout = splitkv.plan_for(q, 2, table.shape[1] * page_size, (-1, -1), hints.get("num_splits", 0), None,
                              False, align=math.lcm(splitkv.CHUNK_ALIGN, page_size))
    assert layout.rearranged == case.startswith("decode")
    if case == "decode-split":
        assert layout.splits > 1 and layout.chunk % page_size == 0


@pytest.mark.parametrize("page_size,why", [(24, "not a size the kernels serve"), (16, "cache_leftpad"),
                                           (16, "not opted in")])
def test_kvcache_gathers_pages_otherwise(emulated, monkeypatch, page_size, why):
    """Other page sizes, cache_leftpad (keys not starting a page) and no opt-in: the pages gathered into a
    contiguous copy first, the unpaged kernel, the same results."""
    q, k_paged, v_paged, table, lens_t, new = _paged_case(page_size, 3, [40, 90], seed=1)
    kw = {}
    if why == "cache_leftpad":
        kw["cache_leftpad"] = torch.tensor([3, 0], dtype=torch.int32)
    if why == "not opted in":
        monkeypatch.delenv(validation.PAGED_TMA_OPT_IN)
        monkeypatch.setattr(validation, "PAGED_TMA_GPU_VERIFIED", False)
    got, want = _both(q, k_paged, v_paged, table, lens_t, new, causal=True, **kw)
    _close(got, want)
    assert emulated and all(cfg.page_size == 0 for cfg in emulated)


def test_forward_varlen_paged_arguments(emulated):
    """runtime.forward_varlen over a paged cache: the flat table and each sequence's first entry reach
    the kernel (default: its table row), cu_seqlens_k refused, a page size the config does not serve
    refused."""
    q, k_paged, v_paged, table, lens_t, _ = _paged_case(16, 2, [20, 33], seed=2)
    k_rows, v_rows = (t.view(-1, *t.shape[2:]) for t in (k_paged, v_paged))
    q_rows = q.reshape(-1, *q.shape[2:])
    cu_q = torch.tensor([0, 2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="no cu_seqlens_k"):
        runtime.forward_varlen(q_rows, k_rows, v_rows, cu_q, cu_q, 2, None, lens_t, 0.1, True, (-1, -1), 0.0,
                               page_table=table, page_size=16)
    with pytest.raises(ValueError, match="not served"):
        runtime.forward_varlen(q_rows, k_rows, v_rows, cu_q, None, 2, None, lens_t, 0.1, True, (-1, -1), 0.0,
                               page_table=table, page_size=24)
    recorded = []
    monkeypatch_kernel = runtime.get_kernel

    def kernel(cfg):
        fn = monkeypatch_kernel(cfg)
        return lambda *args: (recorded.append(args), fn(*args))

    runtime.get_kernel = kernel
    try:
        runtime.forward_varlen(q_rows, k_rows, v_rows, cu_q, None, 2, None, lens_t, 0.1, True, (-1, -1), 0.0,
                               page_table=table, page_size=16)
    finally:
        runtime.get_kernel = monkeypatch_kernel
    args = recorded[0]
    assert args[16].tolist() == [0, table.shape[1]] and args[20].tolist() == table.flatten().tolist()


def test_precompile_builds_the_paged_kernels_when_asked(capsys, monkeypatch):
    """`flashhopper precompile --paged` (or the opt-in) adds plan.paged_kernels to the dispatched set."""
    from flashhopper.cli import main

    monkeypatch.delenv(validation.PAGED_TMA_OPT_IN, raising=False)
    monkeypatch.setattr(validation, "PAGED_TMA_GPU_VERIFIED", False)
    monkeypatch.setattr(validation, "DECODE_SPLIT_GPU_VERIFIED", False)  # (its paged kernels come too)
    counts = []
    for extra in ([], ["--paged"]):
        assert main(["precompile", "--list", "--hdim", "128", "--dtype", "bf16", *extra]) == 0
        counts.append(int(capsys.readouterr().out.strip().splitlines()[-1].split()[0]))
    assert counts[1] - counts[0] == len(plan.paged_kernels(["bf16"], [128])) == 28


def test_precompile_decode_builds_both_tiles_whatever_the_opt_in(capsys, monkeypatch):
    """`flashhopper precompile --decode` builds the split kernels of the varlen tile and of the decode tile
    alike with the decode tile's opt-in set or not (with it set, the varlen tile's were once left out, and a
    GPU suite under the opt-in met split calls with no kernel)."""
    from flashhopper.cli import main

    listed = []
    for opt_in in (None, "1"):
        if opt_in is None:
            monkeypatch.delenv(validation.DECODE_TILE_OPT_IN, raising=False)
        else:
            monkeypatch.setenv(validation.DECODE_TILE_OPT_IN, opt_in)
        assert main(["precompile", "--list", "--decode", "--hdim", "128", "--dtype", "bf16"]) == 0
        listed.append(capsys.readouterr().out.strip().splitlines())
    assert listed[0] == listed[1]
    both = {cfg for tile in (False, True) for cfg in plan.split_kernels(["bf16"], [128], decode_tile=tile)}
    assert len(both) > len(plan.split_kernels(["bf16"], [128], decode_tile=True))
