"""Compiled kernels, kept in memory and on disk, so that no process compiles a kernel twice.

A kernel is named by its frozen config (FwdConfig, BwdConfig, BwdPreConfig: Python scalars only),
which with the versions of the DSL, TVM-FFI and flashhopper, a fingerprint of the kernel sources
and the target arch fixes the binary. The disk entry, under `$FLASHHOPPER_CACHE_DIR` (default
`$XDG_CACHE_HOME/flashhopper`, else `~/.cache/flashhopper`), in a folder per arch and fingerprint:

- `NAME.o`: the DSL's AOT export of the TVM-FFI function (`export_to_c`);
- `NAME.so`: that object linked by the system's C compiler (when there is one), which TVM-FFI
  loads with dlopen without importing the DSL (~2-3 s of a warm start on our H200's host); without
  it the object is loaded by the DSL (`cute.runtime.load_module`, JITLink). Either way: no tracing,
  no compile;
- `NAME.cubin`: the device code, for `flashhopper inspect` and the compile tests;
- `NAME.json`: the manifest, written last: the full key, the fingerprint, the sha256 of the
  other files, and what the launch requests (dynamic shared memory, block shape: read from the
  compiled host code, so that inspection reports what a launch really asks for). An entry whose
  manifest is missing, unreadable, for another key or whose files do not match their hashes is
  never loaded: it is compiled again and replaced.

Many processes (data-parallel ranks, `flashhopper precompile`'s workers, a test run) share the
folder: a missing kernel is compiled under an exclusive `flock` on `NAME.lock`, so N processes
asking together compile it once and the others load it; files are written to temporary names and
renamed into place. A folder that cannot be written is reported once, and kernels are then kept in
memory only. `FLASHHOPPER_DISK_CACHE=0` turns the disk off. `FLASHHOPPER_JIT=0` forbids compiling:
a kernel not in the cache raises (a deployment that must not stall on a compile; `make gpu-test`,
which proves the GPU suite runs on precompiled kernels alone).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from collections import Counter
from pathlib import Path

ARCH = "sm_90a"
FORMAT = 2
ENV_DIR = "FLASHHOPPER_CACHE_DIR"
ENV_DISK = "FLASHHOPPER_DISK_CACHE"
ENV_JIT = "FLASHHOPPER_JIT"
_FUNCTION = "func"  # the exported symbol's name in every object file

# what happened to each request this process made: memory / disk hits, compiles, and entries found
# broken and rebuilt (tests and `flashhopper precompile` read it)
stats: Counter = Counter()
# config -> seconds its compile took in this process
compile_seconds: dict = {}


@dataclasses.dataclass
class _Entry:
    fn: object  # the TVM-FFI function
    cubin: bytes | None = None
    launch: dict | None = None  # {"smem": dynamic shared bytes, "block": [x, y, z]} (launch_request)


_memory: dict = {}
_locks: dict = {}
_locks_guard = threading.Lock()
_disk_state: dict = {}  # "dir": Path | None once decided


def cache_root() -> Path:
    """The folder that holds every fingerprint's entries."""
    env = os.environ.get(ENV_DIR)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flashhopper"


# host-only modules of hopper/ (they do not import the DSL): editing them leaves every binary alone
_HOST_ONLY = {"runtime.py", "kernel_cache.py", "varlen_walk.py"}


def _kernel_sources() -> list[Path]:
    """Every file whose text can change a binary: the kernels, their builders and the configs."""
    package = Path(__file__).resolve().parent.parent
    kernels = [p for p in package.joinpath("hopper").glob("*.py") if p.name not in _HOST_ONLY]
    return sorted(kernels) + [package / "config.py"]


