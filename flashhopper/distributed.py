"""Context parallelism: ring attention over a sequence sharded across the ranks of a process group.

`ring_attn_func(q, k, v, group=...)` takes each rank's shard (b, s_local, h, d) of one self-attention
over the whole sequence and returns that rank's shard of its output. The K/V shards travel round the
ring (rank r sends to r + 1 and receives from r - 1) while every rank attends its queries to the shard
it holds; the partial outputs are merged by their LSE in fp32. The backward passes K/V round again with
the dK/dV accumulators (fp32) behind them; dQ stays local.

Sharding (`layout`): "zigzag" (the default) cuts the sequence into 2W chunks and gives rank r chunks r
and 2W - 1 - r, so that under a causal mask every rank has the same work at every step; "contiguous"
gives rank r the r-th of W equal pieces (any s_local, 1 included). `shard_sequence`, `unshard_sequence`
and `shard_positions` (each token's global position, e.g. for RoPE) do the same cut for the caller.

Each step attends the local query chunks to the key chunks held, each (query chunk, key chunk) pair with
the part of the global mask that falls on it, expressed as a window of flash_attn_func's own
(`pair_window`): pairs the mask leaves empty are not computed (their K/V are still passed on), pairs it
leaves whole run unmasked.

What runs where today: on CPU with the gloo backend and backend="reference", the forward and gradients
are verified against single-process attention (tests/test_distributed.py, world sizes 2 and 4). On
GPUs the same loop calls the Hopper kernels per step (flash_attn_func for the forward, ops.bwd, which
takes an external out and LSE, for the backward) and runs the NCCL transfers on a side stream. On one
GPU, with the ranks as threads and a loopback in place of the transfers, the kernels' path passes the
suite's correctness rule at 2, 3 and 4 ranks (tests/test_distributed_gpu.py); NCCL across GPUs has not
run yet.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flashhopper import sms
from flashhopper.interface import flash_attn_func
from flashhopper.reference import attention_bwd_from_lse, attention_ref
from flashhopper.splitkv import merge_by_lse
from flashhopper.validation import (
    check_backend,
    check_flag,
    normalize_scale,
    normalize_softcap,
    normalize_window,
)

__all__ = ["LAYOUTS", "PairMask", "pair_window", "ring_attn_func", "shard_chunks", "shard_positions",
           "shard_sequence", "unshard_sequence"]

LAYOUTS = ("zigzag", "contiguous")
# the reference backend also takes these (exact float64 per step); the kernels take fp16 / bf16
REFERENCE_DTYPES = (torch.float32, torch.float64)
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------------
# sharding


def _check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout is {layout!r}; accepted: {', '.join(map(repr, LAYOUTS))}")
    return layout


def _check_rank(rank, world_size) -> None:
    for name, x in (("rank", rank), ("world_size", world_size)):
        if not isinstance(x, int) or isinstance(x, bool):
            raise TypeError(f"{name} must be an int, got {x!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}, world_size={world_size}: need world_size >= 1 and "
                         "0 <= rank < world_size")


def shard_chunks(s_local: int, *, rank: int, world_size: int, layout: str = "zigzag"):
    """The global (start, length) of each chunk of rank's shard, in the order the shard stores them:
    zigzag: chunks rank and 2 * world_size - 1 - rank of s_local // 2 tokens (s_local even);
    contiguous: one chunk of s_local tokens from rank * s_local."""
    _check_layout(layout)
    _check_rank(rank, world_size)
    if layout == "contiguous":
        return ((rank * s_local, s_local),)
    if s_local % 2:
        raise ValueError(f"s_local={s_local}: the zigzag layout holds two equal chunks per rank, so s_local "
                         "must be even (layout='contiguous' takes any length)")
    c = s_local // 2
    return ((rank * c, c), ((2 * world_size - 1 - rank) * c, c))


def _local_length(seqlen: int, world_size: int, layout: str, what: str) -> int:
    pieces = 2 * world_size if layout == "zigzag" else world_size
    if seqlen % pieces:
        raise ValueError(f"{what} is {seqlen}: the {layout} layout over {world_size} ranks cuts it into "
                         f"{pieces} equal chunks, so it must be a multiple of {pieces}")
    return seqlen // world_size


def shard_sequence(x: torch.Tensor, *, rank: int, world_size: int, layout: str = "zigzag", dim: int = 1):
    """Rank's shard of x along `dim` (the sequence; 1 for (b, s, h, d)), as ring_attn_func takes it."""
    _check_layout(layout)
    _check_rank(rank, world_size)
    s_local = _local_length(x.shape[dim], world_size, layout, f"x.shape[{dim}]")
    chunks = shard_chunks(s_local, rank=rank, world_size=world_size, layout=layout)
    return torch.cat([x.narrow(dim, start, length) for start, length in chunks], dim=dim)


