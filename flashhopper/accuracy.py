"""The one correctness rule every GPU comparison uses: the tests and `flashhopper fuzz`; forward and
backward, FP8, varlen and decode as they come.

- The reference is float64 on the same rounded inputs (flashhopper.reference).
- The yardstick is our emulator of the kernel's rounding points, never SDPA: fp32 scores and
  softmax, P rounded to the input dtype before P @ V, O rounded at the end (`emulate_forward`); in
  the backward also dS rounded before the dQ / dK GEMMs (`emulate_backward`; after the softmax scale
  where the dispatched kernel applies it there, BwdConfig.scale_in_ds: the same rounding but in
  fp16's subnormal range, where small-magnitude fuzz cases showed it). Its error against the
  reference is what the dtype costs an exact-arithmetic flash kernel. Every bound also holds the
  fp32 flush-to-zero floor (`ftz_floor`, below 1e-30 for any realistic size: it matters only for
  outputs that are themselves subnormal).
- The backward's emulator forms D = rowsum(dO * O) from the O the kernel was given (the forward's
  output), not from its own: O's rounding moves every dS of a row by the same D error, so a
  forward that rounds O its own legitimate way (unnormalized P, division at the end) gives dQ rows
  and, through few queries, dK rows up to 11x the emulator's error on that row (CPU model: 40 draws
  of one fp16 row, magnitude 4); over 128 rows the maxima agree, over one row they do not (seen on
  the H200: varlen sequences of 129, 2049 and one query rows).
- For each output and each block of 128 rows of its sequence dimension (queries for O and dQ, keys
  for dK and dV): max|x - ref| <= r * max|emu - ref| + 2 ulp(max|ref|), and the same with the means
  (2 ulp of the mean |ref|), plus for dQ and dK the fp32 cancellation floor of dS
  (`cancellation_floor`); r = 2, or 3 with softcap (the kernels' tanh is the hardware
  approximation). No element may be NaN: the kernels' outputs and workspaces are NaN-poisoned
  before each call (runtime.poison, set for every GPU test by tests/conftest.py and by the fuzzer).
- LSE: the same rows of -inf (no visible key); elsewhere within 1e-5 * max(1, |lse|), and with
  softcap within 2x the emulator's error plus softcap * 2^-10 (the approximate tanh moves every
  score by up to softcap * 2^-11); both plus 4 fp32 ulps of the row's largest sum of |q| |k|
  products (`score_floor`: the tensor cores truncate each chunk's sum to the largest term's bits).
- A KV cache (flash_attn_with_kvcache, `check_kvcache`): each item's out and LSE by the rule above
  against its keys gathered from the cache after the call; the appended keys and values exact, element
  by element, and every other cache entry bit for bit as before the call.
- FP8 (e4m3 inputs, bf16 out): the reference is float64 on the dequantized inputs (stored value x
  descale); the emulator (`emulate_forward_fp8`) rounds P the kernel's way: exp2(x - max + 8),
  i.e. P * 256, to e4m3, the row sums from the unrounded P, V's descale at the end, in the kernel's
  order (the dispatched key-block width, running max block by block, highest block first, so P is
  rounded against the same max as in the kernel) and, on a Hopper GPU, with `tensor_cores`: QK^T
  and each block's P @ V accumulated as FP8 WGMMA does, below fp32 precision, through
  torch._scaled_mm. That accumulation is one of the kernel's rounding points: with scores of very
  unequal magnitudes (a block of Q 30x the rest) it moves near-tied scores enough to cost 0.2-0.6 of
  an output of magnitude ~2 at hdim 128-256, 2-5x what exact arithmetic gives, and the kernel matched
  the tensor-core emulator's error to 1.00x on every such case (H100, 2026-12-05). r = 3 against
  that yardstick. FP8's own rounding noise hides small errors from that rule (a 2% scale error
  passes it), so FP8 outputs are also held to the kernel-order emulator closely: per 128-row
  block, the mean distance to it at most FP8_TIGHT x the mean FP8 error of the exact-arithmetic
  emulator (what is left: exp2's approximation, the O accumulator carried across key blocks, bf16
  rounding). The LSE
  is held to the kernel-order emulator's by the bound above, and to the reference's within 1e-5 *
  max(1, |lse|) plus twice the emulator's own error (the tensor cores' accumulation of the scores), plus
  softcap x 2^-10 with softcap (the hardware tanh's error, TANH_ERROR, which the emulator does not make).
"""

