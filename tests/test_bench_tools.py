"""Benchmark tooling that needs no GPU: summary math, the plot, the ablation table and CLI guards."""

import contextlib
import io
import json
import os
import pathlib
import sys

import pytest

from flashhopper import cli
from flashhopper.bench import ablation
from flashhopper.bench.summary import format_summary, geomean, summarize

GRID_JSON = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "fwd_grid.json"


def _row(hdim, causal, seqlen, ours, cudnn, fa4):
    tflops = {"flashhopper": ours, "cudnn": cudnn, "fa4": fa4}
    peers = [t for t in (cudnn, fa4) if t]
    ratio = ours / max(peers) if ours and peers else None
    return {"hdim": hdim, "causal": causal, "seqlen": seqlen, "tflops": tflops, "ratio": ratio}


SYNTHETIC = {
    "matmul_tflops": 800.0,
    "results": [
        _row(64, False, 512, 300.0, 400.0, 200.0),  # 0.75: the lowest
        _row(128, True, 8192, 600.0, 500.0, 480.0),  # 1.2
        _row(128, False, 16384, 720.0, 600.0, 720.0),  # 1.0; 720 / 800 = 0.9 of matmul
        _row(256, False, 1024, 500.0, None, None),  # no peer: not in the geomean
    ],
}


def test_geomean():
    assert geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert geomean([0.9]) == pytest.approx(0.9)
    with pytest.raises(ValueError):
        geomean([])
    with pytest.raises(ValueError):
        geomean([1.0, 0.0])


def test_summary_math():
    s = summarize(SYNTHETIC)
    assert s["points"] == 4 and s["points_with_ratio"] == 3
    assert s["geomean_ratio"] == pytest.approx((0.75 * 1.2 * 1.0) ** (1 / 3))
    assert s["min_ratio"] == pytest.approx(0.75)
    assert s["min_point"] == {"hdim": 64, "causal": False, "seqlen": 512}
    frac = s["matmul_fraction"]
    assert frac["fraction"] == pytest.approx(0.9)
    assert frac["tflops"] == 720.0 and frac["matmul_tflops"] == 800.0
    lines = format_summary(s)
    assert len(lines) == 3
    assert "0.965 over 3 of 4 points (target >= 1.05: not met)" in lines[0]
    assert "0.750 at hdim 64 non-causal seqlen 512 (target >= 0.95: not met)" in lines[1]
    assert "hdim 128 non-causal seqlen 16384: 720 TFLOP/s = 0.900 of bf16 matmul 800" in lines[2]
    assert lines[2].endswith("(target >= 0.9: met)")


def test_summary_without_peers_or_the_matmul_point():
    report = {"matmul_tflops": 800.0, "results": [_row(64, True, 1024, 300.0, None, None)]}
    s = summarize(report)
    assert s["geomean_ratio"] is None and s["min_point"] is None and s["matmul_fraction"] is None
    assert format_summary(s) == ["no point has a flashhopper / max(cudnn, fa4) ratio (peers not measured)"]


def test_summary_of_the_real_grid():
    report = json.loads(GRID_JSON.read_text())
    s = summarize(report)
    assert s["points_with_ratio"] == 36
    assert s["geomean_ratio"] == pytest.approx(1.056, abs=0.001)  # as docs/results.md states
    assert s["min_point"] == {"hdim": 64, "causal": True, "seqlen": 512}
    assert s["matmul_fraction"]["fraction"] == pytest.approx(742.9 / 797.9, abs=0.002)


