"""`flashhopper bench --bwd` without a GPU: fake providers for the table, real autograd on the CPU."""

import functools
import io
import json
import pathlib

import pytest
import torch

from flashhopper import cli
from flashhopper.bench import plot, providers, runner
from flashhopper.bench.grid import Point, make_point, quick_grid
from flashhopper.interface import flash_attn_func

GRID_JSON = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "fwd_grid.json"
SMALL = (Point(1, 16, 2, 64, False), Point(1, 16, 2, 64, True))


def _not_called(*args):
    raise AssertionError("the forward maker must not run in a backward benchmark")


def _bwd(ms, seen=None, fail_causal=False):
    """A fake backward maker whose timed call returns its own time (time_ms is patched to call it)."""

    def make_bwd(q, k, v, dout, causal):
        if seen is not None:
            seen.append((q.shape, dout.shape, causal))
        if fail_causal and causal:
            raise RuntimeError("no backward for this mask\ndetails")
        return lambda: ms

    return make_bwd


@pytest.fixture
def fake_timing(monkeypatch):
    monkeypatch.setattr(runner, "time_ms", lambda fn: fn())
    monkeypatch.setattr(runner, "matmul_tflops", lambda: 800.0)
    monkeypatch.setattr(runner.torch.cuda, "get_device_name", lambda: "fake GPU")


def test_bwd_flops_are_2_5_times_forward():
    for p in (make_point(8192, 128, False), make_point(1024, 64, True)):
        assert p.bwd_flops == pytest.approx(2.5 * p.flops)
    assert make_point(8192, 128, True).bwd_flops == 2.5 * 2 * 2 * 16 * 8192 * 8192 * 128


def test_run_point_times_the_backward(fake_timing):
    seen = []
    provs = [
        runner.Provider("flashhopper", _not_called, make_bwd=_bwd(2.0, seen)),
        runner.Provider("cudnn", _not_called, make_bwd=_bwd(4.0)),
        runner.Provider("fa4", _not_called, make_bwd=_bwd(1.0, fail_causal=True)),
        runner.Provider("fwd-only", _not_called),  # no backward: reported, the row survives
    ]
    point = SMALL[1]
    row = runner.run_point(point, provs, device="cpu", backward=True)
    assert seen == [((1, 16, 2, 64), (1, 16, 2, 64), True)]
    assert row["flops"] == point.bwd_flops
    assert row["tflops"]["flashhopper"] == pytest.approx(point.bwd_flops / 2.0 / 1e9)
    assert row["tflops"]["fa4"] is None and row["tflops"]["fwd-only"] is None
    assert row["errors"] == {"fa4": "RuntimeError: no backward for this mask",
                             "fwd-only": "NotImplementedError: fwd-only has no backward to time"}
    assert row["ratio"] == pytest.approx(2.0)  # 1/2 ms against cudnn's 1/4 ms


def test_run_bench_backward_table_and_json(fake_timing, monkeypatch, tmp_path):
    monkeypatch.setattr(runner, "run_point", functools.partial(runner.run_point, device="cpu"))
    provs = [runner.Provider("flashhopper", _not_called, make_bwd=_bwd(2.0)),
             runner.Provider("cudnn", _not_called, make_bwd=_bwd(4.0)),
             runner.Provider("fa4", _not_called, make_bwd=_bwd(1.0, fail_causal=True))]
    out, path = io.StringIO(), tmp_path / "bwd.json"
    report = runner.run_bench(list(SMALL), json_path=str(path), providers=provs, out=out, backward=True)
    rows = report["results"]
    assert [r["flops"] for r in rows] == [p.bwd_flops for p in SMALL]
    assert rows[0]["ratio"] == pytest.approx(0.5) and rows[1]["ratio"] == pytest.approx(2.0)
    text = out.getvalue()
    assert "backward TFLOP/s (FLOPs = 2.5 x forward, backward alone)" in text
    assert "geomean flashhopper / max(cudnn, fa4): 1.000 over 2 of 2 points" in text
    assert "lowest: 0.500 at hdim 64 non-causal seqlen 16" in text
    assert "target" not in text  # the summary's targets are the forward's
    assert "    fa4: RuntimeError: no backward for this mask" in text
    stored = json.loads(path.read_text())
    assert stored["direction"] == "bwd" and stored["providers"] == ["flashhopper", "cudnn", "fa4"]
    assert stored["summary"]["min_ratio"] == pytest.approx(0.5)
    assert stored["results"][1]["tflops"]["flashhopper"] == pytest.approx(SMALL[1].bwd_flops / 2.0 / 1e9)


