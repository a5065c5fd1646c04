"""A test-only interpreter of the small subset of Helm's template language lowtide's chart uses.

No Helm binary can be installed here, so `tests/unit/test_chart.py` renders
`deploy/helm/lowtide/templates/` with this interpreter and checks that the result equals what
`lowtide.deploy.chart.render` builds. It accepts exactly the subset documented in
`deploy/helm/lowtide/README.md` and raises `OutsideSubset` on anything else, so a template that
grows beyond it fails here instead of silently rendering differently from Helm.

The subset (Go text/template + Helm/Sprig functions, semantics as in Go 1.24 text/template and
helm/helm @e9b85e4 (Helm 4) `pkg/engine`):
- text, `{{/* comment */}}`, trim markers `{{- ` and ` -}}` (they eat all adjacent spaces, tabs
  and newlines of the neighbouring text);
- fields `.`, `.Values.a.b`, `.Release.Name|Namespace|Service`, `.Chart.Name|Version|AppVersion`,
  and `$` / `$.Values.a.b` (Go's `$`: the data passed to Execute, i.e. the top-level context, also
  inside `range` and `with`; no other variables);
- `{{ FIELD }}` prints a string as is (anything else is refused: numbers go through `toYaml`,
  because Helm reads values.yaml numbers as float64 and Go prints 1000000 as `1e+06`);
- pipes `| quote` (Go's %q of a string) and `| nindent N`;
- functions `toYaml X` (sigs.k8s.io/yaml output, trailing newline removed), `include "name" .`,
  `.Files.Get "path"` (a file of the chart), `not X` (only as an `if` condition), `hasKey MAP
  "key"` (Sprig v3: whether the map has the key), `eq A B` (Go's builtin, here for two strings,
  two numbers or two booleans only: Go errors on incompatible kinds);
- `{{- if COND }}…{{- else }}…{{- end }}`, `{{- with X }}…{{- end }}` (dot becomes X),
  `{{- range LIST }}…{{- else }}…{{- end }}` (a list only: dot becomes each element in order; the
  else branch when it is empty; no `$i, $v :=` declarations, no ranging over maps or numbers),
  `{{- define "name" -}}…{{- end }}` (in `_*.tpl` files only).
A missing map key is an error here (Helm prints nothing): values.schema.json requires every key.

After rendering, the output is split into documents as Helm's `SplitManifests` does (regex
`(?m)^---[ \\t]*`), files named `_*` are skipped, and the objects are ordered as `helm template`
orders them (file paths sorted, then a stable sort by kind in Helm's `InstallOrder`, unknown kinds
last and by name: helm/helm @e9b85e4 `pkg/release/v1/util/{manifest_sorter,kind_sorter}.go`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class OutsideSubset(Exception):
    """The template uses something the documented subset does not include (or misuses it)."""


#: helm/helm @e9b85e4 pkg/release/v1/util/kind_sorter.go InstallOrder (the whole list, in order).
INSTALL_ORDER = [
    "PriorityClass", "Namespace", "NetworkPolicy", "ResourceQuota", "LimitRange", "PodSecurityPolicy",
    "PodDisruptionBudget", "ServiceAccount", "Secret", "SecretList", "ConfigMap", "StorageClass",
    "PersistentVolume", "PersistentVolumeClaim", "CustomResourceDefinition", "ClusterRole",
    "ClusterRoleList", "ClusterRoleBinding", "ClusterRoleBindingList", "Role", "RoleList", "RoleBinding",
    "RoleBindingList", "Service", "DaemonSet", "Pod", "ReplicationController", "ReplicaSet", "Deployment",
    "HorizontalPodAutoscaler", "StatefulSet", "Job", "CronJob", "IngressClass", "Ingress", "APIService",
    "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration",
]  # fmt: skip

_TOKEN = re.compile(
    r'\s*(?:(?P<string>"(?:[^"\\]|\\.)*")|(?P<number>-?[0-9]+)|(?P<pipe>\|)'
    r"|(?P<field>\$?\.(?:[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)?|\$(?![A-Za-z0-9_]))"
    r"|(?P<word>[A-Za-z_][A-Za-z0-9_]*)|(?P<other>\S))"
)
_GO_WS = " \t\r\n"


# -- parsing ------------------------------------------------------------------------------------


@dataclass
class Text:
    text: str


@dataclass
class Action:
    pipeline: list[list[tuple[str, str]]]  # commands, each a list of (kind, token)


@dataclass
class Block:
    keyword: str  # if | with | range | define
    pipeline: list[list[tuple[str, str]]]
    body: list[Any] = field(default_factory=list)
    otherwise: list[Any] | None = None


def _tokens(source: str, where: str) -> list[list[tuple[str, str]]]:
    commands: list[list[tuple[str, str]]] = [[]]
    pos = 0
    while pos < len(source):
        if not source[pos:].strip():
            break
        m = _TOKEN.match(source, pos)
        if m is None or m.lastgroup is None:
            raise OutsideSubset(f"{where}: cannot read {source[pos:]!r}")
        kind = m.lastgroup
        if kind == "other":
            raise OutsideSubset(f"{where}: {m.group(kind)!r} is outside the subset (in {source!r})")
        if kind == "pipe":
            commands.append([])
        else:
            commands[-1].append((kind, m.group(kind)))
        pos = m.end()
    if any(not c for c in commands):
        raise OutsideSubset(f"{where}: empty command in {source!r}")
    return commands


def _split_actions(text: str, where: str) -> list[tuple[str, str | tuple[bool, str, bool]]]:
    """Text pieces and actions (left trim, inner source, right trim), trim markers applied later."""
    out: list[tuple[str, Any]] = []
    pos = 0
    while True:
        start = text.find("{{", pos)
        if start < 0:
            out.append(("text", text[pos:]))
            return out
        out.append(("text", text[pos:start]))
        end = start + 2
        in_string = False
        while end < len(text):
            ch = text[end]
            if in_string:
                if ch == "\\":
                    end += 1
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif text.startswith("}}", end):
                break
            end += 1
        else:
            raise OutsideSubset(f"{where}: unclosed action at {text[start : start + 40]!r}")
        inner = text[start + 2 : end]
        left = inner.startswith("- ") or inner.startswith("-\n") or inner.startswith("-\t")
        right = inner.endswith(" -") or inner.endswith("\n-") or inner.endswith("\t-")
        if left:
            inner = inner[1:]
        if right:
            inner = inner[:-1]
        out.append(("action", (left, inner.strip(), right)))
        pos = end + 2


def parse(text: str, where: str) -> list[Any]:
    pieces = _split_actions(text, where)
    # Apply trim markers to the neighbouring text pieces.
    for i, (kind, value) in enumerate(pieces):
        if kind != "action":
            continue
        left, _inner, right = value
        if left and i > 0 and pieces[i - 1][0] == "text":
            pieces[i - 1] = ("text", pieces[i - 1][1].rstrip(_GO_WS))
        if right and i + 1 < len(pieces) and pieces[i + 1][0] == "text":
            pieces[i + 1] = ("text", pieces[i + 1][1].lstrip(_GO_WS))
    root: list[Any] = []
    stack: list[Block] = []

    def current() -> list[Any]:
        if not stack:
            return root
        top = stack[-1]
        return top.otherwise if top.otherwise is not None else top.body

    for kind, value in pieces:
        if kind == "text":
            if value:
                current().append(Text(value))
            continue
        _left, inner, _right = value
        if inner.startswith("/*"):
            if not inner.endswith("*/"):
                raise OutsideSubset(f"{where}: a comment must be the whole action: {inner!r}")
            continue
        commands = _tokens(inner, where)
        head = commands[0][0]
        if head == ("word", "end"):
            if len(commands) != 1 or len(commands[0]) != 1 or not stack:
                raise OutsideSubset(f"{where}: unexpected {{{{ {inner} }}}}")
            block = stack.pop()
            current().append(block)
        elif head == ("word", "else"):
            if len(commands[0]) != 1 or len(commands) != 1 or not stack or stack[-1].keyword == "define":
                raise OutsideSubset(
                    f"{where}: only a bare `else` inside if/with/range is in the subset: {inner!r}"
                )
            if stack[-1].otherwise is not None:
                raise OutsideSubset(f"{where}: a second else")
            stack[-1].otherwise = []
        elif head in (("word", "if"), ("word", "with"), ("word", "range"), ("word", "define")):
            keyword = head[1]
            rest = [commands[0][1:], *commands[1:]]
            if not rest[0]:
                raise OutsideSubset(f"{where}: {keyword} without an argument")
            if keyword == "define" and (
                stack or len(rest) != 1 or len(rest[0]) != 1 or rest[0][0][0] != "string"
            ):
                raise OutsideSubset(f"{where}: define takes one quoted name, at top level")
            stack.append(Block(keyword, rest))
        elif head[0] == "word" and head[1] in ("template", "block", "break", "continue"):
            raise OutsideSubset(f"{where}: `{head[1]}` is outside the subset")
        else:
            current().append(Action(commands))
    if stack:
        raise OutsideSubset(f"{where}: {stack[-1].keyword} without end")
    return root


# -- evaluation ---------------------------------------------------------------------------------


def go_quote(s: str) -> str:
    """Go's strconv.Quote (fmt %q) of a string: printable characters kept, the rest escaped."""
    out = ['"']
    named = {"\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\v": "\\v"}
    for ch in s:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ch in named:
            out.append(named[ch])
        elif ch.isprintable():
            out.append(ch)
        elif ord(ch) < 0x80:
            out.append(f"\\x{ord(ch):02x}")
        elif ord(ch) <= 0xFFFF:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    out.append('"')
    return "".join(out)


