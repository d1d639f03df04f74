"""flash_attn_varlen_func's forward and backward against the float64 reference, sequence by sequence,
by the rule of flashhopper/accuracy.py; outputs and workspaces start as NaN (runtime.poison), so a
row no tile wrote shows, and rows past a sequence's seqused_q must still be NaN afterwards (no tile
writes outside its sequence).
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from varlen_cases import SEQUSED, SEQUSED_NEXT

from flashhopper.accuracy import check_forward, check_varlen_forward, check_varlen_grads
from flashhopper.validation import SEQUSED_BWD_OPT_IN

pytestmark = pytest.mark.gpu

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)

from flashhopper import flash_attn_varlen_func  # noqa: E402
from flashhopper.hopper import backward_varlen, forward_varlen, runtime  # noqa: E402

DEV = "cuda"


@pytest.fixture(autouse=True)
def _seqused_bwd_opt_in(monkeypatch):
    monkeypatch.setenv(SEQUSED_BWD_OPT_IN, "1")  # the backward through seqused, until it has passed here


def run_case(lens_q, lens_k, hq=4, hk=2, d=128, dtype=torch.bfloat16, causal=False, window=(-1, -1),
             softcap=0.0, used_q=None, used_k=None):
    torch.manual_seed(zlib.crc32(repr((lens_q, lens_k, hq, hk, d, causal, window, softcap, used_q)).encode()))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
                  for lens in (lens_q, lens_k))
    q = torch.randn(sum(lens_q), hq, d, device=DEV, dtype=dtype)
    k, v = (torch.randn(max(sum(lens_k), 0), hk, d, device=DEV, dtype=dtype) for _ in range(2))
    uq = None if used_q is None else torch.tensor(used_q, dtype=torch.int32, device=DEV)
    uk = None if used_k is None else torch.tensor(used_k, dtype=torch.int32, device=DEV)
    out = torch.full((q.shape[0], hq, d), float("nan"), device=DEV, dtype=dtype)
    lse = torch.full((hq, q.shape[0]), float("nan"), device=DEV)
    scale = 1 / math.sqrt(d)
    lq_eff = used_q or lens_q
    forward_varlen(q, k, v, cu_q, cu_k, max(lq_eff), uq, uk, scale, causal, window, softcap, out=out, lse=lse)
    torch.cuda.synchronize()
    check_varlen_forward(out, lse, q, k, v, cu_q.tolist(), cu_k.tolist(), lq_eff, used_k or lens_k, scale,
                         causal, window, softcap)

PACKINGS = [
    ([0, 1, 17, 127, 128, 129, 300], [5, 1, 17, 130, 128, 129, 1000]),
    ([4097, 1, 0], [4097, 2, 3]),
    ([513, 300], [300, 513]),
]


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (False, (100, 20), 10.0)])
@pytest.mark.parametrize("packing", range(len(PACKINGS)))
def test_varlen_forward(packing, causal, window, softcap, d):
    lens_q, lens_k = PACKINGS[packing]
    run_case(lens_q, lens_k, d=d, causal=causal, window=window, softcap=softcap)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_gqa_and_dtypes(dtype):
    run_case([200, 37, 1000], [300, 37, 900], hq=8, hk=1, dtype=dtype, causal=True)


def test_varlen_seqused_shorter_than_the_packing():
    run_case([300, 200, 129], [400, 100, 129], used_q=[250, 0, 129], used_k=[400, 50, 1], causal=True)


def test_varlen_no_keys_at_all():
    run_case([5, 9], [0, 0])


def test_varlen_split_head_dims():
    """(hdim, dv) = (192, 128) packed (MLA prefill)."""
    lens_q, lens_k = [300, 1, 129], [517, 2, 129]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
                  for lens in (lens_q, lens_k))
    q = torch.randn(sum(lens_q), 4, 192, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(sum(lens_k), 2, 192, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(sum(lens_k), 2, 128, device=DEV, dtype=torch.bfloat16)
    out, lse = forward_varlen(q, k, v, cu_q, cu_k, max(lens_q), None, None, 192 ** -0.5, True, (-1, -1), 0.0)
    torch.cuda.synchronize()
    assert out.shape == (sum(lens_q), 4, 128)
    for i in range(3):
        rows, keys = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        check_forward(out[None, rows], lse[None, :, rows], q[None, rows], k[None, keys], v[None, keys],
                      192 ** -0.5, True, (-1, -1), 0.0)


# The walk (hopper/tile_scheduler.py): only each sequence's real tiles, longest sequence first, claimed
# by the CTAs of a persistent grid from the walk table (hopper/varlen_walk.py). A missed tile leaves NaN,
# a tile walked twice or outside its sequence writes where the rule or the NaN check sees it.
WALK_Q = [3, 0, 1, 17, 4097, 127, 128, 129, 0, 300]  # the longest neither first nor last
WALK_K = [5, 0, 0, 17, 4000, 127, 500, 129, 3, 299]  # sq != sk; a sequence with a query and no key


def _short_documents(count=512, seed=0):
    """`count` documents of 16-511 tokens (the bench's many-short-documents shape), seeded."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(16, 512, (count,), generator=generator).tolist()


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (False, (100, 20), 10.0), (True, (37, -1), 0.0)])
@pytest.mark.parametrize("cap", [None, 3])
def test_varlen_walk_visits_every_tile_once(d, causal, window, softcap, cap, monkeypatch):
    """Lengths 0, 1, 17, 127, 128, 129, 4097 in one packing, GQA; on the SM count's grid and on 3
    CTAs (runtime.persistent_ctas_cap), each CTA claiming tile after tile across sequences."""
    monkeypatch.setattr(runtime, "persistent_ctas_cap", cap)
    run_case(WALK_Q, WALK_K, hq=6, hk=2, d=d, causal=causal, window=window, softcap=softcap)


