"""The exact reference against a row-by-row float64 formula written independently of it."""

import math

import pytest
import torch

from flashhopper.reference import attention_bwd_ref, attention_ref, visible_mask


def sees(i, j, sq, sk, causal, window):
    """Query i may read key j: the diagonal sits at key i + sk - sq (bottom-right aligned)."""
    diag = i + sk - sq
    left, right = window
    if causal and j > diag:
        return False
    if left >= 0 and j < diag - left:
        return False
    return not (right >= 0 and j > diag + right)


def naive_attention(q, k, v, scale, causal=False, window=(-1, -1), softcap=0.0):
    batch, sq, hq, _ = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros(batch, sq, hq, dv, dtype=torch.float64)
    lse = torch.full((batch, hq, sq), -math.inf, dtype=torch.float64)
    for b in range(batch):
        for h in range(hq):
            kv = h // (hq // hk)
            for i in range(sq):
                keys = [j for j in range(sk) if sees(i, j, sq, sk, causal, window)]
                if not keys:
                    continue
                scores = []
                for j in keys:
                    s = float(q[b, i, h] @ k[b, j, kv]) * scale
                    scores.append(softcap * math.tanh(s / softcap) if softcap else s)
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                for w, j in zip(weights, keys, strict=True):
                    out[b, i, h] += (w / total) * v[b, j, kv]
                lse[b, h, i] = top + math.log(total)
    return out, lse


CASES = [
    dict(sq=17, sk=17),
    dict(sq=13, sk=29, causal=True),
    dict(sq=29, sk=13, causal=True),
    dict(sq=20, sk=31, window=(4, 2)),
    dict(sq=31, sk=20, window=(0, 0)),
    dict(sq=24, sk=24, window=(3, -1)),
    dict(sq=24, sk=19, window=(-1, 2)),
    dict(sq=21, sk=26, causal=True, window=(5, -1)),
    dict(sq=26, sk=21, causal=True, window=(5, 3)),
    dict(sq=15, sk=22, softcap=2.5),
    dict(sq=22, sk=15, softcap=1.0, causal=True, window=(6, -1)),
    dict(sq=18, sk=18, hq=4, hk=2, causal=True),
    dict(sq=12, sk=27, hq=4, hk=1, window=(2, 5)),
    dict(sq=9, sk=14, hq=3, hk=1, hdim_v=24),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_matches_naive(case):
    case = dict(case)
    sq, sk = case.pop("sq"), case.pop("sk")
    hq, hk = case.pop("hq", 2), case.pop("hk", 2)
    hdim, hdim_v = 16, case.pop("hdim_v", 16)
    causal, window = case.pop("causal", False), case.pop("window", (-1, -1))
    softcap = case.pop("softcap", 0.0)
    q = torch.randn(2, sq, hq, hdim)
    k = torch.randn(2, sk, hk, hdim)
    v = torch.randn(2, sk, hk, hdim_v)
    scale = 0.7
    out, lse = attention_ref(q, k, v, scale, causal, window, softcap)
    want_out, want_lse = naive_attention(q, k, v, scale, causal, window, softcap)
    assert out.dtype == torch.float64 and lse.dtype == torch.float32
    assert out.shape == (2, sq, hq, hdim_v) and lse.shape == (2, hq, sq)
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse, want_lse.float(), atol=1e-5, rtol=1e-6)


def test_default_scale_is_inverse_sqrt_headdim():
    q, k, v = torch.randn(1, 7, 2, 32), torch.randn(1, 9, 2, 32), torch.randn(1, 9, 2, 32)
    out, lse = attention_ref(q, k, v)
    want_out, want_lse = naive_attention(q, k, v, 1 / math.sqrt(32))
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse, want_lse.float())


@pytest.mark.parametrize(
    "sq, sk, causal, window, n_empty",
    [(10, 4, True, (-1, -1), 6), (8, 4, False, (1, 0), 4), (9, 5, False, (-1, 0), 4),
     (8, 8, True, (2, -1), 0)],
)
def test_rows_without_keys_are_zero_with_neg_inf_lse(sq, sk, causal, window, n_empty):
    q, k, v = torch.randn(1, sq, 2, 16), torch.randn(1, sk, 2, 16), torch.randn(1, sk, 2, 16)
    out, lse = attention_ref(q, k, v, causal=causal, window_size=window)
    empty = ~visible_mask(sq, sk, causal, window).any(dim=1)
    assert int(empty.sum()) == n_empty
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
    assert torch.isneginf(lse[..., empty]).all()
    assert torch.isfinite(lse[..., ~empty]).all()


