"""Job spec parsing and validation: text -> document -> `JobSpec`, and step rendering (DESIGN §5).

Role: the one place that decides whether a job spec is valid, and says precisely where and why
it is not. `parse_document` turns YAML/JSON text into a plain mapping; `build_job_spec` checks a
document (expanding a `use: TEMPLATE` through a `TemplateLookup`) and returns the immutable
`domain.spec.JobSpec`; `render_step` fills a step's `{{...}}` placeholders for one job id.
`topological_order` and `upstream_of` answer DAG questions for the scheduler.

Every problem found is collected as a `SpecIssue(loc, msg)` and raised together in one
`SpecInvalid`, so a researcher fixes a spec in one round. Locations look like
`steps[1].depends[0]`, `params.lr`, `(document)`; problems inside a template file are prefixed
with `template 'NAME': `.

YAML is read with a safe loader that rejects duplicate keys and resolves plain scalars with
YAML 1.2-style rules rather than PyYAML's YAML 1.1 ones: `yes`/`no`/`on`/`off`, dates, `1:30`,
`007` and `0x1f` stay strings; `2e-5` is a float like in JSON; only `true`/`false` are booleans.
This keeps YAML and JSON specs meaning the same thing.

Neighbours: `domain.spec` (the values produced), `domain.layout` (URIs for `{{outputs}}` and
`{{inputs.X}}`), `adapters.templates` (the file-backed `TemplateLookup`).
Must not: read files, read the clock, or know about executors or the store.
"""

from __future__ import annotations

import contextlib
import difflib
import heapq
import json
import math
import re
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import yaml

from lowtide.domain.layout import ArtifactLayout
from lowtide.domain.spec import (
    DEFAULT_GRACE_SECONDS,
    PRIORITY_NAMES,
    PRIORITY_RANGE,
    JobSpec,
    ResolvedStep,
    StepSpec,
)

__all__ = [
    "MAX_GRACE_SECONDS",
    "MAX_RETRIES",
    "MAX_SPEC_BYTES",
    "NAME_RULE",
    "SpecInvalid",
    "SpecIssue",
    "TemplateLookup",
    "build_job_spec",
    "is_valid_name",
    "parse_document",
    "parse_param_assignment",
    "render_step",
    "template_prefix",
    "topological_order",
    "upstream_of",
]

MAX_SPEC_BYTES = 1024 * 1024
#: The most retries a job or step may ask for (a count the store can hold, and more than enough).
MAX_RETRIES = 1000
#: The longest grace a step may ask for: a stop that may take longer is not a stop.
MAX_GRACE_SECONDS = 86400.0
#: A document may expand (through YAML aliases) to at most this many values; an alias-free
#: document within MAX_SPEC_BYTES never comes close, a "billion laughs" one does.
_MAX_VALUES = MAX_SPEC_BYTES

DOCUMENT = "(document)"
NAME_RULE = "1 to 63 lowercase letters, digits or '-', starting and ending with a letter or digit"
_NAME_RE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_IDENT_RULE = "letters, digits and '_', not starting with a digit"

_TOP_KEYS = ("name", "team", "priority", "grace_seconds", "max_retries", "params", "steps", "use")
_STEP_KEYS = ("name", "image", "command", "gpus", "depends", "checkpoint", "max_retries", "env")
_RESERVED_ENV_PREFIX = "LOWTIDE_"
_RESERVED_ENV = frozenset({"CUDA_VISIBLE_DEVICES"})

_PLACEHOLDER_RE = re.compile(r"\{\{\s*([^{}]*?)\s*\}\}")
_ALLOWED_FORMS = "{{params.NAME}}, {{outputs}}, {{inputs.STEP}}, {{job.id}}, {{job.name}}, {{step.name}}"


# --------------------------------------------------------------------------- issues


@dataclass(frozen=True, slots=True)
class SpecIssue:
    """One located problem: `loc` says where (`steps[1].gpus`), `msg` says what is wrong."""

    loc: str
    msg: str

    def __str__(self) -> str:
        return f"{self.loc}: {self.msg}"