def test_run_bench_prints_and_stores_the_summary(monkeypatch, tmp_path):
    from flashhopper.bench import runner
    from flashhopper.bench.grid import make_point

    rows = {(r["hdim"], r["causal"], r["seqlen"]): r for r in SYNTHETIC["results"]}
    monkeypatch.setattr(runner, "matmul_tflops", lambda: 800.0)
    monkeypatch.setattr(runner.torch.cuda, "get_device_name", lambda: "fake GPU")

    def fake_run_point(p, providers, dtype, backward, rounds):
        assert backward is False
        return {**rows[(p.hdim, p.causal, p.seqlen)], "batch": p.batch, "heads": p.heads, "errors": {}}

    monkeypatch.setattr(runner, "run_point", fake_run_point)
    points = [make_point(r["seqlen"], r["hdim"], r["causal"]) for r in SYNTHETIC["results"]]
    providers = [runner.Provider(n, None) for n in ("flashhopper", "cudnn", "fa4")]
    out, path = io.StringIO(), tmp_path / "grid.json"
    runner.run_bench(points, json_path=str(path), providers=providers, out=out)
    text = out.getvalue()
    assert "geomean flashhopper / max(cudnn, fa4): 0.965" in text and "= 0.900 of bf16 matmul" in text
    assert "forward TFLOP/s" in text and "backward" not in text
    assert json.loads(path.read_text())["direction"] == "fwd"
    stored = json.loads(path.read_text())["summary"]
    assert stored["min_ratio"] == pytest.approx(0.75)
    assert stored["matmul_fraction"]["fraction"] == pytest.approx(0.9)


# --- FP8 (e4m3) forward ---


def _fp8_row(hdim, causal, seqlen, ours, cudnn, fast=None, default=None):
    row = {"hdim": hdim, "causal": causal, "seqlen": seqlen, "tflops": {"flashhopper": ours, "cudnn": cudnn},
           "ratio": ours / cudnn if ours and cudnn else None}
    if fast:
        row["scaled_mm_tflops"] = {"fast_accum": fast, "default": default}
    return row


SYNTHETIC_FP8 = {
    "dtype": "e4m3",
    "matmul_tflops": 800.0,  # the bf16 matmul: no ceiling for FP8, so no line about it
    "results": [
        _fp8_row(64, True, 512, 270.0, 300.0, 1300.0, 1150.0),  # 0.9: the lowest
        _fp8_row(128, False, 16384, 1000.0, 800.0, 1250.0, 1100.0),  # 1.25; 1000 / 1250 = 0.8 of the GEMM
        _fp8_row(256, False, 16384, 1040.0, 800.0, 1300.0, 1150.0),  # 1.3; 1040 / 1300 = 0.8 of the GEMM
        _fp8_row(256, True, 1024, 500.0, None, 1280.0, 1140.0),  # cuDNN failed: not in the geomean
    ],
}


def test_fp8_summary_math():
    s = summarize(SYNTHETIC_FP8)
    assert s["fp8"] and s["points_with_ratio"] == 3 and s["matmul_fraction"] is None
    assert s["geomean_ratio"] == pytest.approx((0.9 * 1.25 * 1.3) ** (1 / 3))
    assert s["min_ratio"] == pytest.approx(0.9)
    assert s["min_point"] == {"hdim": 64, "causal": True, "seqlen": 512}
    by_hdim = {f["hdim"]: f for f in s["scaled_mm_fraction"]}
    assert list(by_hdim) == [256, 128]
    assert by_hdim[256]["fraction"] == pytest.approx(0.8) and by_hdim[256]["target"] == 0.85
    assert by_hdim[128]["fraction"] == pytest.approx(0.8) and by_hdim[128]["target"] == 0.75
    assert by_hdim[128]["scaled_mm_tflops"] == 1250.0 and by_hdim[128]["scaled_mm_default_tflops"] == 1100.0
    lines = format_summary(s, ("cudnn",))
    assert lines == [
        "geomean flashhopper / cudnn: 1.135 over 3 of 4 points (target >= 1.1: met)",
        "lowest: 0.900 at hdim 64 causal seqlen 512 (target >= 1: not met)",
        "hdim 256 non-causal seqlen 16384: 1040 TFLOP/s = 0.800 of fp8 scaled_mm 1300 "
        "(fast accum, timed beside it) (target >= 0.85: not met)",
        "hdim 128 non-causal seqlen 16384: 1000 TFLOP/s = 0.800 of fp8 scaled_mm 1250 "
        "(fast accum, timed beside it) (target >= 0.75: met)",
    ]


