"""runtime.forward / runtime.backward on CPU with the compiled kernels replaced by recorders: the launch
arguments (config, window, grid) follow the dispatch functions for every shape and flag, through the
per-call dispatch caches (runtime._fwd_plan, _bwd_plan), and overrides are never served stale."""

from __future__ import annotations

import math

import pytest
import torch
from varlen_cases import SEQUSED, SEQUSED_NEXT

from flashhopper import config, plan
from flashhopper.hopper import runtime

SHAPES = [(1, 1), (17, 17), (128, 128), (1000, 333), (333, 1000), (4097, 4097), (512, 1024), (16384, 16384),
          (1024, 16384)]
MASKS = [(False, (-1, -1)), (True, (-1, -1)), (False, [256, 0]), (True, (100, -1)), (False, (-1, 7))]


@pytest.fixture
def fwd_launches(monkeypatch):
    launches = []
    monkeypatch.setattr(runtime, "get_kernel", _recorder(launches))
    monkeypatch.setattr(runtime, "_tile_counter", lambda device, capturing=None: None)
    monkeypatch.setattr(runtime, "_sm_count", lambda index: 132)
    return launches


def _recorder(launches):
    """A stand-in for runtime.get_kernel: main kernels record their launches, preprocesses do nothing."""
    def get_kernel(cfg):
        if isinstance(cfg, config.BwdPreConfig):
            return lambda *args: None
        return lambda *args: launches.append((cfg, args))
    return get_kernel


def _tensors(b, sq, sk, hq, hk, d):
    q = torch.empty(b, sq, hq, d, dtype=torch.bfloat16)
    k, v = (torch.empty(b, sk, hk, d, dtype=torch.bfloat16) for _ in range(2))
    return q, k, v


def expected_fwd(d, b, sq, sk, hq, causal, window, softcap):
    causal_k, local, wl, wr = plan.mask_kind(causal, window)
    cfg = plan.fwd_config("bf16", d, causal=causal_k, local=local, softcap=softcap,
                            narrow=plan.fwd_narrow_tile(d, sq, causal_k and not local),
                            short=(plan.fwd_short_causal(d, sq, sk, not local) if causal_k
                                   else plan.fwd_short_nomask(d, sq, sk, local)),
                            qring=plan.fwd_short_qring(d, sq, sk, local))
    grid = config.fwd_grid(cfg, sq, hq * b, 132 if cfg.persistent else None)
    section = runtime._l2_section(sk, cfg, hq * b) if cfg.causal or cfg.local else 1
    return cfg, (wl, wr, grid, section)


@pytest.mark.parametrize("d", config.SUPPORTED_HDIMS)
def test_forward_launches_the_dispatched_config(d, fwd_launches):
    for rounds in range(2):  # the second round is served from the cache
        for sq, sk in SHAPES:
            for causal, window in MASKS:
                for softcap in (0.0, 5.0):
                    q, k, v = _tensors(2, sq, sk, 4, 2, d)
                    runtime.forward(q, k, v, 0.1, causal, window, softcap)
                    cfg, args = fwd_launches.pop()
                    want_cfg, want_args = expected_fwd(d, 2, sq, sk, 4, causal, window, softcap > 0)
                    assert cfg == want_cfg, (rounds, sq, sk, causal, window, softcap)
                    assert args[8:12] == want_args, (rounds, sq, sk, causal, window, softcap)
                    # no FP8 descales, no varlen bounds, no page table, no split walk
                    assert args[12:] == (None,) * 9 + (0, 0, 0, 0, 1)


def test_forward_overrides_are_not_served_from_the_cache(fwd_launches):
    q, k, v = _tensors(1, 1024, 1024, 2, 2, 128)
    runtime.forward(q, k, v, 0.1, True, (-1, -1), 0.0)
    default = fwd_launches.pop()[0]
    with runtime.config_overrides(pingpong=not default.pingpong):
        runtime.forward(q, k, v, 0.1, True, (-1, -1), 0.0)
        assert fwd_launches.pop()[0].pingpong != default.pingpong
    runtime.forward(q, k, v, 0.1, True, (-1, -1), 0.0)
    assert fwd_launches.pop()[0] == default


@pytest.fixture
def bwd_launches(monkeypatch):
    launches = []
    monkeypatch.setattr(runtime, "get_kernel", _recorder(launches))
    return launches


def test_backward_launches_the_dispatched_config(bwd_launches):
    for _ in range(2):  # the second round is served from the cache
        for d in config.SUPPORTED_HDIMS:
            for sq, sk in SHAPES[:6]:
                for causal, window in MASKS:
                    for deterministic in (False, True):
                        q, k, v = _tensors(1, sq, sk, 2, 1, d)
                        lse = torch.zeros(1, 2, sq)
                        runtime.backward(q, k, v, q, q, lse, 0.1, causal, window, 0.0, deterministic)
                        cfg, args = bwd_launches.pop()
                        causal_k, local, wl, wr = plan.mask_kind(causal, window)
                        fields = plan.bwd_per_call(d, sq, sk, causal_k, deterministic, False)
                        assert cfg == plan.bwd_config("bf16", d, causal=causal_k, local=local,
                                                        deterministic=deterministic, **fields)
                        assert args[-9:-7] == (wl, wr) and args[-7:] == (None,) * 7  # no varlen bounds


