"""Varlen speed: `flash_attn_varlen_func` on packed sequences against FA4's and FA2's varlen.

The packings are targets.md's serving shapes, self-attention documents packed along the token
dimension (q and k share cu_seqlens): 16 documents of 100-4000 tokens and 512 documents of 16-512
tokens, lengths drawn by torch.randint (upper bound excluded) from a CPU torch.Generator seeded 0,
so every machine packs the same lengths (26,704 and 135,022 tokens, the totals targets.md records);
and 16 documents of 1024 tokens, where flashhopper's dense kernel on the same tensors viewed as
(16, 1024, heads, d) is timed too (fh-dense): the varlen kernel's cost over the dense one's (fh/dense).
Head dims 64, 128, 256 and (192, 128), 16 heads; forward and backward (the backward alone, its
forward run outside the timing).

FLOPs are the same count for every provider: each document's visible (query, key) pairs counted
exactly (causal: L (L + 1) / 2 for a document of L tokens, where targets.md's dense grid halves
L^2), times 2 (d + dv) per head (4 d with dv = d); the backward counts 2.5 x the forward.

Timing follows runner.py: runner.time_ms (CUDA events, warm-up, median of repeats), every provider
of a point timed in the same run, taking turns; each round allocates fresh inputs (all rounds' kept
to the end of the point, so each lands at new addresses) and the median over rounds is reported, with
p10 / p50 / p90 in the JSON (`bench --varlen --allocations N`: N rounds, the speed targets' method).
The ratio is flashhopper over the best of FA2 and FA4.

Importing this module needs no GPU; the benchmark needs CUDA when it runs.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from flashhopper.bench import runner
from flashhopper.bench.providers import _quiet
from flashhopper.bench.summary import geomean, peer_text

HEADS = 16
# (query / key head dim, value head dim)
HDIMS = ((64, 64), (128, 128), (256, 256), (192, 128))
QUICK_HDIMS = ((128, 128),)
# name: (documents, shortest, longest + 1) for torch.randint
PACKINGS = {"16x100-4000": (16, 100, 4000), "512x16-512": (512, 16, 512), "16x1024": (16, 1024, 1025)}
QUICK_PACKINGS = ("16x100-4000",)
SEED = 0
PEERS = ("fa2", "fa4")
DENSE = "fh-dense"  # flashhopper's dense kernel, on equal documents only
BWD_FLOP_FACTOR = 2.5
DEFAULT_ROUNDS = 3
# a provider whose result differs from the reference provider's by more than this fraction of the
# reference's largest magnitude is flagged in the table (bf16 rounding stays well below it)
AGREEMENT_TOLERANCE = 0.05
FLOP_CONVENTION = ("forward: sum over documents of visible (query, key) pairs x 2 (d + dv) x heads, pairs "
                   "counted exactly (causal: bottom-right aligned, L (L + 1) / 2 for L = lq = lk); "
                   "backward: 2.5 x forward")


# --- packings and FLOPs (no GPU) ---


@dataclass(frozen=True)
class Packing:
    name: str
    seqlens: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.seqlens)

    @property
    def max_seqlen(self) -> int:
        return max(self.seqlens)

    @property
    def equal(self) -> bool:
        """Every document as long as the others: the packed tensors are a dense batch's too."""
        return len(set(self.seqlens)) == 1

    def cu_seqlens(self, device="cpu") -> torch.Tensor:
        """int32 (documents + 1,): 0, then the running total of the lengths; built on the CPU."""
        cu = torch.zeros(len(self.seqlens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(self.seqlens, dtype=torch.int64).cumsum(0).to(torch.int32)
        return cu.to(device)

    def describe(self) -> dict:
        return {"documents": len(self.seqlens), "tokens": self.total, "max_seqlen": self.max_seqlen,
                "seqlens": list(self.seqlens)}


def make_packing(name: str, documents: int, shortest: int, end: int, seed: int = SEED) -> Packing:
    """`documents` lengths from torch.randint(shortest, end) (end excluded) with a CPU generator
    seeded `seed`: the same lengths on every machine, and the global RNG is neither used nor moved."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    lengths = torch.randint(shortest, end, (documents,), generator=generator)
    return Packing(name, tuple(int(n) for n in lengths))


def packings(names=tuple(PACKINGS)) -> list[Packing]:
    return [make_packing(name, *PACKINGS[name]) for name in names]


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """(query, key) pairs a sequence attends to. Causal aligns the diagonal bottom-right: query i sees
    keys j <= i + seqlen_k - seqlen_q, clipped to [0, seqlen_k)."""
    if seqlen_q <= 0 or seqlen_k <= 0:
        return 0
    if not causal:
        return seqlen_q * seqlen_k
    # query i sees i + seqlen_k - seqlen_q + 1 keys, at most seqlen_k (reached by the last query only)
    # and none before query seqlen_q - seqlen_k: an arithmetic series from `first` up to seqlen_k
    start = max(0, seqlen_q - seqlen_k)
    first = start + seqlen_k - seqlen_q + 1
    return (seqlen_q - start) * (first + seqlen_k) // 2


def varlen_flops(seqlens_q, seqlens_k, heads: int, hdim: int, hdim_v: int | None = None,
                 causal: bool = False, backward: bool = False) -> float:
    """FLOPs of one call: 2 (hdim + hdim_v) per visible pair and head (QK^T and PV, 2 FLOPs a
    multiply-add), summed over the sequences; the backward counts 2.5 x the forward."""
    hdim_v = hdim if hdim_v is None else hdim_v
    pairs = sum(visible_pairs(lq, lk, causal) for lq, lk in zip(seqlens_q, seqlens_k, strict=True))
    flops = 2.0 * pairs * (hdim + hdim_v) * heads
    return flops * BWD_FLOP_FACTOR if backward else flops


@dataclass(frozen=True)
class VarlenPoint:
    packing: Packing
    hdim: int
    hdim_v: int
    causal: bool
    backward: bool
    heads: int = HEADS

    @property
    def flops(self) -> float:
        seqlens = self.packing.seqlens
        return varlen_flops(seqlens, seqlens, self.heads, self.hdim, self.hdim_v, self.causal, self.backward)

    @property
    def split(self) -> bool:
        return self.hdim_v != self.hdim

    @property
    def hdim_label(self) -> str:
        return f"{self.hdim}/{self.hdim_v}" if self.split else str(self.hdim)

    @property
    def direction(self) -> str:
        return "bwd" if self.backward else "fwd"

    @property
    def label(self) -> str:
        return (f"{self.packing.name} hdim {self.hdim_label} {'causal' if self.causal else 'non-causal'} "
                f"{self.direction}")


def varlen_points(quick: bool = False, hdims=None, causal=(False, True),
                  backward=(False, True)) -> list[VarlenPoint]:
    """The points in table order: packing, head dims, causal, forward then backward. `hdims` picks
    by the query head dim (192 is (192, 128)); default all, or hdim 128 with `quick` (which also
    keeps the first packing only)."""
    chosen = QUICK_HDIMS if quick else HDIMS
    if hdims:
        chosen = [pair for pair in HDIMS if pair[0] in hdims]
    return [VarlenPoint(packing, d, dv, c, b)
            for packing in packings(QUICK_PACKINGS if quick else tuple(PACKINGS))
            for d, dv in chosen for c in causal for b in backward]


# --- providers ---


@dataclass
class Packed:
    """One round's inputs: q, k (total, heads, hdim), v and dout (total, heads, hdim_v; dout only for a
    backward), the packing's cu_seqlens (int32, on the inputs' device) and its longest length."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor | None
    cu_seqlens: torch.Tensor
    max_seqlen: int


