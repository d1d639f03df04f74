"""`flashhopper bench --varlen` without a GPU: packings, the FLOP count, the makers on the CPU, the
table and the command line (the timing itself needs a GPU)."""

import functools
import io
import json
import os
import subprocess
import sys
import types

import pytest
import torch

from flashhopper import cli
from flashhopper.bench import runner, varlen
from flashhopper.interface import flash_attn_varlen_func
from flashhopper.reference import visible_mask

# --- packings ---


def test_packings_are_the_stated_documents():
    a, b, c = varlen.packings()
    assert (a.name, len(a.seqlens), b.name, len(b.seqlens)) == ("16x100-4000", 16, "512x16-512", 512)
    assert all(100 <= n < 4000 for n in a.seqlens) and all(16 <= n < 512 for n in b.seqlens)
    # targets.md's serving table: the same seed-0 packings hold 26,704 and 135,022 tokens
    assert (a.total, b.total) == (26704, 135022)
    assert a.max_seqlen == max(a.seqlens) and b.max_seqlen == 511
    # the equal documents the dense kernel is timed on as well: the grid's 16 x 1024 tokens
    assert (c.name, c.seqlens, c.equal) == ("16x1024", (1024,) * 16, True) and not (a.equal or b.equal)


def test_packings_are_deterministic_and_leave_the_global_rng_alone():
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = varlen.packings()
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(7)
    assert varlen.packings() == first
    assert varlen.make_packing("x", 16, 100, 4000, seed=1) != first[0]


def test_cu_seqlens():
    packing = varlen.Packing("tiny", (3, 1, 5))
    cu = packing.cu_seqlens()
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 4, 9]
    a = varlen.packings()[0]
    cu = a.cu_seqlens()
    assert cu.shape == (17,) and cu[-1].item() == a.total and cu.diff().tolist() == list(a.seqlens)


# --- FLOPs ---


@pytest.mark.parametrize("causal", [False, True])
def test_visible_pairs_match_the_mask(causal):
    for lq in range(0, 13):
        for lk in range(0, 13):
            want = int(visible_mask(lq, lk, causal).sum()) if lq and lk else 0
            assert varlen.visible_pairs(lq, lk, causal) == want, (lq, lk, causal)


def test_varlen_flops_sum_the_documents():
    seqlens_q, seqlens_k = (5, 1, 9, 7), (5, 3, 4, 7)
    for causal in (False, True):
        pairs = sum(int(visible_mask(lq, lk, causal).sum())
                    for lq, lk in zip(seqlens_q, seqlens_k, strict=True))
        assert varlen.varlen_flops(seqlens_q, seqlens_k, 16, 128, causal=causal) == 4 * pairs * 128 * 16
        assert varlen.varlen_flops(seqlens_q, seqlens_k, 2, 192, 128, causal) == 2 * pairs * (192 + 128) * 2
        assert varlen.varlen_flops(seqlens_q, seqlens_k, 16, 64, causal=causal, backward=True) == \
            pytest.approx(2.5 * 4 * pairs * 64 * 16)
    # a causal document of L tokens: L (L + 1) / 2 pairs, not L^2 / 2
    assert varlen.varlen_flops((100,), (100,), 1, 64, causal=True) == 4 * 5050 * 64


def test_points():
    points = varlen.varlen_points()
    # 3 packings x 4 head dims ((192, 128) among them) x 2 masks x fwd, bwd
    assert len(points) == len(set(points)) == 48
    assert sum(p.backward and p.split for p in points) == 6
    assert points[0].label == "16x100-4000 hdim 64 non-causal fwd" and points[1].direction == "bwd"
    quick = varlen.varlen_points(quick=True)
    assert [(p.packing.name, p.hdim, p.causal, p.direction) for p in quick] == [
        ("16x100-4000", 128, False, "fwd"), ("16x100-4000", 128, False, "bwd"),
        ("16x100-4000", 128, True, "fwd"), ("16x100-4000", 128, True, "bwd")]
    picked = varlen.varlen_points(hdims=[192], causal=(True,))
    assert [(p.hdim, p.hdim_v, p.hdim_label, p.backward) for p in picked] == \
        [(192, 128, "192/128", False), (192, 128, "192/128", True)] * 3
    p = quick[3]
    assert p.flops == varlen.varlen_flops(p.packing.seqlens, p.packing.seqlens, 16, 128, causal=True,
                                          backward=True)


