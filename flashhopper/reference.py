"""Ground truth for the kernels.

`attention_ref` / `attention_bwd_ref` are exact (float64), and so is `attention_bwd_from_lse` (the
backward from a given out and LSE, as the kernels take them). `attention_tiled_fwd` /
`attention_tiled_bwd` replay, in float32 and block by block, the algorithm the Hopper kernels run,
so a kernel bug can be told apart from a flaw in the algorithm itself. Everything is vectorized over
batch and heads; the only Python loops are over blocks.

Layout everywhere: (batch, seqlen, heads, headdim); LSE is (batch, heads_q, seqlen_q), natural log.
"""

from __future__ import annotations

import math

import torch

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NEG_INF = float("-inf")


def default_scale(headdim: int, softmax_scale: float | None) -> float:
    return 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)


def effective_window(causal: bool, window_size: tuple[int, int]) -> tuple[int, int]:
    """(left, right) after folding `causal` in; -1 means unbounded on that side."""
    left, right = int(window_size[0]), int(window_size[1])
    return left, (0 if causal else right)


def visible_mask(seqlen_q, seqlen_k, causal=False, window_size=(-1, -1), device=None) -> torch.Tensor:
    """Bool (seqlen_q, seqlen_k): may query i attend to key j.

    The diagonal is aligned bottom-right (query i sits at key position i + seqlen_k - seqlen_q), so
    the last query always lines up with the last key, which is what decoding with a KV cache needs.
    """
    left, right = effective_window(causal, window_size)
    i = torch.arange(seqlen_q, device=device).unsqueeze(1)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    diag = i + (seqlen_k - seqlen_q)
    mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        mask &= j >= diag - left
    if right >= 0:
        mask &= j <= diag + right
    return mask


def expand_kv(x: torch.Tensor, heads_q: int) -> torch.Tensor:
    """Repeat KV heads so that query head h lines up with KV head h // (heads_q // heads_k)."""
    heads_k = x.shape[2]
    if heads_q % heads_k:
        raise ValueError(f"heads_q={heads_q} is not a multiple of heads_k={heads_k}")
    return x if heads_q == heads_k else x.repeat_interleave(heads_q // heads_k, dim=2)


def token_descales(q, k, descales=(None, None, None), dtype=torch.float64):
    """FP8 descales in every accepted form (validation.check_descales) as one per token: (q's (b, sq, hq),
    k's (b, sk, hk), v's (b, hk)) in `dtype`. A (batch, heads_k) descale holds for all its rows (q's for
    the query heads of each kv head: query head h takes kv head h // (heads_q / heads_k)); a per-token
    one (batch, heads, seqlen) is transposed; None is 1."""
    b = q.shape[0]

    def rows(d, x):
        s, h = x.shape[1], x.shape[2]
        if d is None:
            return torch.ones(b, s, h, dtype=dtype, device=x.device)
        d = d.to(dtype)
        if d.dim() == 3:
            return d.transpose(1, 2)
        if d.shape[1] != h:
            d = d.repeat_interleave(h // d.shape[1], dim=1)
        return d[:, None, :].expand(b, s, h)

    vd = descales[2]
    vd = torch.ones(b, k.shape[2], dtype=dtype, device=k.device) if vd is None else vd.to(dtype)
    return rows(descales[0], q), rows(descales[1], k), vd


def dequantize_fp8(q, k, v, descales=(None, None, None)):
    """FP8 inputs as the values they stand for, in float64: x * descale (token_descales: per (batch, kv
    head), or q's and k's per token; None: 1)."""
    qd, kd, vd = token_descales(q, k, descales)
    return (q.to(torch.float64) * qd[..., None], k.to(torch.float64) * kd[..., None],
            v.to(torch.float64) * vd[:, None, :, None])


def attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q=None, seqused_k=None,
                         softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
    """attention_ref per packed sequence: q (total_q, hq, d), k / v (total_k, hk, d). Returns out
    float64 (total_q, hq, dv) and lse float32 (hq, total_q); rows past a sequence's seqused_q (and
    any row no sequence covers) are 0 / -inf. Raises ValueError on bounds that break the contract
    (cu_seqlens not from 0 up to the packed length, seqused beyond a sequence)."""
    cq, ck = (c.tolist() for c in (cu_seqlens_q, cu_seqlens_k))
    for name, c, total in (("cu_seqlens_q", cq, q.shape[0]), ("cu_seqlens_k", ck, k.shape[0])):
        if c[0] != 0 or c[-1] != total or any(b < a for a, b in zip(c, c[1:], strict=False)):
            raise ValueError(f"{name} = {c}: must start at 0, never decrease and end at {total}")
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), NEG_INF, dtype=torch.float32, device=q.device)
    for i in range(len(cq) - 1):
        lq, lk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        for name, used, length in (("seqused_q", seqused_q, lq), ("seqused_k", seqused_k, lk)):
            if used is not None and not 0 <= int(used[i]) <= length:
                raise ValueError(f"{name}[{i}] = {int(used[i])} outside the sequence's {length} tokens")
        lq = lq if seqused_q is None else int(seqused_q[i])
        lk = lk if seqused_k is None else int(seqused_k[i])
        if lq == 0:
            continue
        rows = slice(cq[i], cq[i] + lq)
        if lk == 0:  # no key: out stays 0, lse -inf
            continue
        keys = slice(ck[i], ck[i] + lk)
        o, l_ = attention_ref(q[None, rows], k[None, keys], v[None, keys], softmax_scale, causal, window_size,
                              softcap)
        out[rows] = o[0]
        lse[:, rows] = l_[0]
    return out, lse


