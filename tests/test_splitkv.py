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
    assert not mha.pack_gqa and (mha.splits, mha.chunk) == (4, 2048)  # 128 CTAs; 5 splits ran 1.2 waves


def _ctas(layout, batch, heads_q):
    return batch * (layout.heads_k if layout.pack_gqa else heads_q) * layout.splits


@pytest.mark.parametrize(("batch", "heads_k", "capacity", "splits"), [
    (8, 8, 32768, 2),  # 64 CTAs: 2 splits, 128 CTAs in one wave (ceil(132 / 64) = 3 ran 1.45 waves)
    (1, 8, 8192, 16),  # 8 CTAs: 16 splits of 512 keys, 128 CTAs
    (1, 1, 65536, 57),  # 1 CTA: many splits (64 at most; 57 is within 0.85 of 64's 0.48 of a wave)
    (4, 8, 1024, 4),  # 32 CTAs: as many splits as MIN_CHUNK allows, 128 CTAs
    (17, 8, 32768, 1),  # 136 CTAs, >= 132 SMs: no split
    (16, 8, 32768, 1),  # 128 CTAs: 0.97 of a wave already
    (1, 8, 300, 1),  # shorter than two MIN_CHUNKs
])
def test_split_count_by_wave_efficiency(batch, heads_k, capacity, splits):
    base = dict(seqlen_q=1, heads_q=32, window=(-1, -1), num_splits=0, pack_gqa=None, sms=132)
    layout = splitkv.plan(batch=batch, heads_k=heads_k, capacity=capacity, **base)
    assert layout.pack_gqa and layout.splits == splits
    assert layout.splits * layout.chunk >= capacity > (layout.splits - 1) * layout.chunk
    assert layout.splits == 1 or layout.chunk >= splitkv.MIN_CHUNK


def test_wave_efficiency_rule():
    """FA3's rule: the smallest count within 0.85 of the best efficiency, each count's efficiency as
    its chunks round it; the edges of the limits."""
    eff = lambda ctas, n: ctas * n / (-(-ctas * n // 132) * 132)  # noqa: E731
    assert splitkv.wave_splits(64, 132, 1 << 20, 64) == 2 and eff(64, 3) < 0.85 * eff(64, 2)
    assert splitkv.wave_splits(120, 132, 1 << 20, 64) == 1  # 0.91 of a wave: within 0.85 of anything
    assert splitkv.wave_splits(1, 132, 1 << 20, 64) == 55 and splitkv.wave_splits(1, 132, 1 << 20, 1) == 1
    assert splitkv.wave_splits(5, 132, 1 << 20, 0) == 1  # no room to split: one
    # 14 splits of 8192 keys round to chunks of 640, i.e. 13 splits (0.79): not taken, 16 is
    assert splitkv.wave_splits(8, 132, 8192, 32) == 16
    for ctas in range(1, 132):
        n = splitkv.wave_splits(ctas, 132, 1 << 20, 64)
        best = max(eff(ctas, m) for m in range(1, 65))
        assert eff(ctas, n) >= 0.85 * best and all(eff(ctas, m) < 0.85 * best for m in range(1, n))
