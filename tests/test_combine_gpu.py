"""Split-KV decode's merge kernel (hopper/combine.py) on the GPU against splitkv.merge_by_lse in float64:
random partials and LSEs with splits of no key (-inf) and rows of no key in any split, 1 to 64 splits,
every value head dim, the unpacking views kvcache writes through, outputs poisoned with NaN first (an
element the kernel misses shows); and flash_attn_with_kvcache's split decode with the kernel (the
default: validation.DECODE_MERGE_GPU_VERIFIED) against the torch merge, eager and in a CUDA graph. The
kernels: `flashhopper precompile --decode`."""

from __future__ import annotations

import pytest
import torch

from flashhopper import flash_attn_with_kvcache, splitkv, validation
from flashhopper.hopper import combine_config, combine_splits

pytestmark = pytest.mark.gpu

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)

DEV = "cuda"


def _merge(batch, splits, rows, heads, dv, dtype, out_dtype, seed=0):
    """(kernel's out, kernel's lse, float64 out, float64 lse) for random partials in kvcache's layout."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    n = batch * splits * rows
    o = torch.randn(n, heads, dv, generator=g, device=DEV).to(dtype)
    lse = torch.randn(heads, n, generator=g, device=DEV) * 20
    lse[torch.rand(lse.shape, generator=g, device=DEV) < 0.3] = float("-inf")  # splits of no key
    o5 = o.view(batch, splits, rows, heads, dv)
    lse4 = lse.view(heads, batch, splits, rows).permute(1, 2, 3, 0)
    lse4[:, :, 0, 0] = float("-inf")  # a row with no key in any split
    o5[:, :, 0, 0] = float("nan")  # its partials garbage: weighed 0, never read into the sum
    out = torch.full((batch, 1, heads * rows, dv), float("nan"), dtype=out_dtype, device=DEV)
    lse_out = torch.full((batch, heads * rows, 1), float("nan"), device=DEV)
    out_rows = out[:, 0].unflatten(1, (heads, rows)).transpose(1, 2)
    lse_rows = lse_out[..., 0].unflatten(1, (heads, rows)).transpose(1, 2)
    cfg = combine_config(o5, out_rows, splits)
    assert cfg is not None
    combine_splits(cfg, o5, lse4, out_rows, lse_rows)
    want, want_lse = splitkv.merge_by_lse(torch.nan_to_num(o5.double()), lse4.double(), dim=1)
    return out_rows, lse_rows, want, want_lse


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 16, 33, 64])
@pytest.mark.parametrize("dv", [64, 96, 128, 192, 256])
def test_merge_kernel_equals_merge_by_lse(splits, dv):
    out, lse, want, want_lse = _merge(2, splits, 4, 8, dv, torch.bfloat16, torch.bfloat16, seed=splits)
    torch.testing.assert_close(out.double(), want.to(torch.bfloat16).double(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    assert (out[:, 0, 0] == 0).all() and torch.isneginf(lse[:, 0, 0]).all()


# fp16 is what kvcache launches; fp32 partials or outputs no caller is dispatched (variants: gpu-test-full)
_VARIANT = pytest.mark.variant


@pytest.mark.parametrize("dtype,out_dtype", [
    (torch.float16, torch.float16), pytest.param(torch.bfloat16, torch.float32, marks=_VARIANT),
    pytest.param(torch.float32, torch.float32, marks=_VARIANT),
    pytest.param(torch.float32, torch.bfloat16, marks=_VARIANT)])
def test_merge_kernel_dtypes(dtype, out_dtype):
    out, lse, want, want_lse = _merge(3, 13, 1, 32, 128, dtype, out_dtype, seed=1)
    tol = 1e-5 if out_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), want.to(out_dtype).double(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


def _decode_call(merged, graph=False, **hints):
    """flash_attn_with_kvcache at 2 items x 8k, 32 query heads over 8 KV heads, the merge kernel or not."""
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(2, 1, 32, 128, generator=g, device=DEV).to(torch.bfloat16)
    k, v = (torch.randn(2, 8192, 8, 128, generator=g, device=DEV).to(torch.bfloat16) for _ in range(2))
    lens = torch.tensor([8000, 300], dtype=torch.int32, device=DEV)

    def call():
        return flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, return_lse=True, **hints)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(validation, "DECODE_MERGE_GPU_VERIFIED", merged)
        mp.delenv(validation.DECODE_MERGE_OPT_IN, raising=False)
        if not graph:
            return call()
        call()  # compiled and loaded before the capture
        graph_ = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph_):
            got = call()
        graph_.replay()
        torch.cuda.synchronize()
        return got


@pytest.mark.parametrize("hints", [{}, {"num_splits": 7}, {"num_splits": 1},
                                   {"num_splits": 3, "pack_gqa": False}], ids=repr)
def test_kvcache_decode_with_the_merge_kernel(hints):
    (want, want_lse), (out, lse) = _decode_call(False, **hints), _decode_call(True, **hints)
    torch.testing.assert_close(out.float(), want.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_kvcache_decode_with_the_merge_kernel_in_a_cuda_graph():
    (want, want_lse), (out, lse) = _decode_call(False), _decode_call(True, graph=True)
    torch.testing.assert_close(out.float(), want.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