from __future__ import annotations

import math
from functools import partial

import torch

from flashhopper.reference import attention_grads_flash_rounding, expand_kv, token_descales, visible_mask

BLOCK = 128
FP8_TIGHT = 0.25
# the hardware tanh's (tanh.approx) error in a softcapped score, per unit of softcap: LSE bounds add
# softcap x this, which the emulator's exact tanh does not make
TANH_ERROR = 2.0 ** -10
_MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


def ratio(softcap: float, fp8: bool = False) -> float:
    return 3.0 if softcap or fp8 else 2.0


def ulp(value: float, dtype) -> float:
    """The spacing of `dtype` at |value| (its smallest normal spacing at 0)."""
    mant = _MANTISSA[dtype]
    tiny = torch.finfo(dtype).tiny
    value = max(abs(value), tiny)
    return 2.0 ** (math.floor(math.log2(value)) - mant)


def _scores(q, kf, scale, causal, window, softcap, raw=None):
    """fp32 scores (b, hq, sq, sk) of q against kf (kv heads expanded), times `scale` (a number, or
    per (b, hq) broadcast), softcapped, invisible keys -inf; `raw`: the dot products, already formed."""
    s = (torch.einsum("bqhd,bkhd->bhqk", q.float(), kf) if raw is None else raw) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    sk = kf.shape[1] if raw is None else raw.shape[-1]
    return s.masked_fill(~visible_mask(q.shape[1], sk, causal, window, q.device), float("-inf"))


def emulate_forward(q, k, v, scale, causal, window, softcap):
    """(out in q's dtype, LSE in fp32 natural units) with the forward kernel's rounding points."""
    kf, vf = (expand_kv(t.float(), q.shape[2]) for t in (k, v))
    s = _scores(q, kf, scale, causal, window, softcap)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    o = torch.einsum("bhqk,bkhd->bqhd", p.to(q.dtype).float(), vf).to(q.dtype)
    return o, lse