def attention_ref(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
    """Exact attention in float64. Returns (out float64 (b, sq, hq, dv), lse float32 (b, hq, sq))."""
    scale = default_scale(q.shape[-1], softmax_scale)
    heads_q, seqlen_q, seqlen_k = q.shape[2], q.shape[1], k.shape[1]
    q64 = q.to(torch.float64)
    k64 = expand_kv(k.to(torch.float64), heads_q)
    v64 = expand_kv(v.to(torch.float64), heads_q)
    s = torch.einsum("bqhd,bkhd->bhqk", q64, k64) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    mask = visible_mask(seqlen_q, seqlen_k, causal, window_size, q.device)
    s = s.masked_fill(~mask, NEG_INF)
    # The max only stabilizes exp; detaching it leaves both out and lse differentiable and exact.
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    seen = denom > 0
    denom_safe = torch.where(seen, denom, torch.ones_like(denom))
    out = torch.einsum("bhqk,bkhd->bqhd", p / denom_safe, v64)
    lse = torch.where(seen, m + torch.log(denom_safe), torch.full_like(denom, NEG_INF)).squeeze(-1)
    return out, lse.to(torch.float32)



def attention_grads_in_dtype(q, k, v, dout, scale, causal, window, softcap):
    """(dq, dk, dv) by PyTorch autograd in the input dtype (fp32 math, P rounded to the dtype
    before P @ V): the yardstick for how much gradient error the dtype itself costs (GPU tests)."""
    qs, ks, vs = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    kk = ks.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    vv = vs.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qs.float(), kk.float()) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible_mask(q.shape[1], k.shape[1], causal, window, q.device), float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    o = torch.einsum("bhqk,bkhd->bqhd", p.to(q.dtype).float(), vv.float()).to(q.dtype)
    o.backward(dout)
    return qs.grad, ks.grad, vs.grad


