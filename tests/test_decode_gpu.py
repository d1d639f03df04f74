"""Decode on the 1-warpgroup tile (plan.fwd_config_decode) on the GPU, opted in by
FLASHHOPPER_EXPERIMENTAL_DECODE_TILE=1: flash_attn_with_kvcache with one query token, each item by the
rule of flashhopper/accuracy.py against the float64 reference over its keys, unused cache slots NaN
(they must stay out), every call checked to have run the decode tile.

Experimental until it has passed here on a GPU (validation.DECODE_TILE_GPU_VERIFIED): run with
FH_TEST_EXPERIMENTAL=1."""

from __future__ import annotations

import math

import pytest
import torch
from launched import record_launches

from flashhopper import flash_attn_with_kvcache, validation
from flashhopper.accuracy import check_forward

pytestmark = [pytest.mark.gpu, pytest.mark.experimental]

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs an sm_90 (Hopper) GPU", allow_module_level=True)

DEV = "cuda"
# keys each item sees: one, one block short of 128, one past 4096 (a last block of one key)
CONTEXTS = [1, 127, 4097]


@pytest.fixture(autouse=True)
def _decode_tile(monkeypatch):
    """The decode tile's opt-in, and every forward config launched."""
    monkeypatch.setenv(validation.DECODE_TILE_OPT_IN, "1")
    return record_launches(monkeypatch)


def _decode(launched, d, hq, hk, splits, softcap=0.0, dtype=torch.bfloat16, s_new=0, seed=0):
    torch.manual_seed(seed)
    b, s_cache = len(CONTEXTS), max(CONTEXTS) + 3
    k_cache, v_cache = (torch.randn(b, s_cache, hk, d, device=DEV, dtype=dtype) for _ in range(2))
    lens = [n - s_new for n in CONTEXTS]
    for i, n in enumerate(CONTEXTS):  # slots past the item's keys: NaN
        k_cache[i, n:] = float("nan")
        v_cache[i, n:] = float("nan")
    q = torch.randn(b, 1, hq, d, device=DEV, dtype=dtype)
    k = v = None
    if s_new:
        k, v = (torch.randn(b, s_new, hk, d, device=DEV, dtype=dtype) for _ in range(2))
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=DEV),
        causal=True, softcap=softcap, num_splits=splits, return_lse=True)
    torch.cuda.synchronize()
    cfg = launched[-1]
    assert (cfg.tile_m, cfg.num_consumer_wg, cfg.pingpong) == (64, 1, False), cfg
    for i, n in enumerate(CONTEXTS):
        check_forward(out[i:i + 1], lse[i:i + 1], q[i:i + 1], k_cache[i:i + 1, :n], v_cache[i:i + 1, :n],
                      1 / math.sqrt(d), True, (-1, -1), softcap)


# splits: none, chosen (wave efficiency: 3 items x hk CTAs), 5; GQA 1 (rows not packed), 4, 8. GQA 1
# without a split is not rearranged (the varlen tile), so not a case of the decode tile
_TILE_CASES = [(hq, hk, splits) for splits in (1, 0, 5) for hq, hk in ((8, 8), (32, 8), (16, 2))
               if hq != hk or splits != 1]


@pytest.mark.parametrize("hq,hk,splits", _TILE_CASES)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_decode_tile(_decode_tile, d, hq, hk, splits):
    _decode(_decode_tile, d, hq, hk, splits)


@pytest.mark.parametrize("d", [96, 192])
def test_decode_tile_other_head_dims(_decode_tile, d):
    _decode(_decode_tile, d, 32, 8, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_decode_tile_softcap_dtypes_and_append(_decode_tile, d, dtype):
    _decode(_decode_tile, d, 32, 8, 0, softcap=8.0, dtype=dtype, s_new=1, seed=1)
