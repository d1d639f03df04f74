"""The few numbers a grid run is judged by, computed from its result rows (no GPU, no torch).

A ratio is only meaningful within one run (absolute TFLOP/s drift between runs), so everything
here is derived from a single report: per-point ratios to the best peer, and our hdim 128 long
sequence rate against the same run's matmul rate.
"""

from __future__ import annotations

import math

# docs/results.md: geomean >= 1.05, no point below 0.95; hdim 128 non-causal 16k
# at >= 0.9 of the bf16 matmul rate measured in the same run.
GEOMEAN_TARGET = 1.05
MIN_RATIO_TARGET = 0.95
MATMUL_FRACTION_TARGET = 0.9
MATMUL_POINT = {"hdim": 128, "causal": False, "seqlen": 16384}


def geomean(values) -> float:
    values = list(values)
    if not values or any(v <= 0 for v in values):
        raise ValueError("geomean needs at least one value, all positive")
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _where(row: dict) -> dict:
    return {"hdim": row["hdim"], "causal": row["causal"], "seqlen": row["seqlen"]}


def summarize(report: dict) -> dict:
    """geomean and minimum of flashhopper / best peer, and the matmul fraction when measured."""
    rows = report["results"]
    rated = [r for r in rows if r.get("ratio")]
    summary: dict = {"points": len(rows), "points_with_ratio": len(rated), "geomean_ratio": None,
                     "min_ratio": None, "min_point": None, "matmul_fraction": None}
    if rated:
        lowest = min(rated, key=lambda r: r["ratio"])
        summary.update(geomean_ratio=geomean(r["ratio"] for r in rated), min_ratio=lowest["ratio"],
                       min_point=_where(lowest))
    ceiling = report.get("matmul_tflops")
    for row in rows:
        mine = row["tflops"].get("flashhopper")
        if _where(row) == MATMUL_POINT and mine and ceiling:
            summary["matmul_fraction"] = {**MATMUL_POINT, "tflops": mine, "matmul_tflops": ceiling,
                                          "fraction": mine / ceiling}
    return summary


def _verdict(value: float, target: float, targets: bool = True) -> str:
    if not targets:
        return ""
    return f" (target >= {target:g}: {'met' if value >= target else 'not met'})"


def describe(where: dict) -> str:
    return f"hdim {where['hdim']} {'causal' if where['causal'] else 'non-causal'} seqlen {where['seqlen']}"


def format_summary(summary: dict, peers=("cudnn", "fa4"), targets: bool = True) -> list[str]:
    """The summary as text lines; `targets` adds the forward targets' verdicts (met / not met)."""
    if summary["geomean_ratio"] is None:
        lines = [f"no point has a flashhopper / max({', '.join(peers)}) ratio (peers not measured)"]
    else:
        n, total = summary["points_with_ratio"], summary["points"]
        lines = [
            f"geomean flashhopper / max({', '.join(peers)}): {summary['geomean_ratio']:.3f} over {n} of "
            f"{total} points{_verdict(summary['geomean_ratio'], GEOMEAN_TARGET, targets)}",
            f"lowest: {summary['min_ratio']:.3f} at {describe(summary['min_point'])}"
            f"{_verdict(summary['min_ratio'], MIN_RATIO_TARGET, targets)}",
        ]
    frac = summary["matmul_fraction"]
    if frac:
        verdict = _verdict(frac["fraction"], MATMUL_FRACTION_TARGET, targets)
        lines.append(f"{describe(frac)}: {frac['tflops']:.0f} TFLOP/s = {frac['fraction']:.3f} of bf16 "
                     f"matmul {frac['matmul_tflops']:.0f}{verdict}")
    return lines
