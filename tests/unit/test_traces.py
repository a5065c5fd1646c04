"""Trace loaders and the --trace grammar: arrival statistics, token counts, cropping, errors.

Tests marked by the `data` fixture read the real traces under $LOWTIDE_DATA_DIR (default
../shared/data) and skip when they are absent; the rest build small files in tmp_path.
"""

from __future__ import annotations

import csv
import itertools
import math
import random
import statistics
from pathlib import Path

import pytest

from lowtide.emulator.traces import (
    DEFAULT_TOKENS,
    EmpiricalTokens,
    FixedTokens,
    RateWindow,
    TraceRequest,
    TraceSpecError,
    azure,
    data_dir,
    interarrival_sampler,
    parse_seconds,
    parse_trace_spec,
    read_servegen_client,
    servegen_aggregate,
    servegen_clients,
    synthetic,
    synthetic_rate,
    window_arrivals,
)

SERVEGEN = Path("traces/servegen-m-large")
AGGREGATE = Path("traces/servegen-m-large-aggregate.csv")
AZURE_CONV = Path("traces/azure-llm-2023/AzureLLMInferenceTrace_conv.csv")
AZURE_CODE = Path("traces/azure-llm-2023/AzureLLMInferenceTrace_code.csv")
HOUR = 3600.0
DAY = 86400.0


@pytest.fixture
def data() -> Path:
    root = data_dir()
    needed = [root / SERVEGEN / "chunk-142-trace.csv", root / AGGREGATE, root / AZURE_CONV, root / AZURE_CODE]
    missing = [str(p) for p in needed if not p.is_file()]
    if missing:
        pytest.skip(f"reference data absent (set LOWTIDE_DATA_DIR): missing {', '.join(missing)}")
    return root