class SpecInvalid(ValueError):
    """A spec (or template) with one or more problems; `str()` is one `loc: msg` per line."""

    def __init__(self, issues: Iterable[SpecIssue]) -> None:
        self.issues: tuple[SpecIssue, ...] = tuple(issues)
        super().__init__(str(self))

    def __str__(self) -> str:
        return "\n".join(str(issue) for issue in self.issues)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.issues,))


def template_prefix(name: str) -> str:
    """The location prefix for problems inside template `name`'s file."""
    return f"template {name!r}: "


def is_valid_name(text: object) -> bool:
    """True for a job, team, step or template name (it becomes part of Kubernetes/Argo names)."""
    return isinstance(text, str) and _NAME_RE.fullmatch(text) is not None


class _Issues:
    def __init__(self) -> None:
        self.items: list[SpecIssue] = []

    def add(self, loc: str, msg: str) -> None:
        self.items.append(SpecIssue(loc, msg))


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    name = type(value).__name__
    return f"{'an' if name[:1] in 'aeiou' else 'a'} {name}"


def _suggest(word: object, choices: Sequence[str]) -> str:
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# --------------------------------------------------------------------------- documents


try:
    from yaml import CSafeLoader as _BaseLoader
except ImportError:  # pragma: no cover - PyYAML built without libyaml
    from yaml import SafeLoader as _BaseLoader  # type: ignore[assignment]


class _DuplicateKey(yaml.constructor.ConstructorError):
    def __init__(self, key: object, line: int, first_line: int) -> None:
        super().__init__(None, None, f"duplicate key {key!r} at line {line} (first at line {first_line})")


