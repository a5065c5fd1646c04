"""Job spec validation and building: document -> `JobSpec` (docs/architecture.md §6.1).

Role: the one place that decides whether a job document is valid, and says precisely where and
why it is not. `build_job_spec` checks a document (expanding a `use: TEMPLATE` through a
`TemplateLookup`) and returns the immutable `domain.spec.JobSpec`; every problem found is
collected as a `SpecIssue` and raised together in one `SpecInvalid`. Job-level fields (name,
team, priority, grace_seconds, max_retries, params) are checked here; `require_images` adds the
rule of container runtimes.

Neighbours: `spec_document` (text -> document, before this), `spec_steps` (the step and DAG
checks), `spec_issues` (issues, locations and shared checks), `spec_render` (what a built spec
becomes for one job id), `domain.spec` (the values produced), `adapters.templates` (the
file-backed `TemplateLookup`).
Must not: parse text, read files, read the clock, or know about executors or the store.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from lowtide.domain.spec import (
    DEFAULT_GRACE_SECONDS,
    PRIORITY_NAMES,
    PRIORITY_RANGE,
    JobSpec,
    StepSpec,
)
from lowtide.domain.spec_issues import (
    DOCUMENT,
    IDENT_RE,
    IDENT_RULE,
    MAX_SPEC_SECONDS,
    Issues,
    SpecInvalid,
    SpecIssue,
    check_count,
    check_keys,
    check_name,
    check_seconds,
    doc_error,
    is_valid_name,
    kind,
    suggest,
    template_prefix,
)
from lowtide.domain.spec_steps import check_placeholders, check_steps

__all__ = ["MAX_GRACE_SECONDS", "TemplateLookup", "build_job_spec", "require_images"]

#: The longest grace a step may ask for: a stop that may take longer is not a stop.
MAX_GRACE_SECONDS = MAX_SPEC_SECONDS

_TOP_KEYS = ("name", "team", "priority", "grace_seconds", "max_retries", "params", "steps", "use")


class TemplateLookup(Protocol):
    """Where `use: NAME` finds its template document (see `adapters.templates`)."""

    def load(self, name: str) -> Mapping[str, Any] | None:
        """The template's document, None when there is no such template."""
        ...

    def names(self) -> Sequence[str]:
        """Names of the available templates, sorted."""
        ...


# --------------------------------------------------------------------------- field checks


def _check_priority(value: object, loc: str, issues: Issues) -> int | None:
    low, high = PRIORITY_RANGE
    names = ", ".join(PRIORITY_NAMES)
    rule = f"use {names} or an integer from {low} to {high}"
    if isinstance(value, str):
        if value in PRIORITY_NAMES:
            return PRIORITY_NAMES[value]
        issues.add(loc, f"unknown priority {value!r}{suggest(value, list(PRIORITY_NAMES))}: {rule}")
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if low <= value <= high:
            return value
        issues.add(loc, f"must be between {low} and {high}, got {value}")
        return None
    issues.add(loc, f"must be {names} or an integer from {low} to {high}, got {kind(value)}")
    return None


def _check_no_nul(value: object, loc: str, issues: Issues) -> None:
    """No string anywhere may hold a NUL character: it cannot reach a process's argv or
    environment, and PostgreSQL text cannot store it. Escapes such as "\0" can produce one."""
    if isinstance(value, str):
        if "\x00" in value:
            issues.add(loc or DOCUMENT, "contains a NUL character")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_no_nul(item, f"{loc}[{i}]", issues)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, str) and "\x00" in key:
                issues.add(loc or DOCUMENT, "a key contains a NUL character")
                continue
            sub = f"{loc}{key}" if not loc or loc.endswith(": ") else f"{loc}.{key}"
            _check_no_nul(item, sub, issues)


def _scalar_fields(doc: Mapping[str, Any], prefix: str, issues: Issues) -> dict[str, Any]:
    """The job-level scalar fields present in `doc`, validated (a bad one is left out)."""
    checks = {
        "name": check_name,
        "team": check_name,
        "priority": _check_priority,
        "grace_seconds": check_seconds,
        "max_retries": check_count,
    }
    out: dict[str, Any] = {}
    for key, check in checks.items():
        if key in doc:
            value = check(doc[key], prefix + key, issues)
            if value is not None:
                out[key] = value
    return out


