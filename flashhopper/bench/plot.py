"""Draw a grid report (the JSON `flashhopper bench [--bwd] --json` writes) as TFLOP/s against seqlen.

matplotlib is an optional dependency (`pip install 'flashhopper[plot]'`): it is imported only
here, only when a plot is asked for.
"""

from __future__ import annotations

import json
import statistics

from flashhopper.bench.summary import FP8_NAMES, peer_text, summarize

OURS = "flashhopper"
LABELS = {"flashhopper": "flashhopper", "fa2": "FA2 (SDPA)", "cudnn": "cuDNN (SDPA)", "fa4": "FA4"}
FP8_LABELS = {**LABELS, "cudnn": "cuDNN (sdpa_fp8)"}
# fixed colours so that a provider looks the same in every plot
COLORS = {"flashhopper": "black", "fa2": "tab:gray", "cudnn": "tab:green", "fa4": "tab:blue"}


class MissingMatplotlib(RuntimeError):
    pass


def require_matplotlib():
    """pyplot on the file-only Agg backend (no display on the GPU machines), or a clear error."""
    try:
        import matplotlib
    except ImportError as exc:
        raise MissingMatplotlib(
            "plotting needs matplotlib: pip install matplotlib (or pip install 'flashhopper[plot]')"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _seqlen_label(s: int) -> str:
    return f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s)


def plot_report(report: dict, out_path: str, dpi: int = 90) -> str:
    plt = require_matplotlib()
    rows = report["results"]
    hdims = sorted({r["hdim"] for r in rows})
    modes = sorted({r["causal"] for r in rows})  # False (non-causal) first
    seqlens = sorted({r["seqlen"] for r in rows})
    providers = report.get("providers") or sorted({n for r in rows for n in r["tflops"]})
    providers = sorted(providers, key=lambda n: n == OURS)  # ours drawn last, on top
    labels = FP8_LABELS if report.get("dtype") in FP8_NAMES else LABELS
    ceiling, ceiling_name = _ceiling(report)

    fig, axes = plt.subplots(len(hdims), len(modes), figsize=(4.5 * len(modes), 2.9 * len(hdims)),
                             sharex=True, sharey=True, squeeze=False)
    for i, hdim in enumerate(hdims):
        for j, causal in enumerate(modes):
            ax = axes[i][j]
            panel = sorted((r for r in rows if r["hdim"] == hdim and r["causal"] == causal),
                           key=lambda r: r["seqlen"])
            for name in providers:
                pts = [(r["seqlen"], r["tflops"].get(name)) for r in panel if r["tflops"].get(name)]
                if pts:
                    ours = name == OURS
                    xs, ys = zip(*pts, strict=True)
                    ax.plot(xs, ys, marker="o", markersize=4 if ours else 3, linewidth=2.6 if ours else 1.2,
                            color=COLORS.get(name), label=labels.get(name, name), zorder=3 if ours else 2)
            if ceiling:
                ax.axhline(ceiling, color="tab:red", linestyle="--", linewidth=0.8,
                           label=f"{ceiling_name} ({ceiling:.0f})")
            ax.set_title(f"hdim {hdim}, {'causal' if causal else 'non-causal'}", fontsize=10)
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens, [_seqlen_label(s) for s in seqlens])
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            if j == 0:
                ax.set_ylabel("TFLOP/s")
            if i == len(hdims) - 1:
                ax.set_xlabel("seqlen")
    legend = {}  # every provider once, even one that was measured in some panels only
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=len(legend), fontsize=9,
               frameon=False)
    fig.suptitle(_title(report), fontsize=11)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out_path, dpi=dpi)
    plt.close(fig)
    return out_path


def _ceiling(report: dict):
    """(TFLOP/s, name) of the GEMM line: the bf16 matmul, or for FP8 the median of the FP8 GEMM rates
    timed beside the points (the bf16 matmul is no ceiling for FP8)."""
    if report.get("dtype") not in FP8_NAMES:
        return report.get("matmul_tflops"), "bf16 matmul"
    rates = [r["scaled_mm_tflops"]["fast_accum"] for r in report["results"] if r.get("scaled_mm_tflops")]
    return (statistics.median(rates) if rates else None), "fp8 scaled_mm, fast accum"


def _title(report: dict) -> str:
    summary = report.get("summary") or summarize(report)
    # reports from before the backward benchmark have no direction: they are forward
    direction = "backward" if report.get("direction") == "bwd" else "forward"
    head = f"{report.get('device', 'unknown GPU')}, {report.get('dtype', 'bf16')} {direction}"
    if summary["geomean_ratio"] is None:
        return head
    peers = [{"cudnn": "cuDNN", "fa4": "FA4"}.get(p, p) for p in report.get("peers", ("cudnn", "fa4"))]
    return (f"{head}: flashhopper / {peer_text(peers)} geomean {summary['geomean_ratio']:.2f}, "
            f"lowest {summary['min_ratio']:.2f}")


def plot_file(json_path: str, out_path: str, dpi: int = 90) -> str:
    with open(json_path) as f:
        return plot_report(json.load(f), out_path, dpi=dpi)