def test_fp8_summary_without_the_gemm_points():
    report = {"dtype": "e4m3", "results": [_fp8_row(128, False, 16384, 1000.0, 800.0)]}  # no GEMM timed
    s = summarize(report)
    assert s["scaled_mm_fraction"] == [] and len(format_summary(s, ("cudnn",))) == 2


def _fake_gemms():
    return {"fast_accum": (lambda: "fast", 2.0e12), "default": (lambda: "default", 2.0e12)}


def test_run_point_fp8_times_the_gemm_beside_the_providers(monkeypatch):
    """FP8 inputs on the CPU; cuDNN's frontend absent: its cell is empty, the row goes on."""
    from flashhopper.bench import providers as prov
    from flashhopper.bench import runner
    from flashhopper.bench.grid import Point

    order, seen = [], []

    def make(q, k, v, causal):
        seen.append((q.dtype, tuple(q.shape), causal))
        return lambda: "ours"

    ms = {"ours": 4.0, "fast": 2.0, "default": 2.5}

    def fake_time(fn):
        order.append(fn())
        return ms[order[-1]]

    monkeypatch.setattr(runner, "time_ms", fake_time)
    monkeypatch.setitem(sys.modules, "cudnn", None)  # makes `import cudnn` fail
    point = Point(2, 64, 4, 64, True)
    row = runner.run_point(point, [runner.Provider("flashhopper", make), prov.cudnn_fp8()], runner.FP8,
                           device="cpu", rounds=2, peers=runner.FP8_PEERS, scaled_mm=_fake_gemms())
    assert seen == [(runner.FP8, (2, 64, 4, 64), True)]
    assert order == ["ours", "fast", "default"] * 2  # each round: the providers, then the GEMMs
    assert row["tflops"]["flashhopper"] == pytest.approx(point.flops / 4.0 / 1e9)
    assert row["tflops"]["cudnn"] is None and row["ratio"] is None
    assert row["errors"]["cudnn"].startswith("Unavailable: the cudnn Python frontend is not importable here")
    assert row["scaled_mm_tflops"] == pytest.approx({"fast_accum": 1000.0, "default": 800.0})
    cells = runner.format_row(row, ["flashhopper", "cudnn"]).split()
    assert cells[-5:] == ["-", "-", "1000", "800", f"{point.flops / 4e9 / 1000:.2f}"]


def test_run_bench_fp8(monkeypatch, tmp_path):
    from flashhopper.bench import runner
    from flashhopper.bench.grid import make_point

    rows = {(r["hdim"], r["causal"], r["seqlen"]): r for r in SYNTHETIC_FP8["results"]}
    calls = []
    monkeypatch.setattr(runner, "matmul_tflops", lambda: 800.0)
    monkeypatch.setattr(runner.torch.cuda, "get_device_name", lambda: "fake GPU")
    monkeypatch.setattr(runner, "scaled_mm_calls", _fake_gemms)

    def fake_run_point(p, providers, dtype, backward, rounds, peers, scaled_mm):
        calls.append((dtype, peers, sorted(scaled_mm)))
        return {**rows[(p.hdim, p.causal, p.seqlen)], "batch": p.batch, "heads": p.heads, "errors": {}}

    monkeypatch.setattr(runner, "run_point", fake_run_point)
    points = [make_point(r["seqlen"], r["hdim"], r["causal"]) for r in SYNTHETIC_FP8["results"]]
    providers = [runner.Provider(n, None) for n in ("flashhopper", "cudnn")]
    out, path = io.StringIO(), tmp_path / "fp8.json"
    runner.run_bench(points, dtype="e4m3", json_path=str(path), providers=providers, out=out)
    assert calls[0] == (runner.FP8, ("cudnn",), ["default", "fast_accum"]) and len(calls) == 4
    text = out.getvalue()
    assert "fh/best = flashhopper / cudnn" in text and "mm fast  mm dflt  fh/mm" in text
    assert "geomean flashhopper / cudnn: 1.135" in text and "of fp8 scaled_mm 1300" in text
    assert "bf16 matmul 800" not in text.split("\n", 1)[1]  # only in the header line
    report = json.loads(path.read_text())
    assert report["dtype"] == "e4m3" and report["peers"] == ["cudnn"]
    assert report["results"][1]["scaled_mm_tflops"] == {"fast_accum": 1250.0, "default": 1100.0}
    assert [f["hdim"] for f in report["summary"]["scaled_mm_fraction"]] == [256, 128]
    with pytest.raises(ValueError, match="forward only"):
        runner.run_bench(points, dtype="fp8", providers=providers, out=io.StringIO(), backward=True)


