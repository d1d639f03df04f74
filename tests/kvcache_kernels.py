"""flash_attn_with_kvcache's kernel path on the CPU: float64 stand-ins for its kernels (the varlen
forward, the split inside the attention kernel as a model that takes that kernel's own arguments and walks
its tiles by the host twins of its arithmetic, the merge kernel), and the patches that let the path run on
CPU tensors as on 132 SMs. Shared by tests/test_decode_launches.py and tests/test_fuzz.py."""

from __future__ import annotations

import math

import torch

from flashhopper import splitkv, validation
from flashhopper.hopper import host, runtime
from flashhopper.reference import attention_ref

SMS = 132


def cpu_kernel_path(monkeypatch):
    """flash_attn_with_kvcache's kernel path on CPU tensors, as on SMS SMs (the callers set forward_varlen
    and combine_splits); the gated decode paths as their defaults, whatever the caller's environment says
    (the tests opt in themselves). Returns monkeypatch."""
    monkeypatch.setattr(validation, "require_hopper", lambda q, backend="hopper": None)
    monkeypatch.setattr(validation, "check_varlen_call", lambda *args, **kwargs: None)
    monkeypatch.setattr(splitkv, "_sm_count", lambda index: SMS)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    opt_ins = (validation.DECODE_SPLIT_OPT_IN, validation.DECODE_MERGE_OPT_IN, validation.DECODE_QLEN_OPT_IN)
    for opt_in in opt_ins:
        monkeypatch.delenv(opt_in, raising=False)
    return monkeypatch


def varlen_stand_in(q, k, v, cu_q, starts, max_q, used_q, used_k, scale, causal, window, softcap, out=None,
                     lse=None, decode=False, page_table=None, page_size=0, page_starts=None, **kwargs):
    """forward_varlen on the CPU: sequence n's rows against keys starts[n] .. starts[n] + used_k[n] (paged:
    positions 0 .. used_k[n] of its pages from table entry page_starts[n] on, host.paged_row) in float64,
    rounded to q's dtype as the kernel's output is, into out / lse where given; what it is given checked
    first (`decode`: the rearranged decode, one query token packed or split, with no mask and no out; or
    every sequence max_q rows (forward_varlen's decode walk with a mask), into out)."""
    n = cu_q.shape[0] - 1
    if decode:
        assert tuple(window) == (-1, -1) and used_q is None
        assert (not causal and out is None) or (causal and out is not None and lse is not None)
        assert not causal or torch.equal(cu_q, torch.arange(n + 1, dtype=torch.int32) * max_q)
    if lse is not None:
        assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32 and lse.stride(-1) == 1
    if page_table is not None:
        assert starts is None
        flat, starts = runtime._flat_page_table(page_table, page_starts, n)
        starts = torch.cat([starts, starts[-1:]])
    for t, length in ((cu_q, n + 1), (starts, n + 1), (used_k, n)):
        assert t.dtype == torch.int32 and t.shape == (length,) and t.is_contiguous()
    used_q = cu_q[1:] - cu_q[:-1] if used_q is None else used_q
    lse_out = lse
    o = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"))
    for i in range(n):
        rows, a, u = slice(int(cu_q[i]), int(cu_q[i]) + int(used_q[i])), int(starts[i]), int(used_k[i])
        keys = torch.arange(a, a + max(u, 0))
        if page_table is not None:
            keys = torch.tensor([host.paged_row(flat, a, p, u, page_size) for p in range(max(u, 0))],
                                dtype=torch.long)
        assert int(used_q[i]) <= max_q and 0 <= a and (u <= 0 or 0 <= keys.min() <= keys.max() < k.shape[0])
        if u > 0 and rows.stop > rows.start:
            o_, l_ = attention_ref(q[None, rows], k[None, keys], v[None, keys], scale, causal, window,
                                   softcap)
            o[rows], lse[:, rows] = o_[0], l_[0]
    return (o.to(q.dtype) if out is None else out.copy_(o)), (lse.float() if lse_out is None else
                                                             lse_out.copy_(lse))


