"""Ring attention (flashhopper/distributed.py) through the Hopper kernels, on one GPU.

No machine with several GPUs has been lent, so the ranks of a ring run here as threads of one process on
the one GPU, with a loopback in place of the NCCL transfers (`_LoopbackRing`, the interface of
distributed._Ring): every step's forward and backward kernels, the (query chunk, key chunk) windows,
the fp32 merge by LSE and the dK/dV accumulators' turn round the ring run as they would across GPUs;
only the transport differs. The ranks take turns (one holds the baton until it waits for a transfer), so
the kernels of two ranks never overlap. A one-rank ring through ring_attn_func and its autograd runs the
entry point itself (gloo group of one; no transfer is made).

The unsharded outputs and gradients are checked against the float64 reference of the whole sequence by
the suite's rule (flashhopper/accuracy.py). The same loopback on the CPU with backend="reference" shows
the harness itself agrees with the dense result (tests/test_distributed.py runs the real transfers).
"""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from flashhopper import distributed as fd
from flashhopper.accuracy import check_forward, check_grads
from flashhopper.distributed import ring_attn_func, shard_sequence, unshard_sequence
from flashhopper.reference import attention_bwd_ref, attention_ref
from flashhopper.validation import normalize_window

TIMEOUT_S = 300  # a transfer never posted (a bug in the loop) fails instead of hanging the suite


class _Hub:
    """The mailboxes of a ring of `world` ranks run as threads; `baton` is held by the rank running."""

    def __init__(self, world: int):
        self.world = world
        self.baton = threading.Condition()
        self.boxes = {}  # (receiver, ring number, post number) -> tensors
        self.failed = None


class _Member:
    """What the loop takes as its process group: one rank of a hub."""

    def __init__(self, hub: _Hub, rank: int):
        self.hub, self.rank, self.rings_made = hub, rank, 0


class _LoopbackRing:
    """distributed._Ring's post / wait over the hub: post() copies the tensors into the next rank's box,
    wait() takes the ones the previous rank posted as its same-numbered post of its same-numbered ring
    (every rank makes its rings and posts in the same order), releasing the baton while they are not
    there yet."""

    def __init__(self, group: _Member, device):
        self.hub, self.rank, self.world = group.hub, group.rank, group.hub.world
        self.ring, self.posts = group.rings_made, 0
        group.rings_made += 1

    def post(self, tensors):
        if self.world == 1:
            return None, list(tensors)
        key = ((self.rank + 1) % self.world, self.ring, self.posts)
        self.posts += 1
        self.hub.boxes[key] = [t.clone() for t in tensors]
        self.hub.baton.notify_all()
        return key[1:], None

    def wait(self, handle):
        number, received = handle
        if number is None:
            return received
        key = (self.rank, *number)
        if not self.hub.baton.wait_for(lambda: key in self.hub.boxes or self.hub.failed, TIMEOUT_S):
            raise TimeoutError(f"rank {self.rank}: ring {number[0]} post {number[1]} never came")
        if key not in self.hub.boxes:
            raise RuntimeError(f"rank {self.rank}: another rank failed") from self.hub.failed
        return self.hub.boxes.pop(key)


def _loopback_ring(monkeypatch, world, shards, dout_shards, **kw):
    """Each rank's (out, lse, dq, dk, dv) of a ring of `world` ranks run as threads: shards[r] = (q, k, v)
    of rank r, dout_shards[r] its out's gradient. The loop's own functions (_ring_forward, _ring_backward)
    are called as _RingAttention calls them (autograd runs every backward on one thread per device,
    which threads waiting on each other would block)."""
    monkeypatch.setattr(fd, "_Ring", _LoopbackRing)
    hub = _Hub(world)
    results, errors = [None] * world, []

    def rank_main(rank):
        q, k, v = shards[rank]
        cfg = fd._Config(group=_Member(hub, rank), layout=kw["layout"], scale=kw["scale"],
                         causal=kw["causal"], window=normalize_window(kw["window"]), softcap=kw["softcap"],
                         deterministic=kw["deterministic"], backend=kw["backend"], sm_margin=0)
        with hub.baton:
            try:
                out, lse = fd._ring_forward(q, k, v, cfg)
                grads = fd._ring_backward(dout_shards[rank], q, k, v, out, lse, cfg)
                results[rank] = (out, lse, *grads)
            except BaseException as e:  # noqa: BLE001 (reported below, after every rank stopped)
                hub.failed = e
                errors.append((rank, e))
                hub.baton.notify_all()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S + 30)
    assert not any(t.is_alive() for t in threads), "a rank of the loopback ring hangs"
    if errors:
        rank, e = errors[0]
        raise AssertionError(f"rank {rank} of {world} failed") from e
    return results


def _inputs(b, seqlen, hq, hk, d, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, seqlen, hq, d, generator=g, device=device, dtype=dtype)
    k, v = (torch.randn(b, seqlen, hk, d, generator=g, device=device, dtype=dtype) for _ in range(2))
    dout = torch.randn(b, seqlen, hq, d, generator=g, device=device, dtype=dtype)
    return q, k, v, dout