def test_fully_masked_rows_have_zero_gradient():
    q, k, v = torch.randn(1, 10, 2, 16), torch.randn(1, 4, 2, 16), torch.randn(1, 4, 2, 16)
    dout = torch.randn(1, 10, 2, 16)
    dq, dk, dv = attention_bwd_ref(q, k, v, dout, causal=True)
    assert not any(torch.isnan(g).any() for g in (dq, dk, dv))
    assert torch.equal(dq[:, :6], torch.zeros_like(dq[:, :6]))


def test_visible_mask_matches_rule():
    for sq, sk, causal, window in [(5, 9, True, (-1, -1)), (9, 5, True, (1, -1)), (7, 7, False, (2, 1))]:
        mask = visible_mask(sq, sk, causal, window)
        want = torch.tensor([[sees(i, j, sq, sk, causal, window) for j in range(sk)] for i in range(sq)])
        assert torch.equal(mask, want)


@pytest.mark.parametrize("kwargs", [dict(), dict(causal=True, window_size=(3, -1), softcap=2.0)])
def test_backward_gradcheck_with_gqa(kwargs):
    q = torch.randn(1, 5, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 6, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 6, 2, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: attention_ref(q, k, v, **kwargs)[0], (q, k, v))
    dout = torch.randn(1, 5, 4, 8, dtype=torch.float64)
    dq, dk, dv = attention_bwd_ref(q, k, v, dout, **kwargs)
    assert dk.shape == k.shape and dv.shape == v.shape and dq.dtype == torch.float64
    # dk/dv are the per-query-head gradients of the repeated K/V, summed over each group of 2
    k_wide = k.detach().repeat_interleave(2, dim=2).requires_grad_()
    v_wide = v.detach().repeat_interleave(2, dim=2).requires_grad_()
    out, _ = attention_ref(q, k_wide, v_wide, **kwargs)
    dk_wide, dv_wide = torch.autograd.grad(out, (k_wide, v_wide), dout)
    torch.testing.assert_close(dk, dk_wide.view(1, 6, 2, 2, 8).sum(dim=3))
    torch.testing.assert_close(dv, dv_wide.view(1, 6, 2, 2, 8).sum(dim=3))


def test_grads_in_dtype_yardstick_is_close_to_exact():
    """The GPU tests' yardstick (PyTorch autograd in the input dtype) agrees with float64."""
    from flashhopper.reference import attention_grads_in_dtype

    gen = torch.Generator().manual_seed(4)
    q, k, v, dout = (torch.randn(1, 19, 4, 32, generator=gen).to(torch.bfloat16) for _ in range(4))
    k, v = k[:, :, :2], v[:, :, :2]
    exact = attention_bwd_ref(q, k, v, dout, 0.2, True, (-1, -1), 3.0)
    yard = attention_grads_in_dtype(q, k, v, dout, 0.2, True, (-1, -1), 3.0)
    for got, want in zip(yard, exact, strict=True):
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        torch.testing.assert_close(got.double(), want, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("causal,window,softcap", [(True, (-1, -1), 3.0), (False, (3, 1), 0.0),
                                                   (False, (-1, -1), 0.0)])
def test_flash_rounding_yardstick(causal, window, softcap):
    """The second yardstick (O, P, dS rounded as a flash backward does): exact in float64, where the
    roundings are no-ops, and close to exact in bf16; rows that see no key give zero gradients."""
    from flashhopper.reference import attention_grads_flash_rounding

    gen = torch.Generator().manual_seed(5)
    q, dout = (torch.randn(2, 19, 4, 32, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 23, 2, 32, generator=gen, dtype=torch.float64) for _ in range(2))
    exact = attention_bwd_ref(q, k, v, dout, 0.2, causal, window, softcap)
    got = attention_grads_flash_rounding(q, k, v, dout, 0.2, causal, window, softcap)
    for g, want in zip(got, exact, strict=True):
        assert g.dtype == torch.float64 and g.shape == want.shape
        torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-5)  # fp32 math inside
    q16, k16, v16, do16 = (t.to(torch.bfloat16) for t in (q, k, v, dout))
    exact = attention_bwd_ref(q16, k16, v16, do16, 0.2, causal, window, softcap)
    for p_rounded in (False, True):  # dS from the fp32 P, or from the rounded one (sdp_by_gemm)
        for g, want in zip(attention_grads_flash_rounding(q16, k16, v16, do16, 0.2, causal, window, softcap,
                                                          p_rounded_in_ds=p_rounded), exact, strict=True):
            assert g.dtype == torch.bfloat16
            torch.testing.assert_close(g.double(), want, atol=5e-2, rtol=5e-2)
    # 5 queries, 2 keys, a window that leaves the first 3 queries with no key (the last sees two)
    q, dout = (torch.randn(1, 5, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 2, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    dq, _, _ = attention_grads_flash_rounding(q, k, v, dout, 0.3, False, (1, 0), 0.0)
    assert torch.equal(dq[:, :3], torch.zeros_like(dq[:, :3])) and dq[:, 4].abs().sum() > 0