class _SpecLoader(_BaseLoader):
    """Safe loader that rejects duplicate keys and resolves scalars YAML 1.2-style (see module doc)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if isinstance(key, Hashable) and key in seen:
                raise _DuplicateKey(key, line, seen[key])
            if isinstance(key, Hashable):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _construct_int(loader: _SpecLoader, node: yaml.Node) -> int:
    text = str(loader.construct_scalar(node))  # type: ignore[arg-type]
    try:
        return int(text, 10)
    except ValueError:
        raise yaml.constructor.ConstructorError(
            None, None, f"not an integer: {text!r}", node.start_mark
        ) from None


def _construct_float(loader: _SpecLoader, node: yaml.Node) -> float:
    text = str(loader.construct_scalar(node))  # type: ignore[arg-type]
    special = text.lower().lstrip("+")
    if special in (".inf", "-.inf", ".nan"):
        return float(special.replace(".", ""))
    try:
        return float(text)
    except ValueError:
        raise yaml.constructor.ConstructorError(
            None, None, f"not a number: {text!r}", node.start_mark
        ) from None


_SpecLoader.yaml_implicit_resolvers = {}
for _tag, _pattern, _first in (
    ("bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    ("int", r"^-?(?:0|[1-9][0-9]*)$", "-0123456789"),
    (
        "float",
        r"^(?:[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[-+]?[0-9]+[eE][-+]?[0-9]+"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
        "-+0123456789.",
    ),
    ("null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
    ("merge", r"^(?:<<)$", "<"),
):
    _SpecLoader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(_pattern), list(_first))
_SpecLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_SpecLoader.add_constructor("tag:yaml.org,2002:float", _construct_float)


def _doc_error(msg: str) -> SpecInvalid:
    return SpecInvalid([SpecIssue(DOCUMENT, msg)])


def _load_yaml(text: str) -> Any:
    try:
        return yaml.load(text, Loader=_SpecLoader)  # noqa: S506 - _SpecLoader is a SafeLoader
    except _DuplicateKey as exc:
        raise _doc_error(str(exc.problem)) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = exc.problem or exc.context or "malformed document"
        context = f" ({exc.context})" if exc.problem and exc.context else ""
        raise _doc_error(f"invalid YAML{where}: {what}{context}") from None
    except yaml.YAMLError as exc:
        raise _doc_error(f"invalid YAML: {exc}") from None
    except RecursionError:
        raise _doc_error("invalid YAML: nested too deeply") from None


def _reject_duplicate_json_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _doc_error(f"duplicate key {key!r}")
        out[key] = value
    return out


def _load_json(text: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_reject_duplicate_json_keys)
    except json.JSONDecodeError as exc:
        raise _doc_error(f"invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except RecursionError:
        raise _doc_error("invalid JSON: nested too deeply") from None


def _check_expansion(root: object) -> None:
    """Reject documents that alias themselves or expand to more than _MAX_VALUES values."""
    sizes: dict[int, int] = {}
    in_progress: set[int] = set()

    def size(value: object) -> int:
        if not isinstance(value, dict | list):
            return 1
        key = id(value)
        if key in sizes:
            return sizes[key]
        if key in in_progress:
            raise _doc_error("a YAML alias refers to the mapping or list that contains it")
        in_progress.add(key)
        children = value.values() if isinstance(value, dict) else value
        total = 1
        for child in children:
            total += size(child)
            if total > _MAX_VALUES:
                raise _doc_error(f"the document expands to more than {_MAX_VALUES} values (YAML aliases)")
        in_progress.discard(key)
        sizes[key] = total
        return total

    try:
        size(root)
    except RecursionError:
        raise _doc_error("the document is nested too deeply") from None


def parse_document(data: bytes | str, *, fmt: Literal["auto", "yaml", "json"] = "auto") -> dict[str, Any]:
    """Parse YAML or JSON text into a plain mapping, or raise `SpecInvalid` at `(document)`.

    Rejects input over MAX_SPEC_BYTES, bytes that are not UTF-8 (with the byte offset), malformed
    text (with line and column), duplicate keys, and a top level that is not a mapping. "auto"
    reads text starting with `{` as JSON when it parses as JSON, and as YAML otherwise.
    """
    size = len(data) if isinstance(data, bytes) else len(data.encode("utf-8", "surrogatepass"))
    if size > MAX_SPEC_BYTES:
        raise _doc_error(f"the document is {size} bytes, over the limit of {MAX_SPEC_BYTES} bytes")
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _doc_error(f"not valid UTF-8: bad byte at offset {exc.start}") from None
    else:
        text = data
    text = text.removeprefix("\ufeff")

    if fmt == "json":
        doc = _load_json(text)
    elif fmt == "yaml":
        doc = _load_yaml(text)
    else:
        doc = None
        parsed_as_json = False
        if text.lstrip().startswith("{"):
            # YAML is (nearly) a superset of JSON: when JSON fails, let YAML have its say.
            with contextlib.suppress(SpecInvalid):
                doc, parsed_as_json = _load_json(text), True
        if not parsed_as_json:
            doc = _load_yaml(text)

    if not isinstance(doc, dict):
        got = "an empty document" if doc is None else _kind(doc)
        raise _doc_error(f"the top level must be a mapping, got {got}")
    _check_expansion(doc)
    return doc


class TemplateLookup(Protocol):
    """Where `use: NAME` finds its template document (see `adapters.templates`)."""

    def load(self, name: str) -> Mapping[str, Any] | None:
        """The template's document, None when there is no such template."""
        ...

    def names(self) -> Sequence[str]:
        """Names of the available templates, sorted."""
        ...


# --------------------------------------------------------------------------- field checks


def _check_keys(doc: Mapping[Any, Any], allowed: Sequence[str], loc: str, issues: _Issues) -> None:
    for key in doc:
        if key not in allowed:
            # Located at the key itself: `colour`, `steps[1].depend`, `template 'x': nmae`.
            at = loc[: -len(DOCUMENT)] + str(key) if loc.endswith(DOCUMENT) else f"{loc}.{key}"
            issues.add(at, f"unknown key {key!r}{_suggest(key, allowed)}")


