"""The chart's Kubernetes objects, built in Python: validated values in, manifest dicts out.

Role: one builder per template of `deploy/helm/lowtide/templates/` (same file names, same
objects), run in the order `helm template` prints them: template files by name, then a stable
sort by kind in Helm's install order (helm/helm @e9b85e4 `pkg/release/v1/util/manifest_sorter.go` sorts
the file paths, `kind_sorter.go` `InstallOrder` then sorts by kind, keeping file order within a
kind and putting unknown kinds such as ServiceMonitor last). `tests/unit/test_chart.py` renders
the templates with a test-only interpreter and checks that both give the same objects.

Neighbours: `deploy.chart` loads the chart, merges and validates the values and calls `build`.
Must not: read files, validate values (the caller does) or talk to a cluster.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

#: Where the control plane keeps its state (an emptyDir: the store is PostgreSQL) and its config.
STATE_DIR = "/var/lib/lowtide"
#: Where the admin token Secret is mounted (`auth.admin_token_source`).
ADMIN_TOKEN_DIR = "/etc/lowtide-admin"  # noqa: S105 (a mount path, not a token)
CONFIG_DIR = "/etc/lowtide"
#: The pod's user: any non-root uid works, the image must not need root.
RUN_AS = 10001
DASHBOARD_FILE = "dashboards/lowtide.json"
#: Helm's install order for the kinds this chart emits (kind_sorter.go `InstallOrder`, a subset
#: in the same relative order); kinds not listed sort last.
KIND_ORDER = (
    "PriorityClass",
    "PodDisruptionBudget",
    "ServiceAccount",
    "Secret",
    "ConfigMap",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "Service",
    "Deployment",
)


@dataclass(frozen=True, slots=True)
class Release:
    """What `helm install NAME -n NAMESPACE` gives the templates as `.Release`."""

    name: str
    namespace: str
    service: str = "Helm"


@dataclass(frozen=True, slots=True)
class ChartMeta:
    """`.Chart` fields the templates use (from Chart.yaml)."""

    name: str
    version: str
    app_version: str


Objects = list[dict[str, Any]]
_Builder = Callable[[Mapping[str, Any], Release, ChartMeta, Mapping[str, str]], Objects]


def selector_labels(release: Release) -> dict[str, str]:
    return {"app.kubernetes.io/name": "lowtide", "app.kubernetes.io/instance": release.name}


def labels(release: Release, chart: ChartMeta) -> dict[str, str]:
    return {
        **selector_labels(release),
        "app.kubernetes.io/version": chart.app_version,
        "app.kubernetes.io/managed-by": release.service,
        "helm.sh/chart": f"{chart.name}-{chart.version}",
    }


def _meta(name: str, release: Release, chart: ChartMeta, namespace: str | None = "") -> dict[str, Any]:
    """Object metadata; `namespace` "" means the release's, None a cluster-scoped object."""
    meta: dict[str, Any] = {"name": name}
    if namespace is not None:
        meta["namespace"] = namespace or release.namespace
    meta["labels"] = labels(release, chart)
    return meta


def store_secret_name(values: Mapping[str, Any], release: Release) -> str:
    existing: str = values["store"]["existingSecret"]
    return existing or f"{release.name}-store"


def step_service_account(values: Mapping[str, Any], release: Release) -> str | None:
    """The ServiceAccount Workflow pods run as (`argo.service_account`): the chart's own
    (`RELEASE-step` unless named), an existing one named, or None (the namespace's default)."""
    step = values["stepServiceAccount"]
    name: str = step["name"]
    if step["create"]:
        return name or f"{release.name}-step"
    return name or None


def lowtide_config(values: Mapping[str, Any], release: Release) -> dict[str, Any]:
    """The lowtide.yaml the control plane runs with (configmap.yaml)."""
    config: dict[str, Any] = {
        "state_dir": STATE_DIR,
        "artifact_root": values["artifactRoot"],
        "api": {
            "host": "0.0.0.0",  # noqa: S104 (in a pod: the Service and the probes reach it)
            "port": values["api"]["port"],
            "public_url": f"http://{release.name}.{release.namespace}.svc:{values['service']['port']}",
        },
        "executor": {"kind": "argo"},
        **(
            {"auth": {"admin_token_source": f"{ADMIN_TOKEN_DIR}/token"}}
            if values["adminToken"]["existingSecret"]
            else {}
        ),
        # Only the holder of the release's Lease acts (`adapters.k8s_lease`); the store's lease
        # and its fencing stay behind it.
        "control": {
            "lease_backend": "kubernetes",
            "kubernetes_lease": {"namespace": release.namespace, "name": f"{release.name}-control"},
        },
        "argo": {
            "namespace": values["argo"]["namespace"],
            "research_priority_class": values["priorityClasses"]["research"]["name"],
            **(
                {"service_account": step_service_account(values, release)}
                if step_service_account(values, release)
                else {}
            ),
            **copy.deepcopy(dict(values["argo"]["settings"])),
        },
    }
    if values["services"]:
        config["services"] = copy.deepcopy(values["services"])
    config.update(copy.deepcopy(dict(values["extraConfig"])))
    return config


