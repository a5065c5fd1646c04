"""`lowtide report [--since 24h|7d|ISO] [--until ...] [--by job|team|day|holder] [--tz ZONE] [--json]`
and `lowtide report --month YYYY-MM [--price X] [--currency KRW] [--tz ZONE] [--format table|json|csv|html]`.

Without `--month`: prints `GET /v1/reports/usage` as a Rich table plus totals: GPU-hours of
capacity, lent (what inference did not hold) and used by research, GPU-hours lost to preemption,
equivalent GPUs, and savings in the configured currency. `--since`/`--until` take a duration
before now (``24h``, ``7d``), ISO-8601 or epoch seconds; the server reads them (its clock, its time
zone). With `--month`: prints `GET /v1/reports/monthly` (the month against the month before, per
team) as a headline and a Rich table, JSON, CSV (one row per team and a total row) or a
self-contained HTML page. Every string that comes from users (team and job names) is escaped for
where it goes: Rich markup, HTML, and spreadsheet formulas in CSV. Also the GPU-time helpers
`lowtide show` uses for lost work (`gpu_time`, `lost_work_line`).
Registered by `cli.main` as ``app.command("report")(report_command(_client))``.
Must not: compute figures (the API does) or touch the store.
"""

from __future__ import annotations

import csv
import html
import io
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, NoReturn

import typer
from rich.table import Table

from lowtide.cli.client import ApiFailure, Client
from lowtide.cli.output import console, safe
from lowtide.policy.accounting import KIND_NAMES
from lowtide.policy.monthly import month_label, parse_month

#: API query fields as the options that set them (for error messages).
_OPTION_OF = {
    "query.start": "--since",
    "query.end": "--until",
    "query.group_by": "--by",
    "query.tz": "--tz",
    "query.month": "--month",
    "query.price": "--price",
    "query.currency": "--currency",
}
FORMATS = ("table", "json", "csv", "html")


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
            str | None,
            typer.Option(
                help="Start: a duration before now (24h, 7d), ISO-8601 or epoch seconds (default: 24h)."
            ),
        ] = None,
        until: Annotated[str | None, typer.Option(help="End (default: now); same forms as --since.")] = None,
        by: Annotated[
            str | None, typer.Option("--by", help="Group by job, team, day or holder (default: job).")
        ] = None,
        tz: Annotated[
            str | None,
            typer.Option("--tz", help="Time zone of days, months and local times (default: configured)."),
        ] = None,
        month: Annotated[
            str | None,
            typer.Option(
                "--month", help="A calendar month, YYYY-MM: the monthly summary against the month before."
            ),
        ] = None,
        price: Annotated[
            float | None,
            typer.Option("--price", help="Price per GPU-hour for --month's savings (default: configured)."),
        ] = None,
        currency: Annotated[
            str | None, typer.Option("--currency", help="ISO 4217 code of --price, such as KRW or EUR.")
        ] = None,
        fmt: Annotated[
            str | None,
            typer.Option(
                "--format", help="table, json, csv or html (csv and html with --month) (default: table)."
            ),
        ] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print JSON (same as --format json).")] = False,
    ) -> None:
        """GPU usage: GPU-hours lent and used, lost to preemption, equivalent GPUs and savings;
        with --month, a month against the month before, per team."""
        form = _format(fmt, as_json)
        if month is None:
            if price is not None or currency is not None:
                _refuse("--price and --currency go with --month")
            if form in ("csv", "html"):
                _refuse(f"--format {form} goes with --month (the usage report prints table or json)")
            params: dict[str, str] = {"start": since or "24h", "group_by": (by or "job").lower()}
            if until is not None:
                params["end"] = until
            if tz is not None:
                params["tz"] = tz
            data = _get(client, "/v1/reports/usage", params)
            if form == "json":
                _write_json(data)
            else:
                print_report(data)
            return
        given = [
            name
            for name, value in (("--since", since), ("--until", until), ("--by", by))
            if value is not None
        ]
        if given:
            _refuse(f"--month sets the period itself; drop {', '.join(given)}")
        try:
            label = month_label(*parse_month(month))
        except ValueError as exc:
            _refuse(str(exc), where="--month")
        query: dict[str, str] = {"month": label}
        if tz is not None:
            query["tz"] = tz
        if price is not None:
            query["price"] = repr(price)
        if currency is not None:
            query["currency"] = currency
        data = _get(client, "/v1/reports/monthly", query)
        if form == "json":
            _write_json(data)
        elif form == "csv":
            sys.stdout.write(monthly_csv(data))
        elif form == "html":
            sys.stdout.write(monthly_html(data))
        else:
            print_monthly(data)

    return report


