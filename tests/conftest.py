import os
import random

import numpy as np
import pytest
import torch

from flashhopper.config import parse_overrides


def hopper_available() -> bool:
    try:
        return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    except Exception:  # a broken driver counts as no GPU: the CPU suite must still run
        return False


def pytest_collection_modifyitems(config, items):
    # a variant that has never run on a GPU could hang the whole GPU suite: its tests run only when asked
    if os.environ.get("FH_TEST_EXPERIMENTAL") != "1":
        later = pytest.mark.skip(reason="experimental kernel variant: set FH_TEST_EXPERIMENTAL=1")
        for item in items:
            if "experimental" in item.keywords:
                item.add_marker(later)
    if hopper_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA Hopper GPU (sm_90)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


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
