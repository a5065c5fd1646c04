"""The Kubernetes service manager (`adapters.k8s_services`) with the real `kubernetes` client against
the fake API server (`k8sfake`), a simulated ReplicaSet/kubelet/EndpointSlice controller
(`k8s_deploy_sim`) and, at the end, the real control loop (`sim.harness.LoopHarness`).

Time is the test's: the fake API server's clock, the simulator and the manager's `now` move
together; nothing sleeps but bounded waits for the caches. The manager reads pods and
EndpointSlices from watch caches, which see a write a few milliseconds after it: after the
simulated controllers act (and after a test's own write through the hooks), `settle` waits,
bounded, until the caches have seen the last pod and EndpointSlice write (their
resourceVersion), as a real control loop's next poll a second later would. That is the only
change eventual consistency needs here."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from pydantic import ValidationError

from k8s_deploy_sim import POD_DELETION_COST, DeploymentSim, SimClock, deployment, replica_launch
from k8sfake import ADMIN_TOKEN, FakeCluster
from lowtide.adapters.k8s_services import (
    CHOSEN_COST,
    REPLICA_ANNOTATION,
    DeploymentTarget,
    KubernetesServiceManager,
)
from lowtide.adapters.service_routing import RoutedServiceManager
from lowtide.config import ServiceConfig
from lowtide.control.clock import FakeClock
from lowtide.control.inference import ServiceSetup
from lowtide.control.inference_ports import ReplicaEvent, ReplicaLaunch
from lowtide.deploy.chart import load_chart, render
from lowtide.deploy.manifests import Release
from lowtide.domain.gpus import Node
from lowtide.domain.layout import ArtifactLayout
from lowtide.domain.services import AutoscaleTargets, LendingPolicy, ServiceSpec
from lowtide.sim.harness import LoopHarness
from lowtide.sim.scripted import FakeMetrics, FakeServiceManager
from lowtide.wiring import ServeError, kube_api_client, service_manager
from support import settings_for

NS = "serving"
DEP = "chat-vllm"
START = 1_796_126_400.0
#: Test managers back off 0.05–0.5 s between watch attempts (client-go: 0.8–30 s).
BACKOFF = (0.05, 0.5)
SETTLE_S = 10.0  # a bound, not a duration: a cache is caught up within milliseconds


def settle(manager: KubernetesServiceManager, cluster: FakeCluster, namespace: str = NS) -> None:
    """Wait until the manager's caches have seen the last pod and EndpointSlice write (only while
    the fake is listening: a cache cannot catch up with a server that is away)."""
    if cluster.listening:
        pods, slices = cluster.last_write("pods", namespace), cluster.last_write("endpointslices", namespace)
        assert manager.caught_up("chat", pods, slices, SETTLE_S), "the watch caches did not catch up"


def manager(
    cluster: FakeCluster, target: DeploymentTarget, token: str | None = None
) -> KubernetesServiceManager:
    api = cluster.api_client(token) if token else cluster.api_client()
    return KubernetesServiceManager(api, [target], refresh_s=0.0, watch_backoff_s=BACKOFF)


class World:
    def __init__(
        self, cluster: FakeCluster, clock: SimClock, *, target: DeploymentTarget | None = None
    ) -> None:
        self.cluster = cluster
        self.clock = clock
        self.sim = DeploymentSim(cluster, clock, NS, DEP, service="chat")
        self.target = target or DeploymentTarget("chat", NS, DEP, port=8000, endpoint_service="chat")
        self.manager = manager(cluster, self.target)
        self.events: list[ReplicaEvent] = []

    def run(self, seconds: float, dt: float = 1.0, *, settle: bool = True) -> list[ReplicaEvent]:
        """Step the simulated controllers and poll the manager every `dt` for `seconds`."""
        new: list[ReplicaEvent] = []
        end = self.clock.now + seconds
        while self.clock.now < end:
            self.clock.now += dt
            self.sim.step()
            if settle:
                self.settle()
            new += self.manager.poll(self.clock.now)
        self.events += new
        return new

    def settle(self) -> None:
        settle(self.manager, self.cluster)

    def replicas(self) -> int:
        return int(self.cluster.get("deployments", NS, DEP)["spec"]["replicas"])

    def pods(self, *, live: bool = True) -> list[dict[str, Any]]:
        pods = self.cluster.list("pods", NS, label_selector="app=vllm")
        return [p for p in pods if not (live and p["metadata"].get("deletionTimestamp"))]

    def annotation(self, pod: str, key: str) -> str | None:
        return (self.cluster.get("pods", NS, pod)["metadata"].get("annotations") or {}).get(key)


def launch(slot: int, timeout: float = 120.0) -> ReplicaLaunch:
    return replica_launch(slot, health_timeout_s=timeout)


def kinds(events: list[ReplicaEvent]) -> list[tuple[str, str]]:
    return [(e.replica_id, e.kind) for e in events]


@pytest.fixture
def clock() -> SimClock:
    return SimClock(START)


@pytest.fixture
def cluster(clock: SimClock) -> Iterator[FakeCluster]:
    with FakeCluster(clock=clock) as c:
        c.create("deployments", NS, deployment(DEP))
        yield c


@pytest.fixture
def world(cluster: FakeCluster, clock: SimClock) -> Iterator[World]:
    w = World(cluster, clock)
    yield w
    w.manager.close()


def serving(world: World, n: int) -> None:
    for slot in range(n):
        world.manager.start(launch(slot), world.clock.now)
    events = world.run(10)
    assert sorted(kinds(events)) == [(f"chat/{i}", "healthy") for i in range(n)]


# -- scaling ----------------------------------------------------------------------------------------


def test_scale_up_reports_healthy_replicas_at_their_pod_addresses(world: World) -> None:
    world.manager.start(launch(0), world.clock.now)
    world.manager.start(launch(1), world.clock.now)
    assert world.replicas() == 2  # written at once, through /scale
    assert world.run(3) == []  # pods exist but are not Ready yet
    events = world.run(5)
    assert sorted(kinds(events)) == [("chat/0", "healthy"), ("chat/1", "healthy")]
    pods = {p["metadata"]["annotations"][REPLICA_ANNOTATION]: p for p in world.pods()}
    assert set(pods) == {"chat/0", "chat/1"}
    for rid, pod in pods.items():
        assert world.manager.url(rid) == f"http://{pod['status']['podIP']}:8000"
        assert pod["metadata"]["name"] in next(e.detail for e in events if e.replica_id == rid)
    writes = [r for r in world.cluster.requests if r.verb == "update" and r.resource == "deployments/scale"]
    # At most one write per start, nothing more: a start made while the pod cache still waits for
    # its first LIST (a loaded machine) writes nothing, and the next start writes both replicas.
    assert 1 <= len(writes) <= 2 and all(w.code == 200 for w in writes)
    assert world.manager.url("chat/2") is None


def test_scale_down_removes_the_pod_of_the_parked_replica(world: World) -> None:
    serving(world, 3)
    victim = world.manager.pod_of("chat/1")
    assert victim is not None
    world.manager.park("chat/1", "stop", world.clock.now)
    assert world.annotation(victim, POD_DELETION_COST) == CHOSEN_COST
    assert world.replicas() == 2
    events = world.run(1)
    assert world.sim.deletions == [victim]  # the ReplicaSet chose the pod lowtide annotated
    assert events == []  # terminating: its GPUs are not free yet
    events = world.run(3)
    assert kinds(events) == [("chat/1", "stopped")]
    assert f"pod {victim} gone" in events[0].detail
    assert sorted(world.manager.pod_of(r) or "" for r in ("chat/0", "chat/2")) == sorted(
        p["metadata"]["name"] for p in world.pods()
    )
    assert world.manager.url("chat/1") is None


def test_a_steady_state_reads_only_the_scale_each_poll_pods_and_slices_come_from_watches(
    world: World,
) -> None:
    serving(world, 2)
    before = len(world.cluster.requests)
    assert world.run(20) == []
    steady = [(r.verb, r.resource) for r in world.cluster.requests[before:]]
    assert steady == [("get", "deployments/scale")] * 20  # one request a poll (it was three)
    # Since start-up: one LIST and one long-lived WATCH each for the pods and the EndpointSlices.
    reads = sorted(
        (r.verb, r.resource)
        for r in world.cluster.requests
        if r.resource in ("pods", "endpointslices") and r.verb in ("list", "watch")
    )
    assert reads == [
        ("list", "endpointslices"),
        ("list", "pods"),
        ("watch", "endpointslices"),
        ("watch", "pods"),
    ]


def test_park_while_another_pod_is_starting_keeps_the_ready_pod_for_the_newcomer(world: World) -> None:
    serving(world, 1)
    kept = world.manager.pod_of("chat/0")
    world.manager.start(launch(1), world.clock.now)
    world.run(1)  # chat/1's pod exists, Pending
    world.manager.park("chat/0", "stop", world.clock.now)
    events = world.run(2)
    # The ReplicaSet removes a not-Ready pod before any deletion cost: chat/0's pod stays, goes
    # back to the pool and chat/1 takes it at once.
    assert world.sim.deletions and world.sim.deletions[0] != kept
    assert kinds(events) == [("chat/0", "stopped"), ("chat/1", "healthy")]
    assert "returned to the pool" in events[0].detail
    assert world.manager.pod_of("chat/1") == kept
    assert world.annotation(kept, REPLICA_ANNOTATION) == "chat/1"
    assert world.annotation(kept, POD_DELETION_COST) is None


def test_a_conflict_on_the_scale_write_re_reads_and_writes_the_right_count(world: World) -> None:
    serving(world, 1)
    world.cluster.inject("update", "deployments/scale", status=409, times=2)
    world.manager.start(launch(1), world.clock.now)
    scale_calls = [(r.verb, r.code) for r in world.cluster.requests if r.resource == "deployments/scale"]
    # A fresh read (its resourceVersion) before every try, and a write only with it.
    assert scale_calls[-6:] == [
        ("get", 200),
        ("update", 409),
        ("get", 200),
        ("update", 409),
        ("get", 200),
        ("update", 200),
    ]
    assert world.replicas() == 2
    assert kinds(world.run(8)) == [("chat/1", "healthy")]


def test_a_stale_resource_version_is_a_conflict_not_an_overwrite(world: World, cluster: FakeCluster) -> None:
    """Someone scales the Deployment between lowtide's read and its write: the fake answers the
    stale version with 409, the manager reads again and writes its count on the new version."""
    real_read = world.manager._apps.read_namespaced_deployment_scale
    meddled = []

    def read_then_meddle(*args: Any, **kwargs: Any) -> Any:
        scale = real_read(*args, **kwargs)
        if not meddled:
            meddled.append(True)
            cluster.modify("deployments", NS, DEP, lambda d: d["spec"].update(replicas=5))
        return scale

    world.manager._apps.read_namespaced_deployment_scale = read_then_meddle
    world.manager.start(launch(0), world.clock.now)
    codes = [
        r.code for r in world.cluster.requests if r.verb == "update" and r.resource == "deployments/scale"
    ]
    assert codes == [409, 200]
    assert world.replicas() == 1


# -- autoscalers ------------------------------------------------------------------------------------


def hpa(name: str, target: str, lo: int = 1, hi: int = 4) -> dict[str, Any]:
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": name},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target},
            "minReplicas": lo,
            "maxReplicas": hi,
        },
    }


def test_an_hpa_on_the_deployment_is_refused_with_a_clear_message(world: World) -> None:
    world.cluster.create("horizontalpodautoscalers", NS, hpa("other", "not-ours"))
    world.cluster.create("horizontalpodautoscalers", NS, hpa("chat-hpa", DEP))
    world.manager.start(launch(0), world.clock.now)
    events = world.run(1)
    assert kinds(events) == [("chat/0", "failed")]
    assert "HorizontalPodAutoscaler chat-hpa" in events[0].detail
    assert "refuses" in events[0].detail and "on_autoscaler" in events[0].detail
    assert "other" not in events[0].detail
    assert world.replicas() == 0  # nothing written
    assert not [r for r in world.cluster.requests if r.verb == "update" and r.resource == "deployments/scale"]


def test_a_keda_scaled_object_is_refused_too(world: World) -> None:
    world.cluster.create(
        "scaledobjects",
        NS,
        {
            "apiVersion": "keda.sh/v1alpha1",
            "kind": "ScaledObject",
            "metadata": {"name": "chat-keda"},
            "spec": {"scaleTargetRef": {"name": DEP}, "triggers": []},  # kind defaults to Deployment
        },
    )
    world.manager.start(launch(0), world.clock.now)
    (event,) = world.run(1)
    assert event.kind == "failed" and "KEDA ScaledObject chat-keda" in event.detail


def test_steer_sets_the_hpa_bounds_to_lowtides_count(cluster: FakeCluster, clock: SimClock) -> None:
    cluster.create("horizontalpodautoscalers", NS, hpa("chat-hpa", DEP, 1, 10))
    w = World(cluster, clock, target=DeploymentTarget("chat", NS, DEP, on_autoscaler="steer"))
    for slot in range(2):
        w.manager.start(launch(slot), clock.now)
    spec = cluster.get("horizontalpodautoscalers", NS, "chat-hpa")["spec"]
    assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 2)
    assert w.replicas() == 2
    assert sorted(kinds(w.run(8))) == [("chat/0", "healthy"), ("chat/1", "healthy")]
    w.manager.close()


def test_steer_sets_a_scaled_objects_bounds_and_refuses_zero(cluster: FakeCluster, clock: SimClock) -> None:
    cluster.create(
        "scaledobjects",
        NS,
        {
            "apiVersion": "keda.sh/v1alpha1",
            "kind": "ScaledObject",
            "metadata": {"name": "chat-keda"},
            "spec": {"scaleTargetRef": {"name": DEP}, "minReplicaCount": 0, "maxReplicaCount": 8},
        },
    )
    w = World(cluster, clock, target=DeploymentTarget("chat", NS, DEP, on_autoscaler="steer"))
    w.manager.start(launch(0), clock.now)
    spec = cluster.get("scaledobjects", NS, "chat-keda")["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 1)
    assert [e.kind for e in w.run(8)] == ["healthy"]
    w.manager.park("chat/0", "stop", clock.now)  # 0 cannot be steered: the park waits, said why
    assert w.run(3) == [] and w.replicas() == 1
    assert "steering it to 0 replicas is not possible" in w.manager.problem("chat")
    cluster.delete("scaledobjects", NS, "chat-keda")
    assert [e.kind for e in w.run(4)] == ["stopped"] and w.replicas() == 0
    w.manager.close()


# -- bad news from the cluster ----------------------------------------------------------------------


def test_a_deleted_deployment_fails_its_replicas_clearly_without_raising(world: World) -> None:
    serving(world, 2)
    world.cluster.delete("deployments", NS, DEP)
    events = world.run(1)
    assert sorted(kinds(events)) == [("chat/0", "failed"), ("chat/1", "failed")]
    assert all(f"Deployment {NS}/{DEP} not found" in e.detail for e in events)
    assert world.run(5) == []  # no repeats, no exceptions
    assert "not found" in world.manager.problem("chat")
    world.manager.start(launch(0), world.clock.now)  # the loop retries: failed again, clearly
    (again,) = world.run(1)
    assert again.kind == "failed" and "not found" in again.detail


def test_api_server_errors_are_classified_and_the_manager_recovers(world: World) -> None:
    serving(world, 1)
    world.cluster.inject("*", "*", status=503, times=1000)
    world.manager.start(launch(1), world.clock.now)  # the write cannot happen now
    assert world.run(5) == []
    assert "HTTP 503" in world.manager.problem("chat")
    assert world.replicas() == 1
    world.cluster.clear_faults()
    events = world.run(8)
    assert kinds(events) == [("chat/1", "healthy")]
    assert world.replicas() == 2 and world.manager.problem("chat") == ""


def test_an_api_server_that_is_away_is_reported_unreachable_then_caught_up(world: World) -> None:
    serving(world, 1)
    world.cluster.stop_listening()
    try:
        world.manager.park("chat/0", "stop", world.clock.now)
        assert world.run(3) == []
        assert "unreachable" in world.manager.problem("chat")
    finally:
        world.cluster.resume_listening()
    events = world.run(4)
    assert kinds(events) == [("chat/0", "stopped")]
    assert world.replicas() == 0


def test_a_cache_that_is_not_current_means_dont_know_not_no_pods(world: World) -> None:
    """The watches fail (503) while the scale still reads: the manager does not take its stale
    cache for the truth (a pod deleted meanwhile is not reported) and names the problem; once
    the watches are back (a fresh LIST), the deletion is reported."""
    serving(world, 1)
    pod = world.manager.pod_of("chat/0")
    assert pod is not None
    world.cluster.inject("watch", "*", status=503, times=10_000)
    world.cluster.app.streams.close_all()  # the watches end; opening them again fails
    deadline = time.monotonic() + 10
    while "HTTP 503" not in world.manager.problem("chat"):
        assert time.monotonic() < deadline, world.manager.problem("chat")
        assert world.run(1, settle=False) == []
        time.sleep(0.01)
    assert "reading Deployment serving/chat-vllm: watching " in world.manager.problem("chat")
    world.cluster.delete("pods", NS, pod, gracePeriodSeconds=30)
    assert world.run(3, settle=False) == []  # don't know: not "the pod is gone"
    world.cluster.clear_faults()
    (event,) = world.run(1)
    assert event.kind == "failed" and f"pod {pod} is being deleted" in event.detail
    assert world.manager.problem("chat") == ""


def test_image_pull_failure_fails_the_replica_with_the_reason(world: World) -> None:
    world.sim.image_error = True
    world.manager.start(launch(0), world.clock.now)
    events = world.run(3)
    assert kinds(events) == [("chat/0", "failed")]
    assert "ImagePullBackOff" in events[0].detail
    assert world.replicas() == 0  # the failed slot no longer counts


def test_unschedulable_pod_fails_the_replica_with_the_scheduler_message(world: World) -> None:
    world.sim.unschedulable = True
    world.manager.start(launch(0), world.clock.now)
    (event,) = world.run(3)
    assert event.kind == "failed" and "Unschedulable: 0/3 nodes are available" in event.detail


def test_no_ready_pod_within_the_health_timeout_fails(world: World) -> None:
    world.sim.ready_after = 1000
    world.manager.start(launch(0, timeout=10), world.clock.now)
    (event,) = world.run(12)
    assert event.kind == "failed" and "no Ready pod within 10s" in event.detail


def test_a_healthy_replica_whose_pod_is_deleted_by_someone_else_fails(world: World) -> None:
    serving(world, 1)
    pod = world.manager.pod_of("chat/0")
    assert pod is not None
    world.cluster.delete("pods", NS, pod, gracePeriodSeconds=30)
    (event,) = world.run(1)
    assert event.kind == "failed" and f"pod {pod} is being deleted" in event.detail


def test_a_serving_pod_whose_container_restarts_fails_its_replica(world: World) -> None:
    serving(world, 1)
    pod = world.manager.pod_of("chat/0")
    assert pod is not None

    def crashed(p: dict[str, Any]) -> None:
        p["status"]["containerStatuses"][0].update(
            restartCount=1,
            ready=False,
            state={"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s"}},
        )

    world.cluster.modify("pods", NS, pod, crashed)
    world.settle()
    (event,) = world.manager.poll(world.clock.now + 1)
    assert event.kind == "failed" and f"pod {pod}: container vllm CrashLoopBackOff" in event.detail
    assert world.annotation(pod, REPLICA_ANNOTATION) is None  # released: no replica claims it


def test_adopt_finds_the_annotated_pod_and_reap_releases_unknown_ones(
    world: World, cluster: FakeCluster
) -> None:
    serving(world, 2)
    pods = {rid: world.manager.pod_of(rid) for rid in ("chat/0", "chat/1")}
    world.manager.close()
    fresh = manager(cluster, world.target)
    world.manager = fresh
    assert fresh.adopt("chat/0", launch(0), world.clock.now)
    assert not fresh.adopt("chat/5", launch(5), world.clock.now)
    assert fresh.reap_orphans({"chat/0"}) == ["chat/1"]
    orphan = pods["chat/1"]
    assert orphan is not None
    assert world.annotation(orphan, REPLICA_ANNOTATION) is None
    events = world.run(4)
    assert kinds(events) == [("chat/0", "healthy")]
    assert world.replicas() == 1 and world.sim.deletions == [orphan]
    assert fresh.pod_of("chat/0") == pods["chat/0"]


def test_kill_deletes_the_hung_pod_and_a_fresh_one_serves_after_a_restart(world: World) -> None:
    serving(world, 1)
    hung = world.manager.pod_of("chat/0")
    assert hung is not None
    uid = world.cluster.get("pods", NS, hung)["metadata"]["uid"]
    world.manager.kill("chat/0", world.clock.now, "metrics frozen for 30s")
    deletes = [r for r in world.cluster.requests if r.verb == "delete" and r.resource == "pods"]
    assert [(d.name, d.code) for d in deletes] == [(hung, 200)]
    assert world.cluster.get("pods", NS, hung)["metadata"]["deletionTimestamp"]  # graceful
    (event,) = world.run(1)
    assert event.kind == "failed" and "metrics frozen for 30s" in event.detail and hung in event.detail
    world.manager.start(launch(0), world.clock.now)  # the loop restarts it
    (again,) = world.run(8)
    assert again.kind == "healthy" and world.manager.pod_of("chat/0") != hung
    assert all(p["metadata"]["uid"] != uid for p in world.pods())


def test_routing_sends_each_service_to_its_manager(world: World) -> None:
    local = FakeServiceManager()
    routed = RoutedServiceManager({"chat": world.manager, "embed": local})
    routed.start(launch(0), world.clock.now)
    routed.start(replace(launch(0), replica_id="embed/0", service="embed"), world.clock.now)
    assert local.started == ["embed/0"] and world.replicas() == 1
    events: list[ReplicaEvent] = []
    for _ in range(8):
        world.clock.now += 1
        world.sim.step()
        world.settle()
        events += routed.poll(world.clock.now)
    assert sorted(kinds(events)) == [("chat/0", "healthy"), ("embed/0", "healthy")]
    assert routed.url("embed/0") == "http://fake/embed/0"
    assert (routed.url("chat/0") or "").startswith("http://10.1.0.")
    routed.kill("chat/0", world.clock.now, "hung")  # the Kubernetes manager deletes the pod
    assert [e.kind for e in world.manager.poll(world.clock.now)] == ["failed"]
    with pytest.raises(ValueError, match="has no manager"):
        routed.url("other/0")


def test_wiring_builds_the_kubernetes_manager_from_config(cluster: FakeCluster, tmp_path: Path) -> None:
    settings = settings_for(
        tmp_path,
        services=[
            {
                "name": "chat",
                "model": "m",
                "manager": "kubernetes",
                "kubernetes": {"namespace": NS, "deployment": DEP, "port": 8080, "request_timeout": "2s"},
            },
            {"name": "embed", "model": "e", "emulate": True},
        ],
    )
    manager = service_manager(settings, "inst", api_client=cluster.api_client())
    try:
        assert isinstance(manager, RoutedServiceManager)
        manager.start(launch(0), START)
        assert cluster.get("deployments", NS, DEP)["spec"]["replicas"] == 1
    finally:
        manager.close()
    only = settings_for(tmp_path, services=[settings.services[0].model_dump()])
    k8s = service_manager(only, "inst", api_client=cluster.api_client())
    assert isinstance(k8s, KubernetesServiceManager) and k8s.request_timeout_s == 2.0
    k8s.close()


def test_the_charts_rbac_is_enough_for_refuse_mode_and_a_missing_grant_is_named(clock: SimClock) -> None:
    """The manager with the chart's own ServiceAccount and the Role the chart renders for a
    service (rules enforced by the fake): scaling up, choosing the pod on a scale-down, the
    autoscaler check, and the pod and EndpointSlice watches all pass; with the EndpointSlice
    grant, or only the pods' `watch`, taken out of the Role, the problem names the 403."""
    release = Release("lowtide", "lowtide-system")
    service = {
        "name": "chat",
        "model": "m",
        "manager": "kubernetes",
        "park": "stop",
        "kubernetes": {"namespace": NS, "deployment": DEP, "endpoint_service": "chat"},
    }
    values = {"artifactRoot": "s3://b/l", "store": {"url": "postgresql://db/l"}, "services": [service]}
    objects = render(load_chart(), [values], release)
    role = next(o for o in objects if o["kind"] == "Role" and o["metadata"]["name"] == "lowtide-service-chat")
    assert role["metadata"]["namespace"] == NS
    target = DeploymentTarget("chat", NS, DEP, endpoint_service="chat")
    with FakeCluster(clock=clock) as cluster:
        cluster.load_rbac(objects)
        cluster.add_user("sa-token", f"system:serviceaccount:{release.namespace}:{release.name}")
        cluster.create("deployments", NS, deployment(DEP))
        sim = DeploymentSim(cluster, clock, NS, DEP, service="chat")
        sa = manager(cluster, target, "sa-token")
        events: list[ReplicaEvent] = []
        for slot in range(2):
            sa.start(launch(slot), clock.now)
        for _ in range(8):
            clock.now += 1
            sim.step()
            settle(sa, cluster)
            events += sa.poll(clock.now)
        sa.park("chat/1", "stop", clock.now)
        for _ in range(4):
            clock.now += 1
            sim.step()
            settle(sa, cluster)
            events += sa.poll(clock.now)
        assert sorted(kinds(events)) == [("chat/0", "healthy"), ("chat/1", "healthy"), ("chat/1", "stopped")]
        assert not [r for r in cluster.requests if r.code == 403]
        assert {(r.verb, r.resource) for r in cluster.requests if r.verb == "watch"} == {
            ("watch", "pods"),
            ("watch", "endpointslices"),
        }
        sa.close()

    def without(resource: str, verb: str | None = None) -> list[dict[str, Any]]:
        """The chart's objects with `verb` (None: every verb) on `resource` taken out of the Role."""
        rules = []
        for r in role["rules"]:
            if r["resources"] == [resource]:
                verbs = [v for v in r["verbs"] if verb is not None and v != verb]
                if verbs:
                    rules.append({**r, "verbs": verbs})
            else:
                rules.append(r)
        return [{**o, "rules": rules} if o is role else o for o in objects]

    for narrower, expected in (
        (without("endpointslices"), 'cannot list resource "endpointslices"'),
        (without("pods", "watch"), 'cannot watch resource "pods"'),
    ):
        with FakeCluster(clock=clock) as cluster:
            cluster.load_rbac(narrower)
            cluster.add_user("sa-token", f"system:serviceaccount:{release.namespace}:{release.name}")
            cluster.create("deployments", NS, deployment(DEP))
            strict = manager(cluster, target, "sa-token")
            strict.start(launch(3), clock.now)
            problem = strict.problem("chat")
            assert "HTTP 403" in problem and "RBAC" in problem and expected in problem, problem
            assert cluster.get("deployments", NS, DEP)["spec"]["replicas"] == 0  # nothing written blind
            strict.close()


