"""The simulator: the production loop on a virtual clock (lowtide.sim), checked as a user would.

A hand-computed tiny scenario checks every figure of the summary; a property test checks that the
GPU ledger adds up to capacity × time over random scenarios; the oracle bounds every policy
across seeds; the seed's situation (night trough ≈ half the day's replicas) shows what each
policy harvests; and the command line writes what it says and refuses bad input with exit 2.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from lowtide.cli.main import app
from lowtide.control.inference import ServiceSetup
from lowtide.domain.gpus import Node
from lowtide.domain.services import AutoscaleTargets, LendingPolicy, ServiceSpec
from lowtide.sim.capacity import ReplicaCapacity, derive_replica_capacity, steady_state
from lowtide.sim.fleet import FleetOptions, default_scenario, start_epoch
from lowtide.sim.jobs import ResearchJob
from lowtide.sim.load import LoadCurve
from lowtide.sim.oracle import (
    idle_in_spells,
    idle_in_spells_gpu_hours,
    needed_replicas,
    oracle_harvest_gpu_seconds,
    oracle_idle_gpu_seconds,
)
from lowtide.sim.ports import ReplicaTimes
from lowtide.sim.run import compare, simulate
from lowtide.sim.scenario import Scenario, SimService, StepDefaults

H = 3600.0
STARTUP = 120.0


def service(curve: LoadCurve, *, max_replicas: int, gpus: int = 4, peak_rps: float = 10.0) -> SimService:
    """A service whose replica reaches the autoscaler's concurrency target at `peak_rps`."""
    spec = ServiceSpec(
        name="chat",
        model="m",
        gpus_per_replica=gpus,
        min_replicas=1,
        max_replicas=max_replicas,
        park="sleep",
        startup_s=STARTUP,
        wake_s=10.0,
        autoscale=AutoscaleTargets(scale_up_window_s=30, scale_down_stabilization_s=300),
    )
    capacity = derive_replica_capacity(
        peak_rps,
        500.0,
        200.0,
        replicas_at_peak=1,
        target_concurrency=spec.autoscale.concurrency_per_replica or 32,
    )
    return SimService(
        setup=ServiceSetup(spec=spec, command=("simulated",), base_port=1, reclaim_grace_s=60.0),
        capacity=capacity,
        curve=curve,
        times=ReplicaTimes(startup_s=STARTUP, wake_s=10.0),
        slo_ttft_p90_s=2.0,
    )


def tiny(days: float, jobs: tuple[ResearchJob, ...], rate: float = 2.0) -> Scenario:
    curve = LoadCurve((0.0,), (rate,))
    svc = service(curve, max_replicas=2)
    lending = LendingPolicy(mode="continuous", reclaim_lead_s=2 + 60 + 10)
    return Scenario(
        nodes=(Node("n1", tuple(range(8))),),
        services=(svc,),
        lending=lending,
        jobs=jobs,
        start=start_epoch("UTC"),
        days=days,
        steps=StepDefaults(grace_s=120, restart_s=120, checkpoint_every_s=1800, checkpoint_write_s=20),
    )


