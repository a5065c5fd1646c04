"""Simulator workloads: load curves (`sim.load`) and research jobs (`sim.jobs`).

Most tests build tiny trace files in tmp_path; those using the `data` fixture read the real
reference data under $LOWTIDE_DATA_DIR (default ../shared/data) and skip when it is absent.
"""

from __future__ import annotations

import bisect
import collections
import math
import random
import statistics
import time
from pathlib import Path

import pytest

from lowtide.emulator.traces import LogNormalTokens, TraceSpecError, data_dir, parse_trace_spec
from lowtide.sim.jobs import (
    DL_GPU_MIX,
    JobTraceError,
    ResearchJob,
    job_workload,
    parse_jobs_spec,
    read_alibaba_pods,
    read_philly_runtimes,
    research_jobs,
)
from lowtide.sim.load import LoadCurve, load_curve, token_means

DAY = 86400.0
HOUR = 3600.0
SERVEGEN = Path("traces/servegen-m-large")
AGGREGATE = Path("traces/servegen-m-large-aggregate.csv")
AZURE_CONV = Path("traces/azure-llm-2023/AzureLLMInferenceTrace_conv.csv")
ALIBABA = Path("traces/alibaba-gpu-v2023/openb_pod_list_default.csv")
PHILLY = Path("traces/philly/philly_runtime.csv")
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
ALIBABA_HEADER = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
    "creation_time,deletion_time,scheduled_time\n"
)


@pytest.fixture
def data() -> Path:
    root = data_dir()
    needed = [
        root / SERVEGEN / "chunk-142-trace.csv",
        root / AGGREGATE,
        root / AZURE_CONV,
        root / ALIBABA,
        root / PHILLY,
    ]
    missing = [str(p) for p in needed if not p.is_file()]
    if missing:
        pytest.skip(f"reference data absent (set LOWTIDE_DATA_DIR): missing {', '.join(missing)}")
    return root


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _client(directory: Path, client: int, rows: list[str]) -> Path:
    return _write(directory / f"chunk-{client}-trace.csv", "".join(r + "\n" for r in rows))


# -- LoadCurve ---------------------------------------------------------------------------------------


def test_rate_lookup_and_changes_without_period() -> None:
    curve = LoadCurve((0.0, 10.0, 20.0, 30.0), (1.0, 2.0, 2.0, 0.5))
    assert [curve.rate_at(t) for t in (0, 9.999, 10, 19, 20, 29.9, 30, 1e9)] == [1, 1, 2, 2, 2, 2, 0.5, 0.5]
    assert curve.next_change_after(0) == 10
    assert curve.next_change_after(10) == 30  # 2.0 → 2.0 at 20 is no change
    assert curve.next_change_after(25) == 30
    assert curve.next_change_after(30) == math.inf
    assert curve.max_rate() == 2.0
    assert curve.expected_requests(5, 35) == pytest.approx(5 * 1 + 20 * 2 + 5 * 0.5)
    assert curve.span_s == 40.0  # the last segment counts as long as the one before
    assert curve.mean_rate() == pytest.approx((10 + 40 + 5) / 40)
    assert curve.mean_rate(until_s=20) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="t >= 0"):
        curve.rate_at(-1.0)


def test_period_wraps_rates_and_changes() -> None:
    curve = LoadCurve((0.0, 6.0, 18.0), (1.0, 5.0, 1.0), period_s=24.0)
    assert curve.rate_at(24 + 7) == 5.0
    assert curve.rate_at(48 + 20) == 1.0
    assert curve.rate_at(24 * 1000 + 5.9) == 1.0
    # 18–24 and 0–6 of the next period have the same rate: the next change is at 6 of the next one.
    assert curve.next_change_after(20) == 24 + 6
    assert curve.next_change_after(24 + 6) == 24 + 18
    assert curve.next_change_after(23.999) == 30.0
    assert curve.expected_requests(0, 48) == pytest.approx(2 * (6 + 60 + 6))
    assert curve.mean_rate() == pytest.approx(72 / 24)
    # A 12-unit window over the peak, and one straddling the wrap at the trough.
    assert curve.peak_window_rate(12) == pytest.approx(5.0)
    assert curve.peak_window_rate(18) == pytest.approx((12 * 5 + 6) / 18)
    shifted = LoadCurve((0.0, 6.0), (4.0, 1.0), period_s=10.0)
    assert shifted.next_change_after(8) == 10.0  # 1.0 → 4.0 at the wrap
    assert shifted.peak_window_rate(8, until_s=None) == pytest.approx((6 * 4 + 2 * 1) / 8)
    flat = LoadCurve((0.0, 5.0), (3.0, 3.0), period_s=10.0)
    assert flat.next_change_after(123.0) == math.inf