def test_kube_api_client_reads_kubeconfig_and_says_clearly_when_there_is_none(
    cluster: FakeCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(cluster.write_kubeconfig(tmp_path, ADMIN_TOKEN)))
    api = kube_api_client()
    try:
        assert client.AppsV1Api(api).read_namespaced_deployment_scale(DEP, NS).spec.replicas == 0
    finally:
        api.close()
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(ServeError, match=r"no Kubernetes credentials from KUBECONFIG.*set KUBECONFIG"):
        kube_api_client()


# -- configuration ----------------------------------------------------------------------------------


def test_config_rejects_park_sleep_with_the_kubernetes_manager_saying_why() -> None:
    with pytest.raises(ValidationError, match="a sleeping vLLM pod keeps its GPU allocation"):
        ServiceConfig.model_validate(
            {
                "name": "chat",
                "model": "m",
                "park": "sleep",
                "manager": "kubernetes",
                "kubernetes": {"namespace": NS, "deployment": DEP},
            }
        )
    with pytest.raises(ValidationError, match="manager: kubernetes needs `kubernetes:"):
        ServiceConfig.model_validate({"name": "chat", "model": "m", "manager": "kubernetes"})
    with pytest.raises(ValidationError, match="not a DNS-1123 label"):
        ServiceConfig.model_validate(
            {
                "name": "c",
                "model": "m",
                "manager": "kubernetes",
                "kubernetes": {"namespace": "NS", "deployment": "d"},
            }
        )
    ok = ServiceConfig.model_validate(
        {
            "name": "chat",
            "model": "m",
            "manager": "kubernetes",
            "kubernetes": {"namespace": NS, "deployment": DEP},
        }
    )
    assert ok.kubernetes is not None and ok.kubernetes.on_autoscaler == "refuse"