# --- timing rows with fake providers ---


def _provider(name, ms, seen=None, split=True, fail=None):
    """A fake provider whose timed call returns its time in ms (time_ms is patched to call it)."""

    def maker(x, causal):
        if seen is not None:
            seen.append((name, x.q, x.q.shape, x.v.shape, x.dout is not None, causal))
        if fail:
            raise RuntimeError(f"{fail}\ndetails")
        return lambda: next(ms) if not isinstance(ms, float) else ms

    return varlen.VarlenProvider(name, maker, maker, split_hdims=split)


@pytest.fixture
def fake_timing(monkeypatch):
    monkeypatch.setattr(runner, "time_ms", lambda fn: fn())
    monkeypatch.setattr(runner, "matmul_tflops", lambda: 800.0)
    monkeypatch.setattr(runner.torch.cuda, "get_device_name", lambda: "fake GPU")
    monkeypatch.setattr(varlen, "_compared", lambda result, backward: ())


SMALL = varlen.Packing("small", (5, 9, 2))


def test_run_point_takes_turns_on_fresh_inputs_and_keeps_the_median(fake_timing):
    seen = []
    provs = [_provider("flashhopper", iter([0, 2.0, 0, 1.0, 0, 4.0]), seen),  # first call of a round: untimed
             _provider("fa2", 2.0, seen), _provider("fa4", iter([0, 4.0] * 3), seen),
             _provider("broken", 1.0, seen, fail="no kernel")]
    point = varlen.VarlenPoint(SMALL, 64, 64, True, True, heads=2)
    row = varlen.run_varlen_point(point, provs, device="cpu", rounds=3)
    assert [s[0] for s in seen] == ["flashhopper", "fa2", "fa4", "broken"] + ["flashhopper", "fa2", "fa4"] * 2
    assert all(s[2] == (16, 2, 64) and s[4] and s[5] for s in seen)  # packed (total, heads, d), dout
    q1, q2, q3 = (s[1] for s in seen if s[0] == "flashhopper")  # each round its own q
    assert not (torch.equal(q1, q2) or torch.equal(q2, q3)) and q1 is seen[1][1]  # the providers share it
    assert row["tflops"]["flashhopper"] == pytest.approx(point.flops / 2.0 / 1e9)  # median of 2, 1, 4 ms
    assert row["spread"]["flashhopper"] == pytest.approx([point.flops / 4e9, point.flops / 1e9])
    assert row["ratio"] == pytest.approx(1.0)  # against fa2's 2 ms, the best peer
    assert row["tflops"]["broken"] is None and row["errors"] == {"broken": "RuntimeError: no kernel"}
    assert (row["packing"], row["tokens"], row["documents"], row["direction"]) == ("small", 16, 3, "bwd")
    assert row["flops"] == point.flops and row["rounds"] == 3
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        varlen.run_varlen_point(point, provs, device="cpu", rounds=0)


def test_run_point_skips_providers_without_split_head_dims(fake_timing):
    seen = []
    provs = [_provider("flashhopper", 1.0, seen), _provider("fa2", 1.0, seen, split=False),
             _provider("fa4", 2.0, seen)]
    point = varlen.VarlenPoint(SMALL, 192, 128, False, False, heads=2)
    row = varlen.run_varlen_point(point, provs, device="cpu", rounds=1)
    assert [(s[0], s[2], s[3], s[4]) for s in seen] == [("flashhopper", (16, 2, 192), (16, 2, 128), False),
                                                        ("fa4", (16, 2, 192), (16, 2, 128), False)]
    assert row["skipped"] == {"fa2": "no head dims (192, 128)"} and row["errors"] == {}
    assert row["tflops"]["fa2"] is None and row["ratio"] == pytest.approx(2.0)


