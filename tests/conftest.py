import os
import random

import numpy as np
import pytest
import torch
from hypothesis import settings

from flashhopper.config import parse_overrides

# hypothesis: the same examples on every CI run (a failure there reproduces), random ones elsewhere
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# FH_REQUIRE_GPU=1 (make gpu-test): a GPU test that skips, or no Hopper GPU at all, is a failure
REQUIRE_GPU = os.environ.get("FH_REQUIRE_GPU") == "1"
# FH_TEST_FULL=1 (make test-full, make gpu-test-full): also the tests of kernel variants no user is
# dispatched (a config override); without it they are deselected, so `make gpu-test` runs only kernels
# `flashhopper precompile` built and can forbid compiling (FLASHHOPPER_JIT=0)
FULL = os.environ.get("FH_TEST_FULL") == "1"

# pytest-xdist workers (make test: one a core): one torch thread each, so that a worker's float64 math does
# not spin threads against the other worker's compiles (the decode fuzz's stand-ins ran 4x slower in CI)
if os.environ.get("PYTEST_XDIST_WORKER") and not torch.cuda.is_available():
    torch.set_num_threads(1)


def _is_variant(item) -> bool:
    """Marked `variant`, or parametrized with a non-empty `fields` override (a kernel no user gets). A
    test that builds no kernel (a config's refusal, its budget) names its parameter otherwise
    (`overrides`), or CI would leave it out."""
    fields = getattr(getattr(item, "callspec", None), "params", {}).get("fields")
    return "variant" in item.keywords or bool(fields)


def hopper_available() -> bool:
    """An sm_90 GPU is visible. No CUDA device at all is "no GPU"; a device that fails to answer is
    an error, not a reason to skip the GPU suite."""
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability() == (9, 0)


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: `-m variant` sees the marks added here
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _is_variant(item):
            item.add_marker(pytest.mark.variant)
    if not FULL:
        variants = [item for item in items if _is_variant(item)]
        if variants:
            config.hook.pytest_deselected(items=variants)
            items[:] = [item for item in items if not _is_variant(item)]
    # a variant that has never run on a GPU could hang the whole GPU suite: its tests run only when asked
    if os.environ.get("FH_TEST_EXPERIMENTAL") != "1":
        later = pytest.mark.skip(reason="experimental kernel variant: set FH_TEST_EXPERIMENTAL=1")
        for item in items:
            if "experimental" in item.keywords:
                item.add_marker(later)
    if hopper_available():
        return
    if REQUIRE_GPU:
        raise pytest.UsageError("FH_REQUIRE_GPU=1 but no NVIDIA Hopper GPU (sm_90) is visible")
    skip = pytest.mark.skip(reason="needs an NVIDIA Hopper GPU (sm_90)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_GPU and report.skipped and "gpu" in item.keywords and "experimental" not in item.keywords:
        report.outcome = "failed"
        report.longrepr = f"GPU test skipped under FH_REQUIRE_GPU=1: {report.longrepr}"


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _poison_for_gpu_tests(request, monkeypatch):
    """Every GPU test's outputs and workspaces start as NaN (runtime.poison)."""
    if "gpu" in request.keywords:
        from flashhopper.hopper import runtime  # no DSL import

        monkeypatch.setattr(runtime, "poison", True)
    yield


@pytest.fixture(autouse=True)
def _env_config_overrides():
    """FH_TEST_FWD_OVERRIDES / FH_TEST_BWD_OVERRIDES run every test with those FwdConfig /
    BwdConfig fields replaced (e.g. to GPU-test a candidate default before it is made one)."""
    fwd = parse_overrides(os.environ.get("FH_TEST_FWD_OVERRIDES", ""))
    bwd = parse_overrides(os.environ.get("FH_TEST_BWD_OVERRIDES", ""))
    if not (fwd or bwd):
        yield
        return
    from flashhopper.hopper import runtime  # imports the DSL: only when asked

    with runtime.config_overrides(**fwd), runtime.bwd_config_overrides(**bwd):
        yield


def pytest_terminal_summary(terminalreporter):
    """The kernels in the disk cache after the run (with a fresh $FLASHHOPPER_CACHE_DIR, as in CI:
    the kernels this run compiled, each once however many workers), and this process's compiles."""
    from flashhopper.hopper import kernel_cache  # no DSL import

    folder = kernel_cache.entry_dir()
    entries = len(list(folder.glob("*.json"))) if folder.is_dir() else 0
    s = kernel_cache.stats
    mine = f"; this process compiled {s['compiled']}, loaded {s['disk']}" if s["compiled"] + s["disk"] else ""
    terminalreporter.write_line(f"kernel cache: {entries} kernels in {folder}{mine}")
