"""The Helm chart (deploy/helm/lowtide), its Python renderer and `lowtide k8s render`.

No Helm binary and no cluster here, so this checks what can be checked without them
(deploy/helm/lowtide/README.md says what only `helm template` and a real cluster prove):
- the templates, rendered by the test-only interpreter of the chart's template subset
  (`tests/chart_template.py`), give exactly the renderer's objects, for several values;
- every object validates with kubernetes-validate in strict mode (unknown fields rejected) against
  Kubernetes 1.30's (the chart's minimum) and 1.33's schemas; the ServiceMonitor, a CRD kind it
  does not ship, against a small schema of the fields the chart uses, taken from
  prometheus-operator v0.93.0's CRD;
- values.schema.json rejects bad values with an error naming the field;
- the RBAC is exactly the issue's list (no wildcard, no pods/exec, reads only its own Secret), per
  service in its namespace, and the steps' ServiceAccount has only Argo's workflowtaskresults;
- the Grafana dashboard loads and queries only metrics (and labels) that `api/metrics.py` exposes.
"""

from __future__ import annotations

import ast
import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError
from typer.testing import CliRunner

import lowtide
from chart_template import OutsideSubset, Renderer, go_quote, helm_template, parse, to_yaml
from lowtide.cli.main import app
from lowtide.config import Settings
from lowtide.deploy.chart import (
    ChartNotFound,
    GrantedRule,
    Release,
    ValuesInvalid,
    chart_values,
    coalesce,
    load_chart,
    merge_maps,
    parse_set,
    rbac_rules,
    render,
    validate_values,
)

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "deploy" / "helm" / "lowtide"
#: The chart's minimum (Chart.yaml kubeVersion: scheduling gates are GA from 1.30) and a current one.
K8S_VERSIONS = ("1.30.0", "1.33.0")
K8S_VERSION = K8S_VERSIONS[-1]
PG = "postgresql+psycopg://lowtide:secret@postgres.db.svc:5432/lowtide"
REQUIRED = {"store": {"url": PG}, "artifactRoot": "s3://lowtide-artifacts/prod"}

#: Values scenarios (overlay over the chart's defaults, release name, namespace).
SCENARIOS: dict[str, tuple[dict[str, Any], str, str]] = {
    "defaults": (REQUIRED, "lowtide", "lowtide"),
    "monitoring": (
        {
            **REQUIRED,
            "serviceMonitor": {
                "enabled": True,
                "interval": "15s",
                "labels": {"release": "kube-prometheus-stack"},
            },
            "grafanaDashboard": {"enabled": True},
        },
        "lowtide",
        "monitoring-test",
    ),
    "existing-secret": (
        {
            "store": {"url": "", "existingSecret": "pg-credentials", "key": "uri"},
            "artifactRoot": "gs://bucket/lt",
            "priorityClasses": {"create": False},
        },
        "lowtide",
        "lowtide",
    ),
    # YAML 1.1 reads an unquoted `on`/`no` as booleans: names like these catch a template that
    # forgets to quote; 2000000 catches a number printed without toYaml (Go prints 2e+06).
    "custom-names": (
        {
            **REQUIRED,
            "image": {
                "repository": "registry.example.com:5000/ml/lowtide",
                "tag": "0.1.0-rc1",
                "pullPolicy": "Always",
            },
            "replicas": 3,
            "podDisruptionBudget": {"minAvailable": 2},
            "api": {"port": 9000},
            "service": {"type": "NodePort", "port": 80},
            "argo": {"namespace": "no", "settings": {"grace_margin_seconds": 30}},
            "stepServiceAccount": {"create": False, "name": "research"},
            "priorityClasses": {
                "research": {"name": "gpu-research", "value": -10},
                "inference": {"name": "gpu-serving", "value": 2000000},
            },
            "services": [
                {
                    "name": "chat",
                    "model": "meta-llama/Llama-3.1-8B-Instruct",
                    "manager": "kubernetes",
                    "park": "stop",
                    "kubernetes": {"namespace": "no", "deployment": "chat-vllm"},
                },
                {
                    "name": "embed",
                    "model": "BAAI/bge-m3",
                    "manager": "kubernetes",
                    "park": "stop",
                    "kubernetes": {
                        "namespace": "serving",
                        "deployment": "embed-vllm",
                        "endpoint_service": "embed",
                        "on_autoscaler": "steer",
                    },
                },
            ],
            "adminToken": {"existingSecret": "lowtide-admin", "key": "admin-token"},
            "extraConfig": {"tick_seconds": 1.5, "scheduler": {"team_quotas": {"vision": 8}}},
            "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}},
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "tolerations": [
                {"key": "dedicated", "operator": "Equal", "value": "control", "effect": "NoSchedule"}
            ],
            "affinity": {
                "podAntiAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "weight": 100,
                            "podAffinityTerm": {
                                "topologyKey": "kubernetes.io/hostname",
                                "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "lowtide"}},
                            },
                        }
                    ]
                }
            },
        },
        "on",
        "no",
    ),
}