def _json_numbers(value: Any) -> Any:
    """What sigs.k8s.io/yaml.Marshal does to numbers (through encoding/json): an integral float64
    below 1e21 is written without a fraction, so it reads back as an integer."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e21:
        return int(value)
    if isinstance(value, Mapping):
        return {k: _json_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_numbers(v) for v in value]
    return value


def to_yaml(value: Any) -> str:
    value = _json_numbers(value)
    if value is None:
        return "null"
    if isinstance(value, bool | int | float | str):
        return json.dumps(value)  # a YAML scalar that reads back as the same value
    return yaml.safe_dump(value, sort_keys=True, default_flow_style=False, allow_unicode=True).rstrip("\n")


def truth(value: Any) -> bool:
    """Go text/template's truth: false, 0, nil and empty strings, maps and lists are false."""
    if value is None or value is False:
        return False
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value != 0
    if isinstance(value, str | list | dict):
        return len(value) > 0
    return True


def _helm_numbers(value: Any) -> Any:
    """Values as Helm reads YAML files: sigs.k8s.io/yaml → JSON → float64 for every number."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return float(value)
    if isinstance(value, Mapping):
        return {k: _helm_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_helm_numbers(v) for v in value]
    return value


def _go_eq(a: Any, b: Any, where: str) -> bool:
    """Go text/template's `eq` for the kinds the subset allows (funcs.go `eq`: basic kinds
    compare by value; a string against a number is "incompatible types for comparison")."""

    def kind(v: Any) -> str:
        if isinstance(v, bool):
            return "bool"
        if isinstance(v, int | float):
            return "number"
        if isinstance(v, str):
            return "string"
        raise OutsideSubset(f"{where}: eq of {v!r}: only strings, numbers and booleans")

    if kind(a) != kind(b):
        raise OutsideSubset(f"{where}: eq of {a!r} and {b!r}: incompatible types for comparison")
    return bool(a == b)


class _Files:
    def __init__(self, chart_dir: Path) -> None:
        self.chart_dir = chart_dir

    def get(self, name: str) -> str:
        path = self.chart_dir / name
        if not path.is_file():
            raise OutsideSubset(f".Files.Get {name!r}: no such file in the chart")
        return path.read_text(encoding="utf-8")


class Renderer:
    def __init__(self, chart_dir: Path, values: Mapping[str, Any], release: Mapping[str, str]) -> None:
        meta = yaml.safe_load((chart_dir / "Chart.yaml").read_text(encoding="utf-8"))
        self.chart_dir = chart_dir
        self.root = {
            "Values": _helm_numbers(values),
            "Release": {"Name": release["name"], "Namespace": release["namespace"], "Service": "Helm"},
            "Chart": {
                "Name": meta["name"],
                "Version": str(meta["version"]),
                "AppVersion": str(meta["appVersion"]),
            },
        }
        self.files = _Files(chart_dir)
        self.defines: dict[str, list[Any]] = {}
        self.templates: dict[str, list[Any]] = {}
        for path in sorted((chart_dir / "templates").iterdir()):
            where = f"templates/{path.name}"
            nodes = parse(path.read_text(encoding="utf-8"), where)
            if path.name.startswith("_"):
                for node in nodes:
                    if isinstance(node, Block) and node.keyword == "define":
                        self.defines[json.loads(node.pipeline[0][0][1])] = node.body
                    elif not (isinstance(node, Text) and not node.text.strip()):
                        raise OutsideSubset(f"{where}: only defines (and blank text) belong in a partial")
            else:
                if any(isinstance(n, Block) and n.keyword == "define" for n in nodes):
                    raise OutsideSubset(f"{where}: define only in _*.tpl files")
                self.templates[where] = nodes

    # -- values of operands -----------------------------------------------------------------

    def _field(self, path: str, dot: Any, where: str) -> Any:
        if path.startswith("$"):  # Go's `$`: the top-level data, wherever dot is
            dot, path = self.root, path[1:] or "."
        if path == ".":
            return dot
        value = dot
        for name in path[1:].split("."):
            if not isinstance(value, Mapping):
                raise OutsideSubset(f"{where}: can't evaluate field {name} of a {type(value).__name__}")
            if name not in value:
                raise OutsideSubset(f"{where}: missing key {path} (every value must be set)")
            value = value[name]
        return value

    def _operand(self, token: tuple[str, str], dot: Any, where: str) -> Any:
        kind, text = token
        if kind == "field":
            return self._field(text, dot, where)
        if kind == "string":
            return json.loads(text)
        if kind == "number":
            return int(text)
        raise OutsideSubset(f"{where}: {text!r} is not an operand of the subset")

    def _command(self, command: list[tuple[str, str]], dot: Any, piped: list[Any], where: str) -> Any:
        head_kind, head = command[0]
        args = command[1:]
        if head_kind == "field" and head == ".Files.Get":
            if dot is not self.root or len(args) != 1 or args[0][0] != "string" or piped:
                raise OutsideSubset(f'{where}: .Files.Get "path" (at top level, one path)')
            return self.files.get(json.loads(args[0][1]))
        if head_kind in ("field", "string", "number"):
            if args or piped:
                raise OutsideSubset(f"{where}: {head} takes no arguments")
            return self._operand(command[0], dot, where)
        values = [self._operand(a, dot, where) for a in args] + piped
        if head == "toYaml" and len(values) == 1:
            return to_yaml(values[0])
        if head == "quote" and len(values) == 1:
            if not isinstance(values[0], str):
                raise OutsideSubset(f"{where}: quote a string only (got {values[0]!r})")
            return go_quote(values[0])
        if head == "nindent" and len(values) == 2 and isinstance(values[0], int):
            pad = " " * values[0]
            return "\n" + pad + str(values[1]).replace("\n", "\n" + pad)
        if head == "include" and len(values) == 2 and isinstance(values[0], str):
            if values[0] not in self.defines:
                raise OutsideSubset(f"{where}: include of undefined {values[0]!r}")
            return self._render(self.defines[values[0]], values[1], f"define {values[0]}")
        if head == "not" and len(values) == 1:
            return not truth(values[0])
        if (
            head == "hasKey"
            and len(values) == 2
            and isinstance(values[0], Mapping)
            and isinstance(values[1], str)
        ):
            return values[1] in values[0]
        if head == "eq" and len(values) == 2:
            return _go_eq(values[0], values[1], where)
        raise OutsideSubset(f"{where}: `{head}` with {len(values)} argument(s) is outside the subset")

    def _pipeline(self, pipeline: list[list[tuple[str, str]]], dot: Any, where: str) -> Any:
        value = self._command(pipeline[0], dot, [], where)
        for command in pipeline[1:]:
            if command[0][0] != "word" or command[0][1] not in ("quote", "nindent"):
                raise OutsideSubset(f"{where}: only `| quote` and `| nindent N` may follow a pipe")
            value = self._command(command, dot, [value], where)
        return value

    def _render(self, nodes: list[Any], dot: Any, where: str) -> str:
        out = []
        for node in nodes:
            if isinstance(node, Text):
                out.append(node.text)
            elif isinstance(node, Action):
                value = self._pipeline(node.pipeline, dot, where)
                if not isinstance(value, str):
                    raise OutsideSubset(
                        f"{where}: printing {value!r}: print strings only (numbers through toYaml)"
                    )
                out.append(value)
            elif node.keyword == "if":
                branch = node.body if truth(self._pipeline(node.pipeline, dot, where)) else node.otherwise
                out.append(self._render(branch or [], dot, where))
            elif node.keyword == "range":
                items = self._pipeline(node.pipeline, dot, where)
                if not isinstance(items, list):
                    raise OutsideSubset(f"{where}: range over a list only (got {type(items).__name__})")
                if items:
                    out.extend(self._render(node.body, item, where) for item in items)
                elif node.otherwise is not None:
                    out.append(self._render(node.otherwise, dot, where))
            elif node.keyword == "with":
                value = self._pipeline(node.pipeline, dot, where)
                if truth(value):
                    out.append(self._render(node.body, value, where))
                elif node.otherwise is not None:
                    out.append(self._render(node.otherwise, dot, where))
            else:
                raise OutsideSubset(f"{where}: define inside a template")
        return "".join(out)

    def render_files(self) -> dict[str, str]:
        """Each template file's rendered text."""
        return {where: self._render(nodes, self.root, where) for where, nodes in self.templates.items()}

    def objects(self) -> list[dict[str, Any]]:
        """The manifests, in `helm template` order."""
        manifests: list[dict[str, Any]] = []
        sep = re.compile(r"(?m)^---[ \t]*")
        for where, text in sorted(self.render_files().items()):
            for doc in sep.split(text.lstrip()):
                if not doc.strip():
                    continue
                try:
                    obj = yaml.safe_load(doc)
                except yaml.YAMLError as exc:
                    raise AssertionError(f"{where}: rendered YAML does not parse: {exc}\n{doc}") from exc
                if obj is None:
                    continue  # a document of comments only
                if not isinstance(obj, dict) or "kind" not in obj:
                    raise AssertionError(f"{where}: a document that is not an object: {doc!r}")
                manifests.append(obj)

        def rank(obj: dict[str, Any]) -> tuple[int, str]:
            kind = obj["kind"]
            if kind in INSTALL_ORDER:
                return INSTALL_ORDER.index(kind), ""
            return len(INSTALL_ORDER), kind

        return sorted(manifests, key=rank)


def helm_template(
    chart_dir: Path, values: Mapping[str, Any], name: str, namespace: str
) -> list[dict[str, Any]]:
    """`helm template NAME CHART -n NAMESPACE` for already merged values, within the subset."""
    return Renderer(chart_dir, values, {"name": name, "namespace": namespace}).objects()
