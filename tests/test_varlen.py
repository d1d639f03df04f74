"""flash_attn_varlen_func on the CPU: the float64 reference per packed sequence, and the argument checks."""

from __future__ import annotations

import pytest
import torch

from flashhopper import flash_attn_varlen_func
from flashhopper.reference import attention_ref, attention_varlen_ref

BF16 = torch.bfloat16


def packed(lens_q, lens_k, hq=4, hk=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu = [torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
          for lens in (lens_q, lens_k)]
    q = torch.randn(sum(lens_q), hq, d, generator=g).to(BF16)
    k, v = (torch.randn(sum(lens_k), hk, d, generator=g).to(BF16) for _ in range(2))
    return q, k, v, cu[0], cu[1]


@pytest.mark.parametrize("kwargs", [{}, {"causal": True}, {"window_size": (3, 1)}, {"softcap": 5.0}])
def test_reference_is_attention_per_sequence(kwargs):
    lens_q, lens_k = [5, 0, 17, 3, 1], [7, 4, 17, 0, 9]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 17, return_lse=True, backend="reference",
                                      **kwargs)
    assert out.shape == q.shape and out.dtype == BF16 and lse.shape == (4, sum(lens_q))
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k, strict=True)):
        rows, keys = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        if lq == 0:
            continue
        if lk == 0:  # no key: 0 and -inf (FA3 gives +inf)
            assert (out[rows] == 0).all() and torch.isneginf(lse[:, rows]).all()
            continue
        want, want_lse = attention_ref(q[None, rows], k[None, keys], v[None, keys], **kwargs)
        assert torch.equal(out[rows], want[0].to(BF16)) and torch.equal(lse[:, rows], want_lse[0])


def test_seqused_limits_each_sequence():
    q, k, v, cu_q, cu_k = packed([6, 9], [8, 5])
    used_q, used_k = torch.tensor([4, 9], dtype=torch.int32), torch.tensor([8, 2], dtype=torch.int32)
    out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, used_q, used_k, causal=True)
    want = attention_ref(q[None, 6:15], k[None, 8:10], v[None, 8:10], causal=True)[0][0]
    assert torch.equal(out[6:15], want)
    assert (out[4:6] == 0).all() and torch.isneginf(lse[:, 4:6]).all()  # rows past seqused_q


CONTRACT = [
    ("not from 0", lambda cu: cu + 1, r"cu_seqlens_q = .*must start at 0"),
    ("decreasing", lambda cu: cu.flip(0), r"must start at 0, never decrease"),
]


@pytest.mark.parametrize("bad, pattern", [c[1:] for c in CONTRACT], ids=[c[0] for c in CONTRACT])
def test_reference_checks_the_callers_contract(bad, pattern):
    q, k, v, cu_q, cu_k = packed([3, 4], [3, 4])
    with pytest.raises(ValueError, match=pattern):
        flash_attn_varlen_func(q, k, v, bad(cu_q), cu_k, 4, 4, backend="reference")


def _args(**change):
    q, k, v, cu_q, cu_k = packed([3, 4], [5, 2])
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4, max_seqlen_k=5)
    args.update(change)
    return args


BAD = [
    ("rank 4 q", dict(q=torch.randn(1, 7, 4, 64, dtype=BF16)), ValueError,
     r"q has rank 4.*rank 3, \(total_tokens"),
    ("int64 cu", dict(cu_seqlens_q=torch.tensor([0, 3, 7])), ValueError,
     r"cu_seqlens_q has dtype torch\.int64"),
    ("cu 2-D", dict(cu_seqlens_k=torch.zeros(1, 3, dtype=torch.int32)), ValueError,
     r"cu_seqlens_k has dtype"),
    ("cu lengths", dict(cu_seqlens_k=torch.tensor([0, 7], dtype=torch.int32)), ValueError,
     r"cu_seqlens_q has 3 entries, cu_seqlens_k 2"),
    ("cu not a tensor", dict(cu_seqlens_q=[0, 3, 7]), TypeError, r"cu_seqlens_q must be a torch\.Tensor"),
    ("seqused shape", dict(seqused_q=torch.tensor([3], dtype=torch.int32)), ValueError,
     r"seqused_q must be None or an int32 tensor of shape \(batch,\) = \(2,\)"),
    ("max_seqlen float", dict(max_seqlen_q=4.0), TypeError, r"max_seqlen_q must be a Python int >= 0"),
    ("fp8", {n: torch.randn(7, h, 64).to(torch.float8_e4m3fn) for n, h in (("q", 4), ("k", 2), ("v", 2))},
     TypeError, r"varlen with float8_e4m3fn"),
    ("hdim", dict(q=torch.randn(7, 4, 80, dtype=BF16)), ValueError, r"k has headdim 64 but q has 80"),
]


