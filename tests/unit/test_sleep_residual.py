"""A sleeping replica's GPUs are not empty, and its weights fill host RAM (issue 9, defect 4):
the park choice under a host-RAM budget, and the memory a step lent such a GPU is told about."""

from __future__ import annotations

from pathlib import Path

import pytest

from lowtide.config import ConfigError, Settings, load_settings, service_spec
from lowtide.control.contract import step_environment
from lowtide.domain.gpus import GpuRef, Node
from lowtide.domain.services import ServiceSpec
from lowtide.domain.spec import ResolvedStep
from lowtide.domain.states import ReplicaState
from lowtide.policy.lending import GpuShare, gpu_shares, step_gpu_share
from lowtide.policy.replicas import ReplicaView, ServiceView, choose_park, plan_replicas, sleeping_host_ram

R = ReplicaState
SLEEPY = ServiceSpec(
    name="chat", model="m", gpus_per_replica=1, max_replicas=4, park="sleep", weights_host_gib=40.0
)


def view(
    spec: ServiceSpec, desired: int, *states: tuple[ReplicaState | None, dict[str, object]]
) -> ServiceView:
    replicas = tuple(
        ReplicaView(f"{spec.name}/{slot}", spec.name, slot, state, **kw)  # type: ignore[arg-type]
        for slot, (state, kw) in enumerate(states)
    )
    return ServiceView(spec, desired, replicas)


# -- the park choice ------------------------------------------------------------------------------


def test_within_the_budget_a_replica_sleeps_and_past_it_it_stops_saying_why() -> None:
    assert choose_park(SLEEPY, 100.0, 40.0)[0] == "sleep"  # 40 + 40 ≤ 100
    mode, why = choose_park(SLEEPY, 100.0, 80.0)  # 80 + 40 > 100
    assert mode == "stop"
    assert "80 of 100 GiB" in why and "40 GiB of weights" in why


def test_no_budget_always_sleeps_and_park_stop_always_stops() -> None:
    assert choose_park(SLEEPY, None, 10_000.0) == ("sleep", "park: sleep")
    stopper = ServiceSpec(name="s", model="m", gpus_per_replica=1, park="stop")
    assert choose_park(stopper, 100.0, 0.0)[0] == "stop"


def test_level_two_holds_no_host_ram_so_the_budget_never_stops_it() -> None:
    level2 = ServiceSpec(
        name="s", model="m", gpus_per_replica=1, park="sleep", sleep_level=2, weights_host_gib=40
    )
    assert level2.sleep_host_gib == 0.0
    mode, why = choose_park(level2, 0.0, 1_000.0)
    assert mode == "sleep" and "level 2" in why
    # ... and sleeping level-2 replicas count nothing against the node's budget.
    svc = view(level2, 0, (R.PARKED, {"node": "a", "gpus": (0,), "parked_as": "sleep"}))
    assert sleeping_host_ram([svc], {"a": 10.0}) == {"a": 0.0}


def test_unknown_weights_count_as_the_whole_budget() -> None:
    unknown = ServiceSpec(name="s", model="m", gpus_per_replica=1, park="sleep")
    assert choose_park(unknown, 64.0, 0.0)[0] == "sleep"  # the first one on the node
    mode, why = choose_park(unknown, 64.0, 0.5)
    assert mode == "stop" and "weights_host_gib unset" in why


def test_the_third_replica_past_the_budget_parks_by_stop_and_the_plan_counts_those_parked_this_tick() -> None:
    node = Node("a", (0, 1, 2, 3), sleep_host_ram_gib=100.0)
    # Two drained at once, one asleep already: 40 asleep; the first drained sleeps (80), the
    # second would make 120 > 100 and stops.
    svc = view(
        SLEEPY,
        1,
        (R.SERVING, {"node": "a", "gpus": (0,)}),
        (R.PARKED, {"node": "a", "gpus": (1,), "parked_as": "sleep"}),
        (R.DRAINING, {"node": "a", "gpus": (2,)}),
        (R.DRAINING, {"node": "a", "gpus": (3,)}),
    )
    plan = plan_replicas([svc], (node,), frozenset(), now=0.0)
    parks = [(a.replica_id, a.park_as) for a in plan.actions if a.kind == "park"]
    assert parks == [("chat/2", "sleep"), ("chat/3", "stop")]
    stop = next(a for a in plan.actions if a.replica_id == "chat/3")
    assert "parked by stop, not sleep" in stop.reason and "80 of 100 GiB" in stop.reason


def test_the_budget_is_per_node_and_shared_by_services() -> None:
    other = ServiceSpec(
        name="other", model="m", gpus_per_replica=1, max_replicas=1, park="sleep", weights_host_gib=70
    )
    nodes = (Node("a", (0, 1), sleep_host_ram_gib=100.0), Node("b", (0, 1), sleep_host_ram_gib=100.0))
    asleep_on_a = view(other, 0, (R.PARKED, {"node": "a", "gpus": (0,), "parked_as": "sleep"}))
    draining = view(
        SLEEPY, 0, (R.DRAINING, {"node": "a", "gpus": (1,)}), (R.DRAINING, {"node": "b", "gpus": (1,)})
    )
    plan = plan_replicas([asleep_on_a, draining], nodes, frozenset(), now=0.0)
    assert {a.replica_id: a.park_as for a in plan.actions if a.kind == "park"} == {
        "chat/0": "stop",  # a: 70 + 40 > 100
        "chat/1": "sleep",  # b: 40 ≤ 100
    }


