"""Decode speed: `flash_attn_with_kvcache` over contiguous KV caches against FA4's varlen and torch SDPA.

The points are the KV-cache issue's: batch x context 1 x 8k, 1 x 32k, 1 x 128k, 8 x 32k, 64 x 4k and
128 x 8k; 1 and 4 query tokens; 32 query heads over 8 KV heads at hdim 128, and 32 over 32 at hdim 64.
Each item's cache holds exactly the context (s_cache = cache_seqlens = context) and nothing is
appended (the peers cannot append). Every provider computes the same attention: each query sees the
keys up to its own position, the diagonal aligned bottom-right (one query sees every key). Ours and
FA4 are called with causal=True, as serving engines call them; SDPA, whose is_causal aligns
top-left, gets no mask for one query and a boolean bottom-right mask, built outside the timing, for
more. Contiguous caches only: flashhopper has no paged cache yet.

The providers:
- flashhopper: flash_attn_with_kvcache(q (b, q_len, hq, d), k_cache, v_cache, cache_seqlens=...).
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
context x heads_k x hdim x 2 (K and V) x 2 bytes (bf16 / fp16); q and the output are not counted.

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

from flashhopper.bench import runner
from flashhopper.bench.providers import _quiet
from flashhopper.bench.summary import geomean, peer_text, spread_line, spreads
from flashhopper.bench.varlen import print_disagreements, relative_difference
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
# the order in which a provider is picked as the reference the others' outputs are compared with
AGREEMENT_REFERENCES = ("sdpa", "fa4", "flashhopper")
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
class DecodeProvider:
    name: str
    # (DecodeInputs, DecodePoint) -> zero-argument callable running one call, which returns the
    # output as (b, q_len, hq, d) (views only, no copy)
    make: Callable
    context: Callable[[], contextlib.AbstractContextManager] = field(default=contextlib.nullcontext)
    # how it was run, for the report (SDPA: how GQA reached it)
    info: dict = field(default_factory=dict)


def flashhopper_decode() -> DecodeProvider:
    """flash_attn_with_kvcache with cache_seqlens, no append."""

    def make(x: DecodeInputs, point: DecodePoint):
        from flashhopper.kvcache import flash_attn_with_kvcache

        return lambda: flash_attn_with_kvcache(x.q, x.k_cache, x.v_cache, cache_seqlens=x.cache_seqlens,
                                               causal=True)

    return DecodeProvider("flashhopper", make)


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


def decode_providers(out=sys.stdout) -> list[DecodeProvider]:
    fa4 = fa4_decode(out)
    return [flashhopper_decode(), *([fa4] if fa4 else []), sdpa_decode()]


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


def run_decode_point(point: DecodePoint, providers: list[DecodeProvider], copy_bytes_per_s: float,
                     dtype=torch.bfloat16, device="cuda", rounds: int = DEFAULT_ROUNDS, peers=PEERS,
                     allocations: bool = False) -> dict:
    """Microseconds per call and fraction of the copy rate of each provider at one point: the median
    over `rounds`, each round a median of graph replays over the point's caches divided by their
    number, the providers taking turns (min / max of the rounds under "spread"); with `allocations`
    every round on fresh caches (module doc), p10 / p50 / p90 of the fractions under "percentiles". A
    provider that fails is reported under errors; one timed eagerly under "eager" with the reason."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    row = {"batch": point.batch, "context": point.context, "q_len": point.q_len, "heads_q": point.heads_q,
           "heads_k": point.heads_k, "hdim": point.hdim, "kv_bytes": point.kv_bytes, "caches": point.caches,
           "rotation_bytes": point.rotation_bytes, "us": {p.name: None for p in providers},
           "fraction": {p.name: None for p in providers}, "ratio": None, "timing": {}, "eager": {},
           "errors": {}, "skipped": point.skip_reason, "rounds": rounds, "spread": {}, "agreement": None}
    if allocations:
        row.update(allocations=rounds, percentiles={})
    if row["skipped"]:
        return row
    measure = _measure_allocations if allocations else _measure
    samples = measure(row, point, providers, dtype, device, rounds)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the caches and graphs are gone: give their memory to the next point's
    for name, us in row["us"].items():
        if us:
            row["fraction"][name] = point.kv_bytes / (us * 1e-6) / copy_bytes_per_s
    if allocations:
        row["percentiles"] = {name: runner.percentiles([point.kv_bytes / (us * 1e-6) / copy_bytes_per_s
                                                        for us in samples[name]])
                              for name in row["us"] if row["us"][name]}
    mine = row["fraction"].get("flashhopper")
    rates = [row["fraction"][name] for name in peers if row["fraction"].get(name)]
    row["ratio"] = mine / max(rates) if mine and rates else None
    return row


def _measure(row: dict, point: DecodePoint, providers, dtype, device, rounds: int) -> None:
    """Fill row's us, spread, timing, eager, errors and agreement. Everything on the device (the
    caches, graphs, outputs) lives in this frame and is released when it returns."""
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


# --- the table ---


def format_header(names) -> str:
    cols = "".join(f"{name + ' us':>16}{'frac':>6}" for name in names)
    shape = f"{'batch':>5} {'context':>7} {'q':>2} {'heads':>6} {'hdim':>4} {'N':>3} {'KV MiB':>8}"
    return f"{shape}{cols}{'fh/best':>9}"