def _cv(values: list[float]) -> float:
    return statistics.pstdev(values) / statistics.fmean(values)


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def _write_client(directory: Path, client: int, rows: list[str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"chunk-{client}-trace.csv"
    path.write_text("".join(row + "\n" for row in rows))
    return path


# -- inter-arrival samplers and windows --------------------------------------------------------


@pytest.mark.parametrize(("shape", "scale"), [(0.84, 0.1036), (2.5, 0.4), (0.3, 7.0)])
def test_gamma_sampler_has_shape_scale_moments(shape: float, scale: float) -> None:
    rng = random.Random(1)
    draw = interarrival_sampler("Gamma", shape, scale)
    values = [draw(rng) for _ in range(200_000)]
    assert statistics.fmean(values) == pytest.approx(shape * scale, rel=0.02)
    assert _cv(values) == pytest.approx(1 / math.sqrt(shape), rel=0.03)


@pytest.mark.parametrize(("shape", "scale"), [(0.925, 0.261), (1.5, 2.0), (0.6, 0.05)])
def test_weibull_sampler_has_shape_scale_moments(shape: float, scale: float) -> None:
    rng = random.Random(2)
    draw = interarrival_sampler("Weibull", shape, scale)
    values = [draw(rng) for _ in range(200_000)]
    g1, g2 = math.gamma(1 + 1 / shape), math.gamma(1 + 2 / shape)
    assert statistics.fmean(values) == pytest.approx(scale * g1, rel=0.02)
    assert _cv(values) == pytest.approx(math.sqrt(g2 / g1**2 - 1), rel=0.03)


def test_sampler_rejects_unknown_patterns_and_bad_parameters() -> None:
    with pytest.raises(ValueError, match="unknown inter-arrival pattern 'Pareto'"):
        interarrival_sampler("Pareto", 1.0, 1.0)
    with pytest.raises(ValueError, match="shape > 0 and scale > 0"):
        interarrival_sampler("Gamma", 0.0, 1.0)


@pytest.mark.parametrize("pattern", ["Gamma", "Weibull"])
def test_window_carries_its_rate_and_stays_inside(pattern: str) -> None:
    window = RateWindow(1200.0, 600.0, rate=12.345, cv=1.2, pattern=pattern, shape=0.7, scale=3.0)
    for seed in range(20):
        times = window_arrivals(window, 1.0, random.Random(seed))
        assert len(times) in (7407, 7408)  # 12.345 × 600 = 7407.0 (stochastic rounding)
        assert times == sorted(times)
        assert all(1200.0 < t < 1800.0 for t in times)
    scaled = window_arrivals(window, 0.1, random.Random(0))
    assert len(scaled) in (740, 741)


def test_window_gaps_keep_the_pattern_shape_and_mean() -> None:
    shape = 0.5  # Gamma cv = 1/sqrt(0.5) ≈ 1.414, far from Poisson's 1
    window = RateWindow(0.0, 600.0, rate=100.0, cv=1.414, pattern="Gamma", shape=shape, scale=0.02)
    gaps = _gaps(window_arrivals(window, 1.0, random.Random(3)))
    assert statistics.fmean(gaps) == pytest.approx(1 / 100.0, rel=0.01)
    assert _cv(gaps) == pytest.approx(1 / math.sqrt(shape), rel=0.05)


def test_stochastic_rounding_keeps_the_expected_count() -> None:
    window = RateWindow(
        0.0, 600.0, rate=0.0025, cv=1.0, pattern="Gamma", shape=1.0, scale=400.0
    )  # 1.5/window
    counts = [len(window_arrivals(window, 1.0, random.Random(seed))) for seed in range(4000)]
    assert set(counts) == {1, 2}
    assert statistics.fmean(counts) == pytest.approx(1.5, abs=0.05)


def test_empty_pattern_and_zero_rate_mean_no_traffic() -> None:
    assert window_arrivals(RateWindow(0, 600, 5.0, 1.0, "", 0, 0), 1.0, random.Random(0)) == []
    assert window_arrivals(RateWindow(0, 600, 0.0, 1.0, "Gamma", 1, 1), 1.0, random.Random(0)) == []


# -- ServeGen files (small, written here) ------------------------------------------------------


def test_servegen_clients_merge_crop_and_determinism(tmp_path: Path) -> None:
    directory = tmp_path / "sg"
    _write_client(directory, 1, ["0,2.0,1.0,Gamma,1.0,0.5", "600,0,0,,0,0", "1200,1.0,1.0,Weibull,1.0,1.0"])
    _write_client(directory, 2, ["0,1.0,1.0,Gamma,1.0,1.0", "600,3.0,1.0,Gamma,1.0,0.3", "1200,0,0,,0,0"])
    full = list(servegen_clients(directory, seed=7, tokens=FixedTokens(10, 5)))
    assert [r.at_s for r in full] == sorted(r.at_s for r in full)
    assert all(r.prompt_tokens == 10 and r.max_tokens == 5 for r in full)
    one = list(servegen_clients(directory, clients=[1], seed=7, tokens=FixedTokens(10, 5)))
    two = list(servegen_clients(directory, clients=[2], seed=7, tokens=FixedTokens(10, 5)))
    assert sorted(one + two, key=lambda r: r.at_s) == full  # merging = the union of the clients
    assert len([r for r in one if r.at_s < 600]) in (1199, 1200, 1201)  # 2/s × 600 s
    assert not [r for r in one if 600 <= r.at_s < 1200]  # empty pattern: no traffic
    assert len([r for r in one if r.at_s >= 1200]) in (599, 600, 601)  # last window: 600 s too
    assert list(servegen_clients(directory, seed=7, tokens=FixedTokens(10, 5))) == full
    assert list(servegen_clients(directory, seed=8, tokens=FixedTokens(10, 5))) != full
    # A cropped span holds exactly the same requests, shifted to start at 0.
    crop = list(servegen_clients(directory, start_s=450, duration_s=300, seed=7, tokens=FixedTokens(10, 5)))
    expected = [TraceRequest(r.at_s - 450, 10, 5) for r in full if 450 <= r.at_s < 750]
    assert [r.at_s for r in crop] == pytest.approx([r.at_s for r in expected])
    assert crop and all(0 <= r.at_s < 300 for r in crop)


def test_servegen_token_sizes_do_not_depend_on_the_crop(tmp_path: Path) -> None:
    directory = tmp_path / "sg"
    _write_client(directory, 3, ["0,5.0,1.0,Gamma,1.0,0.2"])
    full = list(servegen_clients(directory, seed=1))
    crop = list(servegen_clients(directory, start_s=300, seed=1))
    assert [(r.prompt_tokens, r.max_tokens) for r in crop] == [
        (r.prompt_tokens, r.max_tokens) for r in full if r.at_s >= 300
    ]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("0,1.0,1.0,Gamma,1.0", "expected 6 fields, got 5"),
        ("0,abc,1.0,Gamma,1.0,1.0", "rate is not a number: 'abc'"),
        ("0,1.0,1.0,Pareto,1.0,1.0", "unknown pattern 'Pareto'"),
        ("0,1.0,1.0,Gamma,0,1.0", "Gamma needs shape p1 > 0 and scale p2 > 0"),
        ("0,-1,1.0,Gamma,1,1.0", "rate and cv must be >= 0"),
    ],
)
def test_servegen_file_errors_name_file_and_line(tmp_path: Path, row: str, message: str) -> None:
    path = _write_client(tmp_path, 9, ["600,1.0,1.0,Gamma,1.0,1.0", row.replace("0,", "1200,", 1)])
    with pytest.raises(ValueError, match=rf"chunk-9-trace\.csv:2: {message}"):
        read_servegen_client(path)