def test_peak_window_rate_finds_the_busiest_window() -> None:
    curve = LoadCurve((0.0, 600.0, 900.0, 1200.0), (1.0, 10.0, 4.0, 1.0), period_s=3600.0)
    assert curve.peak_window_rate(300) == pytest.approx(10.0)
    assert curve.peak_window_rate(600) == pytest.approx((300 * 10 + 300 * 4) / 600)
    assert curve.peak_window_rate(7200) == pytest.approx(curve.mean_rate())
    constant = LoadCurve((0.0,), (2.5,))
    assert constant.peak_window_rate() == constant.mean_rate() == constant.max_rate() == 2.5
    assert constant.next_change_after(1e6) == math.inf


def test_lookups_agree_with_a_linear_scan_in_any_order() -> None:
    rng = random.Random(4)
    starts = [0.0]
    for _ in range(500):
        starts.append(starts[-1] + rng.choice((60.0, 600.0, 37.5)))
    rates = [float(rng.randrange(4)) for _ in starts]
    period = starts[-1] + 600.0
    curve = LoadCurve(tuple(starts), tuple(rates), period_s=period)

    def reference(t: float) -> float:
        local = t % period
        return rates[max(i for i, s in enumerate(starts) if s <= local)]

    times = sorted(rng.uniform(0, 3 * period) for _ in range(300))
    for t in times + rng.sample(times, len(times)):
        assert curve.rate_at(t) == reference(t)
        nxt = curve.next_change_after(t)
        assert nxt > t
        assert curve.rate_at(nxt) != curve.rate_at(t)
        # No change in between: every boundary strictly between t and nxt keeps the rate.
        base = math.floor(t / period) * period
        for k in range(bisect.bisect_right(starts, t - base), len(starts)):
            if base + starts[k] >= nxt:
                break
            assert rates[k] == curve.rate_at(t)


def test_lookups_are_fast_on_90_days_of_windows() -> None:
    n = 90 * 144
    curve = LoadCurve(tuple(600.0 * i for i in range(n)), tuple(float(i % 7) for i in range(n)))
    rng = random.Random(1)
    times = [rng.uniform(0, 90 * DAY) for _ in range(100_000)]
    began = time.perf_counter()
    for t in times:
        curve.rate_at(t)
    t, steps = 0.0, 0
    while t < 90 * DAY:
        t = curve.next_change_after(t)
        steps += 1
    assert steps == n  # every window boundary is a change here (i % 7 differs)
    assert time.perf_counter() - began < 2.0


