"""`flashhopper precompile`: every dispatched kernel compiled into the disk cache by parallel worker
processes, so that later processes (training ranks, test runs, benchmarks) load instead of compile.

Compiling needs no GPU: the kernels are built for sm_90a on any x86-64 Linux machine with the DSL,
and the cache entries carry no trace of the machine beyond the versions in their fingerprint.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor

from flashhopper.compile import ensure_arch_env
from flashhopper.config import BwdConfig, BwdPreConfig, CombineConfig, FwdConfig

# longest compiles first, so that the pool does not end on one long kernel
_ORDER = {BwdConfig: 0, FwdConfig: 1, BwdPreConfig: 2, CombineConfig: 3}


def _compile_one(cfg) -> tuple[str, float]:
    """In a worker: the kernel's cubin through the cache (compiled and stored on a miss; a process
    that got the entry's lock first makes this a load). Returns (what happened, seconds)."""
    from flashhopper.hopper import kernel_cache, runtime

    before = kernel_cache.stats["compiled"]
    t0 = time.perf_counter()
    runtime.kernel_cubin(cfg)
    return ("compiled" if kernel_cache.stats["compiled"] > before else "loaded"), time.perf_counter() - t0


def precompile(configs, jobs: int | None = None, log=print) -> dict:
    """Compile `configs` (from plan.dispatched_kernels) that the disk cache lacks, `jobs` at a time."""
    ensure_arch_env()  # the workers inherit the environment: sm_90a before they import the DSL
    from flashhopper.hopper import kernel_cache

    if kernel_cache._disk() is None:
        raise OSError(f"no writable kernel cache folder ({kernel_cache.entry_dir()}): set "
                      f"{kernel_cache.ENV_DIR} to one, and {kernel_cache.ENV_DISK} not to 0")
    t0 = time.perf_counter()
    todo = sorted((c for c in configs if not kernel_cache.is_cached(c)),
                  key=lambda c: (_ORDER[type(c)], -c.hdim))
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(todo) or 1))
    log(f"{len(configs)} kernels, {len(configs) - len(todo)} already cached in {kernel_cache.entry_dir()}; "
        f"compiling {len(todo)} with {jobs} worker process(es)")
    outcome = {"compiled": 0, "loaded": 0}
    seconds = 0.0
    if todo:
        context = multiprocessing.get_context("spawn")  # no forked DSL or CUDA state in the workers
        with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
            for i, (cfg, (what, secs)) in enumerate(zip(todo, pool.map(_compile_one, todo), strict=True)):
                outcome[what] += 1
                seconds += secs
                log(f"[{i + 1}/{len(todo)}] {what} {type(cfg).__name__} {cfg.dtype} hdim {cfg.hdim} "
                    f"({secs:.1f} s)")
    wall = time.perf_counter() - t0
    report = {"kernels": len(configs), "cached_before": len(configs) - len(todo), **outcome,
              "worker_seconds": round(seconds, 1), "wall_seconds": round(wall, 1), "jobs": jobs,
              "folder": str(kernel_cache.entry_dir())}
    log(f"done in {wall:.1f} s: {outcome['compiled']} compiled, {outcome['loaded']} found made by another "
        f"process, {report['cached_before']} were cached")
    return report