@pytest.mark.parametrize("d,causal,cap", [(128, False, None), (128, True, 7), (64, True, None),
                                         (256, False, 7)])
def test_varlen_walk_many_short_documents(d, causal, cap, monkeypatch):
    """512 documents of 16-511 tokens: ~1-4 query blocks each, far more tiles than CTAs."""
    monkeypatch.setattr(runtime, "persistent_ctas_cap", cap)
    lens = _short_documents()
    run_case(lens, lens, hq=4, hk=1, d=d, causal=causal)


def test_varlen_walk_with_no_tile_at_all_then_again():
    """seqused_q 0 everywhere: every CTA finds no tile and leaves (its consumers on the end marker),
    nothing is written, the tile counter is put back; the next launch on the stream walks normally."""
    run_case([5, 9, 300], [5, 9, 300], used_q=[0, 0, 0])
    run_case([5, 9, 300], [5, 9, 300], causal=True)
    _counters_zero()


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_walk_back_to_back_launches_reset_the_counter(causal, monkeypatch):
    """Launches of different packings back to back on one stream, no sync between them: each starts
    from a zero tile counter (the last CTA of the one before put it back), so each output is the same
    bits as the same launch alone; then every counter reads 0."""
    monkeypatch.setattr(runtime, "persistent_ctas_cap", 5)
    torch.manual_seed(3)
    packings = [WALK_Q, _short_documents(64, seed=1), [1] * 40, [2000, 1, 700]]
    inputs = []
    for lens in packings:
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
        q, k, v = (torch.randn(sum(lens), 4, 128, device=DEV, dtype=torch.bfloat16) for _ in range(3))
        inputs.append((q, k, v, cu, max(lens)))

    def launch(q, k, v, cu, max_len):
        return forward_varlen(q, k, v, cu, cu, max_len, None, None, 128 ** -0.5, causal, (-1, -1), 0.0)

    alone = []
    for x in inputs:
        alone.append(launch(*x))
        torch.cuda.synchronize()
    _counters_zero()
    together = [(i, launch(*inputs[i])) for _ in range(3) for i in range(len(inputs))]
    _counters_zero()
    for i, (out, lse) in together:
        assert torch.equal(out, alone[i][0]) and torch.equal(lse, alone[i][1]), i
    q, k, v, cu, _ = inputs[0]
    check_varlen_forward(alone[0][0], alone[0][1], q, k, v, cu.tolist(), cu.tolist(), WALK_Q, WALK_Q,
                         128 ** -0.5, causal, (-1, -1), 0.0)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (64, 0))])
