"""The GPU's state beside each timed sample: SM clock, board power and whether the power cap holds the
clock down, read by NVML (pynvml; absent: nothing is read). The backward's 10-20% swings between
allocations were the power cap: near 700 W an H100 SXM drops its SM clock from 1980 to 1300-1600 MHz
whichever kernel runs, while each allocation's kernel profiled alone runs within 0.2% of the others
(docs/design.md, "Speed between allocations"). Recorded beside the samples, a slow sample shows its cause."""

from __future__ import annotations

import functools

# nvmlClocksThrottleReasons: the software power cap, and the hardware's power brake / slowdown
_POWER_REASONS = 0x4 | 0x80 | 0x8


@functools.cache
def _handle(index: int):
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
        # NVML numbers the GPUs as the machine does, CUDA as CUDA_VISIBLE_DEVICES lists them
        nvml_index = torch.cuda._get_nvml_device_index(index)
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(nvml_index)
    except Exception:  # no NVML (CPU machines, containers without it): no state
        return None


def read(index: int = 0) -> dict | None:
    """{"sm_mhz", "watts", "power_capped"} of CUDA device `index` now, or None without NVML."""
    got = _handle(index)
    if got is None:
        return None
    nvml, handle = got
    try:
        reasons = nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)
        return {"sm_mhz": nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
                "watts": nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
                "power_capped": bool(reasons & _POWER_REASONS)}
    except Exception:
        return None
