"""The FlashAttention-3 ablation (paper Table 2): forward TFLOP/s with each scheduling switch off.

All configurations run in one process on the same inputs, one after another, so their drops
against "everything on" are comparable even though absolute TFLOP/s drift between runs.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys

from flashhopper.bench.grid import make_point
from flashhopper.config import FwdConfig

# Names of boolean FwdConfig fields that the ablation turns off; a new switch (e.g. persistent)
# joins the table by adding its name here. Kept out of config.py so that file only describes
# kernels, not experiments.
ABLATION_SWITCHES = ("pingpong", "intra_wg_overlap", "persistent", "dynamic_sched", "reg_realloc",
                     "wg_epilogue", "lazy_max")
MODES = (("non-causal", False), ("causal", True))
SEQLEN, HDIM = 8192, 128  # batch 2, 16 heads with the grid's 16384 tokens and hidden 2048
# An ablation variant changes scheduling only; the output must match everything-on to bf16 noise.
MAX_DIFF = 2e-2


def ablation_switches(names=ABLATION_SWITCHES) -> tuple[str, ...]:
    """The switch names, checked against FwdConfig's fields so a typo fails loudly, not silently."""
    fields = {f.name: f for f in dataclasses.fields(FwdConfig)}
    for name in names:
        if name not in fields or fields[name].type not in (bool, "bool"):
            raise ValueError(f"ablation switch {name!r} is not a boolean field of FwdConfig")
    return tuple(names)


def configurations(switches) -> list[tuple[str, dict]]:
    """(label, FwdConfig overrides): all on, each off alone, then all off.

    "Everything on" sets every switch explicitly, so a switch whose default is off still counts.
    """
    on = {s: True for s in switches}
    configs = [("everything on", on)] + [(f"no {s}", {**on, s: False}) for s in switches]
    if len(switches) > 1:
        configs.append(("all off", {s: False for s in switches}))
    return configs


def _drop(value, base):
    return (base - value) / base if value and base else None


def finish_rows(rows: list[dict], modes=MODES) -> list[dict]:
    """Add, per mode, the fractional drop against the first row and whether it is slower."""
    base = rows[0]["tflops"]
    for row in rows:
        row["drop"] = {m: _drop(row["tflops"].get(m), base.get(m)) for m, _ in modes}
        row["slower"] = {m: None if d is None else d > 0 for m, d in row["drop"].items()}
    return rows


def format_table(rows: list[dict], modes=MODES) -> list[str]:
    width = max(len(r["name"]) for r in rows) + 2
    header = "configuration".ljust(width) + "".join(
        f"{m:>12}{'drop':>8}{'slower':>8}" for m, _ in modes)
    lines = [header]
    for i, row in enumerate(rows):
        cells = []
        for mode, _ in modes:
            tf, drop, slower = row["tflops"].get(mode), row["drop"][mode], row["slower"][mode]
            tf_s = f"{tf:.1f}" if tf else "failed"
            drop_s = "-" if i == 0 or drop is None else f"{100 * drop:.1f}%"
            slower_s = "-" if i == 0 or slower is None else ("yes" if slower else "NO")
            cells.append(f"{tf_s:>12}{drop_s:>8}{slower_s:>8}")
        lines.append(row["name"].ljust(width) + "".join(cells))
    return lines


def run_ablation(dtype: str = "bf16", seqlen: int = SEQLEN, hdim: int = HDIM, device: str = "cuda",
                 attn=None, overrides=None, json_path: str | None = None, out=sys.stdout,
                 causal=(False, True), rounds: int = 1) -> dict:
    """Time `attn` under each configuration; print and return the table.

    `causal` picks the modes (both by default; one halves the run, whose time is mostly the
    compiles of each configuration). `rounds` > 1 times every configuration that many times, the
    configurations taking turns, and keeps the median: single rows moved 4-6% between runs on the
    H200 (docs/decisions.md), more than most switches are worth.

    `attn` defaults to flash_attn_func and `overrides` to runtime.config_overrides; tests pass
    stand-ins so that the table logic runs without a GPU or the CuTe DSL.
    """
    import torch

    from flashhopper.bench.runner import DTYPES, time_ms

    if overrides is None:
        from flashhopper.compile import ensure_arch_env

        ensure_arch_env()  # before cutlass is first imported, or kernels build for the wrong arch
        from flashhopper.hopper.runtime import config_overrides as overrides
    if attn is None:
        from flashhopper.interface import flash_attn_func as attn
    switches = ablation_switches()
    rows = [{"name": name, "overrides": o, "tflops": {}, "errors": {}, "max_diff": {}}
            for name, o in configurations(switches)]
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    modes = tuple((m, c) for m, c in MODES if c in causal)
    if not modes:
        raise ValueError(f"causal must include False and/or True, got {causal!r}")
    for mode, is_causal in modes:
        point = make_point(seqlen, hdim, is_causal)
        shape = (point.batch, point.seqlen, point.heads, point.hdim)
        q, k, v = (torch.randn(shape, device=device, dtype=DTYPES[dtype]) for _ in range(3))
        reference, timed = None, {}  # row index -> (call, TFLOP/s samples)
        for i, row in enumerate(rows):
            try:
                # the override is read on every call, so the timed calls must be inside it too
                with overrides(**row["overrides"]):
                    def call(q=q, k=k, v=v, causal=is_causal):
                        return attn(q, k, v, causal=causal)

                    result = call()  # compiles this configuration
                    row["tflops"][mode] = point.flops / time_ms(call) / 1e9
            except Exception as exc:  # one variant failing to build must not lose the others
                row["tflops"][mode] = None
                row["errors"][mode] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
                continue
            timed[i] = (call, [row["tflops"][mode]])
            print(f"  {mode:<10} {row['name']:<22} {row['tflops'][mode]:7.1f} TFLOP/s", file=out, flush=True)
            reference = result if reference is None else reference
            row["max_diff"][mode] = (result.float() - reference.float()).abs().max().item()
        # more rounds: the configurations take turns, each compiled already; the median is kept
        for _ in range(rounds - 1):
            for i, (call, samples) in timed.items():
                with overrides(**rows[i]["overrides"]):
                    samples.append(point.flops / time_ms(call) / 1e9)
        if rounds > 1:
            for i, (_, samples) in timed.items():
                rows[i]["tflops"][mode] = statistics.median(samples)
                rows[i].setdefault("spread", {})[mode] = [min(samples), max(samples)]
            print(f"  {mode}: medians of {rounds} rounds", file=out, flush=True)
    finish_rows(rows, modes)
    point = make_point(seqlen, hdim, False)  # batch and heads do not depend on the mask
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else device,
              "torch": torch.__version__, "dtype": dtype, "switches": list(switches),
              "point": {"seqlen": seqlen, "hdim": hdim, "batch": point.batch, "heads": point.heads},
              "rounds": rounds,
              "results": rows}
    print(f"{report['device']}, torch {report['torch']}, {dtype}; ablation at hdim {hdim}, seqlen {seqlen}, "
          f"batch {point.batch}, {point.heads} heads; forward TFLOP/s, drop vs everything on", file=out)
    for line in format_table(rows, modes):
        print(line, file=out)
    for row in rows:
        for mode, message in row["errors"].items():
            print(f"    {row['name']} ({mode}): {message}", file=out)
        for mode, diff in row["max_diff"].items():
            if not diff <= MAX_DIFF:  # written so that NaN is reported too
                print(f"    {row['name']} ({mode}): output differs from everything on by {diff:.3g}",
                      file=out)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {json_path}", file=out)
    out.flush()
    return report