def test_servegen_file_must_ascend(tmp_path: Path) -> None:
    path = _write_client(tmp_path, 4, ["600,1,1,Gamma,1,1", "0,1,1,Gamma,1,1"])
    with pytest.raises(ValueError, match="window starts must increase"):
        read_servegen_client(path)


def test_servegen_unknown_client(tmp_path: Path) -> None:
    _write_client(tmp_path, 1, ["0,1,1,Gamma,1,1"])
    with pytest.raises(ValueError, match=r"no trace file for client\(s\) 5"):
        servegen_clients(tmp_path, clients=[5])


# -- synthetic -------------------------------------------------------------------------------------


def _count(requests: list[TraceRequest], lo: float, hi: float) -> int:
    return sum(1 for r in requests if lo <= r.at_s < hi)


def test_synthetic_constant_is_poisson_at_rate() -> None:
    reqs = list(synthetic("constant", rate=10.0, duration_s=2000.0, seed=3))
    assert abs(len(reqs) - 20_000) < 4 * math.sqrt(20_000)
    gaps = _gaps([r.at_s for r in reqs])
    assert _cv(gaps) == pytest.approx(1.0, rel=0.05)  # exponential gaps
    assert all(0 <= r.at_s < 2000 for r in reqs)
    assert reqs == list(synthetic("constant", rate=10.0, duration_s=2000.0, seed=3))


def test_synthetic_ramp_step_diurnal_shapes() -> None:
    ramp = list(synthetic("ramp", rate=2.0, peak=20.0, duration_s=1000.0, seed=1))
    # Expected counts: first tenth ≈ ∫ r = 100 × (2 + 3.8)/2 = 290; last tenth ≈ 100 × (18.2 + 20)/2 = 1910.
    assert abs(_count(ramp, 0, 100) - 290) < 4 * math.sqrt(290)
    assert abs(_count(ramp, 900, 1000) - 1910) < 4 * math.sqrt(1910)
    step = list(synthetic("step", rate=1.0, peak=10.0, duration_s=2000.0, seed=2, step_at_s=500.0))
    assert abs(_count(step, 0, 500) - 500) < 4 * math.sqrt(500)
    assert abs(_count(step, 500, 2000) - 15_000) < 4 * math.sqrt(15_000)
    diurnal = list(synthetic("diurnal", rate=1.0, peak=9.0, duration_s=2 * HOUR, period_s=HOUR, seed=4))
    trough = _count(diurnal, 0, 60) + _count(diurnal, HOUR - 60, HOUR + 60)  # around t=0 and t=period
    peak = _count(diurnal, HOUR / 2 - 60, HOUR / 2 + 60) + _count(diurnal, 1.5 * HOUR - 60, 1.5 * HOUR + 60)
    assert trough < 0.25 * peak
    assert synthetic_rate("diurnal", 1.0, 10.0, peak=9.0, period_s=HOUR)(HOUR / 2) == pytest.approx(9.0)


def test_synthetic_default_peak_and_errors() -> None:
    assert synthetic_rate("ramp", 2.0, 100.0)(100.0) == pytest.approx(8.0)  # peak = 4 × rate
    with pytest.raises(ValueError, match="unknown synthetic kind 'wave'"):
        synthetic_rate("wave", 1.0, 10.0)
    with pytest.raises(ValueError, match="finite duration > 0"):
        synthetic_rate("constant", 1.0, 0.0)


def test_token_samplers() -> None:
    rng = random.Random(5)
    sizes = [DEFAULT_TOKENS.sample(rng) for _ in range(50_000)]
    prompts, outputs = [p for p, _ in sizes], [o for _, o in sizes]
    assert statistics.median(prompts) == pytest.approx(math.exp(6.633), rel=0.05)
    assert statistics.median(outputs) == pytest.approx(math.exp(5.019), rel=0.05)
    assert min(prompts) >= 1 and max(prompts) <= 16384 and max(outputs) <= 2048
    assert FixedTokens(7, 3).sample(rng) == (7, 3)
    pairs = EmpiricalTokens(((1, 2), (3, 4)))
    assert {pairs.sample(rng) for _ in range(100)} == {(1, 2), (3, 4)}
    with pytest.raises(ValueError, match="at least one"):
        EmpiricalTokens(())