def test_a_hand_computed_scenario_gives_every_figure_of_the_summary() -> None:
    """8 GPUs, a constant load one 4-GPU replica serves, one 4-GPU job of 1 h of work, 6 hours.

    The replica is booked at t=0 and serves from t=120 s; nothing is lent before the service's
    first fresh metrics (issue 12: a service never healthy since start is not fresh), so the job
    starts at t=120 s on the other four GPUs, loads for 120 s, works 3,600 s and ends at 3,840 s;
    nothing else happens."""
    job = ResearchJob(name="sft", team="nlp", submit_s=0.0, gpus=4, work_s=3600.0, priority="normal")
    s = tiny(0.25, (job,))
    assert needed_replicas(s.services[0], 2.0) == 1
    run = simulate(s, "continuous", price=2.0, currency="KRW")
    out = run.summary
    total_h = 8 * 6.0
    harvested_h = 4 * 3720 / H
    inference_h = 4 * 6.0
    assert out["gpu_hours_total"] == pytest.approx(total_h)
    assert out["gpu_hours_harvested"] == pytest.approx(harvested_h)
    assert out["gpu_hours_inference"] == pytest.approx(inference_h)
    assert out["gpu_hours_idle"] == pytest.approx(total_h - harvested_h - inference_h)
    assert out["oracle_idle_gpu_hours"] == pytest.approx(4 * 6.0)
    assert out["harvest_efficiency"] == pytest.approx(harvested_h / 24.0)
    assert out["gpu_hours_lost_to_preemption"] == 0.0
    assert out["preemptions"] == 0 and out["reclaims"] == 0
    # Nothing serves before the replica is healthy: those two minutes violate the SLO.
    assert out["slo_violation_minutes"] == pytest.approx(STARTUP / 60)
    assert out["baseline_none"]["slo_violation_minutes"] == pytest.approx(STARTUP / 60)
    assert out["baseline_none"]["gpu_hours_inference"] == pytest.approx(8 * 6.0)
    assert (out["job_wait_p50_s"], out["job_completion_p50_s"]) == (STARTUP, STARTUP + 3720.0)
    assert out["jobs_succeeded"] == 1 and out["jobs_unfinished"] == 0
    assert out["equivalent_gpus"] == pytest.approx(harvested_h / 6.0)
    assert out["savings"] == pytest.approx(harvested_h * 2.0) and out["currency"] == "KRW"
    assert out["tick_errors"] == 0


