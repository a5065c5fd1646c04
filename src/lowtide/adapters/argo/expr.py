"""A checker for the expr-lang subset lowtide writes into Argo `retryStrategy.expression`.

Argo evaluates a retry expression with expr-lang (github.com/expr-lang/expr v1.17.8, the version
argo-workflows v4.1.2 pins in go.mod) over a scope built by `buildRetryStrategyLocalScope`
(workflow/controller/operator.go, v4.1.2): `retries` (the 0-based index of the last attempt),
`lastRetry.exitCode` ("-1" when unknown), `lastRetry.status`, `lastRetry.duration` and
`lastRetry.message`, **all strings**, plus the functions of `util/expr/env/env.go` (`asInt`,
`asFloat`, ...). expr-lang compiles against that environment, so `retries < 2` is a type error
(string vs int) that Argo reports only when the retry is evaluated, i.e. after the first failure
in the cluster. This module parses an expression and checks names and operand types, so such a
mistake fails `lowtide argo render` and the tests instead.

Grammar (expr-lang docs/language-definition.md, v1.17: `||`/`or` binds loosest, then `&&`/`and`,
then comparisons and the string operators `contains`, `matches`, `startsWith`, `endsWith`, then
unary `!`/`not`; `+` binds tighter than comparisons): literals (double- or single-quoted
strings, integers, `true`/`false`), names with `.` member access, calls, parentheses. Anything
else is refused, not guessed at.

`evaluate_retry_expression` evaluates a checked expression over a concrete scope the way Argo
does (short-circuit `||`/`&&`; `asInt` parses a decimal string, an error otherwise; `matches` uses
Python's `re.search` where Go uses RE2, the same for the plain alternations we write), so fakes
of Argo's controller in tests decide retries with the expression lowtide compiled.

An expression template (`{{=...}}` in a template's labels or env, e.g. the attempt number
`asInt(retries) + 1`) is checked and evaluated the same way by `check_template_expression` and
`evaluate_template_expression` over the names Argo binds there for a retry child (`retries`, a
string: operator.go `executeTemplate` puts `strconv.Itoa(retryNum)` in the local parameters).

Neighbours: `workflow` builds the expressions and calls `check_retry_expression` and
`check_template_expression`; test fakes of Argo call the evaluators.
Must not: accept syntax it does not understand, or guess a value Argo would not bind.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "RETRY_SCOPE",
    "TEMPLATE_SCOPE",
    "ExprError",
    "check_retry_expression",
    "check_template_expression",
    "evaluate_retry_expression",
    "evaluate_template_expression",
]

#: The names Argo binds for a retry expression, with their expr-lang types (all strings).
RETRY_SCOPE: Mapping[str, str] = {
    "retries": "string",
    "lastRetry.exitCode": "string",
    "lastRetry.status": "string",
    "lastRetry.duration": "string",
    "lastRetry.message": "string",
}
#: The names an expression template of a retry child may use (a string, like every parameter).
TEMPLATE_SCOPE: Mapping[str, str] = {"retries": "string"}
#: Functions from util/expr/env/env.go we allow, with their result type (`asInt` = builtin int).
_FUNCTIONS: Mapping[str, str] = {"asInt": "int", "asFloat": "float"}
_STRING_OPS = ("contains", "matches", "startsWith", "endsWith")
_COMPARE = ("==", "!=", "<", "<=", ">", ">=")
_TOKEN = re.compile(
    r"""\s*(?:
      (?P<num>\d+)
    | (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
    | (?P<op>\|\||&&|==|!=|<=|>=|<|>|!|\(|\)|\.|,|\+)
    | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
    )""",
    re.VERBOSE,
)


class ExprError(ValueError):
    """An expression Argo's expr-lang would refuse (syntax) or fail on (names, types)."""


@dataclass(frozen=True, slots=True)
class _Tok:
    kind: str  # num | str | op | name | end
    text: str
    at: int


def _tokens(text: str) -> list[_Tok]:
    out: list[_Tok] = []
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise ExprError(f"unexpected character {text[pos:].lstrip()[:1]!r} at {pos}")
        kind = m.lastgroup or ""
        out.append(_Tok(kind, m.group(kind), m.start(kind)))
        pos = m.end()
    out.append(_Tok("end", "", len(text)))
    return out


Node = tuple[Any, ...]


class _Parser:
    """Recursive descent over the tokens; every node is (kind, type, ...) with its expr-lang type."""

    def __init__(self, text: str, scope: Mapping[str, str]) -> None:
        self.toks = _tokens(text)
        self.i = 0
        self.scope = scope

    def peek(self) -> _Tok:
        return self.toks[self.i]

    def take(self) -> _Tok:
        tok = self.toks[self.i]
        self.i += 1
        return tok

    def expect(self, text: str) -> None:
        tok = self.take()
        if tok.text != text or tok.kind not in ("op", "name"):
            raise ExprError(f"expected {text!r} at {tok.at}, found {tok.text or 'the end'!r}")

    def parse(self, want: str = "bool") -> Node:
        node = self.orexpr()
        tok = self.peek()
        if tok.kind != "end":
            raise ExprError(f"unexpected {tok.text!r} at {tok.at}")
        if node[1] != want:
            what = "a retry expression must be a boolean" if want == "bool" else f"it must be a {want}"
            raise ExprError(f"{what}, this one is a {node[1]}")
        return node

    def _logical(self, ops: tuple[str, ...], sub: str, kind: str) -> Node:
        left: Node = getattr(self, sub)()
        while self.peek().text in ops:
            tok = self.take()
            right: Node = getattr(self, sub)()
            if left[1] != "bool" or right[1] != "bool":
                raise ExprError(f"{tok.text!r} at {tok.at} needs booleans, got {left[1]} and {right[1]}")
            left = (kind, "bool", left, right)
        return left

    def orexpr(self) -> Node:
        return self._logical(("||", "or"), "andexpr", "or")

    def andexpr(self) -> Node:
        return self._logical(("&&", "and"), "compare", "and")

    def compare(self) -> Node:
        left = self.additive()
        tok = self.peek()
        if (tok.text in _COMPARE and tok.kind == "op") or (tok.text in _STRING_OPS and tok.kind == "name"):
            self.take()
            right = self.additive()
            a, b = left[1], right[1]
            if tok.text in _STRING_OPS:
                if a != "string" or b != "string":
                    raise ExprError(f"{tok.text!r} at {tok.at} needs strings, got {a} and {b}")
            elif tok.text in ("==", "!="):
                if {a, b} - {"int", "float"} and a != b:
                    raise ExprError(f"{tok.text!r} at {tok.at} compares a {a} with a {b}")
            elif not ({a, b} <= {"int", "float"} or a == b == "string"):
                raise ExprError(f"{tok.text!r} at {tok.at} cannot order a {a} and a {b}")
            return ("op", "bool", tok.text, left, right)
        return left

    def additive(self) -> Node:
        """`a + b`: numbers (int + int is an int) or strings (concatenation), as in expr-lang."""
        left = self.unary()
        while self.peek().text == "+" and self.peek().kind == "op":
            tok = self.take()
            right = self.unary()
            a, b = left[1], right[1]
            if {a, b} <= {"int", "float"}:
                kind = "int" if a == b == "int" else "float"
            elif a == b == "string":
                kind = "string"
            else:
                raise ExprError(f"'+' at {tok.at} cannot add a {a} and a {b}")
            left = ("op", kind, "+", left, right)
        return left

    def unary(self) -> Node:
        tok = self.peek()
        if tok.text in ("!", "not") and tok.kind in ("op", "name"):
            self.take()
            node = self.unary()
            if node[1] != "bool":
                raise ExprError(f"{tok.text!r} at {tok.at} needs a boolean, got a {node[1]}")
            return ("not", "bool", node)
        return self.primary()

    def primary(self) -> Node:
        tok = self.take()
        if tok.kind == "num":
            return ("lit", "int", int(tok.text))
        if tok.kind == "str":
            return ("lit", "string", _unquote(tok.text))
        if tok.text == "(" and tok.kind == "op":
            node = self.orexpr()
            self.expect(")")
            return node
        if tok.kind != "name":
            raise ExprError(f"unexpected {tok.text or 'end of expression'!r} at {tok.at}")
        if tok.text in ("true", "false"):
            return ("lit", "bool", tok.text == "true")
        if self.peek().text == "(":
            if tok.text not in _FUNCTIONS:
                raise ExprError(f"unknown function {tok.text!r} at {tok.at}")
            self.take()
            arg = self.orexpr()
            self.expect(")")
            return ("call", _FUNCTIONS[tok.text], tok.text, arg)
        path = tok.text
        while self.peek().text == "." and self.peek().kind == "op":
            self.take()
            member = self.take()
            if member.kind != "name":
                raise ExprError(f"expected a name after '.' at {member.at}")
            path += "." + member.text
        if path not in self.scope:
            known = ", ".join(sorted(self.scope))
            raise ExprError(f"unknown name {path!r} at {tok.at}; Argo binds {known}")
        return ("var", self.scope[path], path)


def _unquote(text: str) -> str:
    body = text[1:-1]
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m.group(1), m.group(1)), body)