# -- the grammar -------------------------------------------------------------------------------------


def test_parse_seconds() -> None:
    assert parse_seconds("90") == 90
    assert parse_seconds("90s") == 90
    assert parse_seconds("10m") == 600
    assert parse_seconds("1d10h30m") == 86400 + 36000 + 1800
    assert parse_seconds("0.5h") == 1800
    for bad in ("", "10x", "h", "10 20", "1.5.2"):
        with pytest.raises(ValueError):
            parse_seconds(bad)


@pytest.fixture
def fake_data(tmp_path: Path) -> Path:
    _write_client(tmp_path / "traces" / "sg", 1, ["0,1,1,Gamma,1,1"])
    _write_client(tmp_path / "traces" / "sg", 2, ["0,1,1,Gamma,1,1"])
    (tmp_path / "agg.csv").write_text("window_start_s,total_rate_rps\n0,5\n600,7\n")
    (tmp_path / "az.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.5,100,10\n2023-11-16 18:00:02.0,200,0\n"
    )
    return tmp_path


def test_spec_servegen_options(fake_data: Path) -> None:
    spec = parse_trace_spec(
        "servegen:traces/sg#clients=1-2#scale=0.5#start=1h#tokens=64/16", data_root=fake_data
    )
    assert spec.kind == "servegen"
    assert spec.path == fake_data / "traces" / "sg"  # found under the data root
    assert spec.clients == (1, 2)
    assert (spec.rate_scale, spec.start_s) == (0.5, 3600.0)
    assert spec.tokens == FixedTokens(64, 16)
    absolute = parse_trace_spec(f"servegen:{fake_data / 'traces' / 'sg'}", data_root=Path("/nonexistent"))
    assert absolute.clients is None


def test_spec_other_sources(fake_data: Path) -> None:
    agg = parse_trace_spec("servegen-aggregate:agg.csv#scale=0.01#cv=2", data_root=fake_data)
    assert (agg.kind, agg.rate_scale, agg.cv) == ("servegen-aggregate", 0.01, 2.0)
    az = parse_trace_spec("azure:az.csv#scale=0.5#start=10m", data_root=fake_data)
    assert (az.kind, az.rate_scale, az.start_s) == ("azure", 0.5, 600.0)
    assert list(parse_trace_spec("azure:az.csv", data_root=fake_data).requests()) == [
        TraceRequest(0.0, 100, 10),
        TraceRequest(1.5, 200, 1),  # max_tokens is at least 1
    ]
    syn = parse_trace_spec("synthetic:diurnal,rate=2,peak=10,period=1h#tokens=8/4")
    assert (syn.synthetic_kind, syn.rate, syn.peak, syn.period_s) == ("diurnal", 2.0, 10.0, 3600.0)
    assert syn.tokens == FixedTokens(8, 4)
    plain = parse_trace_spec("synthetic")
    assert (plain.synthetic_kind, plain.rate) == ("constant", 1.0)
    assert parse_trace_spec("synthetic:step#rate=3#at=30").step_at_s == 30.0
    assert len(list(syn.requests(duration_s=100, seed=1))) > 0
    with pytest.raises(ValueError, match="need a duration"):
        plain.requests()


