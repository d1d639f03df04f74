"""The benchmark grid and FLOP convention shared with FlashAttention, cuDNN and FA4 numbers.

Total tokens are held at 16384 and the hidden size at 2048, so each point moves the same amount of
data per token and only the attention shape changes.
"""

from __future__ import annotations

from dataclasses import dataclass

TOTAL_TOKENS = 16384
HIDDEN = 2048
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HDIMS = (64, 128, 256)


def attention_flops(batch, heads, seqlen_q, seqlen_k, hdim, causal, backward=False) -> float:
    """Two matmuls of 2*sq*sk*d each per head; causal halves it; backward counts 2.5x forward."""
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * hdim
    if causal:
        flops /= 2
    return flops * 2.5 if backward else flops


@dataclass(frozen=True)
class Point:
    batch: int
    seqlen: int
    heads: int
    hdim: int
    causal: bool

    @property
    def flops(self) -> float:
        return attention_flops(self.batch, self.heads, self.seqlen, self.seqlen, self.hdim, self.causal)

    @property
    def bwd_flops(self) -> float:
        return attention_flops(self.batch, self.heads, self.seqlen, self.seqlen, self.hdim, self.causal,
                               backward=True)

    @property
    def label(self) -> str:
        mode = "causal" if self.causal else "full"
        return f"hdim {self.hdim} {mode} seqlen {self.seqlen} (b={self.batch}, h={self.heads})"


def make_point(seqlen: int, hdim: int, causal: bool, total_tokens=TOTAL_TOKENS, hidden=HIDDEN) -> Point:
    return Point(max(1, total_tokens // seqlen), seqlen, hidden // hdim, hdim, causal)


def standard_grid(hdims=HDIMS, causal=(False, True), seqlens=SEQLENS) -> list[Point]:
    return [make_point(s, d, c) for d in hdims for c in causal for s in seqlens]


def quick_grid() -> list[Point]:
    return standard_grid(hdims=(128, 64), causal=(False, True), seqlens=(1024, 8192))