def test_a_surge_preempts_the_job_which_resumes_from_its_checkpoint_and_loses_only_the_tail() -> None:
    """The load steps up at 2 h to what needs both replicas: the job (4 GPUs, 3 h of work, a
    checkpoint every 30 min) gets notice, checkpoints in 20 s and leaves; when the load falls at
    4 h it resumes from that checkpoint and finishes."""
    curve = LoadCurve((0.0, 2 * H, 4 * H), (2.0, 15.0, 2.0))
    base = tiny(0.5, (ResearchJob("pt", "nlp", 0.0, 4, 3 * H, "normal"),))
    s = replace(base, services=(replace(base.services[0], curve=curve),))
    run = simulate(s, "continuous")
    out = run.summary
    assert out["preemptions"] == 1 and out["reclaims"] == 1
    assert out["jobs_succeeded"] == 1
    # The checkpoint written on notice (20 s) kept every second of work: the ledger counts work
    # lost since the last checkpoint, and the step exited the moment it was written.
    assert out["gpu_hours_lost_to_preemption"] == 0.0
    # The second replica never ran before: it cold-starts (120 s) on the GPUs the job gave back
    # after its 20 s checkpoint; the surge is seen within a tick.
    assert out["reclaim_latency_p50_s"] == pytest.approx(20 + STARTUP, abs=2 * s.tick_s)
    assert run.world is not None
    attempts = run.world.store.job_detail(next(iter(run.trace.submitted))).attempts  # type: ignore[union-attr]
    assert [a.state.value for a in attempts] == ["INTERRUPTED", "SUCCEEDED"]
    noticed = attempts[0]
    assert noticed.notice_at is not None and noticed.ended_at == pytest.approx(noticed.notice_at + 20.0)
    # It resumed from the progress it had at notice: its time running (it started once the
    # service's metrics were fresh, issue 12) minus the 120 s of loading, in seconds.
    assert attempts[1].record["resume_from"] == f"p{int(noticed.notice_at - noticed.started_at - 120)}"
    assert attempts[1].ended_at == pytest.approx(
        attempts[1].started_at + 120 + 3 * H - (noticed.notice_at - s.start - 120)
    )


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rates=st.lists(st.floats(0.0, 30.0), min_size=1, max_size=8),
    jobs=st.lists(
        st.tuples(st.floats(0, 20 * H), st.sampled_from([1, 2, 4, 8]), st.floats(600, 6 * H)), max_size=12
    ),
    policy=st.sampled_from(["window", "continuous", "forecast"]),
)
def test_the_ledger_adds_up_to_capacity_times_time(
    rates: list[float], jobs: list[tuple[float, int, float]], policy: str
) -> None:
    curve = LoadCurve(tuple(i * 3 * H for i in range(len(rates))), tuple(rates))
    research = tuple(ResearchJob(f"j{i}", "t", a, g, w, "normal") for i, (a, g, w) in enumerate(jobs))
    s = Scenario(
        nodes=(Node("n1", tuple(range(8))), Node("n2", tuple(range(8)))),
        services=(service(curve, max_replicas=4),),
        lending=LendingPolicy(reclaim_lead_s=72.0),
        jobs=research,
        start=start_epoch("UTC"),
        days=1.0,
    )
    run = simulate(s, policy)  # type: ignore[arg-type]
    out = run.summary
    held = out["gpu_hours_inference"] + out["gpu_hours_harvested"] + out["gpu_hours_idle"]
    assert held == pytest.approx(out["gpu_hours_total"], rel=1e-9)
    assert out["tick_errors"] == 0
    assert run.world is not None
    for holding in run.world.store.holdings():
        assert holding.since <= s.end


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_oracle_bounds_every_policy(seed: int) -> None:
    curve = LoadCurve(
        tuple(h * H for h in range(24)),
        tuple(4.0 + 26.0 * (1 - math.cos(2 * math.pi * h / 24)) / 2 for h in range(24)),
        period_s=24 * H,
    )
    rng = random.Random(seed)
    jobs = tuple(
        ResearchJob(
            f"j{i}",
            f"t{i % 3}",
            rng.uniform(0, 36 * H),
            rng.choice([1, 2, 4, 8]),
            rng.uniform(H, 10 * H),
            "normal",
        )
        for i in range(60)
    )
    s = Scenario(
        nodes=tuple(Node(f"n{i}", tuple(range(8))) for i in range(4)),
        services=(service(curve, max_replicas=8, peak_rps=30.0 / 7),),
        lending=LendingPolicy(reclaim_lead_s=72.0),
        jobs=jobs,
        start=start_epoch("UTC"),
        days=2.0,
        seed=seed,
    )
    runs = compare(s, ["none", "window", "continuous", "forecast", "oracle"])
    oracle = runs[-1].summary
    assert oracle["policy"] == "oracle"
    for run in runs[:-1]:
        out = run.summary
        assert out["gpu_hours_harvested"] <= oracle["oracle_idle_gpu_hours"] + 1e-6, run.policy
        # Against what the jobs could use: a policy also spends GPU-time reloading after notice.
        restarts_h = out["preemptions"] * 8 * s.steps.restart_s / H
        assert out["gpu_hours_harvested"] <= oracle["gpu_hours_harvested"] + restarts_h + 1e-6, run.policy
    assert oracle["gpu_hours_harvested"] <= oracle["oracle_idle_gpu_hours"]
    assert runs[0].summary["gpu_hours_harvested"] == 0.0  # none lends nothing


