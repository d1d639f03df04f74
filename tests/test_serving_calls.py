"""SGLang's and vLLM's calls (tests/serving_calls.py) on the CPU through the reference backend: each
sequence's output equals exact attention of its queries over its keys in order (causal bottom-right)."""

from __future__ import annotations

import functools

import pytest
import serving_calls
import torch

from flashhopper import flash_attn_interface as fa3
from flashhopper import kvcache
from flashhopper.integrations import vllm
from flashhopper.reference import attention_ref


@pytest.fixture(autouse=True)
def _reference(monkeypatch):
    ref = functools.partial(kvcache.flash_attn_with_kvcache, backend="reference")
    monkeypatch.setattr(fa3, "_attn_kvcache", ref)
    monkeypatch.setattr(vllm, "_attn_kvcache", ref)


CASES = {  # (page size, lens_k, lens_q): decode; chunked prefill with a decode beside it
    "sglang decode": (1, [37, 300, 1], [1, 1, 1]),
    "sglang extend": (1, [37, 300, 5], [37, 20, 5]),
    "vllm decode": (16, [37, 300, 16], [1, 1, 1]),
    "vllm mixed": (16, [37, 300, 17], [37, 1, 9]),
}


@pytest.mark.parametrize("window,softcap", [((-1, -1), 0.0), ((63, 0), 0.0), ((-1, -1), 30.0)])
@pytest.mark.parametrize("name", list(CASES))
def test_serving_call(name, window, softcap):
    page, lens_k, lens_q = CASES[name]
    q, kc, vc, table, seq_lens, cu_q, per_seq = serving_calls.paged_batch(page_size=page, lens_k=lens_k,
                                                                          lens_q=lens_q, hq=4, hk=2, d=64)
    if name.startswith("sglang"):
        out, lse = serving_calls.sglang_call(fa3, q, kc, vc, table, seq_lens, cu_q, max(lens_q), window,
                                             softcap)
        assert lse.shape == (4, sum(lens_q))
    else:
        out = serving_calls.vllm_call(vllm, q, kc, vc, table, seq_lens, cu_q, max(lens_q), window, softcap)
    for i, (qs, ks, vs) in enumerate(per_seq):
        want = attention_ref(qs[None], ks[None], vs[None], 64 ** -0.5, True, window, softcap)[0][0]
        rows = slice(int(cu_q[i]), int(cu_q[i + 1]))
        torch.testing.assert_close(out[rows], want.to(out.dtype), rtol=0, atol=0)


def test_vllm_refuses_what_flashhopper_lacks():
    q, kc, vc, table, seq_lens, cu_q, _ = serving_calls.paged_batch(page_size=16, lens_k=[5], lens_q=[1])
    with pytest.raises(NotImplementedError, match="s_aux"):
        vllm.flash_attn_varlen_func(q, kc, vc, 1, cu_q, 5, seqused_k=seq_lens, block_table=table,
                                    s_aux=torch.zeros(8))
    with pytest.raises(ValueError, match="seqused_k"):
        vllm.flash_attn_varlen_func(q, kc, vc, 1, cu_q, 5, block_table=table)


def test_varlen_func_takes_a_page_table_and_out():
    """flashhopper.flash_attn_varlen_func(page_table=, seqused_k=, out=): vLLM's path in our names."""
    from flashhopper import flash_attn_varlen_func

    q, kc, vc, table, seq_lens, cu_q, per_seq = serving_calls.paged_batch(page_size=16, lens_k=[37, 300, 17],
                                                                          lens_q=[37, 1, 9], hq=4, hk=2, d=64)
    out = torch.full_like(q, float("nan"))
    got, lse = flash_attn_varlen_func(q, kc, vc, cu_q, None, 37, 300, seqused_k=seq_lens, page_table=table,
                                      causal=True, out=out, return_lse=True, backend="reference")
    assert got is out and lse.shape == (4, q.shape[0])
    for i, (qs, ks, vs) in enumerate(per_seq):
        want = attention_ref(qs[None], ks[None], vs[None], 64 ** -0.5, True)[0][0]
        torch.testing.assert_close(out[int(cu_q[i]):int(cu_q[i + 1])], want.to(out.dtype), rtol=0, atol=0)
    with pytest.raises(ValueError, match="needs seqused_k"):
        flash_attn_varlen_func(q, kc, vc, cu_q, None, 37, 300, page_table=table, backend="reference")
