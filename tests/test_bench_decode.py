"""`flashhopper bench --decode` without a GPU: the points, the byte count, the cache rotation, the
makers on the CPU (against the reference), the timing loop with fake providers, the table and the
command line (graph capture and the timing itself need a GPU)."""

import functools
import io
import json
import math
import os
import subprocess
import sys
import types

import pytest
import torch

from flashhopper import cli
from flashhopper.bench import decode, runner
from flashhopper.interface import flash_attn_varlen_func
from flashhopper.kvcache import flash_attn_with_kvcache
from flashhopper.reference import visible_mask

MB = 10**6

# --- points, bytes, rotation ---


def test_points_are_the_issues():
    points = decode.decode_points()
    assert len(points) == len(set(points)) == 6 * 2 * 2
    assert {(p.batch, p.context) for p in points} == {(1, 8192), (1, 32768), (1, 131072), (8, 32768),
                                                      (64, 4096), (128, 8192)}
    assert {p.q_len for p in points} == {1, 4}
    assert {(p.heads_q, p.heads_k, p.hdim) for p in points} == {(32, 8, 128), (32, 32, 64)}
    assert points[0] == decode.DecodePoint(1, 8192, 1, 32, 8, 128)
    assert points[0].label == "1 x 8k q1 heads 32:8 hdim 128"
    assert [(p.q_len, p.hdim) for p in points[5:7]] == [(1, 128), (4, 128)]  # table order
    assert [p.hdim for p in decode.decode_points(hdims=[64])] == [64] * 12


def test_quick_points():
    quick = decode.decode_points(quick=True)
    assert [(p.batch, p.context, p.q_len, p.heads_q, p.heads_k, p.hdim) for p in quick] == [
        (1, 8192, 1, 32, 8, 128), (8, 32768, 1, 32, 8, 128), (64, 4096, 1, 32, 8, 128)]
    assert decode.decode_points(quick=True, hdims=[128]) == quick
    assert decode.decode_points(quick=True, hdims=[64]) == []


def test_kv_bytes():
    # batch x context x heads_k x hdim x 2 (K and V) x 2 bytes
    assert decode.kv_bytes(1, 8192, 8, 128) == 8192 * 8 * 128 * 4 == 32 * 2**20
    assert decode.kv_bytes(128, 8192, 32, 64) == 8 * 2**30
    assert decode.kv_bytes(64, 4096, 8, 128, element_bytes=1) == 64 * 4096 * 8 * 128 * 2
    p = decode.DecodePoint(8, 32768, 4, 32, 8, 128)
    assert p.kv_bytes == 8 * 32768 * 8 * 128 * 2 * 2  # the query length does not change what is read


def test_rotation_count():
    assert decode.rotation_count(32 * 2**20) == 4  # 1 x 8k GQA: 4 caches, 128 MiB
    assert decode.rotation_count(4 * 2**20) == 25  # 25 x 4 MiB = 100 MiB
    assert decode.rotation_count(3 * 2**20) == 34  # 34 x 3 MiB = 102 MiB
    assert decode.rotation_count(2**34) == 4
    with pytest.raises(ValueError):
        decode.rotation_count(0)


@pytest.mark.parametrize("point", decode.decode_points() + [decode.DecodePoint(1, 1024, 1, 32, 8, 128),
                                                            decode.DecodePoint(2, 640, 4, 8, 2, 64)])
def test_each_point_walks_at_least_4_caches_over_100_mb(point):
    n = point.caches
    assert n >= 4 and point.rotation_bytes == n * point.kv_bytes > 100 * MB
    assert n == 4 or (n - 1) * point.kv_bytes < decode.MIN_ROTATION_BYTES  # no more than it takes