def test_run_bench_fp8_without_the_gemm(monkeypatch):
    from flashhopper.bench import runner
    from flashhopper.bench.grid import make_point

    def no_gemm():
        raise RuntimeError("no FP8 GEMM on this torch\nmore")

    monkeypatch.setattr(runner, "matmul_tflops", lambda: 800.0)
    monkeypatch.setattr(runner.torch.cuda, "get_device_name", lambda: "fake GPU")
    monkeypatch.setattr(runner, "scaled_mm_calls", no_gemm)
    monkeypatch.setattr(runner, "run_point", lambda p, *a, scaled_mm, **k: {
        **_fp8_row(p.hdim, p.causal, p.seqlen, 1000.0, 800.0), "batch": p.batch, "heads": p.heads,
        "errors": {}})
    out = io.StringIO()
    report = runner.run_bench([make_point(16384, 128, False)], dtype="e4m3", out=out,
                              providers=[runner.Provider(n, None) for n in ("flashhopper", "cudnn")])
    assert "(FP8 GEMM not measured: RuntimeError: no FP8 GEMM on this torch)" in out.getvalue()
    assert report["summary"]["geomean_ratio"] == pytest.approx(1.25)
    assert report["summary"]["scaled_mm_fraction"] == []


def test_fp8_inputs_on_cpu():
    from flashhopper.bench import runner

    x = runner.randn((64, 64), runner.FP8, "cpu")
    assert x.dtype == runner.FP8 and 0.8 < x.float().std() < 1.2


def test_flashhopper_fp8_opts_in_for_its_calls_only(monkeypatch):
    import torch

    from flashhopper import interface
    from flashhopper.bench import providers as prov
    from flashhopper.validation import FP8_OPT_IN

    monkeypatch.delenv(FP8_OPT_IN, raising=False)
    seen = {}

    def fake_attn(q, k, v, causal, q_descale, k_descale, v_descale):
        seen.update(env=os.environ.get(FP8_OPT_IN), causal=causal, descale=q_descale)
        assert k_descale is q_descale and v_descale is q_descale

    monkeypatch.setattr(interface, "flash_attn_func", fake_attn)
    provider = prov.flashhopper_fp8()
    q = torch.zeros(2, 8, 4, 64).to(torch.float8_e4m3fn)
    k = torch.zeros(2, 8, 2, 64).to(torch.float8_e4m3fn)
    with provider.context():
        provider.make(q, k, k, True)()
    assert seen["env"] == "1" and seen["causal"] is True
    assert seen["descale"].shape == (2, 2) and seen["descale"].dtype == torch.float32
    assert FP8_OPT_IN not in os.environ
    monkeypatch.setenv(FP8_OPT_IN, "0")
    with provider.context():
        assert os.environ[FP8_OPT_IN] == "1"
    assert os.environ[FP8_OPT_IN] == "0"


