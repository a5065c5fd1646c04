"""The Helm chart of lowtide's control plane, rendered without Helm: `lowtide k8s render`.

Role: find and load the chart (`deploy/helm/lowtide/`: Chart.yaml, values.yaml,
values.schema.json, dashboards/), merge values files and `--set` assignments over its defaults the
way Helm does, validate the result against values.schema.json (errors name the field), and build
the objects the templates produce (`deploy.manifests`). `rbac_rules` flattens the rendered RBAC
into the rules each subject holds where, for tests that enforce them (a fake API server).

Where the chart is: it lives in the repository (`deploy/helm/lowtide/`), not in the Python
package; `default_chart_dir` finds it relative to this file in a checkout or an editable install,
and `ChartNotFound` says to pass `--chart DIR` otherwise (a wheel does not carry it).

Helm facts reproduced (github.com/helm/helm @e9b85e4, Helm 4's main branch, August 2026): values
files and then `--set` are merged in order (`pkg/cli/values/options.go`, `loader.MergeMaps`), then
coalesced over the chart's defaults: maps key by key, other values replaced, a null removes the
default (`pkg/chart/common/util/coalesce.go`); `--set a.b=v` types v as Helm's `strvals.typedVal`
(true/false/null case-insensitively, integers without a leading zero, otherwise a string) and
splits assignments on unescaped commas (`pkg/strvals/parser.go`); values are validated against
values.schema.json (`pkg/chart/common/util/jsonschema.go`, a Draft 7 schema here); release names
follow `pkg/chart/v2/util/validate_name.go` (DNS-1123 subdomain, at most 53 characters) and this
chart also needs them to be DNS-1035 labels, since the release name names the Service.
Not reproduced: `--set` lists (`a[0]=x`, `{a,b}`: refused, with a message saying to use a values
file) and Helm's other value options (`--set-string`, `--set-file`, `--set-json`).

Neighbours: `cli.k8s_cmd` (the command), `deploy.manifests` (the objects).
Must not: talk to a cluster or run Helm.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lowtide.deploy.manifests import DASHBOARD_FILE, ChartMeta, Objects, Release, build

__all__ = [
    "Chart",
    "ChartNotFound",
    "GrantedRule",
    "Release",
    "ValuesInvalid",
    "chart_values",
    "coalesce",
    "default_chart_dir",
    "load_chart",
    "merge_maps",
    "parse_set",
    "rbac_rules",
    "render",
    "validate_values",
]

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_MAX_RELEASE_NAME = 53
_SET_KEY = re.compile(r"^[A-Za-z0-9_./-]+$")


class ChartNotFound(FileNotFoundError):
    """The chart directory (or one of its files) is missing."""


class ValuesInvalid(ValueError):
    """Values the chart cannot use; `problems` lists "where: why" lines."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = list(problems)


@dataclass(frozen=True, slots=True)
class Chart:
    directory: Path
    meta: ChartMeta
    defaults: Mapping[str, Any]
    schema: Mapping[str, Any]
    files: Mapping[str, str]


def default_chart_dir() -> Path:
    """`deploy/helm/lowtide` of the checkout this module lives in (src/lowtide/deploy/chart.py)."""
    return Path(__file__).resolve().parents[3] / "deploy" / "helm" / "lowtide"


def _read(directory: Path, name: str) -> str:
    try:
        return (directory / name).read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ChartNotFound(f"{directory / name}: missing; is {directory} lowtide's chart?") from exc


def load_chart(directory: Path | None = None) -> Chart:
    """Read the chart at `directory` (default: the checkout's `deploy/helm/lowtide`)."""
    where = directory if directory is not None else default_chart_dir()
    if not where.is_dir():
        hint = "" if directory is not None else " (not in a checkout of lowtide: pass --chart DIR)"
        raise ChartNotFound(f"chart directory {where} not found{hint}")
    meta = yaml.safe_load(_read(where, "Chart.yaml"))
    defaults = yaml.safe_load(_read(where, "values.yaml")) or {}
    schema = json.loads(_read(where, "values.schema.json"))
    if not isinstance(meta, dict) or not isinstance(defaults, dict):
        raise ChartNotFound(f"{where}: Chart.yaml and values.yaml must be mappings")
    return Chart(
        directory=where,
        meta=ChartMeta(
            name=str(meta["name"]), version=str(meta["version"]), app_version=str(meta["appVersion"])
        ),
        defaults=defaults,
        schema=schema,
        files={DASHBOARD_FILE: _read(where, DASHBOARD_FILE)},
    )


