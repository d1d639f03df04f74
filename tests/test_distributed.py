"""Ring attention (flashhopper/distributed.py) on the CPU: the mask of each (query chunk, key chunk) pair
against the global mask, the sharding helpers, the backward from an outside LSE, the argument checks, and
the ring itself on 2 and 4 processes (gloo, backend="reference") against single-process attention:
forward, LSE and gradients, causal or not, zigzag and contiguous shards, GQA, windows, softcap, bf16."""

from __future__ import annotations

import datetime
import itertools
import os
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashhopper import distributed as fd
from flashhopper.distributed import (
    pair_window,
    ring_attn_func,
    shard_positions,
    shard_sequence,
    step_pairs,
    unshard_sequence,
)
from flashhopper.reference import attention_bwd_from_lse, attention_bwd_ref, attention_ref, visible_mask

# ---------------------------------------------------------------------------------------------------
# pure functions


def _pair_mask_as_block(m, q_len, k_len):
    block = torch.zeros(q_len, k_len, dtype=torch.bool)
    if m is not None:
        (a, b), (c, d) = m.q_rows, m.k_rows
        block[a:b, c:d] = visible_mask(b - a, d - c, m.causal, m.window)
    return block


@pytest.mark.parametrize("causal", [False, True])
def test_pair_window_equals_the_global_mask_on_every_block(causal):
    seqlen, sides = 6, (-1, 0, 1, 2, 5)
    ranges = [(start, length) for start in range(seqlen) for length in range(1, seqlen - start + 1)]
    for window in itertools.product(sides, sides):
        full = visible_mask(seqlen, seqlen, causal, window)
        for (q0, lq), (k0, lk) in itertools.product(ranges, ranges):
            want = full[q0:q0 + lq, k0:k0 + lk]
            m = pair_window(q0, lq, k0, lk, causal=causal, window_size=window)
            where = f"window={window} causal={causal} q=[{q0}, {q0 + lq}) k=[{k0}, {k0 + lk}): {m}"
            assert torch.equal(_pair_mask_as_block(m, lq, lk), want), where
            if m is None:
                continue
            assert min(m.window) >= -1, where
            (a, b), (c, d) = m.q_rows, m.k_rows
            # the cut keeps only rows and columns with a visible entry
            assert want[a:b].any(1).all() and want[:, c:d].any(0).all(), where
            if bool(want.all()):  # wholly visible: no mask at all
                assert m == fd.PairMask((0, lq), (0, lk), False, (-1, -1)), where