def unshard_sequence(shards, *, layout: str = "zigzag", dim: int = 1):
    """The whole sequence from every rank's shard (a list in rank order, e.g. from all_gather): the
    inverse of shard_sequence. Differentiable (a torch.cat)."""
    _check_layout(layout)
    shards = list(shards)
    if not shards:
        raise ValueError("shards is empty: give every rank's shard, in rank order")
    s_local = shards[0].shape[dim]
    for r, s in enumerate(shards):
        if s.shape[dim] != s_local:
            raise ValueError(f"shards[{r}] has {s.shape[dim]} tokens along dim {dim}, shards[0] {s_local}; "
                             "every rank's shard has the same length")
    pieces = []
    for r, shard in enumerate(shards):
        offset = 0
        for start, length in shard_chunks(s_local, rank=r, world_size=len(shards), layout=layout):
            pieces.append((start, shard.narrow(dim, offset, length)))
            offset += length
    return torch.cat([p for _, p in sorted(pieces, key=lambda item: item[0])], dim=dim)


def shard_positions(seqlen: int, *, rank: int, world_size: int, layout: str = "zigzag", device=None):
    """int64 (s_local,): the global position of each token of rank's shard (for RoPE and the like)."""
    _check_layout(layout)
    s_local = _local_length(seqlen, world_size, layout, "seqlen")
    chunks = shard_chunks(s_local, rank=rank, world_size=world_size, layout=layout)
    return torch.cat([torch.arange(start, start + length, device=device) for start, length in chunks])


# ---------------------------------------------------------------------------------------------------
# the global mask on one (query chunk, key chunk) pair


@dataclass(frozen=True)
class PairMask:
    """What one (query chunk, key chunk) pair computes: queries q_rows and keys k_rows ([start, stop),
    relative to the chunks) under flash_attn_func's causal / window_size; outside those rows nothing is
    visible."""

    q_rows: tuple[int, int]
    k_rows: tuple[int, int]
    causal: bool
    window: tuple[int, int]


