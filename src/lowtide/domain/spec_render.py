"""Rendering and DAG helpers for a built `JobSpec`: placeholders, parameters, step order.

Role: `render_step` fills a step's `{{...}}` placeholders for one job id and returns what one
attempt runs; `param_text` is a parameter as text (in commands and LOWTIDE_PARAM_<NAME>);
`parse_param_assignment` reads a CLI `NAME=VALUE`; `upstream_of` and `topological_order`
answer DAG questions for the scheduler. The placeholder grammar (PLACEHOLDER_RE,
PLACEHOLDER_FORMS) and `transitive` live here and are shared with `spec_steps`, which checks
placeholders when a spec is built.

Neighbours: `domain.spec` (the values read and produced), `domain.layout` (URIs for
`{{outputs}}` and `{{inputs.X}}`), `spec_document` (`SpecLoader` for CLI values), `spec_issues`
(the identifier rule).
Must not: validate or build specs (that is `spec_parse`/`spec_steps`), import them, read files,
or read the clock.
"""

from __future__ import annotations

import heapq
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import yaml

from lowtide.domain.layout import ArtifactLayout
from lowtide.domain.spec import JobSpec, ResolvedStep, StepSpec
from lowtide.domain.spec_document import SpecLoader, out_of_range_issues
from lowtide.domain.spec_issues import IDENT_RE, IDENT_RULE, excerpt

__all__ = [
    "PLACEHOLDER_FORMS",
    "PLACEHOLDER_RE",
    "param_text",
    "parse_param_assignment",
    "render_step",
    "topological_order",
    "transitive",
    "upstream_of",
]

PLACEHOLDER_RE = re.compile(r"\{\{\s*([^{}]*?)\s*\}\}")
PLACEHOLDER_FORMS = "{{params.NAME}}, {{outputs}}, {{inputs.STEP}}, {{job.id}}, {{job.name}}, {{step.name}}"


def transitive(start: Iterable[str], depends: Mapping[str, Sequence[str]]) -> frozenset[str]:
    """`start` and every step it depends on, directly or not, by `depends` (name -> names)."""
    seen: set[str] = set()
    todo = list(start)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(depends.get(name, ()))
    return frozenset(seen)


def param_text(value: object) -> str:
    """A parameter as text, the same in a rendered command and in LOWTIDE_PARAM_<NAME>."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    return json.dumps(value, separators=(",", ":"))


def render_step(spec: JobSpec, step: StepSpec, *, job_id: str, layout: ArtifactLayout) -> ResolvedStep:
    """`step` with its placeholders filled for job `job_id`: what one attempt runs.

    `inputs` maps every direct dependency (and any step named in `{{inputs.X}}`) to its outputs
    URI. Raises ValueError for a placeholder that `build_job_spec` would have rejected.
    """
    outputs = layout.outputs(job_id, step.name)
    inputs = {dep: layout.outputs(job_id, dep) for dep in step.depends}

    def fill(match: re.Match[str]) -> str:
        inner = match.group(1)
        if inner == "outputs":
            return outputs
        if inner == "job.id":
            return job_id
        if inner == "job.name":
            return spec.name
        if inner == "step.name":
            return step.name
        if inner.startswith("params.") and inner.removeprefix("params.") in spec.params:
            return param_text(spec.params[inner.removeprefix("params.")])
        if inner.startswith("inputs."):
            name = inner.removeprefix("inputs.")
            inputs.setdefault(name, layout.outputs(job_id, name))
            return inputs[name]
        raise ValueError(f"step {step.name!r}: cannot fill {match.group(0)}")

    def render(text: str) -> str:
        return PLACEHOLDER_RE.sub(fill, text)

    return ResolvedStep(
        name=step.name,
        command=tuple(render(arg) for arg in step.command),
        gpus=step.gpus,
        image=render(step.image) if step.image is not None else None,
        env={key: render(value) for key, value in step.env.items()},
        inputs=inputs,
        outputs=outputs,
        checkpoint_dir=layout.checkpoints(job_id, step.name) if step.checkpoint else None,
        secrets=(*spec.secrets, *(u for u in step.secrets if u not in spec.secrets)),
        gpu_memory_gib=step.gpu_memory_gib,
    )


def parse_param_assignment(text: str) -> tuple[str, Any]:
    """Parse a CLI `NAME=VALUE` into (name, value).

    VALUE is read as one YAML plain scalar with the spec rules (`spec_document`): `3` is an int, `2e-5` and
    `0.1` floats, `true`/`false` booleans, `null` None, anything else (including an empty VALUE)
    the string as written. A VALUE starting with `[` or `{` is read as a YAML/JSON list or mapping.
    Raises ValueError (echoing at most an excerpt of VALUE) for a malformed one, or an integer
    outside the spec range (`spec_document.MAX_INT`).
    """
    name, sep, raw = text.partition("=")
    if not sep:
        raise ValueError(f"expected NAME=VALUE, got {excerpt(text)} (no '=')")
    if not name:
        raise ValueError(f"expected NAME=VALUE, got {excerpt(text)} (no name before '=')")
    if not IDENT_RE.fullmatch(name):
        raise ValueError(f"{excerpt(name)} is not a valid parameter name: use {IDENT_RULE}")
    if raw == "":
        return name, ""
    if raw.lstrip().startswith(("[", "{")):
        try:
            value = yaml.load(raw, Loader=SpecLoader)  # noqa: S506 - SpecLoader is a SafeLoader
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or "malformed"
            raise ValueError(f"{name}: cannot read {excerpt(raw)} as a list or mapping: {problem}") from None
    else:
        loader = SpecLoader("")
        try:
            tag = loader.resolve(yaml.ScalarNode, raw, (True, False))  # type: ignore[no-untyped-call]
            if tag == "tag:yaml.org,2002:str":
                return name, raw
            value = loader.construct_object(yaml.ScalarNode(tag, raw))
        except yaml.YAMLError as exc:
            raise ValueError(f"{name}: cannot read {excerpt(raw)}: {exc}") from None
        finally:
            loader.dispose()
    bad = out_of_range_issues(value, name)
    if bad:
        raise ValueError("; ".join(str(issue) for issue in bad))
    return name, value


def upstream_of(spec: JobSpec, step_name: str) -> frozenset[str]:
    """Every step that `step_name` depends on, directly or not (KeyError for an unknown step)."""
    step = spec.step(step_name)
    return transitive(step.depends, {s.name: s.depends for s in spec.steps})


def topological_order(spec: JobSpec) -> tuple[str, ...]:
    """Step names so that each comes after its dependencies; among ready steps, spec order."""
    position = {step.name: i for i, step in enumerate(spec.steps)}
    waiting = {step.name: len(step.depends) for step in spec.steps}
    downstream: dict[str, list[str]] = {step.name: [] for step in spec.steps}
    for step in spec.steps:
        for dep in step.depends:
            downstream[dep].append(step.name)
    ready = [position[name] for name, count in waiting.items() if count == 0]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        name = spec.steps[heapq.heappop(ready)].name
        order.append(name)
        for child in downstream[name]:
            waiting[child] -= 1
            if waiting[child] == 0:
                heapq.heappush(ready, position[child])
    if len(order) < len(spec.steps):
        stuck = ", ".join(step.name for step in spec.steps if step.name not in order)
        raise ValueError(f"dependency cycle among {stuck}")
    return tuple(order)