class _FakeCudnn:
    """The slice of the cudnn frontend's graph API the provider uses, recording what it is asked."""

    def __init__(self):
        import types

        self.data_type = types.SimpleNamespace(FP8_E4M3="e4m3", FLOAT="f32")
        self.heur_mode = types.SimpleNamespace(A="A", FALLBACK="FALLBACK")
        self.diagonal_alignment = types.SimpleNamespace(TOP_LEFT="top-left")
        self.graphs, self.handles, self.streams = [], [], []
        fake = self

        class Desc:
            def __init__(self, **attrs):
                self.attrs = attrs

            def __getattr__(self, name):  # set_output / set_dim / set_stride / set_data_type
                if not name.startswith("set_"):
                    raise AttributeError(name)
                return lambda value: self.attrs.update({name[4:]: value}) or self

        class Graph:
            selected_engine = None  # the cuDNN backend, not a Python engine of the frontend

            def __init__(self, **kw):
                self.kw, self.steps, self.executed = kw, [], []
                fake.graphs.append(self)

            def tensor(self, **kw):
                return Desc(**kw)

            def sdpa_fp8(self, **kw):
                self.sdpa = kw
                self.outputs = [Desc(), None, Desc(), Desc()]
                return self.outputs

            def __getattr__(self, name):
                steps = ("validate", "build_operation_graph", "create_execution_plans", "check_support",
                         "build_plans")
                if name not in steps:
                    raise AttributeError(name)
                return lambda *args: self.steps.append((name, *args))

            def get_workspace_size(self):
                return 1024

            def execute(self, pack, workspace, handle):
                self.executed.append((pack, workspace, handle))

        self.pygraph = Graph

    def create_handle(self):
        self.handles.append(object())
        return self.handles[-1]

    def set_stream(self, handle, stream):
        self.streams.append((handle, stream))


def test_cudnn_fp8_builds_one_graph_per_shape_and_mask(monkeypatch):
    import types

    import torch

    from flashhopper.bench import providers as prov

    fake = _FakeCudnn()
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: types.SimpleNamespace(cuda_stream=7))
    provider = prov.cudnn_fp8()
    q, k = (torch.zeros(2, 16, h, 64).to(torch.float8_e4m3fn) for h in (4, 2))
    provider.make(q, k, k, True)()
    provider.make(q, k, k, True)()  # the same point again (another round, say): the graph is reused
    provider.make(q, k, k, False)()
    assert len(fake.graphs) == 2 and len(fake.handles) == 1
    assert provider.info == {"(2, 16, 4, 64) causal": "cuDNN backend", "(2, 16, 4, 64) full": "cuDNN backend"}
    assert fake.streams == [(fake.handles[0], 7)] * 3
    causal, full = fake.graphs
    assert causal.kw == {"io_data_type": "e4m3", "intermediate_data_type": "f32", "compute_data_type": "f32",
                         "handle": fake.handles[0]}
    assert [s[0] for s in causal.steps] == ["validate", "build_operation_graph", "create_execution_plans",
                                            "check_support", "build_plans"]
    assert causal.steps[2] == ("create_execution_plans", ["A", "FALLBACK"])
    assert causal.sdpa["diagonal_alignment"] == "top-left" and causal.sdpa["right_bound"] == 0
    assert "right_bound" not in full.sdpa and "diagonal_alignment" not in full.sdpa
    assert causal.sdpa["generate_stats"] is False and causal.sdpa["attn_scale"] == pytest.approx(64**-0.5)
    # (b, h, s, d) descriptions of (b, s, h, d) storage, as ours reads it
    q_attrs, v_attrs = causal.sdpa["q"].attrs, causal.sdpa["v"].attrs
    assert q_attrs["dim"] == [2, 4, 16, 64] and q_attrs["stride"] == [4096, 64, 256, 1]
    assert v_attrs["dim"] == [2, 2, 16, 64] and v_attrs["stride"] == [2048, 64, 128, 1]
    o, _, amax_s, amax_o = causal.outputs
    assert o.attrs == {"output": True, "dim": q_attrs["dim"], "stride": q_attrs["stride"],
                       "data_type": "e4m3"}
    assert amax_o.attrs["output"] is True and amax_s.attrs == {}  # Amax_S left virtual
    assert len(causal.executed) == 2
    pack, workspace, handle = causal.executed[0]
    assert handle is fake.handles[0] and workspace.numel() == 1024
    by_name = {desc.attrs.get("name", "o" if desc is o else "amax_o"): t for desc, t in pack.items()}
    assert set(by_name) == {"q", "k", "v", "o", "amax_o", *prov.CUDNN_FP8_SCALES}
    assert by_name["q"].data_ptr() == q.data_ptr() and by_name["q"].shape == (2, 4, 16, 64)
    assert by_name["o"].dtype == torch.float8_e4m3fn and by_name["o"].stride() == (4096, 64, 256, 1)
    assert by_name["scale_s"].item() == 448.0 and by_name["descale_s"].item() == pytest.approx(1 / 448)