def _number(value: Any, kind: str) -> Any:
    try:
        return int(value) if kind == "asInt" else float(value)
    except (TypeError, ValueError):
        raise ExprError(f"{kind}({value!r}): not a number") from None


def _eval(node: Node, scope: Mapping[str, str]) -> Any:
    kind = node[0]
    if kind == "lit":
        return node[2]
    if kind == "var":
        return scope[node[2]]
    if kind == "call":
        return _number(_eval(node[3], scope), node[2])
    if kind == "not":
        return not _eval(node[2], scope)
    if kind == "or":
        return bool(_eval(node[2], scope)) or bool(_eval(node[3], scope))
    if kind == "and":
        return bool(_eval(node[2], scope)) and bool(_eval(node[3], scope))
    op, a, b = node[2], _eval(node[3], scope), _eval(node[4], scope)
    if op == "contains":
        return b in a
    if op == "startsWith":
        return a.startswith(b)
    if op == "endsWith":
        return a.endswith(b)
    if op == "matches":
        return re.search(b, a) is not None
    return {
        "==": lambda: a == b,
        "!=": lambda: a != b,
        "<": lambda: a < b,
        "<=": lambda: a <= b,
        ">": lambda: a > b,
        ">=": lambda: a >= b,
        "+": lambda: a + b,
    }[op]()


