"""Decode speed: `flash_attn_with_kvcache` over contiguous and paged KV caches against FA4's varlen and
torch SDPA; with `prefill`, chunked prefill through pages against flashhopper's dense kernel.

The points are the KV-cache issue's: batch x context 1 x 8k, 1 x 32k, 1 x 128k, 8 x 32k, 64 x 4k and
128 x 8k; 1 and 4 query tokens; 32 query heads over 8 KV heads at hdim 128, and 32 over 32 at hdim 64.
Each item's cache holds exactly the context (s_cache = cache_seqlens = context) and nothing is
appended (the peers cannot append). Every provider computes the same attention: each query sees the
keys up to its own position, the diagonal aligned bottom-right (one query sees every key). Ours and
FA4 are called with causal=True, as serving engines call them; SDPA, whose is_causal aligns
top-left, gets no mask for one query and a boolean bottom-right mask, built outside the timing, for
more.

The providers:
- flashhopper: flash_attn_with_kvcache(q (b, q_len, hq, d), k_cache, v_cache, cache_seqlens=...).
- flashhopper-page{P} (`pages`, `bench --decode --pages P ...`): the same call over a paged copy of each
  cache, (b * ceil(context / P), P, hk, d) holding the same keys and values, through page_table
  (b, ceil(context / P)) int32, a random permutation of all the pages (torch.randperm from a CPU
  generator seeded 0, a new draw for every cache: shuffled, as a serving engine's table is after some
  churn), cache_seqlens as above: position p of item i is slot p % P of page page_table[i, p // P]. The
  copy and its table are made outside the timing. Where flash_attn_with_kvcache gathers the pages into
  a contiguous copy before the kernels (page sizes they do not read in place, 1 among them; kvcache's
  docstring), that copy is part of the timed call; the row says which ("pages_read": "kernels" or
  "gathered"). Its time over flashhopper's (paged us / contiguous us, so 1.05 is 5% slower) is
  reported per point ("time_over_contiguous") and summarized against the issue's targets at one query
  token (PAGED_TIME_TARGETS).
- fa4: FA4's CuTe DSL `flash_attn_varlen_func` (it has no flash_attn_with_kvcache): q packed as
  (b * q_len, hq, d) with cu_seqlens_q, k / v the caches viewed as (b * s_cache, hk, d) with
  cu_seqlens_k = arange(b + 1) * s_cache and seqused_k = cache_seqlens. Skipped with a note where
  flash_attn.cute does not import.
- sdpa: torch's scaled_dot_product_attention (default backend selection) on q (b, hq, q_len, d) and
  the (b, hk, context, d) views of the caches, GQA through enable_gqa where the installed torch takes
  it, else with the KV heads repeated (repeat_interleave) outside the timing.

Decode is memory-bound, so the measure is the KV bytes one call reads over its time, as a fraction
of the device-to-device copy rate measured in the same run (a `dst.copy_(src)` of 1 GiB timed with
CUDA events, median of several; it moves 2 x 1 GiB, a read and a write). KV bytes per call: batch x
context x heads_k x hdim x 2 (K and V) x 2 bytes (bf16 / fp16); q, the output and a page table are not
counted (the same count for the paged providers).

So that no call is served from the L2 cache (50 MB on an H200), every point allocates N = max(4,
ceil(100 MiB / cache bytes)) independent caches with their own q and walks them in turn. Each
provider's N calls of one walk (one call per cache) are captured in one CUDA graph, after warm-up
calls outside the capture (compilation and allocation happen there), and the graph's replays are
timed with CUDA events (warm-up replays, then the median of several), divided by N. The providers
take turns, round after round; the median over rounds is reported. With `allocations` (`bench --decode
--allocations N`, the speed targets' method) each of the N rounds draws every cache and q anew behind a
spacer of random size (the spacers held, the earlier caches freed: held, N rounds of caches would not
fit), captures again and times each provider once, in an order rotated per round; p10 / p50 / p90 of
each provider's fraction of the copy rate go in the JSON. A provider that fails to capture,
or whose replay disagrees with its eager call, is timed eagerly in the same loop instead and marked
in the table. A point whose N caches would exceed 40 GiB is skipped, with the reason printed.

Memory: each paged provider holds its own paged copy of the N caches with their page tables (and
where its pages are gathered, one cache's K and V more: the copy its graph keeps). These count against
the same 40 GiB (held_bytes): without `allocations` every provider's graph and caches are held for the
whole point, so the paged copies add up; with it, one provider is prepared at a time, so the largest
counts. Paged providers are kept in the order given while they fit; one that does not is left out of
that point with the reason ("left_out"). With pages 1 16 64, of the issue's points only 128 x 8k loses
any: at 32:32 hdim 64 (32 GiB of contiguous caches) all three, at 32:8 hdim 128 (16 GiB) the second and
third without `allocations` (fitting_pages).

Chunked prefill (`prefill`, `bench --decode --prefill`): a chunk of 2048 queries after 8k and 32k
tokens already in the cache, batch 1 and 4, heads 32:8 at hdim 128, causal aligned bottom-right (query i
of the chunk sees the cached tokens and the chunk's first i + 1). The cache holds the cached tokens and
the chunk's own keys and values (written before the call, as engines write them; no append in the
timed call), cache_seqlens = cached + 2048 = every key. Providers: flashhopper-dense, flash_attn_func(q,
k, v, causal=True) on the contiguous keys (b, cached + 2048, hk, d) (flash_attn_func aligns the causal
diagonal bottom-right where seqlen_q != seqlen_k); flashhopper, flash_attn_with_kvcache over the
contiguous cache; flashhopper-page{P}, over a paged copy (pages of 64 tokens, or the `pages` sizes), as
above. Measured exactly as decode (the same rotation, graphs, turns and allocations); reported as us
per call and TFLOP/s, FLOPs = 4 x hdim x heads_q per visible (query, key) pair, the pairs counted
exactly (batch x (2048 x cached + 2048 x 2049 / 2)); and each provider's speed over dense (dense us /
its us, = its TFLOP/s / dense's), the issue's target >= 0.9 for the paged ones (PREFILL_SPEED_TARGET).

Importing this module needs no GPU; the benchmark needs CUDA when it runs.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from flashhopper import validation
from flashhopper.bench import runner
from flashhopper.bench.providers import _quiet
from flashhopper.bench.summary import geomean, peer_text, spread_line, spreads
from flashhopper.bench.varlen import print_disagreements, relative_difference, varlen_flops
from flashhopper.reference import visible_mask

# (batch, context): the points
BATCH_CONTEXTS = ((1, 8192), (1, 32768), (1, 131072), (8, 32768), (64, 4096), (128, 8192))
QUICK_BATCH_CONTEXTS = ((1, 8192), (8, 32768), (64, 4096))
Q_LENS = (1, 4)
QUICK_Q_LENS = (1,)
# (query heads, KV heads, head dim): GQA 32:8 at hdim 128, MHA 32:32 at hdim 64
HEAD_CONFIGS = ((32, 8, 128), (32, 32, 64))
QUICK_HEAD_CONFIGS = ((32, 8, 128),)
ELEMENT_BYTES = 2  # bf16 and fp16
# the caches a point walks hold at least this many bytes together (an H200's L2 holds 50 MB), and
# there are at least MIN_CACHES of them
MIN_ROTATION_BYTES = 100 * 2**20
MIN_CACHES = 4
# a point whose caches would hold more than this is skipped
MAX_ROTATION_BYTES = 40 * 2**30
COPY_BYTES = 2**30
COPY_REPEATS = 10
WARMUP_CALLS = 2  # eager calls per cache before the capture
REPLAY_WARMUP = 3
REPLAYS = 10  # timed replays per provider and round; their median is the round's sample
DEFAULT_ROUNDS = 3
PEERS = ("fa4", "sdpa")
DENSE = "flashhopper-dense"  # prefill's baseline: flash_attn_func on the contiguous keys
# the order in which a provider is picked as the reference the others' outputs are compared with
AGREEMENT_REFERENCES = ("sdpa", "fa4", DENSE, "flashhopper")
# the targets at one query token: paged time / contiguous time at most this, by page size
PAGED_TIME_TARGETS = {64: 1.05, 1: 1.15}
# chunked prefill: a chunk of PREFILL_CHUNK queries after PREFILL_CACHED tokens, batch PREFILL_BATCHES,
# heads PREFILL_HEADS (query heads, KV heads, head dim); pages of PREFILL_PAGE_SIZE without --pages
PREFILL_CHUNK = 2048
PREFILL_CACHED = (8192, 32768)
PREFILL_BATCHES = (1, 4)
PREFILL_HEADS = (32, 8, 128)
PREFILL_PAGE_SIZE = 64
PREFILL_SPEED_TARGET = 0.9  # the issue's: paged prefill at >= 0.9 x the dense kernel's speed
PAGE_TABLE_SEED = 0
INDEX_BYTES = 4  # a page table entry (int32)
# a graph replay's output against the same provider's eager call on the same inputs
GRAPH_TOLERANCE = 1e-3
BYTE_CONVENTION = ("KV bytes per call = batch x context x heads_k x hdim x 2 (K and V) x 2 bytes; the copy "
                   "rate counts 2 x the copied size (a read and a write)")


# --- points, bytes, rotation (no GPU) ---


def kv_bytes(batch: int, context: int, heads_k: int, hdim: int, element_bytes: int = ELEMENT_BYTES) -> int:
    """The K and V bytes one decode call reads: every key and value of every item's context."""
    return batch * context * heads_k * hdim * 2 * element_bytes


