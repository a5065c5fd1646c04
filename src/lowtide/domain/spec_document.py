"""Spec documents: YAML/JSON bytes or text -> a plain mapping, or `SpecInvalid` at `(document)`.

Role: `parse_document` is the one way spec text becomes a document. It enforces MAX_SPEC_BYTES,
UTF-8, well-formed YAML/JSON without duplicate keys, a mapping at the top level, and a bound on
how far YAML aliases may expand the document ("billion laughs").

YAML is read with a safe loader (`SpecLoader`) that rejects duplicate keys and resolves plain
scalars with YAML 1.2-style rules rather than PyYAML's YAML 1.1 ones: `yes`/`no`/`on`/`off`,
dates, `1:30`, `007` and `0x1f` stay strings; `2e-5` is a float like in JSON; only
`true`/`false` are booleans. This keeps YAML and JSON specs meaning the same thing.

Numbers are bounded: an integer must fit in 64 bits (MIN_INT..MAX_INT). A larger one (CPython
3.11+ refuses to convert more than `sys.int_info.default_max_str_digits` = 4,300 digits between
int and str, raising ValueError, and no field needs more than 64 bits) is read as an
`OutOfRange` placeholder holding a short excerpt of its digits, never as an int, and
`parse_document` refuses the document with every such number located (`steps[0].gpus`);
`out_of_range_issues` does the same for other values read with `SpecLoader` (CLI `-p k=v`).
Non-finite floats (`.inf`, `NaN`, `1e999`) are plain floats here; each field's own check refuses
them, located.

Neighbours: `spec_issues` (how problems are reported); `spec_parse.build_job_spec` validates the
documents made here; `spec_render.parse_param_assignment` reads CLI values with `SpecLoader`.
Must not: validate what a document means (that is `spec_parse`), read files, or read the clock.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import yaml

from lowtide.domain.spec_issues import (
    DOCUMENT,
    EXCERPT_CHARS,
    SpecInvalid,
    SpecIssue,
    doc_error,
    excerpt,
    kind,
)

__all__ = [
    "MAX_INT",
    "MAX_SPEC_BYTES",
    "MIN_INT",
    "OutOfRange",
    "SpecLoader",
    "out_of_range_issues",
    "parse_document",
]

MAX_SPEC_BYTES = 1024 * 1024
#: A document may expand (through YAML aliases) to at most this many values; an alias-free
#: document within MAX_SPEC_BYTES never comes close, a "billion laughs" one does.
_MAX_VALUES = MAX_SPEC_BYTES


#: The range of an integer in a spec: 64-bit signed (what the store's columns and JSON tools hold).
MAX_INT = 2**63 - 1
MIN_INT = -(2**63)
_MAX_DIGITS = len(str(MAX_INT))


@dataclass(frozen=True, slots=True)
class OutOfRange:
    """An integer literal outside MIN_INT..MAX_INT, kept as an excerpt of its text (never converted)."""

    head: str  # at most EXCERPT_CHARS characters of the literal
    digits: int

    def __str__(self) -> str:
        more = "…" if self.digits > len(self.head.lstrip("+-")) else ""
        return f"{self.head}{more}"

    @property
    def message(self) -> str:
        return (
            f"integer out of range: {self}{f' ({self.digits} digits)' if self.digits > _MAX_DIGITS else ''}; "
            f"integers must be between {MIN_INT} and {MAX_INT}"
        )


def _bounded_int(text: str) -> int | OutOfRange:
    """`text` (an integer literal) as an int, or OutOfRange without ever converting a huge one."""
    digits = len(text.lstrip("+-"))
    if digits <= _MAX_DIGITS:
        value = int(text, 10)
        if MIN_INT <= value <= MAX_INT:
            return value
    return OutOfRange(text[:EXCERPT_CHARS], digits)


def _walk_out_of_range(value: object, loc: str, seen: set[int]) -> Iterator[SpecIssue]:
    if isinstance(value, OutOfRange):
        yield SpecIssue(loc or DOCUMENT, value.message)
    elif isinstance(value, dict | list):
        if id(value) in seen:  # a YAML alias: its content was looked at where it was defined
            return
        seen.add(id(value))
        if isinstance(value, list):
            for i, item in enumerate(value):
                yield from _walk_out_of_range(item, f"{loc}[{i}]", seen)
            return
        for key, item in value.items():
            if isinstance(key, OutOfRange):
                yield SpecIssue(loc or DOCUMENT, f"a key is an {key.message}")
                continue
            name = key if isinstance(key, str) and len(key) <= EXCERPT_CHARS else excerpt(key)
            yield from _walk_out_of_range(item, f"{loc}.{name}" if loc else str(name), seen)


def out_of_range_issues(value: object, loc: str = "") -> list[SpecIssue]:
    """Every integer out of MIN_INT..MAX_INT in `value` (as read here), located under `loc`."""
    return list(_walk_out_of_range(value, loc, set()))


try:
    from yaml import CSafeLoader as _BaseLoader
except ImportError:  # pragma: no cover - PyYAML built without libyaml
    from yaml import SafeLoader as _BaseLoader  # type: ignore[assignment]


class _DuplicateKey(yaml.constructor.ConstructorError):
    def __init__(self, key: object, line: int, first_line: int) -> None:
        super().__init__(
            None, None, f"duplicate key {excerpt(key)} at line {line} (first at line {first_line})"
        )


class SpecLoader(_BaseLoader):
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


def _construct_int(loader: SpecLoader, node: yaml.Node) -> int | OutOfRange:
    text = str(loader.construct_scalar(node))  # type: ignore[arg-type]
    try:
        return _bounded_int(text)
    except ValueError:
        raise yaml.constructor.ConstructorError(
            None, None, f"not an integer: {excerpt(text)}", node.start_mark
        ) from None


def _construct_float(loader: SpecLoader, node: yaml.Node) -> float:
    text = str(loader.construct_scalar(node))  # type: ignore[arg-type]
    special = text.lower().lstrip("+")
    if special in (".inf", "-.inf", ".nan"):
        return float(special.replace(".", ""))
    try:
        return float(text)
    except ValueError:
        raise yaml.constructor.ConstructorError(
            None, None, f"not a number: {excerpt(text)}", node.start_mark
        ) from None


SpecLoader.yaml_implicit_resolvers = {}
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
    SpecLoader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(_pattern), list(_first))
SpecLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
SpecLoader.add_constructor("tag:yaml.org,2002:float", _construct_float)


def _load_yaml(text: str) -> Any:
    try:
        return yaml.load(text, Loader=SpecLoader)  # noqa: S506 - SpecLoader is a SafeLoader
    except _DuplicateKey as exc:
        raise doc_error(str(exc.problem)) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = exc.problem or exc.context or "malformed document"
        context = f" ({exc.context})" if exc.problem and exc.context else ""
        raise doc_error(f"invalid YAML{where}: {what}{context}") from None
    except yaml.YAMLError as exc:
        raise doc_error(f"invalid YAML: {exc}") from None
    except RecursionError:
        raise doc_error("invalid YAML: nested too deeply") from None


def _reject_duplicate_json_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise doc_error(f"duplicate key {excerpt(key)}")
        out[key] = value
    return out


def _load_json(text: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_reject_duplicate_json_keys, parse_int=_bounded_int)
    except json.JSONDecodeError as exc:
        raise doc_error(f"invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except RecursionError:
        raise doc_error("invalid JSON: nested too deeply") from None


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
            raise doc_error("a YAML alias refers to the mapping or list that contains it")
        in_progress.add(key)
        children = value.values() if isinstance(value, dict) else value
        total = 1
        for child in children:
            total += size(child)
            if total > _MAX_VALUES:
                raise doc_error(f"the document expands to more than {_MAX_VALUES} values (YAML aliases)")
        in_progress.discard(key)
        sizes[key] = total
        return total

    try:
        size(root)
    except RecursionError:
        raise doc_error("the document is nested too deeply") from None


def parse_document(data: bytes | str, *, fmt: Literal["auto", "yaml", "json"] = "auto") -> dict[str, Any]:
    """Parse YAML or JSON text into a plain mapping, or raise `SpecInvalid` at `(document)`.

    Rejects input over MAX_SPEC_BYTES, bytes that are not UTF-8 (with the byte offset), malformed
    text (with line and column), duplicate keys, and a top level that is not a mapping. "auto"
    reads text starting with `{` as JSON when it parses as JSON, and as YAML otherwise.
    """
    size = len(data) if isinstance(data, bytes) else len(data.encode("utf-8", "surrogatepass"))
    if size > MAX_SPEC_BYTES:
        raise doc_error(f"the document is {size} bytes, over the limit of {MAX_SPEC_BYTES} bytes")
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise doc_error(f"not valid UTF-8: bad byte at offset {exc.start}") from None
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
        got = "an empty document" if doc is None else kind(doc)
        raise doc_error(f"the top level must be a mapping, got {got}")
    _check_expansion(doc)
    try:
        out_of_range = out_of_range_issues(doc)
    except RecursionError:
        raise doc_error("the document is nested too deeply") from None
    if out_of_range:
        raise SpecInvalid(out_of_range)
    return doc
