"""flash_attn_func's inference calls that are a decode (kvcache.dense_decode) on the GPU: by the split kernel
and the merge kernel (each launch recorded), out and LSE by the rule of flashhopper/accuracy.py, outputs and
partials NaN before the call (runtime.poison); k and v contiguous or a transformers cache's (b, hk, s_k, d)
memory seen as (b, s_k, hk, d); CUDA graph replay.

The kernels: `flashhopper precompile --decode`, or compiled on first use."""

from __future__ import annotations

import pytest
import torch
from launched import record_split_launches

from flashhopper import flash_attn_func
from flashhopper.accuracy import check_forward

pytestmark = pytest.mark.gpu

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)

DEV = "cuda"


def _inputs(b, s, hq, hk, sk, d, dtype, heads_major, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, device=DEV, generator=g).to(dtype)  # noqa: E731
    q = rand(b, s, hq, d)
    if heads_major:  # transformers' cache layout, transposed as its attention functions pass it
        k, v = (rand(b, hk, sk, d).transpose(1, 2) for _ in range(2))
    else:
        k, v = rand(b, sk, hk, d), rand(b, sk, hk, d)
    return q, k, v


@pytest.mark.parametrize("heads_major", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,s,hq,hk,sk,d,causal,softcap", [
    (1, 1, 32, 8, 8191, 128, True, 0.0),  # PackGQA and 16 splits
    (4, 1, 16, 16, 3001, 64, False, 0.0),  # the split alone
    (2, 1, 8, 1, 129, 256, True, 30.0),  # MQA, softcap, a key block and one key
    (3, 4, 32, 8, 2049, 128, True, 0.0),  # four tokens packed per KV head, causal in the kernel
    (2, 16, 8, 2, 5, 64, True, 0.0),  # more tokens than keys: the first ones see none
    (1, 3, 12, 4, 700, 96, False, 0.0),  # three tokens, every key seen
])
def test_dense_decode(monkeypatch, heads_major, dtype, b, s, hq, hk, sk, d, causal, softcap):
    kernels, splits = record_split_launches(monkeypatch)
    q, k, v = _inputs(b, s, hq, hk, sk, d, dtype, heads_major)
    out, lse = flash_attn_func(q, k, v, causal=causal, softcap=softcap, return_lse=True)
    torch.cuda.synchronize()
    assert len(splits) == 1 and all(cfg.split_kv for cfg in kernels if hasattr(cfg, "split_kv")), kernels
    check_forward(out, lse, q, k, v, d ** -0.5, causal, (-1, -1), softcap)


def test_dense_decode_graph_replay(monkeypatch):
    """Captured once, replayed on new values of q, k, v: each replay by the rule."""
    kernels, splits = record_split_launches(monkeypatch)
    q, k, v = _inputs(2, 1, 32, 8, 4000, 128, torch.bfloat16, True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        flash_attn_func(q, k, v, causal=True)  # compiled and warmed outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    for seed in (1, 2):
        q2, k2, v2 = _inputs(2, 1, 32, 8, 4000, 128, torch.bfloat16, True, seed=seed)
        for t, new in ((q, q2), (k, k2), (v, v2)):
            t.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        check_forward(out, lse, q, k, v, 128 ** -0.5, True, (-1, -1), 0.0)
    assert splits and all(n > 1 for n in splits)


@pytest.mark.parametrize("s", [1, 4])
def test_transformers_left_padded_decode(monkeypatch, s):
    """The transformers integration's decode step over a left-padded batch (a transformers cache's layout,
    the padding as cache_leftpad): the split kernel, each row by the rule against its own keys."""
    from types import SimpleNamespace

    from flashhopper.integrations.transformers import attention_forward

    kernels, splits = record_split_launches(monkeypatch)
    b, hq, hk, sk, d = 3, 32, 8, 3000, 128
    g = torch.Generator(device=DEV).manual_seed(4)
    query = torch.randn(b, hq, s, d, device=DEV, generator=g).to(torch.bfloat16)
    key, value = (torch.randn(b, hk, sk, d, device=DEV, generator=g).to(torch.bfloat16) for _ in range(2))
    valid = [3000, 2049, 5]
    mask = torch.stack([torch.arange(sk, device=DEV) >= sk - n for n in valid]).long()
    out, _ = attention_forward(SimpleNamespace(is_causal=True), query, key, value, mask)
    torch.cuda.synchronize()
    assert len(splits) == 1
    for i, n in enumerate(valid):
        q, k, v = (t[i:i + 1].transpose(1, 2) for t in (query, key[:, :, sk - n:], value[:, :, sk - n:]))
        check_forward(out[i:i + 1], None, q, k, v, d ** -0.5, True, (-1, -1), 0.0)