def test_points_over_40_gib_are_skipped():
    points = decode.decode_points()
    assert all(p.skip_reason is None for p in points)  # the issue's points all fit
    assert max(p.rotation_bytes for p in points) == 32 * 2**30  # 128 x 8k at 32:32 hdim 64, 4 caches
    big = decode.DecodePoint(256, 131072, 1, 32, 8, 128)
    assert big.skip_reason == "4 caches x 128.0 GiB = 512.0 GiB > 40.0 GiB"
    assert decode.DecodePoint(160, 8192, 1, 32, 32, 64).skip_reason is None  # 4 x 10 GiB: at the limit
    over = decode.DecodePoint(161, 8192, 1, 32, 32, 64)
    assert over.skip_reason == "4 caches x 10.1 GiB = 40.2 GiB > 40.0 GiB"


def test_a_skipped_point_allocates_nothing(monkeypatch):
    monkeypatch.setattr(decode, "decode_inputs", lambda *a, **kw: pytest.fail("must not allocate"))
    provider = decode.DecodeProvider("flashhopper", lambda x, p: pytest.fail("must not run"))
    row = decode.run_decode_point(decode.DecodePoint(256, 131072, 1, 32, 8, 128), [provider], 4e12,
                                  device="cpu")
    assert row["skipped"].endswith("> 40.0 GiB") and row["us"] == {"flashhopper": None}
    assert row["ratio"] is None and row["errors"] == {}


# --- inputs and the real makers, on the CPU ---

SMALL = decode.DecodePoint(2, 2048, 4, 4, 2, 64)  # 2 MiB of KV: 50 caches


def test_decode_inputs():
    inputs = decode.decode_inputs(SMALL, torch.bfloat16, "cpu")
    assert len(inputs) == SMALL.caches == 50
    x = inputs[0]
    assert x.q.shape == (2, 4, 4, 64) and x.k_cache.shape == x.v_cache.shape == (2, 2048, 2, 64)
    assert x.cache_seqlens.dtype == torch.int32 and x.cache_seqlens.tolist() == [2048, 2048]
    assert x.cu_seqlens_q.tolist() == [0, 4, 8] and x.cu_seqlens_k.tolist() == [0, 2048, 4096]
    assert x.cu_seqlens_q.dtype == x.cu_seqlens_k.dtype == torch.int32
    assert torch.equal(x.mask, visible_mask(4, 2048, causal=True)) and x.mask.shape == (4, 2048)
    assert x.mask[0, 2044] and not x.mask[0, 2045] and x.mask[3].all()  # bottom-right
    assert not torch.equal(inputs[0].k_cache, inputs[1].k_cache)  # independent caches
    assert not torch.equal(inputs[0].q, inputs[1].q)
    assert inputs[1].cache_seqlens is x.cache_seqlens  # the shared parts are shared
    one = decode.decode_inputs(decode.DecodePoint(2, 40, 1, 4, 2, 64), torch.bfloat16, "cpu", count=1)
    assert len(one) == 1 and one[0].mask is None


def _reference_kvcache(seen, q, k_cache, v_cache, **kw):
    seen.append(kw)
    return flash_attn_with_kvcache(q, k_cache, v_cache, backend="reference", **kw)


def _want(x):
    """The attention every provider must compute: flash_attn_with_kvcache's reference."""
    return flash_attn_with_kvcache(x.q, x.k_cache, x.v_cache, cache_seqlens=x.cache_seqlens, causal=True,
                                   backend="reference")


def test_flashhopper_provider_calls_the_cache(monkeypatch):
    from flashhopper import kvcache

    seen = []
    monkeypatch.setattr(kvcache, "flash_attn_with_kvcache", functools.partial(_reference_kvcache, seen))
    provider = decode.flashhopper_decode()
    x = decode.decode_inputs(SMALL, torch.bfloat16, "cpu", count=1)[0]
    with provider.context():
        got = provider.make(x, SMALL)()
    assert seen == [{"cache_seqlens": x.cache_seqlens, "causal": True}]
    torch.testing.assert_close(got, _want(x), rtol=0, atol=0)


