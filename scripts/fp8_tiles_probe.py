"""Compile FP8 forward candidates for sm_90a (no GPU) and print what decides whether one can be timed:
spills, setmaxnreg split, shared memory, one WGMMA wait per commit group, the transposer's LDSM count.

Each SPEC is comma-separated FwdConfig overrides on the dispatched e4m3 config of --hdim (plus the
call's own keys causal=, local=, softcap=, qk_descale=token), e.g.

    python scripts/fp8_tiles_probe.py --hdim 128 "tile_n=160,pv_two_level=false" "causal=true,tile_n=128"
    python scripts/fp8_tiles_probe.py --hdim 64,96 --dispatched --set producer_nreg=24

--dispatched probes every dispatched FP8 kernel of the head dims (plan.dispatched_kernels: 6 masks x 2
descale forms), --set adds overrides to every spec and to those. One JSON line per spec (and a short
table at the end); a spec whose config check fails (shared memory, accumulator budget) is reported with
the reason, uncompiled (--ptxas-decides: compiled past the accumulator budget, a rough margin).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from flashhopper.compile import ensure_arch_env  # noqa: E402

ensure_arch_env()
from flashhopper.config import parse_overrides  # noqa: E402

CALL_KEYS = ("causal", "local", "softcap")


def parse_spec(text: str) -> tuple[dict, dict]:
    """(call keys, FwdConfig overrides) of a spec; qk_descale=token is the one string value."""
    items = [part for part in text.split(",") if part.strip() and not part.strip().startswith("qk_descale=")]
    token = "qk_descale=token" in text.replace(" ", "")
    fields = parse_overrides(",".join(items) or "default")
    call = {key: bool(fields.pop(key)) for key in CALL_KEYS if key in fields}
    if token:
        call["qk_descale"] = "token"
    return call, fields


def config_of(hdim: int, call: dict, fields: dict):
    from flashhopper.plan import fwd_config

    return dataclasses.replace(fwd_config("e4m3", hdim, **call), **fields)


@contextlib.contextmanager
def accumulators_unchecked():
    """FwdConfig.check without its accumulator budget (a rough margin: ptxas has the last word)."""
    from flashhopper.config import FwdConfig

    saved = FwdConfig.accumulator_regs
    FwdConfig.accumulator_regs = lambda self: 0
    try:
        yield
    finally:
        FwdConfig.accumulator_regs = saved


def probe(cfg, ptxas_decides: bool = False) -> dict:
    from flashhopper.compile import inspect_cubin
    from flashhopper.hopper.runtime import kernel_cubin, kernel_launch

    row = {"hdim": cfg.hdim, **{k: True for k in CALL_KEYS if getattr(cfg, k)}, "qk_descale": cfg.qk_descale,
           "tile_n": cfg.tile_n, "pv_two_level": cfg.pv_two_level, "vt_stages": cfg.vt_stages,
           "split": f"{cfg.consumer_regs}/{cfg.producer_regs}", "model_smem": cfg.smem_bytes()}
    unchecked = contextlib.nullcontext()
    try:
        cfg.check()
    except ValueError as exc:
        if not (ptxas_decides and "accumulators need" in str(exc)):
            return {**row, "error": str(exc)}
        row["check"], unchecked = str(exc), accumulators_unchecked()
    start = time.time()
    try:
        with unchecked:
            report = inspect_cubin(kernel_cubin(cfg), smem_bytes=kernel_launch(cfg)["smem"])
    except Exception as exc:  # a trace or ptxas failure is a finding too
        return {**row, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    sass = report["sass"]
    groups = 2 + 2 * (1 + (cfg.causal or cfg.local) + cfg.local)  # one WGMMA wait per commit group
    return {**row, "spill": report["spill_bytes"], "smem": report["smem_bytes"],
            "usetmaxreg": sass["USETMAXREG"], "waits": sass["HGMMA_WAITS"], "waits_expected": groups,
            "ldsm": sass["LDSM"], "instructions": report["instructions"],
            "compile_s": round(time.time() - start, 1)}


def configs(args) -> list:
    from flashhopper.plan import dispatched_kernels

    out = []
    extra = parse_spec(args.set)[1] if args.set else {}
    if args.dispatched:
        out += [dataclasses.replace(cfg, **extra)
                for cfg in dispatched_kernels(dtypes=("e4m3",), hdims=tuple(args.hdim), backward=False)]
    for hdim in args.hdim:
        for spec in args.specs or ([] if args.dispatched else ["default"]):
            call, fields = parse_spec(",".join(filter(None, (spec, args.set))))
            out.append(config_of(hdim, call, fields))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hdim", type=lambda s: [int(x) for x in s.split(",")], required=True,
                        help="head dims, comma-separated")
    parser.add_argument("--dispatched", action="store_true", help="every dispatched FP8 kernel of the hdims")
    parser.add_argument("--set", default="", help="overrides added to every spec")
    parser.add_argument("--ptxas-decides", action="store_true",
                        help="compile a spec that FwdConfig.check rejects only for its accumulator budget")
    parser.add_argument("specs", nargs="*", metavar="SPEC")
    args = parser.parse_args()
    rows = []
    for cfg in configs(args):
        row = probe(cfg, args.ptxas_decides)
        rows.append(row)
        print(json.dumps(row), flush=True)
    for r in rows:
        ok = "error" not in r and r["spill"] == 0 and r["waits"] == r["waits_expected"]
        what = r.get("error") or (f"spill {r['spill']} smem {r['smem']} "
                                  f"waits {r['waits']}/{r['waits_expected']} {r['compile_s']} s"
                                  + (" (past the accumulator check)" if "check" in r else ""))
        keys = " ".join(k for k in CALL_KEYS if r.get(k)) + (" token" if r["qk_descale"] == "token" else "")
        print(f"{'OK  ' if ok else 'FAIL'} hdim {r['hdim']} {keys.strip() or 'nomask'} tile_n {r['tile_n']} "
              f"two_level {r['pv_two_level']} split {r['split']}: {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