def format_row(row: dict, names) -> str:
    cells = ""
    for name in names:
        us, frac = row["us"].get(name), row["fraction"].get(name)
        mark = "*" if row["timing"].get(name) == "eager" else " "
        cells += (f"{us:.1f}{mark}" if us is not None else "- ").rjust(16) + runner._cell(frac, 6, "{:.2f}")
    heads = f"{row['heads_q']}:{row['heads_k']}"
    shape = (f"{row['batch']:>5} {row['context']:>7} {row['q_len']:>2} {heads:>6} {row['hdim']:>4} "
             f"{row['caches']:>3} {row['kv_bytes'] / 2**20:>8.1f}")
    return f"{shape}{cells}{runner._cell(row['ratio'], 9, '{:.2f}')}"


def describe(row: dict) -> str:
    keys = ("batch", "context", "q_len", "heads_q", "heads_k", "hdim")
    return DecodePoint(*(row[k] for k in keys)).label


def summarize(rows: list[dict], peers=PEERS) -> dict:
    """geomean and minimum of flashhopper / best peer (fractions of the copy rate), our fraction's
    range, and with allocations the spread check (bench.summary.spreads)."""
    rated = [r for r in rows if r.get("ratio")]
    ours = [r["fraction"]["flashhopper"] for r in rows if r["fraction"].get("flashhopper")]
    summary: dict = {"points": len(rows), "points_run": sum(1 for r in rows if not r["skipped"]),
                     "points_with_ratio": len(rated), "geomean_ratio": None, "min_ratio": None,
                     "min_point": None, "flashhopper_fraction": [min(ours), max(ours)] if ours else None}
    if rated:
        lowest = min(rated, key=lambda r: r["ratio"])
        summary.update(geomean_ratio=geomean(r["ratio"] for r in rated), min_ratio=lowest["ratio"],
                       min_point=describe(lowest))
    if any("percentiles" in r for r in rows):
        summary["spread"] = spreads(rows, peers, where=lambda row: {"point": describe(row)})
    return summary


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
    if line := spread_line(summary.get("spread"), lambda w: w["point"]):
        lines.append(line)
    return lines


def run_decode_bench(points: list[DecodePoint], dtype: str = "bf16", json_path: str | None = None,
                     providers: list[DecodeProvider] | None = None, out=sys.stdout,
                     rounds: int = DEFAULT_ROUNDS, allocations: bool = False) -> dict:
    """Measure the copy rate, then time every provider at every point; print one table line per point
    and the geomean of the ratios; with `json_path` write the report (rows, copy rate, summary)."""
    providers = providers if providers is not None else decode_providers(out)
    names = [p.name for p in providers]
    copy = copy_rate()
    report = {
        "benchmark": "decode", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "dtype": dtype, "copy": copy, "byte_convention": BYTE_CONVENTION,
        "rotation": {"min_bytes": MIN_ROTATION_BYTES, "min_caches": MIN_CACHES,
                     "max_bytes": MAX_ROTATION_BYTES},
        "timing": {"warmup_calls": WARMUP_CALLS, "replay_warmup": REPLAY_WARMUP, "replays": REPLAYS},
        "providers": names, "peers": list(PEERS),
        "provider_info": {p.name: p.info for p in providers if p.info},
        "rounds": rounds, "results": [], **({"allocations": rounds} if allocations else {}),
    }
    print(f"{report['device']}, torch {report['torch']}, {dtype}; device-to-device copy of "
          f"{_size(copy['bytes'])}: {copy['bytes_per_s'] / 1e12:.2f} TB/s (2 x {_size(copy['bytes'])} moved "
          f"per copy: read + write; median of {copy['repeats']})", file=out, flush=True)
    print(f"decode over contiguous KV caches: us per call, and frac = KV bytes per call / time / copy rate "
          f"(KV bytes = batch x context x heads_k x hdim x 2 (K, V) x 2 B); each point walks N caches, "
          f"{_size(MIN_ROTATION_BYTES)} or more together, one CUDA graph per provider for the N calls, timed "
          f"as the median of {REPLAYS} replays / N, the median of {rounds} round(s) reported"
          f"{' (each on fresh caches: --allocations)' if allocations else ''}; * = timed "
          f"eagerly (no graph); fh/best = flashhopper / {peer_text(PEERS)}", file=out, flush=True)
    for name, info in report["provider_info"].items():
        print(f"{name}: {', '.join(f'{k} {v}' for k, v in info.items())}", file=out, flush=True)
    print(format_header(names), file=out, flush=True)
    for point in points:
        row = run_decode_point(point, providers, copy["bytes_per_s"], runner.DTYPES[dtype], rounds=rounds,
                               allocations=allocations)
        report["results"].append(row)
        print(format_row(row, names), file=out, flush=True)
        if row["skipped"]:
            print(f"    skipped: its caches would not fit: {row['skipped']}", file=out, flush=True)
        for name, message in {**row["eager"], **row["errors"]}.items():
            print(f"    {name}: {message}", file=out, flush=True)
        print_disagreements(row, out)
    report["summary"] = summarize(report["results"])
    for line in format_summary(report["summary"]):
        print(line, file=out, flush=True)
    runner.write_json(report, json_path, out)
    return report
