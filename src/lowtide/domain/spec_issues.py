"""What the spec modules share: located problems, and the rules and wording they all use.

Role: `SpecIssue(loc, msg)` is one located problem and `SpecInvalid` carries every problem found,
so a researcher fixes a spec in one round. Locations look like `steps[1].depends[0]`,
`params.lr`, `(document)` (DOCUMENT); problems inside a template file are prefixed with
`template 'NAME': ` (`template_prefix`). Also here, because more than one spec module needs them:
the `Issues` collector, the name rule (NAME_RULE, `is_valid_name`) and identifier rule
(IDENT_RE, IDENT_RULE), the retry limit (MAX_RETRIES), the checks for unknown keys, names and
counts, and the wording helpers `kind` ("an integer"), `suggest` (" (did you mean 'x'?)") and
`excerpt` (a value as it may appear in a message: at most EXCERPT_CHARS characters, then "…", so a
1 MiB name or key is never echoed back whole).

Neighbours: everything else in `domain.spec_*` builds on this module; it imports none of them.
`spec_document` reads text, `spec_steps` checks steps and the DAG, `spec_parse` checks and
builds a whole job, `spec_render` fills placeholders; `adapters.templates` reports through it.
Must not: import the other spec modules, parse text, do I/O, or read the clock.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DOCUMENT",
    "EXCERPT_CHARS",
    "IDENT_RE",
    "IDENT_RULE",
    "MAX_RETRIES",
    "NAME_RULE",
    "Issues",
    "SpecInvalid",
    "SpecIssue",
    "check_count",
    "check_keys",
    "check_name",
    "doc_error",
    "excerpt",
    "is_valid_name",
    "kind",
    "suggest",
    "template_prefix",
]

#: The most retries a job or step may ask for (a count the store can hold, and more than enough).
MAX_RETRIES = 1000

DOCUMENT = "(document)"
NAME_RULE = "1 to 63 lowercase letters, digits or '-', starting and ending with a letter or digit"
_NAME_RE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
IDENT_RULE = "letters, digits and '_', not starting with a digit"


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


class Issues:
    """The problems found so far, in the order found."""

    def __init__(self) -> None:
        self.items: list[SpecIssue] = []

    def add(self, loc: str, msg: str) -> None:
        self.items.append(SpecIssue(loc, msg))


def kind(value: object) -> str:
    """What `value` is, for a message: "null", "an integer", "a mapping", "a list", ..."""
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


#: The most characters of an offending value a message echoes (then "…").
EXCERPT_CHARS = 64


def excerpt(value: object, limit: int = EXCERPT_CHARS) -> str:
    """`value` for a message, as `repr` would show it but cut to `limit` characters plus "…".

    Never converts a huge integer to decimal (Python refuses past 4,300 digits): it is described
    by its size instead.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4 * limit:
        return f"<an integer of about {int(value.bit_length() * 0.30103) + 1} digits>"
    if isinstance(value, str):
        return repr(value if len(value) <= limit else value[:limit] + "…")
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def suggest(word: object, choices: Sequence[str]) -> str:
    """ " (did you mean 'x'?)" for the closest of `choices` to `word`, or "" when none is close."""
    if not isinstance(word, str) or len(word) > 4 * EXCERPT_CHARS:  # nothing long is a typo
        return ""
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def doc_error(msg: str) -> SpecInvalid:
    """A `SpecInvalid` with the one problem `msg`, located at the whole document."""
    return SpecInvalid([SpecIssue(DOCUMENT, msg)])


# --------------------------------------------------------------------------- shared field checks


def check_keys(doc: Mapping[Any, Any], allowed: Sequence[str], loc: str, issues: Issues) -> None:
    """Report each key of `doc` not in `allowed`, located at the key (`loc` is the mapping's)."""
    for key in doc:
        if key not in allowed:
            # Located at the key itself: `colour`, `steps[1].depend`, `template 'x': nmae`.
            name = key if isinstance(key, str) and len(key) <= EXCERPT_CHARS else excerpt(key)
            at = loc[: -len(DOCUMENT)] + str(name) if loc.endswith(DOCUMENT) else f"{loc}.{name}"
            issues.add(at, f"unknown key {excerpt(key)}{suggest(key, allowed)}")


def check_name(value: object, loc: str, issues: Issues) -> str | None:
    """`value` when it is a valid name (NAME_RULE), else None with the problem reported."""
    if not isinstance(value, str):
        issues.add(loc, f"must be a string, got {kind(value)}")
        return None
    if not is_valid_name(value):
        issues.add(loc, f"{excerpt(value)} is not a valid name: use {NAME_RULE}")
        return None
    return value


def check_count(value: object, loc: str, issues: Issues) -> int | None:
    """`value` when it is a retry count from 0 to MAX_RETRIES, else None with the problem reported."""
    if not isinstance(value, int) or isinstance(value, bool):
        issues.add(loc, f"must be an integer, got {kind(value)}")
        return None
    if value < 0:
        issues.add(loc, f"must be 0 or more, got {value}")
        return None
    if value > MAX_RETRIES:
        issues.add(loc, f"must be at most {MAX_RETRIES}, got {value}")
        return None
    return value


#: The longest duration a spec may give (grace, minimum runtime, restart cost): one day.
MAX_SPEC_SECONDS = 86400.0


def check_seconds(value: object, loc: str, issues: Issues) -> float | None:
    """`value` as seconds when it is a finite number from 0 to a day, else None, reported."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        issues.add(loc, f"must be a number of seconds, got {kind(value)}")
        return None
    if not math.isfinite(value):
        issues.add(loc, f"must be a finite number, got {value}")
        return None
    if value < 0:
        issues.add(loc, f"must be 0 or more, got {value}")
        return None
    if value > MAX_SPEC_SECONDS:
        issues.add(loc, f"must be at most {MAX_SPEC_SECONDS:g} seconds (one day), got {value:g}")
        return None
    return float(value)
