"""Compiling, caching and launching the Hopper kernels.

Kernels are compiled once per static configuration (dtype, hdim, mask kind, softcap, tiles)
against symbolic shapes and strides, so batch, sequence lengths, head counts and strides
never trigger a recompile. The same compile serves the no-GPU inspection path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import tempfile
import threading
import time

import cutlass
import cutlass.cute as cute
import torch

from flashhopper.config import (
    BwdConfig,
    FwdConfig,
    bwd_config,
    bwd_per_call,
    fwd_config,
    fwd_grid,
    fwd_narrow_tile,
    fwd_short_causal,
    fwd_short_nomask,
    fwd_short_qring,
)
from flashhopper.hopper.bwd_common import every_q_block_visited
from flashhopper.hopper.bwd_pre import ROWS_PER_CTA
from flashhopper.hopper.fwd import FlashFwdSm90, softmax_constants
from flashhopper.hopper.layout import CUTE_DTYPES as _NAME_TO_CUTE

try:  # TVM-FFI lets the compiled kernel take torch tensors directly (low host overhead)
    import tvm_ffi  # noqa: F401

    _HAVE_TVM_FFI = True
except ImportError:  # pragma: no cover - depends on the environment
    _HAVE_TVM_FFI = False

_TORCH_TO_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16"}

_cache: dict = {}
_cache_lock = threading.Lock()
compile_seconds: dict = {}
_overrides: dict = {}
# caps a persistent grid below the SM count, so that tests make every CTA loop over many tiles
persistent_ctas_cap: int | None = None


_bwd_overrides: dict = {}
# tests: fill the dQ accumulator with NaN before the preprocess that should clear it
# (BwdConfig.pre_zero_dq), so that a row it missed shows
poison_dq_accum = False
# test hook: fill the dQ output with NaN before a fused_dq_cast backward (catches unwritten rows)
poison_dq = False


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


def _fake_qkvo(cfg: FwdConfig):
    """Fake (b, s, h, d) tensors with symbolic extents and 16-byte-aligned symbolic strides."""
    dt = _NAME_TO_CUTE[cfg.dtype]
    b, sq, sk, h, hk = (cute.sym_int() for _ in range(5))

    def qkv(s, heads, d):
        strides = tuple(cute.sym_int64(divisibility=8) for _ in range(3)) + (1,)
        return cute.runtime.make_fake_tensor(dt, (b, s, heads, d), strides, assumed_align=16)

    q, k, v, o = qkv(sq, h, cfg.hdim), qkv(sk, hk, cfg.hdim), qkv(sk, hk, cfg.hdim_v), qkv(sq, h, cfg.hdim_v)
    lse = cute.runtime.make_fake_tensor(
        cutlass.Float32, (b, h, sq), (cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4
    )
    counter = cute.runtime.make_fake_tensor(cutlass.Int32, (2,), (1,), assumed_align=4)
    return q, k, v, o, lse, counter


def compile_fwd(cfg: FwdConfig, options: str = "", tvm_ffi: bool | None = None):
    """Trace and compile the forward kernel for `cfg` (no GPU needed)."""
    tvm_ffi = _HAVE_TVM_FFI if tvm_ffi is None else tvm_ffi
    opts = "--gpu-arch sm_90a " + options + (" --enable-tvm-ffi" if tvm_ffi else "")
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi)
    args = (*_fake_qkvo(cfg), cutlass.Float32(1.0), cutlass.Float32(0.0), cutlass.Int32(-1),
            cutlass.Int32(-1), cutlass.Int32(1), cutlass.Int32(1), stream)
    return cute.compile(FlashFwdSm90(cfg), *args, options=opts.strip())


def _get_fwd(cfg: FwdConfig):
    fn = _cache.get(cfg)
    if fn is None:
        with _cache_lock:
            fn = _cache.get(cfg)
            if fn is None:
                t0 = time.perf_counter()
                fn = compile_fwd(cfg)
                compile_seconds[cfg] = time.perf_counter() - t0
                _cache[cfg] = fn
    return fn


# an unbounded window side is passed as a huge window so the kernels' arithmetic stays uniform
_UNBOUNDED = 1 << 30


def _mask_kind(causal: bool, window_size) -> tuple[bool, bool, int, int]:
    """(causal kernel, local kernel, window_left, window_right) as the kernels take them.

    Causal is a right window of 0; with any other bound the kernel is the local one."""
    window_left, window_right = int(window_size[0]), int(window_size[1])
    if causal:
        window_right = 0
    local = window_left >= 0 or (window_right >= 0 and not causal)
    wl = window_left if window_left >= 0 else _UNBOUNDED
    wr = window_right if window_right >= 0 else _UNBOUNDED
    return causal and not local, local, wl, wr


@functools.cache
def _sm_count(device_index) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Causal / local tiles are visited (head, batch) section by section, longest first inside each;
# a section's K and V should stay in L2 (50 MB on H100/H200) while its tiles run.
_L2_BUDGET = 32 << 20


def _l2_section(seqlen_k: int, cfg: FwdConfig, num_pairs: int) -> int:
    kv_bytes = seqlen_k * (cfg.hdim + cfg.hdim_v) * cfg.elem_bytes
    return max(1, min(num_pairs, _L2_BUDGET // kv_bytes))


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


def _tile_counter(device) -> torch.Tensor:
    """The dynamic scheduler's counter for the current stream on `device`: 2 int32 (the next
    tile to hand out, the CTAs done claiming), zeroed once here. The kernel leaves it at zero
    when it finishes (FlashFwdSm90.retire_cta), so launches need no memset; the static schedule
    never touches it. Launches on one stream run in order, so one counter per stream is enough;
    two streams must not share one (their kernels may run at the same time).

    Under CUDA graph capture each launch gets its own counter, allocated in the graph's memory
    pool: graphs are captured on a stream of their own but replayed on any stream, so two graphs
    replayed at once on two streams would otherwise share the capture stream's counter."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(2, dtype=torch.int32, device=device)
    # the raw handle: torch.cuda.current_stream() would build a Stream object on every call
    key = (device, torch._C._cuda_getCurrentRawStream(device.index))
    counter = _tile_counters.get(key)
    if counter is None:
        counter = _tile_counters[key] = _persistent_zeros(2, torch.int32, device)
    return counter