@dataclass
class VarlenProvider:
    name: str
    # (Packed, causal) -> zero-argument callable that runs one forward
    make: Callable
    # (Packed, causal) -> zero-argument callable that runs one backward (the maker runs the forward,
    # outside the timing); None: no backward to time
    make_bwd: Callable | None = None
    context: Callable[[], contextlib.AbstractContextManager] = field(default=contextlib.nullcontext)
    # takes a value head dim other than the query's
    split_hdims: bool = True
    # takes only documents of one length (a dense kernel on the packed tensors viewed as a batch)
    equal_only: bool = False

    def timed_call(self, x: Packed, causal: bool, backward: bool) -> Callable:
        if not backward:
            return self.make(x, causal)
        if self.make_bwd is None:
            raise NotImplementedError(f"{self.name} has no backward to time")
        return self.make_bwd(x, causal)


def differentiable_varlen(name: str, attn: Callable, context=contextlib.nullcontext,
                          split_hdims: bool = True, equal_only: bool = False) -> VarlenProvider:
    """A provider from `attn(q, k, v, cu_seqlens, max_seqlen, causal) -> out or (out, ...)`; its
    backward runs the forward once on fresh leaves that require grad (the round's tensors are left
    as they are) and times torch.autograd.grad alone."""

    def make(x: Packed, causal):
        return lambda: attn(x.q, x.k, x.v, x.cu_seqlens, x.max_seqlen, causal)

    def make_bwd(x: Packed, causal):
        q, k, v = (t.detach().requires_grad_() for t in (x.q, x.k, x.v))
        out = attn(q, k, v, x.cu_seqlens, x.max_seqlen, causal)
        out = out[0] if isinstance(out, tuple) else out
        dout = x.dout
        return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    return VarlenProvider(name, make, make_bwd, context, split_hdims, equal_only)


