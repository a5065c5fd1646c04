"""Step and DAG checks for a job or template document: steps, depends, cycles, placeholders.

Role: `check_steps` validates a document's `steps` list (each step's keys, name, command, image,
gpus, gpu_memory_gib, checkpoint, max_retries and env, unique names, `depends` and dependency cycles) and
returns the steps as `CheckedStep`s; `check_placeholders` checks every `{{...}}` in commands,
images and env values against the parameters and each step's upstream steps. Problems are
collected in an `Issues`, never raised here.

Neighbours: `spec_parse.build_job_spec` (the only caller; it turns `CheckedStep`s into
`domain.spec.StepSpec`s), `spec_issues` (issues and shared checks), `spec_render` (the
placeholder grammar and `transitive`, shared with rendering).
Must not: build `JobSpec`s, raise for a bad spec (collect instead), read files, or read the clock.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lowtide.domain.spec import DEFAULT_RESTART_SECONDS
from lowtide.domain.spec_issues import (
    EXCERPT_CHARS,
    IDENT_RE,
    IDENT_RULE,
    Issues,
    check_count,
    check_keys,
    check_name,
    check_seconds,
    excerpt,
    kind,
    suggest,
)
from lowtide.domain.spec_render import PLACEHOLDER_FORMS, PLACEHOLDER_RE, transitive

__all__ = [
    "MAX_GPU_MEMORY_GIB",
    "MAX_TIMEOUT_SECONDS",
    "CheckedStep",
    "check_placeholders",
    "check_steps",
    "check_timeout",
]

_STEP_KEYS = (
    "name",
    "image",
    "command",
    "gpus",
    "gpu_memory_gib",
    "depends",
    "checkpoint",
    "max_retries",
    "env",
    "min_runtime",
    "max_preemptions",
    "restart_seconds",
    "timeout",
    "secrets",  # by reference; checked by spec_parse (docs/architecture.md §11)
)
_RESERVED_ENV_PREFIX = "LOWTIDE_"
_RESERVED_ENV = frozenset({"CUDA_VISIBLE_DEVICES"})


@dataclass
class CheckedStep:
    """One step as checked so far; fields that failed a check keep their defaults."""

    index: int
    loc: str  # prefix + "steps[i]"
    name: str | None  # the name as given (even if invalid), None if missing or not a string
    command: list[str]
    image: str | None = None
    gpus: int = 0
    gpu_memory_gib: float | None = None
    has_depends: bool = False
    raw_depends: object = None
    depends: tuple[str, ...] = ()
    checkpoint: bool = False
    max_retries: int | None = None
    env: dict[str, str] | None = None
    min_runtime: float = 0.0
    max_preemptions: int | None = None
    restart_seconds: float = DEFAULT_RESTART_SECONDS
    timeout: float | None = None


#: The most GiB per GPU a step may ask for when the pool's GPU memory is unknown (a sanity bound).
MAX_GPU_MEMORY_GIB = 1_000_000.0


def _check_gpu_memory(value: object, loc: str, issues: Issues, max_memory: float | None) -> float | None:
    """`gpu_memory_gib`: GiB each of the step's GPUs must have free, a number > 0; at most the
    largest GPU memory of the pool's nodes when every node's is known (`max_memory`)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        issues.add(loc, f"must be a number of GiB per GPU, got {kind(value)}")
        return None
    if isinstance(value, int) and value > MAX_GPU_MEMORY_GIB:  # compared as int: no float overflow
        issues.add(loc, f"must be at most {MAX_GPU_MEMORY_GIB:.0f} GiB, got {excerpt(value)}")
        return None
    memory = float(value)
    if not math.isfinite(memory) or memory <= 0:
        issues.add(loc, f"must be a number of GiB more than 0, got {excerpt(value)}")
        return None
    if memory > MAX_GPU_MEMORY_GIB:
        issues.add(loc, f"must be at most {MAX_GPU_MEMORY_GIB:.0f} GiB, got {excerpt(value)}")
        return None
    if max_memory is not None and memory > max_memory:
        issues.add(
            loc,
            f"{_gib(memory)} GiB per GPU requested but no node's GPUs have more than {_gib(max_memory)} GiB",
        )
        return None
    return memory


def _gib(x: float) -> str:
    return f"{x:.1f}".removesuffix(".0")


#: The longest walltime a spec may set (366 days); no `timeout` at all means no limit.
MAX_TIMEOUT_SECONDS = 366 * 86400.0
_TIMEOUT_RULE = "a number of seconds or a duration such as '90m', '2h', '1h30m' or '3d'"
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*([dhms])")
_DURATION_TEXT = re.compile(r"(?:\d+(?:\.\d+)?\s*[dhms]\s*)+")
_NUMBER_TEXT = re.compile(r"\d+(?:\.\d+)?")
_UNIT_SECONDS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}