def _fp8_gemm(a, b, tensor_cores: bool):
    """(..., M, N) fp32 = a (..., M, K) times b (..., N, K) transposed, both e4m3. With
    `tensor_cores` on a Hopper GPU as FP8 WGMMA accumulates (torch._scaled_mm with use_fast_accum:
    the tensor cores' own accumulation, below fp32 precision; on the H200 random e4m3 scores at hdim
    128 moved by up to 2.8e-2 at |S| = 64, and the kernel's LSE matched the LSE of such scores to
    2.6e-7 where it was 2e-5 off the exact one), else exactly in fp32."""
    if not (tensor_cores and a.is_cuda and torch.cuda.get_device_capability(a.device) == (9, 0)):
        return torch.einsum("...mk,...nk->...mn", a.float(), b.float())
    lead, (m, k), n = a.shape[:-2], a.shape[-2:], b.shape[-2]
    a, b = a.reshape(-1, m, k), b.reshape(-1, n, k)
    up = lambda x: -(-x // 16) * 16  # noqa: E731  (_scaled_mm takes multiples of 16; zeros add nothing)
    pa = torch.zeros(up(m), up(k), dtype=a.dtype, device=a.device)
    pb = torch.zeros(up(n), up(k), dtype=b.dtype, device=a.device)
    one = torch.ones((), device=a.device)
    out = torch.empty(a.shape[0], m, n, device=a.device)
    for i in range(a.shape[0]):
        pa[:m, :k], pb[:n, :k] = a[i], b[i]
        out[i] = torch._scaled_mm(pa, pb.t(), scale_a=one, scale_b=one, out_dtype=torch.float32,
                                  use_fast_accum=True)[:m, :n]
    return out.reshape(*lead, m, n)


def emulate_forward_fp8(q, k, v, descales, scale, causal, window, softcap, p_shift_log2: int = 8,
                        tile_n: int | None = None, tensor_cores: bool = False, rounded_sums: bool = False):
    """(out bf16, LSE) of the FP8 forward's rounding points: fp32 scores of the stored e4m3 values
    times q and k descales (per (batch, kv head) or per token: reference.token_descales), P *
    2^p_shift_log2 rounded to e4m3 for P @ V (V as stored), the sums of the unrounded P, V's descale and
    the division at the end. P is taken against the row's final max, or with `tile_n` as the kernel
    does: key blocks of tile_n from the highest down, each against the running max, O and the sums
    rescaled as the max grows. `tensor_cores`: QK^T and each block's P @ V accumulated as FP8 WGMMA
    does (_fp8_gemm; on a Hopper GPU only). `rounded_sums` (FwdConfig.pv_row_sum): the row sums are those
    of the e4m3 P, made by the same GEMM as O (a column of ones beside V)."""
    heads_q, heads_k = q.shape[2], k.shape[2]
    group = heads_q // heads_k
    qd, kd, vd = token_descales(q, k, descales, torch.float32)
    # q's descale per (row, query head) times k's per (key, its kv head): (b, hq, sq, sk)
    qk = qd.transpose(1, 2)[..., :, None] * expand_kv(kd, heads_q).transpose(1, 2)[..., None, :]
    k8, vt8 = expand_kv(k, heads_q).transpose(1, 2), expand_kv(v, heads_q).permute(0, 2, 3, 1)
    raw = _fp8_gemm(q.transpose(1, 2), k8, tensor_cores)  # (b, hq, sq, sk)
    s = _scores(q, None, scale * qk, causal, window, softcap, raw=raw)
    lse = torch.logsumexp(s, dim=-1)
    sk = k.shape[1]
    width = tile_n or sk
    starts = list(range(0, sk, width))[::-1]  # highest block first
    o = torch.zeros(*s.shape[:3], v.shape[-1], device=q.device)
    total = torch.zeros(*s.shape[:3], 1, device=q.device)
    m = torch.full_like(total, float("-inf"))
    for start in starts:
        blk = s[..., start:start + width]
        m_new = torch.maximum(m, blk.amax(dim=-1, keepdim=True))
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        rescale = torch.exp(torch.where(torch.isfinite(m), m, safe) - safe)
        p = torch.exp(blk - safe) * 2.0 ** p_shift_log2
        p8 = p.to(torch.float8_e4m3fn)
        vt_blk = vt8[..., start:start + width]
        if rounded_sums:  # 16 rows of ones under V^T (a GEMM's N in multiples of 16)
            ones = torch.ones(*vt_blk.shape[:-2], 16, vt_blk.shape[-1], device=q.device).to(vt_blk.dtype)
            both = _fp8_gemm(p8, torch.cat([vt_blk, ones], dim=-2), tensor_cores)
            o = o * rescale + both[..., :vt_blk.shape[-2]]
            total = total * rescale + both[..., -1:]
        else:
            o = o * rescale + _fp8_gemm(p8, vt_blk, tensor_cores)
            total = total * rescale + p.sum(dim=-1, keepdim=True)
        m = m_new
    o = o / torch.where(total > 0, total, torch.ones_like(total))
    o = o.transpose(1, 2) * vd.repeat_interleave(group, dim=1)[:, None, :, None]
    return o.to(torch.bfloat16), lse


def emulate_backward(q, k, v, dout, scale, causal, window, softcap, out=None, ds_scaled=False):
    """(dq, dk, dv) with the backward kernels' rounding points (P and dS in the input dtype), D formed
    from `out` (the forward's output the kernel was given; default the emulated one); `ds_scaled`: dS
    rounded after the softmax scale (the dispatched kernel's BwdConfig.scale_in_ds)."""
    return attention_grads_flash_rounding(q, k, v, dout, scale, causal, window, softcap, out=out,
                                          ds_scaled=ds_scaled)


def _dispatched_scale_in_ds(q, k, causal, window, softcap) -> bool:
    """Whether the backward the call dispatches rounds dS after the scale (only fp16's subnormals tell)."""
    from flashhopper import plan

    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(q.dtype)
    if dtype is None:
        return False
    cfg = plan.bwd_plan(dtype, q.shape[-1], q.shape[1], k.shape[1], causal, window, softcap > 0, False)[0]
    return cfg.scale_in_ds


def ftz_floor(length: int, *magnitudes: float) -> float:
    """The kernels' fp32 flushes subnormal results to zero (exp2 of a very negative score, products
    below 2^-126): each of `length` terms may lose up to 2^-126 times the product of `magnitudes`
    (the largest of what multiplies it). Seen on the H200: bf16 dV of 1e-39 (P ~ 1e-39 flushed)."""
    return length * 2.0 ** -126 * math.prod(magnitudes)


def check_output(name: str, x: torch.Tensor, ref: torch.Tensor, emu: torch.Tensor, softcap: float = 0.0,
                 seq_dim: int = 1, floor: float = 0.0, fp8: bool = False) -> None:
    """The rule for one output (x, emu in the kernel's dtype; ref float64), per block of BLOCK rows of
    `seq_dim`; `floor` an absolute error no rounding point explains (cancellation_floor)."""
    assert x.shape == ref.shape == emu.shape, (name, x.shape, ref.shape, emu.shape)
    assert not x.isnan().any(), f"{name}: NaN (an element no kernel wrote, or a NaN computed)"
    r, dtype = ratio(softcap, fp8), x.dtype
    err = (x.double() - ref).abs().movedim(seq_dim, 0)
    yard = (emu.double() - ref).abs().movedim(seq_dim, 0)
    mag = ref.abs().movedim(seq_dim, 0)
    for start in range(0, err.shape[0], BLOCK):
        e, y, m = (t[start:start + BLOCK] for t in (err, yard, mag))
        e_max, y_max = e.max().item(), y.max().item()
        bound = r * y_max + 2 * ulp(m.max().item(), dtype) + floor
        assert e_max <= bound, (f"{name} rows {start}+: max error {e_max:.3g} > {bound:.3g} "
                                f"(emulator {y_max:.3g})")
        e_mean, y_mean = e.mean().item(), y.mean().item()
        bound = r * y_mean + 2 * ulp(m.mean().item(), dtype) + floor
        assert e_mean <= bound, (f"{name} rows {start}+: mean error {e_mean:.3g} > {bound:.3g} "
                                 f"(emulator {y_mean:.3g})")


def check_fp8_order(x, exact, emu, ref) -> None:
    """FP8: per 128-row block, mean |x - exact| <= FP8_TIGHT * mean |emu - ref| (see the module doc)."""
    err = (x.double() - exact.double()).abs()
    yard = (emu.double() - ref).abs()
    for start in range(0, x.shape[1], BLOCK):
        e, y = err[:, start:start + BLOCK].mean().item(), yard[:, start:start + BLOCK].mean().item()
        assert e <= FP8_TIGHT * y, (f"out rows {start}+: mean distance {e:.3g} to the kernel-order "
                                    f"emulator > {FP8_TIGHT} x the FP8 error {y:.3g}")


def cancellation_floor(dout, v, other, scale) -> float:
    """dQ's and dK's error floor from dS = P (dP - D): dP = dO . V and D = dO . O are fp32 sums over
    the head dim whose difference can cancel to nothing (one visible key: dQ = dK = 0 exactly), and
    their summation order is the kernel's own: each may be off by head dim fp32 ulps of |dO| |V|,
    carried into dQ (dK) by |K| (|Q|) and the scale. Seen on the H200: hdim 256, one query and one
    key, dQ off by 9.0e-7 where the emulator's summation was off by 1.1e-7."""
    d = dout.shape[-1]
    big = [t.abs().max().item() for t in (dout, v, other)]
    return 2 * 2.0 ** -23 * d * big[0] * big[1] * big[2] * scale


def score_floor(q, k, scale, causal, window) -> torch.Tensor:
    """(b, hq, sq): the LSE's error floor from the scores' fp32 sums over the head dim, 4 fp32 ulps
    (2^-21) of the largest sum of |q| |k| products (times the scale) over the row's visible keys.
    The tensor cores add each chunk of products aligned to the largest and cut the bits below
    (truncation, not rounding), so a score is off by a few ulps of its terms' magnitudes, not of
    itself: seen on the H200, bf16 / fp16 inputs of magnitude 4 at hdim 128 / 256 with a window
    (rows of one or two keys, where the LSE is the score), LSE off by 1.0-1.4 x 1e-5 of |lse|."""
    mags = _scores(q.abs(), expand_kv(k.float().abs(), q.shape[2]), scale, causal, window, 0.0)
    return 2.0 ** -21 * mags.amax(dim=-1).clamp(min=0.0).nan_to_num(0.0, neginf=0.0)


def check_lse(lse: torch.Tensor, ref: torch.Tensor, emu: torch.Tensor, softcap: float = 0.0,
              floor: torch.Tensor | float = 0.0) -> None:
    """The rule for the LSE (b, h, sq): fp32 against the float64 reference; `floor` (score_floor)
    added to the bound."""
    assert not lse.isnan().any(), "LSE: unwritten or NaN rows"
    no_key = torch.isinf(ref)
    assert torch.equal(torch.isinf(lse), no_key), "rows that see no key must have LSE = -inf, only those"
    seen = ~no_key
    if not seen.any():
        return
    err = (lse[seen].double() - ref[seen]).abs()
    floor = floor[seen].double() if isinstance(floor, torch.Tensor) else floor
    if softcap:
        bound = 2 * (emu[seen].double() - ref[seen]).abs().max().item() + softcap * TANH_ERROR + floor
        assert (err <= bound).all(), (err.max().item(), bound)
    else:
        bound = 1e-5 * torch.clamp(ref[seen].abs(), min=1.0) + floor
        worst = (err / bound).max().item()
        assert worst <= 1.0, f"LSE error {worst:.3g}x the bound 1e-5 * max(1, |lse|) + the scores' floor"


def check_forward(out, lse, q, k, v, scale, causal, window, softcap, descales=(None, None, None),
                  cfg=None) -> None:
    """A forward's out and LSE against the float64 reference by the rule (FP8: `descales`); lse None: a
    call that returned none (out alone is checked). FP8: `cfg` the kernel's config where it is not the
    dispatched one (its key blocks and row sums set the kernel-order emulator's)."""
    from flashhopper.reference import attention_ref, dequantize_fp8

    fp8 = q.dtype == torch.float8_e4m3fn
    if fp8:
        from flashhopper import plan
        from flashhopper.validation import qk_descale_kind

        ref, ref_lse = attention_ref(*dequantize_fp8(q, k, v, descales), scale, causal, window, softcap)
        emu, emu_lse = emulate_forward_fp8(q, k, v, descales, scale, causal, window, softcap)
        assert out.dtype == torch.bfloat16, out.dtype
        if cfg is None:
            cfg = plan.fwd_plan("e4m3", q.shape[-1], q.shape[1], k.shape[1], causal, window, softcap > 0,
                                qk_descale=qk_descale_kind(descales), need_lse=lse is not None)[0]
        exact, exact_lse = emulate_forward_fp8(q, k, v, descales, scale, causal, window, softcap,
                                               tile_n=cfg.tile_n, tensor_cores=True,
                                               rounded_sums=cfg.pv_row_sum)
        check_fp8_order(out, exact, emu, ref)
    else:
        ref, ref_lse = attention_ref(q, k, v, scale, causal, window, softcap)
        emu, emu_lse = emulate_forward(q, k, v, scale, causal, window, softcap)
    given = [d.float().abs().max().item() for d in descales if d is not None]
    vmax = v.float().abs().max().item() * max(given, default=1.0)
    # FP8: the yardstick is the kernel-order emulator (its tensor-core accumulation is a rounding point)
    check_output("out", out, ref, exact if fp8 else emu, softcap, fp8=fp8,
                 floor=ftz_floor(k.shape[1], vmax))
    if lse is None:
        return
    if fp8:  # exact but for the scores' tensor-core accumulation, which costs no more than its own error
        check_lse(lse, exact_lse.double(), exact_lse, softcap)
        seen = torch.isfinite(ref_lse)
        err, own = ((x[seen].double() - ref_lse[seen]).abs() for x in (lse, exact_lse))
        bound = 1e-5 * ref_lse[seen].abs().clamp(min=1.0) + 2 * own + softcap * TANH_ERROR
        assert (err <= bound).all(), f"LSE: FP8 accumulation, {(err / bound).max().item():.3g}x the bound"
    else:
        check_lse(lse, ref_lse, emu_lse, softcap, floor=score_floor(q, k, scale, causal, window))


def check_varlen_forward(out, lse, q, k, v, cu_seqlens_q, cu_seqlens_k, used_q, used_k, scale, causal, window,
                         softcap) -> None:
    """A varlen forward's out (total_q, h, dv) and LSE (h, total_q), sequence by sequence, by the rule;
    `used_q` / `used_k`: each sequence's used lengths (lists). A sequence with no key gives 0 / -inf;
    rows past a sequence's used length must still hold the poison (NaN): no tile writes outside its
    sequence."""
    starts_q, starts_k = [int(x) for x in cu_seqlens_q], [int(x) for x in cu_seqlens_k]
    for i, (lq, lk) in enumerate(zip(used_q, used_k, strict=True)):
        rows, keys = slice(starts_q[i], starts_q[i] + lq), slice(starts_k[i], starts_k[i] + lk)
        if lq and lk:
            check_forward(out[None, rows], lse[None, :, rows], q[None, rows], k[None, keys], v[None, keys],
                          scale, causal, window, softcap)
        elif lq:
            assert (out[rows] == 0).all() and torch.isneginf(lse[:, rows]).all(), f"sequence {i}: no key"
        unused = slice(starts_q[i] + lq, starts_q[i + 1])
        assert out[unused].isnan().all() and lse[:, unused].isnan().all(), f"sequence {i}: rows past seqused"


def cache_index(cache, item: int, positions, *, row: int | None = None, page_table=None) -> tuple:
    """Where item `item`'s positions (an int64 tensor on the cache's device) lie in a KV cache, as an index:
    cache[index] is their (n, heads_k, d) entries in position order. Contiguous (b_cache, s_cache, ...):
    positions of cache row `row` (cache_batch_idx[item]; default item). Paged (page_table (b, max_pages),
    cache (num_pages, page_size, ...)): position p at slot p % page_size of page page_table[item, p //
    page_size]. Spelled out here, apart from kvcache's own arithmetic, to check it."""
    if page_table is None:
        return item if row is None else row, positions
    page_size = cache.shape[1]
    return page_table[item].long()[positions // page_size], positions % page_size


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's elements as integers of their width: compared, NaN equals the same NaN and -0 is not 0."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(width)


def check_kvcache(out, lse, q, k_cache, v_cache, cache_seqlens, *, scale, causal, window, softcap, k_new=None,
                  v_new=None, before=None, cache_batch_idx=None, cache_leftpad=None, page_table=None) -> None:
    """flash_attn_with_kvcache's results by the rule, item by item (cache_seqlens, cache_batch_idx,
    cache_leftpad: lists of ints as the call was given them; page_table: the call's tensor):

    - the append element by element: k_new[i], v_new[i] ((b, s_new, heads_k, d), or None) at positions
      cache_seqlens[i] .. + s_new of item i's cache row or pages (cache_index);
    - with `before` (copies of (k_cache, v_cache) from before the call) every other entry of both caches,
      other rows and pages included, bit for bit as it was;
    - out (b, s_q, hq, dv) and lse (b, hq, s_q; None where the call returned none) by check_forward
      against the item's keys [cache_leftpad[i], cache_seqlens[i] + s_new) in position order, the queries
      aligned bottom-right; an item with no key gives 0 and -inf.

    A failure names the item."""
    s_new = 0 if k_new is None else k_new.shape[1]
    rows = cache_batch_idx or range(q.shape[0])
    left = cache_leftpad or [0] * q.shape[0]
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=k_cache.device)
    for i, (row, n) in enumerate(zip(rows, cache_seqlens, strict=True)):
        where = partial(cache_index, k_cache, i, row=row, page_table=page_table)
        positions = partial(torch.arange, device=k_cache.device)
        if s_new:
            appended = where(positions(n, n + s_new))
            assert torch.equal(_bits(k_cache[appended]), _bits(k_new[i])), f"item {i}: the appended k"
            assert torch.equal(_bits(v_cache[appended]), _bits(v_new[i])), f"item {i}: the appended v"
            written[appended] = True
        keys = where(positions(left[i], n + s_new))
        item_lse = None if lse is None else lse[i:i + 1]
        if n + s_new > left[i]:
            try:
                check_forward(out[i:i + 1], item_lse, q[i:i + 1], k_cache[keys][None], v_cache[keys][None],
                              scale, causal, window, softcap)
            except AssertionError as exc:
                raise AssertionError(f"item {i}: {exc}") from exc
        else:
            assert (out[i] == 0).all(), f"item {i} (no key): out not all 0"
            assert item_lse is None or torch.isneginf(item_lse).all(), f"item {i} (no key): LSE not all -inf"
    if before is not None:
        for name, now, old in (("k_cache", k_cache, before[0]), ("v_cache", v_cache, before[1])):
            kept = torch.equal(_bits(now[~written]), _bits(old[~written]))
            assert kept, f"{name}: entries besides the append changed"


def check_grads(grads, q, k, v, dout, scale, causal, window, softcap, *, out, label: str = "") -> None:
    """(dq, dk, dv) against the float64 reference by the rule, with dQ's and dK's cancellation floor.
    `out`: the forward's output the backward was given; the emulator forms D = rowsum(dO * O) from
    it, as the kernel does (see the module doc)."""
    from flashhopper.reference import attention_bwd_ref

    refs = attention_bwd_ref(q, k, v, dout, scale, causal, window, softcap)
    emus = emulate_backward(q, k, v, dout, scale, causal, window, softcap, out=out,
                            ds_scaled=_dispatched_scale_in_ds(q, k, causal, window, softcap))
    big = {name: t.abs().max().item() for name, t in (("q", q), ("k", k), ("v", v), ("do", dout))}
    ds_big = 2 * v.shape[-1] * big["do"] * big["v"]  # |dP - D|: sums over the value head dim
    sq, sk = q.shape[1], k.shape[1]
    floors = (cancellation_floor(dout, v, k, scale) + ftz_floor(sk, ds_big, big["k"], scale),
              cancellation_floor(dout, v, q, scale) + ftz_floor(sq, ds_big, big["q"], scale),
              ftz_floor(sq, big["do"]))
    for name, x, ref, emu, floor in zip(("dq", "dk", "dv"), grads, refs, emus, floors, strict=True):
        assert x.dtype == q.dtype, (name, x.dtype)
        check_output(f"{name}{label}", x, ref, emu, softcap, floor=floor)


def check_varlen_grads(grads, q, k, v, dout, cu_seqlens_q, cu_seqlens_k, scale, causal, window,
                       softcap, *, out, used_q=None, used_k=None) -> None:
    """A varlen backward's (dq, dk, dv), packed like q, k, v, sequence by sequence by the rule
    (check_grads; `out` the packed forward output the backward was given); a sequence with no query
    or no key gets all-zero gradients. `used_q` / `used_k`: each sequence's seqused lengths (lists;
    None: the whole ones): the rule holds on the used rows and keys, and the rows and keys past them
    get exactly zero (whatever q, k, v and dout hold there)."""
    dq, dk, dv = grads
    starts_q, starts_k = [int(x) for x in cu_seqlens_q], [int(x) for x in cu_seqlens_k]
    lens_q = [b - a for a, b in zip(starts_q, starts_q[1:], strict=False)]
    lens_k = [b - a for a, b in zip(starts_k, starts_k[1:], strict=False)]
    used_q, used_k = used_q or lens_q, used_k or lens_k
    for i, (lq, lk) in enumerate(zip(used_q, used_k, strict=True)):
        rows, keys = slice(starts_q[i], starts_q[i] + lq), slice(starts_k[i], starts_k[i] + lk)
        if lq and lk:
            check_grads((dq[None, rows], dk[None, keys], dv[None, keys]), q[None, rows], k[None, keys],
                        v[None, keys], dout[None, rows], scale, causal, window, softcap,
                        out=out[None, rows], label=f" sequence {i}")
        else:
            for name, x in (("dq", dq[rows]), ("dk", dk[keys]), ("dv", dv[keys])):
                assert (x == 0).all(), f"sequence {i} (no query or no key): {name} not all zero"
        unused_q, unused_k = slice(rows.stop, starts_q[i + 1]), slice(keys.stop, starts_k[i + 1])
        for name, x in (("dq", dq[unused_q]), ("dk", dk[unused_k]), ("dv", dv[unused_k])):
            assert (x == 0).all(), f"sequence {i}: {name} not all zero past seqused"
