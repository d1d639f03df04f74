"""The kernel cache on disk, with real sm_90a compiles (no GPU): hit, miss, a stale fingerprint, a
corrupt entry, an unwritable folder, and four processes racing on one key."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing
import warnings

import pytest

from flashhopper.compile import ensure_arch_env
from flashhopper.config import BwdPreConfig
from flashhopper.plan import dispatched_kernels

ensure_arch_env()

from flashhopper.hopper import kernel_cache, runtime  # noqa: E402

# the smallest kernel there is (~0.5 s to compile); each test that compiles uses its own variant
SMALL = BwdPreConfig("bf16", 64)


@pytest.fixture(autouse=True)
def _keep_the_runs_cache():
    """These tests reset the process's cache state: the rest of the test run gets it back (its
    kernels, and the compile counts the summary line reports)."""
    saved = [(d, d.copy()) for d in (kernel_cache.stats, kernel_cache.compile_seconds, kernel_cache._memory,
                                     kernel_cache._disk_state)]
    fingerprint = list(kernel_cache._fingerprint)
    yield
    for d, copy in saved:
        d.clear()
        d.update(copy)
    kernel_cache._fingerprint[:] = fingerprint


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache folder and a process that has compiled nothing yet."""
    monkeypatch.setenv(kernel_cache.ENV_DIR, str(tmp_path / "cache"))
    monkeypatch.delenv(kernel_cache.ENV_DISK, raising=False)
    kernel_cache.reset()
    return tmp_path / "cache"


def new_process():
    """What a new process knows: nothing in memory (the disk stays)."""
    kernel_cache.reset()


def files(cfg):
    folder, name = kernel_cache.entry_dir(), kernel_cache.entry_name(cfg)
    return {ext: folder / f"{name}.{ext}" for ext in ("o", "so", "cubin", "json")}


def test_miss_then_hit_from_memory_then_from_disk(cache):
    fn = runtime.get_kernel(SMALL)
    assert kernel_cache.stats["compiled"] == 1 and callable(fn)
    assert runtime.get_kernel(SMALL) is fn and kernel_cache.stats["compiled"] == 1
    entry = files(SMALL)
    manifest = json.loads(entry["json"].read_text())
    assert manifest["key"] == repr(SMALL) and manifest["fingerprint"] == kernel_cache.fingerprint()
    assert manifest["o_sha256"] == hashlib.sha256(entry["o"].read_bytes()).hexdigest()
    cubin = entry["cubin"].read_bytes()
    assert cubin[:4] == b"\x7fELF"

    new_process()
    loaded = runtime.get_kernel(SMALL)
    assert kernel_cache.stats["compiled"] == 0 and kernel_cache.stats["disk"] == 1
    assert callable(loaded) and type(loaded).__name__ == "Function"  # a tvm_ffi.Function from the object
    assert runtime.kernel_cubin(SMALL) == cubin


def test_inspection_and_launch_share_entries(cache):
    """A cubin read for inspection compiles and stores the entry the launch path then loads, and a
    second inspection in a new process is served from disk without loading the object."""
    cfg = dataclasses.replace(SMALL, hdim=96)
    cubin = runtime.kernel_cubin(cfg)
    assert kernel_cache.stats["compiled"] == 1
    new_process()
    assert runtime.kernel_cubin(cfg) == cubin
    assert kernel_cache.stats == {"disk": 1}
    runtime.get_kernel(cfg)
    assert kernel_cache.stats["compiled"] == 0