def test_dense_provider_only_on_equal_documents_and_its_ratio(fake_timing, tmp_path):
    """fh-dense (flashhopper's dense kernel on the packed tensors viewed as a batch) is timed only where
    every document has one length; fh/dense is flashhopper over it, apart from the peers' ratio."""
    provs = [_provider("flashhopper", 2.0), varlen.VarlenProvider("fh-dense", *[_provider("d", 1.0).make] * 2,
                                                                    equal_only=True),
             _provider("fa2", 4.0), _provider("fa4", 1.0)]
    equal = varlen.Packing("equal", (4, 4, 4))
    points = [varlen.VarlenPoint(SMALL, 64, 64, False, False, heads=2),
              varlen.VarlenPoint(equal, 64, 64, True, False, heads=2)]
    rows = [varlen.run_varlen_point(point, provs, device="cpu", rounds=1) for point in points]
    assert rows[0]["skipped"] == {"fh-dense": "documents of different lengths"}
    assert rows[0]["dense_ratio"] is None
    assert rows[1]["skipped"] == {} and rows[1]["dense_ratio"] == pytest.approx(0.5)
    assert rows[1]["ratio"] == pytest.approx(0.5)  # against fa4's 1 ms: fh-dense is no peer
    names = [p.name for p in provs]
    assert varlen.format_header(names).split()[-2:] == ["fh/best", "fh/dense"]
    assert varlen.format_row(rows[1], names).split()[-2:] == ["0.50", "0.50"]
    assert varlen.format_row(rows[0], names).split()[-1] == "-"
    summary = varlen.summarize(rows)
    assert summary["dense"] == {"geomean_ratio": pytest.approx(0.5), "points": 1,
                                "min_ratio": pytest.approx(0.5), "min_point": "equal hdim 64 causal fwd"}
    assert varlen.format_summary(summary)[-1] == (
        "flashhopper varlen / fh-dense (equal documents): geomean 0.500 over 1 points, lowest 0.500 at "
        "equal hdim 64 causal fwd")


def test_dense_provider_views_the_packing_as_a_batch(monkeypatch):
    seen = []

    def fake_dense(q, k, v, causal, deterministic):
        seen.append((q.shape, k.shape, v.shape, causal, deterministic))
        return q + k + v

    monkeypatch.setattr("flashhopper.interface.flash_attn_func", fake_dense)
    x = _packed(varlen.Packing("equal", (4, 4, 4)))
    out = varlen.flashhopper_dense().make(x, True)()
    assert seen == [((3, 4, 2, 64), (3, 4, 2, 64), (3, 4, 2, 64), True, False)]
    assert torch.equal(out, x.q + x.k + x.v)