def test_varlen_graph_replay_with_new_lengths(causal, window, monkeypatch):
    """Captured once (walk table, tile counter and kernel in the graph), replayed with other cu_seqlens
    of the same batch and total: each replay walks the lengths it is given (no host sync, the grid sized
    at capture from max_seqlen_q). Rows past the last sequence stay NaN."""
    monkeypatch.setattr(runtime, "persistent_ctas_cap", None)
    torch.manual_seed(4)
    total, hq, hk, d = 2100, 4, 2, 128
    q = torch.randn(total, hq, d, device=DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(total, hk, d, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    first = [100, 300, 1, 599, 600, 400]
    cu = torch.tensor([0, *torch.tensor(first).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    out = torch.full((total, hq, d), float("nan"), device=DEV, dtype=torch.bfloat16)
    lse = torch.full((hq, total), float("nan"), device=DEV)
    scale = d ** -0.5

    def call():
        forward_varlen(q, k, v, cu, cu, total, None, None, scale, causal, window, 0.0, out=out, lse=lse)

    call()  # compiles / loads outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for lens in (first, [0, 2000, 0, 1, 17, 82], [350] * 6, [1, 1, 1, 1, 1, 2095], [0] * 6, [129] * 6):
        cu.copy_(torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        starts = cu.tolist()
        check_varlen_forward(out, lse, q, k, v, starts, starts, lens, lens, scale, causal, window, 0.0)
        assert out[starts[-1]:].isnan().all() and lse[:, starts[-1]:].isnan().all(), lens


def _counters_zero():
    """Every tile counter (one per stream) is back at 0 once the GPU is idle."""
    torch.cuda.synchronize()
    assert runtime._tile_counters, "no counter was allocated"
    for key, counter in runtime._tile_counters.items():
        assert counter.shape == (2,) and not counter.any(), (key, counter.tolist())


def test_varlen_nan_past_seqused_k_stays_out():
    """K and V rows past a sequence's seqused_k hold NaN (a serving cache's unused slots): the kernel
    loads them with the last key block, masks their scores and zeroes their V rows in smem (all
    consumers, then one barrier), so no NaN reaches the output."""
    lens, used = [300, 129], [250, 1]
    cu = torch.tensor([0, 300, 429], dtype=torch.int32, device=DEV)
    q = torch.randn(429, 4, 128, device=DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(429, 2, 128, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    for i in range(2):
        k[cu[i] + used[i]:cu[i] + lens[i]] = float("nan")
        v[cu[i] + used[i]:cu[i] + lens[i]] = float("nan")
    uk = torch.tensor(used, dtype=torch.int32, device=DEV)
    for causal in (False, True):
        out, lse = forward_varlen(q, k, v, cu, cu, 300, None, uk, 128 ** -0.5, causal, (-1, -1), 0.0)
        torch.cuda.synchronize()
        for i in range(2):
            rows = slice(int(cu[i]), int(cu[i + 1]))
            keys = slice(int(cu[i]), int(cu[i]) + used[i])
            check_forward(out[None, rows], lse[None, :, rows], q[None, rows], k[None, keys], v[None, keys],
                          128 ** -0.5, causal, (-1, -1), 0.0)


def run_backward(lens_q, lens_k, hq=4, hk=2, d=128, dtype=torch.bfloat16, causal=False, window=(-1, -1),
                 softcap=0.0, deterministic=False, dv=None, used_q=None, used_k=None, seed=None):
    """The varlen backward on fresh inputs, each sequence's (dq, dk, dv) by the rule; returns them. `dv`:
    the value head dim (None: d). `used_q` / `used_k`: seqused lengths (lists), passed to the forward
    and the backward; the rows of q, k, v and dout past them hold NaN, and their gradients must be 0.
    `seed`: the inputs' (default: one of the case)."""
    dv = dv or d
    if seed is None:
        seed = zlib.crc32(repr(("bwd", lens_q, lens_k, hq, hk, d, dv, causal, window, softcap, used_q,
                                used_k)).encode())
    torch.manual_seed(seed)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
                  for lens in (lens_q, lens_k))
    q, dout = (torch.randn(sum(lens_q), hq, dim, device=DEV, dtype=dtype) for dim in (d, dv))
    k, v = (torch.randn(sum(lens_k), hk, dim, device=DEV, dtype=dtype) for dim in (d, dv))
    uq, uk = (None if used is None else torch.tensor(used, dtype=torch.int32, device=DEV)
              for used in (used_q, used_k))
    for x, starts, used in ((q, cu_q, used_q), (dout, cu_q, used_q), (k, cu_k, used_k), (v, cu_k, used_k)):
        for i, n in enumerate(used or ()):
            x[int(starts[i]) + n:int(starts[i + 1])] = float("nan")  # never to reach a gradient
    max_q, max_k = max(used_q or lens_q), max(used_k or lens_k)
    scale = 1 / math.sqrt(d)
    out, lse = forward_varlen(q, k, v, cu_q, cu_k, max_q, uq, uk, scale, causal, window, softcap)

    def backward():
        return backward_varlen(q, k, v, out, dout, lse, cu_q, cu_k, max_q, max_k, scale, causal, window,
                               softcap, deterministic=deterministic, seqused_q=uq, seqused_k=uk)

    grads = backward()
    torch.cuda.synchronize()
    assert grads[2].shape == v.shape
    check_varlen_grads(grads, q, k, v, dout, cu_q.tolist(), cu_k.tolist(), scale, causal, window, softcap,
                       out=out, used_q=used_q, used_k=used_k)
    if deterministic:  # bitwise the same again (fresh workspaces, the same inputs)
        for name, x, y in zip(("dq", "dk", "dv"), grads, backward(), strict=True):
            assert torch.equal(x, y), f"{name} differs between two deterministic runs"
    return grads


# the forward's packings plus one of equal lengths (every tile full) and many short sequences
BWD_PACKINGS = [*PACKINGS, ([256] * 4, [256] * 4),
                ([3, 64, 16, 100, 1, 33, 80, 7] * 4, [5, 64, 20, 90, 2, 40, 81, 7] * 4)]


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (False, (100, 20), 10.0), (True, (37, -1), 0.0)])
@pytest.mark.parametrize("packing", range(len(BWD_PACKINGS)))
def test_varlen_backward(packing, causal, window, softcap, d):
    lens_q, lens_k = BWD_PACKINGS[packing]
    run_backward(lens_q, lens_k, d=d, causal=causal, window=window, softcap=softcap)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_backward_deterministic_is_bitwise_reproducible(d, causal):
    run_backward([300, 0, 129, 1000], [517, 3, 129, 1000], hq=8, hk=2, d=d, causal=causal, deterministic=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_backward_gqa_and_dtypes(dtype):
    run_backward([200, 37, 1000], [300, 37, 900], hq=8, hk=1, dtype=dtype, causal=True)


def test_varlen_backward_no_keys_or_no_queries():
    """Sequences with no key get zero dq; with no query zero dk, dv (check_varlen_grads)."""
    run_backward([5, 0, 9, 40], [0, 7, 3, 0])


def test_varlen_autograd():
    """Through flash_attn_varlen_func and torch.autograd (the path training takes), deterministic on."""
    lens = [300, 17, 513]
    cu = torch.tensor([0, 300, 317, 830], dtype=torch.int32, device=DEV)
    q, k, v, dout = (torch.randn(830, 4, 128, device=DEV, dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flash_attn_varlen_func(*leaves, cu, cu, max(lens), max(lens), causal=True, deterministic=True)
    grads = torch.autograd.grad(out, leaves, dout)
    torch.cuda.synchronize()
    check_varlen_grads(grads, q, k, v, dout, cu.tolist(), cu.tolist(), 128 ** -0.5, True, (-1, -1), 0.0,
                       out=out.detach())


# seqused (tests/varlen_cases.py): lengths 0, whole sequences, one row or key, sq != sk, ragged and whole
# query / key blocks, a sequence whose used rows see no used key
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (False, (100, 20), 10.0), (True, (37, -1), 0.0)])
def test_varlen_backward_through_seqused(causal, window, softcap, d):
    """Rows past a sequence's seqused_q get dq = 0, keys past its seqused_k dk = dv = 0, though q, k, v and
    dout hold NaN there (the kernels zero those rows in smem); the used rows by the rule."""
    run_backward(*SEQUSED[:2], d=d, causal=causal, window=window, softcap=softcap, used_q=SEQUSED[2],
                 used_k=SEQUSED[3])


@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_varlen_backward_seqused_h100_failure(d):
    """The case that failed on the H100 (non-causal, hq 4, hk 2): NaN in dq of sequence 0's rows (it uses
    all 400 keys; its last key block holds sequence 1's unused keys) and in dk, dv of row 500 (sequence
    2's one used key; its last query block, past its 129 used queries, holds sequence 3's unused ones).
    The kernels zero every tile row at or past the sequence's used length when seqused is given, the
    next sequences' rows too (tests/test_runtime_dispatch.py's tile model: TiledVarlenBwd)."""
    run_backward(*SEQUSED[:2], d=d, used_q=SEQUSED[2], used_k=SEQUSED[3])


# SEQUSED_NEXT (tests/varlen_cases.py): one path of a NaN past seqused into a used row a sequence
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (False, (100, 20), 10.0)])
def test_varlen_backward_seqused_nan_of_the_next_sequences_stays_out(causal, window, softcap, d):
    run_backward(*SEQUSED_NEXT[:2], d=d, causal=causal, window=window, softcap=softcap,
                 used_q=SEQUSED_NEXT[2], used_k=SEQUSED_NEXT[3])


@pytest.mark.parametrize("side", ["q", "k"])
def test_varlen_backward_seqused_on_one_side(side):
    """seqused_q alone (every key row data) or seqused_k alone (every query row data)."""
    lens_q, lens_k, used_q, used_k = SEQUSED_NEXT
    run_backward(lens_q, lens_k, causal=True, used_q=used_q if side == "q" else None,
                 used_k=used_k if side == "k" else None)


@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_varlen_backward_through_seqused_deterministic(d):
    run_backward(*SEQUSED[:2], hq=8, hk=2, d=d, causal=True, deterministic=True, used_q=SEQUSED[2],
                 used_k=SEQUSED[3])
    run_backward(*SEQUSED_NEXT[:2], hq=8, hk=2, d=d, deterministic=True, used_q=SEQUSED_NEXT[2],
                 used_k=SEQUSED_NEXT[3])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_backward_through_seqused_gqa_and_dtypes(dtype):
    run_backward([200, 37, 1000], [300, 37, 900], hq=8, hk=1, dtype=dtype, causal=True, used_q=[199, 0, 1000],
                 used_k=[300, 37, 513])


def test_varlen_backward_seqused_equal_to_the_lengths():
    """seqused equal to every sequence's length: the same gradients as without it, bit for bit."""
    lens_q, lens_k = [300, 17, 129], [517, 3, 129]
    with_used = run_backward(lens_q, lens_k, causal=True, deterministic=True, used_q=lens_q, used_k=lens_k,
                             seed=5)
    without = run_backward(lens_q, lens_k, causal=True, deterministic=True, seed=5)
    for name, x, y in zip(("dq", "dk", "dv"), with_used, without, strict=True):
        assert torch.equal(x, y), name


def test_varlen_autograd_through_seqused():
    """flash_attn_varlen_func with seqused and torch.autograd (packed documents with spare capacity)."""
    used = [290, 0, 500]  # of sequences of 300, 17, 513 tokens
    cu = torch.tensor([0, 300, 317, 830], dtype=torch.int32, device=DEV)
    q, k, v, dout = (torch.randn(830, 4, 128, device=DEV, dtype=torch.bfloat16) for _ in range(4))
    for x in (q, k, v, dout):
        x[290:300], x[300:317], x[817:830] = float("nan"), float("nan"), float("nan")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    u = torch.tensor(used, dtype=torch.int32, device=DEV)
    out = flash_attn_varlen_func(*leaves, cu, cu, max(used), max(used), seqused_q=u, seqused_k=u, causal=True)
    grads = torch.autograd.grad(out, leaves, dout)
    torch.cuda.synchronize()
    check_varlen_grads(grads, q, k, v, dout, cu.tolist(), cu.tolist(), 128 ** -0.5, True, (-1, -1), 0.0,
                       out=out.detach(), used_q=used, used_k=used)


# (hdim, dv) = (192, 128): hdim 192's kernel on V and dO padded to 192 columns
@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (False, (100, 20), 10.0), (True, (37, -1), 0.0)])
@pytest.mark.parametrize("packing", range(len(BWD_PACKINGS)))
def test_varlen_backward_split_head_dims(packing, causal, window, softcap):
    run_backward(*BWD_PACKINGS[packing], d=192, dv=128, causal=causal, window=window, softcap=softcap)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_backward_split_head_dims_gqa_deterministic_seqused(dtype):
    run_backward(*SEQUSED[:2], hq=8, hk=2, d=192, dv=128, dtype=dtype, causal=True, deterministic=True)
    run_backward(*SEQUSED[:2], hq=6, hk=1, d=192, dv=128, dtype=dtype, window=(100, 20), used_q=SEQUSED[2],
                 used_k=SEQUSED[3])