def _fwd_plan_uncached(dtype, hdim: int, b: int, sq: int, sk: int, h: int, causal: bool, window_size,
                       softcap: bool):
    """What a forward call launches, from its shapes and flags alone: (config, window_left,
    window_right, L2 section)."""
    causal, local, wl, wr = _mask_kind(causal, window_size)
    cfg = fwd_config(_TORCH_TO_NAME[dtype], hdim, causal=causal, local=local, softcap=softcap,
                     narrow=fwd_narrow_tile(hdim, sq, causal and not local),
                     short=(fwd_short_causal(hdim, sq, sk, not local) if causal
                            else fwd_short_nomask(hdim, sq, sk, local)),
                     qring=fwd_short_qring(hdim, sq, sk, local))
    if _overrides:
        cfg = dataclasses.replace(cfg, **_overrides)
    section = _l2_section(sk, cfg, h * b) if cfg.causal or cfg.local else 1
    return cfg, wl, wr, section


# the dispatch above is ~5 us of Python, a visible share of a small call's ~30 us of host time;
# test / tuning overrides (_overrides) bypass the cache
_fwd_plan = functools.lru_cache(maxsize=4096)(_fwd_plan_uncached)


def forward(q, k, v, softmax_scale: float, causal: bool, window_size, softcap: float, out=None, lse=None):
    """Run the forward kernel on validated CUDA tensors; returns (out, lse).

    `out` / `lse` may be given preallocated (tests poison them to catch unwritten elements).
    """
    b, sq, h, d = q.shape
    plan = _fwd_plan_uncached if _overrides else _fwd_plan
    cfg, wl, wr, section = plan(q.dtype, d, b, sq, k.shape[1], h, causal, tuple(window_size), softcap > 0.0)
    if cfg.trace:  # the stamps go to the LSE's memory, far past b * h * sq floats
        from flashhopper.hopper.fwd import trace_words

        if lse is None or lse.untyped_storage().nbytes() < 4 * trace_words():
            raise ValueError(f"FwdConfig.trace needs lse= a view of a buffer of {trace_words()} int32 "
                             "(scripts/fwd_trace.py)")
    fn = _get_fwd(cfg)
    if out is None:
        out = torch.empty(b, sq, h, v.shape[-1], dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(b, h, sq, dtype=torch.float32, device=q.device)
    scale_log2, softcap_pre = softmax_constants(softmax_scale, softcap)
    num_ctas = fwd_grid(cfg, sq, h * b, (persistent_ctas_cap or _sm_count(q.device.index)) if cfg.persistent
                        else None)
    counter = _tile_counter(q.device)  # zero on entry: the previous launch on this stream reset it
    if _HAVE_TVM_FFI:
        fn(q, k, v, out, lse, counter, scale_log2, softcap_pre, wl, wr, num_ctas, section)
    else:  # pragma: no cover - fallback without TVM-FFI
        from cuda.bindings import driver

        def wrap(t):
            return cute.runtime.from_dlpack(t, assumed_align=16 if t.dtype != torch.float32 else 4
                                            ).mark_layout_dynamic(leading_dim=t.ndim - 1)

        stream = driver.CUstream(torch.cuda.current_stream(q.device).cuda_stream)
        counter_t = cute.runtime.from_dlpack(counter, assumed_align=4)
        fn(wrap(q), wrap(k), wrap(v), wrap(out), wrap(lse), counter_t, cutlass.Float32(scale_log2),
           cutlass.Float32(softcap_pre), cutlass.Int32(wl), cutlass.Int32(wr), cutlass.Int32(num_ctas),
           cutlass.Int32(section), stream)
    return out, lse


def _fake_bwd(cfg: BwdConfig):
    dt = _NAME_TO_CUTE[cfg.dtype]
    b, sq, sk, h, hk = (cute.sym_int() for _ in range(5))

    def t4(s, heads, dtype=dt):
        strides = tuple(cute.sym_int64(divisibility=16 // (dtype.width // 8)) for _ in range(3)) + (1,)
        return cute.runtime.make_fake_tensor(dtype, (b, s, heads, cfg.hdim), strides, assumed_align=16)

    sq_pad = cute.sym_int()

    def rows():
        strides = (cute.sym_int64(divisibility=4), cute.sym_int64(divisibility=4), 1)  # TMA: 16 B strides
        return cute.runtime.make_fake_tensor(cutlass.Float32, (b, h, sq_pad), strides, assumed_align=16)

    sem = cute.runtime.make_fake_tensor(cutlass.Int32, (cute.sym_int(), cute.sym_int(), cute.sym_int()),
                                        (cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)
    dq = t4(sq, h) if cfg.fused_dq_cast else None
    # dq_rows_interleaved: the accumulator's rows are padded to whole query blocks (_dq_accum)
    dq_accum = t4(cute.sym_int() if cfg.dq_rows_interleaved else sq, h, cutlass.Float32)
    return (t4(sq, h), t4(sk, hk), t4(sk, hk), t4(sq, h), rows(), rows(), dq_accum,
            sem, dq, t4(sk, hk), t4(sk, hk))


def compile_bwd(cfg: BwdConfig, options: str = "", tvm_ffi: bool | None = None):
    """Trace and compile the backward kernel for `cfg` (no GPU needed)."""
    from flashhopper.hopper.bwd import FlashBwdSm90
    from flashhopper.hopper.bwd_wide import FlashBwdWideSm90

    kernel_cls = FlashBwdWideSm90 if cfg.kv_split == "hdim" else FlashBwdSm90
    tvm_ffi = _HAVE_TVM_FFI if tvm_ffi is None else tvm_ffi
    opts = "--gpu-arch sm_90a " + options + (" --enable-tvm-ffi" if tvm_ffi else "")
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi)
    args = (*_fake_bwd(cfg), cutlass.Float32(1.0), cutlass.Float32(0.0), cutlass.Float32(1.0),
            cutlass.Int32(-1), cutlass.Int32(-1), stream)
    return cute.compile(kernel_cls(cfg), *args, options=opts.strip())


def _fake_pre(dtype: str, hdim: int):
    dt = _NAME_TO_CUTE[dtype]
    b, sq, h, sq_pad = (cute.sym_int() for _ in range(4))

    def t4():  # O and dO are the main kernel's TMA operands: 16-byte aligned, 16-byte strides
        strides = tuple(cute.sym_int64(divisibility=16 // (dt.width // 8)) for _ in range(3)) + (1,)
        return cute.runtime.make_fake_tensor(dt, (b, sq, h, hdim), strides, assumed_align=16)

    def rows(n):
        strides = (cute.sym_int64(), cute.sym_int64(), 1)
        return cute.runtime.make_fake_tensor(cutlass.Float32, (b, h, n), strides, assumed_align=4)

    return t4(), t4(), rows(sq), rows(sq_pad), rows(sq_pad)


def _fake_dq_accum(hdim: int):
    """(b, sq, h, d) fp32, 16-byte aligned rows: the accumulator runtime.backward allocates."""
    strides = tuple(cute.sym_int64(divisibility=4) for _ in range(3)) + (1,)
    shape = tuple(cute.sym_int() for _ in range(3))
    return cute.runtime.make_fake_tensor(cutlass.Float32, (*shape, hdim), strides, assumed_align=16)


def compile_bwd_pre(dtype: str, hdim: int, options: str = "", tvm_ffi: bool | None = None,
                    scale_d: bool = False, zero_dq: bool = False, pdl: bool = False):
    """The backward preprocess (D and log2-LSE rows), compiled without a GPU. `scale_d`: D times
    a runtime softmax scale (BwdConfig.scale_in_ds); `zero_dq`: it also clears the fp32 dQ
    accumulator, which then comes after D and takes the scale argument either way
    (BwdConfig.pre_zero_dq); `pdl` (with zero_dq): it lets the main kernel launch once its rows are
    read (BwdConfig.pdl)."""
    from flashhopper.hopper.bwd_pre import BwdPreprocess, BwdPreprocessScaled, BwdPreprocessZeroDq

    tvm_ffi = _HAVE_TVM_FFI if tvm_ffi is None else tvm_ffi
    opts = "--gpu-arch sm_90a " + options + (" --enable-tvm-ffi" if tvm_ffi else "")
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi)
    if zero_dq:
        return cute.compile(BwdPreprocessZeroDq(dtype, hdim, scale_d, pdl), *_fake_pre(dtype, hdim),
                            _fake_dq_accum(hdim), cutlass.Float32(1.0), stream, options=opts.strip())
    if scale_d:
        return cute.compile(BwdPreprocessScaled(dtype, hdim), *_fake_pre(dtype, hdim), cutlass.Float32(1.0),
                            stream, options=opts.strip())
    return cute.compile(BwdPreprocess(dtype, hdim), *_fake_pre(dtype, hdim), stream, options=opts.strip())


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
                       deterministic: bool):
    """The backward's config and mask for a call's shapes and flags: (config, causal kernel,
    local kernel, window_left, window_right)."""
    causal, local, wl, wr = _mask_kind(causal, window_size)
    # the per-call fields, then the test / tuning overrides over them
    fields = {**bwd_per_call(hdim, sq, sk, causal, deterministic, softcap), **_bwd_overrides}
    cfg = bwd_config(_TORCH_TO_NAME[dtype], hdim, causal=causal, local=local, softcap=softcap,
                     deterministic=deterministic, **fields)
    return cfg, causal, local, wl, wr


_bwd_plan = functools.lru_cache(maxsize=4096)(_bwd_plan_uncached)  # as _fwd_plan; overrides bypass it


def backward(q, k, v, out, dout, lse, softmax_scale: float, causal: bool, window_size, softcap: float,
             deterministic: bool = False, dk=None, dv=None):
    """dq, dk, dv from the saved LSE: preprocess kernel (D, log2-LSE), main kernel, dQ cast."""
    plan = _bwd_plan_uncached if _bwd_overrides else _bwd_plan
    cfg, causal, local, wl, wr = plan(q.dtype, q.shape[-1], q.shape[1], k.shape[1], causal,
                                      tuple(window_size), softcap > 0.0, deterministic)
    fn = _cache.get(cfg)
    if fn is None:
        fn = _cache[cfg] = compile_bwd(cfg)
    pre_key = ("bwd_pre", cfg.dtype, cfg.hdim, cfg.scale_in_ds, cfg.pre_zero_dq, cfg.pdl)
    pre = _cache.get(pre_key)
    if pre is None:
        pre = _cache[pre_key] = compile_bwd_pre(cfg.dtype, cfg.hdim, scale_d=cfg.scale_in_ds,
                                                zero_dq=cfg.pre_zero_dq, pdl=cfg.pdl)
    # per-query rows for the kernel, padded to whole query blocks: LSE in log2 units with +inf
    # where P must be 0 (padding, rows that saw no key), D = rowsum(dO * O) with 0 padding
    b, sq, h, _ = q.shape
    sq_pad = -(-sq // cfg.tile_m) * cfg.tile_m
    # the preprocess writes whole blocks of its ROWS_PER_CTA rows: with 80-row query blocks the
    # kernel's last block may end inside one of them (the rows past sq_pad are never read)
    rows = -(-sq_pad // ROWS_PER_CTA) * ROWS_PER_CTA
    lse_log2 = torch.empty((b, h, rows), dtype=torch.float32, device=q.device)
    d_rows = torch.empty((b, h, rows), dtype=torch.float32, device=q.device)
    if cfg.pre_zero_dq:  # the preprocess clears it: no fill kernel
        dq_accum_all = _dq_accum(q, cfg, torch.empty)
        if poison_dq_accum:
            dq_accum_all.fill_(float("nan"))
        dq_accum = _dq_rows(dq_accum_all, cfg, sq)
        pre(out, dout, lse, lse_log2, d_rows, dq_accum, softmax_scale)
    else:
        if cfg.scale_in_ds:
            pre(out, dout, lse, lse_log2, d_rows, softmax_scale)
        else:
            pre(out, dout, lse, lse_log2, d_rows)
        dq_accum_all = _dq_accum(q, cfg, torch.zeros)
        dq_accum = _dq_rows(dq_accum_all, cfg, sq)
    if deterministic or cfg.fused_dq_cast:  # turns, or landed tiles, per query block
        dq_sem = torch.zeros((b, h, sq_pad // cfg.tile_m), dtype=torch.int32, device=q.device)
    else:  # never read: any int32 tensor will do, and a view costs no allocation or memset (nor a
        # cached tensor, which CUDA graph capture would have to account for)
        dq_sem = lse_log2.view(torch.int32)[:, :, :1]
    dq = None
    if cfg.fused_dq_cast:
        # the kernel stores every query block some key block sees; the others (queries with no
        # key, at the ends of some masks) must read 0
        every = every_q_block_visited(sq, k.shape[1], cfg.tile_m, cfg.tile_n, causal or local, local, wl, wr)
        if every:
            dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            if poison_dq:
                dq.fill_(float("nan"))
        else:
            dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    scale_log2, softcap_pre = softmax_constants(softmax_scale, softcap)
    fn(q, k, v, dout, lse_log2, d_rows, dq_accum_all, dq_sem, dq, dk, dv, scale_log2, softcap_pre,
       softmax_scale, wl, wr)
    if dq is not None:
        return dq, dk, dv
    # the kernel already applied the softmax scale; dQ in q's (b, sq, h, d) order either way
    return dq_accum.to(q.dtype, memory_format=torch.contiguous_format), dk, dv


def bwd_artifact(dtype: str = "bf16", hdim: int = 64, causal: bool = False, local: bool = False,
                 softcap: bool = False, deterministic: bool = False, **overrides):
    """The backward kernel's cubin for `flashhopper inspect bwd` (compiles without a GPU)."""
    from flashhopper.compile import CompiledArtifact

    cfg = bwd_config(dtype, hdim, causal=causal, local=local, softcap=softcap, deterministic=deterministic,
                     **overrides)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = compile_bwd(cfg, options=f"--keep-cubin --dump-dir {tmp}", tvm_ffi=False).__cubin__
    return CompiledArtifact(name="bwd", cubin=cubin, smem_bytes=cfg.smem_bytes())


def fwd_artifact(dtype: str = "bf16", hdim: int = 128, causal: bool = False, local: bool = False,
                 softcap: bool = False, **overrides):
    """Compile with the cubin kept, for `flashhopper inspect fwd` (works without a GPU); `overrides`
    replace FwdConfig fields (e.g. reg_realloc=False)."""
    from flashhopper.compile import CompiledArtifact

    cfg = fwd_config(dtype, hdim, causal=causal, local=local, softcap=softcap)
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    # the DSL also writes the cubin to the dump dir (cwd by default): keep that out of the way
    with tempfile.TemporaryDirectory() as tmp:
        compiled = compile_fwd(cfg, options=f"--keep-cubin --dump-dir {tmp}", tvm_ffi=False)
        cubin = compiled.__cubin__
    return CompiledArtifact(name="fwd", cubin=cubin, smem_bytes=cfg.smem_bytes())


__all__ = ["forward", "backward", "bwd_artifact", "bwd_config_overrides", "compile_bwd", "compile_fwd",
           "config_overrides", "fwd_artifact", "compile_seconds"]
