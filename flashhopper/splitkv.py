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

The partial outputs are in the input dtype (the varlen kernel's output); the merge is in fp32, by
one kernel, hopper/combine.py (validation.decode_merge_enabled: the default since it passed on an H100),
which also unpacks a call without splits (in place of a copy), or where the kernel does not take the
tensors by merge_by_lse's torch ops (nine launches). Without
a window and with one query token the rearranged call computes the same attention; the rule of
flashhopper/accuracy.py judges the rounding (tests/test_kvcache_gpu.py).

By default (validation.decode_split_enabled) the same layout (`plan`) is run inside the kernel instead
(kvcache._split_call, FwdConfig.split_kv): q read in place, each split's keys from cache_seqlens in the
kernel, the partials merged by `merge_parts`; `rearrange` and `combine` are then
not used.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from flashhopper import validation
from flashhopper.config import COMBINE_MAX_SPLITS
from flashhopper.sms import available as available_sms

# split only where the unsplit grid leaves SMs idle (the count by wave efficiency: wave_splits), into
# chunks of at least this many keys
MIN_CHUNK = 256
MAX_SPLITS = COMBINE_MAX_SPLITS  # the merge kernel's bound (config.CombineConfig)
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


def _planned_sms(q) -> int:
    """The SMs a plan fills on q's GPU: its SM count less the SM margin (flashhopper/sms.py)."""
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return available_sms(_sm_count(index))


def plan(*, batch: int, seqlen_q: int | None, heads_q: int, heads_k: int, capacity: int, window,
         num_splits: int, pack_gqa, sms: int, align: int = CHUNK_ALIGN) -> DecodeLayout:
    """The layout for one call. seqlen_q: the query length (None with packed queries: not rearranged);
    capacity: positions an item may hold; num_splits: 0 = choose, 1 = none, n = n (at most one per
    `align` positions); pack_gqa: None = where it helps, True / False. Both are hints, as in FA3: a call
    they would not keep exact (more than one query token, a window) is not rearranged. sms: the SM
    count. align: chunks of whole multiples of it (CHUNK_ALIGN; a paged cache read by the kernels, whole
    pages too)."""
    if not (seqlen_q == 1 and tuple(window) == (-1, -1)):
        return DecodeLayout(heads_k, False, 1, capacity)
    pack = heads_q > heads_k if pack_gqa is None else bool(pack_gqa)
    heads = heads_k if pack else heads_q
    if num_splits == 0:
        ctas = batch * heads
        most = min(capacity // MIN_CHUNK, MAX_SPLITS)
        splits = 1 if ctas >= sms else wave_splits(ctas, sms, capacity, most, align)
    else:
        splits = num_splits
    splits, chunk = _chunks(capacity, splits, align)
    return DecodeLayout(heads_k, pack, splits, chunk)


def _chunks(capacity: int, splits: int, align: int = CHUNK_ALIGN) -> tuple[int, int]:
    """(splits, chunk) for `splits` asked: chunks of whole `align` positions (at most one per `align`
    positions), none wholly past the capacity, so there may be fewer than asked; (1, capacity) unsplit."""
    splits = max(1, min(splits, -(-capacity // align)))
    if splits == 1:
        return 1, capacity
    chunk = -(-capacity // splits)
    chunk = -(-chunk // align) * align
    return -(-capacity // chunk), chunk


# a split count whose last wave is at least this share as full as the best count's is taken (FA3)
WAVE_EFFICIENCY = 0.85


@functools.lru_cache(maxsize=1024)  # ~50 us of Python on every decode call otherwise
def wave_splits(ctas: int, sms: int, capacity: int, most: int, align: int = CHUNK_ALIGN) -> int:
    """The split count to ask for (_chunks) with `ctas` CTAs on `sms` SMs, by wave efficiency (FA3's
    num_splits_heuristic): n splits run ctas * n CTAs in ceil(ctas * n / sms) waves, busy
    ctas * n / (waves * sms) of the time (n as _chunks rounds it); the smallest n in 1..most within
    WAVE_EFFICIENCY of the best. 64 CTAs on 132 SMs: 2 splits (0.97), where 3 ran 1.45 waves (0.73)."""
    def efficiency(n):
        total = ctas * _chunks(capacity, n, align)[0]
        return total / (-(-total // sms) * sms)

    candidates = range(1, max(1, most) + 1)
    best = max(efficiency(n) for n in candidates)
    return next(n for n in candidates if efficiency(n) >= WAVE_EFFICIENCY * best)


def plan_for(q, heads_k: int, capacity: int, window, num_splits: int, pack_gqa,
             packed_q: bool, align: int = CHUNK_ALIGN) -> DecodeLayout:
    """plan() for a (b, s_q, hq, d) q (packed_q: (total_q, hq, d), not rearranged) on its GPU."""
    sms = _planned_sms(q)
    return plan(batch=q.shape[0], seqlen_q=None if packed_q else q.shape[1], heads_q=q.shape[-2],
                heads_k=heads_k, capacity=capacity, window=window, num_splits=num_splits,
                pack_gqa=pack_gqa, sms=sms, align=align)


# query tokens an item that kvcache's decode paths take: one (the split walk, PackGQA) or several packed
# into the split kernel's rows (QLEN_RANGE: kvcache._qlen_call)
DECODE_TOKENS = range(1, 17)
QLEN_RANGE = range(2, DECODE_TOKENS.stop)


def plan_qlen(*, batch: int, heads_q: int, heads_k: int, capacity: int, num_splits: int, sms: int,
              align: int = CHUNK_ALIGN) -> DecodeLayout:
    """The split of an item's keys for kvcache's decode of several query tokens (kvcache._qlen_call): always
    packed (each KV head's query heads of every token as rows of one CTA), split as one query token's
    PackGQA layout is (`plan`: batch * heads_k CTAs by wave efficiency, num_splits as its hint); the
    tokens' causal bounds are the kernel's mask (FwdConfig.token_rows), not the layout's."""
    return plan(batch=batch, seqlen_q=1, heads_q=heads_q, heads_k=heads_k, capacity=capacity, window=(-1, -1),
                num_splits=num_splits, pack_gqa=True, sms=sms, align=align)


def plan_qlen_for(q, heads_k: int, capacity: int, num_splits: int, align: int = CHUNK_ALIGN) -> DecodeLayout:
    """plan_qlen() for a (b, s_q, hq, d) q on its GPU."""
    sms = _planned_sms(q)
    return plan_qlen(batch=q.shape[0], heads_q=q.shape[2], heads_k=heads_k, capacity=capacity,
                     num_splits=num_splits, sms=sms, align=align)


def multiples(count: int, step: int, device, out=None):
    """int32 (count,): 0, step, 2 * step, ... in one kernel (into `out` where given; torch.arange refuses
    a step of 0)."""
    if out is None:
        out = torch.empty(count, dtype=torch.int32, device=device)
    return out.zero_() if step == 0 else torch.arange(0, count * step, step, out=out)


def rearrange(layout: DecodeLayout, q, starts_k, used_k, *, item_rows: int = 0,
              start_step: int | None = None):
    """(q rows, cu_seqlens_q, rows per sequence, key starts with one spare, used keys) for the varlen
    forward: sequence i * splits + j is item i's chunk j. q: (b, 1, hq, d); used_k: int32 (b,) on q's
    device; starts_k: the same, or None for item i's keys from row i * item_rows. The starts and the
    used lengths share one buffer (the spare start, never read, is the first used length). start_step:
    how far apart an item's chunks start (default the chunk: rows; over a paged cache read by the kernels,
    its pages: starts are page-table entries, item_rows the table's row stride)."""
    b, _, hq, d = q.shape
    rows = q
    if layout.pack_gqa:  # query head h = kv head h // g, member h % g: g rows of the kv head
        rows = q.reshape(b, layout.heads_k, hq // layout.heads_k, d).transpose(1, 2)
    per_item, s, chunk, n = rows.shape[1], layout.splits, layout.chunk, b * layout.splits
    q_rows = rows[:, None].expand(b, s, *rows.shape[1:]).reshape(n * per_item, rows.shape[2], d)
    cu_q = multiples(n + 1, per_item, q.device)
    bounds = torch.empty(max(2 * n, n + 1), dtype=torch.int32, device=q.device)
    starts, used = bounds[:n].view(b, s), bounds[n:2 * n].view(b, s)
    step = chunk if start_step is None else start_step
    if starts_k is None and b == 1:  # item 0 from row 0: its chunks' offsets are the starts
        offsets = multiples(s, step, q.device, out=bounds[:s])
        if step != chunk:
            offsets = multiples(s, chunk, q.device)
    else:
        offsets = multiples(s, chunk, q.device)
        if starts_k is None:
            starts_k = multiples(b, item_rows, q.device)
        torch.add(starts_k[:, None], offsets if step == chunk else multiples(s, step, q.device), out=starts)
    torch.sub(used_k[:, None], offsets, out=used).clamp_(0, chunk)
    return q_rows, cu_q, per_item, bounds[:n + 1], bounds[n:2 * n]


def merge_by_lse(o, lse, dim: int, *, out=None, lse_out=None, return_lse: bool = True):
    """Partial outputs o (..., dv) over disjoint key sets, merged along `dim` by their fp32 LSEs (o's
    shape without the last extent), in fp32 (o's dtype where wider): (out, lse), each written into
    `out` (any float dtype) / `lse_out` (fp32) where given (any strides: the unpacking and the cast
    cost no kernel of their own), else new fp32 tensors; lse None without return_lse. A part with no
    key (-inf) weighs nothing; a row with no key in any part gets 0 and -inf."""
    top = lse.amax(dim=dim, keepdim=True).nan_to_num_(0.0, 0.0, 0.0)  # as where(isfinite(top), top, 0)
    weights = (lse - top).exp_()  # -inf -> 0
    total = weights.sum(dim=dim)  # 0 (no key anywhere) or at least 1 (the top part weighs 1)
    if return_lse:  # log 0 = -inf: no key anywhere
        lse_out = torch.add(total.log(), top.squeeze(dim), out=lse_out)
    merged = (o * weights[..., None]).sum(dim=dim)
    out = torch.div(merged, total.clamp_min_(1.0)[..., None], out=out)  # 0 / 1 where no key
    return out, (lse_out if return_lse else None)


def combine(layout: DecodeLayout, o, lse, batch: int, heads_q: int, *, out=None, return_lse: bool = True,
            fused: bool = False):
    """The varlen forward's (o (b * splits * rows, heads, dv), lse (heads, b * splits * rows)) merged
    over the splits by their LSE in fp32 and unpacked: (out (b, 1, hq, dv), lse (b, hq, 1) fp32, or
    None without return_lse). out: written in place where given (any float dtype, any strides), else
    a new fp32 tensor. A query that saw no key in any split gets 0 and -inf. `fused` (CUDA tensors):
    in one kernel (hopper/combine.py) where validation.decode_merge_enabled() and the kernel takes the
    tensors (runtime.combine_config), else by merge_by_lse (a copy without splits)."""
    s, heads, dv = layout.splits, o.shape[1], o.shape[-1]
    rows = o.shape[0] // (batch * s)
    o = o.view(batch, s, rows, heads, dv)
    lse = lse.view(heads, batch, s, rows).permute(1, 2, 3, 0)  # (b, s, rows, heads)
    if out is None:
        out = _output((batch, 1, heads_q, dv), o.device, fused)
    lse_out = _output((batch, heads_q, 1), o.device, fused) if return_lse else None
    # views of the results in the rows' layout: query head h is row h % rows of head h // rows
    out_rows = out[:, 0].unflatten(1, (heads, rows)).transpose(1, 2)  # (b, rows, heads, dv)
    lse_rows = lse_out[..., 0].unflatten(1, (heads, rows)).transpose(1, 2) if return_lse else None
    merge_parts(o, lse, out_rows, lse_rows, kernel=fused and validation.decode_merge_enabled())
    return out, lse_out


def _output(shape, device, poisoned: bool):
    """A new fp32 output of `combine`; `poisoned` (on the kernels' path) NaN where runtime.poison is set
    (the tests, the fuzz: an element the merge leaves unwritten shows)."""
    t = torch.empty(shape, dtype=torch.float32, device=device)
    if poisoned:
        from flashhopper.hopper import runtime

        if runtime.poison:
            t.fill_(float("nan"))
    return t


def merge_parts(o, lse, out, lse_out=None, *, kernel: bool = True):
    """Partial outputs o (b, splits, rows, heads, dv) with their fp32 LSEs (b, splits, rows, heads), merged
    over the splits into out (b, rows, heads, dv) and lse_out (b, rows, heads) fp32 (None: not wanted), all
    views of any strides: with `kernel` (CUDA tensors) in one launch of the merge kernel (hopper/combine.py)
    where it takes the tensors (runtime.combine_config), else by merge_by_lse (a copy with one split)."""
    s = o.shape[1]
    if kernel:
        import flashhopper.hopper as hopper

        cfg = hopper.combine_config(o, out, s)
        if cfg is not None:
            if lse_out is None:  # written and dropped: an allocation, no kernel
                lse_out = torch.empty(out.shape[:-1], dtype=torch.float32, device=o.device)
            hopper.combine_splits(cfg, o, lse, out, lse_out)
            return
    if s > 1:
        merge_by_lse(o, lse, dim=1, out=out, lse_out=lse_out, return_lse=lse_out is not None)
    else:
        out.copy_(o[:, 0])
        if lse_out is not None:
            lse_out.copy_(lse[:, 0])