def _check_name(value: object, loc: str, issues: _Issues) -> str | None:
    if not isinstance(value, str):
        issues.add(loc, f"must be a string, got {_kind(value)}")
        return None
    if not is_valid_name(value):
        issues.add(loc, f"{value!r} is not a valid name: use {NAME_RULE}")
        return None
    return value


def _check_count(value: object, loc: str, issues: _Issues) -> int | None:
    if not isinstance(value, int) or isinstance(value, bool):
        issues.add(loc, f"must be an integer, got {_kind(value)}")
        return None
    if value < 0:
        issues.add(loc, f"must be 0 or more, got {value}")
        return None
    if value > MAX_RETRIES:
        issues.add(loc, f"must be at most {MAX_RETRIES}, got {value}")
        return None
    return value


def _check_priority(value: object, loc: str, issues: _Issues) -> int | None:
    low, high = PRIORITY_RANGE
    names = ", ".join(PRIORITY_NAMES)
    rule = f"use {names} or an integer from {low} to {high}"
    if isinstance(value, str):
        if value in PRIORITY_NAMES:
            return PRIORITY_NAMES[value]
        issues.add(loc, f"unknown priority {value!r}{_suggest(value, list(PRIORITY_NAMES))}: {rule}")
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if low <= value <= high:
            return value
        issues.add(loc, f"must be between {low} and {high}, got {value}")
        return None
    issues.add(loc, f"must be {names} or an integer from {low} to {high}, got {_kind(value)}")
    return None


def _check_no_nul(value: object, loc: str, issues: _Issues) -> None:
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


def _check_seconds(value: object, loc: str, issues: _Issues) -> float | None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        issues.add(loc, f"must be a number of seconds, got {_kind(value)}")
        return None
    if not math.isfinite(value):
        issues.add(loc, f"must be a finite number, got {value}")
        return None
    if value < 0:
        issues.add(loc, f"must be 0 or more, got {value}")
        return None
    if value > MAX_GRACE_SECONDS:
        issues.add(loc, f"must be at most {MAX_GRACE_SECONDS:g} seconds (one day), got {value:g}")
        return None
    return float(value)


def _scalar_fields(doc: Mapping[str, Any], prefix: str, issues: _Issues) -> dict[str, Any]:
    """The job-level scalar fields present in `doc`, validated (a bad one is left out)."""
    checks = {
        "name": _check_name,
        "team": _check_name,
        "priority": _check_priority,
        "grace_seconds": _check_seconds,
        "max_retries": _check_count,
    }
    out: dict[str, Any] = {}
    for key, check in checks.items():
        if key in doc:
            value = check(doc[key], prefix + key, issues)
            if value is not None:
                out[key] = value
    return out


def _json_value(value: object, loc: str, issues: _Issues) -> Any:
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
        loc, f"must be a JSON value (string, number, boolean, null, list or mapping), got {_kind(value)}"
    )
    return None


