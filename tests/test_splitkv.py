"""Decode's PackGQA and split-KV (flashhopper/splitkv.py) on the CPU: the rearranged call, run by a
float64 stand-in for the varlen kernel (each sequence's key start and used length as the kernel reads
them) and merged by LSE, equals attention over each item's keys; the layout choices."""

from __future__ import annotations

import pytest
import torch

from flashhopper import splitkv
from flashhopper.reference import attention_ref


def _varlen_stand_in(q, k, v, cu_q, starts, used, scale, softcap):
    """What forward_varlen computes: sequence n's rows against keys starts[n] .. starts[n] + used[n]."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"))
    cq = cu_q.tolist()
    for n in range(len(cq) - 1):
        rows, a, u = slice(cq[n], cq[n + 1]), int(starts[n]), int(used[n])
        if u and rows.stop > rows.start:
            o, l_ = attention_ref(q[None, rows], k[None, a:a + u], v[None, a:a + u], scale, False, (-1, -1),
                                  softcap)
            out[rows], lse[:, rows] = o[0], l_[0]
    return out, lse


@pytest.mark.parametrize("pack,splits", [(True, 1), (False, 5), (True, 3), (True, 8)])
@pytest.mark.parametrize("softcap", [0.0, 4.0])
def test_rearranged_decode_equals_attention_over_each_items_keys(pack, splits, softcap):
    g = torch.Generator().manual_seed(splits)
    b, hq, hk, d, cap = 3, 8, 2, 32, 700
    q = torch.randn(b, 1, hq, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b * cap, hk, d, generator=g, dtype=torch.float64) for _ in range(2))
    used = torch.tensor([700, 0, 129], dtype=torch.int32)  # full, empty, shorter than one chunk
    left = torch.tensor([0, 0, 40], dtype=torch.int32)
    starts = torch.arange(b, dtype=torch.int32) * cap + left
    layout = splitkv.plan(batch=b, seqlen_q=1, heads_q=hq, heads_k=hk, capacity=cap, window=(-1, -1),
                          num_splits=splits, pack_gqa=pack, sms=132)
    # chunks rounded up to 128 positions: fewer splits than asked where the capacity is short
    assert layout.pack_gqa == pack and layout.splits == -(-cap // layout.chunk) <= splits
    assert layout.chunk % splitkv.CHUNK_ALIGN == 0 or splits == 1
    rows, cu, per_seq, st, us = splitkv.rearrange(layout, q, starts, used)
    assert per_seq == (hq // hk if pack else 1) and st.shape[0] == b * layout.splits + 1
    o, lse = _varlen_stand_in(rows, k, v, cu, st, us, 0.3, softcap)
    out, lse = splitkv.combine(layout, o, lse, b, hq)
    assert out.shape == (b, 1, hq, d) and lse.shape == (b, hq, 1)
    for i in range(b):
        n = int(used[i])
        keys = slice(int(starts[i]), int(starts[i]) + n)
        if n == 0:
            assert (out[i] == 0).all() and torch.isneginf(lse[i]).all()
            continue
        want, want_lse = attention_ref(q[i:i + 1], k[None, keys], v[None, keys], 0.3, True, (-1, -1), softcap)
        torch.testing.assert_close(out[i:i + 1].double(), want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse[i:i + 1].double(), want_lse.double(), rtol=1e-5, atol=1e-5)


def test_layout_choices():
    plan = splitkv.plan
    base = dict(heads_q=32, heads_k=8, window=(-1, -1), num_splits=0, pack_gqa=None, sms=132)
    one = plan(batch=1, seqlen_q=1, capacity=8192, **base)  # 8 CTAs packed: split to fill 132 SMs
    assert one.pack_gqa and (one.splits, one.chunk) == (16, 512)  # 17 asked, 482 keys rounded up
    assert one.splits * one.chunk >= 8192 > (one.splits - 1) * one.chunk
    many = plan(batch=64, seqlen_q=1, capacity=4096, **base)  # 512 CTAs: no split
    assert many.pack_gqa and many.splits == 1
    short = plan(batch=1, seqlen_q=1, capacity=300, **base)  # chunks of at least MIN_CHUNK keys
    assert short.splits == 1
    for kw in (dict(seqlen_q=4), dict(seqlen_q=None), dict(seqlen_q=1, window=(64, 0))):  # not exact
        layout = plan(**{**base, "batch": 1, "capacity": 8192, "pack_gqa": True, "num_splits": 4, **kw})
        assert not layout.rearranged
    off = {**base, "num_splits": 1, "pack_gqa": False}
    assert not plan(batch=1, seqlen_q=1, capacity=8192, **off).rearranged
    mha = plan(batch=1, seqlen_q=1, capacity=8192, **{**base, "heads_k": 32})
    assert not mha.pack_gqa and (mha.splits, mha.chunk) == (5, 1664)