def test_curve_validation_and_scaling() -> None:
    with pytest.raises(ValueError, match="start at 0"):
        LoadCurve((1.0,), (1.0,))
    with pytest.raises(ValueError, match="must increase"):
        LoadCurve((0.0, 5.0, 5.0), (1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match="as many starts as rates"):
        LoadCurve((0.0, 5.0), (1.0,))
    with pytest.raises(ValueError, match="finite and >= 0"):
        LoadCurve((0.0,), (-1.0,))
    with pytest.raises(ValueError, match="after the last start"):
        LoadCurve((0.0, 5.0), (1.0, 1.0), period_s=5.0)
    curve = LoadCurve((0.0, 5.0), (1.0, 3.0), period_s=10.0, prompt_tokens=100, output_tokens=20)
    double = curve.scaled(2.0)
    assert double.rates == (2.0, 6.0)
    assert (double.period_s, double.prompt_tokens, double.output_tokens) == (10.0, 100, 20)
    assert double == LoadCurve((0.0, 5.0), (2.0, 6.0), period_s=10.0, prompt_tokens=100, output_tokens=20)
    with pytest.raises(ValueError, match="scale factor"):
        curve.scaled(-1)


# -- load_curve on small files -------------------------------------------------------------------------


def test_servegen_curve_sums_clients_and_repeats(tmp_path: Path) -> None:
    directory = tmp_path / "sg"
    _client(directory, 1, ["0,2.0,1,Gamma,1,0.5", "600,0,0,,0,0", "1200,1.0,1,Weibull,1,1"])
    _client(directory, 2, ["0,1.5,1,Gamma,1,1", "600,3.0,1,Gamma,1,0.3", "1200,0.25,1,Gamma,1,1"])
    spec = parse_trace_spec(f"servegen:{directory}#tokens=64/16")
    curve = load_curve(spec, days=1)
    assert curve.starts == (0.0, 600.0, 1200.0)
    assert curve.rates == (3.5, 3.0, 1.25)
    assert curve.period_s == 1800.0  # the trace's length: it repeats
    assert curve.rate_at(1800 + 700) == 3.0
    assert (curve.prompt_tokens, curve.output_tokens) == (64, 16)
    one = load_curve(f"servegen:{directory}#clients=1#scale=0.5", days=1)
    assert one.rates == (1.0, 0.0, 0.5)
    # start rotates the trace: t=0 is trace time 900, what came before follows the end.
    rotated = load_curve(f"servegen:{directory}#start=900", days=1)
    assert rotated.starts == (0.0, 300.0, 900.0, 1500.0)
    assert rotated.rates == (3.0, 1.25, 3.5, 3.0)
    assert rotated.period_s == 1800.0
    assert rotated.mean_rate() == pytest.approx(curve.mean_rate())
    on_boundary = load_curve(f"servegen:{directory}#start=600", days=1)
    assert (on_boundary.starts, on_boundary.rates) == ((0.0, 600.0, 1200.0), (3.0, 1.25, 3.5))
    with pytest.raises(ValueError, match="at or after the trace's end"):
        load_curve(f"servegen:{directory}#start=1h", days=1)


def test_aggregate_curve_and_default_token_means(tmp_path: Path) -> None:
    path = _write(tmp_path / "agg.csv", "window_start_s,total_rate_rps\n0,5\n600,7\n\n1200,0\n")
    curve = load_curve(f"servegen-aggregate:{path}#scale=0.1", days=14)
    assert curve.rates == pytest.approx((0.5, 0.7, 0.0))
    assert curve.period_s == 1800.0
    prompt, output = token_means(LogNormalTokens())
    assert (curve.prompt_tokens, curve.output_tokens) == (prompt, output)
    rng = random.Random(3)
    draws = [LogNormalTokens().sample(rng) for _ in range(100_000)]
    assert prompt == pytest.approx(statistics.fmean(p for p, _ in draws), rel=0.02)
    assert output == pytest.approx(statistics.fmean(o for _, o in draws), rel=0.02)


def test_azure_curve_bins_minutes_and_takes_token_means(tmp_path: Path) -> None:
    rows = ["2023-11-16 18:00:00.0,100,10"]  # t=0
    rows += [f"2023-11-16 18:00:{s:02d}.5,300,0" for s in range(1, 31)]  # 30 in minute 0
    rows += [f"2023-11-16 18:01:{s:02d}.0,200,30" for s in range(0, 60, 10)]  # 6 in minute 1
    rows += ["2023-11-16 18:02:05.0,1000,1000"]  # the incomplete last minute: dropped
    path = _write(tmp_path / "az.csv", AZURE_HEADER + "\n".join(rows) + "\n")
    curve = load_curve(f"azure:{path}", days=90)
    assert curve.starts == (0.0, 60.0)
    assert curve.rates == pytest.approx((31 / 60, 6 / 60))
    assert curve.period_s == 120.0
    n = len(rows)
    assert curve.prompt_tokens == pytest.approx((100 + 30 * 300 + 6 * 200 + 1000) / n)
    assert curve.output_tokens == pytest.approx((10 + 30 * 1 + 6 * 30 + 1000) / n)  # at least 1
    thinned = load_curve(f"azure:{path}#scale=0.5#start=1m", days=1)
    assert thinned.rates == pytest.approx((3 / 60, 15.5 / 60))
    short = _write(
        tmp_path / "short.csv", AZURE_HEADER + "2023-11-16 18:00:00,1,1\n2023-11-16 18:00:30,1,1\n"
    )
    with pytest.raises(ValueError, match="too short"):
        load_curve(f"azure:{short}", days=1)


def test_synthetic_curves() -> None:
    constant = load_curve("synthetic#rate=3#tokens=10/5", days=2)
    assert (constant.starts, constant.rates, constant.period_s) == ((0.0,), (3.0,), None)
    assert (constant.prompt_tokens, constant.output_tokens) == (10, 5)
    step = load_curve("synthetic:step,rate=1,peak=6", days=2)
    assert (step.starts, step.rates) == ((0.0, DAY), (1.0, 6.0))  # half the run
    assert load_curve("synthetic:step,rate=1,peak=6,at=1h", days=2).starts == (0.0, HOUR)
    ramp = load_curve("synthetic:ramp,rate=2,peak=20", days=1)
    assert ramp.rate_at(0) == pytest.approx(2.0, abs=0.01)
    assert ramp.rate_at(DAY / 2) == pytest.approx(11.0, abs=0.01)
    assert ramp.rate_at(5 * DAY) == 20.0  # holds its peak after the run
    assert ramp.mean_rate(until_s=DAY) == pytest.approx(11.0, rel=1e-3)
    diurnal = load_curve("synthetic:diurnal,rate=1,peak=9,period=1d", days=30)
    assert diurnal.period_s == DAY
    assert diurnal.rate_at(12 * HOUR) == pytest.approx(9.0, abs=0.01)
    assert diurnal.rate_at(3 * DAY) == pytest.approx(1.0, abs=0.01)
    assert diurnal.mean_rate() == pytest.approx(5.0, rel=1e-3)
    assert diurnal.peak_window_rate(600) == pytest.approx(9.0, abs=0.01)
    with pytest.raises(ValueError, match="days must be"):
        load_curve("synthetic", days=0)


def test_load_spec_errors_propagate_located(tmp_path: Path) -> None:
    with pytest.raises(TraceSpecError, match="unknown trace source 'kafka'"):
        load_curve("kafka:x", days=1)
    with pytest.raises(TraceSpecError, match=r"no readable file 'nope\.csv'"):
        load_curve("azure:nope.csv", days=1, data_root=tmp_path)
    _write(tmp_path / "agg.csv", "window_start_s,total_rate_rps\n0,5\n")
    assert load_curve("servegen-aggregate:agg.csv", days=1, data_root=tmp_path).rates == (5.0,)


# -- malformed load files: every reader names the file and the line ---------------------------------


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (
            ["window_start_s,rate,cv,pattern,p1,p2", "0,1,1,Gamma,1,1"],
            r"chunk-7-trace\.csv:1: start is not a number",
        ),
        (["0,1,1,Gamma,1,1", "600,1,1,Gamma,1"], r"chunk-7-trace\.csv:2: expected 6 fields, got 5"),
        (["0,1,1,Gamma,1,1", "600,x,1,Gamma,1,1"], r"chunk-7-trace\.csv:2: rate is not a number: 'x'"),
        (["0,1,1,Gamma,1,1", "600,-2,1,Gamma,1,1"], r"chunk-7-trace\.csv:2: rate and cv must be >= 0"),
        (
            ["0,1,1,Gamma,1,1", "1200,1,1,Gamma,1,1", "600,1,1,Gamma,1,1"],
            r"chunk-7-trace\.csv:3: window starts must increase \(1200 then 600\)",
        ),
        (["0,1,1,Gamma,1,1", "", "0,1,1,Gamma,1,1"], r"chunk-7-trace\.csv:3: window starts must increase"),
        ([], r"chunk-7-trace\.csv: no windows \(empty file\)"),
    ],
)
def test_servegen_file_errors_are_located(tmp_path: Path, rows: list[str], message: str) -> None:
    _client(tmp_path / "sg", 7, rows)
    with pytest.raises(ValueError, match=message):
        load_curve(f"servegen:{tmp_path / 'sg'}", days=1)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("start,rate\n0,1\n", r"agg\.csv:1: missing column 'window_start_s' \(have: start, rate\)"),
        (
            "window_start_s,total_rate_rps\n0,1\n600,lots\n",
            r"agg\.csv:3: total_rate_rps is not a number: 'lots'",
        ),
        ("window_start_s,total_rate_rps\n0,1\n600,-1\n", r"agg\.csv:3: total_rate_rps must be >= 0"),
        ("window_start_s,total_rate_rps\n0,1\n600,nan\n", r"agg\.csv:3: total_rate_rps is not finite"),
        (
            "window_start_s,total_rate_rps\n0,1\n\n\n600,1\n300,1\n",
            r"agg\.csv:6: window starts must increase \(600 then 300\)",
        ),
        ("window_start_s,total_rate_rps\n0,1\n\n600\n", r"agg\.csv:4: total_rate_rps is not a number: ''"),
        ("window_start_s,total_rate_rps\n", r"agg\.csv: no windows \(a header but no rows\)"),
    ],
)
def test_aggregate_file_errors_are_located(tmp_path: Path, text: str, message: str) -> None:
    path = _write(tmp_path / "agg.csv", text)
    with pytest.raises(ValueError, match=message):
        load_curve(f"servegen-aggregate:{path}", days=1)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "time,in,out\n",
            r"az\.csv:1: expected header TIMESTAMP,ContextTokens,GeneratedTokens, got time,in,out",
        ),
        (
            AZURE_HEADER + "2023-11-16 18:00:02,1,1\n\n2023-11-16 18:00:01,1,1\n",
            r"az\.csv:4: timestamps go backwards",
        ),
        (
            AZURE_HEADER + "2023-11-16 18:00:02,many,1\n",
            r"az\.csv:2: ContextTokens is not an integer: 'many'",
        ),
        (
            AZURE_HEADER + "2023-11-16 18:00:02,1,2.5\n",
            r"az\.csv:2: GeneratedTokens is not an integer: '2\.5'",
        ),
        (AZURE_HEADER + "2023-11-16 18:00:02,-1,1\n", r"az\.csv:2: token counts must be >= 0"),
        (AZURE_HEADER + "2023-11-16 18:00:02,1\n", r"az\.csv:2: expected 3 fields, got 2"),
        (AZURE_HEADER + "noon,1,1\n", r"az\.csv:2: Invalid isoformat"),
        (AZURE_HEADER, r"az\.csv: no requests"),
    ],
)
def test_azure_file_errors_are_located(tmp_path: Path, body: str, message: str) -> None:
    path = _write(tmp_path / "az.csv", body)
    with pytest.raises(ValueError, match=message):
        load_curve(f"azure:{path}", days=1)