def _check_params(value: object, prefix: str, issues: _Issues, *, allow_null: bool) -> dict[str, Any]:
    """Validated parameters (bad names left out); `allow_null` for templates (null = required)."""
    loc = prefix + "params"
    if not isinstance(value, Mapping):
        issues.add(loc, f"must be a mapping of parameter names to values, got {_kind(value)}")
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
        if not isinstance(name, str) or not _IDENT_RE.fullmatch(name):
            issues.add(
                f"{loc}.{name}",
                f"{name!r} is not a valid parameter name: use {_IDENT_RULE}"
                " (it becomes LOWTIDE_PARAM_<NAME>)",
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


# --------------------------------------------------------------------------- steps


@dataclass
class _Step:
    index: int
    loc: str  # prefix + "steps[i]"
    name: str | None  # the name as given (even if invalid), None if missing or not a string
    command: list[str]
    image: str | None = None
    gpus: int = 0
    has_depends: bool = False
    raw_depends: object = None
    depends: tuple[str, ...] = ()
    checkpoint: bool = False
    max_retries: int | None = None
    env: dict[str, str] | None = None


def _check_command(value: object, loc: str, issues: _Issues) -> list[str]:
    if isinstance(value, str):
        issues.add(loc, "a plain string is not accepted: give a list of arguments, e.g. [python, train.py]")
        return []
    if not isinstance(value, list | tuple):
        issues.add(loc, f"must be a list of arguments, got {_kind(value)}")
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
            issues.add(f"{loc}[{i}]", f"must be a string, got {_kind(item)}{hint}")
    return out


def _check_env(value: object, loc: str, issues: _Issues) -> dict[str, str]:
    if not isinstance(value, Mapping):
        issues.add(loc, f"must be a mapping of variable names to strings, got {_kind(value)}")
        return {}
    out: dict[str, str] = {}
    for name, item in value.items():
        at = f"{loc}.{name}"
        if not isinstance(name, str) or not _IDENT_RE.fullmatch(name):
            issues.add(at, f"{name!r} is not a valid environment variable name: use {_IDENT_RULE}")
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
            issues.add(at, f"must be a string, got {_kind(item)}")
    return out


def _check_step(raw: object, index: int, prefix: str, issues: _Issues, max_gpus: int | None) -> _Step | None:
    loc = f"{prefix}steps[{index}]"
    if not isinstance(raw, Mapping):
        issues.add(loc, f"must be a mapping with name and command, got {_kind(raw)}")
        return None
    _check_keys(raw, _STEP_KEYS, loc, issues)

    name: str | None = None
    if "name" not in raw:
        issues.add(f"{loc}.name", "required")
    elif isinstance(raw["name"], str):
        name = raw["name"]
        _check_name(name, f"{loc}.name", issues)
    else:
        issues.add(f"{loc}.name", f"must be a string, got {_kind(raw['name'])}")

    if "command" in raw:
        command = _check_command(raw["command"], f"{loc}.command", issues)
    else:
        issues.add(f"{loc}.command", "required: give a list of arguments, e.g. [python, train.py]")
        command = []
    step = _Step(index=index, loc=loc, name=name, command=command)

    if "image" in raw:
        if isinstance(raw["image"], str) and raw["image"]:
            step.image = raw["image"]
        else:
            issues.add(f"{loc}.image", f"must be a non-empty string, got {_kind(raw['image'])}")
    if "gpus" in raw:
        gpus = raw["gpus"]
        if not isinstance(gpus, int) or isinstance(gpus, bool):
            issues.add(f"{loc}.gpus", f"must be an integer, got {_kind(gpus)}")
        elif gpus < 0:
            issues.add(f"{loc}.gpus", f"must be 0 or more, got {gpus}")
        elif max_gpus is not None and gpus > max_gpus:
            issues.add(f"{loc}.gpus", f"{gpus} GPUs requested but the largest node has {max_gpus}")
        else:
            step.gpus = gpus
    if "checkpoint" in raw:
        if isinstance(raw["checkpoint"], bool):
            step.checkpoint = raw["checkpoint"]
        else:
            issues.add(f"{loc}.checkpoint", f"must be true or false, got {_kind(raw['checkpoint'])}")
    if "max_retries" in raw:
        step.max_retries = _check_count(raw["max_retries"], f"{loc}.max_retries", issues)
    if "env" in raw:
        step.env = _check_env(raw["env"], f"{loc}.env", issues)
    if "depends" in raw:
        step.has_depends, step.raw_depends = True, raw["depends"]
    return step


def _check_depends(step: _Step, known: Mapping[str, int], issues: _Issues) -> None:
    if not step.has_depends:
        return
    raw = step.raw_depends
    loc = f"{step.loc}.depends"
    if isinstance(raw, str) or not isinstance(raw, list | tuple):
        issues.add(loc, f"must be a list of step names, e.g. [prep], got {_kind(raw)}")
        return
    out: list[str] = []
    for i, dep in enumerate(raw):
        at = f"{loc}[{i}]"
        if not isinstance(dep, str):
            issues.add(at, f"must be a step name, got {_kind(dep)}")
        elif dep == step.name:
            issues.add(at, "a step cannot depend on itself")
        elif dep not in known:
            hint = _suggest(dep, list(known)) or f" (steps: {', '.join(known)})"
            issues.add(at, f"unknown step {dep!r}{hint}")
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


def _check_cycles(steps: Sequence[_Step], issues: _Issues) -> None:
    first: dict[str, _Step] = {}
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


def _check_steps(
    doc: Mapping[str, Any], prefix: str, issues: _Issues, max_gpus: int | None
) -> list[_Step] | None:
    loc = prefix + "steps"
    if "steps" not in doc:
        issues.add(
            loc, "required: give a list of steps" + ("" if prefix else " (or use a template: 'use: NAME')")
        )
        return None
    raw_steps = doc["steps"]
    if not isinstance(raw_steps, list | tuple):
        issues.add(loc, f"must be a list of steps, got {_kind(raw_steps)}")
        return None
    if not raw_steps:
        issues.add(loc, "must contain at least one step")
        return None
    steps = [
        step
        for i, raw in enumerate(raw_steps)
        if (step := _check_step(raw, i, prefix, issues, max_gpus)) is not None
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


def _transitive(start: Iterable[str], depends: Mapping[str, Sequence[str]]) -> frozenset[str]:
    seen: set[str] = set()
    todo = list(start)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(depends.get(name, ()))
    return frozenset(seen)


def _check_placeholders(steps: Sequence[_Step], params: Sequence[str], issues: _Issues) -> None:
    """Check every `{{...}}` in commands, images and env values against params and upstream steps."""
    depends: dict[str, tuple[str, ...]] = {}
    for step in steps:
        if step.name is not None:
            depends.setdefault(step.name, step.depends)
    step_names = list(depends)

    def check(text: str, loc: str, step: _Step, upstream: frozenset[str]) -> None:
        for match in _PLACEHOLDER_RE.finditer(text):
            inner, shown = match.group(1), match.group(0)
            if inner in ("outputs", "job.id", "job.name", "step.name"):
                continue
            if inner.startswith("params."):
                name = inner.removeprefix("params.")
                if name not in params:
                    defined = (
                        f"defined: {', '.join(sorted(params))}" if params else "no parameters are defined"
                    )
                    issues.add(loc, f"unknown parameter {name!r} in {shown} ({defined})")
            elif inner.startswith("inputs."):
                name = inner.removeprefix("inputs.")
                if name not in step_names:
                    hint = _suggest(name, step_names) or f" (steps: {', '.join(step_names)})"
                    issues.add(loc, f"unknown step {name!r} in {shown}{hint}")
                elif name == step.name:
                    issues.add(loc, f"{shown} is the step's own output: use {{{{outputs}}}}")
                elif name not in upstream:
                    issues.add(
                        loc, f"step {name!r} in {shown} is not upstream of {step.name!r}: add it to 'depends'"
                    )
            else:
                issues.add(loc, f"unknown placeholder {shown} (allowed: {_ALLOWED_FORMS})")
        if "{{" in _PLACEHOLDER_RE.sub("", text):
            issues.add(
                loc, f"unmatched '{{{{': a literal '{{{{' is not allowed; placeholders are {_ALLOWED_FORMS}"
            )

    for step in steps:
        upstream = _transitive(step.depends, depends)
        for i, arg in enumerate(step.command):
            check(arg, f"{step.loc}.command[{i}]", step, upstream)
        if step.image is not None:
            check(step.image, f"{step.loc}.image", step, upstream)
        for key, value in (step.env or {}).items():
            check(value, f"{step.loc}.env.{key}", step, upstream)


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
        raise _doc_error(f"the top level must be a mapping, got {_kind(doc)}")
    issues = _Issues()
    _check_no_nul(doc, "", issues)
    _check_no_nul(dict(param_overrides or {}), "params", issues)
    _check_keys(doc, _TOP_KEYS, DOCUMENT, issues)
    fields = _scalar_fields(doc, "", issues)
    overrides = dict(param_overrides or {})
    template: str | None = None

    if "use" not in doc:
        params = _check_params(doc.get("params", {}), "", issues, allow_null=False)
        params.update(_check_params(overrides, "", issues, allow_null=False))
        steps = _check_steps(doc, "", issues, max_gpus_per_node)
        if "name" not in doc:
            issues.add("name", "required")
        if steps is not None:
            _check_placeholders(steps, list(params), issues)
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
            _check_keys(tdoc, _TOP_KEYS, prefix + DOCUMENT, issues)  # 'use' is reported just above
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
            steps = _check_steps(tdoc, prefix, issues, max_gpus_per_node)
            if steps is not None:
                _check_placeholders(steps, template_params, issues)
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
            )
            for step in steps
        ),
        template=template,
    )