def test_loaded_without_the_dsl_when_linked(cache):
    """With a C compiler the entry has a linked NAME.so, which a new process loads through TVM-FFI
    without importing the DSL (checked in a fresh interpreter)."""
    import subprocess
    import sys

    cfg = dataclasses.replace(SMALL, hdim=192)
    runtime.get_kernel(cfg)
    assert files(cfg)["so"].exists()
    probe = ("import sys; from flashhopper.config import BwdPreConfig; "
             "from flashhopper.hopper import runtime, kernel_cache; "
             f"fn = runtime.get_kernel({cfg!r}); "
             "print(type(fn).__name__, dict(kernel_cache.stats), 'cutlass' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["Function", "{'disk':", "1}", "False"], out


def test_without_a_c_compiler_the_object_is_loaded_by_the_dsl(cache, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    cfg = dataclasses.replace(SMALL, hdim=256)
    runtime.get_kernel(cfg)
    assert not files(cfg)["so"].exists() and files(cfg)["o"].exists()
    new_process()
    assert callable(runtime.get_kernel(cfg)) and kernel_cache.stats == {"disk": 1}


def test_stale_fingerprint_is_a_miss(cache, monkeypatch):
    cfg = dataclasses.replace(SMALL, scale_d=True)
    runtime.get_kernel(cfg)
    old = files(cfg)
    new_process()
    monkeypatch.setattr(kernel_cache, "fingerprint", lambda: "f" * 64)  # the kernel sources changed
    runtime.get_kernel(cfg)
    assert kernel_cache.stats["compiled"] == 1 and files(cfg)["json"] != old["json"]
    assert old["json"].exists()  # the old entries stay until `flashhopper cache clear --stale`
    assert kernel_cache.clear(stale_only=True) == 1
    assert not old["json"].exists() and files(cfg)["json"].exists()


@pytest.mark.parametrize("damage", ["truncated object", "library of another kernel", "no manifest",
                                    "manifest of another fingerprint", "garbage manifest"])
def test_corrupt_entry_is_rebuilt_never_loaded(cache, monkeypatch, damage):
    cfg = dataclasses.replace(SMALL, zero_dq=True)
    runtime.get_kernel(cfg)
    entry = files(cfg)
    good = entry["o"].read_bytes()
    if damage == "truncated object":
        entry["o"].write_bytes(good[: len(good) // 2])
    elif damage == "library of another kernel":
        entry["so"].write_bytes(entry["so"].read_bytes().replace(b"flashhopper", b"flashhoppeR", 1))
    elif damage == "no manifest":
        entry["json"].unlink()
    elif damage == "manifest of another fingerprint":
        manifest = json.loads(entry["json"].read_text())
        entry["json"].write_text(json.dumps({**manifest, "fingerprint": "0" * 64}))
    else:
        entry["json"].write_text("{not json")
    new_process()
    loaded = []
    for loader in ("_load_object", "_load_library"):
        load = getattr(kernel_cache, loader)
        monkeypatch.setattr(kernel_cache, loader, lambda path, load=load: loaded.append(path) or load(path))
    assert callable(runtime.get_kernel(cfg))
    assert kernel_cache.stats["compiled"] == 1 and loaded == []  # compiled, not loaded
    assert (kernel_cache.stats["broken"] > 0) == (damage != "no manifest")  # seen before and under the lock
    manifest = json.loads(entry["json"].read_text())
    assert manifest["o_sha256"] == hashlib.sha256(entry["o"].read_bytes()).hexdigest()
    new_process()
    runtime.get_kernel(cfg)
    assert kernel_cache.stats["disk"] == 1 and kernel_cache.stats["compiled"] == 0


def test_unwritable_folder_warns_and_keeps_kernels_in_memory(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(kernel_cache.ENV_DIR, str(blocker / "cache"))  # a folder under a file: no root
    kernel_cache.reset()                                                 # escapes that, unlike chmod
    with pytest.warns(RuntimeWarning, match="cannot be written.*in memory only.*FLASHHOPPER_CACHE_DIR"):
        fn = runtime.get_kernel(SMALL)
    assert callable(fn) and kernel_cache.stats["compiled"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert runtime.get_kernel(dataclasses.replace(SMALL, pdl=True, zero_dq=True)) is not None


def test_disk_off(tmp_path, monkeypatch):
    monkeypatch.setenv(kernel_cache.ENV_DIR, str(tmp_path / "cache"))
    monkeypatch.setenv(kernel_cache.ENV_DISK, "0")
    kernel_cache.reset()
    runtime.get_kernel(SMALL)
    assert kernel_cache.stats["compiled"] == 1 and not (tmp_path / "cache").exists()


def test_jit_off_serves_cached_kernels_and_refuses_to_compile(cache, monkeypatch):
    runtime.get_kernel(SMALL)  # compiled and stored while compiling is allowed
    monkeypatch.setenv(kernel_cache.ENV_JIT, "0")
    new_process()
    assert callable(runtime.get_kernel(SMALL)) and kernel_cache.stats["disk"] == 1
    with pytest.raises(RuntimeError, match="FLASHHOPPER_JIT=0 forbids compiling.*flashhopper precompile"):
        runtime.get_kernel(dataclasses.replace(SMALL, hdim=192))
    assert kernel_cache.stats["compiled"] == 0


def _race(folder, barrier, cfg):
    import os

    os.environ[kernel_cache.ENV_DIR] = folder
    from flashhopper.hopper import kernel_cache as kc
    from flashhopper.hopper import runtime as rt

    barrier.wait()
    fn = rt.get_kernel(cfg)
    return kc.stats["compiled"], callable(fn), hashlib.sha256(rt.kernel_cubin(cfg)).hexdigest()


def test_four_processes_racing_on_one_key_compile_once(cache):
    cfg = dataclasses.replace(SMALL, hdim=128)
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        barrier = manager.Barrier(4)
        with context.Pool(4) as pool:
            results = pool.starmap(_race, [(str(cache), barrier, cfg)] * 4)
    assert sum(compiled for compiled, _, _ in results) == 1, results
    assert all(ok for _, ok, _ in results) and len({digest for _, _, digest in results}) == 1


def test_keys_are_scalars_only():
    for cfg in dispatched_kernels():
        assert kernel_cache.key_text(cfg) == repr(cfg)
    with pytest.raises(TypeError, match="frozen config dataclass"):
        kernel_cache.key_text({"hdim": 64})

    @dataclasses.dataclass(frozen=True)
    class WithTensor:
        seqlen: object

    import torch

    with pytest.raises(TypeError, match="Python scalars only"):
        kernel_cache.key_text(WithTensor(torch.tensor(3)))