def _configmap(
    values: Mapping[str, Any], release: Release, chart: ChartMeta, _f: Mapping[str, str]
) -> Objects:
    text = yaml.safe_dump(lowtide_config(values, release), sort_keys=False, allow_unicode=True)
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _meta(f"{release.name}-config", release, chart),
            "data": {"lowtide.yaml": text},
        }
    ]


def _dashboard(
    values: Mapping[str, Any], release: Release, chart: ChartMeta, files: Mapping[str, str]
) -> Objects:
    if not values["grafanaDashboard"]["enabled"]:
        return []
    meta = _meta(f"{release.name}-dashboard", release, chart)
    meta["labels"]["grafana_dashboard"] = "1"
    # A YAML block scalar (`|`) keeps the text and ends it with exactly one newline.
    text = files[DASHBOARD_FILE].rstrip("\n") + "\n"
    return [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"lowtide.json": text}}]


def _deployment(
    values: Mapping[str, Any], release: Release, chart: ChartMeta, _f: Mapping[str, str]
) -> Objects:
    image = values["image"]
    container: dict[str, Any] = {
        "name": "lowtide",
        "image": f"{image['repository']}:{image['tag']}",
        "imagePullPolicy": image["pullPolicy"],
        "command": ["lowtide", "up", "--config", f"{CONFIG_DIR}/lowtide.yaml"],
        "env": [
            {
                "name": "LOWTIDE_STORE_URL",
                "valueFrom": {
                    "secretKeyRef": {
                        "name": store_secret_name(values, release),
                        "key": values["store"]["key"],
                    }
                },
            }
        ],
        "ports": [{"name": "http", "containerPort": values["api"]["port"], "protocol": "TCP"}],
        "readinessProbe": {
            "httpGet": {"path": "/healthz", "port": "http"},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "securityContext": {
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if values["resources"]:
        container["resources"] = copy.deepcopy(values["resources"])
    container["volumeMounts"] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "state", "mountPath": STATE_DIR},
        {"name": "tmp", "mountPath": "/tmp"},  # noqa: S108 (an emptyDir: the root filesystem is read-only)
    ]
    admin_secret = values["adminToken"]["existingSecret"]
    if admin_secret:  # every pod registers the same admin token instead of minting its own
        container["volumeMounts"].append(
            {"name": "admin-token", "mountPath": ADMIN_TOKEN_DIR, "readOnly": True}
        )
    pod: dict[str, Any] = {
        "serviceAccountName": release.name,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS,
            "runAsGroup": RUN_AS,
            "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [
            {"name": "config", "configMap": {"name": f"{release.name}-config"}},
            {"name": "state", "emptyDir": {}},
            {"name": "tmp", "emptyDir": {}},
        ],
    }
    if admin_secret:
        pod["volumes"].append(
            {
                "name": "admin-token",
                "secret": {
                    "secretName": admin_secret,
                    "items": [{"key": values["adminToken"]["key"], "path": "token"}],
                },
            }
        )
    for key in ("nodeSelector", "tolerations", "affinity"):
        if values[key]:
            pod[key] = copy.deepcopy(values[key])
    return [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": _meta(release.name, release, chart),
            "spec": {
                "replicas": values["replicas"],
                "selector": {"matchLabels": selector_labels(release)},
                "template": {"metadata": {"labels": labels(release, chart)}, "spec": pod},
            },
        }
    ]


def _pdb(values: Mapping[str, Any], release: Release, chart: ChartMeta, _f: Mapping[str, str]) -> Objects:
    return [
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": _meta(release.name, release, chart),
            "spec": {
                "minAvailable": values["podDisruptionBudget"]["minAvailable"],
                "selector": {"matchLabels": selector_labels(release)},
            },
        }
    ]


def _priority_classes(
    values: Mapping[str, Any], release: Release, chart: ChartMeta, _f: Mapping[str, str]
) -> Objects:
    classes = values["priorityClasses"]
    if not classes["create"]:
        return []
    research, inference = classes["research"], classes["inference"]
    return [
        {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": _meta(research["name"], release, chart, namespace=None),
            "value": research["value"],
            "preemptionPolicy": "Never",
            "globalDefault": False,
            "description": "lowtide research steps: admitted by lowtide, never preempt other pods.",
        },
        {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": _meta(inference["name"], release, chart, namespace=None),
            "value": inference["value"],
            "preemptionPolicy": "PreemptLowerPriority",
            "globalDefault": False,
            "description": "Inference serving pods scaled by lowtide: above research steps.",
        },
    ]