# -- the real control loop --------------------------------------------------------------------------


def test_the_control_loop_scales_the_deployment_with_load(cluster: FakeCluster, clock: SimClock) -> None:
    spec = ServiceSpec(
        name="chat",
        model="m",
        gpus_per_replica=1,
        min_replicas=1,
        max_replicas=3,
        park="stop",
        autoscale=AutoscaleTargets(
            concurrency_per_replica=4,
            kv_usage=None,
            scale_up_window_s=5,
            scale_down_stabilization_s=20,
            tolerance=0,
        ),
    )
    sim = DeploymentSim(cluster, clock, NS, DEP, service="chat", ready_after=3.0)
    target = DeploymentTarget("chat", NS, DEP, endpoint_service="chat")
    first = manager(cluster, target)
    metrics = FakeMetrics()
    w = LoopHarness(
        nodes=(Node("gpu-a", tuple(range(4))),),
        layout=ArtifactLayout("/art", "/work"),
        clock=FakeClock(START),
        services=(ServiceSetup(spec=spec, command=("serve",), base_port=9000),),
        lending=LendingPolicy(reclaim_lead_s=30, stale_after_s=10, stale_reclaim_after_s=60),
        manager=first,
        sources={"chat": metrics},
    )
    current = [first]

    def run(n: int) -> None:
        for _ in range(n):
            clock.now = w.clock.now() + 1.0
            sim.step()
            settle(current[0], cluster)
            w.tick()

    def states() -> list[str]:
        return [r.state.value for r in w.store.replicas("chat")]

    try:
        w.recover()
        run(6)
        assert states() == ["SERVING"]  # min_replicas: one pod, claimed
        assert cluster.get("deployments", NS, DEP)["spec"]["replicas"] == 1
        metrics.concurrency = 10.0  # 10 per replica → 3 replicas
        run(15)
        assert states() == ["SERVING"] * 3
        assert cluster.get("deployments", NS, DEP)["spec"]["replicas"] == 3
        urls = {first.url(f"chat/{i}") for i in range(3)}
        assert urls == {f"http://{p['status']['podIP']}:8000" for p in cluster.list("pods", NS, "app=vllm")}
        # A restarted control plane adopts the pods by their annotation: nothing restarts.
        w.manager = manager2 = manager(cluster, target)
        current[0] = manager2
        first.close()
        w.restart()
        run(2)
        assert states() == ["SERVING"] * 3
        assert {manager2.url(f"chat/{i}") for i in range(3)} == urls
        assert sim.deletions == []
        # The load goes: after the stabilisation and the drain, two replicas park by scale-down,
        # and exactly their pods are removed.
        pods_of = {f"chat/{i}": manager2.pod_of(f"chat/{i}") for i in range(3)}
        metrics.concurrency = 0.0
        run(90)
        assert sorted(states()) == ["PARKED", "PARKED", "SERVING"]
        parked = {r.id for r in w.store.replicas("chat") if r.state.value == "PARKED"}
        assert sorted(sim.deletions) == sorted(pods_of[rid] or "" for rid in parked)
        assert cluster.get("deployments", NS, DEP)["spec"]["replicas"] == 1
    finally:
        w.close()