def _format(fmt: str | None, as_json: bool) -> str:
    form = (fmt or ("json" if as_json else "table")).lower()
    if form not in FORMATS:
        _refuse(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}", where="--format")
    if as_json and form != "json":
        _refuse(f"--json and --format {form} disagree; use one")
    return form


def _refuse(message: str, *, where: str = "") -> NoReturn:
    """Bad input: say why (the option first, when there is one) and exit 2."""
    prefix = f"{safe(where)}: " if where else ""
    console(stderr=True).print(f"[red]error:[/red] {prefix}{safe(message)}")
    raise typer.Exit(2)


def _get(client: Callable[[], Client], path: str, params: Mapping[str, str]) -> Any:
    try:
        return client().json("GET", path, params=dict(params))
    except ApiFailure as exc:
        err = console(stderr=True)
        err.print(f"[red]error:[/red] {safe(exc.message)}")
        for e in exc.errors:
            where = _OPTION_OF.get(e.get("loc", ""), e.get("loc", ""))
            err.print(f"  {safe(where)}: {safe(e.get('msg', ''))}")
        raise typer.Exit(2 if exc.client_error else 1) from exc


def _write_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")


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
    return [safe(c) for c in head] + tail


# -- the monthly report -------------------------------------------------------------------------

#: CSV columns of a monthly row (`row` is "team" or "total"; `team` is empty on the total row).
CSV_COLUMNS = (
    "month",
    "row",
    "team",
    "jobs_run",
    "previous_jobs_run",
    "research_gpu_hours",
    "previous_research_gpu_hours",
    "change_gpu_hours",
    "change_pct",
    "equivalent_gpus",
    "savings",
    "currency",
    "preemptions",
    "lost_gpu_hours",
)
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _pct(pct: float | None) -> str:
    if pct is None:
        return "-"
    return f"{pct:+.0f} %" if abs(pct) >= 10 else f"{pct:+.1f} %"


def _gpus(n: float) -> str:
    return f"{n:,.1f}" if n >= 10 else f"{n:.2f}"


def _money(amount: float) -> str:
    return f"{amount:,.2f}"


def monthly_headline(d: Mapping[str, Any]) -> str:
    """``N jobs, X GPU-h (+Y % vs PREV), as if Z GPUs were added, saved S CUR`` (plain text)."""
    t = d["total"]
    jobs = t["jobs_run"]
    prev = d["previous_month"]
    change = (
        f"no research in {prev} to compare"
        if t["change_pct"] is None
        else f"{_pct(t['change_pct'])} vs {prev}"
    )
    so_far = "" if d["complete"] else " so far"
    return (
        f"{d['month']}{so_far}: {jobs} job{'' if jobs == 1 else 's'}, "
        f"{t['research_gpu_hours']:,.1f} GPU-h ({change}), "
        f"as if {_gpus(t['equivalent_gpus'])} GPUs were added, "
        f"saved {_money(t['savings'])} {d['currency']}"
    )


def _team_name(row: Mapping[str, Any]) -> str:
    return str(row["team"]) if row["team"] is not None else "(no team)"


def _monthly_cells(row: Mapping[str, Any]) -> list[str]:
    return [
        str(row["jobs_run"]),
        f"{row['research_gpu_hours']:,.2f}",
        f"{row['previous_research_gpu_hours']:,.2f}",
        f"{row['change_gpu_hours']:+,.2f}",
        _pct(row["change_pct"]),
        _gpus(row["equivalent_gpus"]),
        _money(row["savings"]),
        str(row["preemptions"]),
        f"{row['lost_gpu_hours']:,.2f}",
    ]


def print_monthly(d: Mapping[str, Any]) -> None:
    """The headline, the period and what was lent, then one table row per team and the total."""
    out = console()
    state = "complete" if d["complete"] else "in progress"
    out.print(f"[bold]{safe(monthly_headline(d))}[/bold]")
    out.print(
        safe(
            f"period {d['start_local']} → {d['end_local']} ({d['hours']:.1f} h, {d['timezone']}, {state}); "
            f"lent {d['lent_gpu_hours']:,.1f} GPU-h ({_gpus(d['lent_gpus'])} GPUs) of "
            f"{d['capacity_gpu_hours']:,.1f}; {d['total']['preemptions']} preemption(s), "
            f"{d['total']['lost_gpu_hours']:,.2f} GPU-h lost"
        )
    )
    cur, prev = d["currency"], d["previous_month"]
    table = Table(
        "TEAM",
        "JOBS",
        "GPU-H",
        f"GPU-H {prev}",
        "CHANGE",
        "CHANGE %",
        "EQUIV GPUS",
        f"SAVINGS {cur}",
        "PREEMPTIONS",
        "LOST GPU-H",
        title=safe(f"Research on lent GPUs, {d['month']}, per team"),
    )
    for column in table.columns[1:]:
        column.justify = "right"
    for row in d["teams"]:
        table.add_row(safe(_team_name(row)), *[safe(c) for c in _monthly_cells(row)])
    table.add_section()
    table.add_row("TOTAL", *[safe(c) for c in _monthly_cells(d["total"])], style="bold")
    out.print(table)


