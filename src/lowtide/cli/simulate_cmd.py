"""`lowtide simulate`: the production loop on a virtual clock over a real trace, per lending policy.

    lowtide simulate --load SPEC [--jobs SPEC] [--cluster FILE] --days N
                     [--policy none|window|continuous|forecast|oracle | --compare P1,P2,...]
                     [--seed S] [--price X --currency CUR] [--out DIR]

`--load` takes the trace specs `lowtide loadgen` reads; `--jobs` `alibaba:CSV`, `philly:CSV` or
`synthetic[:...]`; `--cluster` a lowtide.yaml (see `sim.fleet`). Writes `DIR/summary.json` and a
self-contained `DIR/report.html` (one policy), or `DIR/compare.json` (`--compare`), and prints a
table. Exit codes: 0 done; 2 bad input (a located message: the spec, the file and line, the
field); 1 the simulation itself failed. Must not: talk to the API or a real store.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, get_args

import typer
from rich.table import Table

from lowtide.cli.output import HELP_MARKUP, console, safe
from lowtide.sim.policies import POLICIES, PolicyName

if TYPE_CHECKING:  # the simulator (and matplotlib) load only when the command runs
    from lowtide.sim.run import PolicyRun
    from lowtide.sim.scenario import Scenario

simulate_app = typer.Typer(
    add_completion=False, pretty_exceptions_enable=False, subcommand_metavar="", rich_markup_mode=HELP_MARKUP
)
out = console()
err = console(stderr=True)

#: The columns of the comparison table: (summary key, heading, format).
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("gpu_hours_harvested", "harvested GPU-h", "{:,.1f}"),
    ("harvest_efficiency", "of idle", "{:.1%}"),
    ("harvest_efficiency_of_demand", "of oracle", "{:.1%}"),
    ("gpu_hours_lost_to_preemption", "lost GPU-h", "{:,.1f}"),
    ("preemptions", "preemptions", "{:,}"),
    ("slo_violation_minutes", "SLO-violation min", "{:,.1f}"),
    ("reclaim_latency_p99_s", "reclaim p99 s", "{:,.1f}"),
    ("job_wait_p50_s", "wait p50 s", "{:,.0f}"),
    ("equivalent_gpus", "equiv. GPUs", "{:,.1f}"),
    ("savings", "savings", "{:,.0f}"),
    ("wall_s", "wall s", "{:.1f}"),
)


def _bad_input(message: str) -> NoReturn:
    err.print(f"[red]error:[/red] {safe(message)}")
    raise typer.Exit(2)


def _policies(text: str) -> list[PolicyName]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in get_args(PolicyName)]
    if unknown or not names:
        _bad_input(f"--compare: unknown policy {', '.join(unknown) or '(none)'}; use {', '.join(POLICIES)}")
    return names  # type: ignore[return-value]


def build_scenario(
    load: str, jobs: str, cluster: Path | None, days: float, seed: int, data_dir: Path | None
) -> Scenario:
    """The scenario the options describe; raises the loaders' located errors (caught by the command)."""
    from lowtide.sim.fleet import FleetOptions, cluster_scenario, default_scenario, load_cluster  # noqa: PLC0415
    from lowtide.sim.jobs import job_workload, parse_jobs_spec  # noqa: PLC0415
    from lowtide.sim.load import load_curve  # noqa: PLC0415

    curve = load_curve(load, days=days, data_root=data_dir)
    job_spec = parse_jobs_spec(jobs, data_dir)
    if cluster is not None:
        settings = load_cluster(cluster)
        largest = max(
            (n.gpus if isinstance(n.gpus, int) else len(n.gpus) if isinstance(n.gpus, list) else 0)
            for n in settings.nodes
        )
        workload = job_workload(job_spec, days=days, seed=seed, max_gpus=max(1, largest))
        return cluster_scenario(settings, curve, workload.jobs, days=days, seed=seed)
    options = FleetOptions()
    workload = job_workload(job_spec, days=days, seed=seed, max_gpus=options.gpus_per_node)
    return default_scenario(curve, workload.jobs, days=days, seed=seed, options=options)


