"""The simulator's capacity model (sim.capacity): queueing arithmetic, overload, the transient,
sizing, SLO time, and the signals the production autoscaler reads."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import fields

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowtide.domain.metrics import ReplicaSignals
from lowtide.domain.services import AutoscaleTargets, ServiceSpec
from lowtide.emulator.engine import Engine, EngineConfig
from lowtide.policy.autoscale import ReplicaSupply, decide_scale, initial_state
from lowtide.sim.capacity import (
    E2E_SIGNAL_MAX_S,
    TTFT_CAP_S,
    TTFT_SIGNAL_MAX_S,
    ModelledLoad,
    ReplicaCapacity,
    ServiceLoadState,
    advance,
    current_load,
    derive_replica_capacity,
    erlang_c,
    replica_signals,
    service_signals,
    slo_violated,
    slo_violation_s,
    steady_state,
)

# -- builders -----------------------------------------------------------------------------------


def textbook(servers: int, service_s: float = 1.0, prefill_s: float = 0.1) -> ReplicaCapacity:
    """A plain M/M/c replica: no batching slowdown, KV never binding."""
    return ReplicaCapacity(
        max_concurrency=servers,
        service_s=service_s,
        prefill_s=prefill_s,
        prompt_tokens=100.0,
        output_tokens=10.0,
        kv_capacity_tokens=1e12,
    )


ENGINE_SHAPED = ReplicaCapacity.from_engine(1000, 250)
SIZED = derive_replica_capacity(100.0, 1000, 250, replicas_at_peak=9, target_concurrency=32.0)


def erlang_c_reference(c: int, a: float) -> float:
    """Erlang C through the textbook Erlang B recurrence (O(c), for checking)."""
    b = 1.0
    for k in range(1, c + 1):
        b = a * b / (k + a * b)
    rho = a / c
    return b / (1 - rho * (1 - b))


# -- Erlang C -----------------------------------------------------------------------------------


def test_erlang_c_textbook_values() -> None:
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3, rel=1e-12)  # c = 2, ρ = 0.5
    for rho in (0.1, 0.5, 0.9, 0.999):
        assert erlang_c(1, rho) == pytest.approx(rho, rel=1e-12)  # M/M/1: P(wait) = ρ
    # c = 3, a = 2 (ρ = 2/3): B = (8/6) / (1 + 2 + 2 + 8/6) = 4/19, C = B / (1 − ρ(1 − B)) = 4/9
    assert erlang_c(3, 2.0) == pytest.approx(4 / 9, rel=1e-12)


@pytest.mark.parametrize(
    ("c", "a"),
    [(2, 1.5), (10, 9.99), (64, 40.0), (256, 32.0), (256, 128.0), (256, 250.0), (1000, 990.0),
     (3000, 2999.9), (5000, 100.0), (5000, 4900.0), (5000, 4990.0)],
)  # fmt: skip
def test_erlang_c_matches_the_recurrence_for_large_c(c: int, a: float) -> None:
    assert erlang_c(c, a) == pytest.approx(erlang_c_reference(c, a), rel=1e-9, abs=1e-300)


def test_erlang_c_edges() -> None:
    assert erlang_c(4, 0.0) == 0.0
    assert erlang_c(4, 4.0) == 1.0
    assert erlang_c(4, 9.0) == 1.0
    assert erlang_c(8000, 1.0) == 0.0  # underflows cleanly, no error
    with pytest.raises(ValueError):
        erlang_c(0, 1.0)
    with pytest.raises(ValueError):
        erlang_c(3, math.nan)


# -- the stationary model -----------------------------------------------------------------------


def test_one_server_is_m_m_1() -> None:
    lam, mu = 0.5, 1.0  # ρ = 0.5
    load = steady_state(textbook(1), lam, 1)
    assert load.running == pytest.approx(lam / mu)
    wq = (lam / mu) / (mu - lam)  # mean wait = ρ / (μ − λ) = 1
    assert load.waiting == pytest.approx(lam * wq)  # Lq = ρ²/(1 − ρ)
    assert load.e2e_mean_s == pytest.approx(wq + 1 / mu)
    # P(Wq > t) = ρ·e^(−(μ−λ)t): p90 = ln(ρ/0.1)/(μ−λ); p50 = 0 since ρ ≤ 0.5
    assert load.ttft_p90_s == pytest.approx(math.log(5) / 0.5 + 0.1)
    assert load.ttft_p50_s == pytest.approx(0.1)
    assert load.e2e_p90_s == pytest.approx(math.log(5) / 0.5 + math.log(10))


def test_two_servers_textbook() -> None:
    load = steady_state(textbook(2), 1.0, 1)  # M/M/2, ρ = 0.5: L = 2ρ/(1 − ρ²) = 4/3
    assert load.running + load.waiting == pytest.approx(4 / 3)
    assert load.waiting == pytest.approx(1 / 3)  # Lq = C·ρ/(1 − ρ) = 1/3


@settings(max_examples=200, deadline=None)
@given(
    servers=st.integers(1, 4000),
    utilisation=st.floats(0.0, 0.9999),
    contention=st.floats(0.0, 0.2),
    replicas=st.integers(1, 50),
)
def test_littles_law(servers: int, utilisation: float, contention: float, replicas: int) -> None:
    cap = ReplicaCapacity(
        max_concurrency=servers,
        service_s=2.0,
        prefill_s=0.2,
        prompt_tokens=500.0,
        output_tokens=100.0,
        kv_capacity_tokens=1e12,
        contention_s=contention,
    )
    rate = utilisation * cap.throughput_rps * replicas
    load = steady_state(cap, rate, replicas)
    assert not load.overloaded
    per_replica = rate / replicas
    assert load.requests_per_s == pytest.approx(per_replica)
    # L = λ·W per replica (and so for the service), with W the mean time in the system
    assert load.running + load.waiting == pytest.approx(per_replica * load.e2e_mean_s, rel=1e-9, abs=1e-12)
    assert load.running == pytest.approx(per_replica * cap.service_time_s(per_replica), rel=1e-9, abs=1e-12)
    assert 0 <= load.running <= servers
    assert load.ttft_p50_s <= load.ttft_p90_s <= load.e2e_p90_s


def test_engine_shape_and_batching_slowdown() -> None:
    cap = ENGINE_SHAPED
    # the emulator's defaults: 1000 prompt tokens at 20k tok/s, 250 steps of 12.08 ms alone
    assert cap.prefill_s == pytest.approx(0.05 + 0.01208)
    assert cap.service_s == pytest.approx(0.05 + 250 * 0.01208)
    assert cap.servers == 256
    # full batch: its prefill plus a 1/256 share of 250 steps of 32.48 ms (= 12.2 req/s); the
    # model counts a request's own prefill and one step once more (0.3 %)
    assert 1 / cap.throughput_rps == pytest.approx(0.05 + 250 * (0.012 + 0.00008 * 256) / 256, rel=5e-3)
    times = [cap.service_time_s(r) for r in (0.0, 4.0, 8.0, 12.0)]
    assert times == sorted(times)
    assert times[0] == cap.service_s
    assert cap.service_time_s(100.0) == cap.full_batch_s


def test_the_model_agrees_with_the_request_level_engine() -> None:
    """The emulator's engine, Poisson arrivals at 8 req/s (65 % of the full-batch throughput)."""
    rate, horizon, warmup = 8.0, 240.0, 60.0
    now = [0.0]
    engine = Engine(EngineConfig(cold_start_s=0.0), lambda: now[0])
    rng = random.Random(7)
    arrivals: list[float] = []
    t = 0.0
    while t < horizon:
        t += rng.expovariate(rate)
        arrivals.append(t)
    requests = []
    area = last = 0.0
    i = 0
    while True:
        event = engine.next_event_at() or math.inf
        arrival = arrivals[i] if i < len(arrivals) else math.inf
        at = min(event, arrival)
        if at > horizon:
            break
        if at > warmup:
            area += engine.num_running * (at - max(last, warmup))
        last = now[0] = at
        if arrival <= event:
            requests.append(engine.submit(1000, 250, output_tokens=250))
            i += 1
        else:
            engine.advance(at)
    done = [r for r in requests if r.finished_at is not None and r.arrival > warmup]
    e2e = sum(r.finished_at - r.arrival for r in done if r.finished_at is not None) / len(done)
    model = steady_state(ENGINE_SHAPED, rate, 1)
    assert area / (horizon - warmup) == pytest.approx(model.running, rel=0.1)
    assert e2e == pytest.approx(model.e2e_mean_s, rel=0.1)