def _json_value(value: object, loc: str, issues: Issues) -> Any:
    """A JSON-compatible copy of `value` (lists and dicts), reporting what is not JSON."""
    if value is None or isinstance(value, str | bool | int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            issues.add(loc, f"must be a finite number, got {value}")
        return value
    if isinstance(value, list | tuple):
        return [_json_value(item, f"{loc}[{i}]", issues) for i, item in enumerate(value)]
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                issues.add(loc, f"keys must be strings, got {key!r}")
                continue
            out[key] = _json_value(item, f"{loc}.{key}", issues)
        return out
    issues.add(
        loc, f"must be a JSON value (string, number, boolean, null, list or mapping), got {kind(value)}"
    )
    return None


def _check_params(value: object, prefix: str, issues: Issues, *, allow_null: bool) -> dict[str, Any]:
    """Validated parameters (bad names left out); `allow_null` for templates (null = required)."""
    loc = prefix + "params"
    if not isinstance(value, Mapping):
        issues.add(loc, f"must be a mapping of parameter names to values, got {kind(value)}")
        return {}
    out: dict[str, Any] = {}
    env_names: dict[str, str] = {}
    for name, item in value.items():
        if isinstance(name, str) and name.upper() in env_names:
            issues.add(
                f"{loc}.{name}",
                f"clashes with '{env_names[name.upper()]}': both would be LOWTIDE_PARAM_{name.upper()}",
            )
            continue
        if isinstance(name, str):
            env_names[name.upper()] = name
        if not isinstance(name, str) or not IDENT_RE.fullmatch(name):
            issues.add(
                f"{loc}.{name}",
                f"{name!r} is not a valid parameter name: use {IDENT_RULE} (it becomes LOWTIDE_PARAM_<NAME>)",
            )
            continue
        if item is None and not allow_null:
            issues.add(
                f"{loc}.{name}",
                "has no value (null): give one (a null parameter means 'required' only in a template)",
            )
            continue
        out[name] = _json_value(item, f"{loc}.{name}", issues)
    return out


# --------------------------------------------------------------------------- building


def build_job_spec(
    doc: Mapping[str, Any],
    *,
    templates: TemplateLookup | None = None,
    param_overrides: Mapping[str, Any] | None = None,
    max_gpus_per_node: int | None = None,
) -> JobSpec:
    """Validate a job document and return its `JobSpec`, or raise `SpecInvalid` with every problem.

    A document either gives `steps`, or `use: TEMPLATE` (looked up in `templates`): then the
    template's name/team/priority/grace_seconds/max_retries are defaults that the job's own
    override, the job's `params` are merged over the template's (only names the template defines;
    a template param that is null is required), and problems inside the template are located with
    `template 'NAME': `. `param_overrides` (CLI `-p k=v`) are applied last, with the same rules;
    a plain job may add new parameters through them. `max_gpus_per_node` bounds each step's `gpus`.

    Round trip: `build_job_spec(spec.to_document()) == spec` for a spec built without a template.
    For a templated spec, `to_document()` has no `use`: it gives the expanded steps and merged
    params, and builds to the same spec except that `template` is None.
    """
    if not isinstance(doc, Mapping):
        raise doc_error(f"the top level must be a mapping, got {kind(doc)}")
    issues = Issues()
    _check_no_nul(doc, "", issues)
    _check_no_nul(dict(param_overrides or {}), "params", issues)
    check_keys(doc, _TOP_KEYS, DOCUMENT, issues)
    fields = _scalar_fields(doc, "", issues)
    overrides = dict(param_overrides or {})
    template: str | None = None

    if "use" not in doc:
        params = _check_params(doc.get("params", {}), "", issues, allow_null=False)
        params.update(_check_params(overrides, "", issues, allow_null=False))
        steps = check_steps(doc, "", issues, max_gpus_per_node)
        if "name" not in doc:
            issues.add("name", "required")
        if steps is not None:
            check_placeholders(steps, list(params), issues)
    else:
        template, tdoc = _load_template(doc["use"], templates, issues)
        if "steps" in doc:
            issues.add("steps", "not allowed together with 'use': the template gives the steps")
        job_params = _check_params(doc.get("params", {}), "", issues, allow_null=True)
        override_params = _check_params(overrides, "", issues, allow_null=True)
        params = {}
        steps = None
        if template is not None and tdoc is not None:
            prefix = template_prefix(template)
            _check_no_nul(tdoc, prefix, issues)
            if "use" in tdoc:
                issues.add(f"{prefix}use", "a template cannot use another template")
            check_keys(tdoc, _TOP_KEYS, prefix + DOCUMENT, issues)  # 'use' is reported just above
            fields = {**_scalar_fields(tdoc, prefix, issues), **fields}
            params = _check_params(tdoc.get("params", {}), prefix, issues, allow_null=True)
            template_params = list(params)
            have = f"it has: {', '.join(sorted(template_params))}" if template_params else "it has none"
            for name, value in (*job_params.items(), *override_params.items()):
                if name in template_params:
                    params[name] = value
                else:
                    issues.add(f"params.{name}", f"not a parameter of template {template!r} ({have})")
            for name, value in params.items():
                if value is None:
                    issues.add(f"params.{name}", f"required by template {template!r}")
            steps = check_steps(tdoc, prefix, issues, max_gpus_per_node)
            if steps is not None:
                check_placeholders(steps, template_params, issues)
            if "name" not in doc and "name" not in tdoc:
                issues.add("name", f"required (the template {template!r} gives none)")

    if issues.items:
        raise SpecInvalid(issues.items)
    assert steps is not None
    return JobSpec(
        name=fields["name"],
        team=fields.get("team", "default"),
        priority=fields.get("priority", PRIORITY_NAMES["normal"]),
        grace_seconds=fields.get("grace_seconds", DEFAULT_GRACE_SECONDS),
        max_retries=fields.get("max_retries", 0),
        params=params,
        steps=tuple(
            StepSpec(
                name=step.name or "",
                command=tuple(step.command),
                gpus=step.gpus,
                image=step.image,
                depends=step.depends,
                checkpoint=step.checkpoint,
                max_retries=step.max_retries,
                env=dict(step.env or {}),
                min_runtime=step.min_runtime,
                max_preemptions=step.max_preemptions,
                restart_seconds=step.restart_seconds,
            )
            for step in steps
        ),
        template=template,
    )


def _load_template(
    use: object, templates: TemplateLookup | None, issues: Issues
) -> tuple[str | None, Mapping[str, Any] | None]:
    if not isinstance(use, str):
        issues.add("use", f"must be a template name, got {kind(use)}")
        return None, None
    if templates is None:
        issues.add("use", "templates are not configured")
        return None, None
    tdoc: Mapping[str, Any] | None = None
    if is_valid_name(use):  # never hand a path-like name to a lookup
        try:
            tdoc = templates.load(use)
        except SpecInvalid as exc:
            issues.items.extend(exc.issues)
            return None, None
    if tdoc is None:
        names = list(templates.names())
        available = f"available: {', '.join(names)}" if names else "no templates are available"
        issues.add("use", f"unknown template {use!r} ({available})")
        return None, None
    if not isinstance(tdoc, Mapping):
        issues.add(f"{template_prefix(use)}{DOCUMENT}", f"the top level must be a mapping, got {kind(tdoc)}")
        return None, None
    return use, tdoc


def require_images(spec: JobSpec, runtime: str) -> None:
    """With a container runtime every step needs an `image`; raises SpecInvalid naming each one."""
    missing = [
        SpecIssue(
            f"steps[{i}].image", f"required: steps run in containers here (executor.runtime: {runtime})"
        )
        for i, step in enumerate(spec.steps)
        if not step.image
    ]
    if missing:
        raise SpecInvalid(missing)