def rotation_count(cache_bytes: int) -> int:
    """How many independent caches a point walks: at least MIN_CACHES, and together at least
    MIN_ROTATION_BYTES (100 MiB, over twice an H200's 50 MB L2)."""
    if cache_bytes <= 0:
        raise ValueError(f"cache_bytes must be > 0, got {cache_bytes}")
    return max(MIN_CACHES, -(-MIN_ROTATION_BYTES // cache_bytes))


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class DecodePoint:
    batch: int
    context: int
    q_len: int
    heads_q: int
    heads_k: int
    hdim: int

    @property
    def kv_bytes(self) -> int:
        return kv_bytes(self.batch, self.context, self.heads_k, self.hdim)

    @property
    def caches(self) -> int:
        return rotation_count(self.kv_bytes)

    @property
    def rotation_bytes(self) -> int:
        return self.caches * self.kv_bytes

    @property
    def skip_reason(self) -> str | None:
        """Why the point is not run (its caches would not fit the budget), or None."""
        if self.rotation_bytes <= MAX_ROTATION_BYTES:
            return None
        return (f"{self.caches} caches x {_size(self.kv_bytes)} = {_size(self.rotation_bytes)} > "
                f"{_size(MAX_ROTATION_BYTES)}")

    @property
    def heads_label(self) -> str:
        return f"{self.heads_q}:{self.heads_k}"

    @property
    def label(self) -> str:
        return (f"{self.batch} x {_tokens(self.context)} q{self.q_len} heads {self.heads_label} "
                f"hdim {self.hdim}")


def decode_points(quick: bool = False, hdims=None) -> list[DecodePoint]:
    """The points in table order: head configuration, query length, batch x context. `hdims` keeps
    the head configurations of those head dims (128: 32:8, 64: 32:32); `quick`: 1 x 8k, 8 x 32k and
    64 x 4k, one query token, 32:8 at hdim 128."""
    heads = QUICK_HEAD_CONFIGS if quick else HEAD_CONFIGS
    if hdims:
        heads = [h for h in heads if h[2] in hdims]
    return [DecodePoint(b, ctx, q_len, hq, hk, d)
            for hq, hk, d in heads
            for q_len in (QUICK_Q_LENS if quick else Q_LENS)
            for b, ctx in (QUICK_BATCH_CONTEXTS if quick else BATCH_CONTEXTS)]


def prefill_points(hdims=None) -> list[DecodePoint]:
    """Chunked prefill's points as DecodePoints (q_len: the chunk, context: the cached tokens and the
    chunk): PREFILL_CHUNK queries after each of PREFILL_CACHED tokens, batch PREFILL_BATCHES, heads
    PREFILL_HEADS; none where `hdims` leaves out its head dim."""
    hq, hk, d = PREFILL_HEADS
    if hdims and d not in hdims:
        return []
    return [DecodePoint(b, cached + PREFILL_CHUNK, PREFILL_CHUNK, hq, hk, d)
            for cached in PREFILL_CACHED for b in PREFILL_BATCHES]


def prefill_label(point: DecodePoint) -> str:
    cached = point.context - point.q_len
    return (f"{point.batch} x chunk {_tokens(point.q_len)} after {_tokens(cached)} heads {point.heads_label} "
            f"hdim {point.hdim}")


# --- paged caches: pages, bytes (no GPU) ---


def pages_per_item(context: int, page_size: int) -> int:
    """The pages one item's context takes (a partial last page counts whole)."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    return -(-context // page_size)


def paged_kv_bytes(point: DecodePoint, page_size: int, element_bytes: int = ELEMENT_BYTES) -> int:
    """The K and V of one paged copy of one of the point's caches (whole pages)."""
    pages = point.batch * pages_per_item(point.context, page_size)
    return pages * page_size * point.heads_k * point.hdim * 2 * element_bytes


def paged_bytes(point: DecodePoint, page_size: int) -> int:
    """One paged copy of one of the point's caches: its K and V (paged_kv_bytes) and its int32 page
    table."""
    pages = point.batch * pages_per_item(point.context, page_size)
    return paged_kv_bytes(point, page_size) + pages * INDEX_BYTES


def gathered(page_size: int) -> bool:
    """Whether flash_attn_with_kvcache is taken to gather pages of this size into a contiguous copy
    before the kernels, for the memory budget: the kernels read whole 8-row TMA boxes (FwdConfig.page_size),
    where paged TMA is on (validation.paged_tma_enabled). The run records what each call did
    (pages_read)."""
    return page_size % 8 != 0 or not validation.paged_tma_enabled()


def gather_bytes(point: DecodePoint, page_size: int) -> int:
    """What a gathering paged provider holds beyond its caches: one cache's gathered K and V, the copy its
    graph's memory pool keeps (a capture reuses it from call to call, and torch.cuda.graph empties torch's
    cache, the eager calls' copies, before capturing); 0 where the pages are read in place."""
    return paged_kv_bytes(point, page_size) if gathered(page_size) else 0


def held_bytes(point: DecodePoint, page_sizes, together: bool = True) -> int:
    """The device memory a point's caches take: the N contiguous caches, and for each paged provider its N
    paged copies and its gather's (gather_bytes); `together` (every provider prepared for the whole
    point) adds the paged providers' up, else (one provider prepared at a time: allocations) the largest
    counts."""
    extra = [point.caches * paged_bytes(point, p) + gather_bytes(point, p) for p in page_sizes]
    return point.rotation_bytes + (sum(extra) if together else max(extra, default=0))


def fitting_pages(point: DecodePoint, page_sizes, together: bool = True) -> tuple[list[int], dict]:
    """The page sizes whose paged providers run at `point`, in the order given, each kept while
    held_bytes stays within MAX_ROTATION_BYTES; and {page size: why not} for the others."""
    kept, left_out = [], {}
    for page_size in page_sizes:
        held = held_bytes(point, [*kept, page_size], together)
        if held <= MAX_ROTATION_BYTES:
            kept.append(page_size)
        else:
            left_out[page_size] = (f"its paged caches would not fit: the point would hold {_size(held)} > "
                                   f"{_size(MAX_ROTATION_BYTES)}")
    return kept, left_out


# --- inputs and providers ---


@dataclass
class DecodeInputs:
    """One cache and its query: q (b, q_len, hq, d); k_cache, v_cache (b, s_cache, hk, d); int32
    cache_seqlens (b,), cu_seqlens_q (b + 1,) = arange * q_len, cu_seqlens_k (b + 1,) = arange * s_cache;
    mask: SDPA's bool (q_len, context) attn_mask, True where query i may see key j (j <= i + context -
    q_len: causal, aligned bottom-right), None for one query. All but q and the caches are shared
    between a point's caches."""
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cache_seqlens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    mask: torch.Tensor | None


def decode_inputs(point: DecodePoint, dtype, device, count: int | None = None) -> list[DecodeInputs]:
    """`count` (default point.caches) independent caches with N(0, 1) keys, values and queries."""
    b, s = point.batch, point.context
    arange = torch.arange(b + 1, device=device, dtype=torch.int32)
    shared = {"cache_seqlens": torch.full((b,), point.context, device=device, dtype=torch.int32),
              "cu_seqlens_q": arange * point.q_len, "cu_seqlens_k": arange * s,
              "mask": visible_mask(point.q_len, s, causal=True, device=device) if point.q_len > 1 else None}
    cache = (b, s, point.heads_k, point.hdim)
    return [DecodeInputs(runner.randn((b, point.q_len, point.heads_q, point.hdim), dtype, device),
                         runner.randn(cache, dtype, device), runner.randn(cache, dtype, device), **shared)
            for _ in range(point.caches if count is None else count)]


@dataclass
class PagedCache:
    """A paged copy of a contiguous cache: k_cache, v_cache (num_pages, page_size, hk, d); page_table int32
    (b, pages per item), position p of item i at slot p % page_size of page page_table[i, p // page_size]."""
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor


def shuffled_page_table(batch: int, per_item: int, generator: torch.Generator, device) -> torch.Tensor:
    """int32 (batch, per_item): a random permutation of the batch * per_item pages (torch.randperm from the
    CPU `generator`), item i's j-th page at page_table[i, j]: every page once, scattered over the cache."""
    order = torch.randperm(batch * per_item, generator=generator, dtype=torch.int32)
    return order.view(batch, per_item).to(device)


def _scatter_pages(cache: torch.Tensor, page_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """(num_pages, page_size, hk, d): item i's j-th page_size positions of `cache` (b, s_cache, hk, d) in page
    page_table[i, j]; the slots past s_cache of an item's last page hold zeros."""
    b, s, hk, d = cache.shape
    per_item = page_table.shape[1]
    if per_item * page_size != s:  # a partial last page
        cache = torch.nn.functional.pad(cache, (0, 0, 0, 0, 0, per_item * page_size - s))
    pages = torch.empty(b * per_item, page_size, hk, d, dtype=cache.dtype, device=cache.device)
    return pages.index_copy_(0, page_table.reshape(-1).long(), cache.reshape(b * per_item, page_size, hk, d))


def paged_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, page_size: int,
                generator: torch.Generator) -> PagedCache:
    """The keys and values of the contiguous (b, s_cache, hk, d) caches in pages of `page_size` positions,
    through a shuffled page table (shuffled_page_table: a new draw from `generator`)."""
    b, s = k_cache.shape[:2]
    table = shuffled_page_table(b, pages_per_item(s, page_size), generator, k_cache.device)
    return PagedCache(_scatter_pages(k_cache, table, page_size), _scatter_pages(v_cache, table, page_size),
                      table)


def _no_notes(point: DecodePoint) -> dict:
    return {}


@dataclass
class DecodeProvider:
    name: str
    # (DecodeInputs, DecodePoint) -> zero-argument callable running one call, which returns the
    # output as (b, q_len, hq, d) (views only, no copy)
    make: Callable
    context: Callable[[], contextlib.AbstractContextManager] = field(default=contextlib.nullcontext)
    # how it was run, for the report (SDPA: how GQA reached it)
    info: dict = field(default_factory=dict)
    page_size: int = 0  # > 0: it reads a paged copy of the caches (its memory counts: held_bytes)
    # what its calls at a point did, for the row (a paged provider: how its pages were read)
    notes: Callable[[DecodePoint], dict] = _no_notes


def flashhopper_decode() -> DecodeProvider:
    """flash_attn_with_kvcache with cache_seqlens, no append."""

    def make(x: DecodeInputs, point: DecodePoint):
        from flashhopper.kvcache import flash_attn_with_kvcache

        return lambda: flash_attn_with_kvcache(x.q, x.k_cache, x.v_cache, cache_seqlens=x.cache_seqlens,
                                               causal=True)

    return DecodeProvider("flashhopper", make)


def pages_read(q: torch.Tensor, paged: PagedCache) -> str | None:
    """How flash_attn_with_kvcache reads this call's pages, as its plan decides (kvcache._paged_plan, with
    this module's arguments: causal, no window, softcap, leftpad or hints): "kernels" (through the table,
    in place) or "gathered" (into a contiguous copy first); None where the plan cannot be asked (no GPU)."""
    from flashhopper import kvcache

    try:
        plan = kvcache._paged_plan(q, paged.k_cache, paged.v_cache, paged.page_table, None, (-1, -1), True,
                                   0.0, 0, None, False)
    except Exception:  # a CPU, or a changed private signature: the report says unknown
        return None
    return "gathered" if plan is None else "kernels"


def flashhopper_paged(page_size: int, seed: int = PAGE_TABLE_SEED) -> DecodeProvider:
    """flash_attn_with_kvcache over a paged copy of each cache (paged_cache: the same keys and values, pages
    of `page_size`, a shuffled page table, a new draw for each cache from a generator seeded `seed`), made
    in the maker, outside the timing; cache_seqlens as the contiguous call's, no append."""
    generator = torch.Generator().manual_seed(seed)
    read: dict[DecodePoint, str | None] = {}

    def make(x: DecodeInputs, point: DecodePoint):
        from flashhopper.kvcache import flash_attn_with_kvcache

        paged = paged_cache(x.k_cache, x.v_cache, page_size, generator)
        if point not in read:
            read[point] = pages_read(x.q, paged)
        return lambda: flash_attn_with_kvcache(x.q, paged.k_cache, paged.v_cache,
                                               cache_seqlens=x.cache_seqlens, page_table=paged.page_table,
                                               causal=True)

    info = {"page_size": page_size, "page_table": f"a random permutation of the pages (seed {seed})"}
    return DecodeProvider(f"flashhopper-page{page_size}", make, info=info, page_size=page_size,
                          notes=lambda point: {"pages_read": read.get(point)})


def dense_prefill() -> DecodeProvider:
    """flashhopper's dense kernel, flash_attn_func(q, k, v, causal=True), on the contiguous caches as k, v
    (b, context, hk, d): the queries aligned bottom-right against every key, as the cache calls see them."""

    def make(x: DecodeInputs, point: DecodePoint):
        from flashhopper.interface import flash_attn_func

        return lambda: flash_attn_func(x.q, x.k_cache, x.v_cache, causal=True)

    return DecodeProvider(DENSE, make)


def fa4_decode(out=sys.stdout) -> DecodeProvider | None:
    """FA4's varlen over the caches as packed rows, or None (with a note on `out`) where flash_attn.cute
    is not importable. Called by keyword (its fourth positional parameter is qv); it may return
    (out, lse)."""
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func as fa4
    except Exception as exc:  # absent, or present but broken: either way not a peer in this run
        print(f"(FA4 not measured: flash_attn.cute unavailable: {exc})", file=out, flush=True)
        return None

    def make(x: DecodeInputs, point: DecodePoint):
        b, q_len, hq, d = x.q.shape
        s_cache = x.k_cache.shape[1]
        q = x.q.view(b * q_len, hq, d)
        k = x.k_cache.view(b * s_cache, *x.k_cache.shape[2:])
        v = x.v_cache.view(b * s_cache, *x.v_cache.shape[2:])

        def call():
            o = fa4(q, k, v, cu_seqlens_q=x.cu_seqlens_q, cu_seqlens_k=x.cu_seqlens_k, max_seqlen_q=q_len,
                    max_seqlen_k=s_cache, seqused_k=x.cache_seqlens, causal=True)
            o = o[0] if isinstance(o, tuple) else o
            return o.view(b, q_len, hq, o.shape[-1])

        return call

    return DecodeProvider("fa4", make, _quiet)


def sdpa_takes_enable_gqa() -> bool:
    """Whether the installed torch's scaled_dot_product_attention takes enable_gqa (torch >= 2.5);
    probed with a tiny call on the CPU."""
    q, k = torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 1, 8)
    try:
        torch.nn.functional.scaled_dot_product_attention(q, k, k, enable_gqa=True)
    except TypeError:
        return False
    return True


def sdpa_decode(enable_gqa: bool | None = None) -> DecodeProvider:
    """torch SDPA, default backend selection, on views of the caches; with GQA either enable_gqa
    (`enable_gqa` None: probed) or KV heads repeated in the maker, outside the timing."""
    gqa = sdpa_takes_enable_gqa() if enable_gqa is None else enable_gqa
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def make(x: DecodeInputs, point: DecodePoint):
        q = x.q.transpose(1, 2)
        k, v = (c[:, :point.context].transpose(1, 2) for c in (x.k_cache, x.v_cache))
        extra = {}
        if point.heads_q != point.heads_k:
            if gqa:
                extra["enable_gqa"] = True
            else:
                group = point.heads_q // point.heads_k
                k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
        mask = x.mask
        return lambda: sdpa(q, k, v, attn_mask=mask, **extra).transpose(1, 2)

    return DecodeProvider("sdpa", make, info={"gqa": "enable_gqa" if gqa else "repeat_interleave"})


def decode_providers(out=sys.stdout, pages=()) -> list[DecodeProvider]:
    """flashhopper, a flashhopper-page{P} for each of `pages`, FA4 (where it imports) and SDPA."""
    fa4 = fa4_decode(out)
    paged = [flashhopper_paged(p) for p in pages]
    return [flashhopper_decode(), *paged, *([fa4] if fa4 else []), sdpa_decode()]


def prefill_providers(pages=(PREFILL_PAGE_SIZE,)) -> list[DecodeProvider]:
    """The dense kernel, flash_attn_with_kvcache over the contiguous cache, and over pages of each of
    `pages`."""
    return [dense_prefill(), flashhopper_decode(), *(flashhopper_paged(p) for p in pages)]


# --- timing ---


def copy_rate(nbytes: int = COPY_BYTES, device="cuda", repeats: int = COPY_REPEATS) -> dict:
    """The device-to-device copy rate: `dst.copy_(src)` of `nbytes`, CUDA events, median of `repeats`
    after warm-up; bytes_per_s counts 2 x nbytes per copy (a read and a write)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = runner._time_with_events(lambda: dst.copy_(src), warmup=3, iters=repeats)
    return {"bytes": nbytes, "moved_bytes": 2 * nbytes, "ms": ms, "repeats": repeats,
            "bytes_per_s": 2 * nbytes / (ms * 1e-3)}


def replay_ms(fn: Callable) -> float:
    """Median milliseconds of fn (one walk over a point's caches): CUDA events, REPLAY_WARMUP warm-up
    calls, then the median of REPLAYS."""
    return runner._time_with_events(fn, warmup=REPLAY_WARMUP, iters=REPLAYS)


def warm_up(calls: list[Callable], device) -> list:
    """Each call WARMUP_CALLS times outside any capture (compilation, allocation, backend choice);
    on CUDA on a side stream, as torch's CUDA graph notes advise. Returns the last walk's outputs."""
    cuda = torch.device(device).type == "cuda"
    stream = torch.cuda.Stream() if cuda else None
    if cuda:
        stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
        for _ in range(WARMUP_CALLS):
            outs = [call() for call in calls]
    if cuda:
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
    return outs


def capture(calls: list[Callable]) -> tuple[Callable, list]:
    """One CUDA graph of the calls in order; (its replay, the outputs the capture allocated, which
    each replay rewrites). Replayed once here, so a graph that cannot run fails now."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [call() for call in calls]
    graph.replay()
    torch.cuda.synchronize()
    return graph.replay, outs


@dataclass
class Prepared:
    """A provider ready to time at one point: `walk` runs its calls over every cache once (a graph
    replay, or the eager calls when `graphed` is False, with the reason in `note`); `first` is the
    eager output of the first cache."""
    provider: DecodeProvider
    walk: Callable
    graphed: bool
    first: torch.Tensor
    note: str | None = None


def prepare(provider: DecodeProvider, inputs: list[DecodeInputs], point: DecodePoint, device) -> Prepared:
    """Make the provider's calls, warm them up and capture them; on a failed capture (or a replay
    whose output differs from the eager call's) fall back to the eager calls."""
    with provider.context():
        calls = [provider.make(x, point) for x in inputs]
        first = warm_up(calls, device)[0]
        try:
            walk, outs = capture(calls)
            diff = relative_difference((outs[0],), (first,))
            if diff > GRAPH_TOLERANCE:
                raise RuntimeError(f"the replay's output differs from the eager call's by {diff:.3g}")
        except Exception as exc:  # timed eagerly instead, and marked
            if torch.device(device).type == "cuda":
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize()
            return Prepared(provider, lambda: [call() for call in calls], False, first,
                            f"graph capture failed: {runner._short(exc)}")
    return Prepared(provider, walk, True, first)


def _agreement(firsts: dict) -> dict | None:
    """Each provider's first-cache output against the first of AGREEMENT_REFERENCES measured."""
    reference = next((name for name in AGREEMENT_REFERENCES if name in firsts), None)
    if reference is None or len(firsts) < 2:
        return None
    diffs = {name: relative_difference((out,), (firsts[reference],)) for name, out in firsts.items()
             if name != reference}
    return {"against": reference, "max_rel_diff": diffs}


def _timed_row(point: DecodePoint, providers: list[DecodeProvider], dtype, device, rounds: int,
               allocations: bool) -> tuple[dict, dict]:
    """The row of one point with what every kind of run shares: its shape and memory, and each provider's
    microseconds per call (the median over `rounds`, each round a median of graph replays over the
    point's caches divided by their number, the providers taking turns; min / max of the rounds under
    "spread"; with `allocations` every round on fresh caches: module doc). A provider that fails is
    reported under errors, one timed eagerly under "eager" with the reason, a paged one whose caches
    would not fit under "left_out" (fitting_pages). Returns (row, {provider: [us, one per round]})."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    row = {"batch": point.batch, "context": point.context, "q_len": point.q_len, "heads_q": point.heads_q,
           "heads_k": point.heads_k, "hdim": point.hdim, "kv_bytes": point.kv_bytes, "caches": point.caches,
           "rotation_bytes": point.rotation_bytes, "held_bytes": None,
           "us": {p.name: None for p in providers}, "timing": {}, "eager": {}, "errors": {}, "left_out": {},
           "skipped": point.skip_reason, "rounds": rounds, "spread": {}, "agreement": None,
           **({"allocations": rounds} if allocations else {})}
    if row["skipped"]:
        return row, {}
    paged = {p.page_size: p.name for p in providers if p.page_size}
    kept, left_out = fitting_pages(point, list(paged), together=not allocations)
    row["held_bytes"] = held_bytes(point, kept, together=not allocations)
    row["left_out"] = {paged[size]: why for size, why in left_out.items()}
    running = [p for p in providers if p.name not in row["left_out"]]
    measure = _measure_allocations if allocations else _measure
    samples = measure(row, point, running, dtype, device, rounds)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the caches and graphs are gone: give their memory to the next point's
    return row, samples


def paged_ratios(row: dict, point: DecodePoint, providers: list[DecodeProvider]) -> dict:
    """{paged provider: its page size, its time over contiguous flashhopper's at this point (its us /
    flashhopper's us; None where either is missing) and its notes (pages_read)}."""
    base = row["us"].get("flashhopper")
    ratios = {}
    for p in providers:
        if p.page_size:
            us = row["us"].get(p.name)
            ratio = us / base if us and base else None
            ratios[p.name] = {"page_size": p.page_size, "time_over_contiguous": ratio, **p.notes(point)}
    return ratios


def run_decode_point(point: DecodePoint, providers: list[DecodeProvider], copy_bytes_per_s: float,
                     dtype=torch.bfloat16, device="cuda", rounds: int = DEFAULT_ROUNDS, peers=PEERS,
                     allocations: bool = False) -> dict:
    """Microseconds per call (_timed_row) and fraction of the copy rate of each provider at one point,
    with `allocations` p10 / p50 / p90 of the fractions under "percentiles"; flashhopper over the best
    peer ("ratio"), and each paged provider's time over flashhopper's ("paged": paged_ratios)."""
    row, samples = _timed_row(point, providers, dtype, device, rounds, allocations)

    def fraction(us):
        return point.kv_bytes / (us * 1e-6) / copy_bytes_per_s

    row["fraction"] = {name: fraction(us) if us else None for name, us in row["us"].items()}
    if allocations:
        row["percentiles"] = {name: runner.percentiles([fraction(us) for us in samples[name]])
                              for name in row["us"] if row["us"][name]}
    mine = row["fraction"].get("flashhopper")
    rates = [row["fraction"][name] for name in peers if row["fraction"].get(name)]
    row["ratio"] = mine / max(rates) if mine and rates else None
    row["paged"] = paged_ratios(row, point, providers)
    return row


def prefill_flops(point: DecodePoint) -> float:
    """FLOPs of one chunked prefill call: 4 x hdim x heads_q per visible (query, key) pair (QK^T and PV),
    the pairs of the chunk's causal bottom-right rows counted exactly (bench.varlen.varlen_flops)."""
    return varlen_flops([point.q_len] * point.batch, [point.context] * point.batch, point.heads_q, point.hdim,
                        causal=True)


def run_prefill_point(point: DecodePoint, providers: list[DecodeProvider], dtype=torch.bfloat16,
                      device="cuda", rounds: int = DEFAULT_ROUNDS, allocations: bool = False) -> dict:
    """Microseconds per call (_timed_row) and TFLOP/s (prefill_flops) of each provider at one chunked
    prefill point, with `allocations` p10 / p50 / p90 of the TFLOP/s; each provider's speed over the
    dense kernel's ("speed_over_dense": dense us / its us) and the paged ones' time over contiguous
    flashhopper's ("paged")."""
    row, samples = _timed_row(point, providers, dtype, device, rounds, allocations)
    flops = prefill_flops(point)

    def tflops(us):
        return flops / (us * 1e-6) / 1e12

    row["flops"] = flops
    row["tflops"] = {name: tflops(us) if us else None for name, us in row["us"].items()}
    if allocations:
        row["percentiles"] = {name: runner.percentiles([tflops(us) for us in samples[name]])
                              for name in row["us"] if row["us"][name]}
    dense = row["us"].get(DENSE)
    row["speed_over_dense"] = {name: dense / us if dense and us else None for name, us in row["us"].items()
                               if name != DENSE}
    row["paged"] = paged_ratios(row, point, providers)
    return row


def _measure(row: dict, point: DecodePoint, providers, dtype, device, rounds: int) -> dict:
    """Fill row's us, spread, timing, eager, errors and agreement; returns the samples {provider: [us, one
    per round]}. Everything on the device (the caches, graphs, outputs) lives in this frame and is
    released when it returns."""
    inputs = decode_inputs(point, dtype, device)
    ready: dict[str, Prepared] = {}
    for p in providers:
        try:
            ready[p.name] = prepare(p, inputs, point, device)
        except Exception as exc:  # one provider failing must not lose the rest of the row
            row["errors"][p.name] = runner._short(exc)
    samples = {name: [] for name in ready}
    for _ in range(rounds):
        for name, prep in list(ready.items()):
            try:
                with prep.provider.context():
                    samples[name].append(replay_ms(prep.walk) * 1e3 / point.caches)
            except Exception as exc:
                row["errors"][name] = runner._short(exc)
                del ready[name]
    for name, prep in ready.items():
        row["us"][name] = statistics.median(samples[name])
        row["spread"][name] = [min(samples[name]), max(samples[name])]
        row["timing"][name] = "graph" if prep.graphed else "eager"
        if not prep.graphed:
            row["eager"][name] = prep.note
    row["agreement"] = _agreement({name: prep.first for name, prep in ready.items()})
    return samples


def _measure_allocations(row: dict, point: DecodePoint, providers, dtype, device, rounds: int,
                         seed: int = 0) -> dict:
    """_measure with every round on fresh caches behind a held spacer of random size (module doc), each
    provider prepared (warm-up, capture) and timed once a round, the order rotated per round; returns
    the samples {provider: [us, one per round]}. The agreement is the first round's."""
    draw = random.Random(seed)
    spacers, live = [], list(providers)
    samples = {p.name: [] for p in providers}
    firsts, how = {}, {}
    for i in range(rounds):
        spacers.append(torch.empty(draw.randrange(1, 64) << 20 | draw.randrange(0, 1 << 20, 256),
                                   dtype=torch.uint8, device=device))
        inputs = decode_inputs(point, dtype, device)
        turn = i % max(len(live), 1)
        for p in live[turn:] + live[:turn]:
            try:
                prep = prepare(p, inputs, point, device)
                with p.context():
                    samples[p.name].append(replay_ms(prep.walk) * 1e3 / point.caches)
            except Exception as exc:  # one provider failing must not lose the rest of the row
                row["errors"][p.name] = runner._short(exc)
                live.remove(p)
                samples[p.name] = []
                prep = None  # its caches and graph freed before the next provider's
                continue
            if i == 0:
                firsts[p.name] = prep.first
            if not prep.graphed:  # timed eagerly in any round: marked
                how[p.name] = prep.note
            prep = None
        inputs = None  # freed before the next round's spacer and caches
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
    for p in live:
        name = p.name
        row["us"][name] = statistics.median(samples[name])
        row["spread"][name] = [min(samples[name]), max(samples[name])]
        row["timing"][name] = "eager" if name in how else "graph"
        if name in how:
            row["eager"][name] = how[name]
    row["agreement"] = _agreement({name: out for name, out in firsts.items() if name in row["timing"]})
    del spacers
    return samples


# --- the tables ---


def _short(name: str) -> str:
    """A provider's name in a ratio column's header: fh, page64, dense."""
    return "fh" if name == "flashhopper" else name.removeprefix("flashhopper-")


def _width(name: str) -> int:
    return max(16, len(name) + 4)


def _ratio_width(header: str) -> int:
    return max(9, len(header) + 2)


def _us_cell(row: dict, name: str) -> str:
    us = row["us"].get(name)
    mark = "*" if row["timing"].get(name) == "eager" else " "
    return (f"{us:.1f}{mark}" if us is not None else "- ").rjust(_width(name))


def format_header(names, paged=()) -> str:
    """The decode table's header: the shape, us and fraction per provider, flashhopper over the best peer,
    and for each of the `paged` providers its time over flashhopper's (pageP/fh)."""
    cols = "".join(f"{name + ' us':>{_width(name)}}{'frac':>6}" for name in names)
    shape = f"{'batch':>5} {'context':>7} {'q':>2} {'heads':>6} {'hdim':>4} {'N':>3} {'KV MiB':>8}"
    ratios = "".join(f"{_short(name) + '/fh':>{_ratio_width(_short(name) + '/fh')}}" for name in paged)
    return f"{shape}{cols}{'fh/best':>9}{ratios}"


def format_row(row: dict, names, paged=()) -> str:
    cells = "".join(_us_cell(row, name) + runner._cell(row["fraction"].get(name), 6, "{:.2f}")
                    for name in names)
    heads = f"{row['heads_q']}:{row['heads_k']}"
    shape = (f"{row['batch']:>5} {row['context']:>7} {row['q_len']:>2} {heads:>6} {row['hdim']:>4} "
             f"{row['caches']:>3} {row['kv_bytes'] / 2**20:>8.1f}")
    ratios = "".join(runner._cell((row.get("paged") or {}).get(name, {}).get("time_over_contiguous"),
                                  _ratio_width(_short(name) + "/fh"), "{:.3f}") for name in paged)
    return f"{shape}{cells}{runner._cell(row['ratio'], 9, '{:.2f}')}{ratios}"


def format_prefill_header(names) -> str:
    """The prefill table's header: the shape, us and TFLOP/s per provider, each one's speed over dense."""
    cols = "".join(f"{name + ' us':>{_width(name)}}{'TF/s':>7}" for name in names)
    shape = f"{'batch':>5} {'chunk':>5} {'cached':>6} {'heads':>6} {'hdim':>4} {'N':>3}"
    ratios = "".join(f"{_short(name) + '/dense':>{_ratio_width(_short(name) + '/dense')}}" for name in names
                     if name != DENSE)
    return f"{shape}{cols}{ratios}"


def format_prefill_row(row: dict, names) -> str:
    cells = "".join(_us_cell(row, name) + runner._cell(row["tflops"].get(name), 7, "{:.0f}")
                    for name in names)
    heads = f"{row['heads_q']}:{row['heads_k']}"
    cached = _tokens(row["context"] - row["q_len"])
    shape = f"{row['batch']:>5} {row['q_len']:>5} {cached:>6} {heads:>6} {row['hdim']:>4} {row['caches']:>3}"
    ratios = "".join(runner._cell(row["speed_over_dense"].get(name), _ratio_width(_short(name) + "/dense"),
                                  "{:.3f}") for name in names if name != DENSE)
    return f"{shape}{cells}{ratios}"


def _point(row: dict) -> DecodePoint:
    return DecodePoint(*(row[k] for k in ("batch", "context", "q_len", "heads_q", "heads_k", "hdim")))


def describe(row: dict) -> str:
    return _point(row).label


def print_notes(row: dict, out) -> None:
    """The lines under a table row: why it was skipped, providers left out, timed eagerly or failed, and
    outputs that disagree."""
    if row["skipped"]:
        print(f"    skipped: its caches would not fit: {row['skipped']}", file=out, flush=True)
    for name, message in {**row["left_out"], **row["eager"], **row["errors"]}.items():
        print(f"    {name}: {message}", file=out, flush=True)
    print_disagreements(row, out)


def summarize(rows: list[dict], peers=PEERS) -> dict:
    """geomean and minimum of flashhopper / best peer (fractions of the copy rate), our fraction's
    range, the paged providers' time over contiguous (paged_summary), and with allocations the spread
    check (bench.summary.spreads)."""
    rated = [r for r in rows if r.get("ratio")]
    ours = [r["fraction"]["flashhopper"] for r in rows if r["fraction"].get("flashhopper")]
    summary: dict = {"points": len(rows), "points_run": sum(1 for r in rows if not r["skipped"]),
                     "points_with_ratio": len(rated), "geomean_ratio": None, "min_ratio": None,
                     "min_point": None, "flashhopper_fraction": [min(ours), max(ours)] if ours else None}
    if rated:
        lowest = min(rated, key=lambda r: r["ratio"])
        summary.update(geomean_ratio=geomean(r["ratio"] for r in rated), min_ratio=lowest["ratio"],
                       min_point=describe(lowest))
    if any(r.get("paged") for r in rows):
        summary["paged"] = paged_summary(rows)
    if any("percentiles" in r for r in rows):
        summary["spread"] = spreads(rows, peers, where=lambda row: {"point": describe(row)})
    return summary


def _paged_entries(rows: list[dict], name: str) -> list[tuple[dict, dict]]:
    """(row, the row's paged entry for `name`) over the rows that have one."""
    return [(r, r["paged"][name]) for r in rows if name in (r.get("paged") or {})]


def paged_summary(rows: list[dict]) -> dict:
    """Per paged provider: geomean and largest time over contiguous over the points that have it (and
    where); at one query token the largest against the issue's target for its page size
    (PAGED_TIME_TARGETS; met: at most the target); how its pages were read (pages_read, where known)."""
    names = dict.fromkeys(name for r in rows for name in r.get("paged") or {})
    found = {}
    for name in names:
        entries = _paged_entries(rows, name)
        rated = [(r, e["time_over_contiguous"]) for r, e in entries if e["time_over_contiguous"]]
        page_size = entries[0][1]["page_size"]
        read = sorted({e.get("pages_read") or "unknown" for _, e in entries})
        found[name] = {"page_size": page_size, "points_with_ratio": len(rated), "geomean": None, "max": None,
                       "max_point": None, "target": PAGED_TIME_TARGETS.get(page_size), "q1_max": None,
                       "met": None, "pages_read": read}
        if rated:
            worst = max(rated, key=lambda pair: pair[1])
            found[name].update(geomean=geomean(ratio for _, ratio in rated), max=worst[1],
                               max_point=describe(worst[0]))
        single = [ratio for r, ratio in rated if r["q_len"] == 1]
        if single:
            found[name]["q1_max"] = max(single)
            if found[name]["target"]:
                found[name]["met"] = max(single) <= found[name]["target"]
    return found


def _paged_line(name: str, entry: dict) -> str:
    if entry["max"] is None:
        return f"{name}: no point has its time over flashhopper's"
    line = (f"{name} / flashhopper time: geomean {entry['geomean']:.3f} over {entry['points_with_ratio']} "
            f"points, at most {entry['max']:.3f} at {entry['max_point']}")
    if entry["q1_max"] is not None:
        line += f"; one query token: at most {entry['q1_max']:.3f}"
        if entry["target"]:
            line += f" (target <= {entry['target']:.2f}: {'met' if entry['met'] else 'NOT met'})"
    return f"{line}; pages read: {', '.join(entry['pages_read'])}"


def format_summary(summary: dict, peers=PEERS) -> list[str]:
    lines = []
    if summary["geomean_ratio"] is None:
        lines.append(f"no point has a flashhopper / {peer_text(peers)} ratio (peers not measured)")
    else:
        lines += [f"geomean flashhopper / {peer_text(peers)}: {summary['geomean_ratio']:.3f} over "
                  f"{summary['points_with_ratio']} of {summary['points']} points",
                  f"lowest: {summary['min_ratio']:.3f} at {summary['min_point']}"]
    if summary["flashhopper_fraction"]:
        low, high = summary["flashhopper_fraction"]
        lines.append(f"flashhopper reads its KV at {low:.2f} to {high:.2f} of the copy rate")
    lines += [_paged_line(name, entry) for name, entry in (summary.get("paged") or {}).items()]
    if line := spread_line(summary.get("spread"), lambda w: w["point"]):
        lines.append(line)
    return lines


def prefill_summary(rows: list[dict]) -> dict:
    """Per provider other than the dense kernel: geomean and lowest speed over dense over the points that
    have it (and where); the paged ones against the issue's PREFILL_SPEED_TARGET (met: the lowest at
    least the target)."""
    names = dict.fromkeys(name for r in rows for name in r["speed_over_dense"])
    found = {}
    for name in names:
        rated = [(r, r["speed_over_dense"][name]) for r in rows if r["speed_over_dense"].get(name)]
        paged = any(name in (r.get("paged") or {}) for r in rows)
        entry = {"points_with_ratio": len(rated), "geomean": None, "min": None, "min_point": None,
                 "target": PREFILL_SPEED_TARGET if paged else None, "met": None}
        if rated:
            lowest = min(rated, key=lambda pair: pair[1])
            entry.update(geomean=geomean(ratio for _, ratio in rated), min=lowest[1],
                         min_point=prefill_label(_point(lowest[0])))
            if paged:
                entry["met"] = lowest[1] >= PREFILL_SPEED_TARGET
        found[name] = entry
    return found


def format_prefill_summary(summary: dict) -> list[str]:
    lines = []
    for name, entry in summary.items():
        if entry["min"] is None:
            lines.append(f"{name}: no point has its speed over {DENSE}'s")
            continue
        line = (f"{name} / {DENSE} speed: geomean {entry['geomean']:.3f} over {entry['points_with_ratio']} "
                f"points, lowest {entry['min']:.3f} at {entry['min_point']}")
        if entry["target"]:
            line += f" (target >= {entry['target']:.2f}: {'met' if entry['met'] else 'NOT met'})"
        lines.append(line)
    return lines


def _print(text: str, out) -> None:
    print(text, file=out, flush=True)


def _print_provider_info(providers: list[DecodeProvider], out) -> None:
    for p in providers:
        if p.info:
            _print(f"{p.name}: {', '.join(f'{k} {v}' for k, v in p.info.items())}", out)


def run_prefill(points: list[DecodePoint], providers: list[DecodeProvider], dtype: str = "bf16",
                out=sys.stdout, rounds: int = DEFAULT_ROUNDS, allocations: bool = False) -> dict:
    """Time the chunked prefill points (run_prefill_point); print their table and summary; return the
    report's "prefill" part (providers, FLOP convention, rows, summary)."""
    names = [p.name for p in providers]
    _print(f"chunked prefill: a chunk of queries after the cached tokens, causal bottom-right; us "
           f"per call and TFLOP/s (FLOPs = 4 x hdim x heads_q per visible (query, key) pair, counted "
           f"exactly); measured as decode (N caches, graphs, turns); X/dense = {DENSE} us / X us (speed over "
           f"the dense kernel, target >= {PREFILL_SPEED_TARGET} for the paged ones)", out)
    _print_provider_info([p for p in providers if p.page_size], out)
    _print(format_prefill_header(names), out)
    rows = []
    for point in points:
        row = run_prefill_point(point, providers, runner.DTYPES[dtype], rounds=rounds,
                                allocations=allocations)
        rows.append(row)
        _print(format_prefill_row(row, names), out)
        print_notes(row, out)
    summary = prefill_summary(rows)
    for line in format_prefill_summary(summary):
        _print(line, out)
    return {"providers": names, "chunk": PREFILL_CHUNK, "dense": DENSE,
            "flop_convention": "4 x hdim x heads_q per visible (query, key) pair (QK^T and PV)",
            "speed_over_dense": f"{DENSE} us / provider us", "results": rows, "summary": summary}


def _decode_legend(rounds: int, allocations: bool, paged: list[str]) -> str:
    legend = (f"decode over KV caches: us per call, and frac = KV bytes per call / time / copy rate "
              f"(KV bytes = batch x context x heads_k x hdim x 2 (K, V) x 2 B); each point walks N caches, "
              f"{_size(MIN_ROTATION_BYTES)} or more together, one CUDA graph per provider for the N calls, "
              f"timed as the median of {REPLAYS} replays / N, the median of {rounds} round(s) reported"
              f"{' (each on fresh caches: --allocations)' if allocations else ''}; * = timed "
              f"eagerly (no graph); fh/best = flashhopper / {peer_text(PEERS)}")
    if paged:
        legend += ("; pageP/fh = flashhopper-pageP us / flashhopper us (paged time over contiguous, 1.05 = "
                   "5% slower; targets at one query token: "
                   + ", ".join(f"<= {t} at page {p}" for p, t in PAGED_TIME_TARGETS.items()) + ")")
    return legend


def run_decode_bench(points: list[DecodePoint], dtype: str = "bf16", json_path: str | None = None,
                     providers: list[DecodeProvider] | None = None, out=sys.stdout,
                     rounds: int = DEFAULT_ROUNDS, allocations: bool = False, pages=(), prefill=(),
                     prefill_with: list[DecodeProvider] | None = None) -> dict:
    """Measure the copy rate, then time every provider at every point; print one table line per point
    and the summary; with `prefill` (points: prefill_points) the chunked prefill table after it (its
    providers `prefill_with`, default prefill_providers over `pages` or PREFILL_PAGE_SIZE); with
    `json_path` write the report (rows, copy rate, summary, "prefill")."""
    providers = providers if providers is not None else decode_providers(out, pages=pages)
    names = [p.name for p in providers]
    paged = [p.name for p in providers if p.page_size]
    copy = copy_rate()
    report = {
        "benchmark": "decode", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "dtype": dtype, "copy": copy, "byte_convention": BYTE_CONVENTION,
        "rotation": {"min_bytes": MIN_ROTATION_BYTES, "min_caches": MIN_CACHES,
                     "max_bytes": MAX_ROTATION_BYTES},
        "timing": {"warmup_calls": WARMUP_CALLS, "replay_warmup": REPLAY_WARMUP, "replays": REPLAYS},
        "providers": names, "peers": list(PEERS),
        "provider_info": {p.name: p.info for p in providers if p.info},
        "paged": {"providers": paged, "time_over_contiguous": "paged us / flashhopper us",
                  "targets_at_one_query": {str(p): t for p, t in PAGED_TIME_TARGETS.items()}},
        "rounds": rounds, "results": [], **({"allocations": rounds} if allocations else {}),
    }
    _print(f"{report['device']}, torch {report['torch']}, {dtype}; device-to-device copy of "
           f"{_size(copy['bytes'])}: {copy['bytes_per_s'] / 1e12:.2f} TB/s (2 x {_size(copy['bytes'])} moved "
           f"per copy: read + write; median of {copy['repeats']})", out)
    _print(_decode_legend(rounds, allocations, paged), out)
    _print_provider_info(providers, out)
    _print(format_header(names, paged), out)
    for point in points:
        row = run_decode_point(point, providers, copy["bytes_per_s"], runner.DTYPES[dtype], rounds=rounds,
                               allocations=allocations)
        report["results"].append(row)
        _print(format_row(row, names, paged), out)
        print_notes(row, out)
    report["summary"] = summarize(report["results"])
    for line in format_summary(report["summary"]):
        _print(line, out)
    if prefill:
        if prefill_with is None:
            prefill_with = prefill_providers(tuple(pages) or (PREFILL_PAGE_SIZE,))
        report["prefill"] = run_prefill(list(prefill), prefill_with, dtype, out, rounds, allocations)
    runner.write_json(report, json_path, out)
    return report