def _load_template(
    use: object, templates: TemplateLookup | None, issues: _Issues
) -> tuple[str | None, Mapping[str, Any] | None]:
    if not isinstance(use, str):
        issues.add("use", f"must be a template name, got {_kind(use)}")
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
        issues.add(f"{template_prefix(use)}{DOCUMENT}", f"the top level must be a mapping, got {_kind(tdoc)}")
        return None, None
    return use, tdoc


# --------------------------------------------------------------------------- rendering and DAG


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
        return _PLACEHOLDER_RE.sub(fill, text)

    return ResolvedStep(
        name=step.name,
        command=tuple(render(arg) for arg in step.command),
        gpus=step.gpus,
        image=render(step.image) if step.image is not None else None,
        env={key: render(value) for key, value in step.env.items()},
        inputs=inputs,
        outputs=outputs,
        checkpoint_dir=layout.checkpoints(job_id, step.name) if step.checkpoint else None,
    )


def parse_param_assignment(text: str) -> tuple[str, Any]:
    """Parse a CLI `NAME=VALUE` into (name, value).

    VALUE is read as one YAML plain scalar with this module's rules: `3` is an int, `2e-5` and
    `0.1` floats, `true`/`false` booleans, `null` None, anything else (including an empty VALUE)
    the string as written. A VALUE starting with `[` or `{` is read as a YAML/JSON list or mapping.
    """
    name, sep, raw = text.partition("=")
    if not sep:
        raise ValueError(f"expected NAME=VALUE, got {text!r} (no '=')")
    if not name:
        raise ValueError(f"expected NAME=VALUE, got {text!r} (no name before '=')")
    if not _IDENT_RE.fullmatch(name):
        raise ValueError(f"{name!r} is not a valid parameter name: use {_IDENT_RULE}")
    if raw == "":
        return name, ""
    if raw.lstrip().startswith(("[", "{")):
        try:
            value = yaml.load(raw, Loader=_SpecLoader)  # noqa: S506 - _SpecLoader is a SafeLoader
        except yaml.YAMLError as exc:
            raise ValueError(f"{name}: cannot read {raw!r} as a list or mapping: {exc}") from None
        return name, value
    loader = _SpecLoader("")
    try:
        tag = loader.resolve(yaml.ScalarNode, raw, (True, False))  # type: ignore[no-untyped-call]
        if tag == "tag:yaml.org,2002:str":
            return name, raw
        return name, loader.construct_object(yaml.ScalarNode(tag, raw))
    finally:
        loader.dispose()


def upstream_of(spec: JobSpec, step_name: str) -> frozenset[str]:
    """Every step that `step_name` depends on, directly or not (KeyError for an unknown step)."""
    step = spec.step(step_name)
    return _transitive(step.depends, {s.name: s.depends for s in spec.steps})


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