# -- research jobs: Alibaba ------------------------------------------------------------------------------


def _pods(tmp_path: Path, rows: list[str]) -> Path:
    return _write(tmp_path / "pods.csv", ALIBABA_HEADER + "".join(r + "\n" for r in rows))


POD_ROWS = [
    "p-a,1000,1024,1,1000,,LS,Succeeded,0,1000,100",  # 1 GPU, work 900
    "p-b,1000,1024,1,460,,BE,Running,1000,5000,1000",  # fractional → 1 GPU, censored, low
    "p-c,1000,1024,0,0,,LS,Succeeded,2000,3000,2000",  # no GPU: not a job
    "p-d,1000,1024,8,1000,,LS,Failed,3000,3500,3100",  # 8 GPUs
    "p-e,1000,1024,2,1000,,LS,Pending,4000,4100,",  # never scheduled
    "p-f,1000,1024,4,1000,,Burstable,Failed,5000,5000,5000",  # zero duration
    "p-g,1000,1024,16,1000,,BE,Succeeded,9000,10000,9500",  # wider than any node
]


def test_alibaba_pods_become_jobs(tmp_path: Path) -> None:
    path = _pods(tmp_path, POD_ROWS)
    pods, end = read_alibaba_pods(path)
    assert [p.name for p in pods] == ["p-a", "p-b", "p-d", "p-e", "p-f", "p-g"]
    assert end == 10000
    spec = parse_jobs_spec(f"alibaba:{path}")
    workload = job_workload(spec, days=1, seed=0, max_gpus=8)
    jobs = {j.name: j for j in workload.jobs}
    assert sorted(jobs) == ["p-a", "p-b", "p-d", "p-g"]
    assert (jobs["p-a"].gpus, jobs["p-a"].work_s, jobs["p-a"].priority) == (1, 900, "normal")
    assert (jobs["p-b"].gpus, jobs["p-b"].work_s, jobs["p-b"].priority) == (1, 4000, "low")
    assert jobs["p-d"].gpus == 8
    assert jobs["p-g"].gpus == 8 and workload.clipped == 1
    assert workload.censored == 1
    assert any("clipped" in n for n in workload.notes) and any("censored" in n for n in workload.notes)
    # The span [first creation = 0, last timestamp = 10000] is mapped onto the day.
    assert jobs["p-d"].submit_s == pytest.approx(3000 * DAY / 10000)
    assert [j.submit_s for j in workload.jobs] == sorted(j.submit_s for j in workload.jobs)
    assert all(j.team.startswith("team-") for j in workload.jobs)
    assert research_jobs(spec, days=1, seed=5, max_gpus=8) == workload.jobs  # seed unused without jobs=
    assert (
        job_workload(parse_jobs_spec(f"alibaba:{path}#max_gpus=4"), days=1, seed=0, max_gpus=8).clipped == 2
    )