def test_run_bench_table_summary_and_json(fake_timing, tmp_path):
    provs = [_provider("flashhopper", 2.0), _provider("fa2", 4.0, split=False), _provider("fa4", 1.0)]
    points = [varlen.VarlenPoint(SMALL, 128, 128, False, False, heads=2),
              varlen.VarlenPoint(SMALL, 128, 128, True, True, heads=2),
              varlen.VarlenPoint(SMALL, 192, 128, True, False, heads=2)]
    out, path = io.StringIO(), tmp_path / "varlen.json"
    run_point = functools.partial(varlen.run_varlen_point, device="cpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(varlen, "run_varlen_point", run_point)
        report = varlen.run_varlen_bench(points, json_path=str(path), providers=provs, out=out, rounds=2)
    text = out.getvalue()
    lines = text.splitlines()
    header = lines.index(varlen.format_header(["flashhopper", "fa2", "fa4"]))
    assert lines[header + 1].split() == ["small", "128", "no", "fwd", "0.0", "0.0", "0.0", "0.50"]
    assert lines[header + 3].split()[:4] == ["small", "192/128", "yes", "fwd"] and " - " in lines[header + 3]
    assert all(len(line) == len(lines[header]) for line in lines[header + 1:header + 4])
    assert ("geomean flashhopper / max(fa2, fa4): 0.500 over 3 of 3 points (fwd 0.500 over 2, bwd 0.500 "
            "over 1)") in text
    assert "lowest: 0.500 at small hdim 128 non-causal fwd" in text
    assert "median of 2 round(s) on fresh inputs" in text and "packing small: 3 documents, 16 tokens" in text
    stored = json.loads(path.read_text())
    assert stored["benchmark"] == "varlen" and stored["providers"] == ["flashhopper", "fa2", "fa4"]
    assert stored["packings"]["small"] == {"documents": 3, "tokens": 16, "max_seqlen": 9,
                                           "seqlens": [5, 9, 2]}
    assert stored["rounds"] == 2 and "L (L + 1) / 2" in stored["flop_convention"]
    assert stored["summary"]["geomean_ratio"] == pytest.approx(0.5)
    assert [r["flops"] for r in stored["results"]] == [p.flops for p in points]
    assert report["results"][2]["skipped"] == {"fa2": "no head dims (192, 128)"}


def test_agreement_flags_a_provider_that_computes_something_else(monkeypatch):
    monkeypatch.setattr(runner, "time_ms", lambda fn: 1.0)
    monkeypatch.setattr(runner, "matmul_tflops", lambda: 800.0)
    monkeypatch.setattr(runner.torch.cuda, "get_device_name", lambda: "fake GPU")

    def attn(scale, q, k, v, cu, max_seqlen, causal):
        return torch.ones(q.shape[0], q.shape[1], v.shape[-1]) * scale

    provs = [varlen.differentiable_varlen("flashhopper", functools.partial(attn, 2.0)),
             varlen.differentiable_varlen("fa2", functools.partial(attn, 1.0)),
             varlen.differentiable_varlen("fa4", lambda *a: (attn(1.01, *a), None))]
    point = varlen.VarlenPoint(SMALL, 64, 64, False, False, heads=2)
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(varlen, "run_varlen_point", functools.partial(varlen.run_varlen_point, device="cpu"))
        report = varlen.run_varlen_bench([point], providers=provs, out=out, rounds=1)
    agreement = report["results"][0]["agreement"]
    assert agreement["against"] == "fa2"
    assert agreement["max_rel_diff"] == pytest.approx({"flashhopper": 1.0, "fa4": 0.01})
    assert "    flashhopper: differs from fa2 by 1 of its largest value" in out.getvalue()
    assert "fa4: differs" not in out.getvalue()


def test_relative_difference():
    want = (torch.tensor([1.0, -4.0]), torch.tensor([2.0]))
    assert varlen.relative_difference((torch.tensor([1.0, -3.0]), torch.tensor([2.0])), want) == 0.25
    assert varlen.relative_difference((torch.tensor([1.0, 2.0]), torch.tensor([1.0])), want) == 1.5
    for bad in (float("nan"), float("inf")):  # a NaN must not pass for agreement
        assert varlen.relative_difference((torch.tensor([1.0, bad]), want[1]), want) == float("inf")


# --- the real makers, on the CPU ---


def _reference_varlen(seen, q, k, v, cu_q, cu_k, max_q, max_k, causal, deterministic):
    seen.append((causal, deterministic, max_q, max_k))
    return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, backend="reference")


def _packed(packing, d=64, dv=64, heads=2, backward=True):
    point = varlen.VarlenPoint(packing, d, dv, True, backward, heads=heads)
    return varlen.packed_inputs(point, torch.bfloat16, "cpu", packing.cu_seqlens())


def test_flashhopper_provider_calls_the_varlen_function(monkeypatch):
    from flashhopper import interface

    seen = []
    monkeypatch.setattr(interface, "flash_attn_varlen_func", functools.partial(_reference_varlen, seen))
    provider, x = varlen.flashhopper_varlen(), _packed(SMALL)
    with provider.context():
        out = provider.make(x, True)()
        grads = provider.make_bwd(x, True)()
    assert seen == [(True, False, 9, 9)] * 2
    assert out.shape == (16, 2, 64) and [g.shape for g in grads] == [(16, 2, 64)] * 3
    assert not any(t.requires_grad for t in (x.q, x.k, x.v))  # the round's tensors are left as they were


