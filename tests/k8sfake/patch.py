"""The three patch formats the apiserver accepts, applied to plain JSON objects.

- JSON merge patch, RFC 7386 (`application/merge-patch+json`): maps merge, null deletes,
  everything else (lists included) replaces.
- Strategic merge patch (`application/strategic-merge-patch+json`), as
  k8s.io/apimachinery/pkg/util/strategicpatch/patch.go (kubernetes commit 000f2605) applies it
  for the fields lowtide uses: lists with a `patchMergeKey` merge element-wise by that key
  (PodSpec.schedulingGates/containers/initContainers/volumes by `name`, container env by `name`,
  ports by `containerPort`, volumeMounts by `mountPath`, conditions by `type`,
  ownerReferences by `uid`), `metadata.finalizers` merges as a set of primitives, other lists
  (tolerations, node taints, args) are atomic and replace; directives `$patch: delete` (list
  element), `$patch: replace` (map or list), `$deleteFromPrimitiveList/<field>`, `$retainKeys`
  and `$setElementOrder/<field>` (accepted; order is not re-applied). Custom resources have no
  Go struct tags, so the server answers 415 for this format (handlers/patch.go).
- JSON patch, RFC 6902 (`application/json-patch+json`): add/remove/replace/move/copy/test;
  a bad document is 400, an operation that does not apply is 422 (handlers/patch.go
  `applyJSPatch`).
Neighbours: `server` picks the format from the Content-Type; `objects` stores the result.
Must NOT: validate the patched object (that is `validation`) or touch storage.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from .errors import bad_request, unprocessable

Obj = dict[str, Any]

MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY = "application/apply-patch+yaml"


# ---------------------------------------------------------------- merge patch (RFC 7386)


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# ---------------------------------------------------------------- strategic merge patch


@dataclass(frozen=True)
class ListSpec:
    """A list field with `patchStrategy: merge`; merge_key None = a set of primitives."""

    merge_key: str | None
    item: dict[str, Any] = field(default_factory=dict)


CONTAINER: dict[str, Any] = {
    "env": ListSpec("name"),
    "ports": ListSpec("containerPort"),
    "volumeMounts": ListSpec("mountPath"),
    "volumeDevices": ListSpec("devicePath"),
}
POD_SPEC: dict[str, Any] = {
    "containers": ListSpec("name", CONTAINER),
    "initContainers": ListSpec("name", CONTAINER),
    "ephemeralContainers": ListSpec("name", CONTAINER),
    "schedulingGates": ListSpec("name"),
    "volumes": ListSpec("name"),
    "imagePullSecrets": ListSpec("name"),
    "hostAliases": ListSpec("ip"),
    "resourceClaims": ListSpec("name"),
    "topologySpreadConstraints": ListSpec("topologyKey"),
}
METADATA: dict[str, Any] = {"finalizers": ListSpec(None), "ownerReferences": ListSpec("uid")}
CONDITIONS: dict[str, Any] = {"conditions": ListSpec("type")}
SCHEMAS: dict[str, dict[str, Any]] = {
    "pods": {
        "metadata": METADATA,
        "spec": POD_SPEC,
        "status": {**CONDITIONS, "podIPs": ListSpec("ip"), "hostIPs": ListSpec("ip")},
    },
    "nodes": {
        "metadata": METADATA,
        "spec": {"podCIDRs": ListSpec(None)},
        "status": {**CONDITIONS, "addresses": ListSpec("type")},
    },
    "deployments": {
        "metadata": METADATA,
        "spec": {"template": {"metadata": METADATA, "spec": POD_SPEC}},
        "status": CONDITIONS,
    },
    "horizontalpodautoscalers": {"metadata": METADATA, "status": CONDITIONS},
}
DEFAULT_SCHEMA: dict[str, Any] = {"metadata": METADATA}

DELETE_PRIMITIVE = "$deleteFromPrimitiveList/"
SET_ORDER = "$setElementOrder/"


def _strip(value: Any, schema: Any) -> Any:
    """A patch value placed where nothing was before: directives removed, maps cleaned."""
    if isinstance(value, dict):
        return _merge_map({}, value, schema if isinstance(schema, dict) else {})
    if isinstance(value, list) and isinstance(schema, ListSpec):
        return _merge_list([], value, schema)
    return copy.deepcopy(value)


def _merge_map(original: Obj, patch: Obj, schema: dict[str, Any]) -> Obj:
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: _strip(v, schema.get(k)) for k, v in patch.items() if k != "$patch"}
    if directive is not None and directive != "merge":
        raise bad_request(f"Unknown patch type: {directive} in map: {patch}")
    result = copy.deepcopy(original)
    retain = patch.get("$retainKeys")
    if retain is not None:
        if not isinstance(retain, list):
            raise bad_request("invalid patch format for retainKeys")
        missing = [k for k in patch if not k.startswith("$") and k not in retain]
        if missing:
            raise unprocessable("The retainKeys list must contain all the keys in the patch")
        result = {k: v for k, v in result.items() if k in retain}
    for key, value in patch.items():
        if key in ("$patch", "$retainKeys") or key.startswith(SET_ORDER):
            continue
        if key.startswith(DELETE_PRIMITIVE):
            name = key[len(DELETE_PRIMITIVE) :]
            if not isinstance(value, list):
                raise bad_request("invalid patch format for primitive list")
            if isinstance(result.get(name), list):
                result[name] = [v for v in result[name] if v not in value]
            continue
        sub = schema.get(key)
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict) and isinstance(result.get(key), dict) and not isinstance(sub, ListSpec):
            result[key] = _merge_map(result[key], value, sub if isinstance(sub, dict) else {})
        elif isinstance(value, list) and isinstance(sub, ListSpec):
            current = result.get(key)
            result[key] = _merge_list(current if isinstance(current, list) else [], value, sub)
        else:
            result[key] = _strip(value, sub)
    return result


def _merge_list(original: list[Any], patch: list[Any], spec: ListSpec) -> list[Any]:
    for element in patch:
        if isinstance(element, dict) and element.get("$patch") == "replace":
            return [_strip(e, spec.item) for e in patch if e is not element]
    if spec.merge_key is None:
        result = copy.deepcopy(original)
        result.extend(copy.deepcopy(v) for v in patch if v not in result)
        return result
    key = spec.merge_key
    result = copy.deepcopy(original)
    for element in patch:
        if not isinstance(element, dict):
            raise bad_request(f"unable to find api field in struct for the merge key {key!r}: {element!r}")
        if key not in element:
            raise bad_request(f"map: {element} does not contain declared merge key: {key}")
        if element.get("$patch") == "delete":
            result = [e for e in result if not (isinstance(e, dict) and e.get(key) == element[key])]
            continue
        for index, existing in enumerate(result):
            if isinstance(existing, dict) and existing.get(key) == element[key]:
                result[index] = _merge_map(existing, element, spec.item)
                break
        else:
            result.append(_merge_map({}, element, spec.item))
    return result


def strategic_merge_patch(resource: str, original: Obj, patch: Any) -> Obj:
    if not isinstance(patch, dict):
        raise bad_request("json: cannot unmarshal array into Go value of type map[string]interface {}")
    return _merge_map(original, patch, SCHEMAS.get(resource, DEFAULT_SCHEMA))


# ---------------------------------------------------------------- JSON patch (RFC 6902)


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise unprocessable(f"add operation does not apply: doc is missing path: {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(doc: Any, parts: list[str], path: str) -> Any:
    cur = doc
    for part in parts[:-1]:
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            raise unprocessable(f"doc is missing path: {path!r}: missing value")
    return cur


def _get(doc: Any, path: str) -> Any:
    parts = _pointer(path)
    if not parts:
        return doc
    parent = _parent(doc, parts, path)
    last = parts[-1]
    if isinstance(parent, dict) and last in parent:
        return parent[last]
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return parent[int(last)]
    raise unprocessable(f"doc is missing path: {path!r}: missing value")


def _add(doc: Any, path: str, value: Any) -> Any:
    parts = _pointer(path)
    if not parts:
        return value
    parent = _parent(doc, parts, path)
    last = parts[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        if last == "-":
            parent.append(value)
        elif last.isdigit() and int(last) <= len(parent):
            parent.insert(int(last), value)
        else:
            raise unprocessable(f"add operation does not apply: doc is missing path: {path!r}: missing value")
    else:
        raise unprocessable(f"add operation does not apply: doc is missing path: {path!r}: missing value")
    return doc


def _remove(doc: Any, path: str) -> Any:
    parts = _pointer(path)
    parent = _parent(doc, parts, path)
    last = parts[-1] if parts else ""
    if isinstance(parent, dict) and last in parent:
        del parent[last]
    elif isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        del parent[int(last)]
    else:
        raise unprocessable(f"Unable to remove nonexistent key: {last}: missing value")
    return doc


def json_patch(original: Obj, operations: Any) -> Any:
    if not isinstance(operations, list):
        raise bad_request("json: cannot unmarshal object into Go value of type jsonpatch.Patch")
    doc: Any = copy.deepcopy(original)
    for op in operations:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise bad_request(f"invalid JSON patch operation: {op!r}")
        kind, path = op["op"], op["path"]
        if kind in ("add", "replace", "test") and "value" not in op:
            raise bad_request(f"missing value for {kind} operation")
        if kind == "add":
            doc = _add(doc, path, copy.deepcopy(op["value"]))
        elif kind == "remove":
            doc = _remove(doc, path)
        elif kind == "replace":
            _get(doc, path)
            doc = (
                _add(_remove(doc, path), path, copy.deepcopy(op["value"])) if _pointer(path) else op["value"]
            )
        elif kind in ("move", "copy"):
            value = copy.deepcopy(_get(doc, op.get("from", "")))
            if kind == "move":
                doc = _remove(doc, op.get("from", ""))
            doc = _add(doc, path, value)
        elif kind == "test":
            if _get(doc, path) != op["value"]:
                raise unprocessable(f"testing value {path} failed: test failed")
        else:
            raise bad_request(f"Unexpected kind: {kind}")
    return doc