def test_kv_cache_caps_the_batch() -> None:
    cap = ReplicaCapacity.from_engine(20_000, 1000)  # 20.5k tokens a sequence: 29 fit in 600k
    assert cap.servers == 600_000 // 20_500
    load = steady_state(cap, 0.9 * cap.throughput_rps, 1)
    assert 0 < load.kv_usage <= 1
    assert load.kv_tokens == pytest.approx(load.running * 20_500)
    assert steady_state(cap, 2 * cap.throughput_rps, 1).kv_usage <= 1


def test_more_load_means_more_waiting_and_higher_ttft() -> None:
    cap = SIZED
    rates = [i * 0.5 for i in range(0, 500)]  # up to ~11 × a replica's throughput over 2 replicas
    loads = [steady_state(cap, r, 2) for r in rates]
    for before, after in itertools.pairwise(loads):
        assert after.waiting >= before.waiting
        assert after.running >= before.running
        assert after.concurrency >= before.concurrency
        assert after.ttft_p90_s >= before.ttft_p90_s
        assert after.ttft_p50_s >= before.ttft_p50_s
        assert after.e2e_p90_s >= before.e2e_p90_s
        assert after.kv_usage >= before.kv_usage
    assert loads[-1].overloaded and not loads[10].overloaded


def test_more_replicas_mean_less_waiting_and_lower_ttft() -> None:
    loads = [steady_state(SIZED, 120.0, n) for n in range(1, 30)]
    for before, after in itertools.pairwise(loads):
        assert after.waiting <= before.waiting
        assert after.concurrency <= before.concurrency
        assert after.ttft_p90_s <= before.ttft_p90_s
        assert after.e2e_p90_s <= before.e2e_p90_s
    assert loads[0].overloaded and not loads[-1].overloaded


