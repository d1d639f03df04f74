"""What a kernel builder in flashhopper.hopper.KERNELS returns (flashhopper inspect)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompiledArtifact:
    name: str
    cubin: bytes
    smem_bytes: int  # the dynamic shared memory per CTA its launch requests (inspection adds the static)
    ptxas_log: str = ""