def _reference(q, k, v, causal, return_lse=False):
    return flash_attn_func(q, k, v, causal=causal, backend="reference", return_lse=return_lse)


def test_differentiable_makers_run_autograd_on_cpu():
    """The real makers: flashhopper's reference backend as is, SDPA through (b, h, s, d) views."""
    b, s, h, d = 1, 24, 2, 64
    q, k, v, dout = (torch.randn(b, s, h, d, dtype=torch.bfloat16) for _ in range(4))
    ours = providers.differentiable("ref", _reference)
    with_lse = providers.differentiable("ref+lse", functools.partial(_reference, return_lse=True))
    sdpa = providers.differentiable("sdpa", providers.sdpa_attn, view=providers.heads_first)
    for causal in (False, True):
        expected = _reference(q, k, v, causal).float()  # computed in float64, rounded to bf16
        torch.testing.assert_close(sdpa.make(q, k, v, causal)().transpose(1, 2).float(), expected,
                                   atol=3e-2, rtol=3e-2)
        call = ours.make_bwd(q, k, v, dout, causal)
        grads = call()
        assert [g.shape for g in grads] == [(b, s, h, d)] * 3
        assert all(torch.equal(a, b) for a, b in zip(grads, call(), strict=True))  # the graph is kept
        assert all(torch.equal(a, b) for a, b in zip(grads, with_lse.make_bwd(q, k, v, dout, causal)(),
                                                     strict=True))
        sdpa_grads = sdpa.make_bwd(q, k, v, dout, causal)()
        assert [g.shape for g in sdpa_grads] == [(b, h, s, d)] * 3
        for ref, got in zip(grads, sdpa_grads, strict=True):
            torch.testing.assert_close(got.transpose(1, 2).float(), ref.float(), atol=5e-2, rtol=5e-2)
    assert not any(t.requires_grad for t in (q, k, v, dout))  # shared inputs left as they were


def test_default_providers_all_have_a_backward():
    provs = providers.default_providers()  # builds them only; nothing runs
    assert [p.name for p in provs][:3] == ["flashhopper", "fa2", "cudnn"]
    assert all(p.make_bwd is not None for p in provs)


# --- CLI ---


def test_cli_parses_bwd():
    args = cli.build_parser().parse_args(["bench", "--bwd", "--quick", "--json", "/tmp/b.json"])
    assert args.bwd and args.quick and args.json == "/tmp/b.json" and not args.ablation
    assert not cli.build_parser().parse_args(["bench"]).bwd


def test_cli_bench_bwd_runs_the_grid_backward(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runner, "run_bench", lambda points, **kw: calls.append((points, kw)) or {})
    assert cli.main(["bench", "--bwd", "--quick", "--hdim", "128", "--json", "x.json"]) == 0
    assert cli.main(["bench", "--quick"]) == 0
    (bwd_points, bwd_kw), (fwd_points, fwd_kw) = calls
    assert bwd_points == [p for p in quick_grid() if p.hdim == 128] and len(bwd_points) == 4
    assert bwd_kw == {"dtype": "bf16", "json_path": "x.json", "backward": True, "overrides": {}, "rounds": 1,
                      "providers": None}
    assert fwd_points == quick_grid() and fwd_kw["backward"] is False


def test_cli_bench_bwd_with_ablation_is_refused(capsys):
    assert cli.main(["bench", "--bwd", "--ablation"]) == 2
    assert "--bwd applies to the grid, not to --ablation" in capsys.readouterr().err