def test_pair_window_on_zigzag_causal_chunks():
    c = 4  # chunks of 4 tokens: q chunk 2 against k chunks 0 (all), 2 (causal), 3 (none)
    assert pair_window(8, c, 0, c, causal=True, window_size=(-1, -1)) == fd.PairMask((0, 4), (0, 4), False,
                                                                                       (-1, -1))
    assert pair_window(8, c, 8, c, causal=True, window_size=(-1, -1)) == fd.PairMask((0, 4), (0, 4), True,
                                                                                       (-1, -1))
    assert pair_window(8, c, 12, c, causal=True, window_size=(-1, -1)) is None
    # a left window of 6: query 8 sees from key 2, query 9 from key 3, query 10 from key 4 (past chunk 0):
    # the lower bound lies above the block's own diagonal, so the block is cut to queries 8..9 and keys
    # 2..3, where it is a window (0, -1)
    m = pair_window(8, c, 0, c, causal=True, window_size=(6, -1))
    assert m == fd.PairMask((0, 2), (2, 4), False, (0, -1))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_causal_steps_skip_only_the_invisible(world, layout):
    """Under causal each step's calls cover exactly the visible (query, key) pairs of the two shards;
    zigzag gives every rank the same count of visible pairs at every step after the first."""
    s_local = 4
    seqlen = s_local * world
    full = visible_mask(seqlen, seqlen, True)
    for rank in range(world):
        q_pos = shard_positions(seqlen, rank=rank, world_size=world, layout=layout)
        for src in range(world):
            k_pos = shard_positions(seqlen, rank=src, world_size=world, layout=layout)
            got = torch.zeros(s_local, s_local, dtype=torch.bool)
            pairs = step_pairs(s_local, rank=rank, src=src, world_size=world, layout=layout, causal=True,
                               window_size=(-1, -1))
            for p in pairs:
                n_q, n_k = p.q_rows.stop - p.q_rows.start, p.k_rows.stop - p.k_rows.start
                got[p.q_rows, p.k_rows] |= visible_mask(n_q, n_k, p.causal, p.window)
            want = full[q_pos][:, k_pos]
            assert torch.equal(got, want), (rank, src)
            assert bool(want.any()) == bool(pairs)
            if layout == "zigzag" and src != rank:
                assert int(want.sum()) == s_local * s_local // 2


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_shard_unshard_round_trip_and_positions(world, layout):
    seqlen = 4 * world
    x = torch.randn(2, seqlen, 3, 5)
    shards = [shard_sequence(x, rank=r, world_size=world, layout=layout) for r in range(world)]
    assert all(s.shape == (2, 4, 3, 5) for s in shards)
    assert torch.equal(unshard_sequence(shards, layout=layout), x)
    positions = [shard_positions(seqlen, rank=r, world_size=world, layout=layout) for r in range(world)]
    for r in range(world):  # the positions are the tokens the shard holds
        assert positions[r].dtype == torch.int64
        assert torch.equal(shards[r], x[:, positions[r]])
    assert torch.equal(unshard_sequence(positions, layout=layout, dim=0), torch.arange(seqlen))
    if layout == "zigzag" and world == 2:  # chunks of 2: rank 0 holds 0 and 3, rank 1 holds 1 and 2
        assert positions[0].tolist() == [0, 1, 6, 7] and positions[1].tolist() == [2, 3, 4, 5]
    # another dim
    y = torch.randn(seqlen, 7)
    parts = [shard_sequence(y, rank=r, world_size=world, layout=layout, dim=0) for r in range(world)]
    assert torch.equal(unshard_sequence(parts, layout=layout, dim=0), y)


def test_shard_errors():
    x = torch.randn(1, 6, 2, 4)
    with pytest.raises(ValueError, match="multiple of 8"):
        shard_sequence(x, rank=0, world_size=4)
    with pytest.raises(ValueError, match="rank=2"):
        shard_sequence(x, rank=2, world_size=2, layout="contiguous")
    with pytest.raises(ValueError, match="layout"):
        shard_positions(8, rank=0, world_size=2, layout="strided")
    with pytest.raises(ValueError, match="shards\\[1\\]"):
        unshard_sequence([x, x[:, :4]])