def flashhopper_varlen() -> VarlenProvider:
    def attn(q, k, v, cu, max_seqlen, causal):
        from flashhopper.interface import flash_attn_varlen_func

        return flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=causal,
                                      deterministic=False)

    return differentiable_varlen("flashhopper", attn)


def flashhopper_dense() -> VarlenProvider:
    """flashhopper's dense kernel (flash_attn_func) on a packing of equal documents, its tensors viewed
    as (documents, length, heads, d): what the varlen kernel costs over it (fh/dense); the output viewed
    back as the packed one, for the agreement check."""

    def attn(q, k, v, cu, max_seqlen, causal):
        from flashhopper.interface import flash_attn_func

        batch = q.shape[0] // max_seqlen
        out = flash_attn_func(*(t.view(batch, max_seqlen, *t.shape[1:]) for t in (q, k, v)), causal=causal,
                              deterministic=False)
        return out.view(q.shape[0], *out.shape[2:])

    return differentiable_varlen(DENSE, attn, equal_only=True)


def fa2_forward(q, k, v, cu, max_seqlen, causal):
    """FA2's varlen forward as PyTorch ships it: (out, logsumexp, rng_state, unused, debug_mask)."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, causal,
                                                   False, scale=q.shape[-1] ** -0.5)


def fa2_backward(dout, q, k, v, forward, cu, max_seqlen, causal):
    """FA2's varlen backward from `forward`, what fa2_forward returned: (dq, dk, dv)."""
    out, lse, rng_state, unused = forward[:4]
    return torch.ops.aten._flash_attention_backward(dout, q, k, v, out, lse, cu, cu, max_seqlen, max_seqlen,
                                                    0.0, causal, rng_state, unused, scale=q.shape[-1] ** -0.5)