# --- plot ---


def test_plot_title_says_the_direction():
    report = json.loads(GRID_JSON.read_text())
    report.pop("direction", None)  # grids written before --bwd have none: they are forward grids
    assert "bf16 forward: flashhopper / max(cuDNN, FA4) geomean 1.06" in plot._title(report)
    assert "bf16 backward: flashhopper / max(cuDNN, FA4)" in plot._title({**report, "direction": "bwd"})
    assert "backward" not in plot._title({**report, "direction": "fwd"})


def test_plot_renders_a_bwd_report(tmp_path):
    pytest.importorskip("matplotlib")
    src, out = tmp_path / "bwd.json", tmp_path / "bwd.png"
    src.write_text(json.dumps({**json.loads(GRID_JSON.read_text()), "direction": "bwd"}))
    assert cli.main(["plot", str(src), str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_bench_set_passes_config_overrides(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runner, "run_bench", lambda points, **kw: calls.append(kw) or {})
    assert cli.main(["bench", "--quick", "--set", "pingpong=false", "--set", "tile_n=64"]) == 0
    assert cli.main(["bench", "--bwd", "--quick", "--set", "scale_in_ds=True"]) == 0
    assert [kw["overrides"] for kw in calls] == [{"pingpong": False, "tile_n": 64}, {"scale_in_ds": True}]


@pytest.mark.parametrize(("argv", "message"), [
    (["bench", "--set", "nope=1"], "--set ['nope'] not a field of FwdConfig"),
    (["bench", "--bwd", "--set", "pingpong=false"], "--set ['pingpong'] not a field of BwdConfig"),
    (["bench", "--set", "pingpong"], "--set takes KEY=VALUE"),
    (["bench", "--set", "tile_n=wide"], "--set takes KEY=VALUE"),
    (["bench", "--ablation", "--set", "tile_n=64"], "--set applies to the grid, not to --ablation"),
    (["bench", "--rounds", "0"], "--rounds takes N >= 1, got 0"),
])
def test_cli_bench_set_refuses_bad_fields(argv, message, capsys):
    assert cli.main(argv) == 2  # before any GPU check: refused on a CPU machine too
    assert message in capsys.readouterr().err


def test_run_bench_records_and_applies_overrides(monkeypatch):
    from flashhopper.hopper import runtime

    seen = []
    monkeypatch.setattr(runner, "matmul_tflops", lambda: 800.0)
    monkeypatch.setattr(runner.torch.cuda, "get_device_name", lambda: "fake GPU")

    def fake_run_point(p, providers, dtype, backward, rounds):
        assert rounds == 1
        seen.append(dict(runtime._bwd_overrides if backward else runtime._overrides))
        return {"hdim": p.hdim, "causal": p.causal, "seqlen": p.seqlen, "batch": p.batch, "heads": p.heads,
                "tflops": {"flashhopper": 1.0}, "ratio": None, "errors": {}}

    monkeypatch.setattr(runner, "run_point", fake_run_point)
    point = make_point(1024, 128, False)
    providers = [runner.Provider("flashhopper", None)]
    report = runner.run_bench([point], providers=providers, out=io.StringIO(), overrides={"tile_n": 64})
    report_bwd = runner.run_bench([point], providers=providers, out=io.StringIO(), backward=True,
                                  overrides={"scale_in_ds": True})
    assert seen == [{"tile_n": 64}, {"scale_in_ds": True}]
    assert report["overrides"] == {"tile_n": 64} and report_bwd["overrides"] == {"scale_in_ds": True}
    assert runtime._overrides == {} and runtime._bwd_overrides == {}  # restored after the run


def test_cli_bench_ablation_takes_rounds(monkeypatch):
    from flashhopper.bench import ablation

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ablation, "run_ablation", lambda **kw: calls.append(kw) or {})
    assert cli.main(["bench", "--ablation", "--causal", "yes", "--rounds", "3"]) == 0
    assert calls == [{"dtype": "bf16", "json_path": None, "causal": (True,), "rounds": 3}]