def _run_sharded(monkeypatch, world, q, k, v, dout, *, layout, backend, **kw):
    """The loopback ring over the whole sequence's tensors; (out, lse, dq, dk, dv) unsharded."""
    def cut(x, rank):
        return shard_sequence(x, rank=rank, world_size=world, layout=layout).contiguous()

    shards = [tuple(cut(t, r) for t in (q, k, v)) for r in range(world)]
    douts = [cut(dout, r) for r in range(world)]
    results = _loopback_ring(monkeypatch, world, shards, douts, layout=layout, backend=backend, **kw)
    out, lse, dq, dk, dv = zip(*results, strict=True)
    lse_full = unshard_sequence([x.transpose(1, 2) for x in lse], layout=layout).transpose(1, 2)
    return (unshard_sequence(out, layout=layout), lse_full,
            *(unshard_sequence(g, layout=layout) for g in (dq, dk, dv)))


def test_loopback_ring_on_the_cpu_equals_dense_attention(monkeypatch):
    """The harness: float64 through the reference backend, 4 ranks, zigzag causal with GQA and a window
    that empties steps, against single-process attention."""
    scale, causal, window, softcap = 0.3, True, (7, -1), 1.5
    q, k, v, dout = _inputs(1, 24, 4, 2, 16, torch.float64, "cpu", seed=3)
    out, lse, *grads = _run_sharded(monkeypatch, 4, q, k, v, dout, layout="zigzag", backend="reference",
                                    scale=scale, causal=causal, window=window, softcap=softcap,
                                    deterministic=False)
    out_ref, lse_ref = attention_ref(q, k, v, scale, causal, window, softcap)
    torch.testing.assert_close(out, out_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, lse_ref.float(), rtol=1e-5, atol=1e-5)
    grads_ref = attention_bwd_ref(q, k, v, dout, scale, causal, window, softcap)
    for got, want in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs an sm_90 (Hopper) GPU")

# (world, layout, dtype, batch, s_local, hq, hk, d, causal, window, softcap, deterministic)
RING_CASES = [
    (2, "zigzag", torch.bfloat16, 2, 256, 4, 2, 128, True, (-1, -1), 0.0, False),
    (4, "zigzag", torch.float16, 1, 194, 2, 2, 64, True, (-1, -1), 0.0, False),  # chunks of 97
    (3, "zigzag", torch.bfloat16, 1, 154, 4, 1, 128, False, (-1, -1), 5.0, True),
    (2, "contiguous", torch.bfloat16, 1, 300, 2, 2, 96, False, (200, 50), 0.0, False),
    (4, "contiguous", torch.bfloat16, 1, 160, 2, 2, 128, True, (300, -1), 0.0, False),  # steps skipped
    (2, "zigzag", torch.bfloat16, 1, 128, 2, 2, 256, True, (-1, -1), 0.0, False),
]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("case", RING_CASES, ids=lambda c: f"w{c[0]}-{c[1]}-{str(c[2])[6:]}-d{c[7]}"
                         f"{'-causal' if c[8] else ''}{'-window' if c[9] != (-1, -1) else ''}"
                         f"{'-softcap' if c[10] else ''}{'-det' if c[11] else ''}")
def test_ring_through_the_kernels_by_the_rule(monkeypatch, case):
    world, layout, dtype, b, s_local, hq, hk, d, causal, window, softcap, deterministic = case
    scale = d ** -0.5
    q, k, v, dout = _inputs(b, s_local * world, hq, hk, d, dtype, "cuda", seed=world * 1000 + s_local + d)
    out, lse, *grads = _run_sharded(monkeypatch, world, q, k, v, dout, layout=layout, backend="auto",
                                    scale=scale, causal=causal, window=window, softcap=softcap,
                                    deterministic=deterministic)
    assert out.dtype == dtype and lse.dtype == torch.float32
    check_forward(out, lse, q, k, v, scale, causal, window, softcap)
    check_grads(grads, q, k, v, dout, scale, causal, window, softcap, out=out)


@pytest.mark.gpu
@needs_hopper
def test_ring_attn_func_one_rank_through_autograd(tmp_path):
    """The entry point and its autograd on the kernels: a group of one rank (its steps are the zigzag
    layout's two chunks against each other, the later one's causal pair cut by pair_window)."""
    q, k, v, dout = _inputs(1, 2 * 181, 4, 2, 128, torch.bfloat16, "cuda", seed=7)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = ring_attn_func(*leaves, causal=True, return_lse=True)
        out.backward(dout)
    finally:
        dist.destroy_process_group()
    scale = 128 ** -0.5
    check_forward(out.detach(), lse, q, k, v, scale, True, (-1, -1), 0.0)
    check_grads([t.grad for t in leaves], q, k, v, dout, scale, True, (-1, -1), 0.0, out=out.detach())