def test_backward_from_an_outside_lse():
    """With its own out and LSE it is the exact backward; with the out and LSE of attention over all the
    keys, the parts over disjoint key sets add up to the whole (dq) and hold each part's dk, dv."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 7, 4, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 9, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(2, 7, 4, 16, generator=g, dtype=torch.float64)
    for softcap in (0.0, 3.0):
        out, lse = attention_ref(q, k, v, 0.3, False, (-1, -1), softcap)
        want = attention_bwd_ref(q, k, v, dout, 0.3, False, (-1, -1), softcap)
        got = attention_bwd_from_lse(q, k, v, out, dout, lse, 0.3, False, (-1, -1), softcap)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        lo = attention_bwd_from_lse(q, k[:, :4], v[:, :4], out, dout, lse, 0.3, softcap=softcap)
        hi = attention_bwd_from_lse(q, k[:, 4:], v[:, 4:], out, dout, lse, 0.3, softcap=softcap)
        torch.testing.assert_close(lo[0] + hi[0], want[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.cat([lo[1], hi[1]], 1), want[1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.cat([lo[2], hi[2]], 1), want[2], rtol=1e-5, atol=1e-6)
    # a row that sees no key: P = 0, no NaN
    lse_none = lse.clone()
    lse_none[:, :, 0] = float("-inf")
    dq, dk, dv = attention_bwd_from_lse(q, k, v, out, dout, lse_none, 0.3, causal=True)
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))


def test_merge_keeps_rows_without_keys_nan_free():
    acc_out = torch.zeros(1, 3, 2, 4)
    acc_lse = torch.full((1, 3, 2), float("-inf"))
    out = torch.randn(1, 2, 2, 4)
    lse = torch.tensor([[[float("-inf"), 0.5], [float("-inf"), -1.0]]])  # (b, h, n): row 0 sees nothing
    fd._merge_into(acc_out, acc_lse, slice(1, 3), out, lse)
    assert torch.isfinite(acc_out).all()
    assert torch.equal(acc_out[:, :2], torch.zeros(1, 2, 2, 4))
    assert torch.isneginf(acc_lse[:, :2]).all()
    torch.testing.assert_close(acc_out[:, 2], out[:, 1])
    torch.testing.assert_close(acc_lse[0, 2], torch.tensor([0.5, -1.0]))
    fd._merge_into(acc_out, acc_lse, slice(2, 3), out[:, 1:], lse[:, :, 1:])  # the same again: log 2 more
    torch.testing.assert_close(acc_out[:, 2], out[:, 1])
    torch.testing.assert_close(acc_lse[0, 2], torch.tensor([0.5, -1.0]) + torch.tensor(2.0).log())


def test_argument_errors_before_any_process_group():
    assert not dist.is_initialized()
    q = torch.randn(1, 4, 4, 64, dtype=torch.float64)
    k = v = torch.randn(1, 4, 2, 64, dtype=torch.float64)
    ref = dict(backend="reference")
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attn_func(q, k, v, **ref)
    with pytest.raises(ValueError, match="heads_q must be a multiple"):
        k3 = torch.randn(1, 4, 3, 64, dtype=torch.float64)
        ring_attn_func(q, k3, k3, **ref)
    with pytest.raises(ValueError, match="s_local differs"):
        ring_attn_func(q, k[:, :2], v[:, :2], **ref)
    with pytest.raises(ValueError, match="rank 4"):
        ring_attn_func(q[0], k, v, **ref)
    with pytest.raises(TypeError, match="q has dtype torch.float64"):
        ring_attn_func(q, k, v, backend="auto")
    with pytest.raises(TypeError, match="v has dtype"):
        ring_attn_func(q, k, v.float(), **ref)
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        ring_attn_func(q, None, v, **ref)
    with pytest.raises(ValueError, match="zigzag"):
        ring_attn_func(q[:, :3], k[:, :3], v[:, :3], **ref)
    with pytest.raises(ValueError, match="layout"):
        ring_attn_func(q, k, v, layout="striped", **ref)
    with pytest.raises(TypeError, match="window_size"):
        ring_attn_func(q, k, v, window_size=3, **ref)
    with pytest.raises(ValueError, match="backend"):
        ring_attn_func(q, k, v, backend="cuda")


# ---------------------------------------------------------------------------------------------------
# the ring, in spawned processes

SCALE = 0.4
# (name, dtype, batch, s_local, hq, hk, d, layout, causal, window, softcap)
CASES_2 = [
    ("zigzag", torch.float64, 2, 4, 2, 2, 16, "zigzag", False, (-1, -1), 0.0),
    ("zigzag causal", torch.float64, 2, 4, 2, 2, 16, "zigzag", True, (-1, -1), 0.0),
    ("s_local 1", torch.float64, 1, 1, 2, 1, 16, "contiguous", False, (-1, -1), 0.0),
    ("s_local 1 causal", torch.float64, 1, 1, 2, 1, 16, "contiguous", True, (-1, -1), 0.0),
    ("zigzag chunks of 1, causal", torch.float64, 1, 2, 2, 2, 16, "zigzag", True, (-1, -1), 0.0),
    ("gqa causal softcap", torch.float64, 1, 6, 4, 1, 16, "zigzag", True, (-1, -1), 2.5),
    ("window left", torch.float64, 1, 6, 2, 1, 8, "zigzag", False, (4, -1), 0.0),
    ("window right", torch.float64, 1, 6, 2, 1, 8, "zigzag", False, (-1, 2), 0.0),
    ("window both", torch.float64, 1, 6, 4, 2, 8, "contiguous", False, (3, 5), 0.0),
    ("window causal", torch.float64, 1, 6, 2, 2, 8, "zigzag", True, (5, -1), 1.5),
    ("bf16 causal gqa", torch.bfloat16, 1, 8, 4, 2, 64, "zigzag", True, (-1, -1), 0.0),
    ("fp16 window", torch.float16, 1, 8, 2, 2, 64, "zigzag", False, (3, 1), 0.0),
]
CASES_4 = [
    ("zigzag causal gqa", torch.float64, 1, 4, 4, 2, 16, "zigzag", True, (-1, -1), 0.0),
    ("zigzag softcap", torch.float64, 2, 2, 2, 2, 8, "zigzag", False, (-1, -1), 2.0),
    ("contiguous s_local 1 causal", torch.float64, 1, 1, 2, 1, 8, "contiguous", True, (-1, -1), 0.0),
    ("window both", torch.float64, 1, 4, 2, 1, 8, "zigzag", False, (2, 3), 0.0),
    ("window causal skips steps", torch.float64, 1, 2, 2, 2, 8, "contiguous", True, (1, -1), 0.0),
    ("bf16 causal window", torch.bfloat16, 1, 4, 2, 2, 64, "zigzag", True, (6, -1), 0.0),
]


def _tolerances(dtype):
    """(rtol, atol as a share of the expected tensor's largest magnitude). fp64: the per-step LSE is
    fp32 (attention_ref's). bf16 / fp16: each step's out is rounded to the dtype before the fp32 merge,
    and so is the out the backward's D is formed from; a gradient element that sums large terms of both
    signs keeps their rounding, hence a bound on the tensor's scale rather than the element's."""
    return {torch.float64: (1e-5, 1e-6), torch.float16: (5e-3, 5e-3)}.get(dtype, (3e-2, 1.5e-2))


def _assert_close(got, want, dtype, what, tolerances=None):
    """|got - want| <= atol * max(1, max|want|) + rtol * |want| elementwise. (torch.testing.assert_close
    imports DTensor once a process group exists: seconds in every spawned rank.)"""
    rtol, atol = _tolerances(dtype) if tolerances is None else tolerances
    got, want = got.detach().double(), want.to(dtype).double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    bound = atol * max(1.0, float(want.abs().max())) + rtol * want.abs()
    err = (got - want).abs()
    bad = ~(err <= bound)  # NaN fails
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} elements off, the worst by "
                           f"{float(err.max())} (got {float(got[bad][0])}, expected {float(want[bad][0])})")


def _dense(case, world):
    """The case's whole-sequence tensors and single-process results (the parent computes them once:
    each spawned rank would otherwise pay autograd's first-call imports)."""
    name, dtype, b, s_local, hq, hk, d, layout, causal, window, softcap = case
    seqlen = s_local * world
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    q = torch.randn(b, seqlen, hq, d, generator=g, dtype=torch.float64).to(dtype)
    k, v = (torch.randn(b, seqlen, hk, d, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    dout = torch.randn(b, seqlen, hq, d, generator=g, dtype=torch.float64).to(dtype)
    out_ref, lse_ref = attention_ref(q, k, v, SCALE, causal, window, softcap)
    grads_ref = attention_bwd_ref(q, k, v, dout, SCALE, causal, window, softcap)
    return (q, k, v, dout), (out_ref, lse_ref, *grads_ref)


def _run_case(case, dense, rank, world, group, counts):
    name, dtype, b, s_local, hq, hk, d, layout, causal, window, softcap = case
    (q, k, v, dout), (out_ref, lse_ref, *grads_ref) = dense

    def mine(x):
        return shard_sequence(x, rank=rank, world_size=world, layout=layout)

    ql, kl, vl = (mine(t).requires_grad_() for t in (q, k, v))
    # k and v as views with gaps (unbound from one packed tensor, as from a fused QKV projection): the ring
    # must send their elements, not their storage
    k_in, v_in = torch.stack([kl, vl], dim=2).unbind(2)  # (of more than one row: not contiguous)
    counts.clear()
    out, lse = ring_attn_func(ql, k_in, v_in, group=group, causal=causal, window_size=window, softcap=softcap,
                              softmax_scale=SCALE, backend="reference", layout=layout, return_lse=True)
    # the same gradient as out.backward(mine(dout)), which imports sympy on its first call (seconds)
    (out * mine(dout)).sum().backward()
    msg = f"case {name!r}, rank {rank} of {world}"
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (b, hq, s_local), msg
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), msg
    _assert_close(out, mine(out_ref), dtype, msg)
    _assert_close(lse, mine(lse_ref.transpose(1, 2)).transpose(1, 2), torch.float32, f"{msg} lse",
                  tolerances=(1e-5, 1e-5))
    for what, got, want in zip(("dq", "dk", "dv"), (ql.grad, kl.grad, vl.grad), grads_ref, strict=True):
        assert got.dtype == dtype, msg
        _assert_close(got, mine(want), dtype, f"{msg} {what}")
    # unshard(ring output) == dense output
    every = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(every, out.detach().contiguous(), group=group)
    _assert_close(unshard_sequence(every, layout=layout), out_ref, dtype, f"{msg} unsharded")
    return dict(counts)


def _counting(fn, counts, key):
    def wrapped(*args, **kwargs):
        counts[key] = counts.get(key, 0) + 1
        return fn(*args, **kwargs)

    return wrapped


def _worker(rank, world, init, cases, extra, dense):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    counts = {}
    fd._step_forward = _counting(fd._step_forward, counts, "fwd")
    fd._step_backward = _counting(fd._step_backward, counts, "bwd")
    try:
        for case in cases:
            seen = _run_case(case, dense[case[0], world], rank, world, None, counts)
            if case[0] == "window causal skips steps":
                # a window of 1 back over shards of 2 tokens: only this rank's and the previous one's keys
                calls = 1 if rank == 0 else 2
                assert seen == {"fwd": calls, "bwd": calls}, (rank, seen)
        if "mismatch" in extra:  # s_local differs between ranks: every rank raises, none hangs
            s = 4 if rank == 0 else 2
            x = torch.randn(1, s, 2, 8, dtype=torch.float64)
            with pytest.raises(ValueError, match="shapes differ between ranks"):
                ring_attn_func(x, x, x, backend="reference")
        if "groups" in extra:  # rings over part of the world: ranks 1 and 3; rank 0 alone; rank 2 outside
            pair, alone = dist.new_group([1, 3]), dist.new_group([0])
            if rank in (1, 3):
                _run_case(CASES_2[1], dense[CASES_2[1][0], 2], [1, 3].index(rank), 2, pair, counts)
            if rank == 0:
                _run_case(CASES_2[5], dense[CASES_2[5][0], 1], 0, 1, alone, counts)
            if rank == 2:
                x = torch.randn(1, 2, 2, 8, dtype=torch.float64)
                with pytest.raises(ValueError, match="not a member"):
                    ring_attn_func(x, x, x, group=pair, backend="reference")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(world, tmp_path, cases, extra=()):
    subgroup_cases = [(CASES_2[1], 2), (CASES_2[5], 1)] if "groups" in extra else []
    assert dist.is_available() and dist.is_gloo_available(), "these tests need torch.distributed with gloo"
    env = {"OMP_NUM_THREADS": "1"}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        dense = {(case[0], w): _dense(case, w) for case, w in [(c, world) for c in cases] + subgroup_cases}
        mp.spawn(_worker, args=(world, f"file://{tmp_path / 'rendezvous'}", cases, extra, dense),
                 nprocs=world, join=True)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_ring_attention_two_ranks(tmp_path):
    _spawn(2, tmp_path, CASES_2, extra=("mismatch",))


def test_ring_attention_four_ranks(tmp_path):
    _spawn(4, tmp_path, CASES_4, extra=("groups",))
