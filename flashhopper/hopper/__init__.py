"""CuTe DSL kernels for Hopper (sm_90a)."""

import os

# The DSL snapshots its target architecture when cutlass is first imported; without a GPU it
# would otherwise default to a non-Hopper arch and the sm_90 MMA builders refuse to trace.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from flashhopper.hopper.runtime import bwd_artifact, forward, fwd_artifact  # noqa: E402

# "bwd" is compile-checked only: it has not been run on a GPU yet and nothing dispatches it.
KERNELS = {"fwd": fwd_artifact, "bwd": bwd_artifact}
NOT_YET_VALIDATED = frozenset({"bwd"})

__all__ = ["KERNELS", "NOT_YET_VALIDATED", "forward"]
