"""Decode over a KV cache with the grid filled: PackGQA and split-KV, arranged around the varlen forward.

One query token per item (decode) gives the varlen kernel one CTA per (query head, item): 32 CTAs
for one item with 32 heads on a 132-SM H200, each reading the whole cache of its KV head, the same
KV head read once per query head of its group. Two rearrangements of the same call fix that:

- PackGQA: the g = hq / hk query heads that share a KV head become g query rows of one head, so one
  CTA reads that KV head once (FlashAttention-2's swap of seqlen_q and the group for decode). Exact
  only where every packed row is the same query: one query token, no window (a window would be
  applied per row); causal is no mask for one query at the end of its keys.
- Split-KV: each item's keys cut into `splits` chunks of `chunk` positions (from the cache's capacity,
  known on the host, so nothing syncs and CUDA graphs capture it; FA3 sizes its splits from the
  capacity too), each chunk a sequence of its own with the item's queries copied; the chunks' outputs
  are merged by their LSE (`combine`). A chunk past an item's length has no key: 0 and -inf, weight 0.

The partial outputs are in the input dtype (the varlen kernel's output); the merge is in fp32. Without
a window and with one query token the rearranged call computes the same attention; the rule of
flashhopper/accuracy.py judges the rounding (tests/test_kvcache_gpu.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# split only where the unsplit grid leaves SMs idle, into chunks of at least this many keys
MIN_CHUNK = 256
MAX_SPLITS = 64
CHUNK_ALIGN = 128  # chunks start on the kernels' key-block boundaries (every tile_n divides 128 or is 128+)


@dataclass(frozen=True)
class DecodeLayout:
    heads_k: int
    pack_gqa: bool
    splits: int
    chunk: int  # positions per split (the whole capacity when splits == 1)

    @property
    def rearranged(self) -> bool:
        return self.pack_gqa or self.splits > 1


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def plan(*, batch: int, seqlen_q: int | None, heads_q: int, heads_k: int, capacity: int, window,
         num_splits: int, pack_gqa, sms: int) -> DecodeLayout:
    """The layout for one call. seqlen_q: the query length (None with packed queries: not rearranged);
    capacity: positions an item may hold; num_splits: 0 = choose, 1 = none, n = n (at most one per
    128 positions); pack_gqa: None = where it helps, True / False. Both are hints, as in FA3: a call
    they would not keep exact (more than one query token, a window) is not rearranged. sms: the SM
    count."""
    if not (seqlen_q == 1 and tuple(window) == (-1, -1)):
        return DecodeLayout(heads_k, False, 1, capacity)
    pack = heads_q > heads_k if pack_gqa is None else bool(pack_gqa)
    heads = heads_k if pack else heads_q
    if num_splits == 0:
        ctas = batch * heads
        splits = 1 if ctas >= sms else min(-(-sms // ctas), capacity // MIN_CHUNK, MAX_SPLITS)
    else:
        splits = num_splits
    splits = max(1, min(splits, -(-capacity // CHUNK_ALIGN)))
    if splits == 1:
        return DecodeLayout(heads_k, pack, 1, capacity)
    chunk = -(-capacity // splits)
    chunk = -(-chunk // CHUNK_ALIGN) * CHUNK_ALIGN
    return DecodeLayout(heads_k, pack, -(-capacity // chunk), chunk)  # no chunk wholly past the capacity


def plan_for(q, heads_k: int, capacity: int, window, num_splits: int, pack_gqa,
             packed_q: bool) -> DecodeLayout:
    """plan() for a (b, s_q, hq, d) q (packed_q: (total_q, hq, d), not rearranged) on its GPU."""
    sms = _sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device())
    return plan(batch=q.shape[0], seqlen_q=None if packed_q else q.shape[1], heads_q=q.shape[-2],
                heads_k=heads_k, capacity=capacity, window=window, num_splits=num_splits,
                pack_gqa=pack_gqa, sms=sms)


def rearrange(layout: DecodeLayout, q, starts_k, used_k):
    """(q rows, cu_seqlens_q, rows per sequence, key starts with one spare, used keys) for the varlen
    forward: sequence i * splits + j is item i's chunk j. q: (b, 1, hq, d); starts_k / used_k: int32
    (b,) on q's device."""
    b, _, hq, d = q.shape
    rows = q
    if layout.pack_gqa:  # query head h = kv head h // g, member h % g: g rows of the kv head
        rows = q.reshape(b, layout.heads_k, hq // layout.heads_k, d).transpose(1, 2)
    per_item, s = rows.shape[1], layout.splits
    q_rows = rows[:, None].expand(b, s, *rows.shape[1:]).reshape(b * s * per_item, rows.shape[2], d)
    cu_q = torch.arange(b * s + 1, device=q.device, dtype=torch.int32) * per_item
    offsets = torch.arange(s, device=q.device, dtype=torch.int32) * layout.chunk
    starts = (starts_k[:, None] + offsets[None]).reshape(-1)
    used = (used_k[:, None] - offsets[None]).clamp(0, layout.chunk).reshape(-1).to(torch.int32)
    return q_rows, cu_q, per_item, torch.cat([starts, starts[-1:]]), used


def merge_by_lse(o, lse, dim: int):
    """Partial outputs o (..., dv) over disjoint key sets, merged along `dim` by their fp32 LSEs (o's
    shape without the last extent): (out fp32, lse). A part with no key (-inf) weighs nothing; a
    row with no key in any part gets 0 and -inf."""
    top = lse.amax(dim=dim, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(lse - top)  # -inf -> 0
    total = weights.sum(dim=dim)
    divisor = torch.where(total > 0, total, torch.ones_like(total))
    out = (o.float() * weights[..., None]).sum(dim=dim) / divisor[..., None]
    return out, top.squeeze(dim) + torch.log(total)  # log 0 = -inf: no key anywhere


def combine(layout: DecodeLayout, o, lse, batch: int, heads_q: int):
    """The varlen forward's (o (b * splits * rows, heads, dv), lse (heads, b * splits * rows)) merged
    over the splits by their LSE in fp32 and unpacked: (out (b, 1, hq, dv) fp32, lse (b, hq, 1)).
    A query that saw no key in any split gets 0 and -inf."""
    s, heads = layout.splits, o.shape[1]
    rows = o.shape[0] // (batch * s)
    o = o.view(batch, s, rows, heads, o.shape[-1]).float()
    lse = lse.view(heads, batch, s, rows).permute(1, 2, 3, 0)  # (b, s, rows, heads)
    if s > 1:
        out, lse = merge_by_lse(o, lse, dim=1)
    else:
        out, lse = o[:, 0], lse[:, 0]
    if layout.pack_gqa:  # (b, g, hk, ...) -> (b, hk, g, ...) -> query heads
        out = out.transpose(1, 2).reshape(batch, heads_q, out.shape[-1])
        lse = lse.transpose(1, 2).reshape(batch, heads_q)
    else:
        out, lse = out.view(batch, heads_q, out.shape[-1]), lse.view(batch, heads_q)
    return out[:, None], lse[:, :, None]
