"""Back-to-back surges through policy.autoscale.decide_scale, shaped like benchmarks/reclaim.py.

The benchmark's service (concurrency 4 per replica, min 1 / max 2, scale-up window 2 s,
stabilisation 5 s, tolerance 0, the default step cap and panic window, tick 0.5 s) gets a surge,
goes idle, parks its extra replica, and the next surge starts right away: each scale-down is undone
within two stabilisation windows. Before 682ebbe that armed the flap guard at the load of the
scale-down; at 0 replicas' worth the guard could never be released and the second surge's extra
replica never parked again (the benchmark "never settled"). These stories run many surges, with
and without a straggling request at the scale-down, and check that every surge gets its second
replica and every calm parks it again. The benchmark turns the burst guard off (surges 18 s apart
would lengthen the window until the calm no longer parks: `test_autoscale.py`'s burst-guard
stories); the last story here shows that with it on.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from lowtide.domain.metrics import ReplicaSignals, ServiceSignals
from lowtide.domain.services import AutoscaleTargets, ServiceSpec
from lowtide.policy.autoscale import ReplicaSupply, ScaleDecision, decide_scale, initial_state

TICK = 0.5
SURGE_S = 6.0  # the load runs until the second replica serves (~4-5 s in the benchmark)
CALM_S = 12.0  # the scale-down (5 s window) and the park happen within it
SURGE_REQUESTS = 22.0  # running 4 + waiting 18 on one replica (the benchmark's load history)


def bench_spec() -> ServiceSpec:
    return ServiceSpec(
        name="chat",
        model="demo-8b",
        gpus_per_replica=2,
        min_replicas=1,
        max_replicas=2,
        autoscale=AutoscaleTargets(
            concurrency_per_replica=4.0,
            kv_usage=None,
            scale_up_window_s=2.0,
            scale_down_stabilization_s=5.0,
            max_scale_down_stabilization_s=5.0,  # the benchmark turns the burst guard off
            tolerance=0.0,
        ),
    )


def signals(requests: float, replicas: int) -> ServiceSignals:
    """`requests` in flight, spread evenly over `replicas` serving replicas."""
    each = requests / replicas
    return ServiceSignals(
        service="chat",
        at=0.0,
        replicas=tuple(
            ReplicaSignals(replica=f"chat/{i}", at=0.0, running=each, waiting=0.0) for i in range(replicas)
        ),
    )


def run_surges(surges: int, straggler: float) -> list[tuple[float, str, ScaleDecision]]:
    """`surges` surges, each followed by a calm; the replicas follow the last decision's desired
    count at the next tick. `straggler` requests stay in flight for the calm's first 6 s (so the
    scale-down at 5 s sees them). Returns (time, phase, decision) of every tick."""
    s = bench_spec()
    state = initial_state(s)
    serving = 1
    out: list[tuple[float, str, ScaleDecision]] = []
    now = 0.0
    for _ in range(surges):
        for phase, length in (("surge", SURGE_S), ("calm", CALM_S)):
            began = now
            while now < began + length - 1e-9:
                late = now - began >= 6.0
                requests = SURGE_REQUESTS if phase == "surge" else 0.0 if late else straggler
                d = decide_scale(s, signals(requests, serving), ReplicaSupply(serving=serving), state, now)
                state = d.state
                out.append((now, phase, d))
                serving = d.desired
                now += TICK
    return out


@pytest.mark.parametrize("straggler", [0.0, 1.0])
def test_every_surge_gets_its_second_replica_and_every_calm_parks_it(straggler: float) -> None:
    ticks = run_surges(10, straggler)
    phases: list[tuple[str, list[ScaleDecision]]] = []
    for _, phase, d in ticks:
        if not phases or phases[-1][0] != phase:
            phases.append((phase, []))
        phases[-1][1].append(d)
    assert len(phases) == 20
    for n, (phase, decisions) in enumerate(phases):
        if phase == "surge":
            assert max(d.desired for d in decisions) == 2, f"surge {n // 2 + 1} never scaled up"
        else:
            last = decisions[-1]
            assert last.desired == 1, f"calm after surge {n // 2 + 1}: {last.reason}"
            assert last.state.flap_guard is None


def test_a_surge_after_a_scale_down_with_a_straggler_arms_the_guard_and_the_calm_releases_it() -> None:
    """With a request still in flight at the scale-down (0.25 replicas' worth), the next surge
    undoing it within two windows does arm the guard (level 2, load 0.25); the calm's load falling
    to 0 is "below what misled it", so the guard lets the replica go."""
    ticks = run_surges(2, straggler=1.0)
    second_surge = [d for at, phase, d in ticks if phase == "surge" and at >= SURGE_S + CALM_S]
    armed = [d.state.flap_guard for d in second_surge if d.state.flap_guard is not None]
    assert armed and armed[-1] == (2, 0.25)
    last_calm = [d for at, phase, d in ticks if phase == "calm" and at >= 2 * SURGE_S + CALM_S]
    assert last_calm[-1].desired == 1 and last_calm[-1].state.flap_guard is None


def test_with_the_burst_guard_on_back_to_back_surges_keep_the_second_replica() -> None:
    """The same surges with the default burst guard: the first two calms park the replica and the
    surges undo it, so the window doubles (5 → 10 → 20 s); from then on a 12 s calm is too short
    to park, and the service stops preempting research every 18 s."""
    off = bench_spec()
    on = replace(off, autoscale=replace(off.autoscale, max_scale_down_stabilization_s=3600.0))
    state = initial_state(on)
    serving, now = 1, 0.0
    calm_ends: list[int] = []
    for _ in range(6):
        for phase, length in (("surge", SURGE_S), ("calm", CALM_S)):
            began = now
            while now < began + length - 1e-9:
                requests = SURGE_REQUESTS if phase == "surge" else 0.0
                d = decide_scale(on, signals(requests, serving), ReplicaSupply(serving=serving), state, now)
                state, serving = d.state, d.desired
                now += TICK
            if phase == "calm":
                calm_ends.append(serving)
    assert calm_ends == [1, 1, 2, 2, 2, 2], calm_ends
    assert state.window_s == 20.0