@pytest.fixture(scope="module")
def chart() -> Any:
    return load_chart(CHART_DIR)


def rendered(chart: Any, scenario: str) -> list[dict[str, Any]]:
    overlay, name, namespace = SCENARIOS[scenario]
    return render(chart, [overlay], Release(name, namespace))


def canonical(objects: list[dict[str, Any]]) -> list[str]:
    """Objects as sorted JSON (types kept: 2 ≠ 2.0 ≠ true), the embedded lowtide.yaml parsed."""
    out = []
    for original in objects:
        obj = copy.deepcopy(original)
        data = obj.get("data") or {}
        if obj["kind"] == "ConfigMap" and "lowtide.yaml" in data:
            data["lowtide.yaml"] = yaml.safe_load(data["lowtide.yaml"])
        out.append(json.dumps(obj, sort_keys=True))
    return out


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in by_kind(objects, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name or ''}: {len(found)} found"
    return found[0]


def config_of(objects: list[dict[str, Any]]) -> dict[str, Any]:
    cm = next(o for o in by_kind(objects, "ConfigMap") if "lowtide.yaml" in o["data"])
    loaded: dict[str, Any] = yaml.safe_load(cm["data"]["lowtide.yaml"])
    return loaded


# -- templates and renderer agree ----------------------------------------------------------------


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_templates_render_exactly_the_renderers_objects(chart: Any, scenario: str) -> None:
    overlay, name, namespace = SCENARIOS[scenario]
    values = chart_values(chart, [overlay])
    from_templates = helm_template(CHART_DIR, values, name, namespace)
    from_python = rendered(chart, scenario)
    assert [(o["kind"], o["metadata"]["name"]) for o in from_templates] == [
        (o["kind"], o["metadata"]["name"]) for o in from_python
    ]
    assert canonical(from_templates) == canonical(from_python)


def test_optional_objects_follow_their_switches(chart: Any) -> None:
    plain = {(o["kind"], o["metadata"]["name"]) for o in rendered(chart, "defaults")}
    assert ("Secret", "lowtide-store") in plain
    assert not any(kind == "ServiceMonitor" for kind, _ in plain)
    assert ("ConfigMap", "lowtide-dashboard") not in plain
    monitored = {(o["kind"], o["metadata"]["name"]) for o in rendered(chart, "monitoring")}
    assert {("ServiceMonitor", "lowtide"), ("ConfigMap", "lowtide-dashboard")} <= monitored
    existing = rendered(chart, "existing-secret")
    assert by_kind(existing, "Secret") == [] and by_kind(existing, "PriorityClass") == []


# -- every object is a valid Kubernetes object -----------------------------------------------------

#: The ServiceMonitor fields the chart writes, with types, patterns and enums as prometheus-operator
#: v0.93.0 declares them (example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml:
#: spec requires endpoints and selector; endpoints[].port/path strings, interval a Duration pattern,
#: honorLabels a boolean). Closed objects: a field the CRD does not have under these names fails.
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "namespace"],
            "properties": {
                "name": {"type": "string"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["endpoints", "selector"],
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {
                                "type": "string",
                                "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
                                r"(([0-9]+)s)?(([0-9]+)ms)?)$",
                            },
                            "honorLabels": {"type": "boolean"},
                        },
                    },
                },
            },
        },
    },
}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_object_validates_strictly(chart: Any, scenario: str, version: str) -> None:
    for obj in rendered(chart, scenario):
        if obj["kind"] == "ServiceMonitor":
            jsonschema.Draft7Validator(SERVICE_MONITOR_SCHEMA).validate(obj)
            continue
        assert kubernetes_validate.validate(obj, version, strict=True) == version.rsplit(".", 1)[0]