@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)])
@pytest.mark.parametrize("enable_gqa", [True, False])
def test_sdpa_provider_computes_the_same_attention(q_len, heads, enable_gqa):
    point = decode.DecodePoint(2, 40, q_len, *heads, 64)
    x = decode.decode_inputs(point, torch.bfloat16, "cpu", count=1)[0]
    provider = decode.sdpa_decode(enable_gqa=enable_gqa)
    assert provider.info == {"gqa": "enable_gqa" if enable_gqa else "repeat_interleave"}
    got = provider.make(x, point)()
    assert got.shape == (2, q_len, heads[0], 64)
    torch.testing.assert_close(got, _want(x), rtol=2e-2, atol=2e-2)


def test_sdpa_reads_only_the_context(monkeypatch):
    """With a cache longer than the context, SDPA sees the first `context` keys (the cache's tail
    filled with NaN would poison the output otherwise)."""
    point = decode.DecodePoint(2, 40, 4, 4, 2, 64)
    x = decode.decode_inputs(point, torch.bfloat16, "cpu", count=1)[0]
    longer = torch.full((2, 48, 2, 64), float("nan"), dtype=torch.bfloat16)
    k, v = longer.clone(), longer.clone()
    k[:, :40], v[:, :40] = x.k_cache, x.v_cache
    y = decode.DecodeInputs(x.q, k, v, x.cache_seqlens, x.cu_seqlens_q, x.cu_seqlens_k, x.mask)
    got = decode.sdpa_decode().make(y, point)()
    torch.testing.assert_close(got, _want(x), rtol=2e-2, atol=2e-2)


def test_sdpa_probe(monkeypatch):
    assert decode.sdpa_takes_enable_gqa()  # the torch this runs on has it

    def old_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        return q

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", old_sdpa)
    assert not decode.sdpa_takes_enable_gqa()
    assert decode.sdpa_decode().info == {"gqa": "repeat_interleave"}


@pytest.fixture
def fake_fa4(monkeypatch):
    """flash_attn.cute.interface with a varlen function that records its keywords and computes with
    flashhopper's reference varlen (which takes seqused_k like FA4's)."""
    seen = []

    def fa4(q, k, v, qv=None, **kw):
        assert qv is None
        seen.append({"q": q, "k": k, "v": v, **kw})
        out = flash_attn_varlen_func(q, k, v, kw["cu_seqlens_q"], kw["cu_seqlens_k"], kw["max_seqlen_q"],
                                     kw["max_seqlen_k"], seqused_k=kw["seqused_k"], causal=kw["causal"],
                                     backend="reference")
        return out, torch.zeros(q.shape[1], q.shape[0])  # (out, lse)

    interface = types.ModuleType("flash_attn.cute.interface")
    interface.flash_attn_varlen_func = fa4
    cute = types.ModuleType("flash_attn.cute")
    cute.interface = interface
    package = types.ModuleType("flash_attn")
    package.cute = cute
    for name, module in (("flash_attn", package), ("flash_attn.cute", cute),
                         ("flash_attn.cute.interface", interface)):
        monkeypatch.setitem(sys.modules, name, module)
    return seen


@pytest.mark.parametrize("q_len", [1, 4])
def test_fa4_reads_the_cache_as_packed_rows(fake_fa4, q_len):
    point = decode.DecodePoint(2, 40, q_len, 4, 2, 64)
    x = decode.decode_inputs(point, torch.bfloat16, "cpu", count=1)[0]
    providers = decode.decode_providers(io.StringIO())
    assert [p.name for p in providers] == ["flashhopper", "fa4", "sdpa"]
    with providers[1].context():
        got = providers[1].make(x, point)()
    (call,) = fake_fa4
    assert call["q"].shape == (2 * q_len, 4, 64) and call["q"].data_ptr() == x.q.data_ptr()
    assert call["k"].shape == (80, 2, 64) and call["k"].data_ptr() == x.k_cache.data_ptr()  # no copy
    assert call["v"].data_ptr() == x.v_cache.data_ptr()
    assert call["cu_seqlens_q"].tolist() == [0, q_len, 2 * q_len]
    assert call["cu_seqlens_k"].tolist() == [0, 40, 80]
    assert call["seqused_k"] is x.cache_seqlens and call["causal"] is True
    assert (call["max_seqlen_q"], call["max_seqlen_k"]) == (q_len, 40)
    assert got.shape == (2, q_len, 4, 64)
    torch.testing.assert_close(got, _want(x), rtol=0, atol=0)