@pytest.mark.parametrize(
    ("spec", "position", "message"),
    [
        ("", 0, "empty trace spec"),
        ("kafka:topic", 0, "unknown trace source 'kafka'"),
        ("servegen", 8, "servegen needs a path"),
        ("azure:", 6, "azure needs a path"),
        ("servegen:missing", 9, "no readable directory 'missing'"),
        ("azure:nope.csv", 6, "no readable file 'nope.csv'"),
        ("servegen:traces/sg#clients=1,x", 27, "clients: expected client ids or ranges"),
        ("servegen:traces/sg#clients=3", 27, r"clients: no trace file for client\(s\) 3"),
        ("servegen:traces/sg#scale=0", 25, "scale: scale must be a number > 0, got '0'"),
        ("servegen:traces/sg#scale", 19, "expected KEY=VALUE, got 'scale'"),
        ("servegen:traces/sg#speed=2", 19, r"unknown option 'speed' for servegen \(known: clients, scale"),
        ("servegen:traces/sg#scale=1#scale=2", 27, "option 'scale' given twice"),
        ("servegen:traces/sg#start=10x", 25, "start: not a duration: '10x'"),
        ("servegen:traces/sg#tokens=big", 26, "tokens: expected lognormal, azure-conv"),
        ("azure:az.csv#scale=2", 19, "azure traces can only be thinned"),
        ("azure:az.csv#tokens=1/1", 13, "unknown option 'tokens' for azure"),
        ("synthetic:wave", 10, "unknown synthetic kind 'wave'"),
        ("synthetic:ramp,rate=x", 20, "rate: rate must be a number >= 0, got 'x'"),
        ("synthetic:ramp,rate=0,peak=0", 0, "synthetic traffic needs rate or peak > 0"),
        ("synthetic#clients=1", 10, "unknown option 'clients' for synthetic"),
    ],
)
def test_spec_errors_are_located(fake_data: Path, spec: str, position: int, message: str) -> None:
    with pytest.raises(TraceSpecError, match=message) as caught:
        parse_trace_spec(spec, data_root=fake_data)
    assert caught.value.position == position
    assert isinstance(caught.value, ValueError)
    assert f"at char {position + 1}:" in str(caught.value)
    assert str(caught.value).splitlines()[-1] == "  " + " " * position + "^"


def test_spec_servegen_dir_without_client_files(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceSpecError, match=r"has no chunk-<client>-trace\.csv files"):
        parse_trace_spec("servegen:empty", data_root=tmp_path)


def test_spec_empirical_tokens_need_the_data(tmp_path: Path) -> None:
    with pytest.raises(TraceSpecError, match="tokens=azure-conv needs"):
        parse_trace_spec("synthetic#tokens=azure-conv", data_root=tmp_path)


def test_azure_file_errors(tmp_path: Path) -> None:
    bad_header = tmp_path / "h.csv"
    bad_header.write_text("time,in,out\n")
    with pytest.raises(
        ValueError, match=r"h\.csv:1: expected header TIMESTAMP,ContextTokens,GeneratedTokens"
    ):
        list(azure(bad_header))
    backwards = tmp_path / "b.csv"
    backwards.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:02,1,1\n2023-11-16 18:00:01,1,1\n"
    )
    with pytest.raises(ValueError, match=r"b\.csv:3: timestamps go backwards"):
        list(azure(backwards))
    garbage = tmp_path / "g.csv"
    garbage.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,1\n")
    with pytest.raises(ValueError, match=r"g\.csv:2: Invalid isoformat"):
        list(azure(garbage))


# -- the real traces ---------------------------------------------------------------------------------


def test_azure_conv_matches_the_csv(data: Path) -> None:
    path = data / AZURE_CONV
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    reqs = list(azure(path))
    assert len(reqs) == len(rows) == 19_366
    for req, row in zip(reqs[:500], rows[:500], strict=True):
        assert req.prompt_tokens == int(row["ContextTokens"])
        assert req.max_tokens == int(row["GeneratedTokens"])
    assert reqs[0].at_s == 0.0
    # 18:15:46.6805900 -> 18:15:50.9951690
    assert reqs[1].at_s == pytest.approx(4.314579, abs=1e-6)
    assert all(a.at_s <= b.at_s for a, b in itertools.pairwise(reqs))
    assert 3400 < reqs[-1].at_s < 3600  # ~58 minutes


def test_azure_crop_and_thinning(data: Path) -> None:
    path = data / AZURE_CODE
    full = list(azure(path))
    crop = list(azure(path, start_s=600, duration_s=300))
    assert crop == [
        TraceRequest(r.at_s - 600, r.prompt_tokens, r.max_tokens) for r in full if 600 <= r.at_s < 900
    ]
    thin = list(azure(path, rate_scale=0.25, seed=1))
    assert abs(len(thin) - len(full) / 4) < 4 * math.sqrt(len(full) * 0.25 * 0.75)
    assert set(thin) <= set(full)
    with pytest.raises(ValueError, match="can only be thinned"):
        azure(path, rate_scale=2.0)


