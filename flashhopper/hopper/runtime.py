"""Launching the Hopper kernels: which kernel a call runs, its workspaces and its arguments.

Kernels come from the kernel cache (kernel_cache.py: in memory, then on disk, then compiled by
build.py), one per static configuration (dtype, hdim, mask kind, softcap, tiles); shapes and strides
are runtime arguments and never trigger a compile. This module does not import the CuTe DSL: a
process whose kernels are all on disk loads them without tracing anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import warnings

import torch

from flashhopper import plan, sms, validation
from flashhopper.artifact import CompiledArtifact
from flashhopper.config import (
    COMBINE_MAX_SPLITS,
    BwdConfig,
    BwdPreConfig,
    CombineConfig,
    FwdConfig,
    fwd_grid,
    key_of_position,
)
from flashhopper.hopper import kernel_cache, varlen_walk
from flashhopper.hopper.host import PRE_ROWS_PER_CTA, softmax_constants
from flashhopper.plan import bwd_config, fwd_config

_TORCH_TO_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "e4m3"}

_overrides: dict = {}
# caps a persistent grid below the SM count, so that tests make every CTA loop over many tiles
persistent_ctas_cap: int | None = None


_bwd_overrides: dict = {}
# test hook (the GPU tests turn it on for every call): every output and workspace a kernel must
# write in full (out, LSE; dK, dV; the preprocess's rows; the dQ accumulator the
# preprocess clears) is filled with NaN first, so an element a kernel misses, or reads before its
# producer wrote it, shows as NaN in the result
poison = False
_NAN = float("nan")


@contextlib.contextmanager
def bwd_config_overrides(**fields):
    """Replace BwdConfig fields (e.g. tile_m=64) for the backward calls made inside the block."""
    saved = dict(_bwd_overrides)
    _bwd_overrides.update(fields)
    try:
        yield
    finally:
        _bwd_overrides.clear()
        _bwd_overrides.update(saved)


@contextlib.contextmanager
def config_overrides(**fields):
    """Replace FwdConfig fields (e.g. pingpong=False) for the calls made inside the block.

    For benchmarks and the ablation; each distinct configuration compiles once and is cached.
    """
    saved = dict(_overrides)
    _overrides.update(fields)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)


def _build(cfg, options: str):
    from flashhopper.hopper.build import compile_kernel  # the DSL: only when a kernel is compiled

    return compile_kernel(cfg, options)


def get_kernel(cfg):
    """The launchable kernel for a FwdConfig, BwdConfig, BwdPreConfig or CombineConfig (kernel_cache.get)."""
    return kernel_cache.get(cfg, _build)


def kernel_cubin(cfg) -> bytes:
    """Its cubin, from the same cache entry (inspection, compile tests)."""
    return kernel_cache.cubin(cfg, _build)[0]


def kernel_launch(cfg) -> dict:
    """What its launch requests, read from the compiled host code: {"smem": dynamic shared bytes,
    "block": [x, y, z]} (kernel_cache.launch_request)."""
    launch = kernel_cache.cubin(cfg, _build)[1]
    if launch is None:
        raise RuntimeError(f"the launch configuration of {cfg!r} could not be read from its host code")
    return launch


@functools.cache
def _sm_count(device_index) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _max_ctas(device_index) -> int:
    """The persistent grids' bound: the SM count (or the tests' persistent_ctas_cap) less the SM margin
    (flashhopper/sms.py)."""
    return sms.available(persistent_ctas_cap or _sm_count(device_index))


# Causal / local tiles are visited (head, batch) section by section, longest first inside each;
# a section's K and V should stay in L2 (50 MB on H100/H200) while its tiles run.
_L2_BUDGET = 32 << 20


def _l2_section(seqlen_k: int, cfg: FwdConfig, num_pairs: int) -> int:
    kv_bytes = seqlen_k * (cfg.hdim + cfg.hdim_v) * cfg.elem_bytes
    return max(1, min(num_pairs, _L2_BUDGET // kv_bytes))


# the split walk's scalars (FwdConfig.split_kv: forward_split) where a kernel takes none
_NO_SPLIT = (0, 0, 0, 0, 1)  # (splits, chunk, new keys, key rows, tokens): FlashFwdSm90's split arguments

_tile_counters: dict = {}


def _persistent_zeros(shape, dtype, device) -> torch.Tensor:
    """A zeroed tensor for a cache that outlives the call, kept out of CUDA graph memory pools.

    torch.compile's CUDA graphs (mode="reduce-overhead") warm up with the calling thread's
    allocations routed into the graph's pool, and refuse to record while a tensor there is held by
    anything but the graph's outputs. The routing is per thread, so the tensor is allocated by a
    helper thread (once per cache entry); it is zeroed on the caller's stream, so the caller's later
    kernels see the zeros."""
    stream = torch.cuda.current_stream(device)
    made = []

    def make():
        try:
            with torch.cuda.stream(stream):
                made.append(torch.zeros(shape, dtype=dtype, device=device))
        except BaseException as e:  # raised again in the caller's thread
            made.append(e)

    worker = threading.Thread(target=make, name="flashhopper-alloc")
    worker.start()
    worker.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


def _tile_counter(device, capturing: bool | None = None) -> torch.Tensor:
    """The dynamic scheduler's counter for the current stream on `device`: 2 int32 (the next
    tile to hand out, the CTAs done claiming), zeroed once here. The kernel leaves it at zero
    when it finishes (FwdTileScheduler.retire), so launches need no memset; the static schedule
    never touches it. Launches on one stream run in order, so one counter per stream is enough;
    two streams must not share one (their kernels may run at the same time).

    Under CUDA graph capture each launch gets its own counter, allocated in the graph's memory
    pool: graphs are captured on a stream of their own but replayed on any stream, so two graphs
    replayed at once on two streams would otherwise share the capture stream's counter. `capturing`:
    whether the current stream is capturing, where the caller has asked already (None: ask)."""
    if torch.cuda.is_current_stream_capturing() if capturing is None else capturing:
        return torch.zeros(2, dtype=torch.int32, device=device)
    # the raw handle: torch.cuda.current_stream() would build a Stream object on every call
    key = (device, torch._C._cuda_getCurrentRawStream(device.index))
    counter = _tile_counters.get(key)
    if counter is None:
        counter = _tile_counters[key] = _persistent_zeros(2, torch.int32, device)
    return counter


def _counter_for(cfg: FwdConfig, device) -> torch.Tensor:
    """The tile counter a forward launch passes: the dynamic scheduler's (_tile_counter), or for the
    static schedule, which never touches it, under CUDA graph capture an uninitialized one (an
    allocation, no kernel: _tile_counter's zeroed one would put a memset into every captured call,
    decode's included)."""
    if cfg.dynamic_sched or device.type != "cuda":
        return _tile_counter(device)
    capturing = torch.cuda.is_current_stream_capturing()  # asked once (a host call on every launch)
    return torch.empty(2, dtype=torch.int32, device=device) if capturing else _tile_counter(device, capturing)


def _fwd_plan_uncached(dtype, hdim: int, b: int, sq: int, sk: int, h: int, causal: bool, window_size,
                       softcap: bool, dv: int = 0, qk_descale: str = "head", need_lse: bool = True):
    """What a forward call launches, from its shapes and flags alone: (config, window_left,
    window_right, L2 section); `qk_descale`: FP8's descale form (validation.qk_descale_kind); `need_lse`
    off: the call returns no LSE (plan.fwd_plan)."""
    cfg, wl, wr = plan.fwd_plan(_TORCH_TO_NAME[dtype], hdim, sq, sk, causal, window_size, softcap, dv,
                                qk_descale=qk_descale, need_lse=need_lse)
    if _overrides:
        cfg = dataclasses.replace(cfg, **_overrides)
    section = _l2_section(sk, cfg, h * b) if cfg.causal or cfg.local else 1
    return cfg, wl, wr, section


# the dispatch above is ~5 us of Python, a visible share of a small call's ~30 us of host time;
# test / tuning overrides (_overrides) bypass the cache
_fwd_plan = functools.lru_cache(maxsize=4096)(_fwd_plan_uncached)


_ones: dict = {}


def fp8_transposed_v(v: torch.Tensor) -> torch.Tensor:
    """V (b, sk, hk, dv) as FwdConfig.vt_in_gmem takes it: (b, hk, dv, sk padded to 16), the keys of each
    16 in P's register order (config.key_of_position). The FP8 ablation's upper bound: the kernel then
    loads V^T with no transpose."""
    b, sk, hk, dv = v.shape
    padded = -(-sk // 16) * 16
    vt = torch.zeros(b, hk, dv, padded, dtype=v.dtype, device=v.device)
    vt[..., :sk] = v.permute(0, 2, 3, 1)
    order = torch.tensor([key_of_position(p) for p in range(16)], device=v.device)
    return vt.view(b, hk, dv, padded // 16, 16)[..., order].reshape(b, hk, dv, padded).contiguous()


def _unit_descale(device) -> torch.Tensor:
    """A (1, 1) fp32 one on `device`, expanded (stride 0) for an FP8 descale that was not given. Under
    CUDA graph capture a fresh one in the graph's pool (its fill is part of the graph, like the
    scheduler's counter); otherwise one per device, kept."""
    if torch.cuda.is_current_stream_capturing():
        return torch.ones((1, 1), dtype=torch.float32, device=device)
    one = _ones.get(device)
    if one is None:
        one = _ones[device] = _persistent_zeros((1, 1), torch.float32, device).add_(1.0)
    return one


def token_descales(descales, b: int, sq: int, h: int, sk: int, hk: int, device) -> tuple:
    """FP8 descales as the per-token kernel takes them: q's (b, h, sq), k's (b, hk, sk), v's (b, hk), from
    validated ones of either form (validation.check_descales); per-(batch, kv head) ones and those not
    given (1) as stride-0 views, except a per-head q descale with GQA (each kv head's repeated over its
    query heads: a (b, h) copy)."""
    qd, kd, vd = descales
    one = _unit_descale(device)
    if qd is None:
        qd = one[:, :, None].expand(b, h, sq)
    elif qd.dim() == 2:
        per_head = qd if qd.shape[1] == h else qd.repeat_interleave(h // qd.shape[1], dim=1)
        qd = per_head[:, :, None].expand(b, h, sq)
    if kd is None:
        kd = one[:, :, None].expand(b, hk, sk)
    elif kd.dim() == 2:
        kd = kd[:, :, None].expand(b, hk, sk)
    return qd, kd, one.expand(b, hk) if vd is None else vd


def forward(q, k, v, softmax_scale: float, causal: bool, window_size, softcap: float, out=None, lse=None,
            descales=(None, None, None), need_lse: bool = True):
    """Run the forward kernel on validated CUDA tensors; returns (out, lse).

    `out` / `lse` may be given preallocated (tests poison them to catch unwritten elements). FP8
    (float8_e4m3fn) q, k, v: `descales` are the validated fp32 q / k / v descales or None (1), (batch,
    heads_k) each, or q's and k's per token (validation.check_descales: then the per-token kernel);
    out is bf16. `need_lse` off: the caller drops the LSE (FP8 may then run the row sums by the tensor
    cores, plan.fp8_row_sum, whose LSE is not exact: it is still written, from those sums).
    """
    b, sq, h, d = q.shape
    plan = _fwd_plan_uncached if _overrides else _fwd_plan
    # the value head dim when it differs (SPLIT_HDIMS); the FP8 ablation's V^T (vt_in_gmem) has it elsewhere
    dv = 0 if _overrides.get("vt_in_gmem") or v.shape[-1] == d else v.shape[-1]
    kind = validation.qk_descale_kind(descales) if q.dtype == torch.float8_e4m3fn else "head"
    cfg, wl, wr, section = plan(q.dtype, d, b, sq, k.shape[1], h, causal, tuple(window_size), softcap > 0.0,
                                dv, kind, need_lse)
    fn = get_kernel(cfg)
    if out is None:
        out = torch.empty(b, sq, h, cfg.hdim_v, dtype=torch.bfloat16 if cfg.is_fp8 else q.dtype,
                          device=q.device)
        if poison:
            out.fill_(_NAN)
    if lse is None:
        lse = torch.empty(b, h, sq, dtype=torch.float32, device=q.device)
        if poison:
            lse.fill_(_NAN)
    scale_log2, softcap_pre = softmax_constants(softmax_scale, softcap)
    num_ctas = fwd_grid(cfg, sq, h * b, _max_ctas(q.device.index) if cfg.persistent
                        else None)
    counter = _counter_for(cfg, q.device)  # zero on entry: the previous launch on this stream reset it
    if cfg.token_descales:  # q's and k's per token (a per-head one repeated), a descale not given 1
        descales = token_descales(descales, b, sq, h, k.shape[1], k.shape[2], q.device)
    elif cfg.is_fp8:  # a descale not given is 1
        one = _unit_descale(q.device).expand(b, k.shape[2])
        descales = tuple(one if x is None else x for x in descales)
    # the varlen arguments (forward_varlen's) and the page table are None here
    fn(q, k, v, out, lse, counter, scale_log2, softcap_pre, wl, wr, num_ctas, section, *descales,
       None, None, None, None, None, None, *_NO_SPLIT)
    return out, lse


@functools.lru_cache(maxsize=4096)
def _varlen_plan(dtype, hdim: int, causal: bool, window_size, softcap: bool, dv: int = 0):
    return plan.fwd_plan_varlen(_TORCH_TO_NAME[dtype], hdim, causal, window_size, softcap, dv)


def varlen_config(dtype, hdim: int, causal: bool, window_size, softcap: bool, dv: int = 0,
                  decode: bool = False, page_size: int = 0):
    """What forward_varlen runs for a call: (config, window_left, window_right). `page_size`: over a
    paged cache, the paged config where the kernels serve the pages (its page_size is then page_size;
    plan.fwd_config_paged), else the unpaged one (0 there); kvcache asks before choosing the paged path."""
    cfg, wl, wr = _varlen_plan(dtype, hdim, causal, tuple(window_size), softcap, dv)
    if decode and not (cfg.causal or cfg.local) and validation.decode_tile_enabled():
        cfg = plan.fwd_plan_decode(cfg.dtype, hdim, softcap, dv)
    if page_size:
        cfg = plan.fwd_config_paged(cfg, page_size)
    if _overrides:  # tests, tuning
        cfg = dataclasses.replace(cfg, **_overrides)
    return cfg, wl, wr


def _used_lengths(cu_seqlens, seqused):
    """Each sequence's used rows as the kernels read them (int32, contiguous): seqused where given, else
    the packed lengths from cu_seqlens (already contiguous)."""
    return cu_seqlens[1:] - cu_seqlens[:-1] if seqused is None else seqused.contiguous()


def _rows_in_use(cu_seqlens, seqused, total: int):
    """(total,) bool: whether each packed row is among its sequence's first seqused rows (all its rows
    where `seqused` is None; False for rows no sequence covers), with no device-to-host copy."""
    batch = cu_seqlens.shape[0] - 1
    token = torch.arange(total, device=cu_seqlens.device, dtype=torch.int32)
    seq = (torch.searchsorted(cu_seqlens, token, right=True) - 1).clamp(0, batch - 1)
    used = _used_lengths(cu_seqlens, seqused)
    row = token - cu_seqlens[seq]
    return (row >= 0) & (row < used[seq]) & (token < cu_seqlens[-1])


def _flat_view(page_table):
    """The page table as the kernel reads it: a flat int32 view of its memory from its first entry (row b's
    first entry at b * stride(0)); the caller has made its last dim contiguous."""
    rows, width = page_table.shape
    span = (rows - 1) * page_table.stride(0) + width if rows else 0
    return page_table.as_strided((max(span, 1),), (1,))


def _flat_page_table(page_table, page_starts, batch: int):
    """(the page table as the kernel reads it: a flat int32 view of its memory from its first entry, each
    sequence's first entry in it): page_starts where given, else row b's first entry for sequence b."""
    if page_table.stride(-1) != 1:
        page_table = page_table.contiguous()
    flat = _flat_view(page_table)
    if page_starts is None:
        page_starts = torch.arange(0, batch * page_table.stride(0), page_table.stride(0), dtype=torch.int32,
                                   device=page_table.device)
    return flat, page_starts.contiguous()


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, seqused_q, seqused_k,
                   softmax_scale: float, causal: bool, window_size, softcap: float, out=None, lse=None,
                   decode: bool = False, page_table=None, page_size: int = 0, page_starts=None,
                   max_seqlen_k: int | None = None):
    """The varlen forward on validated CUDA tensors: q (total_q, hq, d), k / v (total_k, hk, d), int32
    cu_seqlens (batch + 1) and seqused (batch,) or None (then each sequence's whole length); returns
    (out (total_q, hq, dv), lse (hq, total_q)). `decode`: kvcache's rearranged decode (a few rows a
    sequence), which without a mask runs on the 1-warpgroup tile (plan.fwd_plan_decode) where
    validation.decode_tile_enabled(); with a mask it changes only the walk: every sequence max_seqlen_q
    rows.

    Paged (`page_table`, int32 (batch, max_pages) with `page_size` > 0): k / v are a paged cache's rows
    (num_pages * page_size, hk, d) and the kernel reads them through the table, key p of sequence b at row
    page_table[b, p // page_size] * page_size + p % page_size; cu_seqlens_k must be None and seqused_k
    given. `page_starts` (int32 (batch,)): each sequence's first entry in the table's memory where its
    pages do not start a row (kvcache's split decode: a split starts inside its item's row); default row
    b. The call's config must serve page_size (varlen_config), else ValueError: the caller gathers.

    The kernel walks each sequence's tiles, longest sequence first, from a walk table built on the device
    before the launch (hopper/varlen_walk.py: a sort and a cumulative sum of the lengths, no device-to-host
    copy; with `decode`, every sequence as max_seqlen_q rows in its own order), on a persistent grid no
    larger than the tiles can fill. `max_seqlen_k` (at least every sequence's keys; default k's rows)
    sizes the L2 sections of a causal or windowed walk."""
    total_q, h, d = q.shape
    dv = v.shape[-1] if v.shape[-1] != d else 0
    paged = page_table is not None
    if paged:
        if cu_seqlens_k is not None or seqused_k is None:
            raise ValueError("a paged cache takes seqused_k and no cu_seqlens_k (its pages give the rows)")
    cfg, wl, wr = varlen_config(q.dtype, d, causal, window_size, softcap > 0.0, dv, decode,
                                page_size if paged else 0)
    if paged and cfg.page_size != page_size:
        raise ValueError(f"pages of {page_size} rows are not served by the paged kernel of {cfg.tile_n} keys "
                         "a block: gather the pages first")
    if out is None:
        out = torch.empty(total_q, h, v.shape[-1], dtype=q.dtype, device=q.device)
        if poison:
            out.fill_(_NAN)
    if lse is None:
        lse = torch.empty(h, total_q, dtype=torch.float32, device=q.device)
        if poison:
            lse.fill_(_NAN)
    batch = cu_seqlens_q.shape[0] - 1
    if total_q == 0:
        return out, lse
    if k.shape[0] == 0:  # no key anywhere (a TMA descriptor needs rows): every used row sees none
        written = _rows_in_use(cu_seqlens_q, seqused_q, total_q)
        out.masked_fill_(written[:, None, None], 0.0)
        lse.masked_fill_(written[None, :], float("-inf"))
        return out, lse
    flat_table = None
    if paged:  # the kernel reads each sequence's first table entry where it reads cu_seqlens_k otherwise
        flat_table, cu_seqlens_k = _flat_page_table(page_table, page_starts, batch)
    # the kernel's layout
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    seqused_q, seqused_k = _used_lengths(cu_seqlens_q, seqused_q), _used_lengths(cu_seqlens_k, seqused_k)
    fn = get_kernel(cfg)
    scale_log2, softcap_pre = softmax_constants(softmax_scale, softcap)
    if decode:  # kvcache's rearranged decode: every sequence max_seqlen_q rows, alike: no sort to pay for
        walk = varlen_walk.uniform_walk_table(batch, int(max_seqlen_q), tile_m=cfg.tile_m, device=q.device)
    else:
        walk = varlen_walk.walk_table(seqused_q, seqused_k, tile_m=cfg.tile_m)
    num_ctas = varlen_walk.walk_grid(tile_m=cfg.tile_m, total_q=total_q, batch=batch,
                                     max_seqlen_q=int(max_seqlen_q), heads=h,
                                     max_ctas=_max_ctas(q.device.index))
    keys = k.shape[0] if max_seqlen_k is None else int(max_seqlen_k)
    section = _l2_section(max(keys, 1), cfg, h) if cfg.causal or cfg.local else 1  # heads a section
    counter = _counter_for(cfg, q.device)
    fn(q[None], k[None], v[None], out[None], lse[None], counter, scale_log2, softcap_pre, wl, wr, num_ctas,
       section, None, None, None, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, walk, flat_table,
       *_NO_SPLIT)
    return out, lse


@functools.lru_cache(maxsize=1024)
def _split_plan(dtype, hdim: int, softcap: bool, dv: int, page_size: int, decode_tile: bool, causal: bool):
    return plan.fwd_plan_split(_TORCH_TO_NAME[dtype], hdim, softcap, dv, page_size, decode_tile=decode_tile,
                               causal=causal)


def split_config(dtype, hdim: int, softcap: bool, dv: int = 0, page_size: int = 0,
                 causal: bool = False) -> FwdConfig:
    """What forward_split runs: the split walk (FwdConfig.split_kv) of the unmasked varlen tile, or of the
    1-warpgroup decode tile where that is enabled (validation.decode_tile_enabled); `page_size` as
    varlen_config's (the paged config where the kernels serve the pages, else the unpaged one: kvcache
    asks before choosing the paged path); `causal`: over packed query tokens (FwdConfig.token_rows)."""
    dv = 0 if dv == hdim else dv
    cfg = _split_plan(dtype, hdim, softcap, dv, page_size, validation.decode_tile_enabled(), causal)
    if _overrides:  # tests, tuning
        cfg = dataclasses.replace(cfg, **_overrides)
    return cfg


def forward_split(q, k, v, seqlens, softmax_scale: float, softcap: float, *, splits: int, chunk: int,
                  new_keys: int = 0, key_rows: int = 0, key_starts=None, out=None, lse=None, page_table=None,
                  page_size: int = 0, tokens: int = 0):
    """kvcache's decode with the split inside the kernel (FwdConfig.split_kv), on validated CUDA tensors, in
    one launch. q (b, rows, heads, d), any 16-byte strides: each item's query rows (one query token's
    heads, or with PackGQA a KV head's group of them as rows of that head); k / v the cache's rows
    (rows, hk, d), or a paged cache's (pages * page_size, hk, d) with page_table (b, max_pages) int32. Item
    i holds seqlens[i] + new_keys keys (seqlens int32 (b,)) from row i * key_rows (paged: from the table's
    entry i * key_rows, its row stride), or from key_starts[i] (int32 (b,)) where key_rows is 0; split j
    takes its positions [j * chunk, min((j + 1) * chunk, that)) (paged: chunk a multiple of page_size).
    `tokens` >= 1: causal over that many query tokens packed in each item's rows (FwdConfig.token_rows: row
    j * tokens + t, token t the item's (tokens - 1 - t)-th newest, seeing the keys up to its own); 0: no
    mask. Nothing is read on the host: capturable in a CUDA graph, replayed on new lengths.

    Returns the partials (o (b, splits, rows, heads, dv) in q's dtype, lse (b, splits, heads, rows) fp32,
    natural log, -inf where a split has no key) for the merge by LSE (combine_splits), new tensors
    (poisoned with `poison`); with one split, `out` (b, rows, heads, dv) and `lse` (b, heads, rows) where
    given are written in place instead (out: whole 16-byte rows and strides, the TMA store's; lse: its
    last stride 1), and returned with a split mode of one."""
    b, rows, heads, d = q.shape
    dv = v.shape[-1]
    paged = page_table is not None
    cfg = split_config(q.dtype, d, softcap > 0.0, dv, page_size if paged else 0, causal=tokens > 0)
    if paged and cfg.page_size != page_size:
        raise ValueError(f"pages of {page_size} rows are not served by the paged kernel of {cfg.tile_n} keys "
                         "a block: gather the pages first")
    if (out is None) != (lse is None) or (out is not None and splits != 1):
        raise ValueError("forward_split writes into out and lse together, and only with one split")
    if tokens and rows % tokens:
        raise ValueError(f"forward_split: {rows} rows an item do not pack {tokens} query tokens "
                         "(row j * tokens + t)")
    if out is None:
        o = torch.empty(b, splits, rows, heads, dv, dtype=q.dtype, device=q.device)
        lse = torch.empty(b, splits, heads, rows, dtype=torch.float32, device=q.device)
        if poison:
            o.fill_(_NAN)
            lse.fill_(_NAN)
        o_parts, lse_parts = o.view(b * splits, rows, heads, dv), lse.view(b * splits, heads, rows)
    else:
        o_parts, lse_parts, o, lse = out, lse, out[:, None], lse[:, None]
    if b * rows * heads == 0:
        return o, lse
    flat_table = None
    if paged:
        if page_table.stride(-1) != 1 or page_table.stride(0) != key_rows:
            raise ValueError(f"the page table's strides {page_table.stride()} are not ({key_rows}, 1)")
        flat_table = _flat_view(page_table)
    if key_rows == 0 and key_starts is None:
        raise ValueError("key_rows 0 reads each item's first key row from key_starts: pass them")
    seqlens = seqlens.contiguous()
    starts = seqlens if key_rows else key_starts.contiguous()  # (never read where key_rows is not 0)
    fn = get_kernel(cfg)
    scale_log2, softcap_pre = softmax_constants(softmax_scale, softcap)
    tiles = b * splits * heads * -(-rows // cfg.tile_m)
    num_ctas = max(1, min(tiles, _max_ctas(q.device.index)))
    counter = _counter_for(cfg, q.device)  # (the static walk never touches it)
    # no window (causal over packed tokens: the right bound at the diagonal, window_right 0); l2_section 1:
    # the split walk's order (FwdTileScheduler.coords, host.split_tile)
    fn(q, k[None], v[None], o_parts, lse_parts, counter, scale_log2, softcap_pre, -1, 0 if cfg.causal else -1,
       num_ctas, 1,
       None, None, None, None, starts, None, seqlens, None, flat_table, splits, chunk, new_keys, key_rows,
       max(tokens, 1))
    return o, lse


_COMBINE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def rows_aligned(t: torch.Tensor) -> bool:
    """Whether `t`'s last dim is contiguous rows of whole 16-byte vectors (the other strides too) from a
    16-byte aligned address: what the merge kernel's vector loads and stores take."""
    width = 16 // t.element_size()
    return (t.stride(-1) == 1 and t.shape[-1] % width == 0 and t.data_ptr() % 16 == 0
            and all(s % width == 0 for s in t.stride()[:-1]))


def combine_config(o: torch.Tensor, out: torch.Tensor, splits: int) -> CombineConfig | None:
    """The merge kernel's config for partials `o` (b, splits, rows, heads, dv) into `out`
    (b, rows, heads, dv), or None where it does not take them (a dtype, more than COMBINE_MAX_SPLITS
    splits, rows not of whole aligned 16-byte vectors): the caller merges in torch."""
    names = (_COMBINE_NAMES.get(o.dtype), _COMBINE_NAMES.get(out.dtype))
    if None in names or splits > COMBINE_MAX_SPLITS or not (rows_aligned(o) and rows_aligned(out)):
        return None
    return CombineConfig(names[0], o.shape[-1], names[1])


def combine_splits(cfg: CombineConfig, o, lse, out, lse_out) -> None:
    """Split-KV decode's merge by LSE in one launch (hopper/combine.py): partials o (b, splits, rows,
    heads, dv) with their fp32 LSEs (b, splits, rows, heads) into out (b, rows, heads, dv) and lse_out
    (b, rows, heads) fp32, any strides (combine_config says which it takes)."""
    if o.shape[0] * o.shape[2] * o.shape[3] == 0:
        return
    get_kernel(cfg)(o, lse, out, lse_out)


def _dq_accum(q, cfg: BwdConfig, alloc):
    """The fp32 dQ accumulator as a (b, sq, h, d) tensor; with dq_accum_head_major its memory is
    (b, h, sq, d) (a permuted view: the kernels take any strides); with dq_rows_interleaved sq is
    padded to whole query blocks (the main kernel takes the padded tensor, the rest [:, :sq])."""
    b, sq, h, d = q.shape
    if cfg.dq_accum_head_major:
        return alloc((b, h, sq, d), dtype=torch.float32, device=q.device).permute(0, 2, 1, 3)
    if cfg.dq_rows_interleaved:
        return alloc((b, -(-sq // cfg.tile_m) * cfg.tile_m, h, d), dtype=torch.float32, device=q.device)
    return alloc(q.shape, dtype=torch.float32, device=q.device)


def _dq_rows(dq_accum_all, cfg: BwdConfig, sq: int):
    """The accumulator's query rows: all of it, or with dq_rows_interleaved the first sq (the
    padding rows are never read)."""
    return dq_accum_all[:, :sq] if cfg.dq_rows_interleaved else dq_accum_all


def _bwd_plan_uncached(dtype, hdim: int, sq: int, sk: int, causal: bool, window_size, softcap: bool,
                       deterministic: bool, dv: int = 0):
    """The backward's configs and mask for a call's shapes and flags: (config, its preprocess's
    config, causal kernel, local kernel, window_left, window_right), the test / tuning overrides
    applied; `dv`: the value head dim of a SPLIT_HDIMS pair (0: hdim)."""
    cfg, *mask = plan.bwd_plan(_TORCH_TO_NAME[dtype], hdim, sq, sk, causal, window_size, softcap,
                               deterministic, **_bwd_overrides)
    return (cfg, BwdPreConfig.of(cfg, dv), *mask)


_bwd_plan = functools.lru_cache(maxsize=4096)(_bwd_plan_uncached)  # as _fwd_plan; overrides bypass it


def _pad_value_dim(q, v, dout):
    """(V, dO) as the backward's main kernel takes them, and the value head dim of a (hdim, dv) pair
    (SPLIT_HDIMS; 0 where V has q's head dim). The pair runs hdim's kernel on V and dO with zero
    columns up to hdim: dP = dO V^T sums the same products plus zeros, and dV = P^T dO comes out with
    hdim - dv zero columns, sliced off by the caller; S, dS, dQ and dK never read V or dO, the LSE
    is the forward's, and D = rowsum(dO * O) is formed by the preprocess from O and dO as they are
    (BwdPreConfig.of's dv: no padded copy of O). So the gradients are those of a native kernel.

    What the padding costs at (192, 128): a copy of V and of dO at 1.5x their bytes (one F.pad each,
    any strides in, contiguous out), the kernel reads 1.5x their bytes and writes dV 192 wide into a
    buffer that one more copy trims; the dQ accumulator is cleared by a fill rather than inside the
    preprocess. FLOPs: dP and dV run over 192 columns instead of 128, the five GEMMs of a step
    3 x 192 + 2 x 192 = 960 against 3 x 192 + 2 x 128 = 832 units, +15%. A native kernel (V, dO and
    dV tiles of 128 columns) would save both (docs/design.md)."""
    hdim, dv = q.shape[-1], v.shape[-1]
    if dv == hdim:
        return v, dout, 0
    pad = (0, hdim - dv)
    return torch.nn.functional.pad(v, pad), torch.nn.functional.pad(dout, pad), dv


def _value_grad(v, hdim: int, dv_split: int, dv=None):
    """The dV tensor the main kernel writes: `dv` where given, else a fresh one like `v` (NaN-filled
    under `poison`); for a split pair a fresh (..., hdim) buffer (trimmed by _trim_value_grad)."""
    if dv is not None and not dv_split:
        return dv
    if dv_split:
        buf = torch.empty((*v.shape[:-1], hdim), dtype=v.dtype, device=v.device)
    else:
        buf = torch.empty_like(v)
    if poison:
        buf.fill_(_NAN)
    return buf


def _trim_value_grad(buf, v, dv_split: int, dv=None):
    """dV as the caller gets it: the kernel's tensor, or a split pair's first dv columns, copied into
    `dv` or a tensor like `v` (the layout a backward's dV always has)."""
    if not dv_split:
        return buf
    return (torch.empty_like(v) if dv is None else dv).copy_(buf[..., :dv_split])


def backward(q, k, v, out, dout, lse, softmax_scale: float, causal: bool, window_size, softcap: float,
             deterministic: bool = False, dk=None, dv=None):
    """dq, dk, dv from the saved LSE: preprocess kernel (D, log2-LSE), main kernel, dQ cast. V of a
    SPLIT_HDIMS pair (a narrower value head dim) runs through _pad_value_dim."""
    plan = _bwd_plan_uncached if _bwd_overrides else _bwd_plan
    v_in, dout_in, dv_split = _pad_value_dim(q, v, dout)
    cfg, pre_cfg, causal, local, wl, wr = plan(q.dtype, q.shape[-1], q.shape[1], k.shape[1], causal,
                                               tuple(window_size), softcap > 0.0, deterministic, dv_split)
    fn = get_kernel(cfg)
    pre = get_kernel(pre_cfg)
    # per-query rows for the kernel, padded to whole query blocks: LSE in log2 units with +inf
    # where P must be 0 (padding, rows that saw no key), D = rowsum(dO * O) with 0 padding
    b, sq, h, _ = q.shape
    sq_pad = -(-sq // cfg.tile_m) * cfg.tile_m
    # the preprocess writes whole blocks of its PRE_ROWS_PER_CTA rows: with 80-row query blocks the
    # kernel's last block may end inside one of them (the rows past sq_pad are never read)
    rows = -(-sq_pad // PRE_ROWS_PER_CTA) * PRE_ROWS_PER_CTA
    lse_log2 = torch.empty((b, h, rows), dtype=torch.float32, device=q.device)
    d_rows = torch.empty((b, h, rows), dtype=torch.float32, device=q.device)
    if poison:
        lse_log2.fill_(_NAN)
        d_rows.fill_(_NAN)
    # the preprocess reads O and dO as given (dv wide for a split pair)
    if pre_cfg.zero_dq:  # the preprocess clears it: no fill kernel
        dq_accum_all = _dq_accum(q, cfg, torch.empty)
        if poison:
            dq_accum_all.fill_(_NAN)
        dq_accum = _dq_rows(dq_accum_all, cfg, sq)
        pre(out, dout, lse, lse_log2, d_rows, dq_accum, softmax_scale)
    else:
        if pre_cfg.scale_d:
            pre(out, dout, lse, lse_log2, d_rows, softmax_scale)
        else:
            pre(out, dout, lse, lse_log2, d_rows)
        dq_accum_all = _dq_accum(q, cfg, torch.zeros)
        dq_accum = _dq_rows(dq_accum_all, cfg, sq)
    if deterministic:  # turns per query block
        dq_sem = torch.zeros((b, h, sq_pad // cfg.tile_m), dtype=torch.int32, device=q.device)
    else:  # never read: any int32 tensor will do, and a view costs no allocation or memset (nor a
        # cached tensor, which CUDA graph capture would have to account for)
        dq_sem = lse_log2.view(torch.int32)[:, :, :1]
    if dk is None:
        dk = torch.empty_like(k)
        if poison:
            dk.fill_(_NAN)
    dv_out = _value_grad(v, q.shape[-1], dv_split, dv)
    scale_log2, softcap_pre = softmax_constants(softmax_scale, softcap)
    fn(q, k, v_in, dout_in, lse_log2, d_rows, dq_accum_all, dq_sem, dk, dv_out, scale_log2, softcap_pre,
       softmax_scale, wl, wr, None, None, None, None, None, None, None)  # the varlen arguments
    # the kernel already applied the softmax scale; dQ in q's (b, sq, h, d) order either way
    return (dq_accum.to(q.dtype, memory_format=torch.contiguous_format), dk,
            _trim_value_grad(dv_out, v, dv_split, dv))


@functools.lru_cache(maxsize=4096)
def _bwd_varlen_plan(dtype, hdim: int, causal: bool, window_size, softcap: bool, deterministic: bool):
    cfg, _, _, wl, wr = plan.bwd_plan_varlen(_TORCH_TO_NAME[dtype], hdim, causal, window_size, softcap,
                                             deterministic)
    return cfg, wl, wr


def longest_first(cu_seqlens_q, cu_seqlens_k, used_q, used_k, pad_q):
    """The varlen backward's per-sequence starts and lengths (each read by the kernel at the sequence's
    grid index only) with the sequences in launch order: longest used query length first (stable), so
    the grid, which launches a sequence's CTAs after the previous sequence's, starts with the CTAs that
    walk the most query blocks and ends with the shortest (LPT). Three kernels on the device (the sort,
    the stack, the gather), no host sync: (batch,) int32 views of one tensor, in the argument order.
    Taken with a causal or windowed mask: on an H100 (16 documents of 100-4000 tokens, hdim 128) +2.4%
    causal, but -2.1% without a mask, where every CTA of a sequence walks the same query blocks from the
    same first one (docs/results.md)."""
    batch = used_q.shape[0]
    order = torch.argsort(used_q, descending=True, stable=True)
    rows = torch.stack((cu_seqlens_q[:batch], cu_seqlens_k[:batch], used_q, used_k, pad_q[:batch]))
    return tuple(rows.index_select(1, order).unbind(0))


def backward_varlen(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                    softmax_scale: float, causal: bool, window_size, softcap: float,
                    deterministic: bool = False, seqused_q=None, seqused_k=None):
    """dq, dk, dv of the varlen forward on validated CUDA tensors: q, out, dout (total_q, hq, d), k, v
    (total_k, hk, d), lse (hq, total_q) as forward_varlen returned it, int32 cu_seqlens (batch + 1)
    starting at 0 and ending at the packed lengths. seqused_q / seqused_k (int32 (batch,), or None: the
    whole lengths) as the forward took them: the kernels take them where they take the lengths, rows
    past a sequence's seqused_q get dq = 0 (their dout, out and lse are not read) and keys past its
    seqused_k dk = dv = 0 (not seen). Preprocess (D and log2-LSE rows in the padded layout), main kernel,
    dQ cast; V of a SPLIT_HDIMS pair through _pad_value_dim."""
    total_q, h, d = q.shape
    total_k = k.shape[0]
    if total_q == 0 or total_k == 0:  # nothing attends (a TMA descriptor needs rows)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    v_in, dout_in, dv_split = _pad_value_dim(q, v, dout)
    cfg, wl, wr = _bwd_varlen_plan(q.dtype, d, causal, tuple(window_size), softcap > 0.0, deterministic)
    if _bwd_overrides:  # tests, tuning
        cfg = dataclasses.replace(cfg, **_bwd_overrides)
    dk = torch.empty_like(k)
    if poison:
        dk.fill_(_NAN)
    dv = _value_grad(v, d, dv_split)
    batch = cu_seqlens_q.shape[0] - 1
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    used_q, used_k = _used_lengths(cu_seqlens_q, seqused_q), _used_lengths(cu_seqlens_k, seqused_k)
    if seqused_k is not None:  # no CTA writes the rows of keys past a sequence's seqused_k
        unused = ~_rows_in_use(cu_seqlens_k, used_k, total_k)[:, None, None]
        dk.masked_fill_(unused, 0.0)
        dv.masked_fill_(unused, 0.0)
    # sequence b's LSE / D rows from the multiple of tile_m at or below cu_q[b] + b * tile_m: at least
    # its rows rounded up to whole query blocks before the next sequence's (FA3's layout)
    tm = cfg.tile_m
    steps = torch.arange(batch + 1, device=q.device, dtype=torch.int32) * tm
    pad_q = torch.div(cu_seqlens_q + steps, tm, rounding_mode="floor") * tm
    rows = -(-(total_q + (batch + 1) * tm) // 64) * 64  # TMA: 16-byte row strides
    lse_log2 = torch.empty((1, h, rows), dtype=torch.float32, device=q.device)
    d_rows = torch.empty((1, h, rows), dtype=torch.float32, device=q.device)
    if poison:
        lse_log2.fill_(_NAN)
        d_rows.fill_(_NAN)
    pre = get_kernel(BwdPreConfig.of(cfg, dv_split))
    # a sequence's padded rows are fewer than its length + 2 tile_m; O and dO as given (dv wide for a
    # split pair); rows past seqused_q get LSE +inf and D 0, so their P and dS are 0
    pre(out[None], dout[None], lse[None], lse_log2, d_rows, cu_seqlens_q, used_q, pad_q,
        int(max_seqlen_q) + 2 * tm, softmax_scale)
    dq_accum = torch.zeros((1, total_q, h, d), dtype=torch.float32, device=q.device)
    if deterministic:  # turns per (sequence, head, query block)
        m_blocks = max(-(-int(max_seqlen_q) // tm), 1)
        dq_sem = torch.zeros((batch, h, m_blocks), dtype=torch.int32, device=q.device)
    else:  # never read (as in backward)
        dq_sem = lse_log2.view(torch.int32)[:, :, :1]
    fn = get_kernel(cfg)
    scale_log2, softcap_pre = softmax_constants(softmax_scale, softcap)
    # which seqused the caller gave (bit 0 q, bit 1 k): then the rows past them may hold anything (NaN),
    # and every tile row at or past a sequence's used length (the next sequences' rows too) is zeroed
    # in smem before a GEMM reads it; without, every row a tile reads is data and none is
    seqused = int(seqused_q is not None) + 2 * int(seqused_k is not None)
    cu_q, cu_k = cu_seqlens_q, cu_seqlens_k
    if cfg.causal or cfg.local:  # not without a mask: measured 2% slower there (docs/results.md)
        cu_q, cu_k, used_q, used_k, pad_q = longest_first(cu_q, cu_k, used_q, used_k, pad_q)
    fn(q[None], k[None], v_in[None], dout_in[None], lse_log2, d_rows, dq_accum, dq_sem, dk[None], dv[None],
       scale_log2, softcap_pre, softmax_scale, wl, wr, cu_q, cu_k, used_q, used_k, pad_q,
       max(int(max_seqlen_k), 1), seqused)
    # the kernel already applied the softmax scale; rows past seqused_q only ever had zeros added
    return dq_accum[0].to(q.dtype), dk, _trim_value_grad(dv, v, dv_split)


def _artifact(name: str, cfg):
    try:
        smem = kernel_launch(cfg)["smem"]
    except RuntimeError as exc:  # the host code's shape changed (a DSL update): the model, said so
        warnings.warn(f"flashhopper inspect: {exc}; reporting the planner's shared-memory model instead",
                      RuntimeWarning, stacklevel=2)
        smem = cfg.smem_bytes()
    return CompiledArtifact(name=name, cubin=kernel_cubin(cfg), smem_bytes=smem)


def bwd_artifact(dtype: str = "bf16", hdim: int = 64, causal: bool = False, local: bool = False,
                 softcap: bool = False, deterministic: bool = False, **overrides):
    """The backward kernel's cubin for `flashhopper inspect bwd` (compiles without a GPU)."""
    return _artifact("bwd", bwd_config(dtype, hdim, causal=causal, local=local, softcap=softcap,
                                       deterministic=deterministic, **overrides))


def fwd_artifact(dtype: str = "bf16", hdim: int = 128, causal: bool = False, local: bool = False,
                 softcap: bool = False, varlen: bool = False, **overrides):
    """The forward kernel's cubin for `flashhopper inspect fwd` (works without a GPU); `varlen`: the
    varlen kernel's config; `overrides` replace FwdConfig fields (e.g. reg_realloc=False)."""
    config_of = plan.fwd_config_varlen if varlen else fwd_config
    cfg = config_of(dtype, hdim, causal=causal, local=local, softcap=softcap)
    return _artifact("fwd", dataclasses.replace(cfg, **overrides) if overrides else cfg)


__all__ = ["backward", "backward_varlen", "bwd_artifact", "bwd_config_overrides", "combine_config",
           "combine_splits", "config_overrides", "forward",
           "forward_split", "forward_varlen", "fwd_artifact", "get_kernel", "kernel_cubin", "kernel_launch",
           "split_config", "varlen_config"]