def attention_grads_flash_rounding(q, k, v, dout, scale, causal, window, softcap, p_rounded_in_ds=False,
                                   out=None, ds_scaled=False):
    """(dq, dk, dv) with a flash backward's roundings and fp32 math otherwise: O, P and dS rounded to
    the input dtype before the GEMMs that read them, as SDPA's flash backend and FA2-4 do, and the
    gradients at the end: what the dtype costs an exact-arithmetic flash kernel, where
    `attention_grads_in_dtype` (the GPU tests' yardstick) keeps dS in fp32. For studying the tails
    of the tests' bound; the tests do not use it yet. `p_rounded_in_ds`: dS formed from the rounded P
    (BwdConfig.sdp_by_gemm) instead of the
    fp32 one. `out`: the forward's output that D = rowsum(dO * O) is formed from, as a backward
    kernel is given it (default: this function's own rounded O). `ds_scaled`: dS is rounded after the
    softmax scale is applied (BwdConfig.scale_in_ds), not before; the same but for fp16's subnormals."""
    dt, group = q.dtype, q.shape[2] // k.shape[2]
    qf, dof = q.float(), dout.float()
    kf, vf = (t.float().repeat_interleave(group, dim=2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    if softcap:
        t = torch.tanh(s / softcap)
        s = softcap * t
    s = s.masked_fill(~visible_mask(q.shape[1], k.shape[1], causal, window, q.device), float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)  # rows that see no key: P = 0
    p16 = p.to(dt).float()
    o = torch.einsum("bhqk,bkhd->bqhd", p16, vf).to(dt) if out is None else out
    d = (dof * o.float()).sum(-1).permute(0, 2, 1).unsqueeze(-1)  # (b, h, q, 1)
    dp = torch.einsum("bqhd,bkhd->bhqk", dof, vf)
    ds = (p16 if p_rounded_in_ds else p) * (dp - d)
    if softcap:
        ds = ds * (1 - t * t)
    if ds_scaled:
        ds16, after = (ds * scale).to(dt).float(), 1.0
    else:
        ds16, after = ds.to(dt).float(), scale
    dq = torch.einsum("bhqk,bkhd->bqhd", ds16, kf) * after
    dk = torch.einsum("bhqk,bqhd->bkhd", ds16, qf) * after
    dv = torch.einsum("bhqk,bqhd->bkhd", p16, dof)
    b, sk, hk = k.shape[0], k.shape[1], k.shape[2]
    dk, dv = (x.reshape(b, sk, hk, group, x.shape[-1]).sum(3) for x in (dk, dv))
    return dq.to(dt), dk.to(dt), dv.to(dt)


def attention_bwd_ref(q, k, v, dout, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
    """Exact (dq, dk, dv) in float64; dk/dv are summed over the query heads sharing a KV head."""
    with torch.enable_grad():
        q64, k64, v64 = (t.detach().to(torch.float64).requires_grad_() for t in (q, k, v))
        out, _ = attention_ref(q64, k64, v64, softmax_scale, causal, window_size, softcap)
        return torch.autograd.grad(out, (q64, k64, v64), dout.to(torch.float64))


def attention_bwd_from_lse(q, k, v, out, dout, lse, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0):
    """(dq, dk, dv) in float64 from an out and LSE given from outside, by a flash backward's formulas:
    P = exp(S - lse), D = rowsum(dO * O), dS = P * (dP - D) (times softcap's 1 - tanh^2), dQ = dS K *
    scale, dK = dS^T Q * scale, dV = P^T dO; dk / dv summed over the query heads sharing a KV head.

    With this attention's own out and lse it equals attention_bwd_ref. With those of a larger attention
    in which these keys are one part of what each query sees (ring attention's merged out and LSE), it
    gives that attention's gradients restricted to the part: dq's share from these keys, and dk, dv of
    these keys from these queries. The CPU stand-in for the kernels' backward (flashhopper.hopper.backward,
    which takes out and lse the same way). Rows with lse = -inf (no key anywhere) get P = 0."""
    f64 = torch.float64
    scale = default_scale(q.shape[-1], softmax_scale)
    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    q64, o64, do64 = q.to(f64), out.to(f64), dout.to(f64)
    k64, v64 = expand_kv(k.to(f64), heads_q), expand_kv(v.to(f64), heads_q)
    s = torch.einsum("bqhd,bkhd->bhqk", q64, k64) * scale
    if softcap > 0:
        t = torch.tanh(s / softcap)
        s = softcap * t
    s = s.masked_fill(~visible_mask(seqlen_q, seqlen_k, causal, window_size, q.device), NEG_INF)
    lse64 = lse.to(f64)
    lse64 = torch.where(torch.isneginf(lse64), torch.full_like(lse64, float("inf")), lse64)
    p = torch.exp(s - lse64.unsqueeze(-1))  # masked: exp(-inf) = 0; no key anywhere: exp(s - inf) = 0
    delta = (do64 * o64).sum(-1).transpose(1, 2).unsqueeze(-1)  # (b, hq, sq, 1)
    ds = p * (torch.einsum("bqhd,bkhd->bhqk", do64, v64) - delta)
    if softcap > 0:
        ds = ds * (1.0 - t * t)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, k64) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q64) * scale
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do64)
    group = heads_q // heads_k
    dk = dk.reshape(batch, seqlen_k, heads_k, group, dk.shape[-1]).sum(3)
    dv = dv.reshape(batch, seqlen_k, heads_k, group, dv.shape[-1]).sum(3)
    return dq, dk, dv


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def n_block_range(m_block, block_m, block_n, seqlen_q, seqlen_k, causal=False, window_size=(-1, -1)):
    """[lo, hi) of key blocks holding at least one key visible to query block `m_block`.

    Blocks outside it are fully masked and the kernel never loads them; an empty range means the
    whole query block sees nothing (out 0, lse -inf).
    """
    left, right = effective_window(causal, window_size)
    offset = seqlen_k - seqlen_q
    m0 = m_block * block_m
    m1 = min(m0 + block_m, seqlen_q)
    key_lo = 0 if left < 0 else max(0, m0 + offset - left)
    key_hi = seqlen_k if right < 0 else min(seqlen_k, m1 + offset + right)
    if key_hi <= key_lo:
        return 0, 0
    return key_lo // block_n, _ceil_div(key_hi, block_n)


