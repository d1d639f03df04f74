"""Compile-side inspection that needs no GPU: registers, spills, shared memory and SASS counts.

The CuTe DSL compiles for sm_90a on a CPU-only machine as long as the arch is fixed before
`cutlass` is imported; the cubin it produces is then read with cuobjdump/nvdisasm (pip wheels).
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings

from flashhopper.artifact import CompiledArtifact  # noqa: F401 (what KERNELS' builders return)

TARGET_ARCH = "sm_90a"
# Opcode families counted in SASS. A line counts for NAME when its opcode is NAME or NAME.<modifiers>.
# ACQBULK: griddepcontrol.wait, PREEXIT: griddepcontrol.launch_dependents (programmatic dependent launch:
# BwdConfig.pdl, FwdConfig.pdl, CombineConfig.pdl)
SASS_OPCODES = ("HGMMA", "QGMMA", "UTMALDG", "UTMASTG", "UTMAREDG", "SYNCS", "BAR", "MUFU.EX2", "MUFU.TANH",
                "LDL", "STL", "ACQBULK", "PREEXIT", "LDS", "STS", "LDSM", "STSM", "PRMT", "F2FP")
INSTALL_HINT = "pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm"


def ensure_arch_env() -> None:
    """Pin the DSL to sm_90a; must run before the first `import cutlass`.

    The DSL reads CUTE_DSL_ARCH once at import and, with no GPU to query, falls back to sm_100a,
    where every Hopper-only op refuses to build.
    """
    os.environ.setdefault("CUTE_DSL_ARCH", TARGET_ARCH)
    if "cutlass" not in sys.modules:
        return
    arch = _imported_dsl_arch()
    if arch != os.environ["CUTE_DSL_ARCH"]:
        warnings.warn(
            f"cutlass was imported before flashhopper.compile.ensure_arch_env() with arch {arch!r}; "
            f"kernels will not build for {os.environ['CUTE_DSL_ARCH']}. "
            "Export CUTE_DSL_ARCH=sm_90a before starting Python.",
            RuntimeWarning,
            stacklevel=2,
        )


def _imported_dsl_arch() -> str | None:
    try:
        from cutlass.cutlass_dsl import CuTeDSL

        # The private field, not the property: reading the property would trigger GPU detection.
        return CuTeDSL._get_dsl().envar._arch
    except Exception:
        return None


def _candidate_dirs() -> list[str]:
    dirs = []
    for entry in sys.path:
        if entry and os.path.isdir(os.path.join(entry, "nvidia")):
            dirs += sorted(glob.glob(os.path.join(entry, "nvidia", "*", "bin")))
    return dirs


def _find_tool(tool: str) -> str | None:
    for d in _candidate_dirs():
        path = os.path.join(d, tool)
        if os.access(path, os.X_OK):
            return path
    found = shutil.which(tool)
    if found:
        return found
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and os.access(os.path.join(root, "bin", tool), os.X_OK):
            return os.path.join(root, "bin", tool)
    return None


def find_sass_tools() -> tuple[str, str]:
    """(cuobjdump, nvdisasm): the nvidia pip wheels first, then PATH, then $CUDA_HOME/bin."""
    cuobjdump, nvdisasm = _find_tool("cuobjdump"), _find_tool("nvdisasm")
    missing = [name for name, path in (("cuobjdump", cuobjdump), ("nvdisasm", nvdisasm)) if path is None]
    if missing:
        raise FileNotFoundError(
            f"{' and '.join(missing)} not found (looked in nvidia/*/bin on sys.path, PATH, $CUDA_HOME/bin); "
            f"install them with: {INSTALL_HINT}"
        )
    return cuobjdump, nvdisasm


_FUNCTION_USAGE = re.compile(r"Function\s+(\S+?):\s*\n\s*(.*)")
_USAGE_FIELD = re.compile(r"([A-Z_]+(?:\[\d+\])?):(\d+)")
_SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;")
_PREDICATE = re.compile(r"^@!?U?P[T0-9]+\s+")


def parse_resource_usage(text: str) -> dict[str, dict[str, int]]:
    """`cuobjdump --dump-resource-usage` -> {function: {"REG": .., "STACK": .., ...}}."""
    return {
        name: {key: int(val) for key, val in _USAGE_FIELD.findall(fields)}
        for name, fields in _FUNCTION_USAGE.findall(text)
    }


def parse_sass(text: str) -> list[tuple[str, str]]:
    """`cuobjdump -sass` -> [(opcode, operands)], predicate guards stripped."""
    instructions = []
    for line in text.splitlines():
        match = _SASS_LINE.match(line)
        if not match:
            continue
        body = _PREDICATE.sub("", match.group(1))
        opcode, _, operands = body.partition(" ")
        instructions.append((opcode, operands.strip()))
    return instructions


def sass_digest(text: str) -> str:
    """sha256 of the instructions in `cuobjdump -sass` text (their addresses and encodings left out):
    the same for the same code compiled twice, so a change that should leave a kernel alone can be
    checked without a GPU (`flashhopper inspect`, scripts/cubin_hashes.py)."""
    body = "\n".join(m.group(1) for m in map(_SASS_LINE.match, text.splitlines()) if m)
    return hashlib.sha256(body.encode()).hexdigest()


_ADDRESSED = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_BRA_DIV = re.compile(r"BRA\.DIV\s+\S+,\s*0x([0-9a-f]+)")


def diverged_count(text: str, opcode: str) -> int:
    """How many `opcode` instructions of `cuobjdump -sass` text lie in the code that BRA.DIVs branch to
    (from the lowest such target on: ptxas places it after the code a converged warp runs)."""
    lines = [(int(m.group(1), 16), _PREDICATE.sub("", m.group(2)))
             for m in map(_ADDRESSED.match, text.splitlines()) if m]
    targets = [int(t.group(1), 16) for _, body in lines if (t := _BRA_DIV.match(body))]
    if not targets:
        return 0
    start = min(targets)
    return sum(1 for address, body in lines if address >= start and body.split(" ")[0].startswith(opcode))


def count_opcodes(instructions, names=SASS_OPCODES) -> dict[str, int]:
    return {
        name: sum(1 for op, _ in instructions if op == name or op.startswith(name + "."))
        for name in names
    }


def setmaxnreg_values(instructions) -> list[dict]:
    """Each distinct USETMAXREG as {"kind": "DEALLOC.CTAPOOL" | "TRY_ALLOC.CTAPOOL" | ..., "regs": n}."""
    seen = []
    for op, operands in instructions:
        if not op.startswith("USETMAXREG"):
            continue
        last = operands.split(",")[-1].strip()
        try:
            regs = int(last, 0)
        except ValueError:
            continue
        entry = {"kind": op.partition(".")[2], "regs": regs}
        if entry not in seen:
            seen.append(entry)
    return seen


def parse_ptxas_spills(log: str) -> int:
    """Largest 'N bytes spill stores/loads' in a ptxas -v log (0 when absent)."""
    values = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    return max(values, default=0)


def _run(cmd: list[str], env: dict) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def inspect_cubin(cubin: bytes, smem_bytes: int | None = None, ptxas_log: str = "") -> dict:
    """Registers, spills, shared memory and SASS opcode counts of the heaviest kernel in `cubin`;
    `smem_bytes`: the dynamic shared memory its launch requests.

    `registers` is the launch allocation; for a warp-specialized kernel the consumer warpgroups run
    with what USETMAXREG grants them (listed under sass["USETMAXREG"]).
    """
    cuobjdump, nvdisasm = find_sass_tools()
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(nvdisasm) + os.pathsep + env.get("PATH", "")
    with tempfile.TemporaryDirectory(prefix="flashhopper-") as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        usage = parse_resource_usage(_run([cuobjdump, "--dump-resource-usage", path], env))
        sass_text = _run([cuobjdump, "-sass", path], env)
    instructions = parse_sass(sass_text)
    if not usage:
        raise RuntimeError("cuobjdump found no kernel in the cubin")
    name, main = max(usage.items(), key=lambda item: item[1].get("REG", 0))
    local_stack = main.get("LOCAL", 0) + main.get("STACK", 0)
    sass = count_opcodes(instructions)
    setmaxnreg = setmaxnreg_values(instructions)
    sass["USETMAXREG"] = sorted({e["regs"] for e in setmaxnreg})
    # WGMMAs that wait for the warpgroup's previous ones (gsb0): one per commit group when ptxas
    # keeps the async pipeline, every one of them when it has serialized the kernel's WGMMAs
    # (QGMMA, FP8's, counted with them)
    sass["HGMMA_WAITS"] = sum(1 for op, args in instructions
                              if op.startswith(("HGMMA", "QGMMA")) and "gsb0" in args)
    # 16-byte global loads (the backward preprocess is written to use only these for O and dO)
    sass["LDG.128"] = sum(1 for op, _ in instructions if op.startswith("LDG") and op.endswith(".128"))
    sass["STG.128"] = sum(1 for op, _ in instructions if op.startswith("STG") and op.endswith(".128"))
    # global loads of any width, 16-byte shared loads (the FP8 per-token kernels' k descales: read by the
    # producer warp, by the consumers from smem)
    sass["LDG"] = sum(1 for op, _ in instructions if op == "LDG" or op.startswith("LDG."))
    sass["LDS.128"] = sum(1 for op, _ in instructions if op.startswith("LDS") and op.endswith(".128"))
    # thread-block clusters: multicast TMA loads, mbarrier arrives that go through the cluster's
    # shared window (.RED: to a peer CTA, or to our own by its cluster address), cluster barriers
    ops = [op for op, _ in instructions]
    # copies of warp-synchronous code that ptxas adds for a warp it cannot prove converged, reached only
    # through a BRA.DIV (never, where the warp is converged) and placed after the rest of the code
    sass["UTMALDG_DIVERGED"] = diverged_count(sass_text, "UTMALDG")
    sass["UTMALDG_MULTICAST"] = sum(1 for op in ops if op.startswith("UTMALDG") and "MULTICAST" in op)
    sass["SYNCS_ARRIVE_RED"] = sum(1 for op in ops if op.startswith("SYNCS.ARRIVE") and ".RED" in op)
    sass["UCGABAR"] = sum(1 for op in ops if op.startswith("UCGABAR"))
    return {
        "function": name,
        "registers": main.get("REG", 0),
        "spill_bytes": max(local_stack, parse_ptxas_spills(ptxas_log)),
        # what a launch takes: the dynamic bytes it requests (read from the host code) + the static
        "smem_bytes": (smem_bytes or 0) + main.get("SHARED", 0),
        "instructions": len(instructions),
        "sass_sha256": sass_digest(sass_text),
        "sass": sass,
        "usetmaxreg": setmaxnreg,
        "resource_usage": usage,
    }


def inspect_kernel(name: str, **cfg) -> dict:
    """Build kernel `name` from flashhopper.hopper.KERNELS with `cfg` (dtype, hdim, causal, ...)."""
    ensure_arch_env()
    from flashhopper.hopper import KERNELS

    if name not in KERNELS:
        raise KeyError(f"unknown kernel {name!r}; available: {', '.join(sorted(KERNELS))}")
    artifact = KERNELS[name](**cfg)
    report = inspect_cubin(artifact.cubin, artifact.smem_bytes, artifact.ptxas_log)
    return {"kernel": name, "config": cfg, **report}
