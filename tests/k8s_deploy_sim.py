"""A tiny simulated Deployment/ReplicaSet controller, kubelet and EndpointSlice controller over the
fake API server's hooks (`k8sfake.FakeCluster`), stepped on the test's fake clock.

What it reproduces (kubernetes pkg/controller/replicaset/replica_set.go `manageReplicas` and
pkg/controller/controller_utils.go `ActivePodsWithRanks.Less`, v1.22+): active pods (no
deletionTimestamp) are kept equal to the Deployment's `spec.replicas`; surplus pods are deleted
in rank order: unscheduled first, then Pending < Unknown < Running, not Ready < Ready, lower
`controller.kubernetes.io/pod-deletion-cost` (an int32, 0 when absent or invalid) first, then the
newest. Deletions are graceful (30 s, the pod default): the kubelet part finishes them
`terminate_after` seconds later. New pods are bound to a node at the next step and become
Running and Ready (with a pod IP) `ready_after` seconds after creation, unless a failure is
scripted (`image_error`, `crash`, `unschedulable`). An EndpointSlice for `service` lists the pods
with an IP, `conditions.ready` as the pod's readiness. A deleted Deployment's pods are deleted
(the garbage collector's foreground-less cascade, at once).
Not reproduced: surge/rollouts, several ReplicaSets, minReadySeconds, the informer lag.
Must NOT: call the API over HTTP (hooks only: no RBAC, no faults apply to it).
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from k8sfake import FakeCluster
from lowtide.control.inference_ports import ReplicaLaunch

Obj = dict[str, Any]
POD_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


class SimClock:
    """A datetime clock for the fake API server, moved with the loop's float clock."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> datetime:
        return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(seconds=self.now)


def deployment(name: str, replicas: int = 0, app: str = "vllm") -> Obj:
    labels = {"app": app}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [
                        {
                            "name": "vllm",
                            "image": "vllm/vllm-openai:v0.11.0",
                            "ports": [{"containerPort": 8000}],
                            "resources": {"limits": {"nvidia.com/gpu": 1}},
                        }
                    ]
                },
            },
        },
    }


def _cost(pod: Obj) -> int:
    value = ((pod.get("metadata") or {}).get("annotations") or {}).get(POD_DELETION_COST)
    if value is None or not value or not (value[0] == "-" or value == "0" or value[0] in "123456789"):
        return 0
    try:
        n = int(value)
    except ValueError:
        return 0
    return n if -(2**31) <= n < 2**31 else 0


def _ready(pod: Obj) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions", [])
    )


def _rank(pod: Obj) -> tuple[int, int, int, int, str]:
    """Smaller goes first (ActivePodsWithRanks.Less, without the node-colocation rank)."""
    phase = {"Pending": 0, "Unknown": 1, "Running": 2}.get((pod.get("status") or {}).get("phase", ""), 0)
    unassigned = 0 if not (pod.get("spec") or {}).get("nodeName") else 1
    created = pod["metadata"]["creationTimestamp"]
    # newest first: invert the order of creation (then the name) by sorting on the negated key
    return (unassigned, phase, int(_ready(pod)), _cost(pod), _inverse(created + pod["metadata"]["name"]))


def _inverse(text: str) -> str:
    return "".join(chr(0x10FFFF - ord(c)) for c in text)


