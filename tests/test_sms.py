"""The SM margin (flashhopper/sms.py, FA3's sm_margin): the persistent forward grids and the split-KV plans
fill the SM count less the margin, set for a block of calls; FA3's entry points and ring attention pass
theirs on; bad margins are refused by name."""

from __future__ import annotations

import threading

import pytest
import torch
from test_runtime_dispatch import _recorder, _tensors

import flashhopper
from flashhopper import config, distributed, flash_attn_interface, sms, splitkv
from flashhopper.hopper import runtime


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8", None])
def test_bad_margins_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="sm_margin must be an int >= 0"):
        with sms.sm_margin(bad):
            pass
    with pytest.raises(ValueError, match="sm_margin must be an int >= 0"):
        flash_attn_interface.get_scheduler_metadata(1, 1, 8, 4, 4, 64, torch.zeros(1, dtype=torch.int32),
                                                    sm_margin=bad)


def test_the_margin_holds_inside_its_block_only():
    assert flashhopper.sm_margin is sms.sm_margin and sms.current_margin() == 0
    with sms.sm_margin(8):
        assert sms.available(132) == 124
        with sms.sm_margin(200):
            assert sms.available(132) == 1  # never below one SM
        assert sms.current_margin() == 8
        seen = []
        worker = threading.Thread(target=lambda: seen.append(sms.current_margin()))
        worker.start()
        worker.join()
        assert seen == [0]  # another thread keeps its own
    with pytest.raises(RuntimeError), sms.sm_margin(4):
        raise RuntimeError
    assert sms.current_margin() == 0


def test_persistent_forward_grids_leave_the_margin(monkeypatch):
    launches = []
    monkeypatch.setattr(runtime, "get_kernel", _recorder(launches))
    monkeypatch.setattr(runtime, "_tile_counter", lambda device, capturing=None: None)
    monkeypatch.setattr(runtime, "_sm_count", lambda index: 132)
    q, k, v = _tensors(4, 8192, 8192, 16, 16, 128)
    grids = {}
    for margin in (0, 20):
        with sms.sm_margin(margin):
            runtime.forward(q, k, v, 0.1, True, (-1, -1), 0.0)
        cfg, args = launches.pop()
        assert cfg.persistent
        grids[margin] = args[10]
        assert grids[margin] == config.fwd_grid(cfg, 8192, 16 * 4, 132 - margin)
    assert grids == {0: 132, 20: 112}


def test_split_plans_fill_the_sms_less_the_margin(monkeypatch):
    monkeypatch.setattr(splitkv, "_sm_count", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    q = torch.zeros(1, 1, 32, 128)
    plans = {}
    for margin in (0, 66):
        with sms.sm_margin(margin):
            assert splitkv._planned_sms(q) == 132 - margin
            plans[margin] = splitkv.plan_for(q, 8, 131072, (-1, -1), 0, None, False)
        want = splitkv.plan(batch=1, seqlen_q=1, heads_q=32, heads_k=8, capacity=131072, window=(-1, -1),
                            num_splits=0, pack_gqa=None, sms=132 - margin)
        assert plans[margin] == want
    assert plans[0].splits > plans[66].splits  # half the SMs: fewer splits to fill them


def test_fa3_entry_points_and_ring_attention_pass_their_margin(monkeypatch):
    seen = []

    def recording(*args, **kwargs):
        seen.append(sms.current_margin())
        return torch.zeros(1)

    for name in ("_attn", "_attn_varlen", "_attn_kvcache"):
        monkeypatch.setattr(flash_attn_interface, name, recording)
    x = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    flash_attn_interface.flash_attn_func(x, x, x, sm_margin=3)
    flash_attn_interface.flash_attn_varlen_func(x[0], x[0], x[0], cu, cu, 4, 4, sm_margin=5)
    flash_attn_interface.flash_attn_with_kvcache(x, x, x, cache_seqlens=cu[1:], sm_margin=7)
    assert seen == [3, 5, 7] and sms.current_margin() == 0
    with pytest.raises(ValueError, match="sm_margin"):
        flash_attn_interface.flash_attn_func(x, x, x, sm_margin=-2)

    monkeypatch.setattr(distributed, "flash_attn_func", lambda *args, **kwargs: recording())
    pair = distributed._Pair(q_rows=slice(0, 4), k_rows=slice(0, 4), causal=False, window=(-1, -1))
    cfg = distributed._Config(group=None, layout="zigzag", scale=0.1, causal=False, window=(-1, -1),
                              softcap=0.0, deterministic=False, backend="auto", sm_margin=9)
    distributed._step_forward(x, x, x, pair, cfg)
    assert seen[-1] == 9 and sms.current_margin() == 0