@functools.lru_cache(maxsize=4096)
def pair_window(q_start: int, q_len: int, k_start: int, k_len: int, *, causal: bool,
                window_size: tuple[int, int]) -> PairMask | None:
    """The global self-attention mask (causal, window_size as flash_attn_func takes them for a whole
    sequence: query i sees keys in [i - left, i + right]) on the queries [q_start, q_start + q_len) and
    keys [k_start, k_start + k_len), as one flash_attn_func call: None where no query sees any key.

    flash_attn_func's window is relative to the diagonal of the block's bottom-right corner and cannot
    put the lower bound above it (left < 0) nor the upper bound below it, so the block is first cut to
    its visible rows and columns (whose bottom-right corner then lies within the band), and the bounds
    that cut no entry are dropped (-1): a wholly visible pair has no mask, and a window (-1, 0) is
    given as causal=True."""
    left, right = int(window_size[0]), (0 if causal else int(window_size[1]))
    # key j is visible to query i (both relative to their chunks) iff lo <= j - i <= hi
    shift = q_start - k_start
    lo = None if left < 0 else shift - left
    hi = None if right < 0 else shift + right
    ks, ke = (0 if lo is None else max(0, lo)), (k_len if hi is None else min(k_len, q_len + hi))
    qs, qe = (0 if hi is None else max(0, -hi)), (q_len if lo is None else min(q_len, k_len - lo))
    if ks >= ke or qs >= qe:
        return None
    nq, nk = qe - qs, ke - ks
    # the same band on the cut block, j'' - i'' in [lo + qs - ks, hi + qs - ks], against its corner nk - nq
    wl = -1 if lo is None else (nk - nq) - (lo + qs - ks)
    wr = -1 if hi is None else (hi + qs - ks) - (nk - nq)
    if wl >= nk - 1:  # no query's lower bound reaches past key 0
        wl = -1
    if wr >= nq - 1:  # no query's upper bound falls short of the last key
        wr = -1
    if (wl, wr) == (-1, 0):
        return PairMask((qs, qe), (ks, ke), True, (-1, -1))
    return PairMask((qs, qe), (ks, ke), False, (wl, wr))


@dataclass(frozen=True)
class _Pair:
    """One step's call: query rows and key rows of the local shards, and their mask."""

    q_rows: slice
    k_rows: slice
    causal: bool
    window: tuple[int, int]


def step_pairs(s_local: int, *, rank: int, src: int, world_size: int, layout: str, causal: bool,
               window_size: tuple[int, int]) -> list[_Pair]:
    """The calls of the step where `rank`'s queries meet `src`'s keys (rows of the local shards); an
    empty list where the mask hides every key from every query (the step computes nothing)."""
    pairs = []
    q_chunks = shard_chunks(s_local, rank=rank, world_size=world_size, layout=layout)
    k_chunks = shard_chunks(s_local, rank=src, world_size=world_size, layout=layout)
    q_off = 0
    for q_start, q_len in q_chunks:
        k_off = 0
        for k_start, k_len in k_chunks:
            m = pair_window(q_start, q_len, k_start, k_len, causal=causal, window_size=window_size)
            if m is not None:
                pairs.append(_Pair(slice(q_off + m.q_rows[0], q_off + m.q_rows[1]),
                                   slice(k_off + m.k_rows[0], k_off + m.k_rows[1]), m.causal, m.window))
            k_off += k_len
        q_off += q_len
    return pairs


# ---------------------------------------------------------------------------------------------------
# transfers round the ring


@functools.cache
def _side_stream(device: torch.device):
    return torch.cuda.Stream(device=device)


class _Ring:
    """Point-to-point transfers to the next rank of the group and from the previous one
    (torch.distributed.batch_isend_irecv). On CUDA they are posted on a side stream that first waits for
    the compute stream's work so far; wait() makes the compute stream wait for them. One rank: nothing
    moves (the tensors sent are those received)."""

    def __init__(self, group, device: torch.device):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world) if self.world > 1 else None
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world) if self.world > 1 else None
        self.stream = _side_stream(device) if device.type == "cuda" else None

    def post(self, tensors):
        """Send `tensors` to the next rank, receive the same shapes from the previous one; returns at once
        a handle for wait(). The tensors sent must not change until then."""
        if self.world == 1:
            return [], list(tensors)
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in received]
        if self.stream is None:
            return dist.batch_isend_irecv(ops), received
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            requests = dist.batch_isend_irecv(ops)
        for t in (*tensors, *received):  # used on the side stream: not reused before it is done
            t.record_stream(self.stream)
        return requests, received

    def wait(self, handle):
        """The tensors a post() received, once they are there (for the compute stream on CUDA)."""
        requests, received = handle
        for r in requests:
            r.wait()
        if self.stream is not None and requests:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        return received


# ---------------------------------------------------------------------------------------------------
# one step


