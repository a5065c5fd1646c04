"""`--output table|json|yaml|csv` for the CLI's listing and show commands.

Role: `OutputOpt` and `JsonOpt` are the options every such command takes (`--json` stays as the
alias of `--output json`); `chosen(output, as_json)` says which format applies; `emit(data, fmt,
rows)` prints `data` as JSON or YAML (the API's answer, unchanged), or `rows` (a header and
lines of cells) as CSV. The table form stays with each command (Rich). CSV cells are written as
text: control characters made visible (`clean`), so a cell cannot drive the terminal.

Neighbours: `cli.main`. Must not: call the API or exit.
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Sequence
from enum import StrEnum
from typing import Annotated, Any

import typer
import yaml

from lowtide.cli.output import clean

__all__ = ["Format", "JsonOpt", "OutputOpt", "chosen", "emit"]


class Format(StrEnum):
    table = "table"
    json = "json"
    yaml = "yaml"
    csv = "csv"


OutputOpt = Annotated[
    Format | None,
    typer.Option("--output", "-o", help="table (default), json, yaml or csv.", case_sensitive=False),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON (as --output json).")]


def chosen(output: Format | None, as_json: bool) -> Format:
    if output is not None:
        return output
    return Format.json if as_json else Format.table


def emit(data: Any, fmt: Format, rows: Sequence[Sequence[object]] | None = None) -> None:
    """`data` as JSON or YAML, or `rows` (header first) as CSV (without `rows`: `data`'s JSON)."""
    if fmt is Format.yaml:
        sys.stdout.write(yaml.safe_dump(data, sort_keys=True, allow_unicode=False))
    elif fmt is Format.csv and rows is not None:
        writer = csv.writer(sys.stdout, lineterminator="\n")
        for row in rows:
            writer.writerow(["" if c is None else clean(c) for c in row])
    else:
        sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
    sys.stdout.flush()