def test_overload_flag_and_the_ttft_cap() -> None:
    cap = textbook(4)  # 4 req/s at most
    below = steady_state(cap, 3.9, 1)
    assert not below.overloaded and below.ttft_p90_s < TTFT_CAP_S
    for rate in (4.0, 5.0, 400.0):
        load = steady_state(cap, rate, 1)
        assert load.overloaded
        assert load.ttft_p90_s == load.ttft_p50_s == TTFT_CAP_S
        assert load.running == 4
        assert load.requests_per_s == pytest.approx(4.0)  # it serves what it can
        assert load.waiting == pytest.approx(4.0 * TTFT_CAP_S)  # an hour of its work queued
        assert load.utilisation == pytest.approx(rate / 4.0)
        assert slo_violated(load, 2.0)


def test_no_replica() -> None:
    unserved = steady_state(SIZED, 5.0, 0)
    assert unserved.overloaded and unserved.ttft_p90_s == TTFT_CAP_S
    assert unserved.served_rps == 0 and unserved.running == unserved.waiting == 0
    assert slo_violated(unserved, 2.0)
    idle = steady_state(SIZED, 0.0, 0)
    assert not idle.overloaded and not slo_violated(idle, 2.0) and idle.ttft_p90_s == 0.0


def test_an_idle_replica() -> None:
    load = steady_state(SIZED, 0.0, 3)
    assert load.running == load.waiting == load.requests_per_s == load.kv_usage == 0
    assert load.ttft_p90_s == SIZED.prefill_s and not slo_violated(load, 0.0)


@pytest.mark.parametrize("args", [(-1.0, 1), (math.nan, 1), (math.inf, 1), (1.0, -1)])
def test_bad_inputs_are_refused(args: tuple[float, int]) -> None:
    with pytest.raises(ValueError):
        steady_state(SIZED, *args)


def test_capacity_validation() -> None:
    with pytest.raises(ValueError, match="prefill_s"):
        ReplicaCapacity(
            max_concurrency=8,
            service_s=1.0,
            prefill_s=2.0,
            prompt_tokens=1.0,
            output_tokens=1.0,
            kv_capacity_tokens=100.0,
        )
    with pytest.raises(ValueError, match="max_concurrency"):
        textbook(0)
    with pytest.raises(ValueError):
        SIZED.scaled(0.0)