def check_retry_expression(text: str, scope: Mapping[str, str] = RETRY_SCOPE) -> None:
    """Raise ExprError when `text` is not a boolean expr-lang expression over Argo's retry scope."""
    if not text.strip():
        raise ExprError("the expression is empty")
    _Parser(text, scope).parse()


def evaluate_retry_expression(text: str, values: Mapping[str, str]) -> bool:
    """What Argo's `processNodeRetries` gets from `text` for a last child described by `values`
    (`retries`, `lastRetry.exitCode`, ...: strings, as `buildRetryStrategyLocalScope` binds them).
    Raises ExprError for an expression `check_retry_expression` refuses, a name without a value,
    or a conversion that fails (Argo then errors the node)."""
    if not text.strip():
        raise ExprError("the expression is empty")
    tree = _Parser(text, RETRY_SCOPE).parse()
    missing = sorted(set(RETRY_SCOPE) - set(values))
    if missing:
        raise ExprError(f"no value for {', '.join(missing)}")
    return bool(_eval(tree, values))


def _template_tree(text: str, want: str) -> Node:
    if not (text.startswith("{{=") and text.endswith("}}")) or not text[3:-2].strip():
        raise ExprError(f"{text!r} is not one expression template '{{{{=...}}}}'")
    return _Parser(text[3:-2], TEMPLATE_SCOPE).parse(want)


def check_template_expression(text: str, want: str = "int") -> None:
    """Raise ExprError unless `text` is exactly one expression template `{{=E}}` whose E is an
    expr-lang expression of type `want` over `TEMPLATE_SCOPE`."""
    _template_tree(text, want)


def evaluate_template_expression(text: str, values: Mapping[str, str], want: str = "int") -> str:
    """The text Argo puts in place of the expression template `text` for a retry child described
    by `values` (`retries`: its 0-based index, a string); numbers and strings are written plainly.
    Raises ExprError as `check_template_expression`, or for a missing value."""
    tree = _template_tree(text, want)
    missing = sorted(set(TEMPLATE_SCOPE) - set(values))
    if missing:
        raise ExprError(f"no value for {', '.join(missing)}")
    return str(_eval(tree, values))