#: The Role in the Argo namespace: (apiGroup, resource, verbs) exactly as the chart grants them.
#: Workflows: created, read, listed (recovery), patched (`spec.shutdown: Stop`); never watched or
#: deleted. Pods: read (adoption), listed and watched (`adapters.k8s_watch`), patched (admission),
#: deleted (notice, reaping). pods/log: a step's log read for the API (`adapters.argo.pod_logs`).
WORKLOAD_RULES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("argoproj.io", "workflows", ("create", "get", "list", "patch")),
    ("", "pods", ("get", "list", "watch", "patch", "delete")),
    ("", "pods/log", ("get",)),
    # Kubernetes Events about its pods (`adapters.k8s_events`, events.k8s.io/v1): created, and a
    # repeated one's series patched.
    ("events.k8s.io", "events", ("create", "patch")),
    # The step tokens' Secrets, one per job (`adapters.argo.step_tokens`): created, or one key
    # patched. Not restricted by name: their names are per job, and RBAC cannot limit `create`
    # by resourceNames (the name is not known when the request is authorized). No get/list.
    ("", "secrets", ("create", "patch")),
)
#: The Role of the ServiceAccount Workflow pods run as: Argo's executor reports its pod's
#: outputs as WorkflowTaskResults (Argo v3.4+, argo-workflows docs/workflow-rbac.md).
STEP_RULES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("argoproj.io", "workflowtaskresults", ("create", "patch")),
)


def service_rules(service: Mapping[str, Any]) -> list[dict[str, Any]]:
    """What the Kubernetes service manager (`adapters.k8s_services`) needs in a service's own
    namespace, for its settings: the Deployment's scale (by name), its pods (list and watch:
    `adapters.k8s_watch`; annotate, delete a hung one), the autoscalers on it (list);
    EndpointSlices (list, watch) only with `endpoint_service`; HPA update and ScaledObject
    patch only with `on_autoscaler: steer`; Kubernetes Events there (`adapters.k8s_events`:
    create, and patch a repeated one's series)."""
    k8s = service["kubernetes"]
    rules = [
        {**_rule("apps", "deployments/scale", ("get", "update")), "resourceNames": [k8s["deployment"]]},
        _rule("", "pods", ("list", "watch", "patch", "delete")),
        _rule("autoscaling", "horizontalpodautoscalers", ("list",)),
        _rule("keda.sh", "scaledobjects", ("list",)),
        _rule("events.k8s.io", "events", ("create", "patch")),
    ]
    if "endpoint_service" in k8s:
        rules.append(_rule("discovery.k8s.io", "endpointslices", ("list", "watch")))
    if k8s.get("on_autoscaler") == "steer":
        rules.append(_rule("autoscaling", "horizontalpodautoscalers", ("update",)))
        rules.append(_rule("keda.sh", "scaledobjects", ("patch",)))
    return rules


#: Cluster-scoped: the nodes lowtide labels and taints (read-modify-write: get, patch; never listed
#: or watched), and pods list: before admitting a research pod, the GPUs every pod bound to its
#: node holds, in any namespace (`adapters.k8s_nodes`).
NODE_RULES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("", "nodes", ("get", "patch")),
    ("", "pods", ("list",)),
)


def _rule(group: str, resource: str, verbs: tuple[str, ...]) -> dict[str, Any]:
    return {"apiGroups": [group], "resources": [resource], "verbs": list(verbs)}


def _binding(
    kind: str, role_kind: str, name: str, release: Release, chart: ChartMeta, namespace: str | None
) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": kind,
        "metadata": _meta(name, release, chart, namespace=namespace),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind, "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": release.name, "namespace": release.namespace}],
    }


def _rbac(values: Mapping[str, Any], release: Release, chart: ChartMeta, _f: Mapping[str, str]) -> Objects:
    argo_ns: str = values["argo"]["namespace"]
    workloads, control = f"{release.name}-workloads", f"{release.name}-control"
    nodes = f"{release.namespace}-{release.name}-nodes"
    rbac = "rbac.authorization.k8s.io/v1"
    return [
        {
            "apiVersion": rbac,
            "kind": "Role",
            "metadata": _meta(workloads, release, chart, namespace=argo_ns),
            "rules": [_rule(*r) for r in WORKLOAD_RULES],
        },
        _binding("RoleBinding", "Role", workloads, release, chart, argo_ns),
        {
            "apiVersion": rbac,
            "kind": "Role",
            "metadata": _meta(control, release, chart),
            # The HA Lease only. The store Secret reaches the pod through a secretKeyRef and the
            # admin token's as a mounted file: the kubelet reads them, not lowtide.
            "rules": [_rule("coordination.k8s.io", "leases", ("get", "create", "update"))],
        },
        _binding("RoleBinding", "Role", control, release, chart, ""),
        {
            "apiVersion": rbac,
            "kind": "ClusterRole",
            "metadata": _meta(nodes, release, chart, namespace=None),
            "rules": [_rule(*r) for r in NODE_RULES],
        },
        _binding("ClusterRoleBinding", "ClusterRole", nodes, release, chart, None),
    ]