def test_servegen_gamma_rows_say_p1_is_the_shape(data: Path) -> None:
    """On Gamma rows the recorded cv is 1/sqrt(p1): p1 is the shape (as ServeGen reads it)."""
    windows = read_servegen_client(data / SERVEGEN / "chunk-142-trace.csv")
    gamma = [w for w in windows if w.pattern == "Gamma"]
    assert len(gamma) > 1000
    assert all(w.cv == pytest.approx(1 / math.sqrt(w.shape), rel=1e-6) for w in gamma)
    assert {w.size_s for w in windows} == {600.0}
    assert len(windows) == 14 * 144


def test_servegen_client_142_windows_carry_their_rates(data: Path) -> None:
    """Day 8 of client 142: night (03–05 h) vs morning (10 h) traffic, window by window."""
    directory = data / SERVEGEN
    windows = {w.start_s: w for w in read_servegen_client(directory / "chunk-142-trace.csv")}
    day = 7 * DAY
    night = list(servegen_clients(directory, [142], start_s=day + 3 * HOUR, duration_s=2 * HOUR, seed=11))
    morning = list(servegen_clients(directory, [142], start_s=day + 10 * HOUR, duration_s=HOUR, seed=11))
    for reqs, start, hours in ((night, day + 3 * HOUR, 2), (morning, day + 10 * HOUR, 1)):
        for k in range(hours * 6):
            window = windows[start + 600 * k]
            got = _count(reqs, 600 * k, 600 * (k + 1))
            assert abs(got - window.rate * 600) < 1.0, (start + 600 * k, got, window.rate)
    night_rate = len(night) / (2 * HOUR)
    morning_rate = len(morning) / HOUR
    assert 1.0 < night_rate < 4.0
    assert 30.0 < morning_rate < 45.0


def test_servegen_generated_gaps_follow_the_window_fit(data: Path) -> None:
    windows = read_servegen_client(data / SERVEGEN / "chunk-142-trace.csv")
    busy_gamma = next(w for w in windows if w.pattern == "Gamma" and w.rate > 20)
    busy_weibull = next(w for w in windows if w.pattern == "Weibull" and w.rate > 20)
    for window in (busy_gamma, busy_weibull):
        gaps = _gaps(window_arrivals(window, 1.0, random.Random(5)))
        assert statistics.fmean(gaps) == pytest.approx(1 / window.rate, rel=0.01)
        if window.pattern == "Gamma":
            expected_cv = 1 / math.sqrt(window.shape)
        else:
            g1, g2 = math.gamma(1 + 1 / window.shape), math.gamma(1 + 2 / window.shape)
            expected_cv = math.sqrt(g2 / g1**2 - 1)
        assert _cv(gaps) == pytest.approx(expected_cv, rel=0.06), window


def test_servegen_all_clients_scaled(data: Path) -> None:
    spec = parse_trace_spec(f"servegen:{SERVEGEN}#scale=0.05#start=1d12h")
    reqs = list(spec.requests(duration_s=1200, seed=2))
    assert all(a.at_s <= b.at_s for a, b in itertools.pairwise(reqs))
    assert all(0 <= r.at_s < 1200 for r in reqs)
    expected = 0.0
    for path in sorted((data / SERVEGEN).glob("chunk-*-trace.csv")):
        for w in read_servegen_client(path):
            if DAY + 12 * HOUR <= w.start_s < DAY + 12 * HOUR + 1200 and w.pattern:
                expected += w.rate * 0.05 * 600
    assert abs(len(reqs) - expected) < 162  # each client window rounds by less than one request


def test_servegen_aggregate_rates(data: Path) -> None:
    path = data / AGGREGATE
    with path.open(newline="") as handle:
        rates = {float(r["window_start_s"]): float(r["total_rate_rps"]) for r in csv.DictReader(handle)}
    reqs = list(servegen_aggregate(path, start_s=36000, duration_s=3600, seed=3, rate_scale=0.1))
    for k in range(6):
        got = _count(reqs, 600 * k, 600 * (k + 1))
        assert abs(got - rates[36000 + 600 * k] * 0.1 * 600) < 1.0
    gaps = _gaps([r.at_s for r in reqs[:5000]])
    assert _cv(gaps) == pytest.approx(1.0, rel=0.08)  # cv=1 by default


def test_empirical_tokens_from_azure(data: Path) -> None:
    spec = parse_trace_spec("synthetic#tokens=azure-conv#rate=50")
    assert isinstance(spec.tokens, EmpiricalTokens)
    pairs = set(spec.tokens.pairs)
    reqs = list(spec.requests(duration_s=20, seed=1))
    assert reqs and all((r.prompt_tokens, r.max_tokens) in pairs for r in reqs)