def test_cli_bench_fp8_arguments(monkeypatch, capsys):
    import torch

    from flashhopper.bench import runner

    assert cli.main(["bench", "--dtype", "fp8", "--bwd"]) == 2
    assert capsys.readouterr().err == "flashhopper bench: --dtype e4m3 is the forward grid only, not --bwd\n"
    seen = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runner, "run_bench", lambda points, **kw: seen.update(points=points, **kw) or {})
    # FP8's --ablation: the grid, with the same kernel fed V already transposed beside ours and cuDNN's
    assert cli.main(["bench", "--dtype", "e4m3", "--ablation", "--quick"]) == 0
    assert [p.name for p in seen["providers"]] == ["flashhopper", "fh-vt-given", "cudnn"]
    for name in ("fp8", "e4m3"):
        seen.clear()
        assert cli.main(["bench", "--dtype", name, "--quick", "--causal", "no"]) == 0
        assert seen["dtype"] == "e4m3" and seen["backward"] is False
        assert [(p.hdim, p.seqlen, p.causal) for p in seen["points"]] == [
            (128, 1024, False), (128, 8192, False), (64, 1024, False), (64, 8192, False)]
    assert cli.main(["bench", "--dtype", "fp8"]) == 0 and len(seen["points"]) == 36


def test_plot_of_an_fp8_report(tmp_path):
    from flashhopper.bench import plot

    report = {**SYNTHETIC_FP8, "device": "fake GPU", "peers": ["cudnn"],
              "providers": ["flashhopper", "cudnn"]}
    assert plot._ceiling(report) == (1290.0, "fp8 scaled_mm, fast accum")  # the median beside the points
    assert plot._ceiling(SYNTHETIC) == (800.0, "bf16 matmul")
    assert plot._title(report) == "fake GPU, e4m3 forward: flashhopper / cuDNN geomean 1.14, lowest 0.90"
    pytest.importorskip("matplotlib")
    out = tmp_path / "fp8.png"
    assert plot.plot_report(report, str(out)) == str(out) and out.stat().st_size > 10_000


# --- plot ---


def test_plot_renders_the_grid(tmp_path):
    pytest.importorskip("matplotlib")
    from flashhopper.bench.plot import plot_file

    out = tmp_path / "grid.png"
    assert plot_file(str(GRID_JSON), str(out)) == str(out)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 10_000 < len(data) < 150_000


