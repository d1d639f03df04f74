"""The few numbers a grid run is judged by, computed from its result rows (no GPU, no torch).

A ratio is only meaningful within one run (absolute TFLOP/s drift between runs), so everything
here is derived from a single report: per-point ratios to the best peer, and our hdim 128 long
sequence rate against the same run's matmul rate (FP8: hdim 256 and 128 against the FP8 GEMM
rate timed beside that point).
"""

from __future__ import annotations

import math

# docs/results.md: geomean >= 1.05, no point below 0.95; hdim 128 non-causal 16k
# at >= 0.9 of the bf16 matmul rate measured in the same run.
GEOMEAN_TARGET = 1.05
MIN_RATIO_TARGET = 0.95
MATMUL_FRACTION_TARGET = 0.9
MATMUL_POINT = {"hdim": 128, "causal": False, "seqlen": 16384}
# FP8 (e4m3) forward against cuDNN's FP8 SDPA: geomean >= 1.10, no point below 1.0; non-causal 16k
# at these fractions of torch._scaled_mm with fast accumulation (the faster of cuBLAS's two FP8
# modes, so the stricter ceiling), timed beside the point.
FP8_NAMES = ("e4m3", "fp8")
FP8_GEOMEAN_TARGET = 1.10
FP8_MIN_RATIO_TARGET = 1.0
FP8_GEMM_TARGETS = {256: 0.85, 128: 0.75}


def geomean(values) -> float:
    values = list(values)
    if not values or any(v <= 0 for v in values):
        raise ValueError("geomean needs at least one value, all positive")
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _where(row: dict) -> dict:
    return {"hdim": row["hdim"], "causal": row["causal"], "seqlen": row["seqlen"]}


def summarize(report: dict) -> dict:
    """geomean and minimum of flashhopper / best peer, and the matmul fraction when measured (FP8:
    the fractions of the FP8 GEMM instead; the bf16 matmul is no ceiling for FP8)."""
    rows = report["results"]
    rated = [r for r in rows if r.get("ratio")]
    fp8 = report.get("dtype") in FP8_NAMES
    summary: dict = {"points": len(rows), "points_with_ratio": len(rated), "geomean_ratio": None,
                     "min_ratio": None, "min_point": None, "matmul_fraction": None, "fp8": fp8,
                     "scaled_mm_fraction": _scaled_mm_fractions(rows) if fp8 else None}
    if rated:
        lowest = min(rated, key=lambda r: r["ratio"])
        summary.update(geomean_ratio=geomean(r["ratio"] for r in rated), min_ratio=lowest["ratio"],
                       min_point=_where(lowest))
    ceiling = None if fp8 else report.get("matmul_tflops")
    for row in rows:
        mine = row["tflops"].get("flashhopper")
        if _where(row) == MATMUL_POINT and mine and ceiling:
            summary["matmul_fraction"] = {**MATMUL_POINT, "tflops": mine, "matmul_tflops": ceiling,
                                          "fraction": mine / ceiling}
    if report.get("allocations"):
        summary["spread"] = spreads(rows, report.get("peers") or ())
        summary["clock"] = clock_summary(rows)
    return summary


def clock_summary(rows) -> dict | None:
    """Over the rows of an allocations run: the geomean of the paired ratios (runner.paired_ratio), our
    samples' lowest p10 and highest p90 SM clock and the fraction of every provider's samples under the
    power cap (runner's gpu_state; None where NVML read nothing)."""
    paired = [r["paired_ratio"] for r in rows if r.get("paired_ratio")]
    states = [st for r in rows for st in (r.get("gpu_state") or {}).values()]
    per_row = [r.get("gpu_state") or {} for r in rows]
    mine = [st["flashhopper"]["sm_mhz"] for st in per_row if "flashhopper" in st]
    if not paired and not states:
        return None
    return {"paired_geomean": geomean(paired) if paired else None,
            "sm_mhz_p10": min(m["p10"] for m in mine) if mine else None,
            "sm_mhz_p90": max(m["p90"] for m in mine) if mine else None,
            "power_capped": sum(st["power_capped"] for st in states) / len(states) if states else None}


def clock_line(clock: dict | None) -> str | None:
    """One line for clock_summary's figures."""
    if not clock:
        return None
    parts = []
    if clock["paired_geomean"] is not None:
        parts.append("per-allocation ratio (ours / best peer moments apart) geomean "
                     f"{clock['paired_geomean']:.3f}")
    if clock["sm_mhz_p10"] is not None:
        parts.append(f"our samples' SM clock {clock['sm_mhz_p10']:.0f}-{clock['sm_mhz_p90']:.0f} MHz "
                     "(p10-p90)")
    if clock["power_capped"] is not None:
        parts.append(f"{100 * clock['power_capped']:.0f}% of all samples under the power cap")
    return "; ".join(parts)