def test_fa4_is_skipped_with_a_note_when_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails as for an absent package
    out = io.StringIO()
    assert [p.name for p in decode.decode_providers(out)] == ["flashhopper", "sdpa"]
    assert out.getvalue().startswith("(FA4 not measured: flash_attn.cute unavailable:")


def test_import_needs_no_gpu():
    code = ("import sys, flashhopper.bench.decode as d; d.decode_points(); d.flashhopper_decode(); "
            "d.sdpa_decode(); "
            "assert 'cutlass' not in sys.modules and 'flashhopper.hopper' not in sys.modules, sys.modules")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# --- the timing loop with fake providers (capture and timing patched) ---


class Clock:
    """Fake time: each fake call advances it by its provider's cost; replay_ms reads the walk's
    advance."""

    def __init__(self):
        self.now = 0.0

    def replay_ms(self, walk):
        start = self.now
        walk()
        return self.now - start


def _fake(name, clock, cost_ms, scale=1.0, seen=None, fail=None):
    """A provider whose calls cost `cost_ms` of fake time and return q times `scale`."""

    def make(x, point):
        if fail:
            raise RuntimeError(f"{fail}\ndetails")
        if seen is not None:
            seen.append((name, x.q))

        def call():
            clock.now += cost_ms
            return x.q * scale

        return call

    return decode.DecodeProvider(name, make)


def _fake_capture(fail_for=(), differ_for=()):
    """capture() as on a GPU, without one: the walk runs the calls; `fail_for` providers' captures
    raise, `differ_for` providers' replays return other outputs."""

    def capture(calls):
        outs = [call() for call in calls]
        name = capture.current
        if name in fail_for:
            raise RuntimeError("operation not permitted when stream is capturing")
        if name in differ_for:
            outs = [o + 1 for o in outs]
        return lambda: [call() for call in calls], outs

    capture.current = None
    return capture