def merge_maps(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Two layers of user values, as Helm merges its -f files and --set (`loader.MergeMaps`):
    `override` wins, maps are merged key by key, a null is kept (it deletes a default later)."""
    out = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_maps(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def coalesce(user: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """User values over the chart's defaults, as Helm coalesces them: a user null removes the
    default, maps merge key by key, any other user value wins (a null for a key without a
    default stays null)."""
    out = copy.deepcopy(dict(user))
    for key, default in defaults.items():
        if key not in out:
            out[key] = copy.deepcopy(default)
        elif out[key] is None:
            if default is not None:
                del out[key]
        elif isinstance(out[key], Mapping) and isinstance(default, Mapping):
            out[key] = coalesce(out[key], default)
    return out


def chart_values(chart: Chart, overrides: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The values the templates see: the user layers (values files, then --set) merged in
    order, then coalesced over the chart's values.yaml."""
    user: dict[str, Any] = {}
    for layer in overrides:
        user = merge_maps(user, layer)
    return coalesce(user, chart.defaults)


def _typed(text: str) -> Any:
    """A `--set` value typed as Helm's strvals.typedVal does."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "null":
        return None
    if text == "0":
        return 0
    if text and text[0] != "0" and re.fullmatch(r"[-+]?[0-9]+", text):
        value = int(text)
        if -(2**63) <= value < 2**63:  # Go's ParseInt(.., 64): larger stays a string
            return value
    return text


def _split_unescaped(text: str, sep: str) -> list[str]:
    """`text` split on `sep` where no backslash escapes it (`\\,` and `\\.` as in Helm's --set)."""
    parts, current, i = [], [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] == sep:
            current.append(sep)
            i += 2
            continue
        if text[i] == sep:
            parts.append("".join(current))
            current = []
        else:
            current.append(text[i])
        i += 1
    parts.append("".join(current))
    return parts


def parse_set(assignments: Iterable[str]) -> dict[str, Any]:
    """`--set a.b=v[,c=w]` assignments as one nested mapping (later ones win)."""
    out: dict[str, Any] = {}
    for text in assignments:
        for part in _split_unescaped(text, ","):
            key, sep, raw = part.partition("=")
            if "[" in key or raw.startswith("{"):
                raise ValuesInvalid([f"--set {text}: lists are not supported here; use a values file (-f)"])
            names = _split_unescaped(key, ".")
            if not sep or not all(_SET_KEY.fullmatch(name) for name in names):
                raise ValuesInvalid([f"--set {text}: expected key.path=value (a literal dot in a key: \\.)"])
            node = out
            *parents, leaf = names
            for name in parents:
                child = node.get(name)
                if not isinstance(child, dict):
                    child = node[name] = {}
                node = child
            node[leaf] = _typed(raw)
    return out


def _where(path: Iterable[Any]) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(values)"


def validate_values(schema: Mapping[str, Any], values: Mapping[str, Any]) -> list[str]:
    """Located problems ("store.url: ..."), sorted by place; [] when the values are valid."""
    import jsonschema  # type: ignore[import-untyped]  # noqa: PLC0415 (only rendering needs it)

    validator = jsonschema.Draft7Validator(schema)
    problems = []
    for error in sorted(validator.iter_errors(values), key=lambda e: [str(p) for p in e.absolute_path]):
        message = error.message
        if "propertyNames" in error.schema_path:  # the error is about a key, not a value
            message = f"key {error.instance!r} is not allowed here"
        described = error.schema.get("description") if isinstance(error.schema, dict) else None
        if described:
            message += f" ({described})"
        problems.append(f"{_where(error.absolute_path)}: {message}")
    return problems


def check_release(release: Release) -> list[str]:
    problems = []
    if len(release.name) > _MAX_RELEASE_NAME or not _DNS1035.fullmatch(release.name):
        problems.append(
            f"release name {release.name!r}: lowercase letters, digits and '-', starting with a letter, "
            f"at most {_MAX_RELEASE_NAME} characters (it names the Service)"
        )
    if len(release.namespace) > 63 or not _DNS1123_LABEL.fullmatch(release.namespace):
        problems.append(f"namespace {release.namespace!r}: not a DNS-1123 label")
    return problems


def render(chart: Chart, overrides: Sequence[Mapping[str, Any]], release: Release) -> Objects:
    """The chart's objects for its defaults with each of `overrides` merged over them in turn."""
    values = chart_values(chart, overrides)
    problems = check_release(release) + validate_values(chart.schema, values)
    if problems:
        raise ValuesInvalid(problems)
    return build(values, release, chart.meta, chart.files)


@dataclass(frozen=True, slots=True)
class GrantedRule:
    """One RBAC rule as a subject holds it: `namespace` None means cluster-wide (a ClusterRoleBinding)."""

    subject: str  # the username, e.g. system:serviceaccount:NAMESPACE:NAME
    namespace: str | None
    api_groups: tuple[str, ...]
    resources: tuple[str, ...]
    verbs: tuple[str, ...]
    resource_names: tuple[str, ...] = ()


def _subject(subject: Mapping[str, Any], binding_namespace: str | None) -> str:
    if subject["kind"] == "ServiceAccount":
        # Kubernetes' username of a service account (k8s.io/apiserver serviceaccount.MakeUsername).
        return f"system:serviceaccount:{subject.get('namespace') or binding_namespace}:{subject['name']}"
    return str(subject["name"])


def rbac_rules(objects: Iterable[Mapping[str, Any]]) -> list[GrantedRule]:
    """What each subject may do where, from rendered Roles, ClusterRoles and their bindings.

    A RoleBinding grants its Role's (or ClusterRole's) rules in the binding's namespace; a
    ClusterRoleBinding grants a ClusterRole's rules everywhere. A binding to a role that is not
    among `objects` is an error (the chart must be complete)."""
    objects = list(objects)
    roles = {
        (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
        for o in objects
        if o["kind"] in ("Role", "ClusterRole")
    }
    granted: list[GrantedRule] = []
    for binding in (o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        namespace = binding["metadata"].get("namespace") if binding["kind"] == "RoleBinding" else None
        ref = binding["roleRef"]
        role = roles.get((ref["kind"], namespace if ref["kind"] == "Role" else None, ref["name"]))
        if role is None:
            raise ValueError(
                f"{binding['kind']} {binding['metadata']['name']}: {ref['kind']} {ref['name']} missing"
            )
        for subject in binding["subjects"]:
            for rule in role.get("rules", []):
                granted.append(
                    GrantedRule(
                        subject=_subject(subject, namespace),
                        namespace=namespace,
                        api_groups=tuple(rule.get("apiGroups", ())),
                        resources=tuple(rule.get("resources", ())),
                        verbs=tuple(rule.get("verbs", ())),
                        resource_names=tuple(rule.get("resourceNames", ())),
                    )
                )
    return granted