def versions() -> dict:
    """The DSL's and TVM-FFI's installed versions (from their metadata: importing the DSL to ask it
    would cost the warm path ~1 s) and flashhopper's."""
    from importlib.metadata import PackageNotFoundError, version

    from flashhopper.version import __version__

    found = {}
    for name in ("nvidia-cutlass-dsl", "apache-tvm-ffi"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "none"
    return {**found, "flashhopper": __version__}


_fingerprint: list = []


def fingerprint() -> str:
    """sha256 of the versions, the target arch, the entry format and the kernel sources' bytes."""
    if not _fingerprint:
        h = hashlib.sha256(json.dumps({"versions": versions(), "arch": ARCH, "format": FORMAT},
                                      sort_keys=True).encode())
        for path in _kernel_sources():
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        _fingerprint.append(h.hexdigest())
    return _fingerprint[0]


def key_text(cfg) -> str:
    """The config's full text: its class and every field, which must be a Python scalar."""
    if not dataclasses.is_dataclass(cfg) or not cfg.__dataclass_params__.frozen:
        raise TypeError(f"a kernel key must be a frozen config dataclass, got {type(cfg).__name__}")
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if value is not None and type(value) not in (bool, int, float, str):
            raise TypeError(f"{type(cfg).__name__}.{f.name} is a {type(value).__name__}; a kernel key "
                            "holds Python scalars only (a tensor would key on its identity)")
    return repr(cfg)


def entry_name(cfg) -> str:
    return f"{type(cfg).__name__}-{hashlib.sha256(key_text(cfg).encode()).hexdigest()[:32]}"


def entry_dir() -> Path:
    return cache_root() / f"{ARCH}-{fingerprint()[:16]}"


def _disk() -> Path | None:
    """The current entries' folder, or None when the disk is off or the folder cannot be written."""
    if "dir" in _disk_state:
        return _disk_state["dir"]
    path = None
    if os.environ.get(ENV_DISK, "1") != "0":
        path = entry_dir()
        try:
            path.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
                pass
        except OSError as exc:
            warnings.warn(f"flashhopper: the kernel cache folder {path} cannot be written ({exc}); kernels "
                          f"are compiled in memory only for this process. Set {ENV_DIR} to a writable "
                          f"folder, or {ENV_DISK}=0 to silence this.", RuntimeWarning, stacklevel=3)
            path = None
    _disk_state["dir"] = path
    return path


def reset() -> None:
    """Forget the in-process entries and the disk decision (tests; a changed environment)."""
    _memory.clear()
    _disk_state.clear()
    _fingerprint.clear()
    stats.clear()
    compile_seconds.clear()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


_preloaded: dict = {}


def _runtime_libraries() -> list[str]:
    """The DSL's runtime library and TVM-FFI's, found without importing the DSL (that import is
    ~2-3 s on our H200's host: most of a warm start); the DSL's own search when the layout is not the
    expected one (one CUDA flavour of the runtime installed)."""
    import glob
    import importlib.util

    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    found = []
    for root in (spec.submodule_search_locations or []) if spec else []:
        found += glob.glob(os.path.join(root, "cu*", "lib", "libcute_dsl_runtime.so"))
    if len(found) == 1:
        import tvm_ffi.libinfo

        return [found[0], tvm_ffi.libinfo.find_libtvm_ffi()]
    from cutlass.cute.runtime import find_runtime_libraries

    return find_runtime_libraries(enable_tvm_ffi=True)


def _preload() -> None:
    """Open the runtime libraries with RTLD_GLOBAL, so that the kernels' references to them resolve
    (the DSL's own loader opens them without it, which FA4 also works around)."""
    if not _preloaded:
        import ctypes

        for lib in _runtime_libraries():
            if os.path.exists(lib):
                _preloaded[lib] = ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
        _preloaded[""] = None


def _load_library(path: Path):
    """The TVM-FFI function in a linked entry (NAME.so): dlopen through TVM-FFI, no DSL import."""
    import tvm_ffi

    _preload()
    return tvm_ffi.load_module(str(path))[_FUNCTION]


def _load_object(path: Path):
    """The TVM-FFI function in an exported object file, through the DSL's JITLink loader."""
    _preload()
    from cutlass.cute.runtime import load_module

    return getattr(load_module(str(path), enable_tvm_ffi=True), _FUNCTION)


def _link(obj_path: Path) -> bytes | None:
    """The object linked into a shared library by the system's C compiler (its references to the
    runtime libraries left to the preload), or None without one: the entry is then loaded from
    the object by the DSL."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    lib = obj_path.with_suffix(".so")
    try:
        proc = subprocess.run([compiler, "-shared", "-o", str(lib), str(obj_path)], capture_output=True,
                              check=False, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    return lib.read_bytes() if proc.returncode == 0 and lib.exists() else None


def _read_valid(folder: Path, name: str, key: str) -> dict | None:
    """The manifest of a complete entry for `key` whose files match their hashes, or None (absent or
    broken). Its "cubin" is the cubin's bytes."""
    try:
        manifest = json.loads((folder / f"{name}.json").read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        stats["broken"] += 1
        return None
    if not (isinstance(manifest, dict) and manifest.get("format") == FORMAT and manifest.get("key") == key
            and manifest.get("fingerprint") == fingerprint()):
        stats["broken"] += 1
        return None
    exts = ("o", "cubin") + (("so",) if manifest.get("so_sha256") else ())
    try:
        files = {ext: (folder / f"{name}.{ext}").read_bytes() for ext in exts}
    except OSError:
        files = {}
    if not files or any(manifest.get(f"{ext}_sha256") != _sha(data) for ext, data in files.items()):
        stats["broken"] += 1
        return None
    return {**manifest, "cubin": files["cubin"]}


def _load_disk(folder: Path, name: str, key: str) -> _Entry | None:
    manifest = _read_valid(folder, name, key)
    if manifest is None:
        return None
    fn = None
    if manifest.get("so_sha256"):
        with contextlib.suppress(Exception):  # e.g. linked for another runtime layout: the object then
            fn = _load_library(folder / f"{name}.so")
    if fn is None:
        try:
            fn = _load_object(folder / f"{name}.o")
        except Exception:  # a valid hash of an object this DSL cannot load: compile it again
            stats["broken"] += 1
            return None
    stats["disk"] += 1
    return _Entry(fn, manifest["cubin"], manifest.get("launch"))


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the entry from other users of a shared folder
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# the DSL's launch configuration as its host code fills it: grid, block, dynamic shared bytes, stream,
# attributes, attribute count
_LAUNCH_STRUCT = "!llvm.struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)>"


def launch_request(ir_text: str) -> dict | None:
    """What the compiled host function asks of the kernel launch: {"smem": the dynamic shared memory
    bytes, "block": [x, y, z]}, read from the stores of constants into the DSL's launch configuration
    in the lowered host code (`fn.ir_module`); None when there is not exactly one launch with
    constant values."""
    found = []
    for body in ir_text.split("llvm.func ")[1:]:
        if _LAUNCH_STRUCT not in body:
            continue
        consts = dict(re.findall(r"(%\w+) = llvm\.mlir\.constant\((-?\d+) : i(?:32|64)\)", body))
        fields = dict(re.findall(r"(%\w+) = llvm\.getelementptr %\w+\[0, ([\d, ]+)\] : \(!llvm\.ptr\) -> "
                                 r"!llvm\.ptr, " + re.escape(_LAUNCH_STRUCT), body))
        values = {}
        for value, ptr in re.findall(r"llvm\.store (%\w+), (%\w+) : i(?:32|64), !llvm\.ptr", body):
            if ptr in fields:
                values[fields[ptr]] = int(consts[value]) if value in consts else None
        if "2" in values:
            found.append({"smem": values["2"], "block": [values.get(f"1, {i}") for i in range(3)]})
    if len(found) != 1 or found[0]["smem"] is None or None in found[0]["block"]:
        return None
    return found[0]


def _compile(cfg, build) -> tuple[object, bytes, dict | None]:
    """Compile with the cubin kept: (the TVM-FFI function, its cubin, its launch_request)."""
    if os.environ.get(ENV_JIT, "1") == "0":
        raise RuntimeError(f"flashhopper: kernel {entry_name(cfg)} ({key_text(cfg)}) is not in the kernel "
                           f"cache {entry_dir()} and {ENV_JIT}=0 forbids compiling it; run "
                           "`flashhopper precompile` (with the dtypes, head dims and --bwd you use) first")
    with tempfile.TemporaryDirectory(prefix="flashhopper-build-") as tmp:
        t0 = time.perf_counter()
        fn = build(cfg, f"--keep-cubin --dump-dir {tmp}")
        compile_seconds[cfg] = time.perf_counter() - t0
        stats["compiled"] += 1
        return fn, fn.__cubin__, launch_request(str(fn.ir_module))


def _store(folder: Path, name: str, key: str, fn, cubin: bytes, launch: dict | None, seconds: float) -> None:
    with tempfile.TemporaryDirectory(dir=folder, prefix=".export-") as tmp:
        obj_path = Path(tmp) / "kernel.o"
        fn.export_to_c(str(obj_path), function_name=_FUNCTION)
        obj, lib = obj_path.read_bytes(), _link(obj_path)
    files = {"o": obj, "cubin": cubin, **({"so": lib} if lib is not None else {})}
    for ext, data in files.items():
        _write_atomic(folder / f"{name}.{ext}", data)
    manifest = {"format": FORMAT, "key": key, "fingerprint": fingerprint(),
                **{f"{ext}_sha256": _sha(data) for ext, data in files.items()}, "launch": launch,
                "compile_seconds": round(seconds, 3), "versions": versions(),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    _write_atomic(folder / f"{name}.json", json.dumps(manifest, indent=1).encode())  # last: the commit


def _lock_for(cfg) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(cfg, threading.Lock())


def _get_entry(cfg, build) -> _Entry:
    entry = _memory.get(cfg)
    if entry is not None:
        stats["memory"] += 1
        return entry
    if hasattr(cfg, "check"):  # a config no kernel exists for says why, compiled or not (FLASHHOPPER_JIT=0)
        cfg.check()
    with _lock_for(cfg):  # threads of this process: one compile
        entry = _memory.get(cfg)
        if entry is not None:
            stats["memory"] += 1
            return entry
        key, name, folder = key_text(cfg), entry_name(cfg), _disk()
        if folder is None:
            entry = _Entry(*_compile(cfg, build))
        else:
            entry = _load_disk(folder, name, key)
            if entry is None:
                entry = _get_locked(folder, name, key, cfg, build)
        _memory[cfg] = entry
        return entry


def _get_locked(folder: Path, name: str, key: str, cfg, build) -> _Entry:
    """Under the entry's file lock: another process may have built it while we waited."""
    with open(folder / f"{name}.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            entry = _load_disk(folder, name, key)
            if entry is not None:
                return entry
            fn, cubin, launch = _compile(cfg, build)
            try:
                _store(folder, name, key, fn, cubin, launch, compile_seconds[cfg])
            except OSError as exc:  # a full disk: the kernel still runs
                warnings.warn(f"flashhopper: could not store kernel {name} in {folder} ({exc})",
                              RuntimeWarning, stacklevel=4)
            return _Entry(fn, cubin, launch)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def get(cfg, build):
    """The compiled kernel for `cfg`: from this process, else the disk, else `build(cfg, options)`
    (a TVM-FFI compile that keeps its cubin under the options' dump folder), stored for the next."""
    entry = _memory.get(cfg)  # the launch path's hit, kept to one dict look-up
    if entry is not None:
        return entry.fn
    return _get_entry(cfg, build).fn


def cubin(cfg, build) -> tuple[bytes, dict | None]:
    """The device code of the kernel `get` returns for `cfg` and its launch_request: from this
    process, else the disk (without loading the object), else compiled and stored as by `get`."""
    entry = _memory.get(cfg)
    if entry is None and (folder := _disk()) is not None:
        manifest = _read_valid(folder, entry_name(cfg), key_text(cfg))
        if manifest is not None:
            stats["disk"] += 1
            return manifest["cubin"], manifest.get("launch")
    entry = _get_entry(cfg, build)
    return entry.cubin, entry.launch


def is_cached(cfg) -> bool:
    """Whether a valid disk entry for `cfg` exists (no load, no compile)."""
    folder = _disk()
    return folder is not None and _read_valid(folder, entry_name(cfg), key_text(cfg)) is not None


def info() -> dict:
    """The cache folder, the current fingerprint's folder and, per fingerprint folder, its entries
    and bytes."""
    root, current = cache_root(), entry_dir()
    folders = []
    if root.is_dir():
        for d in sorted(p for p in root.iterdir() if p.is_dir()):
            files = [f for f in d.iterdir() if f.is_file()]
            kinds = Counter(f.name.split("-", 1)[0] for f in files if f.suffix == ".json")
            folders.append({"folder": str(d), "current": d == current, "entries": sum(kinds.values()),
                            "by_kind": dict(sorted(kinds.items())),
                            "bytes": sum(f.stat().st_size for f in files)})
    return {"root": str(root), "current": str(current), "fingerprint": fingerprint(), "versions": versions(),
            "disk": os.environ.get(ENV_DISK, "1") != "0", "folders": folders}


def clear(stale_only: bool = False) -> int:
    """Delete the cache's folders (only those of other fingerprints with `stale_only`); returns how
    many were removed. In-process entries stay usable."""
    root, current = cache_root(), entry_dir()
    removed = 0
    if root.is_dir():
        for d in root.iterdir():
            if d.is_dir() and not (stale_only and d == current):
                shutil.rmtree(d, ignore_errors=True)
                removed += 1
    _disk_state.clear()
    return removed