def _service_rbac(
    values: Mapping[str, Any], release: Release, chart: ChartMeta, _f: Mapping[str, str]
) -> Objects:
    """A Role and RoleBinding per service, in the service's namespace (service-rbac.yaml)."""
    objects: Objects = []
    for service in values["services"]:
        name, namespace = f"{release.name}-service-{service['name']}", service["kubernetes"]["namespace"]
        objects.append(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": _meta(name, release, chart, namespace=namespace),
                "rules": service_rules(service),
            }
        )
        objects.append(_binding("RoleBinding", "Role", name, release, chart, namespace))
    return objects


def _step_service_account(
    values: Mapping[str, Any], release: Release, chart: ChartMeta, _f: Mapping[str, str]
) -> Objects:
    """The ServiceAccount Workflow pods run as, its Role and RoleBinding (step-serviceaccount.yaml)."""
    name = step_service_account(values, release)
    if not values["stepServiceAccount"]["create"] or name is None:
        return []
    argo_ns: str = values["argo"]["namespace"]
    binding = _binding("RoleBinding", "Role", name, release, chart, argo_ns)
    binding["subjects"] = [{"kind": "ServiceAccount", "name": name, "namespace": argo_ns}]
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": _meta(name, release, chart, namespace=argo_ns),
            # Argo's executor (the wait container) authenticates with this token.
            "automountServiceAccountToken": True,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _meta(name, release, chart, namespace=argo_ns),
            "rules": [_rule(*r) for r in STEP_RULES],
        },
        binding,
    ]


def _secret(values: Mapping[str, Any], release: Release, chart: ChartMeta, _f: Mapping[str, str]) -> Objects:
    store = values["store"]
    if store["existingSecret"]:
        return []
    return [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": _meta(f"{release.name}-store", release, chart),
            "type": "Opaque",
            "stringData": {store["key"]: store["url"]},
        }
    ]


def _service(values: Mapping[str, Any], release: Release, chart: ChartMeta, _f: Mapping[str, str]) -> Objects:
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(release.name, release, chart),
            "spec": {
                "type": values["service"]["type"],
                "selector": selector_labels(release),
                "ports": [
                    {
                        "name": "http",
                        "port": values["service"]["port"],
                        "targetPort": "http",
                        "protocol": "TCP",
                    }
                ],
            },
        }
    ]


def _service_account(
    values: Mapping[str, Any], release: Release, chart: ChartMeta, _f: Mapping[str, str]
) -> Objects:
    return [{"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(release.name, release, chart)}]


def _service_monitor(
    values: Mapping[str, Any], release: Release, chart: ChartMeta, _f: Mapping[str, str]
) -> Objects:
    monitor = values["serviceMonitor"]
    if not monitor["enabled"]:
        return []
    meta = _meta(release.name, release, chart)
    meta["labels"].update(monitor["labels"])
    endpoint = {"port": "http", "path": "/metrics", "interval": monitor["interval"], "honorLabels": True}
    return [
        {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "ServiceMonitor",
            "metadata": meta,
            "spec": {"selector": {"matchLabels": selector_labels(release)}, "endpoints": [endpoint]},
        }
    ]


#: One builder per template file, by file name (the order Helm reads them in).
TEMPLATES: dict[str, _Builder] = {
    "configmap.yaml": _configmap,
    "dashboard.yaml": _dashboard,
    "deployment.yaml": _deployment,
    "pdb.yaml": _pdb,
    "priorityclasses.yaml": _priority_classes,
    "rbac.yaml": _rbac,
    "secret.yaml": _secret,
    "service-rbac.yaml": _service_rbac,
    "service.yaml": _service,
    "serviceaccount.yaml": _service_account,
    "servicemonitor.yaml": _service_monitor,
    "step-serviceaccount.yaml": _step_service_account,
}


def kind_rank(kind: str) -> int:
    return KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER)


def build(values: Mapping[str, Any], release: Release, chart: ChartMeta, files: Mapping[str, str]) -> Objects:
    """Every object of the chart for these (merged, validated) values, in `helm template` order."""
    objects: Objects = []
    for name in sorted(TEMPLATES):
        objects.extend(TEMPLATES[name](values, release, chart, files))
    # Unknown kinds sort last, by kind name, as in Helm's lessByKind; a stable sort keeps file order.
    return sorted(objects, key=lambda o: (kind_rank(o["kind"]), "" if o["kind"] in KIND_ORDER else o["kind"]))