def test_cli_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "cli.png"
    assert cli.main(["plot", str(GRID_JSON), str(out)]) == 0 and out.stat().st_size > 0
    assert cli.main(["plot", str(tmp_path / "missing.json"), str(out)]) == 2
    assert "cannot plot" in capsys.readouterr().err


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path, capsys):
    from flashhopper.bench.plot import MissingMatplotlib, plot_report

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(MissingMatplotlib, match="pip install matplotlib"):
        plot_report(SYNTHETIC, str(tmp_path / "x.png"))
    assert cli.main(["plot", str(GRID_JSON), str(tmp_path / "x.png")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


# --- ablation ---


def test_ablation_switches_are_fwdconfig_booleans():
    assert ablation.ablation_switches() == ablation.ABLATION_SWITCHES
    assert set(ablation.ABLATION_SWITCHES) >= {"pingpong", "intra_wg_overlap"}
    with pytest.raises(ValueError, match="'tile_n' is not a boolean field"):
        ablation.ablation_switches(("pingpong", "tile_n"))
    with pytest.raises(ValueError, match="'pingpnog'"):
        ablation.ablation_switches(("pingpnog",))


def test_ablation_configurations():
    configs = ablation.configurations(("a", "b"))
    assert configs == [
        ("everything on", {"a": True, "b": True}),
        ("no a", {"a": False, "b": True}),
        ("no b", {"a": True, "b": False}),
        ("all off", {"a": False, "b": False}),
    ]
    assert [name for name, _ in ablation.configurations(("a",))] == ["everything on", "no a"]


def _synthetic_rows():
    numbers = [("everything on", 700.0, 600.0), ("no pingpong", 665.0, 606.0),
               ("no intra_wg_overlap", 560.0, None), ("all off", 553.0, 525.0)]
    rows = [{"name": n, "tflops": {"non-causal": nc, "causal": c}} for n, nc, c in numbers]
    return ablation.finish_rows(rows)


def test_ablation_drops_and_table():
    rows = _synthetic_rows()
    assert rows[1]["drop"]["non-causal"] == pytest.approx(0.05) and rows[1]["slower"]["non-causal"] is True
    assert rows[1]["drop"]["causal"] == pytest.approx(-0.01) and rows[1]["slower"]["causal"] is False
    assert rows[2]["drop"]["causal"] is None and rows[2]["slower"]["causal"] is None
    lines = ablation.format_table(rows)
    assert len(lines) == 5 and len({len(line) for line in lines}) == 1  # aligned columns
    assert lines[0].split() == ["configuration", "non-causal", "drop", "slower", "causal", "drop", "slower"]
    assert lines[1].split() == ["everything", "on", "700.0", "-", "-", "600.0", "-", "-"]
    assert lines[2].split() == ["no", "pingpong", "665.0", "5.0%", "yes", "606.0", "-1.0%", "NO"]
    assert lines[3].split() == ["no", "intra_wg_overlap", "560.0", "20.0%", "yes", "failed", "-", "-"]
    assert lines[4].split() == ["all", "off", "553.0", "21.0%", "yes", "525.0", "12.5%", "yes"]


def test_run_ablation_applies_each_configuration(monkeypatch, tmp_path):
    """Stand-ins for the kernel and runtime.config_overrides: time and output depend on the switches."""
    from flashhopper.bench import runner
    from flashhopper.bench.grid import Point

    active, seen = {}, []
    first, second = ablation.ABLATION_SWITCHES[:2]

    @contextlib.contextmanager
    def fake_overrides(**fields):
        active.update(fields)
        yield
        active.clear()

    def fake_attn(q, k, v, causal):
        seen.append((causal, dict(active)))
        return q + 1 if active == {**dict.fromkeys(active, True), second: False} else q.clone()

    # each switch turned off costs 10% more time; a failure in one variant is reported, not fatal
    def fake_time(fn):
        fn()
        if not any(active.values()):
            raise RuntimeError("could not compile\ndetails")
        return 1.0 + 0.1 * sum(not on for on in active.values())

    monkeypatch.setattr(runner, "time_ms", fake_time)
    # the real point holds 16384 tokens x 2048 hidden; a small one keeps the CPU test fast
    monkeypatch.setattr(ablation, "make_point", lambda s, d, c: Point(2, s, 4, d, c))
    out, path = io.StringIO(), tmp_path / "ablation.json"
    report = ablation.run_ablation(seqlen=64, hdim=64, device="cpu", attn=fake_attn, overrides=fake_overrides,
                                   json_path=str(path), out=out)
    rows = report["results"]
    assert [r["name"] for r in rows][:3] == ["everything on", f"no {first}", f"no {second}"]
    assert seen[0] == (False, dict.fromkeys(ablation.ABLATION_SWITCHES, True))
    assert seen[2] == (False, {**dict.fromkeys(ablation.ABLATION_SWITCHES, True), first: False})
    assert {c for c, _ in seen} == {False, True}
    flops = 4.0 * 2 * 4 * 64 * 64 * 64
    assert rows[0]["tflops"]["non-causal"] == pytest.approx(flops / 1e9)
    assert rows[0]["tflops"]["causal"] == pytest.approx(flops / 2 / 1e9)
    assert rows[1]["drop"]["causal"] == pytest.approx(1 - 1 / 1.1) and rows[1]["slower"]["causal"]
    assert rows[-1]["tflops"]["causal"] is None
    assert rows[-1]["errors"]["causal"] == "RuntimeError: could not compile"
    assert rows[1]["max_diff"]["causal"] == 0.0 and rows[2]["max_diff"]["causal"] > 0.9  # bf16 rounds q + 1
    text = out.getvalue()
    assert "ablation at hdim 64, seqlen 64, batch 2, 4 heads" in text and "failed" in text
    assert f"no {second} (causal): output differs from everything on by 1" in text
    assert json.loads(path.read_text())["switches"] == list(ablation.ABLATION_SWITCHES)


def test_run_ablation_one_mode(monkeypatch):
    """causal=(True,) runs and tabulates the causal mode only (half the compiles on a GPU)."""
    from flashhopper.bench import runner
    from flashhopper.bench.grid import Point

    seen = []

    @contextlib.contextmanager
    def fake_overrides(**fields):
        yield

    def fake_attn(q, k, v, causal):
        seen.append(causal)
        return q.clone()

    monkeypatch.setattr(runner, "time_ms", lambda fn: fn() and 1.0)
    monkeypatch.setattr(ablation, "make_point", lambda s, d, c: Point(2, s, 4, d, c))
    out = io.StringIO()
    report = ablation.run_ablation(seqlen=64, hdim=64, device="cpu", attn=fake_attn, overrides=fake_overrides,
                                   out=out, causal=(True,))
    assert set(seen) == {True}
    assert all(set(r["tflops"]) == {"causal"} and set(r["drop"]) == {"causal"} for r in report["results"])
    header = next(line for line in out.getvalue().splitlines() if line.startswith("configuration"))
    assert "causal" in header and "non-causal" not in header
    with pytest.raises(ValueError, match="causal must include"):
        ablation.run_ablation(device="cpu", attn=fake_attn, overrides=fake_overrides, out=out, causal=())


def test_run_ablation_rounds_take_turns_and_keep_the_median(monkeypatch):
    from flashhopper.bench import runner
    from flashhopper.bench.grid import Point

    active, order = {}, []
    times = iter([1.0, 2.0, 3.0, 1.0, 3.0, 2.0])  # 2 configurations x 3 rounds, in call order

    @contextlib.contextmanager
    def fake_overrides(**fields):
        active.update(fields)
        yield
        active.clear()

    def fake_time(fn):
        order.append(dict(active))
        return next(times)

    monkeypatch.setattr(ablation, "ablation_switches", lambda: ("pingpong",))
    monkeypatch.setattr(runner, "time_ms", fake_time)
    monkeypatch.setattr(ablation, "make_point", lambda s, d, c: Point(2, s, 4, d, c))
    report = ablation.run_ablation(seqlen=64, hdim=64, device="cpu", attn=lambda q, k, v, causal: q.clone(),
                                   overrides=fake_overrides, out=io.StringIO(), causal=(True,), rounds=3)
    on, off = {"pingpong": True}, {"pingpong": False}
    assert order == [on, off, on, off, on, off]  # first round compiles and times each, then turns
    flops = 4.0 * 2 * 4 * 64 * 64 * 64 / 2
    rows = {r["name"]: r for r in report["results"]}
    assert rows["everything on"]["tflops"]["causal"] == pytest.approx(flops / 3.0 / 1e9)  # 1, 3, 3 ms
    assert rows["no pingpong"]["tflops"]["causal"] == pytest.approx(flops / 2.0 / 1e9)  # 2, 1, 2 ms
    assert rows["no pingpong"]["spread"]["causal"] == pytest.approx([flops / 2e9, flops / 1e9])
    assert report["rounds"] == 3
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        ablation.run_ablation(device="cpu", attn=None, overrides=fake_overrides, out=io.StringIO(), rounds=0)


def test_cli_bench_ablation_without_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert cli.main(["bench", "--ablation"]) == 2
    err = capsys.readouterr().err
    assert cli.main(["bench", "--quick"]) == 2
    assert err == capsys.readouterr().err == "flashhopper bench: needs a CUDA GPU (none visible)\n"