def test_strict_validation_catches_an_unknown_field(chart: Any) -> None:
    deployment = copy.deepcopy(one(rendered(chart, "defaults"), "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinessprobe"):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    monitor = copy.deepcopy(one(rendered(chart, "monitoring"), "ServiceMonitor"))
    monitor["spec"]["endpoints"][0]["interval"] = "30 seconds"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(SERVICE_MONITOR_SCHEMA).validate(monitor)


# -- values.schema.json ----------------------------------------------------------------------------


def test_schema_is_draft7_and_the_defaults_need_only_a_store_and_artifacts(chart: Any) -> None:
    jsonschema.Draft7Validator.check_schema(chart.schema)
    problems = validate_values(chart.schema, chart.defaults)
    assert [p.split(":")[0] for p in problems] == ["artifactRoot", "store.url"]
    assert validate_values(chart.schema, chart_values(chart, [REQUIRED])) == []


BAD_VALUES = [
    ({"replicas": 0}, "replicas: 0 is less than the minimum of 1"),
    ({"replica": 2}, "(values): Additional properties are not allowed ('replica' was unexpected)"),
    ({"store": {"url": ""}}, "store.url: '' should be non-empty"),
    ({"store": {"url": "mysql://x@y/z"}}, "store.url: 'mysql://x@y/z' does not match"),
    ({"store": {"existingSecret": "pg"}}, "store.url: '" + PG + "' is expected to be empty"),
    ({"artifactRoot": "/srv/artifacts"}, "artifactRoot: '/srv/artifacts' does not match"),
    ({"artifactRoot": "file:///srv/artifacts"}, "artifactRoot: 'file:///srv/artifacts' should not be valid"),
    ({"image": {"pullPolicy": "Sometimes"}}, "image.pullPolicy: 'Sometimes' is not one of"),
    ({"api": {"port": 70000}}, "api.port: 70000 is greater than the maximum of 65535"),
    ({"argo": {"namespace": "Research"}}, "argo.namespace: 'Research' does not match"),
    ({"argo": {"settings": {"namespace": "x"}}}, "argo.settings: key 'namespace' is not allowed here"),
    (
        {"priorityClasses": {"inference": {"value": 2000000001}}},
        "priorityClasses.inference.value: 2000000001",
    ),
    # lowtide.yaml's argo.research_priority_class takes a DNS-1123 label (config.ArgoConfig)
    (
        {"priorityClasses": {"research": {"name": "gpu.research"}}},
        "priorityClasses.research.name: 'gpu.research'",
    ),
    (
        {"services": [{"name": "chat", "model": "m", "manager": "local"}]},
        "services[0].manager: 'kubernetes' was",
    ),
    (
        {"services": [{"name": "chat", "model": "m", "manager": "kubernetes", "park": "sleep"}]},
        "services[0].park: 'stop' was expected",
    ),
    ({"extraConfig": {"store_url": "sqlite://"}}, "extraConfig: key 'store_url' is not allowed here"),
    (
        {"argo": {"settings": {"service_account": "x"}}},
        "argo.settings: key 'service_account' is not allowed here",
    ),
    ({"stepServiceAccount": {"name": "Research"}}, "stepServiceAccount.name: 'Research'"),
    (
        {
            "services": [
                {
                    "name": "chat",
                    "model": "m",
                    "manager": "kubernetes",
                    "kubernetes": {"namespace": "s", "deployment": "d", "on_autoscaler": "fight"},
                }
            ]
        },
        "services[0].kubernetes.on_autoscaler: 'fight' is not one of",
    ),
    ({"serviceMonitor": {"interval": "30 seconds"}}, "serviceMonitor.interval: '30 seconds' does not match"),
    (
        {"serviceMonitor": {"labels": {"app.kubernetes.io/name": "x"}}},
        "serviceMonitor.labels: key 'app.kubernetes.io/name' is not allowed here",
    ),
]


@pytest.mark.parametrize(("overlay", "expected"), BAD_VALUES, ids=[e.split(":")[0] for _, e in BAD_VALUES])
def test_schema_rejects_bad_values_naming_the_field(
    chart: Any, overlay: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ValuesInvalid) as caught:
        render(chart, [REQUIRED, overlay], Release("lowtide", "lowtide"))
    assert any(p.startswith(expected) for p in caught.value.problems), caught.value.problems


@pytest.mark.parametrize(
    ("name", "namespace", "where"),
    [
        ("2024", "lowtide", "release name"),
        ("a" * 54, "lowtide", "release name"),
        ("lowtide", "Prod", "namespace"),
    ],
)
def test_release_name_and_namespace_are_checked(chart: Any, name: str, namespace: str, where: str) -> None:
    with pytest.raises(ValuesInvalid) as caught:
        render(chart, [REQUIRED], Release(name, namespace))
    (problem,) = caught.value.problems
    assert problem.startswith(f"{where} {(name if where == 'release name' else namespace)!r}")


def test_values_merge_like_helm() -> None:
    defaults = {"a": {"b": 1, "c": {"d": 2}}, "e": [1, 2], "f": "x", "t": {"u": 1}}
    first = {"a": {"c": {"g": 3}}, "e": [3], "f": None, "n": None}
    second = {"a": {"b": None}, "t": "flat"}
    user = merge_maps(first, second)
    assert user == {"a": {"c": {"g": 3}, "b": None}, "e": [3], "f": None, "n": None, "t": "flat"}
    # a null removes a default, but stays for a key without one; lists and non-maps replace
    assert coalesce(user, defaults) == {"a": {"c": {"d": 2, "g": 3}}, "e": [3], "n": None, "t": "flat"}
    assert defaults == {"a": {"b": 1, "c": {"d": 2}}, "e": [1, 2], "f": "x", "t": {"u": 1}}  # untouched


def test_set_types_values_as_helm_strvals() -> None:
    got = parse_set(["a.b=true,a.c=False", "n=0", "m=012", "k=123", "z=null", "s=1.5", r"l.x\.y/z=v\,w"])
    assert got == {
        "a": {"b": True, "c": False},
        "n": 0,
        "m": "012",
        "k": 123,
        "z": None,
        "s": "1.5",
        "l": {"x.y/z": "v,w"},
    }
    for bad in ("a[0]=1", "list={a,b}", "novalue", "=x"):
        with pytest.raises(ValuesInvalid):
            parse_set([bad])


def test_chart_versions_agree(chart: Any) -> None:
    assert chart.meta.app_version == lowtide.__version__ == chart.defaults["image"]["tag"]


def test_missing_chart_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ChartNotFound, match="not found"):
        load_chart(tmp_path / "nowhere")
    (tmp_path / "Chart.yaml").write_text("name: x\nversion: 1\nappVersion: 1\n")
    with pytest.raises(ChartNotFound, match=r"values\.yaml: missing"):
        load_chart(tmp_path)


