"""`lowtide k8s render`: the Kubernetes objects lowtide's Helm chart makes, without Helm.

``lowtide k8s render -f values.yaml [--set k=v] [-o yaml|json]`` merges the values files and
`--set` assignments over the chart's defaults (as `helm template` does), validates them against
the chart's values.schema.json and prints the objects: YAML documents separated by ``---``, or
one JSON ``List``. Exit codes: 0 rendered; 2 bad values, release name, namespace or chart (each
problem on stderr, naming the field). The chart comes from the checkout
(`deploy/helm/lowtide`) or ``--chart DIR`` (`deploy.chart` says why).
Neighbours: `cli.main` registers `k8s_app` as ``k8s``; `deploy.chart` does the work.
Must not: talk to a cluster or to the lowtide API.
"""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
import yaml

from lowtide.cli.output import HELP_MARKUP, console, safe

k8s_app = typer.Typer(
    help="Cluster mode: the Kubernetes objects of lowtide's Helm chart.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=HELP_MARKUP,
)
err = console(stderr=True)


class RenderFormat(StrEnum):
    yaml = "yaml"
    json = "json"


@k8s_app.callback()
def _group() -> None:
    """Cluster mode: the Kubernetes objects of lowtide's Helm chart."""


def _fail(message: str, problems: list[str] | None = None) -> NoReturn:
    err.print(f"[red]error:[/red] {safe(message)}")
    for problem in problems or []:
        err.print(f"  {safe(problem)}")
    raise typer.Exit(2)


def _values_file(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        _fail(f"{path}: cannot read: {exc.strerror or exc}")
    except yaml.YAMLError as exc:
        _fail(f"{path}: not YAML: {exc}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        _fail(f"{path}: a values file must be a mapping, not a {type(data).__name__}")
    return data


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the embedded lowtide.yaml and dashboard) as `|` blocks when YAML allows."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


@k8s_app.command("render")
def render_command(
    values: Annotated[
        list[Path] | None,
        typer.Option("--values", "-f", help="A values file (repeatable; later ones win)."),
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="key.path=value over the values files (repeatable; as Helm's --set)."),
    ] = None,
    output: Annotated[
        RenderFormat, typer.Option("--output", "-o", help="yaml (documents) or json (a List).")
    ] = RenderFormat.yaml,
    chart: Annotated[
        Path | None, typer.Option("--chart", help="The chart directory (default: deploy/helm/lowtide).")
    ] = None,
    release: Annotated[str, typer.Option("--release-name", help="The Helm release name.")] = "lowtide",
    namespace: Annotated[str, typer.Option("--namespace", "-n", help="The release's namespace.")] = "default",
) -> None:
    """Print the objects `helm template` would make for these values."""
    from lowtide.deploy.chart import (  # noqa: PLC0415 (jsonschema and the chart only for this command)
        ChartNotFound,
        Release,
        ValuesInvalid,
        load_chart,
        parse_set,
        render,
    )

    try:
        loaded = load_chart(chart)
    except ChartNotFound as exc:
        _fail(str(exc))
    layers = [_values_file(path) for path in values or []]
    try:
        if set_:
            layers.append(parse_set(set_))
        objects = render(loaded, layers, Release(name=release, namespace=namespace))
    except ValuesInvalid as exc:
        _fail("invalid values for the lowtide chart", exc.problems)
    if output is RenderFormat.json:
        document = {"apiVersion": "v1", "kind": "List", "items": objects}
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
        return
    texts = [yaml.dump(o, Dumper=_Dumper, sort_keys=False, allow_unicode=True) for o in objects]
    sys.stdout.write("---\n" + "---\n".join(texts))
