"""The benchmark grid and FLOP convention (targets.md); the timing itself needs a GPU."""

import pytest

from flashhopper.bench.grid import attention_flops, make_point, quick_grid, standard_grid
from flashhopper.bench.runner import format_header, format_row


def test_standard_grid_holds_tokens_and_hidden_size():
    grid = standard_grid()
    assert len(grid) == 3 * 2 * 6
    assert len(set(grid)) == len(grid)
    for p in grid:
        assert p.batch * p.seqlen == 16384 and p.heads * p.hdim == 2048
    assert {p.seqlen for p in grid} == {512, 1024, 2048, 4096, 8192, 16384}
    assert make_point(16384, 128, True).batch == 1 and make_point(512, 64, False).heads == 32


def test_quick_grid():
    grid = quick_grid()
    assert len(grid) == 8
    assert {(p.hdim, p.seqlen) for p in grid} == {(128, 1024), (128, 8192), (64, 1024), (64, 8192)}


def test_flops_convention():
    assert attention_flops(2, 16, 1024, 1024, 128, False) == 4 * 2 * 16 * 1024 * 1024 * 128
    assert attention_flops(2, 16, 1024, 1024, 128, True) == 2 * 2 * 16 * 1024 * 1024 * 128
    assert attention_flops(1, 1, 10, 10, 8, False, backward=True) == pytest.approx(2.5 * 4 * 800)
    assert make_point(8192, 128, False).flops == 4 * 2 * 16 * 8192 * 8192 * 128


def test_table_row_formatting():
    names = ["flashhopper", "fa2", "cudnn", "fa4"]
    tflops = {"flashhopper": 601.23, "fa2": None, "cudnn": 555.0, "fa4": 623.0}
    row = {"hdim": 128, "causal": True, "seqlen": 8192, "batch": 2, "heads": 16, "tflops": tflops,
           "ratio": 601.23 / 623}
    line = format_row(row, names)
    assert "601.2" in line and " - " in line + " " and "0.97" in line
    assert len(line) == len(format_header(names))


def test_run_point_records_failures_and_ratio(monkeypatch):
    from flashhopper.bench import runner
    from flashhopper.bench.grid import Point

    monkeypatch.setattr(runner, "time_ms", lambda fn: 2.0)

    def broken(q, k, v, causal):
        raise RuntimeError("no kernel for this shape\nsecond line")

    providers = [
        runner.Provider("flashhopper", lambda q, k, v, c: lambda: None),
        runner.Provider("cudnn", lambda q, k, v, c: lambda: None),
        runner.Provider("fa4", broken),
    ]
    point = Point(batch=1, seqlen=16, heads=2, hdim=64, causal=True)
    row = runner.run_point(point, providers, device="cpu")
    assert row["tflops"]["flashhopper"] == pytest.approx(point.flops / 2.0 / 1e9)
    assert row["tflops"]["fa4"] is None and row["errors"] == {"fa4": "RuntimeError: no kernel for this shape"}
    assert row["ratio"] == pytest.approx(1.0)


def test_run_point_rounds_interleave_providers_and_take_the_median(monkeypatch):
    from flashhopper.bench import runner
    from flashhopper.bench.grid import Point

    order, times = [], {"flashhopper": iter([2.0, 1.0, 4.0]), "cudnn": iter([2.0, 2.0, 2.0])}

    def fake_time_ms(call):
        order.append(call.name)
        return next(times[call.name])

    monkeypatch.setattr(runner, "time_ms", fake_time_ms)
    providers = [runner.Provider(n, lambda q, k, v, c, n=n: _Call(n)) for n in ("flashhopper", "cudnn")]
    point = Point(batch=1, seqlen=16, heads=2, hdim=64, causal=False)
    row = runner.run_point(point, providers, device="cpu", rounds=3)
    assert order == ["flashhopper", "cudnn"] * 3  # the providers take turns within each round
    assert row["tflops"]["flashhopper"] == pytest.approx(point.flops / 2.0 / 1e9)  # median of 2, 1, 4 ms
    assert row["spread"]["flashhopper"] == pytest.approx([point.flops / 4.0 / 1e9, point.flops / 1.0 / 1e9])
    assert row["rounds"] == 3 and row["ratio"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        runner.run_point(point, providers, device="cpu", rounds=0)


class _Call:
    def __init__(self, name):
        self.name = name

    def __call__(self):
        return None


def test_run_point_allocations_draw_fresh_inputs_and_report_percentiles(monkeypatch):
    """--allocations: each allocation new input tensors (while the previous are still held), the
    providers in a rotated order, p10 / p50 / p90 per provider, the ratio of p50s, the spreads."""
    from flashhopper.bench import runner
    from flashhopper.bench.grid import Point
    from flashhopper.bench.summary import summarize

    seen, order = {"flashhopper": [], "cudnn": []}, []
    # ours: one slow allocation in ten; cuDNN steady
    ms = {"flashhopper": iter([1.0] * 9 + [1.5]), "cudnn": iter([1.25] * 10)}

    def make(name):
        def maker(q, k, v, causal):
            seen[name].append(q.data_ptr())
            return _Call(name)
        return maker

    def fake_time_ms(call, short=False):
        assert short
        order.append(call.name)
        return next(ms[call.name])

    monkeypatch.setattr(runner, "time_ms", fake_time_ms)
    # NVML's reading after each sample: the power cap on the last allocation's two
    clocks = iter([1980] * 18 + [1400] * 2)
    monkeypatch.setattr(runner.gpu_state, "read", lambda index: (lambda mhz: {
        "sm_mhz": mhz, "watts": 700.0 if mhz < 1980 else 400.0, "power_capped": mhz < 1980})(next(clocks)))
    providers = [runner.Provider(n, make(n)) for n in ("flashhopper", "cudnn")]
    point = Point(batch=1, seqlen=16, heads=2, hdim=64, causal=False)
    row = runner.run_point(point, providers, device="cpu", allocations=10)
    assert len(set(seen["flashhopper"])) == 10 and seen["flashhopper"] == seen["cudnn"]
    assert order[:4] == ["flashhopper", "cudnn", "cudnn", "flashhopper"]
    rate = point.flops / 1e9
    pct = row["percentiles"]["flashhopper"]
    assert pct["p50"] == pytest.approx(rate) and pct["p10"] < rate and pct["p90"] == pytest.approx(rate)
    assert row["ratio"] == pytest.approx(1.25)
    assert row["paired_ratio"] == pytest.approx(1.25)  # the median of the ten per-allocation ratios
    state = row["gpu_state"]["flashhopper"]
    assert state["power_capped"] == pytest.approx(0.1) and state["sm_mhz"]["p50"] == 1980
    ours, theirs = runner.point_spreads(row, ("cudnn", "fa4"))
    assert ours > 1.0 and theirs == pytest.approx(1.0)
    summary = summarize({"results": [row], "peers": ["cudnn", "fa4"], "allocations": 10})
    assert len(summary["spread"]["wider_than_allowed"]) == (1 if ours > 1.05 else 0)
    assert summary["clock"]["paired_geomean"] == pytest.approx(1.25)
    assert summary["clock"]["power_capped"] == pytest.approx(0.1)
    line = runner.format_row(row, ["flashhopper", "cudnn"], ("cudnn",))
    assert len(line) == len(runner.format_header(["flashhopper", "cudnn"], allocations=True))