def check_timeout(value: object, loc: str, issues: Issues) -> float | None:
    """A walltime (`timeout` of a job or a step) in seconds, else None, reported.

    Accepted: a positive number of seconds, or a duration text such as "90m", "2h", "1h30m",
    "1.5h" or "3d" (units d, h, m, s; a bare number is seconds); at most MAX_TIMEOUT_SECONDS.
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        issues.add(loc, f"must be {_TIMEOUT_RULE}, got {kind(value)}")
        return None
    if isinstance(value, str):
        text = value.strip()
        if len(text) > 64:  # no duration is that long; never scan a megabyte
            seconds = math.nan
        elif _NUMBER_TEXT.fullmatch(text):
            seconds = float(text)
        elif _DURATION_TEXT.fullmatch(text):
            seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in _DURATION_PART.findall(text))
        else:
            seconds = math.nan
        if math.isnan(seconds):
            issues.add(loc, f"must be {_TIMEOUT_RULE}, got {excerpt(value)}")
            return None
    elif isinstance(value, int) and value > MAX_TIMEOUT_SECONDS:  # compared as int: no float overflow
        seconds = math.inf
    else:
        seconds = float(value)
    if math.isnan(seconds):
        issues.add(loc, "must be a finite number of seconds, got nan")
        return None
    if seconds <= 0:
        issues.add(loc, f"must be more than 0 seconds (leave it out for no limit), got {excerpt(value)}")
        return None
    if seconds > MAX_TIMEOUT_SECONDS:
        issues.add(loc, f"must be at most {MAX_TIMEOUT_SECONDS:.0f} seconds (366 days), got {excerpt(value)}")
        return None
    return seconds


def _check_command(value: object, loc: str, issues: Issues) -> list[str]:
    if isinstance(value, str):
        issues.add(loc, "a plain string is not accepted: give a list of arguments, e.g. [python, train.py]")
        return []
    if not isinstance(value, list | tuple):
        issues.add(loc, f"must be a list of arguments, got {kind(value)}")
        return []
    if not value:
        issues.add(loc, "must not be empty: give the program and its arguments")
        return []
    out: list[str] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, int) and not isinstance(item, bool):
            out.append(str(item))
        else:
            out.append("")  # keeps later indices aligned for placeholder locations
            hint = " (quote it to keep it exactly as written)" if isinstance(item, float | bool) else ""
            issues.add(f"{loc}[{i}]", f"must be a string, got {kind(item)}{hint}")
    return out


def _check_env(value: object, loc: str, issues: Issues) -> dict[str, str]:
    if not isinstance(value, Mapping):
        issues.add(loc, f"must be a mapping of variable names to strings, got {kind(value)}")
        return {}
    out: dict[str, str] = {}
    for name, item in value.items():
        at = f"{loc}.{name}"
        if not isinstance(name, str) or not IDENT_RE.fullmatch(name):
            issues.add(at, f"{excerpt(name)} is not a valid environment variable name: use {IDENT_RULE}")
            continue
        if name.upper().startswith(_RESERVED_ENV_PREFIX) or name in _RESERVED_ENV:
            issues.add(
                at,
                f"{name!r} is reserved: CUDA_VISIBLE_DEVICES and names starting with "
                f"{_RESERVED_ENV_PREFIX} are set by lowtide (the step contract)",
            )
            continue
        if isinstance(item, str):
            out[name] = item
        elif isinstance(item, int) and not isinstance(item, bool):
            out[name] = str(item)
        else:
            issues.add(at, f"must be a string, got {kind(item)}")
    return out


def _check_step(
    raw: object, index: int, prefix: str, issues: Issues, max_gpus: int | None, max_memory: float | None
) -> CheckedStep | None:
    loc = f"{prefix}steps[{index}]"
    if not isinstance(raw, Mapping):
        issues.add(loc, f"must be a mapping with name and command, got {kind(raw)}")
        return None
    check_keys(raw, _STEP_KEYS, loc, issues)

    name: str | None = None
    if "name" not in raw:
        issues.add(f"{loc}.name", "required")
    elif isinstance(raw["name"], str):
        name = raw["name"]
        check_name(name, f"{loc}.name", issues)
    else:
        issues.add(f"{loc}.name", f"must be a string, got {kind(raw['name'])}")

    if "command" in raw:
        command = _check_command(raw["command"], f"{loc}.command", issues)
    else:
        issues.add(f"{loc}.command", "required: give a list of arguments, e.g. [python, train.py]")
        command = []
    step = CheckedStep(index=index, loc=loc, name=name, command=command)

    if "image" in raw:
        if isinstance(raw["image"], str) and raw["image"]:
            step.image = raw["image"]
        else:
            issues.add(f"{loc}.image", f"must be a non-empty string, got {kind(raw['image'])}")
    if "gpus" in raw:
        gpus = raw["gpus"]
        if not isinstance(gpus, int) or isinstance(gpus, bool):
            issues.add(f"{loc}.gpus", f"must be an integer, got {kind(gpus)}")
        elif gpus < 0:
            issues.add(f"{loc}.gpus", f"must be 0 or more, got {gpus}")
        elif max_gpus is not None and gpus > max_gpus:
            issues.add(f"{loc}.gpus", f"{gpus} GPUs requested but the largest node has {max_gpus}")
        else:
            step.gpus = gpus
    if "gpu_memory_gib" in raw:
        at = f"{loc}.gpu_memory_gib"
        step.gpu_memory_gib = _check_gpu_memory(raw["gpu_memory_gib"], at, issues, max_memory)
        cpu_only = "gpus" not in raw or (type(raw["gpus"]) is int and raw["gpus"] == 0)
        if step.gpu_memory_gib is not None and cpu_only:
            issues.add(at, "only for a step with GPUs: give gpus (1 or more) too")
    if "checkpoint" in raw:
        if isinstance(raw["checkpoint"], bool):
            step.checkpoint = raw["checkpoint"]
        else:
            issues.add(f"{loc}.checkpoint", f"must be true or false, got {kind(raw['checkpoint'])}")
    if "max_retries" in raw:
        step.max_retries = check_count(raw["max_retries"], f"{loc}.max_retries", issues)
    if "max_preemptions" in raw:
        step.max_preemptions = check_count(raw["max_preemptions"], f"{loc}.max_preemptions", issues)
    for key in ("min_runtime", "restart_seconds"):
        if key in raw and (seconds := check_seconds(raw[key], f"{loc}.{key}", issues)) is not None:
            setattr(step, key, seconds)
    if "timeout" in raw:
        step.timeout = check_timeout(raw["timeout"], f"{loc}.timeout", issues)
    if "env" in raw:
        step.env = _check_env(raw["env"], f"{loc}.env", issues)
    if "depends" in raw:
        step.has_depends, step.raw_depends = True, raw["depends"]
    return step


def _check_depends(step: CheckedStep, known: Mapping[str, int], issues: Issues) -> None:
    if not step.has_depends:
        return
    raw = step.raw_depends
    loc = f"{step.loc}.depends"
    if isinstance(raw, str) or not isinstance(raw, list | tuple):
        issues.add(loc, f"must be a list of step names, e.g. [prep], got {kind(raw)}")
        return
    out: list[str] = []
    for i, dep in enumerate(raw):
        at = f"{loc}[{i}]"
        if not isinstance(dep, str):
            issues.add(at, f"must be a step name, got {kind(dep)}")
        elif dep == step.name:
            issues.add(at, "a step cannot depend on itself")
        elif dep not in known:
            hint = suggest(dep, list(known)) or f" (steps: {', '.join(known)})"
            issues.add(at, f"unknown step {excerpt(dep)}{hint}")
        elif dep in out:
            issues.add(at, f"duplicate dependency {dep!r}")
        else:
            out.append(dep)
    step.depends = tuple(out)


def _strongly_connected(nodes: Sequence[str], succ: Mapping[str, Sequence[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (specs may have many steps)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for root in nodes:
        if root in index:
            continue
        work: list[tuple[str, int]] = [(root, 0)]
        while work:
            node, i = work[-1]
            if i == 0 and node not in index:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            children = succ[node]
            if i < len(children):
                work[-1] = (node, i + 1)
                child = children[i]
                if child not in index:
                    work.append((child, 0))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                out.append(component)
    return out


def _check_cycles(steps: Sequence[CheckedStep], issues: Issues) -> None:
    first: dict[str, CheckedStep] = {}
    for step in steps:
        if step.name is not None and step.name not in first:
            first[step.name] = step
    # Edges point downstream (from a dependency to the step that needs it), so a cycle reads in
    # the order the steps would have to run: prep -> train -> eval -> prep.
    succ: dict[str, list[str]] = {name: [] for name in first}
    for name, step in first.items():
        for dep in step.depends:
            succ[dep].append(name)
    found: list[tuple[int, str, str]] = []
    for component in _strongly_connected(list(first), succ):
        if len(component) < 2:
            continue
        members = set(component)
        start = min(component, key=lambda n: first[n].index)
        # Shortest way from start back to itself inside the component, neighbours in spec order.
        came_from: dict[str, str] = {}
        frontier = [start]
        end: str | None = None
        while frontier and end is None:
            nxt: list[str] = []
            for node in frontier:
                for child in succ[node]:
                    if child not in members:
                        continue
                    if child == start:
                        end = node
                        break
                    if child not in came_from:
                        came_from[child] = node
                        nxt.append(child)
                if end is not None:
                    break
            frontier = nxt
        path = [start]
        node = end if end is not None else start
        while node != start:
            path.append(node)
            node = came_from[node]
        cycle = [start, *reversed(path[1:]), start]
        found.append((first[start].index, f"{first[start].loc}.depends", " -> ".join(cycle)))
    for _, loc, cycle_text in sorted(found):
        issues.add(loc, f"dependency cycle {cycle_text}")


def check_steps(
    doc: Mapping[str, Any],
    prefix: str,
    issues: Issues,
    max_gpus: int | None,
    max_steps: int | None = None,
    max_memory: float | None = None,
) -> list[CheckedStep] | None:
    """The document's steps as checked; None when there are none to check. `max_steps` (config
    `scheduler.max_steps_per_job`) bounds their number: a longer list is reported at `steps` and
    not checked further (a 10,000-step spec over the limit costs one check, not 10,000).
    `max_memory` (GiB; None: unknown) bounds each step's `gpu_memory_gib`."""
    loc = prefix + "steps"
    if "steps" not in doc:
        issues.add(
            loc, "required: give a list of steps" + ("" if prefix else " (or use a template: 'use: NAME')")
        )
        return None
    raw_steps = doc["steps"]
    if not isinstance(raw_steps, list | tuple):
        issues.add(loc, f"must be a list of steps, got {kind(raw_steps)}")
        return None
    if not raw_steps:
        issues.add(loc, "must contain at least one step")
        return None
    if max_steps is not None and len(raw_steps) > max_steps:
        issues.add(loc, f"{len(raw_steps)} steps; the limit is {max_steps} (scheduler.max_steps_per_job)")
        return None
    steps = [
        step
        for i, raw in enumerate(raw_steps)
        if (step := _check_step(raw, i, prefix, issues, max_gpus, max_memory)) is not None
    ]
    known: dict[str, int] = {}
    for step in steps:
        if step.name is None:
            continue
        if step.name in known:
            issues.add(
                f"{step.loc}.name", f"duplicate step name {step.name!r} (also steps[{known[step.name]}])"
            )
        else:
            known[step.name] = step.index
    for step in steps:
        _check_depends(step, known, issues)
    _check_cycles(steps, issues)
    return steps


