"""`lowtide report [--since 24h|7d|ISO] [--until ...] [--by job|team|day|holder] [--tz ZONE] [--json]`.

Prints `GET /v1/reports/usage` as a Rich table plus totals: GPU-hours of capacity, lent (what
inference did not hold) and used by research, GPU-hours lost to preemption, equivalent GPUs, and
savings in the configured currency. `--since`/`--until` take a duration before now (``24h``,
``7d``), ISO-8601 or epoch seconds; the server reads them (its clock, its time zone). Also the
GPU-time helpers `lowtide show` uses for lost work (`gpu_time`, `lost_work_line`).
Registered by `cli.main` as ``app.command("report")(report_command(_client))``.
Must not: compute figures (the API does) or touch the store.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from lowtide.cli.client import ApiFailure, Client
from lowtide.cli.output import console
from lowtide.policy.accounting import KIND_NAMES

#: API query fields as the options that set them (for error messages).
_OPTION_OF = {"query.start": "--since", "query.end": "--until", "query.group_by": "--by", "query.tz": "--tz"}


def gpu_time(seconds: float | None) -> str:
    """GPU-seconds for people: ``-`` (unknown), ``0``, ``12.5 GPU-min`` below an hour, else GPU-h."""
    if seconds is None:
        return "-"
    if seconds == 0:
        return "0"
    if seconds < 3600:
        return f"{seconds / 60:.1f} GPU-min"
    return f"{seconds / 3600:.2f} GPU-h"


def _hours(seconds: float) -> str:
    h = seconds / 3600
    return f"{h:.2f}" if h == 0 or h >= 0.01 else f"{h:.2g}"


def lost_work_line(steps: Sequence[Mapping[str, Any]], attempts: Sequence[Mapping[str, Any]]) -> str:
    """``preempted N times, X GPU-h of work lost`` for a job (from `GET /v1/jobs/{id}`), with the
    work lost to failures and cancellations added when there was some."""
    times = sum(int(s.get("preemptions") or 0) for s in steps)
    preempted = sum(a.get("lost_gpu_seconds") or 0.0 for a in attempts if a.get("preempted"))
    other = sum(a.get("lost_gpu_seconds") or 0.0 for a in attempts if not a.get("preempted"))
    line = f"preempted {times} time{'' if times == 1 else 's'}, {_hours(preempted)} GPU-h of work lost"
    if other > 0:
        line += f"; {_hours(other)} GPU-h more lost to failures and cancellations"
    return line


def report_command(client: Callable[[], Client]) -> Callable[..., None]:
    """The `report` command, talking to the API through `client()` (cli.main's `_client`)."""

    def report(
        since: Annotated[
            str, typer.Option(help="Start: a duration before now (24h, 7d), ISO-8601 or epoch seconds.")
        ] = "24h",
        until: Annotated[str | None, typer.Option(help="End (default: now); same forms as --since.")] = None,
        by: Annotated[str, typer.Option("--by", help="Group by job, team, day or holder.")] = "job",
        tz: Annotated[
            str | None, typer.Option("--tz", help="Time zone of days and local times (default: configured).")
        ] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    ) -> None:
        """GPU usage: GPU-hours lent and used, lost to preemption, equivalent GPUs and savings."""
        params: dict[str, str] = {"start": since, "group_by": by.lower()}
        if until is not None:
            params["end"] = until
        if tz is not None:
            params["tz"] = tz
        try:
            data = client().json("GET", "/v1/reports/usage", params=params)
        except ApiFailure as exc:
            err = console(stderr=True)
            err.print(f"[red]error:[/red] {escape(exc.message)}")
            for e in exc.errors:
                where = _OPTION_OF.get(e.get("loc", ""), e.get("loc", ""))
                err.print(f"  {escape(where)}: {escape(e.get('msg', ''))}")
            raise typer.Exit(2 if exc.client_error else 1) from exc
        if as_json:
            sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
            return
        print_report(data)

    return report


def print_report(d: Mapping[str, Any]) -> None:
    """The report as a table (one row per group) and the totals under it."""
    out = console()
    cur = d["currency"]
    table = _table(d["group_by"], cur)
    for r in d["rows"]:
        table.add_row(*_cells(d["group_by"], r))
    out.print(table)
    t = d["totals"]
    out.print(
        f"period {d['start_local']} → {d['end_local']} ({d['hours']:.1f} h, {d['timezone']})\n"
        f"capacity  {_hours(t['capacity_gpu_seconds'])} GPU-h ({t['capacity_gpus']:.2f} GPUs): "
        f"inference {_hours(t['inference_gpu_seconds'])}, research {_hours(t['research_gpu_seconds'])}, "
        f"idle {_hours(t['idle_gpu_seconds'])}\n"
        f"lent      {_hours(t['lent_gpu_seconds'])} GPU-h ({t['lent_gpus']:.2f} GPUs)\n"
        f"used      {_hours(t['research_gpu_seconds'])} GPU-h ({t['research_gpus']:.2f} GPUs) by research\n"
        f"lost      {_hours(t['lost_gpu_seconds'])} GPU-h to {t['preemptions']} preemption(s)\n"
        f"savings   {t['savings']:.2f} {cur} at {d['price_per_gpu_hour']:g} {cur} per GPU-hour"
    )


def _table(group_by: str, cur: str) -> Table:
    tail = ("LOST GPU-H", "PREEMPTIONS", "EQUIV GPUS", f"SAVINGS {cur}")
    head: tuple[str, ...] = {
        "job": ("JOB", "NAME", "TEAM", "GPU-H"),
        "team": ("TEAM", "GPU-H"),
        "day": ("DAY", "INFERENCE GPU-H", "RESEARCH GPU-H", "IDLE GPU-H"),
        "holder": ("HOLDER", "KIND", "JOB", "TEAM", "GPU-H"),
    }.get(group_by, ("GROUP", "GPU-H"))
    table = Table(*head, *tail)
    for column in table.columns[len(head) - (3 if group_by == "day" else 1) :]:
        column.justify = "right"
    return table


def _cells(group_by: str, r: Mapping[str, Any]) -> list[str]:
    held = r["capacity_gpu_seconds"]
    tail = [
        _hours(r["lost_gpu_seconds"]),
        str(r["preemptions"]),
        f"{r['equivalent_gpus']:.2f}",
        f"{r['savings']:.2f}",
    ]
    if group_by == "job":
        head = [r["job_id"] or "-", r["job_name"] or "-", r["team"] or "-", _hours(held)]
    elif group_by == "team":
        head = [r["team"] or "-", _hours(held)]
    elif group_by == "day":
        head = [
            r["day"],
            _hours(r["inference_gpu_seconds"]),
            _hours(r["research_gpu_seconds"]),
            _hours(r["idle_gpu_seconds"]),
        ]
    elif group_by == "holder":
        kind = KIND_NAMES.get(r["holder_kind"], r["holder_kind"])
        head = [r["key"], kind, r["job_id"] or "-", r["team"] or "-", _hours(held)]
    else:
        head = [r["key"], _hours(held)]
    return [escape(c) for c in head] + tail