# -- the control plane and its configuration -------------------------------------------------------


def test_deployment_runs_lowtide_up_non_root_with_readiness_on_healthz(chart: Any) -> None:
    objects = rendered(chart, "custom-names")
    deployment = one(objects, "Deployment", "on")
    assert deployment["spec"]["replicas"] == 3
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert container["command"] == ["lowtide", "up", "--config", f"{mounts['config']}/lowtide.yaml"]
    assert {"name": "config", "configMap": {"name": "on-config"}} in pod["volumes"]
    assert config_of(objects)["state_dir"] == mounts["state"]
    probe = container["readinessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    (port,) = container["ports"]
    assert probe["port"] == port["name"] == "http"
    assert port["containerPort"] == config_of(objects)["api"]["port"] == 9000
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["serviceAccountName"] == one(objects, "ServiceAccount")["metadata"]["name"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for selecting in (
        deployment["spec"]["selector"]["matchLabels"],
        one(objects, "Service")["spec"]["selector"],
    ):
        assert selecting.items() <= labels.items()
    pdb = one(objects, "PodDisruptionBudget")
    assert (
        pdb["spec"]["minAvailable"] == 2 and pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    )
    service = one(objects, "Service")
    assert service["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]


@pytest.mark.parametrize(
    ("scenario", "secret", "key"),
    [("defaults", "lowtide-store", "url"), ("existing-secret", "pg-credentials", "uri")],
)
def test_store_url_comes_from_the_secret(chart: Any, scenario: str, secret: str, key: str) -> None:
    objects = rendered(chart, scenario)
    (container,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    (env,) = container["env"]
    assert env == {"name": "LOWTIDE_STORE_URL", "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}
    assert "store_url" not in config_of(objects)
    for created in by_kind(objects, "Secret"):
        assert created["metadata"]["name"] == secret and created["stringData"] == {key: PG}


def test_config_runs_argo_with_kubernetes_services(chart: Any) -> None:
    config = config_of(rendered(chart, "custom-names"))
    assert config["executor"] == {"kind": "argo"}
    assert config["argo"] == {
        "namespace": "no",
        "research_priority_class": "gpu-research",
        "service_account": "research",
        "grace_margin_seconds": 30,
    }
    assert config["artifact_root"] == "s3://lowtide-artifacts/prod"
    assert config["api"] == {"host": "0.0.0.0", "port": 9000, "public_url": "http://on.no.svc:80"}
    assert [(s["name"], s["manager"], s["park"]) for s in config["services"]] == [
        ("chat", "kubernetes", "stop"),
        ("embed", "kubernetes", "stop"),
    ]
    assert config["tick_seconds"] == 1.5 and config["scheduler"] == {"team_quotas": {"vision": 8}}
    # Every pod registers the admin token of the Secret instead of minting its own.
    assert config["auth"] == {"admin_token_source": "/etc/lowtide-admin/token"}
    assert "auth" not in config_of(rendered(chart, "defaults"))
    # Only the holder of the release's Lease acts (adapters.k8s_lease, in front of the store's lease).
    assert config["control"] == {
        "lease_backend": "kubernetes",
        "kubernetes_lease": {"namespace": "no", "name": "on-control"},
    }


@pytest.mark.parametrize("scenario", ["defaults", "custom-names"])
def test_the_charts_config_is_what_lowtide_accepts(chart: Any, scenario: str) -> None:
    config = config_of(rendered(chart, scenario))
    try:
        settings = Settings(**config)
    except ValidationError as exc:
        raise AssertionError(f"lowtide refuses the chart's lowtide.yaml: {exc.errors()}") from exc
    assert settings.executor.kind == "argo"
    assert settings.control.lease_backend == "kubernetes"
    if scenario == "custom-names":
        assert settings.auth.admin_token_source == "/etc/lowtide-admin/token"


def test_the_admin_token_secret_is_mounted_read_only_where_the_config_says(chart: Any) -> None:
    pod = one(rendered(chart, "custom-names"), "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert {"name": "admin-token", "mountPath": "/etc/lowtide-admin", "readOnly": True} in container[
        "volumeMounts"
    ]
    assert {
        "name": "admin-token",
        "secret": {"secretName": "lowtide-admin", "items": [{"key": "admin-token", "path": "token"}]},
    } in pod["volumes"]
    plain = one(rendered(chart, "defaults"), "Deployment")["spec"]["template"]["spec"]
    assert all(v["name"] != "admin-token" for v in plain["volumes"])


# -- RBAC ---------------------------------------------------------------------------------------------


def expected_rules(namespace: str, argo_ns: str) -> set[GrantedRule]:
    sa = f"system:serviceaccount:{namespace}:lowtide"

    def rule(
        ns: str | None, group: str, resource: str, verbs: str, names: tuple[str, ...] = ()
    ) -> GrantedRule:
        return GrantedRule(sa, ns, (group,), (resource,), tuple(verbs.split()), names)

    return {
        # Every rule is used by lowtide (tests/integration/test_chart_rbac_coverage.py): no
        # Workflow watch or delete, no Secret read, no node list or watch.
        rule(argo_ns, "argoproj.io", "workflows", "create get list patch"),
        rule(argo_ns, "", "pods", "get list watch patch delete"),
        rule(argo_ns, "", "pods/log", "get"),  # a step's log for `lowtide logs` (adapters.argo.pod_logs)
        rule(argo_ns, "events.k8s.io", "events", "create patch"),  # Kubernetes Events about its pods
        rule(argo_ns, "", "secrets", "create patch"),  # the step tokens' Secrets: no get, no list
        rule(namespace, "coordination.k8s.io", "leases", "get create update"),
        rule(None, "", "nodes", "get patch"),
        rule(None, "", "pods", "list"),  # the node fit check: pods bound to a node, any namespace
        # The steps' own ServiceAccount: only what Argo's executor needs (docs/workflow-rbac.md).
        GrantedRule(
            f"system:serviceaccount:{argo_ns}:lowtide-step",
            argo_ns,
            ("argoproj.io",),
            ("workflowtaskresults",),
            ("create", "patch"),
            (),
        ),
    }


@pytest.mark.parametrize("scenario", ["defaults", "existing-secret"])
def test_rbac_is_exactly_the_listed_rules(chart: Any, scenario: str) -> None:
    objects = rendered(chart, scenario)
    granted = rbac_rules(objects)
    assert len(granted) == len(set(granted))
    assert set(granted) == expected_rules("lowtide", "lowtide")


def test_rbac_has_no_wildcards_exec_or_other_secrets(chart: Any) -> None:
    objects = rendered(chart, "custom-names")
    roles = by_kind(objects, "Role") + by_kind(objects, "ClusterRole")
    assert {r["kind"] for r in roles} == {"Role", "ClusterRole"}
    for role in roles:
        for rule in role["rules"]:
            assert "*" not in rule["apiGroups"] + rule["resources"] + rule["verbs"]
            assert "pods/exec" not in rule["resources"] and "pods/attach" not in rule["resources"]
            if "secrets" in rule["resources"]:  # never read; written only: the step tokens'
                assert rule["verbs"] == ["create", "patch"] and "resourceNames" not in rule
    cluster_wide = {r for g in rbac_rules(objects) if g.namespace is None for r in g.resources}
    assert cluster_wide == {"nodes", "pods"}
    # Pods cluster-wide: list only (the fit check), never read one by one, watched or written.
    assert {g.verbs for g in rbac_rules(objects) if g.namespace is None and g.resources == ("pods",)} == {
        ("list",)
    }
    workloads = {g.resources for g in rbac_rules(objects) if g.namespace == "no"}
    assert ("workflows",) in workloads and ("pods/log",) in workloads
    # A container's log only in the Argo namespace: never a service's pods' or any other's.
    assert {g.namespace for g in rbac_rules(objects) if "pods/log" in g.resources} == {"no"}


def test_each_service_gets_exactly_what_its_settings_need_in_its_own_namespace(chart: Any) -> None:
    objects = rendered(chart, "custom-names")
    sa = "system:serviceaccount:no:on"

    def rule(ns: str, group: str, resource: str, verbs: str, names: tuple[str, ...] = ()) -> GrantedRule:
        return GrantedRule(sa, ns, (group,), (resource,), tuple(verbs.split()), names)

    def base(ns: str, deployment: str) -> set[GrantedRule]:
        return {
            rule(ns, "apps", "deployments/scale", "get update", (deployment,)),
            rule(ns, "", "pods", "list watch patch delete"),
            rule(ns, "autoscaling", "horizontalpodautoscalers", "list"),
            rule(ns, "keda.sh", "scaledobjects", "list"),
            rule(ns, "events.k8s.io", "events", "create patch"),  # Events about what it scales
        }

    def service_grants(role: str) -> set[GrantedRule]:
        mine = [o for o in objects if o["metadata"]["name"] == role]
        assert [o["kind"] for o in mine] == ["Role", "RoleBinding"]
        return set(rbac_rules(mine))

    # chat: in the Argo namespace, no endpoint_service, on_autoscaler refuse (the default).
    assert service_grants("on-service-chat") == base("no", "chat-vllm")
    # embed: its own namespace, readiness from EndpointSlices, steering its autoscalers.
    assert service_grants("on-service-embed") == base("serving", "embed-vllm") | {
        rule("serving", "discovery.k8s.io", "endpointslices", "list watch"),
        rule("serving", "autoscaling", "horizontalpodautoscalers", "update"),
        rule("serving", "keda.sh", "scaledobjects", "patch"),
    }
    # Nothing of the service manager's is granted anywhere else.
    service_resources = {"deployments/scale", "horizontalpodautoscalers", "scaledobjects", "endpointslices"}
    for granted in rbac_rules(objects):
        if set(granted.resources) & service_resources:
            assert granted in service_grants("on-service-chat") | service_grants("on-service-embed")
    assert not [o for o in rendered(chart, "defaults") if "-service-" in o["metadata"]["name"]]


def test_the_steps_service_account_is_the_charts_own_or_the_one_named(chart: Any) -> None:
    defaults = rendered(chart, "defaults")
    assert config_of(defaults)["argo"]["service_account"] == "lowtide-step"
    account = one(defaults, "ServiceAccount", "lowtide-step")
    assert account["metadata"]["namespace"] == "lowtide"  # the Argo namespace, where the pods run
    assert account["automountServiceAccountToken"] is True  # Argo's executor uses the token
    (granted,) = [g for g in rbac_rules(defaults) if g.subject.endswith(":lowtide-step")]
    assert (granted.resources, granted.verbs) == (("workflowtaskresults",), ("create", "patch"))
    # An existing account: named in lowtide.yaml, nothing created.
    custom = rendered(chart, "custom-names")
    assert config_of(custom)["argo"]["service_account"] == "research"
    assert not [o for o in custom if o["metadata"]["name"] in ("research", "on-step")]
    # Neither: the namespace's default account (lowtide.yaml names none).
    none = render(chart, [REQUIRED, {"stepServiceAccount": {"create": False}}], Release("lowtide", "lowtide"))
    assert "service_account" not in config_of(none)["argo"]
    assert not any(o["metadata"]["name"] == "lowtide-step" for o in none)


def test_rbac_rules_refuses_a_binding_without_its_role(chart: Any) -> None:
    objects = [o for o in rendered(chart, "defaults") if o["kind"] != "ClusterRole"]
    with pytest.raises(ValueError, match="ClusterRole lowtide-lowtide-nodes missing"):
        rbac_rules(objects)


def test_priority_classes(chart: Any) -> None:
    objects = rendered(chart, "custom-names")
    research = one(objects, "PriorityClass", "gpu-research")
    inference = one(objects, "PriorityClass", "gpu-serving")
    assert research["preemptionPolicy"] == "Never"
    assert inference["preemptionPolicy"] == "PreemptLowerPriority"
    assert research["value"] == -10 < inference["value"] == 2000000
    assert research["globalDefault"] is inference["globalDefault"] is False
    assert config_of(objects)["argo"]["research_priority_class"] == research["metadata"]["name"]
    assert "namespace" not in research["metadata"]


# -- the Grafana dashboard ------------------------------------------------------------------------


def exposed_metrics() -> dict[str, set[str]]:
    """Every sample name `api/metrics.py` can expose, with its label names: its Gauge/Counter
    definitions read from the source, then written by prometheus_client itself (so a Counter's
    `_total` suffix is what the library really writes)."""
    source = (REPO / "src" / "lowtide" / "api" / "metrics.py").read_text(encoding="utf-8")
    registry = CollectorRegistry()
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id not in ("Gauge", "Counter") or not isinstance(node.args[0], ast.Constant):
            continue
        name = node.args[0].value
        label_names = [e.value for e in node.args[2].elts] if len(node.args) > 2 else []
        kind = Gauge if node.func.id == "Gauge" else Counter
        metric = kind(name, "doc", label_names, registry=registry)
        (metric.labels(*["x"] * len(label_names)) if label_names else metric).inc()
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


#: Labels Prometheus (and the ServiceMonitor's target) put on every series.
TARGET_LABELS = {"pod", "instance", "job", "namespace", "container", "endpoint"}
_METRIC = re.compile(r"\b(lowtide_[a-z_]+)(\{[^}]*\})?")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")


def test_dashboard_queries_only_exposed_metrics_and_labels() -> None:
    dashboard = json.loads((CHART_DIR / "dashboards" / "lowtide.json").read_text(encoding="utf-8"))
    exposed = exposed_metrics()
    assert "lowtide_infrastructure_failures_total" in exposed  # the Counter's exposed name
    used: set[str] = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            names = []
            for match in _METRIC.finditer(expr):
                name, selector = match.group(1), match.group(2) or ""
                assert name in exposed, f"{panel['title']}: {name} is not a metric of api/metrics.py"
                for label in re.findall(r"([a-zA-Z_]+)\s*=~?", selector):
                    assert label in exposed[name], f"{panel['title']}: {name} has no label {label}"
                names.append(name)
            assert names, f"{panel['title']}: {expr} queries no lowtide metric"
            for group in _GROUPING.findall(expr):
                for label in filter(None, (g.strip() for g in group.split(","))):
                    assert label in TARGET_LABELS or any(label in exposed[n] for n in names), (
                        f"{panel['title']}: no metric of {expr!r} has the label {label}"
                    )
            legend_labels = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
            assert legend_labels <= TARGET_LABELS | set().union(*(exposed[n] for n in names))
            used.update(names)
    wanted = {
        "lowtide_jobs", "lowtide_steps", "lowtide_queue_steps", "lowtide_gpus", "lowtide_reclaims",
        "lowtide_preemptions", "lowtide_lost_gpu_seconds", "lowtide_loop_last_tick_duration_seconds",
        "lowtide_loop_tick_errors", "lowtide_store_up", "lowtide_clock_skew_seconds",
        "lowtide_infrastructure_failures_total",
    }  # fmt: skip
    assert wanted <= used, f"no panel for {wanted - used}"


def test_dashboard_configmap_carries_the_json_for_the_sidecar(chart: Any) -> None:
    cm = one(rendered(chart, "monitoring"), "ConfigMap", "lowtide-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    text = (CHART_DIR / "dashboards" / "lowtide.json").read_text(encoding="utf-8")
    assert json.loads(cm["data"]["lowtide.json"]) == json.loads(text)
    monitor = one(rendered(chart, "monitoring"), "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["endpoints"] == [
        {"port": "http", "path": "/metrics", "interval": "15s", "honorLabels": True}
    ]


# -- the test interpreter refuses what it does not know --------------------------------------------


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{ range .Values.s }}x{{ end }}", "range over a list only"),
        ("{{ range $i, $v := .Values.l }}x{{ end }}", "outside the subset"),
        ("{{ if eq .Values.s 1 }}x{{ end }}", "incompatible types"),
        ('{{ hasKey .Values.s "k" }}', "outside the subset"),
        ("{{ $x := 1 }}", "outside the subset"),
        ("{{ .Values.n }}", "print strings only"),
        ("{{ .Values.missing }}", "missing key"),
        ("{{ .Values.s | upper }}", "only `| quote`"),
        ("{{ default 1 .Values.n }}", "outside the subset"),
        ("{{ .Values.n | quote }}", "quote a string only"),
        ("{{ if .Values.s }}x", "without end"),
        ('{{ template "x" . }}', "template"),
    ],
)
def test_interpreter_refuses_constructs_outside_the_subset(
    tmp_path: Path, template: str, message: str
) -> None:
    (tmp_path / "templates").mkdir()
    (tmp_path / "Chart.yaml").write_text("name: t\nversion: 0.1.0\nappVersion: '1'\n")
    (tmp_path / "templates" / "t.yaml").write_text(template)
    with pytest.raises(OutsideSubset, match=re.escape(message)):
        Renderer(tmp_path, {"n": 1000000, "s": "x", "l": [1]}, {"name": "r", "namespace": "n"}).render_files()


def test_interpreter_semantics_match_go_and_helm() -> None:
    assert go_quote('a"b\\c\nd\x01é') == '"a\\"b\\\\c\\nd\\x01é"'
    assert yaml.safe_load(go_quote('a"b\\c\nd\x01é')) == 'a"b\\c\nd\x01é'
    assert to_yaml(2000000.0) == "2000000" and to_yaml({"b": 1.0, "a": [2.5]}) == "a:\n- 2.5\nb: 1"
    nodes = parse("a  \n{{- /* c */ -}}\n  b{{ if .x }}y{{ else }}z{{ end }}", "t")
    assert [type(n).__name__ for n in nodes] == ["Text", "Text", "Block"]
    assert nodes[0].text + nodes[1].text == "ab"


def test_interpreter_range_dollar_haskey_and_eq_follow_go(tmp_path: Path) -> None:
    """Go's text/template: `range` sets dot to each element (else: empty list), `$` is the
    top-level data inside it; Sprig's hasKey; eq on two strings."""
    (tmp_path / "templates").mkdir()
    (tmp_path / "Chart.yaml").write_text("name: t\nversion: 0.1.0\nappVersion: '1'\n")
    (tmp_path / "templates" / "t.yaml").write_text(
        "{{- range .Values.l }}[{{ .n }}@{{ $.Release.Name }}"
        '{{- if hasKey . "k" }}{{ if eq .k "on" }}+{{ else }}-{{ end }}{{ end }}]{{- end }}'
        "{{ range .Values.e }}x{{ else }}empty{{ end }}"
    )
    values = {"l": [{"n": "a"}, {"n": "b", "k": "on"}, {"n": "c", "k": "off"}], "e": []}
    out = Renderer(tmp_path, values, {"name": "r", "namespace": "n"}).render_files()["templates/t.yaml"]
    assert out == "[a@r][b@r+][c@r-]empty"


# -- the CLI ---------------------------------------------------------------------------------------


runner = CliRunner()
REQUIRED_SET = ["--set", f"store.url={PG}", "--set", "artifactRoot=s3://b/p"]


def test_cli_renders_yaml_documents_and_json(chart: Any, tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"store": {"url": PG}, "grafanaDashboard": {"enabled": True}}))
    args = ["k8s", "render", "-f", str(values), "--set", "artifactRoot=s3://b/p", "-n", "lt"]
    as_yaml = runner.invoke(app, args)
    assert as_yaml.exit_code == 0, as_yaml.output
    documents = [d for d in yaml.safe_load_all(as_yaml.stdout) if d is not None]
    expected = render(
        chart,
        [{"store": {"url": PG}, "grafanaDashboard": {"enabled": True}, "artifactRoot": "s3://b/p"}],
        Release("lowtide", "lt"),
    )
    assert canonical(documents) == canonical(expected)
    as_json = runner.invoke(app, [*args, "-o", "json"])
    assert as_json.exit_code == 0, as_json.output
    listed = json.loads(as_json.stdout)
    assert listed["kind"] == "List" and canonical(listed["items"]) == canonical(expected)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--set", "replicas=0"], "replicas: 0 is less than the minimum of 1"),
        (["--set", "services[0].name=x"], "lists are not supported"),
        (["--chart", "/nonexistent/chart"], "chart directory /nonexistent/chart not found"),
        (["-f", "/nonexistent/values.yaml"], "/nonexistent/values.yaml: cannot read"),
        (["--release-name", "Lowtide"], "release name 'Lowtide'"),
    ],
)
def test_cli_bad_input_exits_2_naming_the_problem(extra: list[str], message: str) -> None:
    result = runner.invoke(app, ["k8s", "render", *REQUIRED_SET, *extra])
    assert result.exit_code == 2
    assert message in " ".join(result.stderr.split())


def test_cli_values_file_must_be_a_mapping(tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text("- a\n- b\n")
    result = runner.invoke(app, ["k8s", "render", "-f", str(values)])
    assert result.exit_code == 2 and "must be a mapping, not a list" in result.stderr