def _fmt(value: Any, pattern: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return pattern.format(value)


def _spells(summary: dict[str, Any]) -> str:
    """' (in spells ≥ 10m: …, ≥ 1h: …)' from `oracle_idle_gpu_hours_in_spells`, or ''."""
    spells = summary.get("oracle_idle_gpu_hours_in_spells") or {}
    if not spells:
        return ""
    parts = ", ".join(f"≥ {label} {hours:,.0f}" for label, hours in spells.items())
    return f" (in spells {parts})"


def print_table(runs: list[PolicyRun]) -> None:
    table = Table(title="lowtide simulate", title_justify="left")
    table.add_column("policy")
    for _, heading, _ in COLUMNS:
        table.add_column(heading, justify="right")
    for run in runs:
        s = run.summary
        table.add_row(safe(run.policy), *(_fmt(s.get(key), pattern) for key, _, pattern in COLUMNS))
    out.print(table)
    first = runs[0].summary
    base = next((r.summary["baseline_none"] for r in runs if "baseline_none" in r.summary), None) or {
        "slo_violation_minutes": first.get("slo_violation_minutes", 0.0)
    }
    out.print(
        f"{first['gpus']} GPUs × {first['days']:g} days = {first['gpu_hours_total']:,.0f} GPU-h; "
        f"oracle idle {first['oracle_idle_gpu_hours']:,.0f} GPU-h{_spells(first)}; "
        f"`none` baseline SLO violations {base.get('slo_violation_minutes', 0.0):,.1f} min"
    )
    scaled = {name: k for name, k in (first.get("load_scale_by_service") or {}).items() if k != 1.0}
    if scaled:
        listed = ", ".join(f"{safe(name)} ×{k:,.1f}" for name, k in scaled.items())
        out.print(f"load scaled up to fill the fleet (the trace is too light for it): {listed}")


def write_single(run: PolicyRun, out_dir: Path) -> None:
    from lowtide.sim.report import plots, render_html  # noqa: PLC0415  (matplotlib: only here)

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(run.summary, indent=2, sort_keys=True) + "\n")
    images: dict[str, str] = {}
    if run.world is not None and run.trace is not None:
        images = plots(run.trace.samples, run.world.scenario.start, run.world.scenario.pool_gpus)
    (out_dir / "report.html").write_text(render_html(run.summary, images))


@simulate_app.callback(invoke_without_command=True)
def simulate_command(
    load: Annotated[str, typer.Option("--load", help="Load trace spec, as for `lowtide loadgen --trace`.")],
    days: Annotated[float, typer.Option("--days", help="Simulated days (> 0, at most 366).")],
    jobs: Annotated[
        str, typer.Option("--jobs", help="Research jobs: alibaba:CSV, philly:CSV or synthetic[:...].")
    ] = "synthetic",
    cluster: Annotated[
        Path | None, typer.Option("--cluster", help="A lowtide.yaml describing nodes, services, lending.")
    ] = None,
    policy: Annotated[
        str, typer.Option("--policy", help="none | window | continuous | forecast | oracle.")
    ] = "continuous",
    compare_: Annotated[
        str | None,
        typer.Option("--compare", help="Several policies side by side, e.g. none,window,continuous."),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Random seed (same seed, same result).")] = 0,
    price: Annotated[float, typer.Option("--price", help="Price of a GPU-hour, for savings.")] = 0.0,
    currency: Annotated[str, typer.Option("--currency", help="Currency of --price (3 letters).")] = "USD",
    out_dir: Annotated[Path, typer.Option("--out", help="Where summary.json and report.html go.")] = Path(
        "simulation"
    ),
    data_dir: Annotated[
        Path | None, typer.Option("--data-dir", help="Where relative trace paths are looked up.")
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the summary JSON instead of a table.")
    ] = False,
) -> None:
    """Run lowtide's own control loop on a virtual clock over a load trace and research jobs."""
    from lowtide.config import ConfigError  # noqa: PLC0415  (the simulator loads only when it runs)
    from lowtide.emulator.traces import TraceSpecError  # noqa: PLC0415
    from lowtide.sim.jobs import JobTraceError  # noqa: PLC0415
    from lowtide.sim.run import compare  # noqa: PLC0415

    if not (0 < days <= 366) or not math.isfinite(days):
        _bad_input(f"--days: must be > 0 and at most 366, got {days:g}")
    if not (price >= 0 and math.isfinite(price)):
        _bad_input(f"--price: must be a finite number ≥ 0, got {price:g}")
    if len(currency) != 3 or not currency.isalpha() or not currency.isupper():
        _bad_input(f"--currency: three upper-case letters such as USD or KRW, got {currency!r}")
    policies = _policies(compare_) if compare_ is not None else _policies(policy)
    if compare_ is None and len(policies) != 1:
        _bad_input("--policy takes one policy; use --compare for several")
    try:
        scenario = build_scenario(load, jobs, cluster, days, seed, data_dir)
    except (TraceSpecError, JobTraceError, ConfigError, ValueError, OSError) as exc:
        _bad_input(str(exc))
    with err.status(f"simulating {days:g} days on {scenario.pool_gpus} GPUs ({', '.join(policies)})…"):
        runs = compare(scenario, policies, price=price, currency=currency)
    if compare_ is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        document = {"policies": [r.policy for r in runs], "runs": {r.policy: r.summary for r in runs}}
        (out_dir / "compare.json").write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    else:
        write_single(runs[0], out_dir)
    if as_json:
        typer.echo(
            json.dumps(runs[0].summary if compare_ is None else {r.policy: r.summary for r in runs}, indent=2)
        )
    else:
        print_table(runs)
        written = "compare.json" if compare_ is not None else "summary.json and report.html"
        out.print(f"wrote {safe(written)} in {safe(str(out_dir))}")
