"""CuTe DSL kernels for Hopper (sm_90a)."""

import os

# The DSL snapshots its target architecture when cutlass is first imported; without a GPU it
# would otherwise default to a non-Hopper arch and the sm_90 MMA builders refuse to trace.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from flashhopper.hopper.runtime import (  # noqa: E402
    backward,
    backward_varlen,
    bwd_artifact,
    combine_config,
    combine_splits,
    forward,
    forward_split,
    forward_varlen,
    fwd_artifact,
)

KERNELS = {"fwd": fwd_artifact, "bwd": bwd_artifact}
# kernels that compile but have not been validated on a GPU (the demo says so)
NOT_YET_VALIDATED = frozenset()

__all__ = ["KERNELS", "NOT_YET_VALIDATED", "backward", "backward_varlen", "combine_config", "combine_splits",
           "forward", "forward_split", "forward_varlen"]