def check_placeholders(steps: Sequence[CheckedStep], params: Sequence[str], issues: Issues) -> None:
    """Check every `{{...}}` in commands, images and env values against params and upstream steps."""
    depends: dict[str, tuple[str, ...]] = {}
    for step in steps:
        if step.name is not None:
            depends.setdefault(step.name, step.depends)
    step_names = list(depends)

    def check(text: str, loc: str, step: CheckedStep, upstream: frozenset[str]) -> None:
        for match in PLACEHOLDER_RE.finditer(text):
            inner, shown = match.group(1), match.group(0)
            shown = shown if len(shown) <= EXCERPT_CHARS else shown[:EXCERPT_CHARS] + "…"
            if inner in ("outputs", "job.id", "job.name", "step.name"):
                continue
            if inner.startswith("params."):
                name = inner.removeprefix("params.")
                if name not in params:
                    defined = (
                        f"defined: {', '.join(sorted(params))}" if params else "no parameters are defined"
                    )
                    issues.add(loc, f"unknown parameter {excerpt(name)} in {shown} ({defined})")
            elif inner.startswith("inputs."):
                name = inner.removeprefix("inputs.")
                if name not in step_names:
                    hint = suggest(name, step_names) or f" (steps: {', '.join(step_names)})"
                    issues.add(loc, f"unknown step {excerpt(name)} in {shown}{hint}")
                elif name == step.name:
                    issues.add(loc, f"{shown} is the step's own output: use {{{{outputs}}}}")
                elif name not in upstream:
                    issues.add(
                        loc, f"step {name!r} in {shown} is not upstream of {step.name!r}: add it to 'depends'"
                    )
            else:
                issues.add(loc, f"unknown placeholder {shown} (allowed: {PLACEHOLDER_FORMS})")
        if "{{" in PLACEHOLDER_RE.sub("", text):
            issues.add(
                loc,
                f"unmatched '{{{{': a literal '{{{{' is not allowed; placeholders are {PLACEHOLDER_FORMS}",
            )

    for step in steps:
        upstream = transitive(step.depends, depends)
        for i, arg in enumerate(step.command):
            check(arg, f"{step.loc}.command[{i}]", step, upstream)
        if step.image is not None:
            check(step.image, f"{step.loc}.image", step, upstream)
        for key, value in (step.env or {}).items():
            check(value, f"{step.loc}.env.{key}", step, upstream)
