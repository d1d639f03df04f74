"""FP8 (e4m3) inputs for `flash_attn_func`: quantization with the descales it takes, and Hadamard
incoherent processing.

    q8, qd = quantize(q, heads_k=k.shape[2])          # per (batch, kv head) scales, as FA3 takes them
    k8, kd = quantize(k)
    v8, vd = quantize(v)
    out = flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)   # bf16

    q8, qd = quantize(q, "block")                      # one scale per block of 128 rows of each head
    k8, kd = quantize(k, "block")                      # descales per token: (batch, heads, seqlen)

    qr, kr = hadamard(q), hadamard(k)                  # before quantizing: QK^T unchanged, outliers spread

Scales are chosen so that each group's largest magnitude maps to e4m3's largest finite value (448);
the descale is its inverse. "tensor" and "head": a float32 (batch, heads_k) descale (per-tensor: one
value, expanded), Q's groups the query heads of one kv head, since that descale form applies one q
descale per (batch, kv head) (FA3's convention). "block": one scale per block of `block` rows of each
(batch, head) of x (Q's own query heads), returned per token, (batch, heads, seqlen), each block's
descale repeated over its rows: the kernel applies q's descale per query row and k's per key
(hopper/fp8_descale.py), so any block size (or one scale per token, block=1) works with any of its
tiles. V keeps a (batch, heads_k) descale ("tensor" or "head"). The default block, 128 rows, is the
FP8 kernel's query tile and the block a fused producer (a projection's epilogue, a KV-cache page
writer) most often sees whole; the descales cost 4 bytes per row and head at any block size.

Hadamard rotation: x -> x (D H) / sqrt(n) along the head dim, H the n x n Walsh-Hadamard matrix and D
a diagonal of random signs (fixed by `seed`), block-diagonal with n = 32 at hdim 96 and 64 at 192
(powers of two). The matrix is orthogonal, so rotating Q and K by the same one leaves Q K^T as it
was, while a few large entries of a row are spread over all of it: e4m3's 3 mantissa bits then
cover the typical entries better (FlashAttention-3, Table 3). V and the output are not rotated.
"""

from __future__ import annotations

import functools
import math

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
GRANULARITIES = ("tensor", "head", "block")
BLOCK_ROWS = 128


def quantize(x: torch.Tensor, granularity: str = "head", heads_k: int | None = None, block: int = BLOCK_ROWS,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in e4m3, float32 descale) with x ~= x8 * descale per group.

    x: (batch, seqlen, heads, headdim), any float dtype. granularity "head": one scale per (batch,
    kv head) (for q, its query heads together: pass heads_k), descale (batch, heads_k); "tensor": one
    for all, expanded to (batch, heads_k); "block": one per `block` rows (the last block may be shorter)
    of each (batch, head) of x, descale per token (batch, heads, seqlen) (heads_k is not used)."""
    if x.dim() != 4:
        raise ValueError(f"x has rank {x.dim()}; accepted: rank 4, (batch, seqlen, heads, headdim)")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity is {granularity!r}; accepted: {', '.join(map(repr, GRANULARITIES))}")
    b, s, h, d = x.shape
    heads_k = h if heads_k is None else int(heads_k)
    if heads_k < 1 or h % heads_k:
        raise ValueError(f"heads_k is {heads_k}; it must divide the {h} heads of x")
    xf = x.float()
    if granularity == "block":
        return _quantize_blocks(xf, block)
    if granularity == "tensor":
        amax = xf.abs().amax().reshape(1, 1).expand(b, heads_k)
    else:
        amax = xf.view(b, s, heads_k, h // heads_k, d).abs().amax(dim=(1, 3, 4))
    descale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    per_head = descale.repeat_interleave(h // heads_k, dim=1)[:, None, :, None]
    x8 = (xf / per_head).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return x8, (descale if granularity == "head" else descale[:1, :1].expand(b, heads_k))


def _quantize_blocks(xf: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize's "block": one scale per `block` rows of each (batch, head), the descale per token."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block is {block!r}; accepted: a positive int (rows per scale)")
    b, s, h, _ = xf.shape
    blocks = -(-s // block)
    row_max = torch.zeros(b, blocks * block, h, device=xf.device)
    row_max[:, :s] = xf.abs().amax(dim=-1)
    amax = row_max.view(b, blocks, block, h).amax(dim=2)  # (b, blocks, h)
    descale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    per_row = descale.repeat_interleave(block, dim=1)[:, :s]  # (b, s, h)
    x8 = (xf / per_row[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return x8, per_row.transpose(1, 2).contiguous()


def _block(hdim: int) -> int:
    """Side of the Walsh-Hadamard blocks: the head dim if a power of two, else its largest power-of-
    two divisor of at least 32 (96 -> 32, 192 -> 64)."""
    if hdim & (hdim - 1) == 0:
        return hdim
    block = hdim & -hdim
    if block < 32:
        raise ValueError(f"hdim {hdim}: no power-of-two block of at least 32 divides it")
    return block


@functools.lru_cache(maxsize=32)
def hadamard_matrix(hdim: int, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    """The orthogonal float32 (hdim, hdim) rotation `hadamard` multiplies by: D H / sqrt(n), block-
    diagonal for head dims that are not powers of two."""
    n = _block(hdim)
    h = torch.ones(1, 1)
    while h.shape[0] < n:  # Sylvester's construction
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (hdim,), generator=torch.Generator().manual_seed(seed)) * 2.0 - 1.0
    rot = torch.block_diag(*[h] * (hdim // n)) / math.sqrt(n)
    return (signs[:, None] * rot).to(device)


def hadamard(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """x rotated along its head dim by hadamard_matrix (same dtype). Rotate Q and K with the same
    seed: Q K^T is unchanged up to the rounding of x's dtype."""
    rot = hadamard_matrix(x.shape[-1], seed, str(x.device))
    return (x.float() @ rot).to(x.dtype)