# the allocations mode: our p50 / p10 may be no wider than the widest peer's, or this, at any point
SPREAD_ALLOWANCE = 1.05


def spreads(rows, peers, where=None) -> dict:
    """Points where our spread (p50 / p10 over the allocations) is wider than max(the peers', 5%);
    each named by `where(row)` (a dict; default the grid's point)."""
    where = where or _where
    wider, ours_all = [], []
    for row in rows:
        pct = row.get("percentiles") or {}
        mine = pct.get("flashhopper")
        if not mine or not mine["p10"]:
            continue
        ours = mine["p50"] / mine["p10"]
        theirs = [p["p50"] / p["p10"] for name, p in pct.items() if name in peers and p["p10"]]
        allowed = max([SPREAD_ALLOWANCE, *theirs])
        ours_all.append(ours)
        if ours > allowed:
            wider.append({**where(row), "ours": ours, "allowed": allowed})
    return {"points": len(ours_all), "widest": max(ours_all, default=None), "wider_than_allowed": wider}


def spread_line(found: dict | None, name) -> str | None:
    """The summary's line for spreads() (None where nothing was measured), each point wider than allowed
    on a line of its own, named by name(entry)."""
    if not found or found["widest"] is None:
        return None
    wider = found["wider_than_allowed"]
    return (f"spread p50/p10 over allocations: ours at most {found['widest']:.3f}; wider than "
            f"max(the peers', {SPREAD_ALLOWANCE:g}) at {len(wider)} of {found['points']} points"
            + "".join(f"\n  {name(w)}: {w['ours']:.3f} > {w['allowed']:.3f}" for w in wider))


def _scaled_mm_fractions(rows) -> list[dict]:
    """Ours over the FP8 GEMM (fast accumulation) timed beside it, at each target point measured."""
    fractions = []
    for hdim, target in FP8_GEMM_TARGETS.items():
        where = {"hdim": hdim, "causal": False, "seqlen": 16384}
        for row in rows:
            mine, gemm = row["tflops"].get("flashhopper"), row.get("scaled_mm_tflops") or {}
            if _where(row) == where and mine and gemm.get("fast_accum"):
                fractions.append({**where, "tflops": mine, "scaled_mm_tflops": gemm["fast_accum"],
                                  "scaled_mm_default_tflops": gemm.get("default"),
                                  "fraction": mine / gemm["fast_accum"], "target": target})
    return fractions


def _verdict(value: float, target: float, targets: bool = True) -> str:
    if not targets:
        return ""
    return f" (target >= {target:g}: {'met' if value >= target else 'not met'})"


def describe(where: dict) -> str:
    return f"hdim {where['hdim']} {'causal' if where['causal'] else 'non-causal'} seqlen {where['seqlen']}"


def peer_text(peers) -> str:
    return peers[0] if len(peers) == 1 else f"max({', '.join(peers)})"


def format_summary(summary: dict, peers=("cudnn", "fa4"), targets: bool = True) -> list[str]:
    """The summary as text lines; `targets` adds the forward targets' verdicts (met / not met)."""
    geomean_target, min_target = GEOMEAN_TARGET, MIN_RATIO_TARGET
    if summary.get("fp8"):
        geomean_target, min_target = FP8_GEOMEAN_TARGET, FP8_MIN_RATIO_TARGET
    if summary["geomean_ratio"] is None:
        lines = [f"no point has a flashhopper / {peer_text(peers)} ratio (peers not measured)"]
    else:
        n, total = summary["points_with_ratio"], summary["points"]
        lines = [
            f"geomean flashhopper / {peer_text(peers)}: {summary['geomean_ratio']:.3f} over {n} of "
            f"{total} points{_verdict(summary['geomean_ratio'], geomean_target, targets)}",
            f"lowest: {summary['min_ratio']:.3f} at {describe(summary['min_point'])}"
            f"{_verdict(summary['min_ratio'], min_target, targets)}",
        ]
    for frac in summary.get("scaled_mm_fraction") or []:
        lines.append(f"{describe(frac)}: {frac['tflops']:.0f} TFLOP/s = {frac['fraction']:.3f} of fp8 "
                     f"scaled_mm {frac['scaled_mm_tflops']:.0f} (fast accum, timed beside it)"
                     f"{_verdict(frac['fraction'], frac['target'], targets)}")
    if line := spread_line(summary.get("spread"), describe):
        lines.append(line)
    if line := clock_line(summary.get("clock")):
        lines.append(line)
    frac = summary["matmul_fraction"]
    if frac:
        verdict = _verdict(frac["fraction"], MATMUL_FRACTION_TARGET, targets)
        lines.append(f"{describe(frac)}: {frac['tflops']:.0f} TFLOP/s = {frac['fraction']:.3f} of bf16 "
                     f"matmul {frac['matmul_tflops']:.0f}{verdict}")
    return lines
