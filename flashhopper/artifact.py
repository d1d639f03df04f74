"""What a kernel builder in flashhopper.hopper.KERNELS returns (flashhopper inspect)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompiledArtifact:
    name: str
    cubin: bytes
    smem_bytes: int  # dynamic + static shared memory per CTA, as launched
    ptxas_log: str = ""
