"""Job spec validation and building: document -> `JobSpec` (docs/architecture.md §6.1).

Role: the one place that decides whether a job document is valid, and says precisely where and
why it is not. `build_job_spec` checks a document (expanding a `use: TEMPLATE` through a
`TemplateLookup`) and returns the immutable `domain.spec.JobSpec`; every problem found is
collected as a `SpecIssue` and raised together in one `SpecInvalid`. Job-level fields (name,
team, priority, grace_seconds, max_retries, params) are checked here, and so are the `secrets`
of the job and of each step (names by reference: a list of names, or a mapping ENV_VAR: name;
whether the operator defines them is checked by the API, docs/architecture.md §11);
`require_images` adds the rule of container runtimes.

Neighbours: `spec_document` (text -> document, before this), `spec_steps` (the step and DAG
checks), `spec_issues` (issues, locations and shared checks), `spec_render` (what a built spec
becomes for one job id), `domain.spec` (the values produced), `adapters.templates` (the
file-backed `TemplateLookup`).
Must not: parse text, read files, read the clock, or know about executors or the store.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from lowtide.domain.image_ref import image_problem
from lowtide.domain.spec import (
    DEFAULT_GRACE_SECONDS,
    PRIORITY_NAMES,
    PRIORITY_RANGE,
    JobSpec,
    SecretUse,
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
    excerpt,
    is_valid_name,
    kind,
    suggest,
    template_prefix,
)
from lowtide.domain.spec_render import PLACEHOLDER_RE, param_text
from lowtide.domain.spec_steps import CheckedStep, check_placeholders, check_steps, check_timeout

__all__ = ["MAX_GRACE_SECONDS", "TemplateLookup", "build_job_spec", "image_warnings", "require_images"]

#: The longest grace a step may ask for: a stop that may take longer is not a stop.
MAX_GRACE_SECONDS = MAX_SPEC_SECONDS

_TOP_KEYS = (
    "name",
    "team",
    "priority",
    "grace_seconds",
    "max_retries",
    "params",
    "steps",
    "use",
    "secrets",
    "timeout",
)
_SECRET_ENV_RESERVED = ("LOWTIDE_", "CUDA_VISIBLE_DEVICES")
_ONE_KEY = object()  # a list item that is a mapping of more than one key


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
        issues.add(loc, f"unknown priority {excerpt(value)}{suggest(value, list(PRIORITY_NAMES))}: {rule}")
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


def _check_secret_env(env: object, at: str, issues: Issues) -> str | None:
    if not isinstance(env, str) or not IDENT_RE.fullmatch(env):
        issues.add(at, f"{env!r} is not a valid environment variable name: use {IDENT_RULE}")
        return None
    if env.upper().startswith(_SECRET_ENV_RESERVED[0]) or env == _SECRET_ENV_RESERVED[1]:
        issues.add(at, f"{env!r} is reserved: it is set by lowtide (the step contract)")
        return None
    return env


def _check_secrets(value: object, loc: str, issues: Issues) -> tuple[SecretUse, ...]:
    """`secrets:` of a job or step: a list of secret names (each item may also be a one-key
    mapping {ENV_VAR: name}), or a mapping ENV_VAR: name. Names only, never values."""
    rule = "give a list of secret names, or a mapping ENV_VAR: secret-name"
    items: list[tuple[str, object, object]] = []  # (loc, env or None, name)
    if isinstance(value, Mapping):
        items = [(f"{loc}.{env}", env, name) for env, name in value.items()]
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            if isinstance(item, Mapping) and len(item) == 1:
                ((env, name),) = item.items()
                items.append((f"{loc}[{i}]", env, name))
            elif isinstance(item, Mapping):
                items.append((f"{loc}[{i}]", None, _ONE_KEY))
            else:
                items.append((f"{loc}[{i}]", None, item))
    else:
        issues.add(loc, f"must be a list or a mapping, got {kind(value)}: {rule}")
        return ()
    out: list[SecretUse] = []
    envs: set[str] = set()
    for at, env, name in items:
        checked_env = None if env is None else _check_secret_env(env, at, issues)
        if env is not None and checked_env is None:
            continue
        if name is _ONE_KEY:
            issues.add(at, f"a mapping item names one secret, {{ENV_VAR: name}}; {rule}")
            continue
        if not isinstance(name, str):
            issues.add(at, f"must be a secret name, got {kind(name)}")
            continue
        if check_name(name, at, issues) is None:
            continue
        if checked_env is not None:
            if checked_env in envs:
                issues.add(at, f"{checked_env} is given twice")
                continue
            envs.add(checked_env)
        use = SecretUse(name, checked_env)
        if use in out:
            issues.add(at, f"secret {name!r} is given twice")
            continue
        out.append(use)
    return tuple(out)


def _step_secrets(
    doc: Mapping[str, Any], prefix: str, steps: Sequence[Any], issues: Issues
) -> dict[int, tuple[SecretUse, ...]]:
    """Each checked step's own `secrets` (by its index in the document's `steps`)."""
    raw_steps = doc.get("steps")
    out: dict[int, tuple[SecretUse, ...]] = {}
    if not isinstance(raw_steps, list | tuple):
        return out
    for step in steps:
        raw = raw_steps[step.index]
        if isinstance(raw, Mapping) and "secrets" in raw:
            out[step.index] = _check_secrets(raw["secrets"], f"{prefix}steps[{step.index}].secrets", issues)
    return out


def _scalar_fields(doc: Mapping[str, Any], prefix: str, issues: Issues) -> dict[str, Any]:
    """The job-level scalar fields present in `doc`, validated (a bad one is left out)."""
    checks = {
        "name": check_name,
        "team": check_name,
        "priority": _check_priority,
        "grace_seconds": check_seconds,
        "max_retries": check_count,
        "timeout": check_timeout,
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
                issues.add(loc, f"keys must be strings, got {excerpt(key)}")
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
                f"{excerpt(name)} is not a valid parameter name: use {IDENT_RULE} "
                "(it becomes LOWTIDE_PARAM_<NAME>)",
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
    max_steps_per_job: int | None = None,
    default_team: str = "default",
    max_gpu_memory_gib: float | None = None,
    override_locs: Mapping[str, str] | None = None,
) -> JobSpec:
    """Validate a job document and return its `JobSpec`, or raise `SpecInvalid` with every problem.

    A document either gives `steps`, or `use: TEMPLATE` (looked up in `templates`): then the
    template's name/team/priority/grace_seconds/max_retries are defaults that the job's own
    override, the job's `params` are merged over the template's (only names the template defines;
    a template param that is null is required), and problems inside the template are located with
    `template 'NAME': `. `param_overrides` (CLI `-p k=v`) are applied last, with the same rules:
    they may only set parameters the job (or its template) declares, so a typo is refused rather
    than silently ignored. Their problems are located at `override_locs[name]` (the API passes
    `query.param[i]`), else at `params.NAME`. `max_gpus_per_node` bounds each step's `gpus`,
    `max_steps_per_job` the number of steps (config `scheduler.max_steps_per_job`),
    `max_gpu_memory_gib` each step's `gpu_memory_gib` (the largest GPU memory of the pool's
    nodes; None: some node's is unknown, no bound). A job-level
    `timeout` is the walltime of each step that sets none (`policy.walltime`).
    `default_team` is the team of a job whose document (and template) names none (the API passes
    the submitter's first team). `secrets` of the job (or, without them, of its template) apply
    to every step; a step's own `secrets` add to them.

    Round trip: `build_job_spec(spec.to_document()) == spec` for a spec built without a template.
    For a templated spec, `to_document()` has no `use`: it gives the expanded steps and merged
    params, and builds to the same spec except that `template` is None.
    """
    if not isinstance(doc, Mapping):
        raise doc_error(f"the top level must be a mapping, got {kind(doc)}")
    issues = Issues()
    _check_no_nul(doc, "", issues)
    check_keys(doc, _TOP_KEYS, DOCUMENT, issues)
    fields = _scalar_fields(doc, "", issues)
    overrides = dict(param_overrides or {})
    template: str | None = None
    job_secrets = _check_secrets(doc["secrets"], "secrets", issues) if "secrets" in doc else None
    step_secrets: dict[int, tuple[SecretUse, ...]] = {}

    def override_loc(name: str) -> str:
        return (override_locs or {}).get(name, f"params.{name}")

    def check_overrides(allow_null: bool) -> dict[str, Any]:
        found = Issues()
        _check_no_nul(overrides, "params", found)
        checked = _check_params(overrides, "", found, allow_null=allow_null)
        for issue in found.items:  # located at the override itself (`query.param[0]`)
            name = issue.loc.removeprefix("params.").split(".")[0].split("[")[0]
            issues.add(override_loc(name) if name in overrides else issue.loc, issue.msg)
        return checked

    def unknown_override(name: str, declared: Sequence[str], of: str, hint: str = "") -> None:
        have = f"it has: {', '.join(sorted(declared))}" if declared else "it has none"
        issues.add(override_loc(name), f"{excerpt(name)} is not a parameter of {of} ({have}){hint}")

    if "use" not in doc:
        params = _check_params(doc.get("params", {}), "", issues, allow_null=False)
        raw_params = doc.get("params")
        declared = [k for k in raw_params if isinstance(k, str)] if isinstance(raw_params, Mapping) else []
        for name, value in check_overrides(allow_null=False).items():
            if name in declared:
                params[name] = value
            else:
                unknown_override(name, declared, "this job", "; declare it under 'params' to set it")
        steps = check_steps(doc, "", issues, max_gpus_per_node, max_steps_per_job, max_gpu_memory_gib)
        if "name" not in doc:
            issues.add("name", "required")
        if steps is not None:
            check_placeholders(steps, list(params), issues)
            step_secrets = _step_secrets(doc, "", steps, issues)
    else:
        template, tdoc = _load_template(doc["use"], templates, issues)
        if "steps" in doc:
            issues.add("steps", "not allowed together with 'use': the template gives the steps")
        job_params = _check_params(doc.get("params", {}), "", issues, allow_null=True)
        override_params = check_overrides(allow_null=True)
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
            for name, value in job_params.items():
                if name in template_params:
                    params[name] = value
                else:
                    issues.add(f"params.{name}", f"not a parameter of template {template!r} ({have})")
            for name, value in override_params.items():
                if name in template_params:
                    params[name] = value
                else:
                    unknown_override(name, template_params, f"template {template!r}")
            for name, value in params.items():
                if value is None:
                    at = override_loc(name) if name in override_params else f"params.{name}"
                    issues.add(at, f"required by template {template!r}")
            steps = check_steps(
                tdoc, prefix, issues, max_gpus_per_node, max_steps_per_job, max_gpu_memory_gib
            )
            if steps is not None:
                check_placeholders(steps, template_params, issues)
                step_secrets = _step_secrets(tdoc, prefix, steps, issues)
            if job_secrets is None and "secrets" in tdoc:
                job_secrets = _check_secrets(tdoc["secrets"], f"{prefix}secrets", issues)
            if "name" not in doc and "name" not in tdoc:
                issues.add("name", f"required (the template {template!r} gives none)")

    if steps is not None:
        _check_images(steps, params, issues)
    if issues.items:
        raise SpecInvalid(issues.items)
    assert steps is not None
    return JobSpec(
        name=fields["name"],
        team=fields.get("team", default_team),
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
                timeout=step.timeout,
                secrets=step_secrets.get(step.index, ()),
                gpu_memory_gib=step.gpu_memory_gib,
            )
            for step in steps
        ),
        template=template,
        timeout=fields.get("timeout"),
        secrets=job_secrets or (),
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
        issues.add("use", f"unknown template {excerpt(use)} ({available})")
        return None, None
    if not isinstance(tdoc, Mapping):
        issues.add(f"{template_prefix(use)}{DOCUMENT}", f"the top level must be a mapping, got {kind(tdoc)}")
        return None, None
    return use, tdoc


def _check_images(steps: Sequence[CheckedStep], params: Mapping[str, Any], issues: Issues) -> None:
    """Each step's image, its `{{params.X}}` filled in, must be a pullable reference
    (`domain.image_ref`); one still holding another placeholder is left to rendering."""

    def fill(match: re.Match[str]) -> str:
        inner = match.group(1)
        name = inner.removeprefix("params.")
        if inner.startswith("params.") and params.get(name) is not None:
            return param_text(params[name])
        return match.group(0)

    for step in steps:
        if step.image is None:
            continue
        image = PLACEHOLDER_RE.sub(fill, step.image)
        if PLACEHOLDER_RE.search(image):
            continue
        problem = image_problem(image)
        if problem is not None:
            issues.add(f"{step.loc}.image", f"{problem}; got {excerpt(image)}")


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


def image_warnings(spec: JobSpec, runtime: str) -> list[SpecIssue]:
    """With the process runtime an `image` is ignored: one warning per step that gives one
    (the API returns them as `warnings`, the CLI prints them; the job is accepted)."""
    if runtime != "process":
        return []
    return [
        SpecIssue(
            f"steps[{i}].image",
            "ignored: steps run as plain processes here (executor.runtime: process), not in containers",
        )
        for i, step in enumerate(spec.steps)
        if step.image
    ]