def test_alibaba_time_mapping_and_sampling(tmp_path: Path) -> None:
    rows = [
        f"p-{i:04d},1,1,1,1000,,LS,Succeeded,{i * 3600},{i * 3600 + 600},{i * 3600 + 60}" for i in range(200)
    ]
    path = _pods(tmp_path, rows)
    real = research_jobs(parse_jobs_spec(f"alibaba:{path}#scale=1"), days=1, seed=0, max_gpus=8)
    # start=auto: the 1st-percentile creation time (pod 2 of 200) is t=0; real time from there.
    assert [j.name for j in real] == [f"p-{i:04d}" for i in range(2, 26)]
    assert [j.submit_s for j in real] == [h * 3600.0 for h in range(24)]
    assert all(j.work_s == 540 for j in real)  # durations are never scaled
    full = research_jobs(parse_jobs_spec(f"alibaba:{path}#start=0"), days=2, seed=0, max_gpus=8)
    assert len(full) == 200
    assert full[-1].submit_s == pytest.approx(199 * 3600 * 2 * DAY / (199 * 3600 + 600))
    a = research_jobs(parse_jobs_spec(f"alibaba:{path}#jobs=20"), days=2, seed=1, max_gpus=8)
    b = research_jobs(parse_jobs_spec(f"alibaba:{path}#jobs=20"), days=2, seed=1, max_gpus=8)
    c = research_jobs(parse_jobs_spec(f"alibaba:{path}#jobs=20"), days=2, seed=2, max_gpus=8)
    assert a == b != c
    assert len(a) == 20 and a[-1].submit_s - a[0].submit_s > DAY  # spread over the span
    assert len(research_jobs(parse_jobs_spec(f"alibaba:{path}#jobs=5000"), days=2, seed=1, max_gpus=8)) == 198


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", r"pods\.csv:1: empty file: expected a header line"),
        (
            "name,num_gpu,qos\np,1,LS\n",
            r"pods\.csv:1: missing column 'gpu_milli' \(have: name, num_gpu, qos\)",
        ),
        (
            ALIBABA_HEADER + "p,1,1,one,1000,,LS,Running,0,10,0\n",
            r"pods\.csv:2: num_gpu is not a non-negative integer: 'one'",
        ),
        (
            ALIBABA_HEADER + "p,1,1,1,1000,,LS,Running,0,10,0\n\nq,1,1,1,1000,,LS,Running,soon,10,0\n",
            r"pods\.csv:4: creation_time is not a number: 'soon'",
        ),
        (
            ALIBABA_HEADER + "p,1,1,1,1000,,LS,Running,100,50,\n",
            r"pods\.csv:2: deletion_time 50 is before creation_time 100",
        ),
        (
            ALIBABA_HEADER + "p,1,1,1,1000,,LS,Running,100,150,200\n",
            r"pods\.csv:2: negative duration: deletion_time 150 is before scheduled_time 200",
        ),
        (
            ALIBABA_HEADER + "p,1,1,1,1000,,LS,Running,100,150,50\n",
            r"pods\.csv:2: scheduled_time 50 is before creation_time 100",
        ),
        (
            ALIBABA_HEADER + "p,1,1,1,x,,LS,Running,100,150,100\n",
            r"pods\.csv:2: gpu_milli is not a number: 'x'",
        ),
        (
            ALIBABA_HEADER + "p,1,1,1,1000,,LS,Pending,100,150,\n",
            r"pods\.csv: no scheduled GPU pod with a positive duration",
        ),
    ],
)
def test_alibaba_file_errors_are_located(tmp_path: Path, text: str, message: str) -> None:
    path = _write(tmp_path / "pods.csv", text)
    spec = parse_jobs_spec(f"alibaba:{path}")
    with pytest.raises(JobTraceError, match=message) as caught:
        research_jobs(spec, days=1, seed=0, max_gpus=8)
    assert isinstance(caught.value, ValueError)
    assert caught.value.path == path