def test_the_seeds_situation_night_trough_needs_half_the_replicas() -> None:
    """32 GPUs of 4-GPU replicas (8 replicas), a day/night load whose trough needs about half the
    day's replicas, plenty of research work: continuous lending harvests clearly more than the
    night window, the oracle bounds both, and the service loses (almost) nothing against none."""
    hours = tuple(h * H for h in range(24))
    night_day = tuple(30.0 if 8 <= h < 20 else 14.0 for h in range(24))
    curve = LoadCurve(hours, night_day, period_s=24 * H)
    svc = service(curve, max_replicas=8, peak_rps=30.0 / 7)
    day_need = needed_replicas(svc, 30.0)
    night_need = needed_replicas(svc, 14.0)
    assert day_need == 7 and 3 <= night_need <= 4  # no headroom in this service
    jobs = tuple(ResearchJob(f"j{i}", "t", i * 600.0, 4, 4 * H, "normal") for i in range(200))
    s = Scenario(
        nodes=tuple(Node(f"n{i}", tuple(range(8))) for i in range(4)),
        services=(svc,),
        lending=LendingPolicy(reclaim_lead_s=72.0),
        jobs=jobs,
        start=start_epoch("UTC"),
        days=3.0,
    )
    runs = {r.policy: r.summary for r in compare(s, ["none", "window", "continuous", "forecast", "oracle"])}
    idle = oracle_idle_gpu_seconds(s.services, s.pool_gpus, 3 * 86400.0) / H
    assert idle == pytest.approx(runs["oracle"]["oracle_idle_gpu_hours"])
    assert runs["continuous"]["gpu_hours_harvested"] > 1.15 * runs["window"]["gpu_hours_harvested"] > 0
    assert runs["continuous"]["harvest_efficiency"] > 0.9
    for name in ("window", "continuous", "forecast"):
        assert runs[name]["gpu_hours_harvested"] <= idle + 1e-6
        assert (
            runs[name]["slo_violation_minutes"]
            <= runs["none"]["slo_violation_minutes"] + 0.01 * 3 * 1440 + 30
        )


def test_the_capacity_model_is_what_the_summary_uses_for_the_slo() -> None:
    svc = service(LoadCurve((0.0,), (10.0,)), max_replicas=2)
    assert steady_state(svc.capacity, 10.0, 0).ttft_p90_s > svc.slo_ttft_p90_s
    assert steady_state(svc.capacity, 10.0, 1).ttft_p90_s <= svc.slo_ttft_p90_s


# -- the command line -----------------------------------------------------------------------------