# -- sizing -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("peak", "replicas", "target", "prompt", "output"),
    [(100.0, 9, 32.0, 1000, 250), (3.0, 1, 32.0, 760, 150), (2000.0, 63, 32.0, 2048, 28),
     (50.0, 4, 8.0, 0, 0), (40.0, 3, 200.0, 1000, 250), (40.0, 3, 250.0, 1000, 250)],
)  # fmt: skip
def test_derived_capacity_reaches_the_target_at_the_peak(
    peak: float, replicas: int, target: float, prompt: float, output: float
) -> None:
    cap = derive_replica_capacity(peak, prompt, output, replicas_at_peak=replicas, target_concurrency=target)
    load = steady_state(cap, peak, replicas)
    assert load.concurrency == pytest.approx(target, rel=1e-6)
    assert load.concurrency <= target * (1 + 1e-12)
    assert not load.overloaded
    fewer = steady_state(cap, peak, replicas - 1) if replicas > 1 else steady_state(cap, peak * 1.2, 1)
    assert fewer.concurrency > target


def test_derived_capacity_keeps_the_engine_shape() -> None:
    shape = ReplicaCapacity.from_engine(1000, 250)
    factor = SIZED.service_s / shape.service_s
    assert SIZED.prefill_s == pytest.approx(shape.prefill_s * factor)
    assert SIZED.contention_s == pytest.approx(shape.contention_s * factor)
    assert SIZED.servers == shape.servers and SIZED.kv_capacity_tokens == shape.kv_capacity_tokens
    # the docstring's example
    assert factor == pytest.approx(0.54, abs=0.01)
    assert SIZED.service_time_s(100 / 9) == pytest.approx(2.88)
    assert SIZED.throughput_rps == pytest.approx(22.5, abs=0.1)


def test_derived_capacity_gets_a_cache_for_a_full_batch() -> None:
    cap = derive_replica_capacity(10.0, 8000, 500, replicas_at_peak=2, target_concurrency=32.0)
    assert cap.servers == cap.max_concurrency == 256
    assert steady_state(cap, 10.0, 2).concurrency == pytest.approx(32.0)


@pytest.mark.parametrize(
    "kwargs",
    [{"peak_rate_rps": 0.0}, {"replicas_at_peak": 0}, {"target_concurrency": 0.0},
     {"target_concurrency": 256.0}],
)  # fmt: skip
def test_derive_refuses_what_cannot_be_sized(kwargs: dict[str, float]) -> None:
    args: dict[str, float] = {
        "peak_rate_rps": 10.0,
        "prompt_tokens": 1000,
        "output_tokens": 250,
        "replicas_at_peak": 2,
        "target_concurrency": 32.0,
    }
    args.update(kwargs)
    with pytest.raises(ValueError):
        derive_replica_capacity(
            args["peak_rate_rps"],
            args["prompt_tokens"],
            args["output_tokens"],
            replicas_at_peak=int(args["replicas_at_peak"]),
            target_concurrency=args["target_concurrency"],
        )


# -- the autoscaler on the model ----------------------------------------------------------------


def run_autoscaler(rate: float, start: int, ticks: int = 300, tick_s: float = 10.0) -> list[int]:
    """Production `decide_scale` on modelled signals; replicas start instantly. Replica counts."""
    spec = ServiceSpec(
        name="llm",
        model="m",
        gpus_per_replica=4,
        min_replicas=1,
        max_replicas=20,
        autoscale=AutoscaleTargets(ttft_p90_slo_s=2.0),
    )
    state = initial_state(spec)
    n = start
    counts = []
    for tick in range(ticks):
        now = tick * tick_s
        load = steady_state(SIZED, rate, n)
        signals = service_signals("llm", load, [f"llm-{i}" for i in range(n)], now)
        decision = decide_scale(spec, signals, ReplicaSupply(serving=n), state, now)
        assert not decision.unknown
        state, n = decision.state, decision.desired
        counts.append(n)
    return counts