def _csv_text(value: str) -> str:
    """A user-controlled cell that a spreadsheet would run as a formula gets a leading quote."""
    return "'" + value if value.startswith(_FORMULA_START) else value


def _csv_row(d: Mapping[str, Any], row: Mapping[str, Any], kind: str) -> list[str]:
    pct = row["change_pct"]
    return [
        d["month"],
        kind,
        "" if kind == "total" else _csv_text(row["key"]),
        str(row["jobs_run"]),
        str(row["previous_jobs_run"]),
        f"{row['research_gpu_hours']:.4f}",
        f"{row['previous_research_gpu_hours']:.4f}",
        f"{row['change_gpu_hours']:.4f}",
        "" if pct is None else f"{pct:.2f}",
        f"{row['equivalent_gpus']:.4f}",
        f"{row['savings']:.2f}",
        d["currency"],
        str(row["preemptions"]),
        f"{row['lost_gpu_hours']:.4f}",
    ]


def monthly_csv(d: Mapping[str, Any]) -> str:
    """One row per team, then the total row (`row` = total), under a header (RFC 4180 quoting)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for row in d["teams"]:
        writer.writerow(_csv_row(d, row, "team"))
    writer.writerow(_csv_row(d, d["total"], "total"))
    return buf.getvalue()


_HTML_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem; color: #1d2733; }
h1 { font-size: 1.4rem; margin-bottom: .2rem; }
p.headline { font-size: 1.15rem; font-weight: 600; }
p.period { color: #5b6775; }
table { border-collapse: collapse; margin-top: 1rem; }
th, td { padding: .35rem .7rem; border-bottom: 1px solid #d8dee5; }
th { background: #eef2f6; text-align: left; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.total td { font-weight: 700; border-top: 2px solid #1d2733; }
"""


def monthly_html(d: Mapping[str, Any]) -> str:
    """A self-contained HTML page (inline CSS, no scripts, no external assets); every value is
    HTML-escaped."""

    def e(value: object) -> str:
        return html.escape(str(value), quote=True)

    cur, prev = d["currency"], d["previous_month"]
    heads = [
        "Team",
        "Jobs",
        "GPU-h",
        f"GPU-h {prev}",
        "Change",
        "Change %",
        "Equiv. GPUs",
        f"Savings {cur}",
        "Preemptions",
        "Lost GPU-h",
    ]
    head = "".join(f"<th{'' if i == 0 else ' class=num'}>{e(h)}</th>" for i, h in enumerate(heads))

    def tr(name: str, row: Mapping[str, Any], cls: str = "") -> str:
        cells = "".join(f"<td class=num>{e(c)}</td>" for c in _monthly_cells(row))
        return f"<tr{f' class={cls}' if cls else ''}><td>{e(name)}</td>{cells}</tr>"

    rows = "\n".join(tr(_team_name(r), r) for r in d["teams"])
    state = "complete" if d["complete"] else "in progress"
    lent, capacity = f"{d['lent_gpu_hours']:,.1f}", f"{d['capacity_gpu_hours']:,.1f}"
    price = f"{d['price_per_gpu_hour']:g}"
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>lowtide usage report {e(d['month'])}</title>\n"
        f"<style>{_HTML_STYLE}</style>\n</head>\n<body>\n"
        f"<h1>Research on lent GPUs: {e(d['month'])}</h1>\n"
        f'<p class="headline">{e(monthly_headline(d))}</p>\n'
        f'<p class="period">{e(d["start_local"])} → {e(d["end_local"])} ({e(d["timezone"])}, {e(state)}); '
        f"lent {e(lent)} GPU-h of {e(capacity)}; price {e(price)} {e(cur)} per GPU-hour</p>\n"
        f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{rows}\n"
        f"{tr('Total', d['total'], 'total')}\n</tbody>\n</table>\n</body>\n</html>\n"
    )