def test_a_parking_replica_of_a_sleeping_service_is_counted_as_asleep() -> None:
    svc = view(
        SLEEPY, 0, (R.PARKING, {"node": "a", "gpus": (0,)}), (R.PARKED, {"node": "a", "parked_as": "stop"})
    )
    assert sleeping_host_ram([svc], {"a": 100.0}) == {"a": 40.0}


# -- the memory a step is told about ----------------------------------------------------------------


def test_a_gpu_under_a_sleeping_replica_has_its_residual_reserved_and_the_rest_as_the_limit() -> None:
    nodes = (Node("a", (0, 1, 2), gpu_memory_gib=80.0), Node("b", (0, 1)))
    shares = gpu_shares(nodes, [("a", (0, 1), 2.5), ("b", (1,), 3.0), ("a", (2,), 0.0)])
    assert shares == {
        GpuRef("a", 0): GpuShare(2.5, 77.5),
        GpuRef("a", 1): GpuShare(2.5, 77.5),
        GpuRef("b", 1): GpuShare(3.0, None),  # the GPU's memory is unknown: no limit figure
    }
    assert step_gpu_share(shares, "a", (1, 2)) == GpuShare(2.5, 77.5)
    assert step_gpu_share(shares, "a", (2,)) is None  # a zero residual reserves nothing
    assert step_gpu_share(shares, "b", (0, 1)) == GpuShare(3.0, None)


def test_two_sleepers_on_one_gpu_add_up_and_a_step_gets_its_tightest_gpu() -> None:
    nodes = (Node("a", (0, 1), gpu_memory_gib=24.0),)
    shares = gpu_shares(nodes, [("a", (0,), 2.0), ("a", (0,), 3.0), ("a", (1,), 1.0)])
    assert step_gpu_share(shares, "a", (0, 1)) == GpuShare(5.0, 19.0)


def _env(share: GpuShare | None) -> dict[str, str]:
    resolved = ResolvedStep(
        name="s",
        command=("true",),
        gpus=1,
        image=None,
        env={},
        inputs={},
        outputs="/tmp/out",
        checkpoint_dir=None,
    )
    return step_environment(
        job_id="j",
        attempt=1,
        node="a",
        gpus=(0,),
        resolved=resolved,
        params={},
        grace_seconds=30,
        notice_path="/tmp/n",
        last_checkpoint=None,
        api_url=None,
        step_token=None,
        gpu_share=share,
    )


def test_the_contract_names_the_limit_rounded_down_and_the_reservation_rounded_up() -> None:
    env = _env(GpuShare(2.004, 77.996))
    assert env["LOWTIDE_GPU_MEMORY_LIMIT_GIB"] == "77.99"
    assert env["LOWTIDE_GPU_MEMORY_RESERVED_GIB"] == "2.01"
    unknown = _env(GpuShare(2.0, None))
    assert unknown["LOWTIDE_GPU_MEMORY_RESERVED_GIB"] == "2" and "LOWTIDE_GPU_MEMORY_LIMIT_GIB" not in unknown
    plain = _env(None)
    assert not any(k.startswith("LOWTIDE_GPU_MEMORY") for k in plain)


# -- config ---------------------------------------------------------------------------------------


def load_settings_from_text(text: str, directory: Path) -> Settings:
    path = directory / "lowtide.yaml"
    path.write_text(text, encoding="utf-8")
    return load_settings(path)


def test_config_keys_reach_the_spec_and_nodes_and_bad_values_name_the_field(tmp_path: Path) -> None:
    text = """
nodes: [{name: a, gpus: 2, gpu_memory_gib: 80, sleep_host_ram_gib: 256}]
services:
  - {name: chat, model: m, park: sleep, sleep_level: 2, sleep_residual_gib: 3.5, weights_host_gib: 16}
"""
    settings = load_settings_from_text(text, tmp_path)
    spec = service_spec(settings.services[0])
    assert (spec.sleep_level, spec.sleep_residual_gib, spec.weights_host_gib) == (2, 3.5, 16.0)
    assert (settings.nodes[0].gpu_memory_gib, settings.nodes[0].sleep_host_ram_gib) == (80.0, 256.0)
    assert (
        service_spec(
            load_settings_from_text("services: [{name: c, model: m}]", tmp_path).services[0]
        ).sleep_level
        == 1
    )
    for bad, field in (
        ("services: [{name: c, model: m, sleep_level: 3}]", "sleep_level"),
        ("services: [{name: c, model: m, sleep_residual_gib: -1}]", "sleep_residual_gib"),
        ("services: [{name: c, model: m, weights_host_gib: 0}]", "weights_host_gib"),
        ("nodes: [{name: a, gpus: 1, gpu_memory_gib: 0}]", "gpu_memory_gib"),
        ("nodes: [{name: a, gpus: 1, sleep_host_ram_gib: -5}]", "sleep_host_ram_gib"),
    ):
        with pytest.raises(ConfigError, match=field):
            load_settings_from_text(bad, tmp_path)