@pytest.mark.parametrize(("rate", "start"), [(100.0, 1), (100.0, 20), (50.0, 20), (20.0, 1), (150.0, 5)])
def test_the_autoscaler_settles_within_its_targets(rate: float, start: int) -> None:
    counts = run_autoscaler(rate, start)
    n = counts[-1]
    assert set(counts[-60:]) == {n}  # settled for the last 10 minutes
    load = steady_state(SIZED, rate, n)
    # at the target, or above it by less than the autoscaler's ±10 % band (it keeps n then)
    assert load.concurrency <= 32.0 * 1.1
    assert load.ttft_p90_s <= 2.0 and not load.overloaded
    needed = next(k for k in range(1, 21) if steady_state(SIZED, rate, k).concurrency <= 32.0)
    assert needed - 1 <= n <= needed + 1  # 9 at 100 req/s, the fleet's sizing


def test_the_autoscaler_holds_the_sized_fleet_at_the_peak() -> None:
    assert set(run_autoscaler(100.0, 9, ticks=60)) == {9}


# -- the transient ------------------------------------------------------------------------------


def test_backlog_grows_drains_and_is_dropped() -> None:
    cap = textbook(4)  # 4 req/s per replica
    s0 = ServiceLoadState()
    grown = advance(s0, cap, 10.0, 2, 100.0)  # 2 req/s over capacity for 100 s
    assert grown.backlog == pytest.approx(200.0) and grown.dropped == 0
    load = current_load(grown, cap, 10.0, 2)
    assert load.overloaded and load.running == 4
    assert load.waiting == pytest.approx(100.0)  # per replica
    assert load.ttft_p90_s == pytest.approx(200.0 / 8.0 + cap.full_batch_ttft_s)
    drained = advance(grown, cap, 10.0, 3, 30.0)  # 2 req/s under capacity: 200 → 140
    assert drained.backlog == pytest.approx(140.0)
    assert advance(drained, cap, 10.0, 3, 1000.0).backlog == 0.0
    assert advance(grown, cap, 10.0, 0, 5.0) == ServiceLoadState(0.0, 200.0 + 50.0)
    full = advance(s0, cap, 10.0, 2, 10 * TTFT_CAP_S)  # fills to an hour of work, drops the rest
    assert full.backlog == pytest.approx(8.0 * TTFT_CAP_S)
    assert full.dropped == pytest.approx(2.0 * 10 * TTFT_CAP_S - 8.0 * TTFT_CAP_S)
    assert current_load(full, cap, 10.0, 2).ttft_p90_s == TTFT_CAP_S
    assert current_load(full, cap, 10.0, 2) == steady_state(cap, 10.0, 2)  # the long-run limit
    assert advance(s0, cap, 3.0, 2, 1e6) is s0  # stable and empty: nothing moves


def test_a_small_backlog_runs_before_it_waits() -> None:
    cap = textbook(4)
    load = current_load(ServiceLoadState(backlog=2.0), cap, 4.0, 2)  # 1 extra per replica
    stationary = steady_state(cap, 4.0, 2)
    assert load.running + load.waiting == pytest.approx(stationary.concurrency + 1.0)
    assert load.running <= 4 and not load.overloaded


@settings(max_examples=200, deadline=None)
@given(
    backlog=st.floats(0, 50_000),
    rate=st.floats(0, 30),
    replicas=st.integers(0, 6),
    a=st.floats(0, 5000),
    b=st.floats(0, 5000),
    slo=st.floats(0.01, 5000),
)
def test_advance_and_slo_time_are_exact_over_any_split(
    backlog: float, rate: float, replicas: int, a: float, b: float, slo: float
) -> None:
    cap = textbook(4)
    s0 = ServiceLoadState(backlog=backlog)
    whole = advance(s0, cap, rate, replicas, a + b)
    split = advance(advance(s0, cap, rate, replicas, a), cap, rate, replicas, b)
    assert split.backlog == pytest.approx(whole.backlog, rel=1e-9, abs=1e-6)
    assert split.dropped == pytest.approx(whole.dropped, rel=1e-9, abs=1e-6)
    total = slo_violation_s(s0, cap, rate, replicas, a + b, slo)
    parts = slo_violation_s(s0, cap, rate, replicas, a, slo) + slo_violation_s(
        advance(s0, cap, rate, replicas, a), cap, rate, replicas, b, slo
    )
    assert parts == pytest.approx(total, rel=1e-9, abs=1e-6)
    assert 0 <= total <= a + b + 1e-9