@dataclass(frozen=True)
class _Config:
    group: object
    layout: str
    scale: float
    causal: bool
    window: tuple[int, int]
    softcap: float
    deterministic: bool
    backend: str
    sm_margin: int


def _step_forward(q, k, v, pair: _Pair, cfg: _Config):
    """(out (b, n, hq, dv), lse (b, hq, n) fp32) of the pair's queries against its keys."""
    qs, ks, vs = q[:, pair.q_rows], k[:, pair.k_rows], v[:, pair.k_rows]
    if q.dtype in REFERENCE_DTYPES:  # flash_attn_func takes fp16 / bf16 only; the same exact reference
        return attention_ref(qs, ks, vs, cfg.scale, pair.causal, pair.window, cfg.softcap)
    with sms.sm_margin(cfg.sm_margin):
        return flash_attn_func(qs, ks, vs, softmax_scale=cfg.scale, causal=pair.causal,
                               window_size=pair.window, softcap=cfg.softcap, return_lse=True,
                               backend=cfg.backend)


def _step_backward(q, k, v, out, dout, lse, pair: _Pair, cfg: _Config):
    """(dq, dk, dv) of the pair's rows from the merged (global) out and LSE: the pair's share of dq, and
    dk, dv of its keys from these queries. The reference backend (and fp32 / fp64) recomputes them in
    float64 (reference.attention_bwd_from_lse); the kernels through ops.bwd, which takes out and LSE
    from outside the same way (dk, dv in the input dtype: a kernel that adds into fp32 accumulators
    would save their rounding per step)."""
    qs, ks, vs = q[:, pair.q_rows], k[:, pair.k_rows], v[:, pair.k_rows]
    os_, dos, ls = out[:, pair.q_rows], dout[:, pair.q_rows], lse[:, :, pair.q_rows]
    if cfg.backend == "reference" or q.dtype in REFERENCE_DTYPES:
        return attention_bwd_from_lse(qs, ks, vs, os_, dos, ls, cfg.scale, pair.causal, pair.window,
                                      cfg.softcap)
    from flashhopper import ops

    return ops.bwd(dos, qs, ks, vs, os_, ls.contiguous(), cfg.scale, pair.causal, pair.window[0],
                   pair.window[1], cfg.softcap, cfg.deterministic)


def _merge_into(acc_out, acc_lse, rows: slice, out, lse) -> None:
    """Merge a step's partial (out (b, n, h, dv), lse (b, h, n)) into the running fp32 result's rows
    (acc_out (b, s, h, dv), acc_lse (b, s, h)) by LSE; rows that saw no key on either side stay 0, -inf."""
    o = torch.stack((acc_out[:, rows], out.to(acc_out.dtype)))
    w = torch.stack((acc_lse[:, rows], lse.transpose(1, 2).to(acc_lse.dtype)))
    merge_by_lse(o, w, dim=0, out=acc_out[:, rows], lse_out=acc_lse[:, rows])


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------------
# the ring loops


def _ring_forward(q, k, v, cfg: _Config):
    """(out q.dtype (b, s, hq, dv), lse fp32 (b, hq, s)) of the local queries against every rank's keys."""
    ring = _Ring(cfg.group, q.device)
    b, s, hq, _ = q.shape
    acc = _acc_dtype(q.dtype)
    acc_out = torch.zeros(b, s, hq, v.shape[-1], dtype=acc, device=q.device)
    acc_lse = torch.full((b, s, hq), float("-inf"), dtype=acc, device=q.device)
    kv = (k.contiguous(), v.contiguous())  # point-to-point sends take dense tensors (NCCL's do not check)
    for step in range(ring.world):
        # the next step's K/V are on their way before this step computes
        pending = ring.post(kv) if step + 1 < ring.world else None
        src = (ring.rank - step) % ring.world
        for pair in step_pairs(s, rank=ring.rank, src=src, world_size=ring.world, layout=cfg.layout,
                               causal=cfg.causal, window_size=cfg.window):
            out, lse = _step_forward(q, kv[0], kv[1], pair, cfg)
            _merge_into(acc_out, acc_lse, pair.q_rows, out, lse)
        if pending is not None:
            kv = tuple(ring.wait(pending))
    return acc_out.to(q.dtype), acc_lse.transpose(1, 2).to(torch.float32).contiguous()


