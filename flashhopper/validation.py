"""Argument checks for `flash_attn_func`.

They run before any kernel: a TMA descriptor built from a bad stride or a misaligned pointer fails
on the GPU with an opaque error (or silently reads the wrong rows), so every constraint the kernels
rely on is checked here and reported with the argument's name, what was given and what is accepted.
"""

from __future__ import annotations

import functools
import math
import numbers
import os

import torch

SUPPORTED_HDIMS = (64, 96, 128, 192, 256)
SPLIT_HDIMS = ((192, 128),)  # as flashhopper.config's (this module imports no more than torch)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)
FP8_DTYPES = (torch.float8_e4m3fn,)
# The FP8 forward: its LDSM.T / STSM transposer, the per-token descales and the wider key blocks
# (plan._FP8_WIDE_TILES) passed on an H100 (2026-12-06, docs/testing.md) the FP8 GPU tests, a 4,000-case FP8
# fuzz (every dispatched FP8 kernel hit) and memcheck / racecheck / synccheck at 0 over all 60 dispatched FP8
# kernels with 1,000 keys: on by default at head dims 64-128
FP8_GPU_VERIFIED = True
# ... but not at 192 / 256, where O is carried in one FP8 WGMMA accumulator (a second one for two-level
# accumulation does not fit the registers): its error grows with the keys (docs/results-fp8.md), and the
# fuzz's kernel-order check fails on long rows of large inputs (hdim 256, 2,634 keys). Those calls need the
# opt-in variable set to 1
FP8_ONE_LEVEL_HDIMS = (192, 256)
FP8_OPT_IN = "FLASHHOPPER_EXPERIMENTAL_FP8"
# the varlen backward through seqused_q / seqused_k (the used lengths taken by the kernels, every tile row
# past a sequence's used length zeroed in shared memory, zero gradients past them): passed
# tests/test_varlen_gpu.py and a 5,000-case fuzz with 0 failures on an H100 (2026-12-05, 7da5413): on by
# default; the variable stays for code that sets it
SEQUSED_BWD_GPU_VERIFIED = True
SEQUSED_BWD_OPT_IN = "FLASHHOPPER_EXPERIMENTAL_SEQUSED_BWD"
# the 1-warpgroup decode tile (plan.fwd_config_decode) for kvcache's rearranged decode: it passes the
# GPU suite (tests/test_decode_gpu.py, 2026-12-05) but timed no faster than the varlen kernel's tile
# (docs/results-decode.md: decode is bound by its host-side kernels, not by the tile), so decode keeps
# the varlen tile unless this variable is set to 1 (decode_tile_enabled)
DECODE_TILE_GPU_VERIFIED = False
DECODE_TILE_OPT_IN = "FLASHHOPPER_EXPERIMENTAL_DECODE_TILE"
# the paged K / V path (FwdConfig.page_size: the varlen and decode kernels read a paged cache's pages by
# TMA, plan.fwd_config_paged) passed tests/test_paged_gpu.py's checks (2026-12-05): on by default where
# the page size serves (paged_tma_enabled); other page sizes gather the pages first
PAGED_TMA_GPU_VERIFIED = True
PAGED_TMA_OPT_IN = "FLASHHOPPER_EXPERIMENTAL_PAGED_TMA"
# split-KV decode's merge by LSE in one kernel (hopper/combine.py) instead of splitkv.merge_by_lse's nine
# torch ops: passed tests/test_combine_gpu.py and memcheck / racecheck (0 errors) on an H100 (55b212c),
# 1 x 8k decode 56.6 -> 34.2 us (docs/results-decode.md): on by default; the variable stays for code
# that sets it
DECODE_MERGE_GPU_VERIFIED = True
DECODE_MERGE_OPT_IN = "FLASHHOPPER_EXPERIMENTAL_DECODE_MERGE"
# kvcache's decode with the split inside the attention kernel (FwdConfig.split_kv, runtime.forward_split: the
# tile walk maps to (item, head, split) by arithmetic, each split's keys read from cache_seqlens in the
# kernel, the partials merged by hopper/combine.py: two launches in all at 1 x 8k, where the splits built by
# torch ops around the varlen kernel take 10 to 18): passed tests/test_decode_split_gpu.py and 300 decode
# fuzz cases on an H100 (2026-12-05), 1 x 8k decode at 0.59 of the copy rate where the arranged call read
# 0.33 (docs/results-decode.md): on by default (the merge kernel with it); the variable stays for code
# that sets it
DECODE_SPLIT_GPU_VERIFIED = True
DECODE_SPLIT_OPT_IN = "FLASHHOPPER_EXPERIMENTAL_DECODE_SPLIT"
# kvcache's decode of 2 to 16 query tokens an item (speculative decoding; no window, unpacked q): each KV
# head's query heads of all the tokens packed as the split kernel's rows, causal in the kernel
# (FwdConfig.token_rows; kvcache._qlen_call). Passed tests/test_decode_qlen_gpu.py and the KV-cache, split,
# paged and serving GPU suites on an H100 (2026-12-06, 5a432ce + its window fix: 241 passed); 4 query tokens
# read 0.97-1.01 of the copy rate at batch >= 8 (docs/results-decode.md): on by default; the variable stays
# for code that sets it
DECODE_QLEN_GPU_VERIFIED = True
DECODE_QLEN_OPT_IN = "FLASHHOPPER_EXPERIMENTAL_DECODE_QLEN"
BACKENDS = ("auto", "hopper", "reference")
# TMA needs 16-byte aligned global strides and base addresses.
ALIGN_BYTES = 16


