"""Shared memory as the launch requests it, against the configs' Python model."""

from flashhopper.config import SMEM_CAPACITY, SMEM_RESERVED_PER_CTA

# The model (FwdConfig / BwdConfig.smem_bytes: buffers + mbarriers + 1 KiB of alignment) leaves out
# the rest of the DSL's alignment padding (before each 1024-aligned buffer) and the 1 KiB Hopper
# reserves per CTA (counted in the cubin's static shared memory): measured 1.9-3.0 KiB over it.
MODEL_SLACK = 3 * 1024
# That reserve (config.SMEM_RESERVED_PER_CTA) is not part of the 227 KiB a CTA may request: a backward
# variant whose dynamic + static bytes came to exactly SMEM_CAPACITY + 1 KiB launched and passed (H100)


def assert_smem(report, cfg):
    """What the kernel's launch requests (dynamic, read from its host code, + static) fits the SM,
    and the planner's model is at most MODEL_SLACK below it."""
    real = report["smem_bytes"]
    assert real <= SMEM_CAPACITY + SMEM_RESERVED_PER_CTA, (repr(cfg), real)
    assert 0 <= real - cfg.smem_bytes() <= MODEL_SLACK, (repr(cfg), real, cfg.smem_bytes())