def _ring_backward(dout, q, k, v, out, lse, cfg: _Config):
    """(dq, dk, dv) of the local shards. K/V go round as in the forward; each key shard's dK/dV
    accumulator (fp32) follows it one step behind, each rank adding its queries' share, and arrives
    back home after a full turn; dQ adds up locally."""
    ring = _Ring(cfg.group, q.device)
    s = q.shape[1]
    acc = _acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = (k.contiguous(), v.contiguous())  # (as the forward's)
    dkv_pending = None
    for step in range(ring.world):
        kv_pending = ring.post(kv) if step + 1 < ring.world else None
        src = (ring.rank - step) % ring.world
        dk_part = dv_part = None
        for pair in step_pairs(s, rank=ring.rank, src=src, world_size=ring.world, layout=cfg.layout,
                               causal=cfg.causal, window_size=cfg.window):
            if dk_part is None:
                dk_part = torch.zeros(k.shape, dtype=acc, device=k.device)
                dv_part = torch.zeros(v.shape, dtype=acc, device=v.device)
            dq_s, dk_s, dv_s = _step_backward(q, kv[0], kv[1], out, dout, lse, pair, cfg)
            dq[:, pair.q_rows] += dq_s
            dk_part[:, pair.k_rows] += dk_s
            dv_part[:, pair.k_rows] += dv_s
        # src's accumulators, from the rank that held src's keys last step (none yet at step 0)
        if dkv_pending is None:
            dk_acc = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv_acc = torch.zeros(v.shape, dtype=acc, device=v.device)
        else:
            dk_acc, dv_acc = ring.wait(dkv_pending)
        if dk_part is not None:
            dk_acc += dk_part
            dv_acc += dv_part
        dkv_pending = ring.post((dk_acc, dv_acc))  # the last one goes home: src + 1 is the next rank
        if kv_pending is not None:
            kv = tuple(ring.wait(kv_pending))
    dk_acc, dv_acc = ring.wait(dkv_pending)
    return dq.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg):
        out, lse = _ring_forward(q, k, v, cfg)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = cfg
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        # every rank must take part in the ring: an unused out still runs with a zero gradient (autograd
        # materializes it)
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, ctx.cfg)
        return dq, dk, dv, None


# ---------------------------------------------------------------------------------------------------
# the entry point


def _check_tensors(q, k, v, backend: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; accepted: rank 4, (batch, s_local, heads, "
                             "headdim)")
        if 0 in t.shape:
            raise ValueError(f"{name} is empty (shape {tuple(t.shape)}); every dimension must be > 0")
    accepted = KERNEL_DTYPES + (REFERENCE_DTYPES if backend == "reference" else ())
    if q.dtype not in accepted:
        raise TypeError(f"q has dtype {q.dtype}; accepted with backend={backend!r}: "
                        f"{', '.join(map(str, accepted))}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; q, k and v must share a dtype")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; q, k and v must share a "
                             "device")
    (b, s, hq, d), (bk, sk, hk, dk), (bv, sv, hv, _) = q.shape, k.shape, v.shape
    if not b == bk == bv:
        raise ValueError(f"batch differs: q has {b}, k has {bk}, v has {bv}; it must be equal")
    if not s == sk == sv:
        raise ValueError(f"s_local differs: q has {s}, k has {sk}, v has {sv}; self-attention shards q, k "
                         "and v alike")
    if hk != hv:
        raise ValueError(f"v has {hv} heads but k has {hk}; k and v heads must match")
    if hq % hk:
        raise ValueError(f"q has {hq} heads, k has {hk}: heads_q must be a multiple of heads_k (GQA/MQA)")
    if dk != d:
        raise ValueError(f"k has headdim {dk} but q has {d}; they must be equal")