def _is_real(x) -> bool:
    # exact types first: the ABC checks cost ~0.5 us, on every call
    return type(x) in (float, int) or (isinstance(x, numbers.Real) and not isinstance(x, bool))


def _is_int(x) -> bool:
    return type(x) is int or (isinstance(x, numbers.Integral) and not isinstance(x, bool))


def check_tensors(q, k, v, layout: bool = True, allow_empty: bool = False) -> None:
    """Types, dtypes, devices, ranks and shapes; with `layout`, also what TMA needs of strides and
    data pointers (which only real tensors have). `allow_empty`: varlen's packed tensors may hold no
    token."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in SUPPORTED_DTYPES:
            hint = " (FP8 attention takes e4m3: more mantissa for the same range of scores)" \
                if t.dtype == torch.float8_e5m2 else ""
            raise TypeError(f"{name} has dtype {t.dtype}; accepted: torch.float16, torch.bfloat16, "
                            f"torch.float8_e4m3fn{hint}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; q, k and v must share a dtype")
        if t.device != q.device:
            raise ValueError(
                f"{name} is on {t.device} but q is on {q.device}; q, k and v must share a device"
            )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} has rank {t.dim()} (shape {tuple(t.shape)}); "
                "accepted: rank 4, (batch, seqlen, heads, headdim)"
            )
        if t.numel() == 0 and not allow_empty:
            raise ValueError(f"{name} is empty (shape {tuple(t.shape)}); every dimension must be > 0")
    _check_shapes(q, k, v)
    if layout:
        check_layouts(("q", q), ("k", k), ("v", v))


def _check_shapes(q, k, v) -> None:
    (bq, _, hq, hdim), (bk, sk, hk, dk), (bv, sv, hv, dv) = q.shape, k.shape, v.shape
    if not bq == bk == bv:
        raise ValueError(f"batch differs: q has {bq}, k has {bk}, v has {bv}; it must be equal")
    if sk != sv:
        raise ValueError(f"v has seqlen {sv} but k has {sk}; seqlen_k must match")
    if dk != hdim:
        raise ValueError(f"k has headdim {dk} but q has {hdim}; they must be equal")
    if dv != hdim and (hdim, dv) not in SPLIT_HDIMS:
        pairs = ", ".join(map(str, SPLIT_HDIMS))
        raise ValueError(f"v has headdim {dv} but q has {hdim}; accepted: the same, or (q, v) head dims "
                         f"{pairs}")
    if hdim not in SUPPORTED_HDIMS:
        accepted = ", ".join(map(str, SUPPORTED_HDIMS))
        raise ValueError(f"headdim (q.shape[-1]) is {hdim}; accepted: {accepted}")
    if hk != hv:
        raise ValueError(f"v has {hv} heads but k has {hk}; k and v heads must match")
    if hq % hk:
        raise ValueError(f"q has {hq} heads, k has {hk}: heads_q must be a multiple of heads_k (GQA/MQA)")


def check_descales(q, k, descales) -> tuple:
    """FP8's q / k / v descales: each None (1) or a float32 tensor on q's device, any strides (an
    expanded scalar too), of shape (batch, heads_k), or for q and k one per token: q_descale (batch,
    heads_q, seqlen_q), k_descale (batch, heads_k, seqlen_k) (per-block scales repeated over each
    block's rows: flashhopper.fp8.quantize "block"); only with float8_e4m3fn inputs."""
    names = ("q_descale", "k_descale", "v_descale")
    if q.dtype not in FP8_DTYPES:
        for name, d in zip(names, descales, strict=True):
            if d is not None:
                raise ValueError(f"{name} is given but q is {q.dtype}; descales go with float8_e4m3fn inputs")
        return descales
    b, hk = int(q.shape[0]), int(k.shape[2])
    per_head = (b, hk)
    per_token = {"q_descale": ("(batch, heads_q, seqlen_q)", (b, int(q.shape[2]), int(q.shape[1]))),
                 "k_descale": ("(batch, heads_k, seqlen_k)", (b, hk, int(k.shape[1])))}
    for name, d in zip(names, descales, strict=True):
        if d is None:
            continue
        if not isinstance(d, torch.Tensor):
            raise TypeError(f"{name} must be None or a torch.Tensor, got {type(d).__name__}")
        if d.dtype != torch.float32:
            raise TypeError(f"{name} has dtype {d.dtype}; accepted: torch.float32")
        token = per_token.get(name)
        if tuple(d.shape) != per_head and (token is None or tuple(d.shape) != token[1]):
            accepted = f"(batch, heads_k) = {per_head}"
            if token is not None:
                accepted += f" or per token {token[0]} = {token[1]}"
            raise ValueError(f"{name} has shape {tuple(d.shape)}; accepted: {accepted} (expand a scalar: "
                             "d.expand(batch, heads_k))")
        if d.device != q.device:
            raise ValueError(f"{name} is on {d.device} but q is on {q.device}")
    return descales


def qk_descale_kind(descales) -> str:
    """Which FP8 kernel checked descales need (config.QK_DESCALES): "token" when q's or k's is given per
    token (rank 3), else "head"."""
    return "token" if any(d is not None and d.dim() == 3 for d in descales[:2]) else "head"


def needs_grad(q, k, v) -> bool:
    """Autograd will want a backward of this call."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _enabled(verified: bool, opt_in: str) -> bool:
    """A gated path's switch: its GPU_VERIFIED constant, or the caller's opt-in variable set to 1."""
    return verified or os.environ.get(opt_in) == "1"


def _require_verified(what: str, verified: bool, opt_in: str) -> None:
    """A path (`what`: "the FP8 forward", ...) whose current kernels have not passed the GPU suite:
    refused unless the caller opts in."""
    if not _enabled(verified, opt_in):
        raise NotImplementedError(f"{what}: its current kernels have not yet been verified on a GPU; set "
                                  f"{opt_in}=1 to run it anyway")


def decode_tile_enabled() -> bool:
    """Whether the rearranged decode runs on the 1-warpgroup tile (DECODE_TILE_GPU_VERIFIED, or opted
    in by DECODE_TILE_OPT_IN=1); otherwise on the varlen forward's own tile."""
    return _enabled(DECODE_TILE_GPU_VERIFIED, DECODE_TILE_OPT_IN)


def paged_tma_enabled() -> bool:
    """Whether flash_attn_with_kvcache reads a paged cache's pages in the kernels (PAGED_TMA_GPU_VERIFIED,
    or opted in by PAGED_TMA_OPT_IN=1) where they serve its page size; otherwise it gathers them first."""
    return _enabled(PAGED_TMA_GPU_VERIFIED, PAGED_TMA_OPT_IN)


def decode_merge_enabled() -> bool:
    """Whether kvcache's rearranged decode merges the splits in one kernel (DECODE_MERGE_GPU_VERIFIED, or
    opted in by DECODE_MERGE_OPT_IN=1); otherwise by splitkv.merge_by_lse's torch ops."""
    return _enabled(DECODE_MERGE_GPU_VERIFIED, DECODE_MERGE_OPT_IN)


def decode_split_enabled() -> bool:
    """Whether kvcache's rearranged decode splits its keys inside the attention kernel and merges them by the
    merge kernel (DECODE_SPLIT_GPU_VERIFIED, or opted in by FLASHHOPPER_EXPERIMENTAL_DECODE_SPLIT=1)."""
    return _enabled(DECODE_SPLIT_GPU_VERIFIED, DECODE_SPLIT_OPT_IN)


def decode_qlen_enabled() -> bool:
    """Whether kvcache's decode of 2 to 16 query tokens an item takes the split inside the attention kernel
    with the tokens packed into its rows, causal in the kernel (kvcache._qlen_call;
    DECODE_QLEN_GPU_VERIFIED, or opted in by FLASHHOPPER_EXPERIMENTAL_DECODE_QLEN=1); otherwise the varlen
    kernel over every query head."""
    return _enabled(DECODE_QLEN_GPU_VERIFIED, DECODE_QLEN_OPT_IN)


def check_split_hdims_call(q, k, v) -> None:
    """A value head dim other than the query's (SPLIT_HDIMS, forward and backward) takes 16-bit inputs."""
    if v.shape[-1] != q.shape[-1] and q.dtype in FP8_DTYPES:
        raise TypeError("float8_e4m3fn inputs take equal q and v head dims")


def check_fp8_call(q, k, v) -> None:
    """What the FP8 forward does not do (yet): gradients, and running before its GPU verification."""
    if q.dtype not in FP8_DTYPES:
        return
    if needs_grad(q, k, v):
        raise NotImplementedError("float8_e4m3fn inputs that require grad: there is no FP8 backward; "
                                  "detach them, or train in bf16 / fp16")
    _require_verified("the FP8 forward", FP8_GPU_VERIFIED, FP8_OPT_IN)
    if q.shape[-1] in FP8_ONE_LEVEL_HDIMS and not _enabled(False, FP8_OPT_IN):
        raise NotImplementedError(
            f"float8_e4m3fn inputs at head dim {q.shape[-1]}: its FP8 forward carries O in one FP8 "
            "accumulator, whose error grows with the number of keys (two-level accumulation covers head "
            f"dims 64-128); set {FP8_OPT_IN}=1 to run it anyway, or use bfloat16")


def check_varlen_tensors(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                         seqused_k, layout: bool = True) -> int:
    """flash_attn_varlen_func's packed tensors and sequence bounds; returns the batch size.

    Checked here: types, dtypes, devices, ranks and shapes, and (with `layout`) what TMA needs of
    strides and pointers. Not checked, the caller's contract (each would cost a device-to-host
    copy on every call): cu_seqlens start at 0, never decrease and end at the packed length;
    seqused_* at most each sequence's length; max_seqlen_* at least every (used) length.
    backend="reference" checks all of them."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} has rank {t.dim()} (shape {tuple(t.shape)}); accepted: rank 3, "
                             "(total_tokens, heads, headdim)")
    check_tensors(q[None], k[None], v[None], layout=False, allow_empty=True)  # dtypes, devices, heads, dims
    if q.dtype in FP8_DTYPES:
        raise TypeError("varlen with float8_e4m3fn inputs is not supported yet; accepted: float16, bfloat16")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name} has dtype {cu.dtype} and shape {tuple(cu.shape)}; accepted: int32 of "
                             "shape (batch + 1,), batch >= 1")
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device} but q is on {q.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries, cu_seqlens_k "
                         f"{cu_seqlens_k.shape[0]}; both are batch + 1")
    batch = cu_seqlens_q.shape[0] - 1
    for name, used in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if used is None:
            continue
        if not isinstance(used, torch.Tensor) or used.dtype != torch.int32 or tuple(used.shape) != (batch,):
            raise ValueError(f"{name} must be None or an int32 tensor of shape (batch,) = ({batch},)")
        if used.device != q.device:
            raise ValueError(f"{name} is on {used.device} but q is on {q.device}")
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not _is_int(n) or n < 0:
            raise TypeError(f"{name} must be a Python int >= 0, got {n!r}")
    if layout:  # an empty tensor is never read
        check_layouts(*((name, t) for name, t in (("q", q), ("k", k), ("v", v)) if t.numel()))
    return batch


def check_varlen_call(q, k, v, seqused_q=None, seqused_k=None) -> None:
    """What the varlen kernels do not do (yet): the backward through seqused_q / seqused_k before its GPU
    verification (SEQUSED_BWD_GPU_VERIFIED). (Varlen itself passed the GPU suite and the fuzz, its
    forward's walk on an H100 at 55b212c: docs/testing.md.)"""
    if needs_grad(q, k, v) and (seqused_q is not None or seqused_k is not None):
        _require_verified("the varlen backward through seqused_q / seqused_k", SEQUSED_BWD_GPU_VERIFIED,
                          SEQUSED_BWD_OPT_IN)


def layout_problem(name: str, t: torch.Tensor) -> str | None:
    """Why TMA cannot read `t` as it is laid out (a message naming `name`), or None if it can."""
    stride = t.stride()
    if stride[-1] != 1:
        return f"{name} has stride {stride[-1]} in its last dimension; accepted: 1 (contiguous headdim)"
    step = ALIGN_BYTES // t.element_size()
    for s in stride[:-1]:  # a loop, not any(): this runs on every call
        if s % step:
            return (
                f"{name} has strides {tuple(stride)}; accepted: every stride but the last a multiple of "
                f"{step} elements ({ALIGN_BYTES}-byte aligned rows)"
            )
    if t.data_ptr() % ALIGN_BYTES:
        return f"{name}.data_ptr() is not {ALIGN_BYTES}-byte aligned; accepted: aligned storage"
    return None


def check_layouts(*named) -> None:
    """Raise for the first of the (name, tensor) pairs that TMA cannot read as laid out."""
    for name, t in named:
        problem = layout_problem(name, t)
        if problem:
            raise ValueError(problem)


def normalize_window(window_size) -> tuple[int, int]:
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a 2-tuple (left, right) of ints >= -1, got {window_size!r}")
    for side in window_size:
        if not _is_int(side):
            raise TypeError(f"window_size must be a 2-tuple (left, right) of ints >= -1, got {window_size!r}")
        if side < -1:
            raise ValueError(
                f"window_size={tuple(window_size)!r}: each side must be >= -1 (-1 means unbounded)"
            )
    return int(window_size[0]), int(window_size[1])


def normalize_scale(softmax_scale, hdim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(hdim)
    if not _is_real(softmax_scale):
        raise TypeError(f"softmax_scale must be None or a positive finite number, got {softmax_scale!r}")
    softmax_scale = float(softmax_scale)
    # comparisons, not math.isfinite, which torch.compile(dynamic=True) cannot trace (NaN fails both)
    if not 0 < softmax_scale < math.inf:
        raise ValueError(f"softmax_scale is {softmax_scale!r}; accepted: None or a positive finite number")
    return softmax_scale


def normalize_softcap(softcap) -> float:
    if not _is_real(softcap):
        raise TypeError(f"softcap must be a finite number >= 0 (0 disables), got {softcap!r}")
    softcap = float(softcap)
    if not 0 <= softcap < math.inf:  # as softmax_scale
        raise ValueError(f"softcap is {softcap!r}; accepted: a finite number >= 0 (0 disables)")
    return softcap


def check_flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_backend(backend) -> str:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend is {backend!r}; accepted: {', '.join(map(repr, BACKENDS))}")
    return backend


HOPPER_CAPABILITY = (9, 0)


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def require_hopper(q: torch.Tensor, backend: str = "hopper") -> None:
    """The kernels' device check: CUDA tensors on an sm_90 GPU, or a RuntimeError that says where the
    tensors are and what runs anywhere."""
    where = str(q.device)
    if q.device.type == "cuda" and torch.cuda.is_available():
        index = q.device.index if q.device.index is not None else torch.cuda.current_device()
        capability = _capability(index)
        if capability == HOPPER_CAPABILITY:
            return
        where += f" (compute capability {capability[0]}.{capability[1]})"
    raise RuntimeError(
        f"backend={backend!r} needs CUDA tensors on a Hopper GPU (H100/H200, sm_90); the tensors are on "
        f'{where}. backend="reference" runs anywhere (exact float64, slow).'
    )