@dataclass
class DeploymentSim:
    cluster: FakeCluster
    clock: SimClock
    namespace: str
    name: str
    service: str | None = None
    nodes: tuple[str, ...] = ("gpu-a", "gpu-b", "gpu-c")
    ready_after: float = 5.0
    terminate_after: float = 2.0
    image_error: bool = False
    crash: bool = False
    unschedulable: bool = False
    deletions: list[str] = field(default_factory=list)  # pods the "ReplicaSet" deleted, in order
    _born: dict[str, float] = field(default_factory=dict)
    _dying: dict[str, float] = field(default_factory=dict)
    _ips: itertools.count[int] = field(default_factory=lambda: itertools.count(10))
    _names: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def step(self) -> None:
        now = self.clock.now
        self._finish_deletions(now)
        try:
            dep = self.cluster.get("deployments", self.namespace, self.name)
        except Exception:
            dep = None
        labels = {"app": "vllm"} if dep is None else dep["spec"]["selector"]["matchLabels"]
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        pods = self.cluster.list("pods", self.namespace, label_selector=selector)
        if dep is None:
            for p in pods:
                if not p["metadata"].get("deletionTimestamp"):
                    self._delete(p, now)
            self._slices()
            return
        active = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        want = int(dep["spec"].get("replicas") or 0)
        if len(active) < want:
            for _ in range(want - len(active)):
                self._create(dep, now)
        elif len(active) > want:
            for p in sorted(active, key=_rank)[: len(active) - want]:
                self.deletions.append(p["metadata"]["name"])
                self._delete(p, now)
        for p in self.cluster.list("pods", self.namespace, label_selector=selector):
            self._kubelet(p, now)
        self._slices()
        self._status(dep)

    # -- pieces -----------------------------------------------------------------------------------

    def _create(self, dep: Obj, now: float) -> None:
        template = dep["spec"]["template"]
        name = f"{self.name}-{next(self._names):04d}"
        self.cluster.create(
            "pods",
            self.namespace,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "labels": dict(template["metadata"]["labels"])},
                "spec": dict(template["spec"]),
            },
        )
        self._born[name] = now

    def _delete(self, pod: Obj, now: float) -> None:
        name = pod["metadata"]["name"]
        gone = self.cluster.delete("pods", self.namespace, name, gracePeriodSeconds=30)
        if gone["metadata"].get("deletionTimestamp"):
            self._dying[name] = now

    def _finish_deletions(self, now: float) -> None:
        for name, since in list(self._dying.items()):
            if now - since >= self.terminate_after:
                with contextlib.suppress(Exception):  # gone at once: it was never bound
                    self.cluster.finish_pod_deletion(self.namespace, name)
                del self._dying[name]

    def _kubelet(self, pod: Obj, now: float) -> None:
        meta = pod["metadata"]
        name = meta["name"]
        if meta.get("deletionTimestamp"):
            return
        spec = pod.get("spec") or {}
        if not spec.get("nodeName"):
            if self.unschedulable:
                if not any(
                    c.get("reason") == "Unschedulable"
                    for c in (pod.get("status") or {}).get("conditions", [])
                ):
                    self.cluster.modify("pods", self.namespace, name, _unschedulable)
                return
            self.cluster.bind_pod(
                self.namespace, name, self.nodes[int(name.rsplit("-", 1)[1]) % len(self.nodes)]
            )
            return
        born = self._born.get(name, now)
        status = pod.get("status") or {}
        if self.image_error and status.get("phase") == "Pending":
            if not status.get("containerStatuses"):
                self.cluster.modify(
                    "pods", self.namespace, name, _waiting("ImagePullBackOff", "Back-off pulling image")
                )
            return
        if self.crash and status.get("phase") != "Failed":
            if not status.get("containerStatuses"):
                self.cluster.modify(
                    "pods", self.namespace, name, _waiting("CrashLoopBackOff", "back-off 10s")
                )
            return
        if now - born >= self.ready_after and not _ready(pod):
            ip = f"10.1.0.{next(self._ips)}"
            self.cluster.modify("pods", self.namespace, name, lambda p: _run(p, ip))

    def _slices(self) -> None:
        if self.service is None:
            return
        pods = self.cluster.list("pods", self.namespace, label_selector="app=vllm")
        endpoints = [
            {
                "addresses": [p["status"]["podIP"]],
                "conditions": {
                    "ready": _ready(p) and not p["metadata"].get("deletionTimestamp"),
                    "terminating": bool(p["metadata"].get("deletionTimestamp")),
                },
                "targetRef": {"kind": "Pod", "name": p["metadata"]["name"], "namespace": self.namespace},
            }
            for p in pods
            if (p.get("status") or {}).get("podIP")
        ]
        name = f"{self.service}-sim"
        body = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": name, "labels": {"kubernetes.io/service-name": self.service}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
            "endpoints": endpoints,
        }
        try:
            current = self.cluster.get("endpointslices", self.namespace, name)
        except Exception:
            self.cluster.create("endpointslices", self.namespace, body)
            return
        if current.get("endpoints") != endpoints:

            def change(s: Obj) -> None:
                s["endpoints"] = endpoints

            self.cluster.modify("endpointslices", self.namespace, name, change)

    def _status(self, dep: Obj) -> None:
        pods = self.cluster.list("pods", self.namespace, label_selector="app=vllm")
        active = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        ready = sum(1 for p in active if _ready(p))
        status = {"replicas": len(active), "readyReplicas": ready, "availableReplicas": ready}
        if (dep.get("status") or {}) != {**(dep.get("status") or {}), **status}:

            def change(d: Obj) -> None:
                d.setdefault("status", {}).update(status)

            self.cluster.modify("deployments", self.namespace, self.name, change)


def _unschedulable(p: Obj) -> None:
    conditions = [
        c for c in p.setdefault("status", {}).get("conditions", []) if c.get("type") != "PodScheduled"
    ]
    p["status"]["conditions"] = [
        *conditions,
        {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
        },
    ]


def _waiting(reason: str, message: str) -> Any:
    def change(p: Obj) -> None:
        p.setdefault("status", {})["containerStatuses"] = [
            {
                "name": "vllm",
                "ready": False,
                "restartCount": 1 if reason == "CrashLoopBackOff" else 0,
                "image": "vllm/vllm-openai:v0.11.0",
                "imageID": "",
                "state": {"waiting": {"reason": reason, "message": message}},
            }
        ]

    return change


def _run(p: Obj, ip: str) -> None:
    status = p.setdefault("status", {})
    status["phase"] = "Running"
    status["podIP"] = ip
    status["podIPs"] = [{"ip": ip}]
    conditions = [
        c for c in status.get("conditions", []) if c.get("type") not in ("Ready", "ContainersReady")
    ]
    status["conditions"] = [
        *conditions,
        {"type": "ContainersReady", "status": "True"},
        {"type": "Ready", "status": "True"},
    ]
    status["containerStatuses"] = [
        {
            "name": "vllm",
            "ready": True,
            "restartCount": 0,
            "image": "vllm/vllm-openai:v0.11.0",
            "imageID": "",
            "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}},
        }
    ]


def replica_launch(slot: int, *, service: str = "chat", health_timeout_s: float = 120.0) -> ReplicaLaunch:
    """What the control loop asks the service manager to start for `service/slot` (the command,
    port and GPUs are the Deployment's in Kubernetes: only the id, service and timeout matter)."""
    return ReplicaLaunch(
        replica_id=f"{service}/{slot}",
        service=service,
        model="m",
        node="gpu-a",
        gpus=(slot,),
        port=8000,
        command=("vllm", "serve"),
        env={},
        work_dir="",
        log_path="",
        health_timeout_s=health_timeout_s,
    )
