"""A simulated Argo controller and kubelet, stepped on a fake clock over a `FakeCluster`.

Role: what a cluster would do around lowtide's `ArgoExecutor`, faithful to the facts the
executor depends on (argo-workflows v4.1.2, commit f016ad89; kubernetes commit 000f2605):

Argo controller (`workflow/controller/operator.go`, `workflowpod.go`, `workflow/util/pod_name.go`)
- A Workflow gets a DAG node named after it; each DAG task whose dependencies' nodes Succeeded
  gets a `Retry` node `<wf>.<task>` (id `Workflow.NodeID`) and Pod children `<wf>.<task>(N)`.
- A child's pod is named `<wf>-<template>-<fnv32a(node name)>` (v2 names), labelled with the
  template's and `spec.podMetadata` labels (an expression template such as
  `{{=asInt(retries) + 1}}` evaluated with `retries` = N by `adapters.argo.expr`, as Argo
  substitutes the template per retry; env values too), `workflows.argoproj.io/workflow`, annotated with
  `workflows.argoproj.io/node-id`/`node-name`; its spec is the template's container, volumes
  and priority class with `podSpecPatch` merged (the admission gate, the grace period).
- Node phase follows the pod (`assessNodeStatus`): Pending (message `<Reason>: <message>` of a
  waiting container, or `Unschedulable: ...`), Running, Succeeded (outputs: exitCode, the
  `lowtide-result` parameter from the shim's result file), Failed (`main: <Reason> (exit code
  N)`, or the pod's own status message, e.g. an eviction). A started, not pending node whose
  pod is missing gets `Error`/`pod deleted` once more than 10 s have passed since its
  `startedAt` (`podReconciliation`, RECENTLY_STARTED_POD_DURATION); a pending one gets its pod
  made again.
- A finished child that did not succeed: the template's `retryStrategy.expression` is evaluated
  (`adapters.argo.expr.evaluate_retry_expression`, scope as `buildRetryStrategyLocalScope`:
  `retries` = index of the last child, `lastRetry.exitCode` ("-1" when none), `.status`,
  `.duration`, `.message`); true → child N + 1, false → the Retry node and the Workflow fail.
- `spec.shutdown: Stop` (exec_control.go `applyExecutionControl`, pod/queue.go): a pending pod
  is deleted, a running one gets SIGTERM (its script's `on_term`; SIGKILL after the pod's
  grace), and the node is marked Failed at once, `workflow shutdown with strategy:  Stop`;
  nothing new starts, the Retry node and the Workflow end Failed "Stopped with strategy 'Stop'".

Kubelet and scheduler (kubernetes pkg/kubelet, pkg/registry/core/pod)
- A pod without gates is bound to its `nodeSelector` `kubernetes.io/hostname` (or `cpu-0`),
  then runs: Running at once, or waiting with an image error when the script says so; or the
  scheduler refuses it (PodScheduled False/`Unschedulable` with the script's message).
- It exits as scripted (`Script`): after `run_s` with `exit_code` (137 `OOMKilled` when `oom`);
  the shim writes the result marker exactly when it exits 0 on its own.
- A graceful delete is SIGTERM: the step checkpoints and the shim exits 75 after `term_s`
  (`on_term="checkpoint"`), or exits 0 without the marker (`"exit0"`, the hazard), or ignores
  it and is killed at the deletion deadline (`"ignore"`, exit 137). The container's terminal
  status is written first and the pod removed at the next step (the controller sees the exit),
  unless `race_delete`: then the pod is gone before the controller looks ("pod deleted").

- Secret volumes are read once, when the container starts (`secret_files`).

Not modelled: init/wait containers (their failures), task results, the `completed` label,
podGC, workflow-level retries, onExit handlers, parallelism, a real scheduler's resource fit
(a pod is bound where its nodeSelector says), image pull progress, node failures.
Neighbours: `k8sfake.FakeCluster` (hooks), `tests/integration/test_argo_executor.py`.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from k8sfake import FakeCluster
from lowtide.adapters.argo.expr import evaluate_retry_expression, evaluate_template_expression
from lowtide.adapters.argo.pods import HOSTNAME_LABEL, argo_node_id, argo_pod_name
from lowtide.adapters.argo.workflow import LABEL_JOB, RESULT_COMPLETED, RESULT_PARAMETER

Obj = dict[str, Any]
_TERMINAL = ("Succeeded", "Failed", "Error", "Skipped", "Omitted")
RECENTLY_STARTED_S = 10.0
STOPPED = "Stopped with strategy 'Stop'"
SHUTDOWN_NODE = "workflow shutdown with strategy:  Stop"  # sic: two spaces (exec_control.go)


@dataclass(frozen=True)
class Script:
    """How one attempt's container behaves (module docstring)."""

    run_s: float = 5.0
    exit_code: int = 0
    marker: bool = True
    oom: bool = False
    on_term: str = "checkpoint"  # "checkpoint" | "exit0" | "ignore"
    term_s: float = 1.0
    image_error: str | None = None  # e.g. "ErrImagePull": waits for its image forever
    #: The scheduler's message when no node fits the admitted pod (it stays Pending, unbound).
    unschedulable: str | None = None