def test_backward_maker_times_autograd_alone(monkeypatch):
    """The forward runs in the maker; the timed call gives the gradients of the reference backend,
    the same on every call (the graph is kept)."""
    from flashhopper import interface

    monkeypatch.setattr(interface, "flash_attn_varlen_func", functools.partial(_reference_varlen, []))
    x = _packed(SMALL)
    call = varlen.flashhopper_varlen().make_bwd(x, True)
    grads = call()
    assert all(torch.equal(a, b) for a, b in zip(grads, call(), strict=True))
    q, k, v = (t.detach().requires_grad_() for t in (x.q, x.k, x.v))
    out = interface.flash_attn_varlen_func(q, k, v, x.cu_seqlens, x.cu_seqlens, 9, 9, True, False)
    for got, want in zip(grads, torch.autograd.grad(out, (q, k, v), x.dout), strict=True):
        assert torch.equal(got, want)


def _bind(schema, args, kwargs) -> dict:
    names = [a.name for a in schema.arguments]
    return {**dict(zip(names, args, strict=False)), **kwargs}


def test_fa2_calls_match_the_installed_schemas(monkeypatch):
    """The aten operators are CUDA only: fakes record the calls, bound to the installed torch's schemas."""
    aten = torch.ops.aten
    fwd_schema = aten._flash_attention_forward.default._schema
    bwd_schema = aten._flash_attention_backward.default._schema
    calls = {}

    def fake_fwd(*args, **kwargs):
        calls["fwd"] = _bind(fwd_schema, args, kwargs)
        q, v = args[0], args[2]
        return torch.zeros(q.shape[0], q.shape[1], v.shape[-1]), "lse", "rng", "unused", "debug"

    def fake_bwd(*args, **kwargs):
        calls["bwd"] = _bind(bwd_schema, args, kwargs)
        return "dq", "dk", "dv"

    fake_aten = types.SimpleNamespace(_flash_attention_forward=fake_fwd, _flash_attention_backward=fake_bwd)
    monkeypatch.setattr(torch.ops, "aten", fake_aten)
    x = _packed(SMALL, d=128, dv=128)
    provider = varlen.fa2_varlen()
    assert not provider.split_hdims
    provider.make(x, True)()
    assert calls["fwd"]["query"] is x.q and calls["fwd"]["value"] is x.v
    assert calls["fwd"]["cum_seq_q"] is x.cu_seqlens and calls["fwd"]["cum_seq_k"] is x.cu_seqlens
    assert (calls["fwd"]["max_q"], calls["fwd"]["max_k"], calls["fwd"]["dropout_p"]) == (9, 9, 0.0)
    assert calls["fwd"]["is_causal"] is True and calls["fwd"]["return_debug_mask"] is False
    assert calls["fwd"]["scale"] == pytest.approx(128**-0.5)
    calls.clear()
    assert provider.make_bwd(x, False)() == ("dq", "dk", "dv")
    bwd = calls["bwd"]
    assert bwd["grad_out"] is x.dout and bwd["query"] is x.q and bwd["logsumexp"] == "lse"
    assert bwd["out"].shape == (16, 2, 128) and bwd["is_causal"] is False and bwd["dropout_p"] == 0.0
    assert list(bwd)[12:14] == [a.name for a in bwd_schema.arguments][12:14]  # rng state / offset
    assert (bwd[list(bwd)[12]], bwd[list(bwd)[13]]) == ("rng", "unused")
    assert (bwd["max_q"], bwd["max_k"], bwd["scale"]) == (9, 9, pytest.approx(128**-0.5))


def test_fa4_is_skipped_with_a_note_when_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails as for an absent package
    out = io.StringIO()
    provs = varlen.varlen_providers(out)
    assert [p.name for p in provs] == ["flashhopper", "fh-dense", "fa2"]
    assert out.getvalue().startswith("(FA4 not measured: flash_attn.cute unavailable:")


def test_fa4_called_by_keyword_and_its_lse_dropped(monkeypatch):
    seen = []

    def fake_fa4(q, k, v, qv=None, **kw):
        assert qv is None
        seen.append(kw)
        return q + k + v, torch.zeros(q.shape[1], q.shape[0])  # (out, lse)

    interface = types.ModuleType("flash_attn.cute.interface")
    interface.flash_attn_varlen_func = fake_fa4
    cute = types.ModuleType("flash_attn.cute")
    cute.interface = interface
    package = types.ModuleType("flash_attn")
    package.cute = cute
    for name, module in (("flash_attn", package), ("flash_attn.cute", cute), ("flash_attn.cute.interface",
                                                                                interface)):
        monkeypatch.setitem(sys.modules, name, module)
    provs = varlen.varlen_providers(io.StringIO())
    assert [p.name for p in provs] == ["flashhopper", "fh-dense", "fa2", "fa4"] and provs[3].split_hdims
    x = _packed(SMALL)
    with provs[3].context():
        grads = provs[3].make_bwd(x, True)()
    assert [g.shape for g in grads] == [(16, 2, 64)] * 3
    assert seen == [{"cu_seqlens_q": x.cu_seqlens, "cu_seqlens_k": x.cu_seqlens, "max_seqlen_q": 9,
                     "max_seqlen_k": 9, "causal": True}]


