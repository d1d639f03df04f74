"""Tracing and compiling the Hopper kernels for sm_90a from their configs (no GPU needed).

Each kernel is compiled against symbolic shapes and 16-byte-aligned symbolic strides, so batch,
sequence lengths, head counts and strides never trigger a recompile. `compile_kernel` is what the
kernel cache (kernel_cache.py) calls on a miss; nothing else compiles.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from flashhopper.config import BwdConfig, BwdPreConfig, CombineConfig, FwdConfig
from flashhopper.hopper.layout import CUTE_DTYPES as _NAME_TO_CUTE

_BASE_OPTIONS = "--gpu-arch sm_90a --enable-tvm-ffi"


def _options(extra: str) -> str:
    return f"{_BASE_OPTIONS} {extra}".strip()


def _fake_qkvo(cfg: FwdConfig):
    """Fake (b, s, h, d) tensors with symbolic extents and 16-byte-aligned symbolic strides; O in
    bf16 for FP8 inputs. split_kv: Q's batch (items), K / V's (1) and O / LSE's (items x splits) apart."""
    dt = _NAME_TO_CUTE[cfg.dtype]
    b, sq, sk, h, hk = (cute.sym_int() for _ in range(5))
    b_kv, b_o = (cute.sym_int(), cute.sym_int()) if cfg.split_kv else (b, b)

    def qkv(s, heads, d, dtype=dt, batch=b):
        strides = tuple(cute.sym_int64(divisibility=16 * 8 // dtype.width) for _ in range(3)) + (1,)
        return cute.runtime.make_fake_tensor(dtype, (batch, s, heads, d), strides, assumed_align=16)

    o_dt = cutlass.BFloat16 if cfg.is_fp8 else dt
    q, k, v = qkv(sq, h, cfg.hdim), qkv(sk, hk, cfg.hdim, batch=b_kv), qkv(sk, hk, cfg.hdim_v, batch=b_kv)
    if cfg.vt_in_gmem:  # V^T: (b, hk, dv, keys padded to 16)
        strides = tuple(cute.sym_int64(divisibility=16) for _ in range(3)) + (1,)
        v = cute.runtime.make_fake_tensor(dt, (b, hk, cfg.hdim_v, cute.sym_int()), strides, assumed_align=16)
    o = qkv(sq, h, cfg.hdim_v, o_dt, batch=b_o)
    lse = cute.runtime.make_fake_tensor(
        cutlass.Float32, (b_o, h, sq), (cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4
    )
    counter = cute.runtime.make_fake_tensor(cutlass.Int32, (2,), (1,), assumed_align=4)
    return q, k, v, o, lse, counter


def _fake_descales(cfg: FwdConfig):
    """FP8: the (b, hk) fp32 descales of Q, K, V, any strides (0 too: an expanded scalar); else None.
    Per-token (qk_descale "token"): Q's (b, h, sq) and K's (b, hk, sk), V's (b, hk)."""
    if not cfg.is_fp8:
        return None, None, None

    def fake(*shape):
        strides = tuple(cute.sym_int64() for _ in shape)
        return cute.runtime.make_fake_tensor(cutlass.Float32, shape, strides, assumed_align=4)

    b, hk = cute.sym_int(), cute.sym_int()
    if cfg.token_descales:
        return fake(b, cute.sym_int(), cute.sym_int()), fake(b, hk, cute.sym_int()), fake(b, hk)
    return fake(b, hk), fake(b, hk), fake(b, hk)


def _fake_varlen(cfg: FwdConfig):
    """Varlen: cu_seqlens_q / _k (batch + 1,), seqused_q / _k (batch,) and the walk table (2 batch,) int32
    (hopper/varlen_walk.py); split_kv: only the items' key starts and cache lengths, (batch,) each; else
    None."""
    if not cfg.varlen:
        return None, None, None, None, None
    b = cute.sym_int()

    def ints(n):
        return cute.runtime.make_fake_tensor(cutlass.Int32, (n,), (1,), assumed_align=4)

    if cfg.split_kv:
        return None, ints(cute.sym_int()), None, ints(b), None
    return ints(cute.sym_int()), ints(cute.sym_int()), ints(b), ints(b), ints(cute.sym_int())


def _fake_page_table(cfg: FwdConfig):
    """Paged (FwdConfig.page_size): the page table, flat int32 (each sequence's first entry comes in
    cu_seqlens_k's place); else None."""
    if not cfg.page_size:
        return None
    return cute.runtime.make_fake_tensor(cutlass.Int32, (cute.sym_int(),), (1,), assumed_align=4)


def compile_fwd(cfg: FwdConfig, options: str = ""):
    """Trace and compile the forward kernel for `cfg`."""
    from flashhopper.hopper.fwd import FlashFwdSm90

    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    # the split walk's scalars (FwdConfig.split_kv; unused by the other kernels): splits, chunk, new keys,
    # key rows an item
    split = (cutlass.Int32(1), cutlass.Int32(128), cutlass.Int32(0), cutlass.Int32(1), cutlass.Int32(1))
    args = (*_fake_qkvo(cfg), cutlass.Float32(1.0), cutlass.Float32(0.0), cutlass.Int32(-1),
            cutlass.Int32(-1), cutlass.Int32(1), cutlass.Int32(1), *_fake_descales(cfg), *_fake_varlen(cfg),
            _fake_page_table(cfg), *split, stream)
    return cute.compile(FlashFwdSm90(cfg), *args, options=_options(options))


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
    # dq_rows_interleaved: the accumulator's rows are padded to whole query blocks (_dq_accum)
    dq_accum = t4(cute.sym_int() if cfg.dq_rows_interleaved else sq, h, cutlass.Float32)
    return (t4(sq, h), t4(sk, hk), t4(sk, hk), t4(sq, h), rows(), rows(), dq_accum,
            sem, t4(sk, hk), t4(sk, hk))


def _fake_bwd_varlen(cfg: BwdConfig):
    """Varlen: cu_seqlens_q / _k (batch + 1,), seqused_q / _k (batch,), the padded row offsets
    (batch + 1,) int32, max_seqlen_k and the seqused bits (which of seqused_q / _k the caller gave);
    else None."""
    if not cfg.varlen:
        return (None,) * 7
    b = cute.sym_int()

    def ints(n):
        return cute.runtime.make_fake_tensor(cutlass.Int32, (n,), (1,), assumed_align=4)

    n = cute.sym_int()  # batch + 1
    return ints(n), ints(n), ints(b), ints(b), ints(n), cutlass.Int32(1), cutlass.Int32(0)


def compile_bwd(cfg: BwdConfig, options: str = ""):
    """Trace and compile the backward's main kernel for `cfg`."""
    from flashhopper.hopper.bwd import FlashBwdSm90
    from flashhopper.hopper.bwd_wide import FlashBwdWideSm90

    kernel_cls = FlashBwdWideSm90 if cfg.kv_split == "hdim" else FlashBwdSm90
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    args = (*_fake_bwd(cfg), cutlass.Float32(1.0), cutlass.Float32(0.0), cutlass.Float32(1.0),
            cutlass.Int32(-1), cutlass.Int32(-1), *_fake_bwd_varlen(cfg), stream)
    return cute.compile(kernel_cls(cfg), *args, options=_options(options))


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


def compile_bwd_pre(cfg: BwdPreConfig, options: str = ""):
    """Trace and compile the backward preprocess (D and log2-LSE rows; see BwdPreConfig)."""
    from flashhopper.hopper.bwd_pre import (
        BwdPreprocess,
        BwdPreprocessScaled,
        BwdPreprocessVarlen,
        BwdPreprocessZeroDq,
    )

    dtype, hdim = cfg.dtype, cfg.hdim
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    if cfg.varlen:
        if cfg.zero_dq or cfg.pdl:
            raise ValueError("the varlen preprocess neither clears dQ nor launches with PDL")
        ints = [cute.runtime.make_fake_tensor(cutlass.Int32, (cute.sym_int(),), (1,), assumed_align=4)
                for _ in range(3)]
        return cute.compile(BwdPreprocessVarlen(dtype, hdim, cfg.scale_d), *_fake_pre(dtype, hdim), *ints,
                            cutlass.Int32(1), cutlass.Float32(1.0), stream, options=_options(options))
    if cfg.zero_dq:
        return cute.compile(BwdPreprocessZeroDq(dtype, hdim, cfg.scale_d, cfg.pdl), *_fake_pre(dtype, hdim),
                            _fake_dq_accum(hdim), cutlass.Float32(1.0), stream, options=_options(options))
    if cfg.scale_d:
        return cute.compile(BwdPreprocessScaled(dtype, hdim), *_fake_pre(dtype, hdim), cutlass.Float32(1.0),
                            stream, options=_options(options))
    return cute.compile(BwdPreprocess(dtype, hdim), *_fake_pre(dtype, hdim), stream,
                        options=_options(options))


def compile_combine(cfg: CombineConfig, options: str = ""):
    """Trace and compile split-KV decode's merge by LSE (hopper/combine.py)."""
    from flashhopper.hopper.combine import CombineSplits, fake_args

    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(CombineSplits(cfg), *fake_args(cfg), stream, options=_options(options))


_BUILDERS = {FwdConfig: compile_fwd, BwdConfig: compile_bwd, BwdPreConfig: compile_bwd_pre,
             CombineConfig: compile_combine}


def compile_kernel(cfg, options: str = ""):
    """The TVM-FFI function of the kernel that `cfg` (a FwdConfig, BwdConfig, BwdPreConfig or CombineConfig)
    names."""
    try:
        builder = _BUILDERS[type(cfg)]
    except KeyError:
        raise TypeError(f"no kernel is built from a {type(cfg).__name__}") from None
    return builder(cfg, options)