@pytest.mark.parametrize(
    ("backlog", "rate", "replicas", "slo"),
    [(0.0, 10.0, 2, 30.0), (400.0, 6.0, 2, 10.0), (400.0, 6.0, 2, 1000.0), (0.0, 3.0, 1, 2.0),
     (0.0, 3.99, 1, 2.0), (100.0, 0.0, 1, 5.0), (0.0, 1.0, 0, 2.0), (0.0, 0.0, 0, 2.0)],
)  # fmt: skip
def test_slo_time_matches_sampling(backlog: float, rate: float, replicas: int, slo: float) -> None:
    cap = textbook(4)
    s0 = ServiceLoadState(backlog=backlog)
    dt, steps = 200.0, 20_000
    h = dt / steps
    sampled = 0.0
    for k in range(steps):
        state = advance(s0, cap, rate, replicas, (k + 0.5) * h)
        if slo_violated(current_load(state, cap, rate, replicas), slo):
            sampled += h
    assert slo_violation_s(s0, cap, rate, replicas, dt, slo) == pytest.approx(sampled, abs=2 * h)


# -- signals ------------------------------------------------------------------------------------


def test_replica_and_service_signals() -> None:
    load = steady_state(SIZED, 90.0, 9)
    signals = service_signals("llm", load, [f"r{i}" for i in range(9)], 123.0)
    assert signals.service == "llm" and signals.at == 123.0 and len(signals.replicas) == 9
    r = signals.replicas[4]
    assert r.replica == "r4" and r.at == 123.0 and not r.stale
    assert (r.running, r.waiting, r.kv_usage) == (load.running, load.waiting, load.kv_usage)
    assert r.concurrency == pytest.approx(load.concurrency)
    assert r.requests_per_s == pytest.approx(10.0)
    assert r.generation_tokens_per_s == pytest.approx(2500.0)
    assert r.prompt_tokens_per_s == pytest.approx(10_000.0)
    assert r.ttft_p90_s == load.ttft_p90_s and r.ttft_p50_s == load.ttft_p50_s
    assert r.e2e_p90_s == load.e2e_p90_s
    assert r.ttft_p99_s is None and r.e2e_p50_s is None and r.e2e_p99_s is None  # not modelled
    with pytest.raises(ValueError):
        service_signals("llm", load, ["r0"], 0.0)
    assert service_signals("llm", steady_state(SIZED, 5.0, 0), [], 0.0).replicas == ()


def test_signals_read_like_vllm_histograms() -> None:
    overloaded = replica_signals(steady_state(SIZED, 1000.0, 1), "r", 0.0)
    assert overloaded.ttft_p90_s == TTFT_SIGNAL_MAX_S  # the largest finite bucket bound
    assert overloaded.e2e_p90_s is not None and overloaded.e2e_p90_s <= E2E_SIGNAL_MAX_S
    idle = replica_signals(steady_state(SIZED, 0.0, 1), "r", 0.0)
    assert idle.ttft_p90_s is None and idle.ttft_p50_s is None and idle.e2e_p90_s is None
    assert idle.running == 0 and idle.requests_per_s == 0  # known, and zero


# -- cost ---------------------------------------------------------------------------------------


def test_steady_state_performance_smoke() -> None:
    """100k calls across the whole range (idle to overloaded); timing is reported, not asserted."""
    rates = [200.0 * (i % 1000) / 700 for i in range(100_000)]
    last: ModelledLoad | None = None
    for rate in rates:
        last = steady_state(SIZED, rate, 9)
    assert last is not None and last.rate_rps == rates[-1]


def test_replica_signals_are_built_by_field_position_in_the_field_order_of_the_domain() -> None:
    # `sim.capacity._signals_of` passes these positionally: a reordered field must fail here
    assert [f.name for f in fields(ReplicaSignals)][:14] == [
        "replica", "at", "running", "waiting", "kv_usage", "kv_tokens_used", "prompt_tokens_per_s",
        "generation_tokens_per_s", "requests_per_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s",
        "e2e_p50_s", "e2e_p90_s",
    ]  # fmt: skip