def test_import_needs_no_gpu():
    code = ("import sys, flashhopper.bench.varlen as v; v.varlen_points(); "
            "assert 'cutlass' not in sys.modules and 'flashhopper.hopper' not in sys.modules, sys.modules")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# --- CLI ---


def test_cli_parses_varlen():
    args = cli.build_parser().parse_args(["bench", "--varlen"])
    assert args.varlen and not args.quick and args.rounds is None
    argv = ["bench", "--varlen", "--quick", "--json", "v.json", "--rounds", "5"]
    args = cli.build_parser().parse_args(argv)
    assert args.varlen and args.quick and args.json == "v.json" and args.rounds == 5
    assert not cli.build_parser().parse_args(["bench"]).varlen


def test_cli_bench_varlen_runs_the_points(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(varlen, "run_varlen_bench", lambda points, **kw: calls.append((points, kw)) or {})
    assert cli.main(["bench", "--varlen"]) == 0
    assert cli.main(["bench", "--varlen", "--quick", "--json", "v.json", "--rounds", "1"]) == 0
    assert cli.main(["bench", "--varlen", "--bwd", "--hdim", "64", "192", "--causal", "yes"]) == 0
    assert cli.main(["bench", "--varlen", "--hdim", "192", "--dtype", "fp16"]) == 0
    (full, full_kw), (quick, quick_kw), (bwd, _), (split, split_kw) = calls
    assert full == varlen.varlen_points() and full_kw == {"dtype": "bf16", "json_path": None, "rounds": 3}
    assert quick == varlen.varlen_points(quick=True) and quick_kw == {"dtype": "bf16", "json_path": "v.json",
                                                                      "rounds": 1}
    assert [(p.packing.name, p.hdim, p.causal, p.direction) for p in bwd] == [
        ("16x100-4000", 64, True, "bwd"), ("16x100-4000", 192, True, "bwd"), ("512x16-512", 64, True, "bwd"),
        ("512x16-512", 192, True, "bwd"), ("16x1024", 64, True, "bwd"), ("16x1024", 192, True, "bwd")]
    assert {(p.hdim, p.hdim_v) for p in split} == {(192, 128)} and len(split) == 12
    assert split_kw["dtype"] == "fp16"


@pytest.mark.parametrize(("argv", "message"), [
    (["--dtype", "e4m3"], "--varlen times bf16 or fp16, not --dtype e4m3"),
    (["--dtype", "fp8"], "--varlen times bf16 or fp16, not --dtype fp8"),
    (["--ablation"], "--ablation does not apply to --varlen"),
    (["--plot", "x.png"], "--plot does not apply to --varlen"),
    (["--set", "pingpong=false"], "--set does not apply to --varlen"),
    (["--seqlen", "1024"], "--seqlen does not apply to --varlen (fixed by its packings)"),
    (["--hdim", "96"], "--varlen --hdim [96] not benchmarked; choose from [64, 128, 192, 256]"),
    (["--rounds", "0"], "--rounds takes N >= 1, got 0"),
])
def test_cli_bench_varlen_refuses_other_options(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(varlen, "run_varlen_bench", lambda *a, **kw: pytest.fail("must not run"))
    assert cli.main(["bench", "--varlen", *argv]) == 2  # before any GPU check: refused on a CPU machine too
    assert message in capsys.readouterr().err


def test_cli_bench_varlen_without_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "--varlen", "--quick"]) == 2
    assert capsys.readouterr().err == "flashhopper bench: needs a CUDA GPU (none visible)\n"
