"""Kubernetes Events (`adapters.k8s_events`, docs/cluster.md "Kubernetes Events") with the real
`kubernetes` client against the fake API server (`k8sfake`, which validates events.k8s.io/v1 as
pkg/apis/core/validation/events.go does), run as the chart's ServiceAccount with the chart's
RBAC where the executor and the service manager are involved.

Scenarios: the recorder writes valid Events in the namespace of the object they regard, escapes
and cuts notes; 50 identical occurrences are one Event with series.count 50; a series ends after
its window; the per-object limit; a 403 is logged once naming the rule and breaks nothing; 5xx
are retried, then dropped; a slow or absent API server does not hold `emit` (the queue is
bounded, drops are counted); `close` stops the thread. The Argo executor's Events (deferred,
admitted, notice, image pull give-up), admission going on under a 403 on events, and the
service manager's (scaled, autoscaler conflict as one series, steered, Deployment missing, replica
failed), scaling going on under a 403 on events.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from argo_sim import ArgoSim, Script
from argo_world import LAYOUT, NS, RELEASE, ROOT, SA, SA_TOKEN, SETTINGS, T0, drive, node_object
from k8s_deploy_sim import DeploymentSim, SimClock, deployment, replica_launch
from k8sfake import ADMIN_TOKEN, FakeCluster
from lowtide.adapters.argo.executor import ArgoExecutor
from lowtide.adapters.k8s_events import CONTROLLER, EventRecorder, Regarding
from lowtide.adapters.k8s_services import DeploymentTarget, KubernetesServiceManager
from lowtide.control.clock import FakeClock
from lowtide.control.inference_ports import ReplicaEvent, ReplicaLaunch
from lowtide.deploy.chart import load_chart, render
from lowtide.domain.gpus import Node
from lowtide.domain.states import AttemptState
from lowtide.policy.outcomes import RetryPolicy
from lowtide.sim.harness import LoopHarness
from lowtide.store.memory import MemoryStore
from lowtide.wiring import argo_workflows, build, k8s_event_recorder
from support import settings_for

SERVING = "serving"
DEP = "chat-vllm"
EVENTS = "events.events.k8s.io"
WAIT_S = 10.0  # a bound, not a duration


def chart(*, services: bool = False, events_rule: bool = True) -> list[dict[str, Any]]:
    values: dict[str, Any] = {"artifactRoot": ROOT, "store": {"url": "postgresql://db/l"}}
    if services:
        values["services"] = [
            {
                "name": "chat",
                "model": "m",
                "manager": "kubernetes",
                "park": "stop",
                "kubernetes": {"namespace": SERVING, "deployment": DEP, "on_autoscaler": "steer"},
            }
        ]
    objects = render(load_chart(), [values], RELEASE)
    if not events_rule:
        for o in objects:
            if o["kind"] in ("Role", "ClusterRole"):
                o["rules"] = [r for r in o["rules"] if r["resources"] != ["events"]]
    return objects


def events_in(cluster: FakeCluster, namespace: str) -> list[dict[str, Any]]:
    return cluster.list(EVENTS, namespace)


def about(cluster: FakeCluster, namespace: str, kind: str, name: str) -> list[tuple[str, str, str]]:
    """(type, reason, note) of the Events regarding that object, oldest first."""
    found = [
        e
        for e in events_in(cluster, namespace)
        if (e["regarding"]["kind"], e["regarding"]["name"]) == (kind, name)
    ]
    found.sort(key=lambda e: e["eventTime"])
    return [(e["type"], e["reason"], e["note"]) for e in found]


def recorder(cluster: FakeCluster, token: str | None = None, **kwargs: Any) -> EventRecorder:
    api = cluster.api_client(token) if token else cluster.api_client()
    kwargs.setdefault("instance", "lowtide-0")
    kwargs.setdefault("retry_s", 0.01)
    return EventRecorder(api, **kwargs)


@pytest.fixture
def cluster() -> Iterator[FakeCluster]:
    with FakeCluster() as c:
        yield c


def writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "lowtide-k8s-events"]


# -- the recorder ------------------------------------------------------------------------------------


def test_an_event_is_valid_and_lands_in_the_namespace_of_the_object_it_regards(cluster: FakeCluster) -> None:
    rec = recorder(cluster)
    try:
        pod = Regarding.pod("team-a", "step-0", "uid-1")
        rec.emit(pod, "Warning", "AdmissionDeferred", "Admit", "node n1: 1 of 4 GPUs free\x1b[31m\nred")
        rec.emit(Regarding.deployment(SERVING, DEP), "Normal", "Scaled", "Scale", "é" * 600)
        assert rec.flush(WAIT_S)
    finally:
        rec.close()
    (event,) = events_in(cluster, "team-a")
    assert event["regarding"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "step-0",
        "namespace": "team-a",
        "uid": "uid-1",
    }
    assert (event["type"], event["reason"], event["action"]) == ("Warning", "AdmissionDeferred", "Admit")
    assert event["reportingController"] == CONTROLLER == "lowtide.io/control-plane"
    assert event["reportingInstance"] == "lowtide-0"
    assert event["note"] == "node n1: 1 of 4 GPUs free\\x1b[31m\\nred"  # escaped, not interpreted
    assert event["metadata"]["name"].startswith("step-0.") and "series" not in event
    (long,) = events_in(cluster, SERVING)
    assert long["note"].endswith("...") and len(long["note"].encode()) <= 1024  # cut on a character
    assert rec.stats.created == 2 and rec.stats.failed == 0


def test_fifty_identical_occurrences_are_one_event_with_series_count_fifty(cluster: FakeCluster) -> None:
    rec = recorder(cluster)
    pod = Regarding.pod(NS, "step-0", "u")
    try:
        for _ in range(50):
            rec.emit(pod, "Warning", "AdmissionDeferred", "Admit", "node n1 is cordoned")
        rec.emit(pod, "Warning", "AdmissionDeferred", "Admit", "node n1 is not Ready")  # another note
        assert rec.flush(WAIT_S)
    finally:
        rec.close()
    events = {e["note"]: e for e in events_in(cluster, NS)}
    assert set(events) == {"node n1 is cordoned", "node n1 is not Ready"}
    assert events["node n1 is cordoned"]["series"]["count"] == 50
    assert "series" not in events["node n1 is not Ready"]
    writes = [r for r in cluster.requests if r.resource == "events"]
    assert len([r for r in writes if r.verb == "create"]) == 2  # not 51 objects
    assert rec.stats.aggregated == 49


def test_a_series_is_patched_as_it_grows_and_ends_after_its_window(cluster: FakeCluster) -> None:
    now = [T0]
    rec = recorder(cluster, clock=lambda: now[0], series_finish_s=360.0)
    pod = Regarding.pod(NS, "step-0", "u")
    try:
        rec.emit(pod, "Normal", "Admitted", "Admit", "onto n1")
        assert rec.flush(WAIT_S)
        for _ in range(3):
            now[0] += 10
            rec.emit(pod, "Normal", "Admitted", "Admit", "onto n1")
        assert rec.flush(WAIT_S)
        (first,) = events_in(cluster, NS)
        assert first["series"]["count"] == 4
        assert first["series"]["lastObservedTime"] == "2027-01-15T08:00:30.000000Z"
        now[0] += 361  # the series ended: the next occurrence is a new Event
        rec.emit(pod, "Normal", "Admitted", "Admit", "onto n1")
        assert rec.flush(WAIT_S)
    finally:
        rec.close()
    events = sorted(events_in(cluster, NS), key=lambda e: e["eventTime"])
    assert [e.get("series", {}).get("count") for e in events] == [4, None]
    patches = [r for r in cluster.requests if r.resource == "events" and r.verb == "patch"]
    assert [r.code for r in patches] == [200]  # one write for the three occurrences


def test_creates_are_limited_per_object(cluster: FakeCluster) -> None:
    rec = recorder(cluster, burst=3, refill_s=300.0)
    try:
        for i in range(5):
            rec.emit(Regarding.pod(NS, "noisy"), "Warning", "ReplicaFailed", "Fail", f"failure {i}")
        rec.emit(Regarding.pod(NS, "quiet"), "Warning", "ReplicaFailed", "Fail", "failure")
        assert rec.flush(WAIT_S)
    finally:
        rec.close()
    names = sorted(e["regarding"]["name"] for e in events_in(cluster, NS))
    assert names == ["noisy", "noisy", "noisy", "quiet"]
    assert rec.stats.rate_limited == 2


def test_a_403_is_logged_once_naming_the_rule_and_dropped(
    cluster: FakeCluster, caplog: pytest.LogCaptureFixture
) -> None:
    cluster.load_rbac(chart(events_rule=False))
    cluster.add_user(SA_TOKEN, SA)
    rec = recorder(cluster, SA_TOKEN)
    try:
        with caplog.at_level(logging.WARNING, logger="lowtide.adapters.k8s_events"):
            for i in range(5):
                rec.emit(Regarding.pod(NS, f"step-{i}"), "Normal", "Admitted", "Admit", "onto n1")
            assert rec.flush(WAIT_S)
    finally:
        rec.close()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said
    assert f"in namespace {NS}" in said[0] and 'apiGroups ["events.k8s.io"]' in said[0]
    assert 'verbs ["create", "patch"]' in said[0] and "forbidden" in said[0].lower()
    assert rec.stats.failed == 5 and events_in(cluster, NS) == []
    assert len([r for r in cluster.requests if r.resource == "events"]) == 5  # no retries of a 403


def test_server_errors_are_retried_then_dropped(cluster: FakeCluster) -> None:
    rec = recorder(cluster, max_tries=3)
    try:
        cluster.inject("create", "events", status=503, times=2)
        rec.emit(Regarding.pod(NS, "a"), "Normal", "Admitted", "Admit", "onto n1")
        assert rec.flush(WAIT_S)
        assert [e["regarding"]["name"] for e in events_in(cluster, NS)] == ["a"]  # the third try
        cluster.inject("create", "events", status=500, times=3)
        rec.emit(Regarding.pod(NS, "b"), "Normal", "Admitted", "Admit", "onto n1")
        assert rec.flush(WAIT_S)
    finally:
        rec.close()
    assert [e["regarding"]["name"] for e in events_in(cluster, NS)] == ["a"]
    assert rec.stats.failed == 1
    assert [r.code for r in cluster.requests if r.resource == "events"] == [503, 503, 201, 500, 500, 500]


def test_a_slow_api_server_does_not_hold_emit_and_a_full_queue_drops_counted(
    cluster: FakeCluster, caplog: pytest.LogCaptureFixture
) -> None:
    cluster.inject("create", "events", latency=2.0, times=100)
    rec = recorder(cluster, queue_size=2, request_timeout_s=10.0)
    with caplog.at_level(logging.WARNING, logger="lowtide.adapters.k8s_events"):
        for i in range(20):
            rec.emit(Regarding.pod(NS, f"step-{i}"), "Normal", "Admitted", "Admit", "onto n1")
        # Every emit has returned while the API server still holds the first request.
        assert not [r for r in cluster.requests if r.resource == "events"]
        assert rec.stats.dropped >= 17
        rec.close(timeout_s=0.1)
    assert not rec.alive and not writer_threads()
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 1 and "queue is full" in dropped[0]  # one line, with the count in it


def test_an_absent_api_server_neither_raises_nor_keeps_the_thread(cluster: FakeCluster) -> None:
    rec = recorder(cluster, max_tries=2, request_timeout_s=1.0)
    cluster.stop_listening()
    for i in range(10):
        rec.emit(Regarding.pod(NS, f"step-{i}"), "Warning", "AdmissionDeferred", "Admit", "busy")
    rec.close(timeout_s=1.0)
    assert not rec.alive and not writer_threads()
    assert rec.stats.created == 0


def test_close_writes_the_pending_series_and_stops_the_thread(cluster: FakeCluster) -> None:
    before = len(writer_threads())
    rec = recorder(cluster, series_flush_s=3600.0)
    assert len(writer_threads()) == before + 1
    for _ in range(7):
        rec.emit(Regarding.pod(NS, "step-0"), "Normal", "StopNotice", "Stop", "notice")
    rec.close()
    rec.emit(Regarding.pod(NS, "step-0"), "Normal", "StopNotice", "Stop", "after close: ignored")
    assert len(writer_threads()) == before and not rec.alive
    ((event,),) = [events_in(cluster, NS)]
    assert event["series"]["count"] == 7


# -- the Argo executor ---------------------------------------------------------------------------


class ArgoWorld:
    def __init__(
        self, cluster: FakeCluster, clock: FakeClock, events: EventRecorder, **executor: Any
    ) -> None:
        self.cluster, self.clock, self.events = cluster, clock, events
        self.store = MemoryStore()
        self.sim = ArgoSim(cluster, clock.now, NS)
        nodes = (Node("n1", (0, 1, 2, 3)),)
        self.h = LoopHarness(
            nodes=nodes,
            layout=LAYOUT,
            clock=clock,
            store=self.store,
            executor=ArgoExecutor(
                cluster.api_client(SA_TOKEN),
                SETTINGS,
                argo_workflows(self.store, SETTINGS),
                nodes={"n1": 4},
                events=events,
                **executor,
            ),
            retry=RetryPolicy(5.0, 5.0),
        )
        self.h.recover()

    def run(self, until: Callable[[], bool], limit: int = 200) -> None:
        drive(self.sim, self.h, until, limit)

    def attempts(self, job: str) -> list[Any]:
        return list(self.h.store.job_detail(job).attempts)

    def pod(self) -> dict[str, Any]:
        (pod,) = [p for p in self.cluster.list("pods", NS) if not p["metadata"].get("deletionTimestamp")]
        return pod


@pytest.fixture
def argo(request: pytest.FixtureRequest) -> Iterator[ArgoWorld]:
    """`@pytest.mark.parametrize("argo", [{"events_rule": False, ...}], indirect=True)` changes it."""
    params = dict(getattr(request, "param", {}))
    clock = FakeClock(T0)
    with FakeCluster(clock=lambda: datetime.fromtimestamp(clock.now(), UTC)) as cluster:
        cluster.load_rbac(chart(events_rule=params.pop("events_rule", True)))
        cluster.add_user(SA_TOKEN, SA)
        cluster.create("nodes", "", node_object("n1", 4))
        rec = recorder(cluster, SA_TOKEN)
        world = ArgoWorld(cluster, clock, rec, **params)
        try:
            yield world
        finally:
            world.h.executor.close()
            rec.close()


def one_step(gpus: int) -> dict[str, Any]:
    return {"name": "j", "steps": [{"name": "t", "command": ["t"], "gpus": gpus}]}


def test_the_executor_says_deferred_then_admitted_then_notice_on_the_pod(argo: ArgoWorld) -> None:
    argo.cluster.create(
        "pods",
        SERVING,
        {
            "metadata": {"name": "chat-vllm-7f9c"},
            "spec": {
                "containers": [{"name": "v", "image": "v", "resources": {"limits": {"nvidia.com/gpu": 3}}}]
            },
        },
    )
    argo.cluster.bind_pod(SERVING, "chat-vllm-7f9c", "n1")
    job = argo.h.submit(one_step(2))
    argo.sim.script(job, "t", Script(run_s=600))  # running until the notice
    argo.run(lambda: any(a.state == AttemptState.FAILED for a in argo.attempts(job)))
    pod = argo.pod()
    name, uid = pod["metadata"]["name"], pod["metadata"]["uid"]
    argo.cluster.delete("pods", SERVING, "chat-vllm-7f9c")
    argo.cluster.finish_pod_deletion(SERVING, "chat-vllm-7f9c")
    argo.run(lambda: argo.attempts(job)[-1].state == AttemptState.RUNNING)
    running = argo.attempts(job)[-1]
    argo.store.request_preemption(running.id, grace_s=30, reason="GPUs reclaimed", now=argo.clock.now())
    argo.h.tick()  # the loop's notice, with its reason
    assert argo.events.flush(WAIT_S)
    said = about(argo.cluster, NS, "Pod", name)
    assert said[0] == (
        "Warning",
        "AdmissionDeferred",
        "node n1: 1 of 4 GPUs free (serving/chat-vllm-7f9c holds 3); the step needs 2",
    )
    assert said[1][:2] == ("Normal", "Admitted") and "onto node n1 with 2 GPUs" in said[1][2]
    assert said[2][:2] == ("Normal", "Preempting")
    assert said[2][2].startswith("GPUs reclaimed: notice: SIGTERM now") and "within 30s" in said[2][2]
    assert all(e["regarding"]["uid"] == uid for e in events_in(argo.cluster, NS))


@pytest.mark.parametrize(
    ("why", "reason", "words"),
    [
        ("cancel", "Cancelling", "job cancelled: notice"),
        ("walltime", "WalltimeExceeded", "walltime limit reached: notice"),
        ("none", "StopNotice", "notice"),
    ],
)
def test_a_notice_event_says_why_the_loop_gave_it(argo: ArgoWorld, why: str, reason: str, words: str) -> None:
    doc = one_step(1)
    doc["grace_seconds"] = 30
    if why == "walltime":
        doc["steps"][0]["timeout"] = 20
    job = argo.h.submit(doc)
    argo.sim.script(job, "t", Script(run_s=600))
    argo.run(lambda: argo.attempts(job)[-1].state == AttemptState.RUNNING)
    name = argo.pod()["metadata"]["name"]
    if why == "none":  # a caller that gives no reason (the port's default)
        argo.h.executor.notify_stop(argo.attempts(job)[-1].id, argo.clock.now() + 30, argo.clock.now())
    else:
        if why == "cancel":
            argo.store.request_cancel(job, by="alice", now=argo.clock.now())
        argo.run(lambda: argo.attempts(job)[-1].state == AttemptState.STOPPING)
    assert argo.events.flush(WAIT_S)
    (notice,) = [e for e in about(argo.cluster, NS, "Pod", name) if e[1] != "Admitted"]
    assert notice[:2] == ("Normal", reason)
    assert notice[2].startswith(words) and "within 30s" in notice[2]


@pytest.mark.parametrize("argo", [{"image_pull_bound_s": 0.0}], indirect=True)
def test_the_executor_says_when_it_gives_up_on_an_image(argo: ArgoWorld) -> None:
    job = argo.h.submit(one_step(1))
    argo.sim.script(job, "t", Script(image_error="ErrImagePull"))
    argo.run(lambda: any(a.exit_reason is not None for a in argo.attempts(job)))
    assert argo.events.flush(WAIT_S)
    gave_up = [e for e in events_in(argo.cluster, NS) if e["reason"] == "ImagePullGaveUp"]
    assert len(gave_up) == 1 and gave_up[0]["type"] == "Warning" and gave_up[0]["regarding"]["kind"] == "Pod"


@pytest.mark.parametrize("argo", [{"events_rule": False}], indirect=True)
def test_a_403_on_events_does_not_stop_admission(argo: ArgoWorld, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="lowtide.adapters.k8s_events"):
        job = argo.h.submit(one_step(1))
        argo.sim.script(job, "t", Script(run_s=600))
        argo.run(lambda: argo.attempts(job)[-1].state == AttemptState.RUNNING)
        assert argo.events.flush(WAIT_S)
    assert argo.pod()["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "n1"}  # admitted
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and f"may not create Kubernetes Events in namespace {NS}" in said[0]


# -- the Kubernetes service manager ---------------------------------------------------------------


def launch(slot: int) -> ReplicaLaunch:
    return replica_launch(slot, health_timeout_s=600.0)


class ServiceWorld:
    def __init__(
        self, cluster: FakeCluster, clock: SimClock, events: EventRecorder, on_autoscaler: str
    ) -> None:
        self.cluster, self.clock, self.events = cluster, clock, events
        self.sim = DeploymentSim(cluster, clock, SERVING, DEP)
        target = DeploymentTarget("chat", SERVING, DEP, on_autoscaler=on_autoscaler)  # type: ignore[arg-type]
        self.manager = KubernetesServiceManager(
            cluster.api_client(SA_TOKEN), [target], refresh_s=0.0, watch_backoff_s=(0.05, 0.5), events=events
        )
        self.replica_events: list[ReplicaEvent] = []

    def run(self, seconds: float) -> None:
        end = self.clock.now + seconds
        while self.clock.now < end:
            self.clock.now += 1.0
            self.sim.step()
            pods = self.cluster.last_write("pods", SERVING)
            assert self.manager.caught_up("chat", pods, None, WAIT_S)
            self.replica_events += self.manager.poll(self.clock.now)


def service_world(on_autoscaler: str = "refuse", *, events_rule: bool = True) -> Iterator[ServiceWorld]:
    clock = SimClock(T0)
    with FakeCluster(clock=clock) as cluster:
        cluster.load_rbac(chart(services=True, events_rule=events_rule))
        cluster.add_user(SA_TOKEN, SA)
        cluster.create("deployments", SERVING, deployment(DEP))
        rec = recorder(cluster, SA_TOKEN)
        world = ServiceWorld(cluster, clock, rec, on_autoscaler)
        try:
            yield world
        finally:
            world.manager.close()
            rec.close()


def hpa(minimum: int = 1, maximum: int = 4) -> dict[str, Any]:
    return {
        "metadata": {"name": "chat-hpa"},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": DEP},
            "minReplicas": minimum,
            "maxReplicas": maximum,
        },
    }


def test_the_service_manager_says_scaled_on_the_deployment_and_replica_failed_on_the_pod() -> None:
    for w in service_world():
        uid = w.cluster.get("deployments", SERVING, DEP)["metadata"]["uid"]
        w.sim.crash = True  # its pod never becomes Ready: CrashLoopBackOff
        w.manager.start(launch(0), w.clock.now)
        w.run(10)
        assert w.events.flush(WAIT_S)
        scaled = sorted(
            (e for e in events_in(w.cluster, SERVING) if e["reason"] == "Scaled"),
            key=lambda e: e["eventTime"],
        )
        ref = {"apiVersion": "apps/v1", "kind": "Deployment", "name": DEP, "namespace": SERVING, "uid": uid}
        assert [e["regarding"] for e in scaled] == [ref, ref]
        assert {e["type"] for e in scaled} == {"Normal"}
        assert "spec.replicas 0 → 1" in scaled[0]["note"] and "spec.replicas 1 → 0" in scaled[1]["note"]
        failed = [e for e in events_in(w.cluster, SERVING) if e["reason"] == "ReplicaFailed"]
        assert failed and failed[0]["type"] == "Warning" and failed[0]["regarding"]["kind"] == "Pod"
        assert "chat/0" in failed[0]["note"] and "CrashLoopBackOff" in failed[0]["note"]


def test_an_autoscaler_conflict_is_one_warning_series_on_the_deployment() -> None:
    for w in service_world("refuse"):
        w.cluster.create("horizontalpodautoscalers", SERVING, hpa())
        for slot in range(3):  # every start and poll refuses again: one Event, counted
            w.manager.start(launch(slot), w.clock.now)
            w.run(3)
        assert w.events.flush(WAIT_S)
        (conflict,) = [e for e in events_in(w.cluster, SERVING) if e["reason"] == "AutoscalerConflict"]
        assert conflict["type"] == "Warning" and conflict["regarding"]["kind"] == "Deployment"
        assert "HorizontalPodAutoscaler chat-hpa" in conflict["note"]
        assert conflict["series"]["count"] >= 3
        assert int(w.cluster.get("deployments", SERVING, DEP)["spec"]["replicas"]) == 0  # no fight


def test_steering_says_steered_on_the_autoscaler() -> None:
    for w in service_world("steer"):
        made = w.cluster.create("horizontalpodautoscalers", SERVING, hpa())
        w.manager.start(launch(0), w.clock.now)
        w.manager.start(launch(1), w.clock.now)
        w.run(3)
        assert w.events.flush(WAIT_S)
        steered = [e for e in events_in(w.cluster, SERVING) if e["reason"] == "Steered"]
        assert {e["regarding"]["kind"] for e in steered} == {"HorizontalPodAutoscaler"}
        assert {e["regarding"]["uid"] for e in steered} == {made["metadata"]["uid"]}
        notes = sorted(e["note"] for e in steered)  # one per change of bounds
        assert [n.split(" for ")[0] for n in notes] == ["bounds set to 1..1", "bounds set to 2..2"]


def test_a_missing_deployment_is_a_warning_regarding_it_by_name() -> None:
    for w in service_world():
        w.manager.start(launch(0), w.clock.now)
        w.run(8)
        w.cluster.delete("deployments", SERVING, DEP)
        w.run(3)
        assert w.events.flush(WAIT_S)
        (missing,) = [e for e in events_in(w.cluster, SERVING) if e["reason"] == "DeploymentMissing"]
        assert missing["type"] == "Warning"
        assert missing["regarding"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": DEP,
            "namespace": SERVING,
        }
        assert f"Deployment {SERVING}/{DEP} not found" in missing["note"]


def test_a_403_on_events_does_not_stop_scaling(caplog: pytest.LogCaptureFixture) -> None:
    for w in service_world(events_rule=False):
        with caplog.at_level(logging.ERROR, logger="lowtide.adapters.k8s_events"):
            w.manager.start(launch(0), w.clock.now)
            w.run(10)
            assert w.events.flush(WAIT_S)
        assert [(e.replica_id, e.kind) for e in w.replica_events] == [("chat/0", "healthy")]
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and f"in namespace {SERVING}" in said[0]


# -- wiring ------------------------------------------------------------------------------------------


def test_wiring_builds_one_recorder_in_cluster_mode_and_closes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = SimClock(T0)
    with FakeCluster(clock=clock) as cluster:
        cluster.create("deployments", SERVING, deployment(DEP))
        monkeypatch.setenv("KUBECONFIG", str(cluster.write_kubeconfig(tmp_path, ADMIN_TOKEN)))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        (tmp_path / "local").mkdir()
        (tmp_path / "cluster").mkdir()
        local = settings_for(tmp_path / "local", services=[{"name": "e", "model": "e", "emulate": True}])
        assert k8s_event_recorder(local) is None  # nothing of the cluster: no recorder, no thread
        service = {"name": "chat", "model": "m", "manager": "kubernetes", "park": "stop"}
        service["kubernetes"] = {"namespace": SERVING, "deployment": DEP}
        before = len(writer_threads())
        lt = build(settings_for(tmp_path / "cluster", services=[service]))
        try:
            assert len(writer_threads()) == before + 1
            assert lt.inference is not None
            lt.inference.manager.start(launch(0), T0)  # the manager has the recorder
        finally:
            lt.close()
        assert len(writer_threads()) == before  # stopped at shutdown, what it held written
        (scaled,) = events_in(cluster, SERVING)
        assert (scaled["reason"], scaled["regarding"]["name"]) == ("Scaled", DEP)