# -- research jobs: Philly and synthetic -------------------------------------------------------------


def test_philly_jobs(tmp_path: Path) -> None:
    path = _write(tmp_path / "philly.csv", "runtime\n0.0\n60\n\n3600\n7200.5\n")
    assert read_philly_runtimes(path) == [0.0, 60.0, 3600.0, 7200.5]
    spec = parse_jobs_spec(f"philly:{path}#rate=20#low=0.25")
    jobs = research_jobs(spec, days=10, seed=3, max_gpus=8)
    expected = 20 * 24 * 10
    assert abs(len(jobs) - expected) < 4 * math.sqrt(expected)
    assert {j.work_s for j in jobs} == {60.0, 3600.0, 7200.5}  # zero runtimes left out
    assert [j.submit_s for j in jobs] == sorted(j.submit_s for j in jobs)
    assert all(0 <= j.submit_s < 10 * DAY for j in jobs)
    gpus = collections.Counter(j.gpus for j in jobs)
    for size, share in DL_GPU_MIX:
        assert gpus[size] / len(jobs) == pytest.approx(share, abs=0.03)
    assert sum(j.priority == "low" for j in jobs) / len(jobs) == pytest.approx(0.25, abs=0.03)
    assert jobs == research_jobs(spec, days=10, seed=3, max_gpus=8)
    assert jobs != research_jobs(spec, days=10, seed=4, max_gpus=8)
    exact = research_jobs(parse_jobs_spec(f"philly:{path}#jobs=50"), days=1, seed=0, max_gpus=2)
    assert len(exact) == 50 and max(j.gpus for j in exact) == 2
    capped = research_jobs(parse_jobs_spec(f"philly:{path}#jobs=5#rate=100"), days=1, seed=0, max_gpus=8)
    assert len(capped) == 5 and capped[-1].submit_s < HOUR  # the first 5 of a fast process


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("seconds\n1\n", r"philly\.csv:1: expected the header 'runtime', got 'seconds'"),
        ("runtime\n1\n\nlong\n", r"philly\.csv:4: runtime is not a number: 'long'"),
        ("runtime\n-5\n", r"philly\.csv:2: negative runtime -5"),
        ("runtime\n1,2\n", r"philly\.csv:2: expected 1 field, got 2"),
        ("runtime\n0\n", r"philly\.csv: no positive runtime"),
    ],
)
def test_philly_file_errors_are_located(tmp_path: Path, text: str, message: str) -> None:
    path = _write(tmp_path / "philly.csv", text)
    with pytest.raises(JobTraceError, match=message):
        research_jobs(parse_jobs_spec(f"philly:{path}"), days=1, seed=0, max_gpus=8)