def _resolve_group(group):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("ring_attn_func needs an initialized process group "
                           "(torch.distributed.init_process_group); group=None means the default one")
    group = dist.group.WORLD if group is None else group
    if dist.get_rank(group) < 0:
        raise ValueError("group: this process is not a member of the process group given")
    return group


def _check_ranks_agree(q, k, v, group) -> None:
    """Every rank's shapes against every other's (one small all_gather), so that all ranks raise
    together instead of some waiting forever on a transfer of the wrong size. Only where the tensors are
    on the CPU (gloo): on GPUs it would cost a device-to-host sync per call, and equal shapes on all
    ranks are the caller's contract."""
    if q.device.type != "cpu" or dist.get_world_size(group) == 1:
        return
    mine = torch.tensor([*q.shape, *k.shape, v.shape[-1]], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    for r, theirs in enumerate(every):
        if not torch.equal(theirs, mine):
            b, s, hq, d, _, _, hk, _, dv = theirs.tolist()
            raise ValueError(f"shapes differ between ranks: rank {r} of the group has q (b={b}, "
                             f"s_local={s}, hq={hq}, d={d}), k heads {hk}, v headdim {dv}; rank "
                             f"{dist.get_rank(group)} has q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                             f"{tuple(v.shape)}: every rank holds an equal shard")


def ring_attn_func(q, k, v, group=None, causal=False, window_size=(-1, -1), softcap=0.0, softmax_scale=None,
                   deterministic=False, backend="auto", layout="zigzag", return_lse=False, sm_margin=0):
    """Self-attention over a sequence sharded across the ranks of `group` (ring attention).

    q: (b, s_local, hq, d), k, v: (b, s_local, hk, d) with hq a multiple of hk: this rank's shard of the
    sequence, cut as shard_sequence(x, rank=..., world_size=..., layout=layout) cuts it, s_local the same
    on every rank. causal, window_size, softcap and softmax_scale as flash_attn_func takes them for the
    whole sequence (query i sees keys [i - left, i + right], i and j global positions). group: a
    torch.distributed process group (None: the default one), initialized; every rank of it calls this
    function (and the backward) with equal shapes. backend: each step's attention, as flash_attn_func's
    ("reference" also takes fp32 / fp64); deterministic: the kernels' backward's. layout: "zigzag"
    (s_local even; balanced under causal) or "contiguous". sm_margin: SMs each step's forward kernel leaves
    free for the transfers' kernels beside it (flashhopper.sm_margin; the backward's grids take none).

    Returns this rank's out (q.dtype, (b, s_local, hq, d)) or, with return_lse, (out, lse) with lse
    float32 (b, hq, s_local), natural log. Differentiable in q, k and v. The partial results are merged
    in fp32 (float64 for float64 inputs), and so are dQ, dK and dV before the final cast.
    """
    backend = check_backend(backend)
    _check_tensors(q, k, v, backend)
    layout = _check_layout(layout)
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"q has s_local={q.shape[1]}: the zigzag layout holds two equal chunks per rank, so "
                         "s_local must be even (layout='contiguous' takes any length)")
    cfg_args = dict(
        layout=layout,
        scale=normalize_scale(softmax_scale, int(q.shape[-1])),
        causal=check_flag("causal", causal),
        window=normalize_window(window_size),
        softcap=normalize_softcap(softcap),
        deterministic=check_flag("deterministic", deterministic),
        backend=backend,
        sm_margin=sms.check_margin(sm_margin),
    )
    return_lse = check_flag("return_lse", return_lse)
    group = _resolve_group(group)
    _check_ranks_agree(q, k, v, group)
    out, lse = _RingAttention.apply(q, k, v, _Config(group=group, **cfg_args))
    return (out, lse) if return_lse else out
