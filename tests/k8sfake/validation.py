"""Create/update validation the fake applies, for the rules lowtide depends on.

Sources (kubernetes commit 000f2605, pkg/apis/core/validation/validation.go):
- `ValidatePodCreate`: a pod created with schedulingGates may not also set spec.nodeName
  ("cannot be set until all schedulingGates have been cleared").
- `ValidatePodUpdate`: containers may not be added or removed; only `containers[*].image`,
  `initContainers[*].image`, `activeDeadlineSeconds` (set, or lowered), `tolerations`
  (additions only), `schedulingGates` (deletions only: `validateOnlyDeletedSchedulingGates`,
  "only deletion is allowed, but found new scheduling gate '<name>'" at
  spec.schedulingGates[i].name) and `terminationGracePeriodSeconds` (negative → 1) may change;
  while the *old* pod is gated, `nodeSelector` may gain keys but not change or lose them
  (`validateNodeSelectorMutation`: "only additions to spec.nodeSelector are allowed (no
  mutations or deletions)") and `affinity.nodeAffinity` required terms may only gain
  expressions; anything else is "pod updates may not change fields other than ...".
- `ValidateTaint`: effect must be NoSchedule, PreferNoSchedule or NoExecute.
- apps/validation `ValidateDeploymentSpec`: replicas >= 0, selector required and matching the
  template labels. autoscaling `ValidateScale`: spec.replicas >= 0.
- `ValidateObjectMetaUpdate` (apimachinery/pkg/api/validation/objectmeta.go): no new finalizers
  once deletionTimestamp is set.
The real message for the catch-all pod rule ends with a `cmp.Diff` of the specs; the fake
names the changed top-level fields instead. Neighbours: `objects` calls these.
Must NOT: store anything or know HTTP.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .errors import FieldError

Obj = dict[str, Any]

UPDATABLE_POD_SPEC_FIELDS = [
    "`spec.containers[*].image`",
    "`spec.initContainers[*].image`",
    "`spec.activeDeadlineSeconds`",
    "`spec.tolerations` (only additions to existing tolerations)",
    "`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)",
]
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def _gate_names(spec: Obj) -> list[str]:
    return [str(g.get("name")) for g in spec.get("schedulingGates") or [] if isinstance(g, dict)]


def validate_pod_create(pod: Obj) -> list[FieldError]:
    spec = pod.get("spec") or {}
    errors: list[FieldError] = []
    if not spec.get("containers"):
        errors.append(FieldError("spec.containers", "Required", ""))
    for i, c in enumerate(spec.get("containers") or []):
        if not c.get("name"):
            errors.append(FieldError(f"spec.containers[{i}].name", "Required", ""))
        if not c.get("image"):
            errors.append(FieldError(f"spec.containers[{i}].image", "Required", ""))
    names = _gate_names(spec)
    for i, name in enumerate(names):
        if name in names[:i]:
            errors.append(FieldError(f"spec.schedulingGates[{i}].name", "Invalid", "Duplicate value", name))
    if spec.get("nodeName") and names:
        errors.append(
            FieldError(
                "spec.nodeName", "Forbidden", "cannot be set until all schedulingGates have been cleared"
            )
        )
    return errors


def _required_terms(spec: Obj) -> list[Any]:
    node_affinity = ((spec.get("affinity") or {}).get("nodeAffinity")) or {}
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    return list(required.get("nodeSelectorTerms") or [])


def _terms_only_added(new_terms: list[Any], old_terms: list[Any]) -> bool:
    if old_terms and len(new_terms) != len(old_terms):
        return False
    for new, old in zip(new_terms, old_terms, strict=False):
        for key in ("matchExpressions", "matchFields"):
            old_list, new_list = old.get(key) or [], new.get(key) or []
            if new_list[: len(old_list)] != old_list:
                return False
        if not (old.get("matchExpressions") or old.get("matchFields")) and (
            new.get("matchExpressions") or new.get("matchFields")
        ):
            return False
    return True


def validate_pod_update(new: Obj, old: Obj) -> list[FieldError]:
    new_spec = dict(new.get("spec") or {})
    old_spec = dict(old.get("spec") or {})
    errors: list[FieldError] = []
    for field in ("containers", "initContainers"):
        if len(new_spec.get(field) or []) != len(old_spec.get(field) or []):
            return [FieldError(f"spec.{field}", "Forbidden", "pod updates may not add or remove containers")]
        for i, c in enumerate(new_spec.get(field) or []):
            if not c.get("image"):
                errors.append(FieldError(f"spec.{field}[{i}].image", "Required", ""))
    new_ads, old_ads = new_spec.get("activeDeadlineSeconds"), old_spec.get("activeDeadlineSeconds")
    if new_ads is not None:
        if new_ads < 0 or new_ads > 2**31 - 1:
            errors.append(
                FieldError(
                    "spec.activeDeadlineSeconds",
                    "Invalid",
                    "must be between 0 and 2147483647, inclusive",
                    new_ads,
                )
            )
        elif old_ads is not None and old_ads < new_ads:
            errors.append(
                FieldError(
                    "spec.activeDeadlineSeconds",
                    "Invalid",
                    "must be less than or equal to previous value",
                    new_ads,
                )
            )
    elif old_ads is not None:
        errors.append(
            FieldError(
                "spec.activeDeadlineSeconds",
                "Invalid",
                "must not update from a positive integer to nil value",
                None,
            )
        )
    new_tol, old_tol = new_spec.get("tolerations") or [], old_spec.get("tolerations") or []
    for t in old_tol:
        same = [
            n
            for n in new_tol
            if {k: v for k, v in n.items() if k != "tolerationSeconds"}
            == {k: v for k, v in t.items() if k != "tolerationSeconds"}
        ]
        if not same:
            errors.append(
                FieldError(
                    "spec.tolerations",
                    "Forbidden",
                    "existing toleration can not be modified except its tolerationSeconds",
                )
            )
            break
    old_gates = _gate_names(old_spec)
    for i, name in enumerate(_gate_names(new_spec)):
        if name not in old_gates:
            errors.append(
                FieldError(
                    f"spec.schedulingGates[{i}].name",
                    "Forbidden",
                    f"only deletion is allowed, but found new scheduling gate '{name}'",
                )
            )
    munged = dict(new_spec)
    for field in ("containers", "initContainers"):
        if field in munged:
            munged[field] = [
                {**c, "image": old_c.get("image")}
                for c, old_c in zip(munged[field], old_spec.get(field) or [], strict=False)
            ]
    for field in ("activeDeadlineSeconds", "schedulingGates", "tolerations"):
        munged.pop(field, None)
        if field in old_spec:
            munged[field] = old_spec[field]
    old_tgps, new_tgps = (
        old_spec.get("terminationGracePeriodSeconds"),
        munged.get("terminationGracePeriodSeconds"),
    )
    if old_tgps is not None and old_tgps < 0 and new_tgps == 1:
        munged["terminationGracePeriodSeconds"] = old_tgps
    if old_gates:
        new_sel, old_sel = munged.get("nodeSelector") or {}, old_spec.get("nodeSelector") or {}
        if new_sel != old_sel:
            if any(k not in new_sel or new_sel[k] != v for k, v in old_sel.items()):
                errors.append(
                    FieldError(
                        "spec.nodeSelector",
                        "Invalid",
                        "only additions to spec.nodeSelector are allowed (no mutations or deletions)",
                        new_sel,
                    )
                )
            munged.pop("nodeSelector", None)
            if "nodeSelector" in old_spec:
                munged["nodeSelector"] = old_spec["nodeSelector"]
        new_terms, old_terms = _required_terms(munged), _required_terms(old_spec)
        new_na = (munged.get("affinity") or {}).get("nodeAffinity")
        old_na = (old_spec.get("affinity") or {}).get("nodeAffinity")
        if new_na != old_na:
            if old_terms and not _terms_only_added(new_terms, old_terms):
                errors.append(
                    FieldError(
                        "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms",
                        "Invalid",
                        "only additions are allowed (no mutations or deletions)",
                        new_terms,
                    )
                )
            affinity = dict(munged.get("affinity") or {})
            if old_na is None:
                affinity.pop("nodeAffinity", None)
            else:
                affinity["nodeAffinity"] = old_na
            if affinity:
                munged["affinity"] = affinity
            elif "affinity" in old_spec:
                munged["affinity"] = old_spec["affinity"]
            else:
                munged.pop("affinity", None)
    if munged != old_spec:
        changed = sorted(k for k in set(munged) | set(old_spec) if munged.get(k) != old_spec.get(k))
        errors.append(
            FieldError(
                "spec",
                "Forbidden",
                "pod updates may not change fields other than "
                + ",".join(UPDATABLE_POD_SPEC_FIELDS)
                + "\n  changed: "
                + ", ".join(f"spec.{k}" for k in changed),
            )
        )
    return errors


def validate_pod_status_update(new: Obj, old: Obj) -> list[FieldError]:
    if (new.get("spec") or {}).get("nodeName") != (old.get("spec") or {}).get("nodeName"):
        return [FieldError("status.nodeName", "Forbidden", "may not be changed directly")]
    return []


def validate_node(node: Obj) -> list[FieldError]:
    errors: list[FieldError] = []
    for i, taint in enumerate((node.get("spec") or {}).get("taints") or []):
        if not taint.get("key"):
            errors.append(FieldError(f"spec.taints[{i}].key", "Required", ""))
        effect = taint.get("effect")
        if not effect:
            errors.append(FieldError(f"spec.taints[{i}].effect", "Required", ""))
        elif effect not in TAINT_EFFECTS:
            errors.append(
                FieldError(
                    f"spec.taints[{i}].effect",
                    "NotSupported",
                    "supported values: " + ", ".join(f'"{e}"' for e in TAINT_EFFECTS),
                    effect,
                )
            )
    return errors


def validate_deployment(dep: Obj) -> list[FieldError]:
    spec = dep.get("spec") or {}
    errors: list[FieldError] = []
    replicas = spec.get("replicas")
    if isinstance(replicas, int) and replicas < 0:
        errors.append(FieldError("spec.replicas", "Invalid", "must be greater than or equal to 0", replicas))
    selector = (spec.get("selector") or {}).get("matchLabels")
    if not spec.get("selector"):
        errors.append(FieldError("spec.selector", "Required", ""))
    else:
        labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
        if selector and any(labels.get(k) != v for k, v in selector.items()):
            errors.append(
                FieldError(
                    "spec.template.metadata.labels",
                    "Invalid",
                    "`selector` does not match template `labels`",
                    labels,
                )
            )
    return errors


def validate_scale(scale: Obj) -> list[FieldError]:
    replicas = (scale.get("spec") or {}).get("replicas", 0)
    if not isinstance(replicas, int) or replicas < 0:
        return [FieldError("spec.replicas", "Invalid", "must be greater than or equal to 0", replicas)]
    return []


def validate_lease(lease: Obj) -> list[FieldError]:
    duration = (lease.get("spec") or {}).get("leaseDurationSeconds")
    if duration is not None and duration <= 0:
        return [FieldError("spec.leaseDurationSeconds", "Invalid", "must be greater than 0", duration)]
    return []


def validate_finalizers(new: Obj, old: Obj) -> list[FieldError]:
    old_meta, new_meta = old.get("metadata") or {}, new.get("metadata") or {}
    if not old_meta.get("deletionTimestamp"):
        return []
    added = [f for f in new_meta.get("finalizers") or [] if f not in (old_meta.get("finalizers") or [])]
    if added:
        return [
            FieldError(
                "metadata.finalizers",
                "Forbidden",
                f"no new finalizers can be added if the object is being deleted, found new finalizers "
                f"{json.dumps(added)}",
            )
        ]
    return []


# ---------------------------------------------------------------- object meta (all kinds)
# apimachinery/pkg/util/validation/validation.go (IsDNS1123Subdomain, IsQualifiedName,
# IsValidLabelValue) and pkg/api/validation/objectmeta.go (ValidateObjectMeta): the same
# names and labels rules apply to custom resources.

_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = rf"{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*"
_QUALIFIED_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_LABEL_VALUE = r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?"
SUBDOMAIN_MSG = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
    "and must start and end with an alphanumeric character (e.g. 'example.com', regex used for "
    "validation is '" + _DNS1123_SUBDOMAIN + "')"
)
LABEL_VALUE_MSG = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', "
    "and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or "
    "'12345', regex used for validation is '" + _LABEL_VALUE + "')"
)
NAME_PART_MSG = (
    "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with "
    "an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for "
    "validation is '" + _QUALIFIED_NAME + "')"
)


def _subdomain_errors(value: str) -> list[str]:
    errs = []
    if len(value) > 253:
        errs.append("must be no more than 253 characters")
    if not re.fullmatch(_DNS1123_SUBDOMAIN, value):
        errs.append(SUBDOMAIN_MSG)
    return errs


def _qualified_name_errors(key: str) -> list[str]:
    prefix, _, name = key.rpartition("/")
    errs = []
    if "/" in key and not prefix:
        errs.append("prefix part must be non-empty")
    elif prefix:
        errs.extend("prefix part " + e for e in _subdomain_errors(prefix))
    if not name:
        errs.append("name part must be non-empty")
    else:
        if len(name) > 63:
            errs.append("name part must be no more than 63 characters")
        if not re.fullmatch(_QUALIFIED_NAME, name):
            errs.append(NAME_PART_MSG)
    return errs


def validate_object_meta(obj: Obj, check_name: bool) -> list[FieldError]:
    meta = obj.get("metadata") or {}
    errors: list[FieldError] = []
    name = meta.get("name") or ""
    if check_name and name:
        errors.extend(FieldError("metadata.name", "Invalid", e, name) for e in _subdomain_errors(name))
    for key, raw in (meta.get("labels") or {}).items():
        errors.extend(FieldError("metadata.labels", "Invalid", e, key) for e in _qualified_name_errors(key))
        value = "" if raw is None else str(raw)
        if len(value) > 63:
            errors.append(
                FieldError("metadata.labels", "Invalid", "must be no more than 63 characters", value)
            )
        if not re.fullmatch(_LABEL_VALUE, value):
            errors.append(FieldError("metadata.labels", "Invalid", LABEL_VALUE_MSG, value))
    for key in meta.get("annotations") or {}:
        errors.extend(
            FieldError("metadata.annotations", "Invalid", e, key) for e in _qualified_name_errors(key)
        )
    return errors


# ---------------------------------------------------------------- events.k8s.io/v1 Event
# pkg/apis/core/validation/events.go (kubernetes commit 04791b49): `ValidateEventCreate` /
# `ValidateEventUpdate` with the strict rules of events.k8s.io/v1 and `legacyValidateEvent`. Field
# paths are the internal type's, as the real server reports them ("message" for note,
# "involvedObject" for regarding). Lengths are Go's len(): UTF-8 bytes.
EVENT_TYPES = ("Normal", "Warning")
REPORTING_INSTANCE_LIMIT = 128
ACTION_LIMIT = 128
REASON_LIMIT = 128
NOTE_LIMIT = 1024


def _series_errors(event: Obj) -> list[FieldError]:
    series = event.get("series")
    if series is None:
        return []
    errors: list[FieldError] = []
    if int(series.get("count") or 0) < 2:
        errors.append(FieldError("series.count", "Invalid", "should be at least 2", ""))
    if not series.get("lastObservedTime"):
        errors.append(FieldError("series.lastObservedTime", "Required", ""))
    return errors


def _legacy_event_errors(event: Obj) -> list[FieldError]:
    """`legacyValidateEvent` for an event with eventTime set (every events.k8s.io/v1 event)."""
    errors: list[FieldError] = []
    namespace = (event.get("metadata") or {}).get("namespace") or ""
    regarding_ns = (event.get("regarding") or {}).get("namespace") or ""
    if not regarding_ns and namespace not in ("default", "kube-system"):
        errors.append(FieldError("involvedObject.namespace", "Invalid", "does not match event.namespace", ""))
    controller = str(event.get("reportingController") or "")
    if not controller:
        errors.append(FieldError("reportingController", "Required", ""))
    errors.extend(
        FieldError("reportingController", "Invalid", e, controller)
        for e in _qualified_name_errors(controller)
    )
    for field_name, limit in (
        ("reportingInstance", REPORTING_INSTANCE_LIMIT),
        ("action", ACTION_LIMIT),
        ("reason", REASON_LIMIT),
    ):
        value = str(event.get(field_name) or "")
        if not value:
            errors.append(FieldError(field_name, "Required", ""))
        if len(value.encode()) > limit:
            errors.append(FieldError(field_name, "Invalid", f"can have at most {limit} characters", ""))
    if len(str(event.get("note") or "").encode()) > NOTE_LIMIT:
        errors.append(FieldError("message", "Invalid", f"can have at most {NOTE_LIMIT} characters", ""))
    return errors


def validate_event_v1_create(event: Obj) -> list[FieldError]:
    errors = _legacy_event_errors(event) + _series_errors(event)
    if not event.get("eventTime"):
        errors.append(FieldError("eventTime", "Required", ""))
    if event.get("type") not in EVENT_TYPES:
        errors.append(FieldError("type", "Invalid", f"has invalid value: {event.get('type') or ''}", ""))
    for field_name in ("deprecatedFirstTimestamp", "deprecatedLastTimestamp"):
        if event.get(field_name):
            name = "firstTimestamp" if "First" in field_name else "lastTimestamp"
            errors.append(FieldError(name, "Invalid", "needs to be unset", ""))
    if event.get("deprecatedCount"):
        errors.append(FieldError("count", "Invalid", "needs to be unset", ""))
    if event.get("deprecatedSource"):
        errors.append(FieldError("source", "Invalid", "needs to be unset", ""))
    return errors


_EVENT_IMMUTABLE = (
    ("regarding", "involvedObject"),
    ("reason", "reason"),
    ("note", "message"),
    ("type", "type"),
    ("eventTime", "eventTime"),
    ("action", "action"),
    ("related", "related"),
    ("reportingController", "reportingController"),
    ("reportingInstance", "reportingInstance"),
)


def validate_event_v1_update(new: Obj, old: Obj) -> list[FieldError]:
    """Series is the only mutable part (with metadata): everything else is immutable."""
    errors = _legacy_event_errors(new)
    if new.get("series") != old.get("series"):
        errors.extend(_series_errors(new))
    for field_name, path in _EVENT_IMMUTABLE:
        if new.get(field_name) != old.get(field_name):
            errors.append(FieldError(path, "Invalid", "field is immutable", new.get(field_name)))
    return errors
