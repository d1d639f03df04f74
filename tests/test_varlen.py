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
    monkeypatch.delenv(validation.VARLEN_OPT_IN, raising=False)
    if not validation.VARLEN_GPU_VERIFIED:
        with pytest.raises(NotImplementedError, match=validation.VARLEN_OPT_IN):
            validation.check_varlen_call(q, k, v)
    monkeypatch.setenv(validation.VARLEN_OPT_IN, "1")
    validation.check_varlen_call(q, k, v)
    validation.check_varlen_call(q.requires_grad_(), k, v)  # gradients: the varlen backward
    with pytest.raises(NotImplementedError, match="seqused"):
        validation.check_varlen_call(q, k, v, seqused_k=torch.ones(1, dtype=torch.int32))


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
