"""The transformers attention function (flashhopper.integrations.transformers.attention_forward) on
the H200 kernels with the tensors a Llama layer hands it (transformers itself is not carried to the
GPU machine: its wheel does not fit the 64 MiB that travel with the checkout beside the DSL bundle).
Each sequence's output and gradients by the rule of flashhopper/accuracy.py, for a batch without
padding, a left-padded batch with its 2-D mask, and packed sequences (a flattening collator's
cu_seq_lens, or its position_ids alone); then one SGD step of a projection feeding the queries, against
the float64 one."""

from __future__ import annotations

import types

import pytest
import torch

from flashhopper.accuracy import check_grads, check_output, emulate_forward
from flashhopper.integrations.transformers import attention_forward
from flashhopper.reference import attention_ref

pytestmark = pytest.mark.gpu

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)

DEV = "cuda"
MODULE = types.SimpleNamespace(is_causal=True, config=types.SimpleNamespace(dtype=torch.bfloat16))




def _check_sequence(out, grads, q, k, v, dout, rows_q, rows_k, scale, window):
    """One sequence (its rows of the (B, S, H, D) tensors) by the rule: out and (dq, dk, dv)."""
    qs, ks, vs, ds = (t[None, r] for t, r in ((q, rows_q), (k, rows_k), (v, rows_k), (dout, rows_q)))
    ref = attention_ref(qs, ks, vs, scale, True, window)[0]
    emu = emulate_forward(qs, ks, vs, scale, True, window, 0.0)[0]
    o = out[None, rows_q]
    check_output("out", o, ref, emu)
    check_grads(tuple(g[None, r] for g, r in zip(grads, (rows_q, rows_k, rows_k), strict=True)), qs, ks, vs,
                ds, scale, True, window, 0.0, out=o)


@pytest.mark.parametrize("window", [None, 48])
@pytest.mark.parametrize("kind", ["dense", "left_padded", "packed", "packed_positions"])
def test_llama_layer_tensors(kind, window):
    torch.manual_seed(0)
    b, s, hq, hk, d = (1, 300, 4, 2, 64) if kind.startswith("packed") else (3, 200, 4, 2, 64)
    scale = d ** -0.5
    q, k, v, dout = (torch.randn(b, s, h, d, device=DEV, dtype=torch.bfloat16) for h in (hq, hk, hk, hq))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kw = dict(scaling=scale, sliding_window=window)
    mask, seqs = None, []
    if kind == "left_padded":
        lens = [200, 137, 1]
        mask = torch.zeros(b, s, dtype=torch.long, device=DEV)
        for i, n in enumerate(lens):
            mask[i, s - n:] = 1
            seqs.append((i, slice(s - n, s)))
    elif kind == "packed":
        lens = [120, 1, 179]
        cu = torch.tensor([0, 120, 121, 300], dtype=torch.int32, device=DEV)
        kw.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=179, max_length_k=179)
        seqs = [(0, slice(int(cu[i]), int(cu[i + 1]))) for i in range(3)]
    elif kind == "packed_positions":  # the collator's default: position_ids alone mark the sequences
        lens = [120, 1, 179]
        kw.update(position_ids=torch.cat([torch.arange(n, device=DEV) for n in lens])[None])
        seqs = [(0, slice(0, 120)), (0, slice(120, 121)), (0, slice(121, 300))]
    else:
        seqs = [(i, slice(0, s)) for i in range(b)]
    # transformers' layout: (B, H, S, D), the KV heads not repeated
    out, _ = attention_forward(MODULE, *(t.transpose(1, 2) for t in leaves), mask, **kw)
    grads = torch.autograd.grad(out, leaves, dout)
    torch.cuda.synchronize()
    win = (window - 1, window - 1) if window else (-1, -1)
    for i, rows in seqs:
        _check_sequence(out[i].detach(), tuple(g[i] for g in grads), q[i], k[i], v[i], dout[i], rows, rows,
                        scale, win)
    if kind == "left_padded":  # padding rows: output 0, no gradient
        assert (out[1, : s - 137] == 0).all() and (grads[0][1, : s - 137] == 0).all()


def test_one_sgd_step_through_the_kernels():
    """A projection W feeding the queries, one SGD step through our attention, W against the step taken
    through the float64 reference on the same bf16 inputs: within the kernels' bf16 rounding."""
    torch.manual_seed(1)
    b, s, h, d = 2, 256, 4, 64
    x = torch.randn(b, s, d, device=DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(b, h, s, d, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    w0 = torch.randn(d, h * d, device=DEV) * d ** -0.5
    steps = []
    for backend in ("auto", "reference"):
        w = w0.clone().requires_grad_()
        q = (x.float() @ w).view(b, s, h, d).transpose(1, 2)
        # fp32 queries: the function casts them to the model's bf16 (and its output back) either way
        out, _ = attention_forward(MODULE, q, k, v, None, scaling=d ** -0.5, backend=backend)
        out.float().square().mean().backward()
        with torch.no_grad():
            w -= 0.1 * w.grad
        steps.append(w.detach())
    moved = (steps[1] - w0).abs().max().item()
    assert moved > 0 and (steps[0] - steps[1]).abs().max().item() <= 0.05 * moved
