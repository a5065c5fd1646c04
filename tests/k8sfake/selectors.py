"""Label and field selectors for list and watch, as the apiserver parses and applies them.

Label selectors: the string syntax of k8s.io/apimachinery/pkg/labels/selector.go (kubernetes
commit 000f2605): `k=v`, `k==v`, `k!=v`, `k in (a,b)`, `k notin (a,b)`, `k`, `!k`, comma = AND;
`!=` and `notin` also match objects without the label. Field selectors:
k8s.io/apimachinery/pkg/fields/selector.go (`=`, `==`, `!=` only) with the per-resource field
sets of pkg/registry/core/pod/strategy.go `ToSelectableFields` (metadata.name,
metadata.namespace, spec.nodeName, spec.restartPolicy, spec.schedulerName,
spec.serviceAccountName, status.phase, status.podIP, status.nominatedNodeName), nodes
(spec.unschedulable), events (involvedObject.*, reason, type) and the generic
metadata.name/metadata.namespace for everything else (custom resources included).
Neighbours: `server` parses query strings with these; `watch` filters events with them.
Must NOT: touch storage.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import bad_request

Obj = dict[str, Any]

_KEY = r"[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?"


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!exists"
    values: tuple[str, ...] = ()

    def matches(self, labels: dict[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "exists":
            return present
        if self.op == "!exists":
            return not present
        if self.op in ("=", "in"):
            return present and value in self.values
        return not present or value not in self.values  # "!=", "notin"


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return parts


def parse_label_selector(text: str) -> list[Requirement]:
    """Parse a labelSelector query value; a bad one is a 400 like the apiserver's."""
    text = text.strip()
    if not text:
        return []
    reqs: list[Requirement] = []
    for raw in _split_top_level(text):
        part = raw.strip()
        m = re.fullmatch(rf"({_KEY})\s+(in|notin)\s+\(([^()]*)\)", part)
        if m:
            values = tuple(v.strip() for v in m.group(4).split(",") if v.strip())
            if not values:
                raise bad_request(
                    "unable to parse requirement: for 'in', 'notin' operators, values set can't be empty "
                    f"({part})"
                )
            reqs.append(Requirement(m.group(1), m.group(3), values))
            continue
        m = re.fullmatch(rf"({_KEY})\s*(==|=|!=)\s*([-A-Za-z0-9_.]*)", part)
        if m:
            op = "!=" if m.group(3) == "!=" else "="
            reqs.append(Requirement(m.group(1), op, (m.group(4),)))
            continue
        m = re.fullmatch(rf"(!?)\s*({_KEY})", part)
        if m:
            reqs.append(Requirement(m.group(2), "!exists" if m.group(1) else "exists"))
            continue
        raise bad_request(f"unable to parse requirement: invalid label selector term {part!r}")
    return reqs


def labels_match(reqs: list[Requirement], obj: Obj) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(r.matches(labels) for r in reqs)


def _get(obj: Obj, dotted: str) -> Any:
    cur: Any = obj
    for part in dotted.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


def _pod_ips(obj: Obj) -> str:
    ips = _get(obj, "status.podIPs") or []
    return str(ips[0].get("ip", "")) if ips else ""


def _getter(dotted: str) -> Callable[[Obj], Any]:
    return lambda o: _get(o, dotted)


_INVOLVED = ("kind", "namespace", "name", "uid", "apiVersion", "resourceVersion", "fieldPath")
_GENERIC: dict[str, Callable[[Obj], Any]] = {
    "metadata.name": lambda o: _get(o, "metadata.name"),
    "metadata.namespace": lambda o: _get(o, "metadata.namespace"),
}
FIELDS: dict[str, dict[str, Callable[[Obj], Any]]] = {
    "pods": {
        **_GENERIC,
        "spec.nodeName": lambda o: _get(o, "spec.nodeName"),
        "spec.restartPolicy": lambda o: _get(o, "spec.restartPolicy"),
        "spec.schedulerName": lambda o: _get(o, "spec.schedulerName"),
        "spec.serviceAccountName": lambda o: _get(o, "spec.serviceAccountName"),
        "spec.hostNetwork": lambda o: str(bool(_get(o, "spec.hostNetwork"))).lower(),
        "status.phase": lambda o: _get(o, "status.phase"),
        "status.podIP": _pod_ips,
        "status.nominatedNodeName": lambda o: _get(o, "status.nominatedNodeName"),
    },
    "nodes": {**_GENERIC, "spec.unschedulable": lambda o: str(bool(_get(o, "spec.unschedulable"))).lower()},
    "events": {
        **_GENERIC,
        **{f"involvedObject.{k}": _getter(f"involvedObject.{k}") for k in _INVOLVED},
        "reason": lambda o: _get(o, "reason"),
        "reportingComponent": lambda o: _get(o, "reportingComponent"),
        "source": lambda o: _get(o, "source.component"),
        "type": lambda o: _get(o, "type"),
    },
}


@dataclass(frozen=True)
class FieldRequirement:
    field: str
    equal: bool
    value: str


def parse_field_selector(text: str, resource: str) -> list[FieldRequirement]:
    text = text.strip()
    if not text:
        return []
    known = FIELDS.get(resource, _GENERIC)
    reqs: list[FieldRequirement] = []
    for raw in text.split(","):
        m = re.fullmatch(r"\s*([^=!\s]+)\s*(==|=|!=)\s*(.*?)\s*", raw)
        if not m:
            raise bad_request(f"invalid selector: '{text}'; can't understand '{raw}'")
        name = m.group(1)
        if name not in known:
            if resource in FIELDS and resource != "nodes":
                raise bad_request(f"field label not supported: {name}")
            raise bad_request(
                f'"{name}" is not a known field selector: only "metadata.name", "metadata.namespace"'
            )
        reqs.append(FieldRequirement(name, m.group(2) != "!=", m.group(3)))
    return reqs


def fields_match(reqs: list[FieldRequirement], obj: Obj, resource: str) -> bool:
    known = FIELDS.get(resource, _GENERIC)
    for r in reqs:
        value = known[r.field](obj)
        text = "" if value is None else str(value)
        if (text == r.value) != r.equal:
            return False
    return True


@dataclass(frozen=True)
class Selector:
    """A parsed labelSelector + fieldSelector pair for one resource."""

    resource: str
    labels: tuple[Requirement, ...] = ()
    fields: tuple[FieldRequirement, ...] = ()

    @classmethod
    def parse(cls, resource: str, label_selector: str | None, field_selector: str | None) -> Selector:
        return cls(
            resource,
            tuple(parse_label_selector(label_selector or "")),
            tuple(parse_field_selector(field_selector or "", resource)),
        )

    def matches(self, obj: Obj) -> bool:
        return labels_match(list(self.labels), obj) and fields_match(list(self.fields), obj, self.resource)