def m_block_range(n_block, block_m, block_n, seqlen_q, seqlen_k, causal=False, window_size=(-1, -1)):
    """[lo, hi) of query blocks with at least one query that sees key block `n_block` (backward)."""
    left, right = effective_window(causal, window_size)
    offset = seqlen_k - seqlen_q
    n0 = n_block * block_n
    n1 = min(n0 + block_n, seqlen_k)
    query_lo = 0 if right < 0 else max(0, n0 - offset - right)
    query_hi = seqlen_q if left < 0 else min(seqlen_q, n1 - offset + left)
    if query_hi <= query_lo:
        return 0, 0
    return query_lo // block_m, _ceil_div(query_hi, block_m)


def _score_transform(scale: float, softcap: float):
    """(pre, post): log2-domain scores are tanh(S*pre)*post with softcap, else S*post.

    Folding scale and log2(e) into one multiply is what lets the kernel use exp2 (one MUFU.EX2) and
    a single FFMA per score.
    """
    if softcap > 0:
        return scale / softcap, softcap * LOG2E
    return None, scale * LOG2E


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.float().transpose(1, 2)


def attention_tiled_fwd(q, k, v, block_m=128, block_n=128, softmax_scale=None, causal=False,
                        window_size=(-1, -1), softcap=0.0, lazy_max_log2=None):
    """Block-wise online softmax in float32. Returns (out (b, sq, hq, dv), lse (b, hq, sq)).

    `lazy_max_log2` (FwdConfig.lazy_max's model): in blocks with no masked entry after the first,
    P is taken against the running max as it is; a row with no max yet or a block sum above
    2^lazy_max_log2 takes the exact step instead (the kernel decides per warp of 16 rows, which
    changes only how often the exact step runs)."""
    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k, hdim_v = k.shape[1], v.shape[-1]
    pre, post = _score_transform(default_scale(q.shape[-1], softmax_scale), softcap)
    qf = _heads_first(q)
    kf = _heads_first(expand_kv(k, heads_q))
    vf = _heads_first(expand_kv(v, heads_q))
    mask = visible_mask(seqlen_q, seqlen_k, causal, window_size, q.device)
    out = qf.new_zeros(batch, heads_q, seqlen_q, hdim_v)
    lse = qf.new_full((batch, heads_q, seqlen_q), NEG_INF)
    for m_block in range(_ceil_div(seqlen_q, block_m)):
        m0, m1 = m_block * block_m, min((m_block + 1) * block_m, seqlen_q)
        q_blk = qf[:, :, m0:m1]
        row_max = qf.new_full((batch, heads_q, m1 - m0), NEG_INF)
        row_sum = qf.new_zeros(batch, heads_q, m1 - m0)
        acc = qf.new_zeros(batch, heads_q, m1 - m0, hdim_v)
        lo, hi = n_block_range(m_block, block_m, block_n, seqlen_q, seqlen_k, causal, window_size)
        for n_block in range(lo, hi):
            n0, n1 = n_block * block_n, min((n_block + 1) * block_n, seqlen_k)
            s = q_blk @ kf[:, :, n0:n1].transpose(-1, -2)
            s = torch.tanh(s * pre) * post if pre is not None else s * post
            s = s.masked_fill(~mask[m0:m1, n0:n1], NEG_INF)
            lazy = lazy_max_log2 is not None and n_block > lo and bool(mask[m0:m1, n0:n1].all())
            if lazy:
                stale = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
                p_lazy = torch.exp2(s - stale.unsqueeze(-1))
                sum_lazy = p_lazy.sum(dim=-1)
                keep = ~torch.isinf(row_max) & (sum_lazy <= 2.0 ** lazy_max_log2)
            new_max = torch.maximum(row_max, s.amax(dim=-1))
            # A row that has seen only masked keys keeps max -inf; pinning it to 0 avoids
            # exp2(-inf - -inf) = NaN while still giving p = 0 and correction = 0.
            ref_max = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
            p = torch.exp2(s - ref_max.unsqueeze(-1))
            correction = torch.exp2(row_max - ref_max)
            if lazy:  # rows that keep their max: no correction, P against the old max
                new_max = torch.where(keep, row_max, new_max)
                correction = torch.where(keep, torch.ones_like(correction), correction)
                p = torch.where(keep.unsqueeze(-1), p_lazy, p)
            row_sum = row_sum * correction + p.sum(dim=-1)
            acc = acc * correction.unsqueeze(-1) + p @ vf[:, :, n0:n1]
            row_max = new_max
        seen = row_sum > 0
        safe_sum = torch.where(seen, row_sum, torch.ones_like(row_sum))
        out[:, :, m0:m1] = acc / safe_sum.unsqueeze(-1)
        lse[:, :, m0:m1] = torch.where(seen, row_max * LN2 + torch.log(safe_sum), NEG_INF)
    return out.transpose(1, 2), lse


