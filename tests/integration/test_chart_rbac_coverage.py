"""The chart's RBAC, measured: every request lowtide makes in cluster mode is allowed, and every
rule the chart grants its ServiceAccount is used by some request (issue 8: "enough for every
scenario and nothing more"). Must not: hand-write the requests (tests/k8sfake/test_chart_rbac.py
does that); here lowtide's real code makes them.

One fake API server (`k8sfake`) holds exactly the RBAC `lowtide.deploy.chart.render` gives for a
release with three Kubernetes-managed services; every lowtide client authenticates as the chart's
ServiceAccount (`system:serviceaccount:lowtide-system:lowtide`), as the control plane's pod does
(client-go/kubernetes client in-cluster config: the mounted ServiceAccount token). The
scenarios, run in turn on the fake clock, together cover lowtide's cluster surface:

- the Argo executor (`adapters.argo`) under the real loop (`sim.harness.LoopHarness`) with
  `argo_sim` playing Argo and the kubelet, node lending on (`adapters.k8s_nodes`) and Kubernetes
  Events on (`adapters.k8s_events`): a two-step GPU job deferred by another namespace's pod on its
  node (the fit check; a repeated AdmissionDeferred Event is a series, patched), then admitted
  (node label/taint, step tokens' Secret created then patched, pod admission patch), the control
  plane restarted while its second step runs (recover: adopt by the pod's name and uid,
  reap_orphans), finished and its Workflow stopped (`end_job`); a running job cancelled (its pod
  deleted with a uid precondition: the same request a preemption's notice makes, `_delete_pod`)
  and retried (a new Workflow generation) to success;
- the Kubernetes service manager (`adapters.k8s_services`) with `tests/k8s_deploy_sim.py`: scale
  up and down through `deployments/scale`, a park with pod-deletion-cost, readiness from
  EndpointSlices, a steered HPA, a steered KEDA ScaledObject, a hung replica's pod deleted, a
  refused HPA (a repeated Warning: an Event series) until its owner removes it, a restart (adopt,
  reap_orphans);
- the Lease elector (`adapters.k8s_lease`): acquire (get 404, create), renew (update);
- lowtide's API reading a running step's log from its pod (`adapters.argo.pod_logs`: pods/log
  get, and pods get for its uid), as `lowtide logs JOB STEP` does.

The admin token (`adminToken.existingSecret`) is mounted as a file and read from
`auth.admin_token_source` (deploy/manifests.py `ADMIN_TOKEN_DIR`), and the store URL reaches the
pod as an environment variable from a `secretKeyRef`: the kubelet reads both Secrets, not
lowtide, so neither needs a rule of lowtide's ServiceAccount.

"Used" is measured per (apiGroup, resource[/subresource], verb, scope): a Role's rule by a request
in its namespace, a ClusterRole's (bound cluster-wide) by a request on a cluster-scoped resource or
across all namespaces (a namespaced request is already allowed by a Role); a rule with
`resourceNames` only by a request naming one of them (Kubernetes RBAC semantics,
k8s.io/kubernetes plugin/pkg/auth/authorizer/rbac/rbac.go `RuleAllows`, v1.35). A refused (403)
request uses nothing; any other answer (a 404 on the Lease's first get, a 409) does. The three
services share one namespace, so a rule two of their Roles grant there (e.g. HPA update, with
steer) counts as used once either service uses it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

from fastapi.testclient import TestClient
from kubernetes import client

from argo_sim import ArgoSim, Script
from argo_world import LAYOUT, NS, RELEASE, ROOT, SA, SA_TOKEN, SETTINGS, T0, drive, node_object, settling
from k8s_deploy_sim import DeploymentSim, SimClock, deployment, replica_launch
from k8sfake import FakeCluster
from k8sfake.server import RequestRecord
from lowtide.adapters.argo.executor import ArgoExecutor
from lowtide.adapters.argo.pod_logs import PodLogReader
from lowtide.adapters.k8s_events import EventRecorder
from lowtide.adapters.k8s_lease import KubeLeaseElector
from lowtide.adapters.k8s_services import DeploymentTarget, KubernetesServiceManager
from lowtide.api.app import ApiContext, create_app
from lowtide.control.clock import FakeClock
from lowtide.control.inference_ports import ReplicaEvent, ReplicaLaunch
from lowtide.deploy.chart import GrantedRule, load_chart, rbac_rules, render
from lowtide.domain.gpus import Node
from lowtide.domain.states import AttemptState
from lowtide.policy.outcomes import RetryPolicy
from lowtide.sim.harness import LoopHarness
from lowtide.store.memory import MemoryStore
from lowtide.wiring import argo_workflows

SERVING = "serving"
WAIT_S = 10.0  # a bound, not a duration
NODES = (Node("n1", (0, 1, 2, 3)),)

#: Three services in one namespace: HPA steered with EndpointSlices, KEDA steered, HPA refused.
SERVICES = [
    {
        "name": "chat",
        "model": "m",
        "manager": "kubernetes",
        "park": "stop",
        "kubernetes": {
            "namespace": SERVING,
            "deployment": "chat-vllm",
            "endpoint_service": "chat",
            "on_autoscaler": "steer",
        },
    },
    {
        "name": "code",
        "model": "m",
        "manager": "kubernetes",
        "park": "stop",
        "kubernetes": {"namespace": SERVING, "deployment": "code-vllm", "on_autoscaler": "steer"},
    },
    {
        "name": "embed",
        "model": "m",
        "manager": "kubernetes",
        "park": "stop",
        "kubernetes": {"namespace": SERVING, "deployment": "embed-vllm"},
    },
]
TARGETS = [
    DeploymentTarget("chat", SERVING, "chat-vllm", endpoint_service="chat", on_autoscaler="steer"),
    DeploymentTarget("code", SERVING, "code-vllm", on_autoscaler="steer"),
    DeploymentTarget("embed", SERVING, "embed-vllm"),
]


def chart_objects() -> list[dict[str, Any]]:
    values = {"artifactRoot": ROOT, "store": {"url": "postgresql://db/l"}, "services": SERVICES}
    return render(load_chart(), [values], RELEASE)


# -- the measure ------------------------------------------------------------------------------------

Grant = tuple[str, str, str, str, tuple[str, ...]]  # group, resource, verb, namespace ("*": all), names


def grants(rules: Iterable[GrantedRule]) -> set[Grant]:
    """Each (group, resource, verb, scope, resourceNames) the chart grants the ServiceAccount."""
    return {
        (group, resource, verb, "*" if rule.namespace is None else rule.namespace, rule.resource_names)
        for rule in rules
        if rule.subject == SA
        for group in rule.api_groups
        for resource in rule.resources
        for verb in rule.verbs
    }


def uses(grant: Grant, r: RequestRecord) -> bool:
    group, resource, verb, scope, names = grant
    where = r.namespace == "" if scope == "*" else r.namespace == scope
    named = not names or r.name in names
    return (r.group, r.resource, r.verb) == (group, resource, verb) and where and named and r.code != 403


def unused(granted: set[Grant], requests: list[RequestRecord]) -> list[Grant]:
    return sorted(g for g in granted if not any(uses(g, r) for r in requests))


def show(grant: Grant) -> str:
    group, resource, verb, scope, names = grant
    where = "cluster-wide" if scope == "*" else f"in {scope}"
    named = f" (resourceNames {list(names)})" if names else ""
    return f"{group or 'core'} {resource} {verb} {where}{named}"


# -- the Argo executor ----------------------------------------------------------------------------


def gpu_pod(name: str, gpus: int) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {
            "containers": [{"name": "v", "image": "v", "resources": {"limits": {"nvidia.com/gpu": gpus}}}]
        },
    }


class ArgoPart:
    def __init__(self, cluster: FakeCluster, clock: FakeClock, events: EventRecorder) -> None:
        self.cluster, self.clock, self.events = cluster, clock, events
        self.store = MemoryStore()
        self.sim = ArgoSim(cluster, clock.now, NS)
        self.h = LoopHarness(
            nodes=NODES,
            layout=LAYOUT,
            clock=clock,
            store=self.store,
            executor=self.executor(),
            retry=RetryPolicy(5.0, 5.0),
        )
        self.h.recover()
        settling(self.sim, lambda: self.h.executor)

    def executor(self) -> ArgoExecutor:
        return ArgoExecutor(
            self.cluster.api_client(SA_TOKEN),
            SETTINGS,
            argo_workflows(self.store, SETTINGS),
            nodes={n.name: len(n.gpus) for n in NODES},
            events=self.events,
            watch_backoff_s=(0.05, 0.5),
        )

    def run(self, until: Callable[[], bool], limit: int = 200) -> None:
        drive(self.sim, self.h, until, limit)

    def attempts(self, job: str) -> list[Any]:
        return list(self.h.store.job_detail(job).attempts)

    def state(self, job: str) -> str:
        return self.h.store.job_detail(job).job.state.value

    def running(self, job: str) -> bool:
        attempts = self.attempts(job)
        return bool(attempts) and attempts[-1].state == AttemptState.RUNNING


def read_log_through_the_api(argo: ArgoPart, job: str, step: str, handle: str) -> None:
    """`lowtide logs JOB STEP`: lowtide's API reads the step's log from its pod (pods/log get,
    then pods get: the uid check of `adapters.argo.pod_logs`)."""
    pod = handle.split("/")[1]
    argo.cluster.set_pod_log(NS, pod, "epoch 1\n")
    ctx = ApiContext(
        store=argo.store,  # type: ignore[arg-type]  # the log endpoint's reads only
        clock=argo.clock,
        nodes=NODES,
        layout=LAYOUT,
        auth_enabled=False,
        logs=PodLogReader(argo.cluster.api_client(SA_TOKEN)),
    )
    answer = TestClient(create_app(ctx)).get(f"/v1/jobs/{job}/steps/{step}/logs")
    assert (answer.status_code, answer.text) == (200, "epoch 1\n")


def argo_scenarios(argo: ArgoPart) -> None:
    # Deferred by another namespace's pod on the node (the fit check), tick after tick: one
    # AdmissionDeferred Event and its series.
    argo.cluster.create("pods", SERVING, gpu_pod("other-0", 3))
    argo.cluster.bind_pod(SERVING, "other-0", "n1")
    sft = argo.h.submit(
        {
            "name": "sft",
            "steps": [
                {"name": "prep", "command": ["prep"], "gpus": 2},
                {"name": "train", "command": ["train"], "gpus": 2, "depends": ["prep"]},
            ],
        }
    )
    argo.sim.script(sft, "train", Script(run_s=60))
    for _ in range(20):
        argo.sim.step()
        argo.h.tick()
    assert not argo.running(sft)  # deferred: not the step's failure, tried again
    assert argo.events.flush(WAIT_S)
    argo.cluster.delete("pods", SERVING, "other-0")
    argo.cluster.finish_pod_deletion(SERVING, "other-0")
    # Admitted (label, taint, the step token's Secret created, then patched for train). The
    # control plane restarts while train runs: its attempt adopted by its pod (the handle names
    # it), nothing reaped.
    argo.run(lambda: argo.running(sft) and argo.attempts(sft)[-1].step_name == "train")
    train = argo.attempts(sft)[-1]
    assert "/@" not in str(train.handle)  # a pod's name and uid, recorded with its start
    read_log_through_the_api(argo, sft, "train", train.handle)
    argo.h.executor.close()
    argo.h.executor = argo.executor()
    report = argo.h.restart()
    assert report.adopted == (train.id,) and report.lost == (), report
    argo.run(lambda: argo.state(sft) == "SUCCEEDED")
    argo.h.tick()  # end_job: the finished job's Workflow stopped

    # A running job cancelled: its pod deleted (uid precondition), its Workflow stopped.
    long = argo.h.submit({"name": "long", "steps": [{"name": "t", "command": ["t"], "gpus": 1}]})
    argo.sim.script(long, "t", Script(run_s=10_000))
    argo.run(lambda: argo.running(long))
    argo.store.request_cancel(long, by="alice", now=argo.clock.now())
    argo.run(lambda: argo.state(long) == "CANCELLED")
    argo.h.tick()

    # Retried: a new Workflow generation, which runs the step again.
    now = argo.clock.now()
    argo.store.retry_job(long, by="alice", now=now)
    argo.sim.script(f"{long}-r{math.floor(now * 1000)}", "t", Script(run_s=30))
    argo.run(lambda: argo.state(long) == "SUCCEEDED")
    argo.h.tick()
    assert argo.events.flush(WAIT_S)


# -- the Kubernetes service manager ---------------------------------------------------------------


def launch(service: str, slot: int) -> ReplicaLaunch:
    return replica_launch(slot, service=service, health_timeout_s=600.0)


class ServicePart:
    def __init__(self, cluster: FakeCluster, clock: SimClock, events: EventRecorder) -> None:
        self.cluster, self.clock, self.events = cluster, clock, events
        for t in TARGETS:  # chat's pods are app=vllm, the label the simulated EndpointSlice selects
            app = "vllm" if t.endpoint_service else t.deployment
            cluster.create("deployments", SERVING, deployment(t.deployment, app=app))
        self.sims = [
            DeploymentSim(cluster, clock, SERVING, t.deployment, service=t.endpoint_service) for t in TARGETS
        ]
        self.manager = self.make()
        self.said: list[ReplicaEvent] = []

    def make(self) -> KubernetesServiceManager:
        return KubernetesServiceManager(
            self.cluster.api_client(SA_TOKEN),
            TARGETS,
            refresh_s=0.0,
            watch_backoff_s=(0.05, 0.5),
            events=self.events,
        )

    def run(self, seconds: float) -> list[ReplicaEvent]:
        new: list[ReplicaEvent] = []
        end = self.clock.now + seconds
        while self.clock.now < end:
            self.clock.now += 1.0
            for sim in self.sims:
                sim.step()
            pods, slices = (
                self.cluster.last_write("pods", SERVING),
                self.cluster.last_write("endpointslices", SERVING),
            )
            assert self.manager.caught_up("chat", pods, slices, WAIT_S)
            new += self.manager.poll(self.clock.now)
        self.said += new
        return new

    def kinds(self, events: list[ReplicaEvent]) -> list[tuple[str, str]]:
        return sorted((e.replica_id, e.kind) for e in events)


def service_scenarios(s: ServicePart) -> None:
    s.cluster.create("horizontalpodautoscalers", SERVING, hpa("chat-hpa", "chat-vllm"))
    s.cluster.create("horizontalpodautoscalers", SERVING, hpa("embed-hpa", "embed-vllm"))
    s.cluster.create(
        "scaledobjects",
        SERVING,
        {
            "apiVersion": "keda.sh/v1alpha1",
            "kind": "ScaledObject",
            "metadata": {"name": "code-keda"},
            "spec": {"scaleTargetRef": {"name": "code-vllm"}, "minReplicaCount": 0, "maxReplicaCount": 8},
        },
    )
    # Scale up (the HPA and the ScaledObject steered), ready from EndpointSlices.
    for replica in (launch("chat", 0), launch("chat", 1), launch("code", 0)):
        s.manager.start(replica, s.clock.now)
    assert s.kinds(s.run(10)) == [("chat/0", "healthy"), ("chat/1", "healthy"), ("code/0", "healthy")]
    assert s.cluster.get("horizontalpodautoscalers", SERVING, "chat-hpa")["spec"]["maxReplicas"] == 2
    assert s.cluster.get("scaledobjects", SERVING, "code-keda")["spec"]["maxReplicaCount"] == 1
    # Park (pod-deletion-cost, scale down), a hung replica's pod deleted.
    s.manager.park("chat/1", "stop", s.clock.now)
    assert s.kinds(s.run(5)) == [("chat/1", "stopped")]
    s.manager.kill("chat/0", s.clock.now, "metrics frozen for 30s")
    assert s.kinds(s.run(1)) == [("chat/0", "failed")]
    s.manager.start(launch("chat", 0), s.clock.now)  # the loop starts it again
    assert s.kinds(s.run(8)) == [("chat/0", "healthy")]
    # A refused HPA, again and again: one Warning Event, its series patched.
    for slot in range(3):
        s.manager.start(launch("embed", slot), s.clock.now)
        s.run(3)
    assert "embed-hpa" in s.manager.problem("embed")
    s.cluster.delete("horizontalpodautoscalers", SERVING, "embed-hpa")  # its owner removed it
    s.manager.start(launch("embed", 3), s.clock.now)
    assert ("embed/3", "healthy") in s.kinds(s.run(8))
    # A restart: adopt the annotated pods, reap none.
    s.manager.close()
    s.manager = s.make()
    for replica in (launch("chat", 0), launch("code", 0), launch("embed", 3)):
        assert s.manager.adopt(replica.replica_id, replica, s.clock.now)
    assert s.manager.reap_orphans({"chat/0", "code/0", "embed/3"}) == []
    s.run(2)
    assert s.events.flush(WAIT_S)


def hpa(name: str, target: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target},
            "minReplicas": 1,
            "maxReplicas": 10,
        },
    }


# -- the Lease ------------------------------------------------------------------------------------


def lease_scenarios(cluster: FakeCluster, now: float) -> None:
    elector = KubeLeaseElector(
        client.CoordinationV1Api(cluster.api_client(SA_TOKEN)),
        namespace=RELEASE.namespace,
        name="control",
        identity="lowtide-0_1_abc",
        duration_s=10,
        renew_deadline_s=8.0,
    )
    assert elector.try_acquire_or_renew(now, datetime.fromtimestamp(now, UTC))  # get 404, create
    assert elector.try_acquire_or_renew(now + 2, datetime.fromtimestamp(now + 2, UTC))  # update


# -- the test -------------------------------------------------------------------------------------


def test_every_request_is_allowed_and_every_granted_rule_is_used() -> None:
    objects = chart_objects()
    clock, sclock = FakeClock(T0), SimClock(T0)
    cluster = FakeCluster(
        clock=lambda: datetime.fromtimestamp(max(clock.now(), sclock.now), UTC), bookmark_interval=0.05
    )
    with cluster:
        cluster.load_rbac(objects)
        cluster.add_user(SA_TOKEN, SA)
        for n in NODES:
            cluster.create("nodes", "", node_object(n.name, len(n.gpus)))
        events = EventRecorder(cluster.api_client(SA_TOKEN), instance="lowtide-0", retry_s=0.01)
        try:
            argo = ArgoPart(cluster, clock, events)
            try:
                argo_scenarios(argo)
            finally:
                argo.h.executor.close()
            sclock.now = clock.now() + 1  # the fake API server's clock: the later of the two
            services = ServicePart(cluster, sclock, events)
            try:
                service_scenarios(services)
            finally:
                services.manager.close()
            lease_scenarios(cluster, sclock.now)
        finally:
            events.close()
        requests = cluster.requests

    assert {r.user for r in requests} == {SA}  # every lowtide client is the ServiceAccount
    refused = sorted({(r.group, r.resource, r.verb, r.namespace, r.name) for r in requests if r.code == 403})
    assert refused == [], f"the chart's RBAC refused lowtide: {refused}"
    granted = grants(rbac_rules(objects))
    never = unused(granted, requests)
    assert never == [], (
        "granted to lowtide's ServiceAccount but never used (excess privilege):\n"
        + "\n".join(show(g) for g in never)
    )