@dataclass
class _Kubelet:
    running_at: float | None = None
    term_at: float | None = None


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _epoch(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


@dataclass
class ArgoSim:
    cluster: FakeCluster
    now: Callable[[], float]
    namespace: str = "lowtide"
    #: (workflow, task) -> the scripts of its retries, by index (the last one repeats).
    scripts: dict[tuple[str, str], list[Script]] = field(default_factory=dict)
    race_delete: bool = False
    #: Pod names in the order the controller created them.
    created: list[str] = field(default_factory=list)
    #: (pod name, deletionGracePeriodSeconds) of every pod the kubelet sent SIGTERM to.
    sigterms: list[tuple[str, int | None]] = field(default_factory=list)
    #: pod name -> {file path: content} of its secret volumes, read when its container started.
    secret_files: dict[str, dict[str, str]] = field(default_factory=dict)
    _kubelet: dict[str, _Kubelet] = field(default_factory=dict)
    _results: dict[str, str] = field(default_factory=dict)  # pod uid -> result file content
    _doomed: list[str] = field(default_factory=list)  # pods to remove at the next step
    _signalled: set[str] = field(default_factory=set)  # pod uids Argo sent SIGTERM (shutdown)
    #: Called at the end of each `step`: a reader's watch cache catches up with what it wrote
    #: (`argo_world.settle`), as a real control loop's next poll a second later would see it.
    settle: Callable[[], None] | None = None

    def script(self, workflow: str, task: str, *scripts: Script) -> None:
        self.scripts[(workflow, task)] = list(scripts)

    def step(self) -> None:
        """One round: the kubelet, then the controller."""
        self._kubelet_round()
        for wf in self.cluster.list("workflows", self.namespace):
            self._reconcile(wf)
        if self.settle is not None:
            self.settle()

    # -- kubelet ---------------------------------------------------------------------------

    def _script_for(self, pod: Obj) -> Script:
        meta = pod["metadata"]
        wf = meta["labels"].get("workflows.argoproj.io/workflow", "")
        node_name = meta["annotations"]["workflows.argoproj.io/node-name"]
        task, _, rest = node_name[len(wf) + 1 :].partition("(")
        index = int(rest.rstrip(")"))
        scripts = self.scripts.get((wf, task)) or [Script()]
        return scripts[min(index, len(scripts) - 1)]

    def _kubelet_round(self) -> None:
        ns, now = self.namespace, self.now()
        for name in self._doomed:
            with contextlib.suppress(Exception):  # already gone
                self.cluster.finish_pod_deletion(ns, name)
        self._doomed = []
        for pod in self.cluster.list("pods", ns, label_selector=LABEL_JOB):
            meta, spec = pod["metadata"], pod["spec"]
            name, uid = meta["name"], meta["uid"]
            state = self._kubelet.setdefault(uid, _Kubelet())
            phase = (pod.get("status") or {}).get("phase", "Pending")
            script = self._script_for(pod)
            if phase in ("Succeeded", "Failed"):
                if meta.get("deletionTimestamp"):
                    self.cluster.finish_pod_deletion(ns, name)
                continue
            deleting = meta.get("deletionTimestamp")
            if deleting or uid in self._signalled:
                if phase != "Running":
                    if deleting:
                        self.cluster.finish_pod_deletion(ns, name)
                    continue
                if state.term_at is None:
                    state.term_at = now  # SIGTERM: the kubelet's on a graceful delete, or Argo's signal
                    grace = meta.get("deletionGracePeriodSeconds") if deleting else None
                    self.sigterms.append((name, grace))
                kill_at = (
                    _epoch(deleting)
                    if deleting
                    else state.term_at + float(spec.get("terminationGracePeriodSeconds") or 30)
                )
                if script.on_term == "ignore":
                    if now >= kill_at:
                        self._terminate(pod, 137, "Error", marker=False)
                elif now >= state.term_at + script.term_s:
                    code = 0 if script.on_term == "exit0" else 75
                    self._terminate(pod, code, "Completed" if code == 0 else "Error", marker=False)
                continue
            if spec.get("schedulingGates"):
                continue
            if not spec.get("nodeName"):
                if script.unschedulable:
                    self._set_unschedulable(pod, script.unschedulable)
                    continue
                self.cluster.bind_pod(ns, name, (spec.get("nodeSelector") or {}).get(HOSTNAME_LABEL, "cpu-0"))
            if phase == "Pending":
                if script.image_error:
                    self._set_waiting(pod, script.image_error)
                    continue
                state.running_at = now
                self._mount_secrets(pod)
                self._set_running(pod)
            elif state.running_at is not None and now >= state.running_at + script.run_s:
                if script.oom:
                    self._terminate(pod, 137, "OOMKilled", marker=False)
                else:
                    code = script.exit_code
                    self._terminate(pod, code, "Completed" if code == 0 else "Error", marker=script.marker)

    def _mount_secrets(self, pod: Obj) -> None:
        """The kubelet sets up secret volumes from the Secret's data before it starts the
        container (pkg/volume/secret `SetUpAt`); an `optional` Secret or key that is missing
        gives no file. Later changes to the Secret are not modelled (the kubelet syncs them
        only periodically)."""
        mounts = {m["name"]: m["mountPath"] for m in pod["spec"]["containers"][0].get("volumeMounts") or []}
        files: dict[str, str] = {}
        for volume in pod["spec"].get("volumes") or []:
            source = volume.get("secret")
            if source is None or volume["name"] not in mounts:
                continue
            try:
                data = self.cluster.get("secrets", self.namespace, source["secretName"]).get("data") or {}
            except Exception:
                assert source.get("optional"), (
                    f"secret {source['secretName']} missing: the pod would not start"
                )
                continue
            for item in source.get("items") or [{"key": k, "path": k} for k in data]:
                if item["key"] in data:
                    text = base64.b64decode(data[item["key"]]).decode("utf-8")
                    files[f"{mounts[volume['name']]}/{item['path']}"] = text
        self.secret_files[pod["metadata"]["name"]] = files

    def _set_running(self, pod: Obj) -> None:
        now = _iso(self.now())

        def run(p: Obj) -> None:
            status = p.setdefault("status", {})
            status["phase"] = "Running"
            status["startTime"] = now
            status["containerStatuses"] = [
                {"name": "main", "ready": True, "restartCount": 0, "state": {"running": {"startedAt": now}}}
            ]

        self.cluster.modify("pods", self.namespace, pod["metadata"]["name"], run)

    def _set_unschedulable(self, pod: Obj, message: str) -> None:
        def refuse(p: Obj) -> None:
            status = p.setdefault("status", {})
            others = [c for c in status.get("conditions") or [] if c.get("type") != "PodScheduled"]
            scheduled = {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": message,
            }
            status["conditions"] = [*others, scheduled]

        self.cluster.modify("pods", self.namespace, pod["metadata"]["name"], refuse)

    def _set_waiting(self, pod: Obj, reason: str) -> None:
        image = pod["spec"]["containers"][0]["image"]

        def wait(p: Obj) -> None:
            p.setdefault("status", {})["containerStatuses"] = [
                {
                    "name": "main",
                    "ready": False,
                    "restartCount": 0,
                    "state": {"waiting": {"reason": reason, "message": f'Back-off pulling image "{image}"'}},
                }
            ]

        self.cluster.modify("pods", self.namespace, pod["metadata"]["name"], wait)

    def _terminate(self, pod: Obj, code: int, reason: str, *, marker: bool) -> None:
        meta = pod["metadata"]
        self._results[meta["uid"]] = RESULT_COMPLETED if marker and code == 0 else ""
        now = _iso(self.now())

        def end(p: Obj) -> None:
            status = p.setdefault("status", {})
            status["phase"] = "Succeeded" if code == 0 else "Failed"
            status["containerStatuses"] = [
                {
                    "name": "main",
                    "ready": False,
                    "restartCount": 0,
                    "state": {"terminated": {"exitCode": code, "reason": reason, "finishedAt": now}},
                }
            ]

        self.cluster.modify("pods", self.namespace, meta["name"], end)
        if meta.get("deletionTimestamp"):
            if self.race_delete:
                self.cluster.finish_pod_deletion(self.namespace, meta["name"])
            else:
                self._doomed.append(meta["name"])

    # -- controller -------------------------------------------------------------------------

    def _reconcile(self, wf: Obj) -> None:
        name = wf["metadata"]["name"]
        status = copy.deepcopy(wf.get("status") or {})
        if status.get("phase") in ("Succeeded", "Failed", "Error"):
            return
        now = self.now()
        nodes: dict[str, Obj] = status.setdefault("nodes", {})
        spec = wf["spec"]
        templates = {t["name"]: t for t in spec["templates"]}
        entry = templates[spec["entrypoint"]]
        if name not in nodes:
            status["phase"] = "Running"
            status["startedAt"] = _iso(now)
            nodes[name] = {
                "id": name,
                "name": name,
                "displayName": name,
                "type": "DAG",
                "templateName": entry["name"],
                "phase": "Running",
                "startedAt": _iso(now),
                "children": [],
            }
        shutdown = spec.get("shutdown")
        tasks = entry["dag"]["tasks"]
        for task in tasks:
            rname = f"{name}.{task['name']}"
            rid = argo_node_id(name, rname)
            if rid not in nodes:
                deps = [nodes.get(argo_node_id(name, f"{name}.{d}")) for d in task.get("dependencies", [])]
                if shutdown or any(d is None or d.get("phase") != "Succeeded" for d in deps):
                    continue
                nodes[rid] = {
                    "id": rid,
                    "name": rname,
                    "displayName": task["name"],
                    "type": "Retry",
                    "templateName": task["template"],
                    "phase": "Running",
                    "startedAt": _iso(now),
                    "children": [],
                }
                nodes[name]["children"].append(rid)
                self._new_child(wf, nodes, rid, 0)
            retry = nodes[rid]
            if retry["phase"] in _TERMINAL:
                continue
            child = nodes[retry["children"][-1]]
            self._sync(wf, child, templates[task["template"]], bool(shutdown))
            if child["phase"] not in _TERMINAL:
                continue
            if child["phase"] == "Succeeded":
                retry["phase"] = "Succeeded"
                retry["outputs"] = child.get("outputs")
            elif shutdown or not self._retry(templates[task["template"]], retry, child):
                retry["phase"] = child["phase"] if not shutdown else "Failed"
                retry["message"] = child.get("message", "") if not shutdown else STOPPED
                retry["finishedAt"] = _iso(now)
            else:
                self._new_child(wf, nodes, rid, len(retry["children"]))
        self._finish(name, status, nodes, tasks, bool(shutdown))
        self.cluster.modify("workflows", self.namespace, name, lambda w: w.__setitem__("status", status))

    def _finish(
        self, name: str, status: Obj, nodes: dict[str, Obj], tasks: list[Obj], shutdown: bool
    ) -> None:
        retries = [nodes.get(argo_node_id(name, f"{name}.{t['name']}")) for t in tasks]
        pods_running = any(n["type"] == "Pod" and n["phase"] not in _TERMINAL for n in nodes.values())
        if all(r is not None and r["phase"] == "Succeeded" for r in retries):
            status["phase"], nodes[name]["phase"] = "Succeeded", "Succeeded"
        elif shutdown and not pods_running:
            status["phase"], status["message"] = "Failed", STOPPED
            nodes[name]["phase"] = "Failed"
        elif not pods_running and any(r is not None and r["phase"] in ("Failed", "Error") for r in retries):
            failed = next(r for r in retries if r is not None and r["phase"] in ("Failed", "Error"))
            status["phase"], status["message"] = "Failed", failed.get("message", "")
            nodes[name]["phase"] = "Failed"
        if status.get("phase") in ("Succeeded", "Failed"):
            status["finishedAt"] = _iso(self.now())

    def _retry(self, template: Obj, retry: Obj, child: Obj) -> bool:
        expression = (template.get("retryStrategy") or {}).get("expression")
        if not expression:
            return False
        outputs = child.get("outputs") or {}
        values = {
            "retries": str(len(retry["children"]) - 1),
            "lastRetry.exitCode": str(outputs.get("exitCode", "-1")),
            "lastRetry.status": child["phase"],
            "lastRetry.duration": str(_epoch(child["finishedAt"]) - _epoch(child["startedAt"])),
            "lastRetry.message": child.get("message", ""),
        }
        return evaluate_retry_expression(expression, values)

    def _new_child(self, wf: Obj, nodes: dict[str, Obj], rid: str, index: int) -> None:
        retry = nodes[rid]
        cname = f"{retry['name']}({index})"
        cid = argo_node_id(wf["metadata"]["name"], cname)
        nodes[cid] = {
            "id": cid,
            "name": cname,
            "displayName": f"{retry['displayName']}({index})",
            "type": "Pod",
            "templateName": retry["templateName"],
            "phase": "Pending",
            "startedAt": _iso(self.now()),
            "children": [],
        }
        retry["children"].append(cid)

    def _pod_name(self, wf: Obj, child: Obj) -> str:
        return argo_pod_name(wf["metadata"]["name"], child["name"], child["templateName"])

    def _sync(self, wf: Obj, child: Obj, template: Obj, shutdown: bool) -> None:
        ns, now = self.namespace, self.now()
        pod_name = self._pod_name(wf, child)
        pods = [p for p in self.cluster.list("pods", ns) if p["metadata"]["name"] == pod_name]
        pod = pods[0] if pods else None
        if child["phase"] in _TERMINAL:
            return  # fulfilled: Argo no longer changes it
        if pod is None:
            if child["phase"] == "Pending":
                if shutdown:
                    child.update(phase="Failed", message=SHUTDOWN_NODE, finishedAt=_iso(now))
                else:
                    self._create_pod(wf, child, template)
            elif now - _epoch(child["startedAt"]) > RECENTLY_STARTED_S:
                child.update(phase="Error", message="pod deleted", finishedAt=_iso(now))
            return
        meta, status = pod["metadata"], pod.get("status") or {}
        phase = status.get("phase", "Pending")
        if shutdown and phase in ("Pending", "Running") and child["phase"] not in _TERMINAL:
            # exec_control.go applyExecutionControl + pod/queue.go terminateContainers: a pending
            # pod is deleted, a running one gets SIGTERM (SIGKILL after its grace); the node fails.
            if phase == "Pending":
                self.cluster.delete("pods", ns, pod_name, preconditions={"uid": meta["uid"]})
            else:
                self._signalled.add(meta["uid"])
            child.update(phase="Failed", message=SHUTDOWN_NODE, finishedAt=_iso(now))
            return
        if phase == "Pending":
            child["phase"], child["message"] = "Pending", self._pending_message(pod)
        elif phase == "Running":
            child["phase"] = "Running"
            child["hostNodeName"] = pod["spec"].get("nodeName")
            child.pop("message", None)
        else:
            terminated = (status.get("containerStatuses") or [{}])[0].get("state", {}).get("terminated", {})
            code = int(terminated.get("exitCode", -1))
            child["phase"] = "Succeeded" if phase == "Succeeded" else "Failed"
            child["finishedAt"] = _iso(now)
            child["outputs"] = {
                "exitCode": str(code),
                "parameters": [{"name": RESULT_PARAMETER, "value": self._results.get(meta["uid"], "")}],
            }
            if phase == "Failed":
                child["message"] = (
                    status.get("message") or f"main: {terminated.get('reason', 'Error')} (exit code {code})"
                )

    @staticmethod
    def _pending_message(pod: Obj) -> str:
        status = pod.get("status") or {}
        for cs in status.get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting")
            if waiting and waiting.get("reason"):
                return f"{waiting['reason']}: {waiting.get('message', '')}"
        for cond in status.get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("reason") == "Unschedulable":
                return f"Unschedulable: {cond.get('message', '')}"
        return ""

    def _create_pod(self, wf: Obj, child: Obj, template: Obj) -> None:
        wf_name = wf["metadata"]["name"]
        retries = str(int(child["name"].rsplit("(", 1)[1].rstrip(")")))

        def resolve(value: Any) -> Any:
            if isinstance(value, str) and value.startswith("{{="):
                return evaluate_template_expression(value, {"retries": retries})
            return value

        labels = {
            **((wf["spec"].get("podMetadata") or {}).get("labels") or {}),
            **{k: resolve(v) for k, v in ((template.get("metadata") or {}).get("labels") or {}).items()},
            "workflows.argoproj.io/workflow": wf_name,
        }
        container = copy.deepcopy(template["container"])
        for env in container.get("env") or []:
            if "value" in env:
                env["value"] = resolve(env["value"])
        spec: Obj = {
            "containers": [container],
            "volumes": copy.deepcopy(template.get("volumes") or []),
            "restartPolicy": "Never",
        }
        if template.get("priorityClassName"):
            spec["priorityClassName"] = template["priorityClassName"]
        if template.get("podSpecPatch"):
            spec.update(json.loads(template["podSpecPatch"]))
        pod: Obj = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": self._pod_name(wf, child),
                "namespace": self.namespace,
                "labels": labels,
                "annotations": {
                    "workflows.argoproj.io/node-id": child["id"],
                    "workflows.argoproj.io/node-name": child["name"],
                },
                # workflowpod.go: a controller reference to the Workflow
                "ownerReferences": [
                    {
                        "apiVersion": "argoproj.io/v1alpha1",
                        "kind": "Workflow",
                        "name": wf_name,
                        "uid": wf["metadata"]["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": spec,
        }
        self.cluster.create("pods", self.namespace, pod)
        self.created.append(pod["metadata"]["name"])

    # -- reading, for tests ----------------------------------------------------------------

    def workflow(self, name: str) -> Obj:
        return self.cluster.get("workflows", self.namespace, name)

    def retry_children(self, workflow: str, task: str) -> list[Obj]:
        """The Pod children of `<workflow>.<task>`'s Retry node, in order."""
        nodes = (self.workflow(workflow).get("status") or {}).get("nodes") or {}
        retry = nodes.get(argo_node_id(workflow, f"{workflow}.{task}"))
        return [nodes[c] for c in retry["children"]] if retry else []