def attention_tiled_bwd(q, k, v, out, dout, lse, block_m=128, block_n=128, softmax_scale=None,
                        causal=False, window_size=(-1, -1), softcap=0.0):
    """Backward from the saved LSE, key block outer / query block inner. Returns float32 (dq, dk, dv)."""
    batch, seqlen_q, heads_q, hdim = q.shape
    seqlen_k, heads_k, hdim_v = k.shape[1], k.shape[2], v.shape[-1]
    scale = default_scale(hdim, softmax_scale)
    pre, post = _score_transform(scale, softcap)
    qf, of, dof = _heads_first(q), _heads_first(out), _heads_first(dout)
    kf = _heads_first(expand_kv(k, heads_q))
    vf = _heads_first(expand_kv(v, heads_q))
    mask = visible_mask(seqlen_q, seqlen_k, causal, window_size, q.device)
    # Rows that saw nothing have lse = -inf; +inf there makes every recomputed P exactly 0.
    lse2 = lse.float() * LOG2E
    lse2 = torch.where(torch.isinf(lse2), torch.full_like(lse2, float("inf")), lse2).unsqueeze(-1)
    delta = (dof * of).sum(dim=-1, keepdim=True)
    dq = torch.zeros_like(qf)
    dk = qf.new_zeros(batch, heads_q, seqlen_k, hdim)
    dv = qf.new_zeros(batch, heads_q, seqlen_k, hdim_v)
    for n_block in range(_ceil_div(seqlen_k, block_n)):
        n0, n1 = n_block * block_n, min((n_block + 1) * block_n, seqlen_k)
        k_blk, v_blk = kf[:, :, n0:n1], vf[:, :, n0:n1]
        lo, hi = m_block_range(n_block, block_m, block_n, seqlen_q, seqlen_k, causal, window_size)
        for m_block in range(lo, hi):
            m0, m1 = m_block * block_m, min((m_block + 1) * block_m, seqlen_q)
            q_blk, do_blk = qf[:, :, m0:m1], dof[:, :, m0:m1]
            s = q_blk @ k_blk.transpose(-1, -2)
            if pre is not None:
                t = torch.tanh(s * pre)
                s = t * post
            else:
                s = s * post
            s = s.masked_fill(~mask[m0:m1, n0:n1], NEG_INF)
            p = torch.exp2(s - lse2[:, :, m0:m1])
            dv[:, :, n0:n1] += p.transpose(-1, -2) @ do_blk
            dp = do_blk @ v_blk.transpose(-1, -2)
            ds = p * (dp - delta[:, :, m0:m1])
            if pre is not None:
                ds = ds * (1.0 - t * t)
            dk[:, :, n0:n1] += (ds.transpose(-1, -2) @ q_blk) * scale
            dq[:, :, m0:m1] += (ds @ k_blk) * scale
    group = heads_q // heads_k
    dk = dk.view(batch, heads_k, group, seqlen_k, hdim).sum(dim=2)
    dv = dv.view(batch, heads_k, group, seqlen_k, hdim_v).sum(dim=2)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