def split_kernel_model(cfg, launched):
    """The split decode kernel (FwdConfig.split_kv) on the CPU for runtime.get_kernel(cfg): it takes the
    kernel's arguments as runtime.forward_split passes them, checks them as the compiled kernel's
    signature would (dtypes, ranks, the strides TMA and the stores need, the arguments the walk leaves
    unused), and walks the tiles as the kernel does: CTA c from tile c by the grid, each tile's (item,
    split, head, query block) by host.split_tile, its keys by host.split_keys (paged: their rows by
    host.paged_row), its rows against them in float64 into partial item * splits + split, rounded to O's
    dtype (token_rows: each row against the keys its token sees). Each launch's (cfg, splits, chunk) goes
    to `launched`."""
    def kernel(q, k, v, o, lse, counter, scale_log2, softcap_pre, wl, wr, num_ctas, l2_section, qd, kd, vd,
               cu_q, starts, used_q, seqlens, walk, table, splits, chunk, new_keys, key_rows, tokens):
        assert cfg.split_kv and cfg.varlen and not cfg.local and cfg.causal == cfg.token_rows
        assert wl == -1 and l2_section == 1 and wr in (-1, 0) and (wr == 0) == cfg.causal
        assert {type(x) for x in (splits, chunk, new_keys, key_rows, tokens)} == {int}
        assert tokens >= 1 and (cfg.token_rows or tokens == 1)
        assert qd is kd is vd is cu_q is used_q is walk is None and (table is None) == (cfg.page_size == 0)
        b, rows, heads, d = q.shape
        dv = v.shape[-1]
        assert k.shape[0] == v.shape[0] == 1 and k.shape[-1] == d and heads % k.shape[2] == 0
        assert o.shape == (b * splits, rows, heads, dv) and lse.shape == (b * splits, heads, rows)
        assert o.dtype == q.dtype == k.dtype and lse.dtype == torch.float32 and lse.stride(-1) == 1
        for t in (q, k, v, o):  # TMA: whole 16-byte strides, a contiguous head dim
            assert t.stride(-1) == 1 and all(s % 8 == 0 for s in t.stride()[:-1]), t.stride()
        for t in (seqlens, starts) + ((table,) if table is not None else ()):
            assert t.dtype == torch.int32 and t.dim() == 1 and t.is_contiguous()
        assert seqlens.shape == (b,) and (key_rows > 0 or starts.shape == (b,)) and chunk > 0
        assert cfg.page_size == 0 or chunk % cfg.page_size == 0
        launched.append((cfg, splits, chunk))
        log2e = math.log2(math.e)
        softcap = scale_log2 / log2e if softcap_pre else 0.0
        scale = softcap_pre * softcap if softcap_pre else scale_log2 / log2e
        m_blocks = -(-rows // cfg.tile_m)
        walked = []
        for cta in range(num_ctas):
            tile = cta
            while (coords := host.split_tile(tile, m_blocks=m_blocks, heads=heads, splits=splits,
                                             batch=b, from_last=cfg.causal)) is not None:
                item, split, head, m_block = coords
                walked.append(coords)
                first, count = host.split_keys(item, split, used=seqlens, new_keys=new_keys, starts=starts,
                                               key_rows=key_rows, chunk=chunk, page_size=cfg.page_size)
                if cfg.page_size:
                    keys = [host.paged_row(table, first, p, count, cfg.page_size) for p in range(count)]
                else:
                    keys = list(range(first, first + count))
                assert all(0 <= r < k.shape[1] for r in keys)
                part, kv = item * splits + split, head // (heads // k.shape[2])
                # token_rows: row r is token r % tokens of `tokens`, bottom-right against the keys to the
                # item's end (mask.py's rule with window_right as given): in this split, key p is seen
                # where p <= r % tokens + (to_end - tokens) + wr
                to_end = int(seqlens[item]) + new_keys - split * chunk
                for r in range(m_block * cfg.tile_m, min(rows, (m_block + 1) * cfg.tile_m)):
                    seen = count
                    if cfg.token_rows:
                        seen = max(0, min(count, r % tokens + to_end - tokens + wr + 1))
                    if seen:
                        one = lambda t: t[None, :, None]  # noqa: E731 (rows of one head, a batch of one)
                        o_, l_ = attention_ref(one(q[item, r:r + 1, head]), one(k[0, keys[:seen], kv]),
                                               one(v[0, keys[:seen], kv]), scale, False, (-1, -1), softcap)
                        o[part, r, head] = o_[0, 0, 0].to(o.dtype)
                        lse[part, head, r] = l_[0, 0, 0].float()
                    else:  # no key: 0 and -inf
                        o[part, r, head] = 0
                        lse[part, head, r] = float("-inf")
                tile += num_ctas
        # every tile once (the walk is the kernel's: each CTA strides by the grid)
        assert len(walked) == len(set(walked)) == b * splits * heads * m_blocks
    return kernel


def split_kernels(monkeypatch, model=True):
    """runtime.forward_split's launch on the CPU (the opt-in set): get_kernel returns `model`'s kernel
    (split_kernel_model), or one that only counts its launches; the tile counter an allocation. Returns
    the launches' list."""
    launched = []
    monkeypatch.setenv(validation.DECODE_SPLIT_OPT_IN, "1")
    monkeypatch.setattr(runtime, "_sm_count", lambda index: SMS)
    monkeypatch.setattr(runtime, "_counter_for", lambda cfg, device: torch.empty(2, dtype=torch.int32))

    def get_kernel(cfg):
        assert cfg.split_kv, cfg  # the varlen kernel goes through forward_varlen's stand-in
        return split_kernel_model(cfg, launched) if model else (lambda *args: launched.append((cfg,)))

    monkeypatch.setattr(runtime, "get_kernel", get_kernel)
    return launched


def merge_stand_in(cfg, o, lse, out, lse_out):
    """runtime.combine_splits on the CPU: what the kernel is given checked (its config's dtypes and head
    dim, the views' shapes), the merge by merge_by_lse in float64 into out / lse_out."""
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    b, s, rows, heads, dv = o.shape
    assert (cfg.dtype, cfg.out_dtype, cfg.hdim) == (names[o.dtype], names[out.dtype], dv)
    assert s <= cfg.max_splits
    assert lse.shape == (b, s, rows, heads) and lse.dtype == torch.float32
    assert out.shape == (b, rows, heads, dv) and lse_out.shape == (b, rows, heads) and out.stride(-1) == 1
    merged, merged_lse = splitkv.merge_by_lse(o.double(), lse.double(), dim=1)
    out.copy_(merged)
    lse_out.copy_(merged_lse)
