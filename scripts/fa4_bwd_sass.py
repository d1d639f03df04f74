"""Compile FA4's SM90 backward main kernel for sm_90a on a machine with no GPU, next to ours, and
count the SASS of both (docs/notes/bwd-hdim192.md: the two loops at hdim 192 in the same tile).

    python3 scripts/fa4_bwd_sass.py 192 [--out /tmp/fa4cmp] [--set num_consumer_wg=2 --set ...]

FA4 comes from the DSL bundle (.device/cutedsl-*-bundle.tar.xz carries flash-attn-4 4.0.0b36 and
quack), unpacked once into --out; its per-hdim SM90 config (`_tile_size_bwd_sm90`, no mask) and its
fake-tensor helper build the kernel, and two modules it imports that this machine lacks (einops,
quack.autotuner, only used elsewhere) are stubbed. Ours is `runtime.bwd_artifact` with the --set
overrides. Writes fa4_h{hdim}.cubin / .sass and ours_h{hdim}.cubin / .sass, prints the config and a
count of the main opcodes of each (the whole kernel; the consumer loop is the range between its
back-edge branch and that branch's target in the .sass).
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import subprocess
import sys
import tarfile
import types

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ.setdefault("FLASH_ATTENTION_ARCH", "sm_90")
os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", "132")

OPS = ("HGMMA", "WARPGROUP.DEPBAR", "BAR.SYNC", "BAR.ARV", "SYNCS", "STSM", "LDSM", "STS", "LDS",
       "MUFU.EX2", "FMUL", "FFMA", "UTMALDG", "UTMASTG", "UTMAREDG", "UBLKRED", "UBLKCP", "REDG", "ATOMG",
       "ACQBULK", "LDL", "STL")


def unpack_fa4(out: str) -> str:
    site = os.path.join(out, "site")
    if not os.path.isdir(os.path.join(site, "flash_attn")):
        device_dir = os.path.join(os.path.dirname(__file__), "..", ".device")
        bundle = sorted(glob.glob(os.path.join(device_dir, "cutedsl-*-bundle.tar.xz")))
        if not bundle:
            sys.exit("no .device/cutedsl-*-bundle.tar.xz: copy ../shared/device/* to .device/ first")
        with tarfile.open(bundle[-1]) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(("site/flash_attn/", "site/quack/"))]
            tar.extractall(out, members=members, filter="data")
    return site


def stub_missing_modules() -> None:
    """einops and quack.autotuner (triton) are imported by FA4 modules this kernel does not use."""
    if "einops" not in sys.modules:
        einops = types.ModuleType("einops")
        for name in ("rearrange", "repeat", "reduce"):
            setattr(einops, name, lambda *a, **k: (_ for _ in ()).throw(RuntimeError("einops stub")))
        sys.modules["einops"] = einops
    autotuner = types.ModuleType("quack.autotuner")

    class AutotuneConfig:
        def __init__(self, *a, **k):
            self.kwargs = k

    autotuner.AutotuneConfig = AutotuneConfig
    autotuner.Autotuner = type("Autotuner", (), {"__init__": lambda self, *a, **k: None})
    autotuner.autotune = lambda *a, **k: (lambda f: f)
    sys.modules["quack.autotuner"] = autotuner


def fa4_cubin(hdim: int, out: str) -> tuple[bytes, object]:
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32
    from flash_attn.cute import interface as fa4
    from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90
    from flash_attn.cute.utils import AuxData

    cfg = fa4._tile_size_bwd_sm90(hdim, hdim, False, False)
    kernel = FlashAttentionBackwardSm90(
        cutlass.BFloat16, hdim, hdim, 1, False, is_local=False, deterministic=False,
        tile_m=cfg.m_block_size, tile_n=cfg.n_block_size, Q_stage=cfg.num_stages_Q,
        dO_stage=cfg.num_stages_dO, PdS_stage=cfg.num_stages_PdS, SdP_swapAB=cfg.SdP_swapAB,
        dKV_swapAB=cfg.dKV_swapAB, dQ_swapAB=cfg.dQ_swapAB, AtomLayoutMSdP=cfg.AtomLayoutMSdP,
        AtomLayoutNdKV=cfg.AtomLayoutNdKV, AtomLayoutMdQ=cfg.AtomLayoutMdQ,
        num_threads=(cfg.num_wg + 1) * 128,
        V_in_regs=False, score_mod=None, score_mod_bwd=None, mask_mod=None, has_aux_tensors=False,
        q_subtile_factor=2, dQ_single_wg=cfg.dQ_single_wg)
    fake = fa4.make_fake_bwd_tensors(cutlass.BFloat16, has_gqa=False, varlen_q=False, varlen_k=False)
    mQ, mK, mV, _mO, mdO, _mdQ, mdK, mdV, _mLSE, mLSElog2, mPdPsum, dQaccum = fake[:12]
    args = [kernel, mQ, mK, mV, mdO, mLSElog2, mPdPsum, dQaccum, mdK, mdV, Float32(1.0),
            *([None] * 9), AuxData(None, None), None, None, cute.runtime.make_fake_stream()]
    dump = os.path.join(out, f"dump_fa4_h{hdim}")
    os.makedirs(dump, exist_ok=True)
    return cute.compile(*args, options=f"--keep-cubin --dump-dir {dump}").__cubin__, cfg


def sass(cubin: bytes, path: str) -> list[str]:
    from flashhopper.compile import find_sass_tools, parse_sass

    with open(path + ".cubin", "wb") as f:
        f.write(cubin)
    cuobjdump, nvdisasm = find_sass_tools()
    env = dict(os.environ, PATH=os.path.dirname(nvdisasm) + os.pathsep + os.environ.get("PATH", ""))
    text = subprocess.run([cuobjdump, "-sass", path + ".cubin"], capture_output=True, text=True, env=env,
                          check=True).stdout
    with open(path + ".sass", "w") as f:
        f.write(text)
    return [op for op, _ in parse_sass(text)]


def counts(ops: list[str]) -> dict[str, int]:
    c = collections.Counter()
    for op in ops:
        for name in OPS:
            if op == name or op.startswith(name + "."):
                c[name] += 1
    c["total"] = len(ops)
    return c


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("hdim", type=int)
    parser.add_argument("--out", default="/tmp/fa4cmp")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="our BwdConfig override for the comparison kernel (repeatable)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    sys.path.insert(0, unpack_fa4(args.out))
    stub_missing_modules()

    import flashhopper.compile as fh_compile
    from flashhopper.config import parse_overrides

    fh_compile.ensure_arch_env()
    from flashhopper.hopper import runtime

    theirs, cfg = fa4_cubin(args.hdim, args.out)
    ours = runtime.bwd_artifact(hdim=args.hdim, **parse_overrides(",".join(args.set))).cubin
    print(f"FA4 SM90 backward config at hdim {args.hdim}: {cfg}")
    rows = {"FA4": counts(sass(theirs, os.path.join(args.out, f"fa4_h{args.hdim}"))),
            "ours": counts(sass(ours, os.path.join(args.out, f"ours_h{args.hdim}")))}
    print(f"{'opcode':>18} {'FA4':>7} {'ours':>7}")
    for name in (*OPS, "total"):
        if rows["FA4"][name] or rows["ours"][name]:
            print(f"{name:>18} {rows['FA4'][name]:7d} {rows['ours'][name]:7d}")
    print(f"SASS in {args.out}/fa4_h{args.hdim}.sass and ours_h{args.hdim}.sass")


if __name__ == "__main__":
    main()