def test_backward_overrides_are_not_served_from_the_cache(bwd_launches):
    q, k, v = _tensors(1, 256, 256, 2, 2, 128)
    lse = torch.zeros(1, 2, 256)
    runtime.backward(q, k, v, q, q, lse, 0.1, False, (-1, -1), 0.0)
    default = bwd_launches.pop()[0]
    with runtime.bwd_config_overrides(lpt=not default.lpt):
        runtime.backward(q, k, v, q, q, lse, 0.1, False, (-1, -1), 0.0)
        assert bwd_launches.pop()[0].lpt != default.lpt
    runtime.backward(q, k, v, q, q, lse, 0.1, False, (-1, -1), 0.0)
    assert bwd_launches.pop()[0] == default


@pytest.mark.parametrize("override", [{"tile_m": 80}, {"dq_accum_head_major": True}])
def test_backward_override_wins_over_the_per_call_choice_it_rules_out(bwd_launches, override):
    """hdim 128 causal <= 1k takes 64-row steps with interleaved dQ rows per call; an override those
    rows do not fit (80-row steps, a head-major dQ) drops them instead of failing."""
    q, k, v = _tensors(1, 512, 512, 2, 2, 128)
    lse = torch.zeros(1, 2, 512)
    with runtime.bwd_config_overrides(**override):
        runtime.backward(q, k, v, q, q, lse, 0.1, True, (-1, -1), 0.0)
    cfg = bwd_launches.pop()[0]
    assert all(getattr(cfg, key) == value for key, value in override.items())
    assert not cfg.dq_rows_interleaved


@pytest.mark.parametrize("fault", ["unwritten_row", "wrong_scale"])
def test_fault_hooks_launch_what_they_say(fwd_launches, monkeypatch, fault):
    """tests/faults.py's forward faults (tests/test_faults_gpu.py): the last row left out of the launch
    while the caller still gets every row; the scale 1% off."""
    import faults

    q, k, v = _tensors(1, 300, 517, 2, 2, 128)
    runtime.forward(q, k, v, 0.1, False, (-1, -1), 0.0)
    plain = fwd_launches.pop()[1]
    faults.inject(monkeypatch, runtime, fault)
    out, lse = runtime.forward(q, k, v, 0.1, False, (-1, -1), 0.0)
    args = fwd_launches.pop()[1]
    if fault == "unwritten_row":
        assert args[0].shape[1] == 299 and args[3].shape[1] == 299
        assert out.shape[1] == 300 and lse.shape[2] == 300
    else:
        assert args[6] == pytest.approx(plain[6] * 1.01)


@pytest.mark.parametrize("opt_in", [False, True])
def test_decode_tile_only_where_opted_in(fwd_launches, monkeypatch, opt_in):
    """forward_varlen(decode=True), kvcache's rearranged decode: the 1-warpgroup decode config
    (plan.fwd_plan_decode) and its grid of 64-row tiles only with FLASHHOPPER_EXPERIMENTAL_DECODE_TILE=1
    (validation.decode_tile_enabled) and no mask; the varlen config otherwise, and always without
    `decode`."""
    from flashhopper import validation

    monkeypatch.setattr(validation, "DECODE_TILE_GPU_VERIFIED", False)
    if opt_in:
        monkeypatch.setenv(validation.DECODE_TILE_OPT_IN, "1")
    else:
        monkeypatch.delenv(validation.DECODE_TILE_OPT_IN, raising=False)
    q = torch.empty(6 * 4, 8, 128, dtype=torch.bfloat16)  # 6 sequences of 4 packed rows, 8 KV heads
    k, v = (torch.empty(3000, 8, 128, dtype=torch.bfloat16) for _ in range(2))
    cu_q = torch.arange(7, dtype=torch.int32) * 4
    starts, used = torch.arange(7, dtype=torch.int32) * 500, torch.full((6,), 500, dtype=torch.int32)
    for decode, causal, softcap in ((True, False, 0.0), (True, False, 5.0), (False, False, 0.0),
                                    (True, True, 0.0)):
        runtime.forward_varlen(q, k, v, cu_q, starts, 4, None, used, 0.1, causal, (-1, -1), softcap,
                               decode=decode)
        cfg, args = fwd_launches.pop()
        want = plan.fwd_config_varlen("bf16", 128, causal=causal, softcap=softcap > 0)
        if decode and opt_in and not causal:
            want = plan.fwd_config_decode("bf16", 128, softcap=softcap > 0)
            assert want.tile_m == 64 and want.num_consumer_wg == 1
        # the decode walk: every sequence its 4 rows, in order (varlen_walk.uniform_walk_table)
        assert cfg == want and args[10] == 8 * 6 and args[19].tolist() == [1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5]


