"""Benchmark tooling that needs no GPU: summary math, the plot, the ablation table and CLI guards."""

import contextlib
import io
import json
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