@pytest.mark.parametrize("change, exc, pattern", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_arguments(change, exc, pattern):
    with pytest.raises(exc, match=pattern):
        flash_attn_varlen_func(**_args(**change), backend="reference")


def test_kernel_path_needs_the_gpu_and_the_opt_in(monkeypatch):
    from flashhopper import validation

    with pytest.raises(RuntimeError, match="Hopper GPU"):
        flash_attn_varlen_func(**_args())
    q, k, v = _args()["q"], _args()["k"], _args()["v"]
    validation.check_varlen_call(q, k, v)
    validation.check_varlen_call(q.requires_grad_(), k, v)  # gradients: the varlen backward
    used = torch.ones(1, dtype=torch.int32)
    validation.check_varlen_call(q.detach(), k, v, seqused_k=used)  # no gradients: the forward
    # the backward through seqused as it was before its GPU run (verified since): refused without the opt-in
    monkeypatch.setattr(validation, "SEQUSED_BWD_GPU_VERIFIED", False)
    monkeypatch.delenv(validation.SEQUSED_BWD_OPT_IN, raising=False)
    with pytest.raises(NotImplementedError, match=validation.SEQUSED_BWD_OPT_IN):
        validation.check_varlen_call(q, k, v, seqused_k=used)
    monkeypatch.setenv(validation.SEQUSED_BWD_OPT_IN, "1")
    validation.check_varlen_call(q, k, v, seqused_q=used, seqused_k=used)


@pytest.mark.parametrize("d,dv", [(64, 64), (192, 128)])
@pytest.mark.parametrize("kwargs", [{}, {"causal": True}, {"window_size": (3, 1), "softcap": 5.0}])
def test_reference_backward_through_seqused(kwargs, d, dv):
    """backend="reference" differentiates through seqused (the semantics the GPU tests hold the kernels
    to): rows past a sequence's seqused_q get dq = 0 and keys past its seqused_k dk = dv = 0, whatever
    q, k, v and dout hold there (NaN here); the used rows get the sequence's own gradients. Used
    lengths 0 and whole sequences, sq != sk, GQA, head dims (192, 128) too."""
    from flashhopper.reference import attention_bwd_ref

    lens_q, lens_k = [6, 9, 4, 5, 7], [8, 5, 3, 7, 6]
    used_q, used_k = [4, 9, 0, 5, 3], [8, 2, 3, 0, 6]
    q, k, _, cu_q, cu_k = packed(lens_q, lens_k, d=d)
    v = torch.randn(sum(lens_k), 2, dv).to(BF16)
    dout = torch.randn(sum(lens_q), 4, dv).to(BF16)
    past_q = [r for i, n in enumerate(used_q) for r in range(int(cu_q[i]) + n, int(cu_q[i + 1]))]
    past_k = [r for i, n in enumerate(used_k) for r in range(int(cu_k[i]) + n, int(cu_k[i + 1]))]
    for x, rows in ((q, past_q), (k, past_k), (v, past_k), (dout, past_q)):
        x[rows] = float("nan")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    used = {"seqused_q": torch.tensor(used_q, dtype=torch.int32),
            "seqused_k": torch.tensor(used_k, dtype=torch.int32)}
    out = flash_attn_varlen_func(*leaves, cu_q, cu_k, 9, 8, backend="reference", **used, **kwargs)
    dq, dk, dv_ = torch.autograd.grad(out, leaves, dout)
    assert (dq[past_q] == 0).all() and (dk[past_k] == 0).all() and (dv_[past_k] == 0).all()
    for i in range(len(lens_q)):
        rows = slice(int(cu_q[i]), int(cu_q[i]) + used_q[i])
        keys = slice(int(cu_k[i]), int(cu_k[i]) + used_k[i])
        if not used_q[i] or not used_k[i]:
            assert (dq[rows] == 0).all() and (dk[keys] == 0).all() and (dv_[keys] == 0).all()
            continue
        want = attention_bwd_ref(q[None, rows], k[None, keys], v[None, keys], dout[None, rows], **kwargs)
        for got, exact in zip((dq[rows], dk[keys], dv_[keys]), want, strict=True):
            assert torch.equal(got, exact[0].to(BF16))


def test_the_varlen_rule_passes_the_reference_and_fails_a_row_written_past_seqused():
    from flashhopper.accuracy import check_varlen_forward

    q, k, v, cu_q, cu_k = packed([6, 9, 4], [8, 5, 3])
    used_q, used_k = [4, 9, 4], [8, 5, 0]
    used = (torch.tensor(used_q), torch.tensor(used_k))
    out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, *used, causal=True)
    out, lse = out.to(BF16), lse.clone()
    out[4:6], lse[:, 4:6] = float("nan"), float("nan")  # rows past seqused_q, poisoned and never written
    check_varlen_forward(out, lse, q, k, v, cu_q, cu_k, used_q, used_k, 64 ** -0.5, True, (-1, -1), 0.0)
    out[5] = 0.0
    with pytest.raises(AssertionError, match="sequence 0: rows past seqused"):
        check_varlen_forward(out, lse, q, k, v, cu_q, cu_k, used_q, used_k, 64 ** -0.5, True, (-1, -1), 0.0)