@pytest.fixture
def fake_gpu(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(decode, "replay_ms", clock.replay_ms)
    fake = _fake_capture(fail_for=("fa4",), differ_for=("odd",))
    real_prepare = decode.prepare

    def prepare(provider, *a, **kw):
        fake.current = provider.name
        return real_prepare(provider, *a, **kw)

    monkeypatch.setattr(decode, "capture", fake)
    monkeypatch.setattr(decode, "prepare", prepare)
    monkeypatch.setattr(decode, "copy_rate", lambda: {"bytes": 2**30, "moved_bytes": 2**31, "ms": 0.5,
                                                      "repeats": 10, "bytes_per_s": 4e12})
    monkeypatch.setattr(runner.torch.cuda, "get_device_name", lambda: "fake GPU")
    return clock


def test_run_point_times_graphs_takes_turns_and_falls_back_to_eager(fake_gpu):
    seen = []
    provs = [_fake("flashhopper", fake_gpu, 0.010, seen=seen), _fake("fa4", fake_gpu, 0.020, seen=seen),
             _fake("sdpa", fake_gpu, 0.008, scale=1.5, seen=seen),
             _fake("broken", fake_gpu, 1.0, fail="no kernel")]
    row = decode.run_decode_point(SMALL, provs, 4e12, device="cpu", rounds=2)
    n = SMALL.caches
    # each provider makes one call per cache, each cache its own q, the same caches for every provider
    assert [s[0] for s in seen] == ["flashhopper"] * n + ["fa4"] * n + ["sdpa"] * n
    qs = [s[1] for s in seen]
    assert len({q.data_ptr() for q in qs[:n]}) == n
    assert all(a is b for a, b in zip(qs[:n], qs[n:2 * n], strict=True))
    assert row["us"]["flashhopper"] == pytest.approx(10.0) and row["us"]["sdpa"] == pytest.approx(8.0)
    assert row["us"]["fa4"] == pytest.approx(20.0) and row["us"]["broken"] is None
    frac = SMALL.kv_bytes / 10e-6 / 4e12
    assert row["fraction"]["flashhopper"] == pytest.approx(frac)
    assert row["ratio"] == pytest.approx(0.8)  # against sdpa, the faster peer
    assert row["timing"] == {"flashhopper": "graph", "fa4": "eager", "sdpa": "graph"}
    assert row["eager"] == {"fa4": "graph capture failed: RuntimeError: operation not permitted when stream "
                                   "is capturing"}
    assert row["errors"] == {"broken": "RuntimeError: no kernel"}
    assert row["spread"]["flashhopper"] == pytest.approx([10.0, 10.0]) and row["rounds"] == 2
    assert row["caches"] == n and row["rotation_bytes"] == n * SMALL.kv_bytes and row["skipped"] is None
    agreement = row["agreement"]
    assert agreement["against"] == "sdpa"
    assert agreement["max_rel_diff"] == pytest.approx({"flashhopper": 1 / 3, "fa4": 1 / 3}, abs=1e-2)
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        decode.run_decode_point(SMALL, provs, 4e12, device="cpu", rounds=0)


def test_a_replay_that_differs_from_the_eager_call_is_timed_eagerly(fake_gpu):
    row = decode.run_decode_point(SMALL, [_fake("odd", fake_gpu, 0.01)], 4e12, device="cpu", rounds=1)
    assert row["timing"] == {"odd": "eager"}
    assert row["eager"]["odd"].startswith("graph capture failed: RuntimeError: the replay's output differs")
    assert row["us"]["odd"] == pytest.approx(10.0) and row["ratio"] is None and row["agreement"] is None


def test_run_bench_table_summary_and_json(fake_gpu, tmp_path):
    provs = [_fake("flashhopper", fake_gpu, 0.010), _fake("fa4", fake_gpu, 0.020),
             _fake("sdpa", fake_gpu, 0.008)]
    points = [SMALL, decode.DecodePoint(2, 640, 1, 8, 2, 64), decode.DecodePoint(256, 131072, 1, 32, 8, 128)]
    out, path = io.StringIO(), tmp_path / "decode.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decode, "run_decode_point", functools.partial(decode.run_decode_point, device="cpu"))
        report = decode.run_decode_bench(points, json_path=str(path), providers=provs, out=out, rounds=1)
    text = out.getvalue()
    lines = text.splitlines()
    assert lines[0] == ("fake GPU, torch " + torch.__version__ + ", bf16; device-to-device copy of 1.0 GiB: "
                        "4.00 TB/s (2 x 1.0 GiB moved per copy: read + write; median of 10)")
    header = lines.index(decode.format_header(["flashhopper", "fa4", "sdpa"]))
    assert "fh/best" in lines[header] and "flashhopper us" in lines[header]
    first = lines[header + 1].split()
    frac = SMALL.kv_bytes / 10e-6 / 4e12
    assert first[:7] == ["2", "2048", "4", "4:2", "64", "50", "2.0"]
    assert first[7:] == ["10.0", f"{frac:.2f}", "20.0*", f"{frac / 2:.2f}", "8.0", f"{frac * 1.25:.2f}",
                         "0.80"]
    assert len(lines[header + 1]) == len(lines[header])
    assert lines[header + 2] == ("    fa4: graph capture failed: RuntimeError: operation not permitted when "
                                 "stream is capturing")
    skipped = lines.index("    skipped: its caches would not fit: 4 caches x 128.0 GiB = 512.0 GiB > "
                          "40.0 GiB")
    assert lines[skipped - 1].split()[:7] == ["256", "131072", "1", "32:8", "128", "4", "131072.0"]
    assert lines[skipped - 1].split()[7:] == ["-", "-", "-", "-", "-", "-", "-"]
    assert len(lines[skipped - 1]) == len(lines[header])
    assert "* = timed eagerly" in text and "fh/best = flashhopper / max(fa4, sdpa)" in text
    assert "geomean flashhopper / max(fa4, sdpa): 0.800 over 2 of 3 points" in text
    assert "lowest: 0.800 at " in text and "flashhopper reads its KV at" in text
    stored = json.loads(path.read_text())
    assert stored["benchmark"] == "decode" and stored["providers"] == ["flashhopper", "fa4", "sdpa"]
    assert stored["copy"]["bytes_per_s"] == 4e12 and "2 x the copied size" in stored["byte_convention"]
    assert stored["rotation"] == {"min_bytes": 100 * 2**20, "min_caches": 4, "max_bytes": 40 * 2**30}
    assert [r["kv_bytes"] for r in stored["results"]] == [p.kv_bytes for p in points]
    assert stored["results"][0]["timing"]["fa4"] == "eager" and stored["results"][2]["skipped"]
    assert stored["summary"]["geomean_ratio"] == pytest.approx(0.8)
    assert stored["summary"]["points"] == 3 and stored["summary"]["points_run"] == 2
    assert report["results"][1]["caches"] == decode.DecodePoint(2, 640, 1, 8, 2, 64).caches


def test_allocations_draw_fresh_caches_each_round_and_report_percentiles(fake_gpu):
    """--allocations: every round new caches and q for every provider (the previous ones freed, the
    spacers held), each provider prepared and timed once a round in an order rotated per round;
    p10 / p50 / p90 of the fractions, and the spread check in the summary."""
    seen, costs = [], [0.010, 0.012, 0.010, 0.011]  # one per round

    def make(x, point):
        cost = costs[sum(1 for s in seen if s[0] == "flashhopper") // SMALL.caches]
        seen.append(("flashhopper", x.q))

        def call():
            fake_gpu.now += cost
            return x.q

        return call

    provs = [decode.DecodeProvider("flashhopper", make), _fake("sdpa", fake_gpu, 0.008, seen=seen)]
    row = decode.run_decode_point(SMALL, provs, 4e12, device="cpu", rounds=4, allocations=True)
    n = SMALL.caches
    names = [s[0] for s in seen]
    # the order rotates: (flashhopper, sdpa), (sdpa, flashhopper), ...
    assert names == (["flashhopper"] * n + ["sdpa"] * n + ["sdpa"] * n + ["flashhopper"] * n) * 2
    assert len({id(s[1]) for s in seen}) == 4 * n  # a provider's caches are fresh each round
    assert row["allocations"] == 4 and row["rounds"] == 4
    pct = row["percentiles"]
    assert set(pct) == {"flashhopper", "sdpa"} and pct["sdpa"]["p10"] == pytest.approx(pct["sdpa"]["p50"])
    assert pct["flashhopper"]["p10"] <= pct["flashhopper"]["p50"] <= pct["flashhopper"]["p90"]
    assert row["ratio"] is not None and row["timing"] == {"flashhopper": "graph", "sdpa": "graph"}
    summary = decode.summarize([row])
    assert summary["spread"]["points"] == 1
    widest = pct["flashhopper"]["p50"] / pct["flashhopper"]["p10"]
    assert summary["spread"]["widest"] == pytest.approx(widest)
    assert (summary["spread"]["wider_than_allowed"] != []) == (widest > 1.05)
    assert any(line.startswith("spread p50/p10 over allocations") for line in decode.format_summary(summary))
    plain = decode.run_decode_point(SMALL, provs[1:], 4e12, device="cpu", rounds=2)
    assert "percentiles" not in plain and "spread" not in decode.summarize([plain])


def test_summary_without_peers():
    row = {"batch": 1, "context": 8192, "q_len": 1, "heads_q": 32, "heads_k": 8, "hdim": 128, "skipped": None,
           "ratio": None, "fraction": {"flashhopper": 0.5}}
    summary = decode.summarize([row])
    assert summary["geomean_ratio"] is None and summary["flashhopper_fraction"] == [0.5, 0.5]
    assert decode.format_summary(summary) == [
        "no point has a flashhopper / max(fa4, sdpa) ratio (peers not measured)",
        "flashhopper reads its KV at 0.50 to 0.50 of the copy rate"]
    assert math.isclose(decode.summarize([{**row, "ratio": 2.0}])["geomean_ratio"], 2.0)


# --- CLI ---


def test_cli_parses_decode():
    args = cli.build_parser().parse_args(["bench", "--decode"])
    assert args.decode and not args.quick and not args.varlen and args.rounds is None
    argv = ["bench", "--decode", "--quick", "--json", "d.json", "--rounds", "5"]
    args = cli.build_parser().parse_args(argv)
    assert args.decode and args.quick and args.json == "d.json" and args.rounds == 5
    assert not cli.build_parser().parse_args(["bench"]).decode


def test_cli_bench_decode_runs_the_points(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(decode, "run_decode_bench", lambda points, **kw: calls.append((points, kw)) or {})
    assert cli.main(["bench", "--decode"]) == 0
    assert cli.main(["bench", "--decode", "--quick", "--json", "d.json", "--rounds", "1"]) == 0
    assert cli.main(["bench", "--decode", "--hdim", "64", "--dtype", "fp16"]) == 0
    assert cli.main(["bench", "--decode", "--quick", "--allocations", "20"]) == 0
    (full, full_kw), (quick, quick_kw), (mha, mha_kw), (_, alloc_kw) = calls
    assert full == decode.decode_points() and full_kw == {"dtype": "bf16", "json_path": None, "rounds": 3,
                                                          "allocations": False}
    assert quick == decode.decode_points(quick=True)
    assert quick_kw == {"dtype": "bf16", "json_path": "d.json", "rounds": 1, "allocations": False}
    assert alloc_kw == {"dtype": "bf16", "json_path": None, "rounds": 20, "allocations": True}
    assert {(p.heads_q, p.heads_k, p.hdim) for p in mha} == {(32, 32, 64)} and len(mha) == 12
    assert mha_kw["dtype"] == "fp16"


@pytest.mark.parametrize(("argv", "message"), [
    (["--dtype", "e4m3"], "--decode times bf16 or fp16 caches, not --dtype e4m3"),
    (["--dtype", "fp8"], "--decode times bf16 or fp16 caches, not --dtype fp8"),
    (["--bwd"], "--bwd does not apply to --decode (decode is inference only: there is no backward)"),
    (["--varlen"], "--varlen does not apply to --decode (a benchmark of its own: run one at a time)"),
    (["--ablation"], "--ablation does not apply to --decode"),
    (["--plot", "x.png"], "--plot does not apply to --decode"),
    (["--set", "pingpong=false"], "--set does not apply to --decode"),
    (["--seqlen", "1024"], "--seqlen does not apply to --decode (fixed by its batch x context points)"),
    (["--causal", "yes"], "--causal does not apply to --decode"),
    (["--hdim", "256"], "--decode --hdim [256] not benchmarked; choose from [64, 128]"),
    (["--rounds", "0"], "--rounds takes N >= 1, got 0"),
    (["--allocations", "20", "--rounds", "2"], "--allocations replaces --rounds"),
    (["--quick", "--hdim", "64"], "no decode point left: --quick is hdim 128 only"),
])
def test_cli_bench_decode_refuses_what_does_not_apply(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(decode, "run_decode_bench", lambda *a, **kw: pytest.fail("must not run"))
    assert cli.main(["bench", "--decode", *argv]) == 2  # before any GPU check: refused on a CPU machine too
    assert message in capsys.readouterr().err


def test_cli_bench_decode_without_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "--decode", "--quick"]) == 2
    assert capsys.readouterr().err == "flashhopper bench: needs a CUDA GPU (none visible)\n"
