"""flash_attn_varlen_func's forward against the float64 reference, sequence by sequence, by the rule of
flashhopper/accuracy.py; out and LSE start as NaN, so a row no tile wrote shows, and rows past a
sequence's seqused_q must still be NaN afterwards (no tile writes outside its sequence).
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from flashhopper.accuracy import check_forward, check_varlen_forward
from flashhopper.validation import VARLEN_OPT_IN

pytestmark = pytest.mark.gpu

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)

from flashhopper.hopper import forward_varlen  # noqa: E402

DEV = "cuda"


@pytest.fixture(autouse=True)
def _varlen_opt_in(monkeypatch):
    monkeypatch.setenv(VARLEN_OPT_IN, "1")


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