def test_varlen_launches_its_config_on_the_walk_of_its_sequences(fwd_launches, monkeypatch):
    """flash_attn_varlen_func's launch: the varlen config of the mask, (1, total, h, d) views of the
    packed tensors, (1, h, total) for LSE, the bounds and seqused from cu_seqlens when not given, the walk
    table of the used lengths (longest keys first), a persistent grid no larger than the tiles' bound,
    L2 sections of heads sized by max_seqlen_k (k's rows when not given)."""
    from flashhopper.hopper import varlen_walk

    q = torch.empty(300, 4, 128, dtype=torch.bfloat16)
    k, v = (torch.empty(500, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    cu_q = torch.tensor([0, 100, 300], dtype=torch.int32)
    cu_k = torch.tensor([0, 250, 500], dtype=torch.int32)
    out, lse = runtime.forward_varlen(q, k, v, cu_q, cu_k, 200, None, None, 0.1, True, (-1, -1), 0.0)
    assert out.shape == (300, 4, 128) and lse.shape == (4, 300)
    cfg, args = fwd_launches.pop()
    assert cfg == plan.fwd_config_varlen("bf16", 128, causal=True) and cfg.varlen and cfg.dynamic_sched
    assert args[0].shape == (1, 300, 4, 128) and args[4].shape == (1, 4, 300)
    # the tiles' bound: 2 sequences of at most 2 query blocks, 300 rows in at most 2 + 2 partial blocks
    assert args[10] == varlen_walk.walk_grid(tile_m=128, total_q=300, batch=2, max_seqlen_q=200, heads=4,
                                             max_ctas=132) == 4 * 4
    assert args[11] == runtime._l2_section(500, cfg, 4)  # heads a section, from k's 500 rows
    assert args[12:15] == (None,) * 3 and args[20] is None
    assert args[17].tolist() == [100, 200] and args[18].tolist() == [250, 250]  # seqused from cu_seqlens
    # sequence 0 first (its keys tie with sequence 1's), 1 then 2 query blocks
    assert args[19].dtype == torch.int32 and args[19].tolist() == [1, 3, 0, 1]
    long_keys = 1 << 20  # 512 MiB of K and V a head: one head a section
    runtime.forward_varlen(q, k, v, cu_q, cu_k, 200, None, None, 0.1, True, (-1, -1), 0.0,
                           max_seqlen_k=long_keys)
    assert fwd_launches.pop()[1][11] == runtime._l2_section(long_keys, cfg, 4) == 1
    monkeypatch.setattr(runtime, "persistent_ctas_cap", 3)  # the tests' cap: a few CTAs walk every tile
    runtime.forward_varlen(q, k, v, cu_q, cu_k, 200, None, None, 0.1, False, (-1, -1), 0.0)
    cfg, args = fwd_launches.pop()
    assert args[10] == 3 and args[11] == 1  # no mask: one head a section (m fastest)
    # no key at all: no launch, 0 and -inf
    no_keys = torch.zeros(3, dtype=torch.int32)
    out, lse = runtime.forward_varlen(q, k[:0], v[:0], cu_q, no_keys, 200, None, None, 0.1, False, (-1, -1),
                                      0.0)
    assert not fwd_launches and (out == 0).all() and torch.isneginf(lse).all()


def test_a_static_schedule_takes_no_zeroed_counter_under_graph_capture(monkeypatch):
    """The tile counter: the dynamic scheduler's always (_tile_counter, zeroed once per stream, or
    per captured launch); for the static schedule, which never touches it, under capture an
    uninitialized allocation, so that a captured call (decode's) holds no memset for it."""
    zeroed, empty = object(), []
    monkeypatch.setattr(runtime, "_tile_counter", lambda device, capturing=None: zeroed)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(runtime.torch, "empty", lambda *a, **kw: empty.append((a, kw)) or "empty")
    cuda = torch.device("cuda")
    static = config.FwdConfig(dtype="bf16", hdim=128, persistent=False, dynamic_sched=False)
    dynamic = config.FwdConfig(dtype="bf16", hdim=128, persistent=True, dynamic_sched=True)
    assert runtime._counter_for(dynamic, cuda) is zeroed and not empty
    assert runtime._counter_for(static, cuda) == "empty"
    assert empty == [((2,), {"dtype": torch.int32, "device": cuda})]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert runtime._counter_for(static, cuda) is zeroed  # eager: the cached one, no allocation
    assert runtime._counter_for(static, torch.device("cpu")) is zeroed


def test_fp8_token_descales_launch_the_per_token_kernel(fwd_launches, monkeypatch):
    """FP8 with q's or k's descale per token: the per-token config (plan.fwd_plan's, qk_descale
    "token"), its descales as the kernel takes them, q's (b, hq, sq), k's (b, hk, sk), v's (b, hk), those
    given per (batch, kv head) or not at all as stride-0 views (a per-head q descale repeated over its
    query heads first); per-head descales keep the per-head kernel and arguments."""
    monkeypatch.setattr(runtime, "_unit_descale", lambda device: torch.ones(1, 1))
    e4m3 = torch.float8_e4m3fn
    b, sq, sk, hq, hk, d = 2, 300, 517, 4, 2, 128
    q = torch.empty(b, sq, hq, d, dtype=e4m3)
    k, v = (torch.empty(b, sk, hk, d, dtype=e4m3) for _ in range(2))
    qt, kt = torch.rand(b, hq, sq), torch.rand(b, hk, sk)
    qh, kh, vh = (torch.rand(b, hk) for _ in range(3))
    for causal in (False, True):
        want = plan.fwd_plan("e4m3", d, sq, sk, causal, (-1, -1), False, qk_descale="token")[0]
        assert want.token_descales and want.tile_n == (64 if causal else 96)
        for descales in ((qt, kt, vh), (qt, None, None), (None, kt, vh), (qh, kt, None), (qt, kh, vh)):
            runtime.forward(q, k, v, 0.1, causal, (-1, -1), 0.0, descales=descales)
            cfg, args = fwd_launches.pop()
            qd, kd, vd = args[12:15]
            assert cfg == want and qd.shape == (b, hq, sq) and kd.shape == (b, hk, sk) and vd.shape == (b, hk)
            want_q = (qh.repeat_interleave(2, dim=1)[:, :, None] if descales[0] is qh
                      else torch.ones(1) if descales[0] is None else qt)
            want_k = kh[:, :, None] if descales[1] is kh else torch.ones(1) if descales[1] is None else kt
            assert torch.equal(qd, want_q.expand(b, hq, sq)) and torch.equal(kd, want_k.expand(b, hk, sk))
            assert torch.equal(vd, (torch.ones(1) if descales[2] is None else vh).expand(b, hk))
            assert descales[1] is not None or kd.stride() == (0, 0, 0)
        runtime.forward(q, k, v, 0.1, causal, (-1, -1), 0.0, descales=(qh, kh, vh))
        cfg, args = fwd_launches.pop()
        assert not cfg.token_descales and args[12:15] == (qh, kh, vh)


# --- the backward's host side against stand-in kernels that compute exactly what they are handed ---


def _window_of(cfg, wl, wr):
    """(causal, window_size) of the reference for a backward launch's mask arguments."""
    if cfg.causal:
        return True, (-1, -1)
    if not cfg.local:
        return False, (-1, -1)
    return False, tuple(-1 if w >= plan.UNBOUNDED else w for w in (wl, wr))


def _exact_bwd(q, k, v, dout, cfg, scale, softcap_pre, wl, wr):
    """The exact (float64) gradients attention_bwd_ref gives for one launch's operands."""
    from flashhopper.reference import attention_bwd_ref

    causal, window = _window_of(cfg, wl, wr)
    softcap = scale / softcap_pre if cfg.softcap else 0.0
    return attention_bwd_ref(q, k, v, dout, scale, causal, window, softcap)


@pytest.fixture
def exact_bwd_kernels(monkeypatch):
    """runtime.get_kernel's stand-in for the backward: the preprocess records what it reads; the main
    kernel records its operands and writes the exact gradients of what it is handed (varlen: per
    sequence over its used rows and keys, which are all a kernel writes: dK / dV rows of the used keys,
    dQ accumulator rows of the used queries)."""
    seen = {}

    def main(cfg):
        def kernel(q, k, v, dout, lse_log2, d_rows, dq_accum, dq_sem, dk, dv, scale_log2, softcap_pre, scale,
                   wl, wr, cu_q, cu_k, used_q, used_k, pad_q, max_k, seqused):
            seen["main"] = (cfg, v.clone(), dout.clone(), used_q, used_k)
            if cu_q is None:
                dq, dk_, dv_ = _exact_bwd(q, k, v, dout, cfg, scale, softcap_pre, wl, wr)
                dq_accum[:, : q.shape[1]] += dq.float()
                dk.copy_(dk_)
                dv.copy_(dv_)
                return
            for i in range(used_k.shape[0]):  # the kernel's grid: a sequence per used length
                rows = slice(int(cu_q[i]), int(cu_q[i]) + int(used_q[i]))
                keys = slice(int(cu_k[i]), int(cu_k[i]) + int(used_k[i]))
                if rows.stop == rows.start or keys.stop == keys.start:
                    dk[:, keys] = 0.0  # the kernel's CTAs of a sequence with no query write zeros
                    dv[:, keys] = 0.0
                    continue
                grads = _exact_bwd(q[:, rows], k[:, keys], v[:, keys], dout[:, rows], cfg, scale, softcap_pre,
                                   wl, wr)
                dq_accum[:, rows] += grads[0].float()
                dk[:, keys] = grads[1].to(dk.dtype)
                dv[:, keys] = grads[2].to(dv.dtype)
        return kernel

    def get_kernel(cfg):
        if isinstance(cfg, config.BwdPreConfig):
            return lambda out, dout, *args: seen.update(pre=(cfg, out.shape, dout.shape, args))
        return main(cfg)

    monkeypatch.setattr(runtime, "get_kernel", get_kernel)
    monkeypatch.setattr(runtime, "poison", True)  # what no stand-in writes shows as NaN
    return seen


def _split_inputs(b, sq, sk, hq, hk, strided: bool, seed=0):
    """q, k (hdim 192), v (128), dout (128); with `strided` v every other head of a wider tensor."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    q, k, dout = rand(b, sq, hq, 192), rand(b, sk, hk, 192), rand(b, sq, hq, 128)
    v = rand(b, sk, 2 * hk, 128)[:, :, ::2] if strided else rand(b, sk, hk, 128)
    return q, k, v, dout


def _assert_padded(x, width):
    assert x.shape[-1] == 192 and x.is_contiguous() and (x[..., width:] == 0).all()


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (False, (5, 2), 3.0)])
def test_split_head_dims_backward_runs_hdim_192_on_padded_v_and_dout(exact_bwd_kernels, causal, window,
                                                                      softcap, strided):
    """(192, 128): the main kernel of hdim 192 (the dispatched one) on V and dO with 64 zero columns, the
    preprocess of 128 columns on O and dO as given; dV trimmed to 128 columns in V's layout. The
    gradients are those of the unpadded problem (the zero columns add nothing to dP, and dV's are 0)."""
    from flashhopper.reference import attention_bwd_ref

    q, k, v, dout = _split_inputs(2, 37, 53, 4, 2, strided)
    out = torch.randn(2, 37, 4, 128).to(torch.bfloat16)
    lse = torch.zeros(2, 4, 37)
    dq, dk, dv = runtime.backward(q, k, v, out, dout, lse, 0.2, causal, window, softcap, deterministic=causal)
    cfg, v_in, dout_in, _, _ = exact_bwd_kernels["main"]
    causal_k, local, _, _ = plan.mask_kind(causal, window)
    assert cfg == plan.bwd_plan("bf16", 192, 37, 53, causal, window, softcap > 0, causal)[0]
    _assert_padded(v_in, 128)
    _assert_padded(dout_in, 128)
    assert torch.equal(v_in[..., :128], v) and torch.equal(dout_in[..., :128], dout)
    pre_cfg, out_shape, dout_shape, _ = exact_bwd_kernels["pre"]
    assert pre_cfg == config.BwdPreConfig.of(cfg, 128) and pre_cfg.hdim == 128 and not pre_cfg.zero_dq
    assert out_shape == dout_shape == (2, 37, 4, 128)
    assert dv.shape == v.shape and dv.stride() == torch.empty_like(v).stride()
    want = attention_bwd_ref(q, k, v, dout, 0.2, causal, window, softcap)
    for got, exact in zip((dq, dk, dv), want, strict=True):
        assert got.dtype == torch.bfloat16 and not got.isnan().any()
        torch.testing.assert_close(got.double(), exact.to(torch.bfloat16).double(), rtol=1e-2, atol=1e-3)


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("d,dv_dim", [(128, 128), (192, 128)])
def test_varlen_backward_takes_seqused_where_it_takes_the_lengths(exact_bwd_kernels, d, dv_dim):
    """backward_varlen(seqused_q=, seqused_k=): the kernels get the used lengths in place of the
    packed ones (the preprocess the same tensors, no copy; the causal main kernel them in its launch
    order, longest first, each with its sequence's offsets), the offsets stay cu_seqlens'; rows past
    seqused_q get dq = 0 and keys past seqused_k dk = dv = 0 (no kernel writes them: the host zeroes
    them, the outputs start as NaN here); the used rows get each sequence's own gradients. Used lengths
    0 and whole sequences included; (192, 128) through the padding."""
    from flashhopper.reference import attention_bwd_ref

    lens_q, lens_k = [6, 9, 4, 5, 7], [8, 5, 3, 7, 6]
    used_q, used_k = [4, 9, 0, 5, 3], [8, 2, 3, 0, 6]
    g = torch.Generator().manual_seed(1)
    q, dout = (torch.randn(sum(lens_q), 4, dim, generator=g).to(torch.bfloat16) for dim in (d, dv_dim))
    k, v = (torch.randn(sum(lens_k), 2, dim, generator=g).to(torch.bfloat16) for dim in (d, dv_dim))
    out = torch.randn(sum(lens_q), 4, dv_dim).to(torch.bfloat16)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    uq, uk = torch.tensor(used_q, dtype=torch.int32), torch.tensor(used_k, dtype=torch.int32)
    lse = torch.zeros(4, sum(lens_q))
    dq, dk, dv = runtime.backward_varlen(q, k, v, out, dout, lse, cu_q, cu_k, 9, 8, 0.3, True, (-1, -1), 0.0,
                                         seqused_q=uq, seqused_k=uk)
    cfg, v_in, _, kernel_uq, kernel_uk = exact_bwd_kernels["main"]
    # causal: the main kernel's sequences longest used query length first (runtime.longest_first)
    order = sorted(range(len(used_q)), key=lambda i: (-used_q[i], i))
    assert kernel_uq.tolist() == [used_q[i] for i in order]
    assert kernel_uk.tolist() == [used_k[i] for i in order]
    assert exact_bwd_kernels["pre"][3][4] is uq  # (lse, lse_log2, d_rows, cu_q, used_q, ...)
    assert cfg == plan.bwd_config_varlen("bf16", d, causal=True) and v_in.shape[-1] == d
    assert exact_bwd_kernels["pre"][0] == config.BwdPreConfig.of(cfg, 0 if dv_dim == d else dv_dim)
    for i in range(len(lens_q)):
        q0, k0 = int(cu_q[i]), int(cu_k[i])
        rows, keys = slice(q0, q0 + used_q[i]), slice(k0, k0 + used_k[i])
        past_q, past_k = slice(rows.stop, int(cu_q[i + 1])), slice(keys.stop, int(cu_k[i + 1]))
        assert (dq[past_q] == 0).all() and (dk[past_k] == 0).all() and (dv[past_k] == 0).all()
        if not used_q[i] or not used_k[i]:
            assert (dq[rows] == 0).all() and (dk[keys] == 0).all() and (dv[keys] == 0).all()
            continue
        want = attention_bwd_ref(q[None, rows], k[None, keys], v[None, keys], dout[None, rows], 0.3, True)
        for got, exact in zip((dq[rows], dk[keys], dv[keys]), want, strict=True):
            exact = exact[0].to(torch.bfloat16).double()
            torch.testing.assert_close(got.double(), exact, rtol=1e-2, atol=1e-3)


def _box(x, start: int, rows: int):
    """Rows [start, start + rows) of a packed (total, heads, dim) tensor as a TMA box loads them: what
    lies there, whichever sequence's rows those are, and zeros past the tensor's end."""
    box = x.new_zeros(rows, *x.shape[1:])
    stop = min(start + rows, x.shape[0])
    if stop > start:
        box[: stop - start] = x[start:stop]
    return box


class TiledVarlenBwd:
    """A CPU model of the varlen backward's preprocess and main kernel (runtime.get_kernel's stand-in)
    that moves the data as they do, in float32: the preprocess's padded LSE / D rows (+inf / 0 past a
    sequence's used rows, -inf LSE to +inf); per (sequence, key block) CTA the K / V box and per step
    the Q / dO box of full tile rows from the sequence's first packed row, which past its end hold the
    next sequences' rows (any of them unused, NaN in the tests), the rows past the used length zeroed
    in smem as `zero` says, P by selection on the visibility rule and by the +inf LSE rows past
    seqused_q, dS = P (dP - D), the whole dQ tile added into the packed dQ rows (clipped at the
    tensor's end) and dK / dV stored for the used keys only. `zero`: "seqused" (the kernels: every row
    at or past the used length when the caller gave seqused on that side, the `seqused` bits) or
    "own" (the first kernels': only where the sequence itself has rows past its used length, which
    let NaN of the next sequence's unused rows into a sequence using all of its rows)."""

    def __init__(self, zero: str = "seqused"):
        self.zero = zero
        self.seqused = None  # the bits of the last launch

    def get_kernel(self, cfg):
        from functools import partial

        if isinstance(cfg, config.BwdPreConfig):
            return partial(self.pre, cfg)
        return partial(self.main, cfg)

    @staticmethod
    def pre(cfg, out, dout, lse, lse_log2, d_rows, cu_q, used_q, pad_q, max_rows, scale):
        from flashhopper.hopper.host import PRE_ROWS_PER_CTA

        grid_rows = -(-max_rows // PRE_ROWS_PER_CTA) * PRE_ROWS_PER_CTA
        for b in range(used_q.shape[0]):
            p0, q0, used = int(pad_q[b]), int(cu_q[b]), int(used_q[b])
            written = min(int(pad_q[b + 1]) - p0, grid_rows)
            lse_log2[0, :, p0:p0 + written] = float("inf")
            d_rows[0, :, p0:p0 + written] = 0.0
            lse_b = lse[0, :, q0:q0 + used].float()
            lse_log2[0, :, p0:p0 + used] = torch.where(lse_b == float("-inf"), float("inf"),
                                                       lse_b * math.log2(math.e))
            d = (out[0, q0:q0 + used].float() * dout[0, q0:q0 + used].float()).sum(-1).T
            d_rows[0, :, p0:p0 + used] = d * scale if cfg.scale_d else d

    def main(self, cfg, q, k, v, dout, lse_log2, d_rows, dq_accum, dq_sem, dk, dv, scale_log2, softcap_pre,
             scale, wl, wr, cu_q, cu_k, used_q, used_k, pad_q, max_k, seqused):
        from flashhopper.hopper.host import host_m_block_range

        self.seqused = seqused
        q, k, v, dout = (x[0].float() for x in (q, k, v, dout))
        tm, tn, hk = cfg.tile_m, cfg.tile_n, k.shape[1]
        ratio = q.shape[1] // hk
        has_right, has_left = cfg.causal or cfg.local, cfg.local
        for b in range(used_q.shape[0]):
            uq, uk = int(used_q[b]), int(used_k[b])
            q0, k0, p0 = int(cu_q[b]), int(cu_k[b]), int(pad_q[b])
            if self.zero == "seqused":
                zero_q, zero_k = bool(seqused & 1), bool(seqused & 2)
            else:
                zero_q, zero_k = uq < int(cu_q[b + 1]) - q0, uk < int(cu_k[b + 1]) - k0
            for n in range(-(-max_k // tn)):
                keys_left = uk - n * tn
                if keys_left <= 0:  # a key block past the sequence's keys: the CTA does nothing
                    continue
                K, V = _box(k, k0 + n * tn, tn), _box(v, k0 + n * tn, tn)
                if zero_k and keys_left < tn:
                    K[keys_left:], V[keys_left:] = 0.0, 0.0
                m_min, m_max = host_m_block_range(n, uq, uk, tm, tn, has_right, has_left, wl, wr)
                key = (n * tn + torch.arange(tn))[None]
                for kv_head in range(hk):
                    dK, dV = K.new_zeros(tn, K.shape[-1]), V.new_zeros(tn, V.shape[-1])
                    for h in range(kv_head * ratio, (kv_head + 1) * ratio):
                        for m in range(m_min, m_max):
                            row0, rows_left = q0 + m * tm, uq - m * tm
                            Q, dO = _box(q, row0, tm)[:, h], _box(dout, row0, tm)[:, h]
                            if zero_q and rows_left < tm:
                                Q[rows_left:], dO[rows_left:] = 0.0, 0.0
                            lse2 = lse_log2[0, h, p0 + m * tm:p0 + (m + 1) * tm, None]
                            d_row = d_rows[0, h, p0 + m * tm:p0 + (m + 1) * tm, None]
                            query = (m * tm + torch.arange(tm))[:, None]
                            visible = key < uk
                            if has_right:
                                visible = visible & (key <= query + uk - uq + wr)
                            if has_left:
                                visible = visible & (key >= query + uk - uq - wl)
                            s = Q @ K[:, kv_head].T
                            t = torch.tanh(s * softcap_pre) if cfg.softcap else None
                            s = (t if cfg.softcap else s) * scale_log2
                            p = torch.where(visible, torch.exp2(s - lse2), 0.0)
                            dp = dO @ V[:, kv_head].T
                            ds = p * ((dp * scale if cfg.scale_in_ds else dp) - d_row)
                            if cfg.softcap:
                                ds = ds * (1.0 - t * t)
                            dV += p.T @ dO
                            dK += ds.T @ Q
                            dQ = ds @ K[:, kv_head] * (1.0 if cfg.scale_in_ds else scale)
                            stop = min(row0 + tm, dq_accum.shape[1])
                            dq_accum[0, row0:stop, h] += dQ[:stop - row0]
                    rows = min(keys_left, tn)  # the used keys' rows only
                    dK = dK * (1.0 if cfg.scale_in_ds else scale)
                    dk[0, k0 + n * tn:k0 + n * tn + rows, kv_head] = dK[:rows]
                    dv[0, k0 + n * tn:k0 + n * tn + rows, kv_head] = dV[:rows]


def _seqused_problem(lens_q, lens_k, used_q, used_k, d, dv_dim, hq=4, hk=2, seed=3):
    """bf16 q, k, v, dout (packed) with NaN past seqused, and cu_seqlens."""
    g = torch.Generator().manual_seed(seed)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    q, dout = (torch.randn(sum(lens_q), hq, dim, generator=g).to(torch.bfloat16) for dim in (d, dv_dim))
    k, v = (torch.randn(sum(lens_k), hk, dim, generator=g).to(torch.bfloat16) for dim in (d, dv_dim))
    for x, cu, used in ((q, cu_q, used_q), (dout, cu_q, used_q), (k, cu_k, used_k), (v, cu_k, used_k)):
        for i, n in enumerate(used):
            x[int(cu[i]) + n:int(cu[i + 1])] = float("nan")
    return q, k, v, dout, cu_q, cu_k


def _seqused_forward(q, k, v, cu_q, cu_k, uq, uk, used_q, scale, causal, window, softcap):
    """The reference forward's out (bf16) and lse, NaN past seqused_q (the forward leaves those rows
    undefined)."""
    from flashhopper.reference import attention_varlen_ref

    out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, uq, uk, scale, causal, window, softcap)
    out, lse = out.to(torch.bfloat16), lse.clone()
    for i, n in enumerate(used_q):
        out[int(cu_q[i]) + n:int(cu_q[i + 1])] = float("nan")
        lse[:, int(cu_q[i]) + n:int(cu_q[i + 1])] = float("nan")
    return out, lse


def _seqused_backward(monkeypatch, model, lens_q, lens_k, used_q, used_k, d, dv_dim, causal, window, softcap,
                      given=("q", "k")):
    """runtime.backward_varlen through `model` on _seqused_problem's inputs; seqused_q / _k passed as
    `given` names them (a side not given uses its whole lengths). Returns (grads, inputs, out)."""
    monkeypatch.setattr(runtime, "get_kernel", model.get_kernel)
    monkeypatch.setattr(runtime, "poison", True)  # what the model does not write shows as NaN
    used_q, used_k = (used_q if "q" in given else lens_q), (used_k if "k" in given else lens_k)
    q, k, v, dout, cu_q, cu_k = _seqused_problem(lens_q, lens_k, used_q, used_k, d, dv_dim)
    uq, uk = (torch.tensor(u, dtype=torch.int32) if side in given else None
              for u, side in ((used_q, "q"), (used_k, "k")))
    scale = d ** -0.5
    out, lse = _seqused_forward(q, k, v, cu_q, cu_k, uq, uk, used_q, scale, causal, window, softcap)
    grads = runtime.backward_varlen(q, k, v, out, dout, lse, cu_q, cu_k, max(used_q), max(used_k), scale,
                                    causal, window, softcap, seqused_q=uq, seqused_k=uk)
    return grads, (q, k, v, dout, cu_q, cu_k, used_q, used_k, scale), out


@pytest.mark.parametrize("lengths", [SEQUSED, SEQUSED_NEXT], ids=["h100", "next"])
@pytest.mark.parametrize("d,dv_dim", [(64, 64), (128, 128), (256, 256), (192, 128)])
@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (False, (100, 20), 10.0)])
def test_varlen_backward_model_keeps_the_nan_past_seqused_out(monkeypatch, d, dv_dim, causal, window,
                                                              softcap, lengths):
    """The tile model of the varlen backward (TiledVarlenBwd, the kernels' zeroing) on the lengths that
    failed on the H100, every row past seqused NaN: no NaN reaches a gradient, the used rows get the
    rule's gradients and the rows past seqused zero (the keys kernel at 64 / 128, the wide one at 192 /
    256). The paths a NaN had: the K / V box of a sequence using all its keys running into the next
    sequences' unused keys (dP, then dS and dQ of every row), the Q / dO box of one using all its queries
    into the next ones' unused queries (S, P and dP of those rows: dK, dV of every key); rows that see no
    key (LSE -inf: +inf in the padded rows), a sequence with no query or no key, D and LSE of unused
    rows (the preprocess reads only used rows), the dQ rows a tile adds past its sequence (zeros)."""
    from flashhopper.accuracy import check_varlen_grads

    model = TiledVarlenBwd()
    grads, (q, k, v, dout, cu_q, cu_k, used_q, used_k, scale), out = _seqused_backward(
        monkeypatch, model, *lengths, d, dv_dim, causal, window, softcap)
    assert model.seqused == 3
    for name, x in zip(("dq", "dk", "dv"), grads, strict=True):
        assert not x.isnan().any(), name
    check_varlen_grads(grads, q, k, v, dout, cu_q.tolist(), cu_k.tolist(), scale, causal, window, softcap,
                       out=out, used_q=used_q, used_k=used_k)


@pytest.mark.parametrize("d", [64, 128])
def test_varlen_backward_model_of_the_first_kernels_shows_the_h100_failure(monkeypatch, d):
    """The same model zeroing only where the sequence itself has rows past its seqused (the first
    kernels) gives what the H100 run gave: NaN in dq of sequence 0's used rows (its last key block holds
    sequence 1's unused keys) and in dk, dv of row 500 (sequence 2's one key: its last query block holds
    sequence 3's unused queries)."""
    grads, _, _ = _seqused_backward(monkeypatch, TiledVarlenBwd(zero="own"), *SEQUSED, d, d, False,
                                    (-1, -1), 0.0)
    dq, dk, dv = grads
    assert dq[:250].flatten(1).isnan().any(1).all()
    assert dk[500].isnan().any() and dv[500].isnan().any()
    # sequence 0 of SEQUSED_NEXT: all 129 queries and 100 keys used, its blocks run into sequence 1's
    # unused rows
    dq, dk, dv = _seqused_backward(monkeypatch, TiledVarlenBwd(zero="own"), *SEQUSED_NEXT, d, d, False,
                                   (-1, -1), 0.0)[0]
    assert dq[:129].flatten(1).isnan().any(1).all() and dk[:100].isnan().any() and dv[:100].isnan().any()


@pytest.mark.parametrize("given", [(), ("q",), ("k",), ("q", "k")])
def test_varlen_backward_tells_the_kernel_which_seqused_it_got(monkeypatch, given):
    """The main kernel's last argument: bit 0 seqused_q given, bit 1 seqused_k (the kernels zero the tile
    rows past the used lengths on that side only then: without it every row a tile reads is data). Only
    the given side's rows past seqused hold NaN here: the model's gradients hold no NaN either way."""
    from flashhopper.accuracy import check_varlen_grads

    model = TiledVarlenBwd()
    grads, (q, k, v, dout, cu_q, cu_k, used_q, used_k, scale), out = _seqused_backward(
        monkeypatch, model, *SEQUSED, 64, 64, True, (-1, -1), 0.0, given=given)
    assert model.seqused == ("q" in given) + 2 * ("k" in given)
    check_varlen_grads(grads, q, k, v, dout, cu_q.tolist(), cu_k.tolist(), scale, True, (-1, -1), 0.0,
                       out=out, used_q=used_q, used_k=used_k)