def test_synthetic_jobs_follow_day_and_night() -> None:
    spec = parse_jobs_spec("synthetic:rate=30,swing=0.8,median=30m,sigma=1#teams=3")
    jobs = research_jobs(spec, days=20, seed=1, max_gpus=8)
    hours = collections.Counter(int(j.submit_s % DAY // HOUR) for j in jobs)
    day, night = hours[13] + hours[14] + hours[15], hours[1] + hours[2] + hours[3]
    assert night < 0.3 * day  # peak 1.8×, trough 0.2× the mean
    assert len(jobs) == pytest.approx(30 * 24 * 20, rel=0.05)
    assert statistics.median(j.work_s for j in jobs) == pytest.approx(1800, rel=0.1)
    assert {j.team for j in jobs} == {"team-a", "team-b", "team-c"}
    assert {j.priority for j in jobs} == {"low", "normal"}
    assert jobs == research_jobs(spec, days=20, seed=1, max_gpus=8)
    exact = research_jobs(parse_jobs_spec("synthetic#jobs=300"), days=3, seed=9, max_gpus=8)
    assert len(exact) == 300 and all(0 <= j.submit_s < 3 * DAY for j in exact)


def test_research_job_validation() -> None:
    with pytest.raises(ValueError, match="at least one GPU"):
        ResearchJob("j", "t", 0.0, 0, 10.0, "normal")
    with pytest.raises(ValueError, match="work_s"):
        ResearchJob("j", "t", 0.0, 1, 0.0, "normal")
    with pytest.raises(ValueError, match="priority"):
        ResearchJob("j", "t", 0.0, 1, 10.0, "urgent")
    with pytest.raises(ValueError, match="days must be"):
        research_jobs(parse_jobs_spec("synthetic"), days=-1, seed=0, max_gpus=8)


@pytest.mark.parametrize(
    ("spec", "position", "message"),
    [
        ("", 0, "empty job spec"),
        ("borg:x.csv", 0, "unknown job source 'borg'"),
        ("alibaba:nope.csv", 8, "no readable file 'nope.csv'"),
        ("alibaba", 7, "no readable file"),  # the default file is not under this data root
        ("philly:ph.csv#jobs=0", 19, "jobs: expected an integer >= 1, got '0'"),
        ("philly:ph.csv#jobs", 14, "expected KEY=VALUE, got 'jobs'"),
        ("philly:ph.csv#scale=2", 14, r"unknown option 'scale' for philly \(known: jobs, rate"),
        ("philly:ph.csv#rate=1#rate=2", 21, "option 'rate' given twice"),
        ("philly:ph.csv#rate=-1", 19, "rate: expected a number > 0, got '-1'"),
        ("philly:ph.csv#low=1.5", 18, r"low: expected a number >= 0 and <= 1, got '1\.5'"),
        ("synthetic:rate=2,swing=x", 23, "swing: expected a number >= 0 and <= 1"),
        ("synthetic#median=0", 17, "median: must be > 0"),
        ("synthetic#teams=27", 16, "teams: expected an integer from 1 to 26"),
        ("alibaba:pods.csv#start=10x", 23, "start: not a duration"),
        ("alibaba:pods.csv#max_gpus=0", 26, "max_gpus: expected an integer >= 1"),
    ],
)
def test_job_spec_errors_are_located(tmp_path: Path, spec: str, position: int, message: str) -> None:
    _write(tmp_path / "ph.csv", "runtime\n1\n")
    _pods(tmp_path, POD_ROWS)
    with pytest.raises(JobTraceError, match=message) as caught:
        parse_jobs_spec(spec, data_root=tmp_path)
    assert caught.value.position == position
    assert f"at char {position + 1}:" in str(caught.value)
    assert str(caught.value).splitlines()[-1] == "  " + " " * position + "^"


def test_job_spec_options_and_defaults(tmp_path: Path) -> None:
    _pods(tmp_path, POD_ROWS)
    spec = parse_jobs_spec(
        "alibaba:pods.csv#jobs=10#scale=0.5#start=1d#max_gpus=4#teams=2", data_root=tmp_path
    )
    assert (spec.kind, spec.path, spec.jobs, spec.scale, spec.start_s) == (
        "alibaba",
        tmp_path / "pods.csv",
        10,
        0.5,
        DAY,
    )
    assert (spec.max_gpus, spec.teams) == (4, 2)
    assert parse_jobs_spec("alibaba:pods.csv#start=auto", data_root=tmp_path).start_s is None
    synth = parse_jobs_spec("synthetic:rate=2,swing=0.5#median=2h#sigma=0.5#low=0")
    assert (synth.rate_per_h, synth.swing, synth.median_s, synth.sigma, synth.low_share) == (
        2,
        0.5,
        7200,
        0.5,
        0,
    )
    default = tmp_path / "traces" / "philly" / "philly_runtime.csv"
    _write(default, "runtime\n5\n")
    assert parse_jobs_spec("philly", data_root=tmp_path).path == default


# -- the real reference data -----------------------------------------------------------------------------


def test_real_alibaba_trace(data: Path) -> None:
    began = time.perf_counter()
    pods, _ = read_alibaba_pods(data / ALIBABA)
    assert time.perf_counter() - began < 1.0
    assert len(pods) == 7064  # num_gpu >= 1 of 8,152
    workload = job_workload(parse_jobs_spec("alibaba", data_root=data), days=14, seed=0, max_gpus=8)
    jobs = workload.jobs
    assert len(jobs) >= 1000
    gpus = collections.Counter(j.gpus for j in jobs)
    assert set(gpus) == {1, 2, 4, 8} and gpus[1] > 0.9 * len(jobs)
    assert workload.clipped == 0
    assert 0.3 < sum(j.priority == "low" for j in jobs) / len(jobs) < 0.5  # qos BE
    assert 0 < workload.censored < len(jobs)
    days = collections.Counter(int(j.submit_s // DAY) for j in jobs)
    assert set(days) == set(range(14))  # the mix covers the whole run
    narrow = job_workload(parse_jobs_spec("alibaba", data_root=data), days=14, seed=0, max_gpus=4)
    assert narrow.clipped == gpus[8]


def test_real_philly_runtimes(data: Path) -> None:
    runtimes = read_philly_runtimes(data / PHILLY)
    assert len(runtimes) == 83_154
    positive = sorted(r for r in runtimes if r > 0)
    assert 1000 < statistics.median(positive) < 2000  # the README: p50 1,186 s over all rows
    jobs = research_jobs(parse_jobs_spec("philly#jobs=1000", data_root=data), days=14, seed=0, max_gpus=8)
    assert len(jobs) == 1000


def test_real_servegen_total_has_a_day_night_cycle(data: Path) -> None:
    curve = load_curve(f"servegen:{data / SERVEGEN}", days=14)
    assert curve.period_s == 14 * DAY
    hourly = [  # mean rate per hour of day over the 14 days
        statistics.fmean(
            curve.expected_requests(d * DAY + h * HOUR, d * DAY + (h + 1) * HOUR) for d in range(14)
        )
        / HOUR
        for h in range(24)
    ]
    trough, peak = min(hourly), max(hourly)
    assert trough < 0.8 * peak  # mild in the sum (per client it is much stronger)
    assert trough > 100 and peak < 300
    client = load_curve(f"servegen:{data / SERVEGEN}#clients=142", days=14)
    night = client.expected_requests(7 * DAY + 3 * HOUR, 7 * DAY + 5 * HOUR) / (2 * HOUR)
    morning = client.expected_requests(7 * DAY + 10 * HOUR, 7 * DAY + 11 * HOUR) / HOUR
    assert night < 0.15 * morning


def test_real_aggregate_matches_the_client_sum(data: Path) -> None:
    summed = load_curve(f"servegen:{data / SERVEGEN}", days=14)
    aggregate = load_curve(f"servegen-aggregate:{data / AGGREGATE}", days=14)
    assert aggregate.period_s == summed.period_s
    assert aggregate.mean_rate() == pytest.approx(summed.mean_rate(), rel=0.02)
    for k in range(0, 2016, 7):
        t = k * 600.0 + 1
        assert aggregate.rate_at(t) == pytest.approx(summed.rate_at(t), rel=0.02, abs=0.01)


def test_real_azure_curve(data: Path) -> None:
    curve = load_curve(f"azure:{data / AZURE_CONV}", days=90)
    assert curve.period_s is not None and 3400 < curve.period_s < 3600
    assert 19_000 < curve.expected_requests(0, curve.period_s) <= 19_366
    assert 900 < curve.prompt_tokens < 1500 and 150 < curve.output_tokens < 300
    assert curve.rate_at(89 * DAY) == curve.rate_at(89 * DAY % curve.period_s)