def fa2_varlen() -> VarlenProvider:
    """FA2 through torch.ops.aten's flash attention operators (no dropout); equal head dims only."""

    def make(x: Packed, causal):
        return lambda: fa2_forward(x.q, x.k, x.v, x.cu_seqlens, x.max_seqlen, causal)

    def make_bwd(x: Packed, causal):
        forward = fa2_forward(x.q, x.k, x.v, x.cu_seqlens, x.max_seqlen, causal)
        return lambda: fa2_backward(x.dout, x.q, x.k, x.v, forward, x.cu_seqlens, x.max_seqlen, causal)

    return VarlenProvider("fa2", make, make_bwd, split_hdims=False)


def fa4_varlen(out=sys.stdout) -> VarlenProvider | None:
    """FA4's CuTe DSL varlen, or None (with a note on `out`) where flash_attn.cute is not importable.
    Called by keyword: its fourth positional parameter is qv. It may return (out, lse)."""
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func as fa4
    except Exception as exc:  # absent, or present but broken: either way not a peer in this run
        print(f"(FA4 not measured: flash_attn.cute unavailable: {exc})", file=out, flush=True)
        return None

    def attn(q, k, v, cu, max_seqlen, causal):
        return fa4(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen,
                   max_seqlen_k=max_seqlen, causal=causal)

    return differentiable_varlen("fa4", attn, _quiet)


def varlen_providers(out=sys.stdout) -> list[VarlenProvider]:
    fa4 = fa4_varlen(out)
    return [flashhopper_varlen(), flashhopper_dense(), fa2_varlen(), *([fa4] if fa4 else [])]


# --- timing ---


def packed_inputs(point: VarlenPoint, dtype, device, cu_seqlens: torch.Tensor) -> Packed:
    """Fresh N(0, 1) inputs for one round (dout only for a backward point)."""
    total, h = point.packing.total, point.heads
    q, k = (runner.randn((total, h, point.hdim), dtype, device) for _ in range(2))
    v = runner.randn((total, h, point.hdim_v), dtype, device)
    dout = runner.randn((total, h, point.hdim_v), dtype, device) if point.backward else None
    return Packed(q, k, v, dout, cu_seqlens, point.packing.max_seqlen)


def _compared(result, backward: bool) -> tuple:
    """What is compared between providers: a forward's output (the first tensor when it returns
    several), a backward's (dq, dk, dv)."""
    if backward:
        return tuple(result[:3])
    return (result if isinstance(result, torch.Tensor) else result[0],)


def relative_difference(got, want) -> float:
    """max |got - want| / max |want| over the tensors, in float32; inf where either holds a NaN or
    an infinity."""
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        scale = b.float().abs().max().item() or 1.0
        diff = (a.float() - b.float()).abs().max().item() / scale
        worst = max(worst, diff if math.isfinite(diff) else math.inf)
    return worst