def test_simulate_writes_summary_and_a_self_contained_report(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app,
        [
            "simulate",
            "--load",
            "synthetic:diurnal,rate=5,peak=20",
            "--jobs",
            "synthetic:jobs=40",
            "--days",
            "1",
            "--policy",
            "continuous",
            "--price",
            "3000",
            "--currency",
            "KRW",
            "--out",
            str(tmp_path / "out"),
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    for key in (
        "gpu_hours_total",
        "gpu_hours_inference",
        "gpu_hours_harvested",
        "gpu_hours_lost_to_preemption",
        "oracle_idle_gpu_hours",
        "harvest_efficiency",
        "slo_violation_minutes",
        "baseline_none",
        "preemptions",
        "reclaim_latency_p50_s",
        "reclaim_latency_p99_s",
        "job_wait_p50_s",
        "job_completion_p50_s",
        "equivalent_gpus",
        "savings",
    ):
        assert key in summary, key
    assert summary["currency"] == "KRW" and summary["gpu_hours_harvested"] > 0
    # 20 req/s at the peak is light for 63 replicas: scaled up, and said so.
    assert summary["load_scale_by_service"]["llm"] > 1.0
    page = (tmp_path / "out" / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 4
    assert "http://" not in page and "https://" not in page  # nothing loaded from elsewhere
    assert "continuous" in result.output


def test_simulate_compare_prints_one_table_and_writes_json(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app,
        [
            "simulate",
            "--load",
            "synthetic:diurnal,rate=5,peak=20",
            "--jobs",
            "synthetic:jobs=30",
            "--days",
            "1",
            "--compare",
            "none,window,continuous,oracle",
            "--out",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "compare.json").read_text())
    assert doc["policies"] == ["none", "window", "continuous", "oracle"]
    oracle = doc["runs"]["oracle"]
    assert oracle["oracle_idle_gpu_hours"] >= doc["runs"]["continuous"]["gpu_hours_harvested"]
    assert oracle["gpu_hours_harvested"] == oracle["oracle_harvest_gpu_hours"] > 0
    for name in doc["policies"]:
        assert name in result.output
    scale = doc["runs"]["continuous"]["load_scale_by_service"]["llm"]
    assert (
        scale > 1.0
        and f"load scaled up to fill the fleet (the trace is too light for it): llm ×{scale:,.1f}"
        in (" ".join(result.output.split()))
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--days", "0"], "--days"),
        (["--days", "1", "--policy", "greedy"], "unknown policy greedy"),
        (["--days", "1", "--load", "nosuch:x"], "unknown trace source"),
        (["--days", "1", "--jobs", "alibaba:/nonexistent.csv"], "nonexistent.csv"),
        (["--days", "1", "--currency", "won"], "--currency"),
        (["--days", "1", "--price", "-1"], "--price"),
    ],
)
def test_simulate_refuses_bad_input_with_exit_2(args: list[str], message: str, tmp_path: Path) -> None:
    base = ["simulate", "--load", "synthetic", "--out", str(tmp_path)]
    if "--load" in args:
        base = ["simulate", "--out", str(tmp_path)]
    result = CliRunner().invoke(app, [*base, *args])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_the_default_fleet_needs_every_replica_but_the_headroom_at_the_busiest_window() -> None:
    curve = LoadCurve(tuple(h * H for h in range(24)), tuple(10.0 + h for h in range(24)), period_s=24 * H)
    s = default_scenario(curve, (), days=1.0, seed=0, options=FleetOptions(nodes=4, gpus_per_node=8))
    svc = s.services[0]
    assert svc.setup.spec.max_replicas == 8 and s.pool_gpus == 32
    # 33 req/s at the peak is light for 7 replicas: the load is scaled up, not the replicas slowed.
    assert svc.load_scale > 1.0 and svc.curve.rates == tuple(r * svc.load_scale for r in curve.rates)
    peak = svc.curve.peak_window_rate(600.0, until_s=86400.0)
    assert needed_replicas(svc, peak) == 8  # 7 + 1 headroom
    assert needed_replicas(svc, 10.0 * svc.load_scale) < 8


def test_a_light_load_is_scaled_up_to_the_fleet_so_replicas_run_at_engine_speed() -> None:
    """Slowing replicas to fit a light trace would stretch every request to minutes and put TTFT
    above any SLO with every replica up; the fleet scales the load instead, so `none` meets the
    SLO at the busiest window, and the autoscaler sees the same concurrency either way."""
    light = LoadCurve((0.0, 12 * H), (1.0, 4.0), period_s=24 * H, prompt_tokens=2000, output_tokens=30)
    s = default_scenario(light, (), days=1.0, seed=0, options=FleetOptions(nodes=4, gpus_per_node=8))
    svc = s.services[0]
    engine = ReplicaCapacity.from_engine(2000, 30)
    assert svc.load_scale > 1.0
    assert svc.capacity.service_s <= engine.service_s * (1 + 1e-9)  # never slower than the engine
    peak = svc.curve.peak_window_rate(600.0, until_s=86400.0)
    assert peak == pytest.approx(4.0 * svc.load_scale)
    assert needed_replicas(svc, peak) == 8
    everyone = steady_state(svc.capacity, peak, svc.setup.spec.max_replicas)
    assert everyone.ttft_p90_s < svc.slo_ttft_p90_s
    # A heavy load is served as given, by replicas faster than the engine.
    heavy = light.scaled(1000.0)
    h = default_scenario(
        heavy, (), days=1.0, seed=0, options=FleetOptions(nodes=4, gpus_per_node=8)
    ).services[0]
    assert h.load_scale == 1.0 and h.curve is heavy
    assert h.capacity.service_s < engine.service_s


def test_the_oracle_harvest_is_the_idle_capacity_fed_by_the_jobs_work() -> None:
    """8 GPUs, one 4-GPU replica needed all along: 4 idle. A 2-GPU job of 1 h (+120 s load) at
    t=0 gives 7,440 GPU-s; an 8-GPU job of 1 h at t=4 h cannot all fit in the 2 h left at 4 GPUs
    (29,760 GPU-s of work, 28,800 of room) — the bound is the room."""
    s = tiny(0.25, ())
    svc = s.services
    first = ResearchJob("a", "t", 0.0, 2, 3600.0, "normal")
    assert oracle_harvest_gpu_seconds(svc, 8, 6 * H, [first], 120.0) == pytest.approx(2 * 3720)
    second = ResearchJob("b", "t", 4 * H, 8, 3600.0, "normal")
    both = oracle_harvest_gpu_seconds(svc, 8, 6 * H, [first, second], 120.0)
    assert both == pytest.approx(2 * 3720 + 4 * 2 * H)
    assert both <= oracle_idle_gpu_seconds(svc, 8, 6 * H) == pytest.approx(4 * 6 * H)
    # A job runs at most at its width: one GPU for 6 h, however many are idle.
    long = ResearchJob("c", "t", 0.0, 1, 10 * H, "normal")
    assert oracle_harvest_gpu_seconds(svc, 8, 6 * H, [long], 120.0) == pytest.approx(6 * H)


def test_simulate_reads_a_cluster_file_in_lowtides_own_format(tmp_path: Path) -> None:
    cluster = tmp_path / "lowtide.yaml"
    cluster.write_text(
        """
nodes:
  - {name: a, gpus: 8}
  - {name: b, gpus: 8}
lending: {mode: continuous}
services:
  - name: chat
    model: m
    gpus_per_replica: 4
    max_replicas: 3
    park: sleep
    simulation: {replica_capacity_rps: 4, load_share: 0.5, slo_ttft_p90: 1.5}
  - name: code
    model: c
    gpus_per_replica: 2
    max_replicas: 2
    base_port: 8200
"""
    )
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        [
            "simulate",
            "--load",
            "synthetic:diurnal,rate=2,peak=8",
            "--jobs",
            "synthetic:jobs=20",
            "--cluster",
            str(cluster),
            "--days",
            "1",
            "--out",
            str(out),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["gpus"] == 16 and summary["nodes"] == 2
    assert summary["services"] == ["chat", "code"]
    assert set(summary["slo_violation_minutes_by_service"]) == {"chat", "code"}


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ("nodes: [{name: a, gpus: auto}]\nservices: [{name: s, model: m}]\n", "nodes[0].gpus"),
        ("nodes: [{name: a, gpus: 4}]\n", "services"),
        (
            "nodes: [{name: a, gpus: 4}]\nservices: [{name: s, model: m, simulation: {load_share: 2}}]\n",
            "load_share",
        ),
    ],
)
def test_simulate_names_what_is_wrong_in_a_cluster_file(tmp_path: Path, document: str, message: str) -> None:
    cluster = tmp_path / "lowtide.yaml"
    cluster.write_text(document)
    result = CliRunner().invoke(
        app,
        ["simulate", "--load", "synthetic", "--cluster", str(cluster), "--days", "1", "--out", str(tmp_path)],
    )
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_the_same_inputs_and_seed_give_the_same_summary() -> None:
    curve = LoadCurve(tuple(h * H for h in range(24)), tuple(5.0 + h for h in range(24)), period_s=24 * H)
    rng = random.Random(7)
    jobs = tuple(
        ResearchJob(
            f"j{i}", "t", rng.uniform(0, 20 * H), rng.choice([1, 2, 4]), rng.uniform(H, 5 * H), "normal"
        )
        for i in range(40)
    )
    s = default_scenario(curve, jobs, days=1.0, seed=3, options=FleetOptions(nodes=4, gpus_per_node=8))
    first, second = (simulate(s, "continuous").summary for _ in range(2))
    for volatile in ("wall_s", "simulated_s_per_wall_s"):
        first.pop(volatile)
        second.pop(volatile)
    assert first == second


def test_the_oracle_idle_in_spells_counts_only_spells_long_enough() -> None:
    """8 GPUs, one 4-GPU replica needed at 2 req/s, both at 15: idle 4 GPUs from 0 to 30 min and
    from 35 to 180 min, none otherwise (4 h). Spells of ≥ 10 or 30 minutes use all 700 idle
    GPU-minutes; of ≥ 1 h only the 145-minute spell (580)."""
    curve = LoadCurve((0.0, 1800.0, 2100.0, 10800.0), (2.0, 15.0, 2.0, 15.0))
    svc = (service(curve, max_replicas=2),)
    assert [needed_replicas(svc[0], r) for r in (2.0, 15.0)] == [1, 2]
    assert oracle_idle_gpu_seconds(svc, 8, 4 * H) == pytest.approx(4 * 175 * 60)
    assert idle_in_spells(svc, 8, 4 * H, 600.0) == pytest.approx(4 * 175 * 60)
    assert idle_in_spells(svc, 8, 4 * H, 1800.0) == pytest.approx(4 * 175 * 60)
    assert idle_in_spells(svc, 8, 4 * H, 3600.0) == pytest.approx(4 * 145 * 60)
    assert idle_in_spells(svc, 8, 4 * H, 5 * H) == 0.0  # no loan can last longer than the run
    assert idle_in_spells_gpu_hours(svc, 8, 4 * H) == pytest.approx(
        {"10m": 700 / 60, "30m": 700 / 60, "1h": 580 / 60}
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from([0.0, 2.0, 15.0, 30.0]), min_size=2, max_size=30), st.integers(1, 12))
def test_the_idle_in_spells_is_the_opening_of_the_idle_curve(rates: list[float], width: int) -> None:
    """Against a brute force on the minute grid: a minute's GPUs count when some window of
    `width` minutes around it keeps at least as many idle throughout; never above the idle."""
    curve = LoadCurve(tuple(60.0 * i for i in range(len(rates))), tuple(rates))
    svc = (service(curve, max_replicas=2, gpus=4),)
    minutes = len(rates)
    idle = [max(0, 8 - 4 * needed_replicas(svc[0], r)) for r in rates]
    expected = 0.0
    for c in range(minutes):
        best = 0
        for start in range(max(0, c - width + 1), c + 1):
            if start + width <= minutes:
                best = max(best, min(idle[start : start + width]))
        expected += best * 60.0
    got = idle_in_spells(svc, 8, 60.0 * minutes, 60.0 * width)
    assert got == pytest.approx(expected)
    assert got <= oracle_idle_gpu_seconds(svc, 8, 60.0 * minutes) + 1e-6


def test_the_oracle_idle_is_what_the_curve_needs_at_the_replicas_target_rate() -> None:
    """An independent computation from the curve alone: a replica carries `peak_rps` (10 req/s)
    at the autoscaler's concurrency target, so the load needs ⌈rate ÷ 10⌉ replicas (at least
    min_replicas, at most max_replicas); every other GPU is idle. The oracle gives exactly that
    (its tolerance band would have lent up to 10 % more)."""
    rates = [0.5, 3.0, 9.9, 10.0, 10.1, 19.0, 27.5, 31.0, 12.0, 4.0]
    curve = LoadCurve(tuple(3600.0 * i for i in range(len(rates))), tuple(rates))
    svc = (service(curve, max_replicas=4),)
    expected = sum(max(0, 16 - 4 * min(4, max(1, math.ceil(r / 10.0)))) * 3600.0 for r in rates)
    assert [needed_replicas(svc[0], r) for r in rates] == [min(4, max(1, math.ceil(r / 10.0))) for r in rates]
    assert oracle_idle_gpu_seconds(svc, 16, 3600.0 * len(rates)) == pytest.approx(expected)
