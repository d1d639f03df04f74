"""SGLang's and vLLM's calls (tests/serving_calls.py) on the H200 kernels: each sequence by the rule
of flashhopper/accuracy.py against its keys in order; cache slots no sequence uses hold NaN."""

from __future__ import annotations

import pytest
import serving_calls
import torch

from flashhopper import flash_attn_interface as fa3
from flashhopper.accuracy import check_forward, check_output, emulate_forward
from flashhopper.integrations import vllm
from flashhopper.reference import attention_ref

pytestmark = pytest.mark.gpu

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)




CASES = {  # (page size, lens_k, lens_q)
    "sglang decode": (1, [37, 3000, 1, 700], [1, 1, 1, 1]),
    "sglang extend": (1, [37, 3000, 5], [37, 200, 5]),
    "vllm decode": (16, [37, 3000, 16, 700], [1, 1, 1, 1]),
    "vllm mixed": (16, [37, 3000, 17], [37, 1, 9]),
    "vllm speculative": (16, [37, 3000, 16, 700], [4, 4, 4, 4]),  # the same tokens an item: packed rows
}


@pytest.mark.parametrize("window,softcap", [((-1, -1), 0.0), ((255, 0), 0.0), ((-1, -1), 30.0)])
@pytest.mark.parametrize("name", list(CASES))
def test_serving_call(name, window, softcap):
    page, lens_k, lens_q = CASES[name]
    q, kc, vc, table, seq_lens, cu_q, per_seq = serving_calls.paged_batch(
        page_size=page, lens_k=lens_k, lens_q=lens_q, hq=32, hk=8, d=128, device="cuda")
    if name.startswith("sglang"):
        out, lse = serving_calls.sglang_call(fa3, q, kc, vc, table, seq_lens, cu_q, max(lens_q), window,
                                             softcap)
    else:
        out = serving_calls.vllm_call(vllm, q, kc, vc, table, seq_lens, cu_q, max(lens_q), window, softcap)
        lse = None
    torch.cuda.synchronize()
    scale = 128 ** -0.5
    for i, (qs, ks, vs) in enumerate(per_seq):
        rows = slice(int(cu_q[i]), int(cu_q[i + 1]))
        if lse is not None:
            check_forward(out[None, rows], lse[None, :, rows], qs[None], ks[None], vs[None], scale, True,
                          window, softcap)
        else:  # vLLM asks for no LSE: the output alone by the rule
            ref = attention_ref(qs[None], ks[None], vs[None], scale, True, window, softcap)[0]
            emu = emulate_forward(qs[None], ks[None], vs[None], scale, True, window, softcap)[0]
            check_output("out", out[None, rows], ref, emu, softcap)