def run_varlen_point(point: VarlenPoint, providers: list[VarlenProvider], dtype=torch.bfloat16,
                     device="cuda", rounds: int = DEFAULT_ROUNDS, peers=PEERS) -> dict:
    """TFLOP/s of each provider at one point: the median over `rounds`, each round on freshly
    allocated inputs, the providers taking turns within it (min / max under "spread"). The first
    round's results are compared with the first peer's (agreement, max_rel_diff). A provider that
    fails is reported under errors; one that cannot take the head dims under skipped."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    cu = point.packing.cu_seqlens().to(device)
    errors, skipped, samples, results = {}, {}, {}, {}
    active = []
    for p in providers:
        if point.split and not p.split_hdims:
            skipped[p.name] = f"no head dims ({point.hdim}, {point.hdim_v})"
        elif p.equal_only and not point.packing.equal:
            skipped[p.name] = "documents of different lengths"
        else:
            active.append(p)
            samples[p.name] = []
    held = []  # every round's inputs kept to the end of the point: each round's land at new addresses
    for r in range(rounds):
        x = packed_inputs(point, dtype, device, cu)
        held.append(x)
        for p in list(active):
            try:
                with p.context():
                    fn = p.timed_call(x, point.causal, point.backward)
                    result = fn()  # the first call compiles / picks a kernel: kept out of the timing
                    if r == 0:
                        results[p.name] = _compared(result, point.backward)
                    del result
                    samples[p.name].append(point.flops / runner.time_ms(fn) / 1e9)
            except Exception as exc:  # one provider failing must not lose the rest of the row
                errors[p.name] = runner._short(exc)
                active.remove(p)
                results.pop(p.name, None)
            fn = None
    del held
    measured = [p.name for p in active]
    tflops = {p.name: statistics.median(samples[p.name]) if p.name in measured else None for p in providers}
    rates = [tflops[name] for name in peers if tflops.get(name)]
    mine = tflops.get("flashhopper")
    reference = next((name for name in peers if name in results), None)
    diffs = {name: relative_difference(got, results[reference]) for name, got in results.items()
             if reference and name != reference}
    p = point.packing
    return {
        "packing": p.name, "documents": len(p.seqlens), "tokens": p.total, "max_seqlen": p.max_seqlen,
        "hdim": point.hdim, "hdim_v": point.hdim_v, "causal": point.causal, "direction": point.direction,
        "heads": point.heads, "flops": point.flops, "tflops": tflops,
        "ratio": mine / max(rates) if mine and rates else None, "errors": errors, "skipped": skipped,
        "dense_ratio": mine / tflops[DENSE] if mine and tflops.get(DENSE) else None,
        "rounds": rounds, "spread": {n: [min(samples[n]), max(samples[n])] for n in measured},
        "percentiles": {n: runner.percentiles(samples[n]) for n in measured},
        "agreement": {"against": reference, "max_rel_diff": diffs} if diffs else None,
    }


def format_header(names) -> str:
    cols = "".join(n.rjust(12) for n in names)
    dense = f"{'fh/dense':>9}" if DENSE in names else ""
    return f"{'packing':>11} {'hdim':>7} {'causal':>6} {'dir':>3}{cols}{'fh/best':>9}{dense}"


def format_row(row: dict, names) -> str:
    cells = "".join(runner._cell(row["tflops"].get(n)) for n in names)
    hdim = str(row["hdim"]) if row["hdim_v"] == row["hdim"] else f"{row['hdim']}/{row['hdim_v']}"
    causal = "yes" if row["causal"] else "no"
    dense = runner._cell(row.get("dense_ratio"), 9, "{:.2f}") if DENSE in names else ""
    return (f"{row['packing']:>11} {hdim:>7} {causal:>6} {row['direction']:>3}{cells}"
            f"{runner._cell(row['ratio'], 9, '{:.2f}')}{dense}")


def describe(row: dict) -> str:
    hdim = str(row["hdim"]) if row["hdim_v"] == row["hdim"] else f"({row['hdim']}, {row['hdim_v']})"
    return f"{row['packing']} hdim {hdim} {'causal' if row['causal'] else 'non-causal'} {row['direction']}"


def summarize(rows: list[dict]) -> dict:
    """geomean and minimum of flashhopper / best peer, over all points and per direction."""
    rated = [r for r in rows if r.get("ratio")]
    summary: dict = {"points": len(rows), "points_with_ratio": len(rated), "geomean_ratio": None,
                     "min_ratio": None, "min_point": None, "by_direction": {}}
    if rated:
        lowest = min(rated, key=lambda r: r["ratio"])
        summary.update(geomean_ratio=geomean(r["ratio"] for r in rated), min_ratio=lowest["ratio"],
                       min_point=describe(lowest))
    for direction in ("fwd", "bwd"):
        ratios = [r["ratio"] for r in rated if r["direction"] == direction]
        if ratios:
            summary["by_direction"][direction] = {"geomean_ratio": geomean(ratios), "points": len(ratios)}
    dense = [r for r in rows if r.get("dense_ratio")]
    if dense:
        lowest = min(dense, key=lambda r: r["dense_ratio"])
        summary["dense"] = {"geomean_ratio": geomean(r["dense_ratio"] for r in dense), "points": len(dense),
                            "min_ratio": lowest["dense_ratio"], "min_point": describe(lowest)}
    return summary


def format_summary(summary: dict, peers=PEERS) -> list[str]:
    if summary["geomean_ratio"] is None:
        lines = [f"no point has a flashhopper / {peer_text(peers)} ratio (peers not measured)"]
    else:
        parts = ", ".join(f"{d} {s['geomean_ratio']:.3f} over {s['points']}"
                          for d, s in summary["by_direction"].items())
        lines = [f"geomean flashhopper / {peer_text(peers)}: {summary['geomean_ratio']:.3f} over "
                 f"{summary['points_with_ratio']} of {summary['points']} points ({parts})",
                 f"lowest: {summary['min_ratio']:.3f} at {summary['min_point']}"]
    if dense := summary.get("dense"):
        lines.append(f"flashhopper varlen / {DENSE} (equal documents): geomean {dense['geomean_ratio']:.3f} "
                     f"over {dense['points']} points, lowest {dense['min_ratio']:.3f} at "
                     f"{dense['min_point']}")
    return lines


def run_varlen_bench(points: list[VarlenPoint], dtype: str = "bf16", json_path: str | None = None,
                     providers: list[VarlenProvider] | None = None, out=sys.stdout,
                     rounds: int = DEFAULT_ROUNDS) -> dict:
    """Time every provider at every point, print one table line per point and the geomean of the
    ratios, and with `json_path` write the report (rows, packings' lengths, summary) as JSON."""
    providers = providers if providers is not None else varlen_providers(out)
    names = [p.name for p in providers]
    ceiling = runner.matmul_tflops()
    used = {point.packing.name: point.packing for point in points}
    report = {
        "benchmark": "varlen", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "dtype": dtype, "heads": HEADS, "matmul_tflops": ceiling, "providers": names, "peers": list(PEERS),
        "rounds": rounds, "flop_convention": FLOP_CONVENTION,
        "packings": {name: p.describe() for name, p in used.items()}, "results": [],
    }
    print(f"{report['device']}, torch {report['torch']}, {dtype}; bf16 matmul 8192^3: {ceiling:.0f} TFLOP/s",
          file=out, flush=True)
    for name, p in used.items():
        print(f"packing {name}: {len(p.seqlens)} documents, {p.total} tokens, longest {p.max_seqlen}",
              file=out, flush=True)
    print(f"varlen TFLOP/s, {HEADS} heads, median of {rounds} round(s) on fresh inputs; bwd: the backward "
          f"alone, FLOPs 2.5 x forward; fh/best = flashhopper / {peer_text(PEERS)}"
          + (f", fh/dense = flashhopper / {DENSE}" if DENSE in names else ""), file=out, flush=True)
    print(format_header(names), file=out, flush=True)
    for point in points:
        row = run_varlen_point(point, providers, runner.DTYPES[dtype], rounds=rounds)
        report["results"].append(row)
        print(format_row(row, names), file=out, flush=True)
        for name, message in row["errors"].items():
            print(f"    {name}: {message}", file=out, flush=True)
        print_disagreements(row, out)
    report["summary"] = summarize(report["results"])
    for line in format_summary(report["summary"]):
        print(line, file=out, flush=True)
    runner.write_json(report, json_path, out)
    return report


def print_disagreements(row: dict, out) -> None:
    """A line for each provider whose result differs from the reference provider's by more than
    AGREEMENT_TOLERANCE of its largest value (NaN counts as a difference)."""
    agreement = row["agreement"] or {"max_rel_diff": {}}
    for name, diff in agreement["max_rel_diff"].items():
        if not diff <= AGREEMENT_TOLERANCE:
            print(f"    {name}: differs from {agreement['against']} by {diff:.3g} of its largest value",
                  file=out, flush=True)
