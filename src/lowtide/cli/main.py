"""The `lowtide` command line (Typer + Rich).

Every command but `up` and `validate` talks to the REST API (`--url`, `$LOWTIDE_URL`, or the
config's API address) with a token (`--token`, `$LOWTIDE_TOKEN`, or the admin token file the
embedded mode wrote). Exit codes: 0 success; 2 bad input or a request the API refused (4xx), with
the located errors printed; 1 anything else (server error, unreachable, a waited-on job that did
not succeed). `--output json|yaml|csv` (`--json`) prints machine-readable output (`cli.formats`);
waits show a spinner on a terminal; `--watch` redraws with Rich Live until Ctrl-C (exit 0).
Must not: touch the store directly.
"""

from __future__ import annotations

import codecs
import itertools
import json
import logging
import os
import secrets
import sys
import threading
import time
import uuid
import webbrowser
from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
import yaml
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from lowtide import __version__
from lowtide.cli.argo_cmd import argo_app
from lowtide.cli.client import ApiFailure, Client
from lowtide.cli.doctor_cmd import doctor_command
from lowtide.cli.emulate_cmd import emulate_app
from lowtide.cli.formats import Format, JsonOpt, OutputOpt, chosen, emit
from lowtide.cli.k8s_cmd import k8s_app
from lowtide.cli.loadgen_cmd import loadgen_app
from lowtide.cli.metrics_cmd import metrics_app
from lowtide.cli.output import HELP_MARKUP, clean, console, safe
from lowtide.cli.report_cmd import gpu_time, lost_work_line, report_command
from lowtide.cli.simulate_cmd import simulate_app
from lowtide.config import ConfigError, Settings, load_settings
from lowtide.domain.ids import JOB_ID_RE

#: The variable a shell completion script sets to ask `lowtide` for completions.
COMPLETE_VAR = "_LOWTIDE_COMPLETE"
app = typer.Typer(
    name="lowtide",
    help="Run research jobs on the GPUs your inference fleet is not using.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=HELP_MARKUP,
)
if os.environ.get(COMPLETE_VAR):  # a shell asks for completions (`lowtide completion SHELL`)
    from typer._completion_classes import completion_init

    completion_init()  # Typer's bash/zsh/fish/powershell, registered only with add_completion
token_app = typer.Typer(help="Manage API tokens (admin).", no_args_is_help=True, rich_markup_mode=HELP_MARKUP)
app.add_typer(token_app, name="token")
app.add_typer(metrics_app, name="metrics", help="Read vLLM /metrics the way lowtide does.")
app.add_typer(emulate_app, name="emulate", help="Emulated inference servers for machines without GPUs.")
app.add_typer(loadgen_app, name="loadgen")
app.add_typer(simulate_app, name="simulate", help="Simulate lending on a virtual clock over real traces.")
app.add_typer(argo_app, name="argo", help="Cluster mode: the Argo Workflow a job becomes.")
app.add_typer(k8s_app, name="k8s", help="Cluster mode: the objects of lowtide's Helm chart.")
app.command("doctor", help="Check a running vLLM replica against what lowtide needs.")(doctor_command)


out = console()
err = console(stderr=True)
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
#: How long `lowtide submit` keeps retrying an unreachable or unavailable lowtide (same key).
SUBMIT_RETRY_S = 60.0


class _State:
    config: str | None = None
    url: str | None = None
    token: str | None = None


state = _State()
#: How `--watch` waits between two refreshes (tests replace it).
_sleep: Callable[[float], None] = time.sleep
WATCH_S = 1.0
PARAM_HELP = (
    "Set a parameter the spec declares: k=v (repeatable). A list or mapping is YAML, "
    "e.g. -p 'tags=[a, b]' or -p 'opt={beta: 0.9}'."
)


def _version(value: bool) -> None:
    if value:
        sys.stdout.write(f"lowtide {__version__}\n")
        raise typer.Exit(0)


@app.callback()
def _main(
    config: Annotated[
        str | None, typer.Option("--config", "-c", envvar="LOWTIDE_CONFIG", help="lowtide.yaml to use.")
    ] = None,
    url: Annotated[str | None, typer.Option("--url", envvar="LOWTIDE_URL", help="API address.")] = None,
    token: Annotated[str | None, typer.Option("--token", envvar="LOWTIDE_TOKEN", help="API token.")] = None,
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            is_eager=True,
            callback=_version,
            help="Print lowtide's version and exit.",
        ),
    ] = False,
) -> None:
    state.config, state.url, state.token = config, url, token


# -- helpers ---------------------------------------------------------------------------------


def _fail(
    message: str, code: int = 2, errors: list[dict[str, str]] | None = None, where: str = ""
) -> NoReturn:
    err.print(f"[red]error:[/red] {safe(message)}")
    for e in errors or []:
        prefix = f"{where}: " if where else ""
        err.print(f"  {safe(prefix)}{safe(e.get('loc', ''))}: {safe(e.get('msg', ''))}")
    raise typer.Exit(code)


def _print_warnings(warnings: list[dict[str, str]] | None, where: str = "") -> None:
    """The API's (or local validation's) warnings, on stderr: what of the spec is ignored."""
    prefix = f"{where}: " if where else ""
    for w in warnings or []:
        where_ = f"{prefix}{w.get('loc', '')}"
        err.print(f"[yellow]warning:[/yellow] {safe(where_)}: {safe(w.get('msg', ''))}")


def _settings() -> Settings:
    try:
        return load_settings(state.config)
    except ConfigError as exc:
        _fail(str(exc))


def _client() -> Client:
    settings: Settings | None = None
    url = state.url
    token = state.token
    if url is None or token is None:
        settings = _settings()
    if url is None:
        assert settings is not None
        url = settings.api.url
    if token is None and settings is not None:
        path = settings.admin_token_path
        if path.exists():
            try:
                token = path.read_text(encoding="utf-8").strip()
            except OSError:
                token = None
    return Client(url, token)


app.command("report")(report_command(_client))


def _call(fn: Any, *args: Any, where: str = "", **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except ApiFailure as exc:
        _fail(exc.message, 2 if exc.client_error else 1, exc.errors, where)


def _when(ts: float | None) -> str:
    if not ts:
        return "-"
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _dur(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _content_type(path: Path) -> str:
    return "application/json" if path.suffix.lower() == ".json" else "application/yaml"


def _read_spec(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        _fail(f"cannot read {path}: {exc.strerror or exc}")


def _state_style(s: str) -> str:
    color = {
        "SUCCEEDED": "green",
        "FAILED": "red",
        "CANCELLED": "yellow",
        "RUNNING": "cyan",
        "PREEMPTING": "magenta",
        "PREEMPTED": "magenta",
        "CANCELLING": "yellow",
        "SKIPPED": "dim",
    }.get(s)
    return f"[{color}]{safe(s)}[/{color}]" if color else safe(s)


def _state_text(s: str) -> Text:
    return Text.from_markup(_state_style(s))


def _cells(*cells: object) -> list[Text]:
    """Table cells: text as written (never markup, control characters made visible), or a
    `Text` already styled (`_state_text`)."""
    return [c if isinstance(c, Text) else Text(clean(c)) for c in cells]


# -- commands --------------------------------------------------------------------------------


@app.command()
def up(
    host: Annotated[str | None, typer.Option(help="Listen address (default from config).")] = None,
    port: Annotated[int | None, typer.Option(help="Listen port (default from config).")] = None,
    stop_replicas_on_exit: Annotated[
        bool, typer.Option(help="Stop the gateway and replicas when lowtide stops (default: keep serving).")
    ] = False,
    config: Annotated[
        str | None, typer.Option("--config", "-c", help="lowtide.yaml to use (as `lowtide -c FILE up`).")
    ] = None,
) -> None:
    """Start the embedded control plane: API, scheduling loop, executor, services and gateways."""
    from lowtide.wiring import ServeError, preflight, serve  # noqa: PLC0415 (server-only imports)

    if config is not None:
        state.config = config
    overrides: dict[str, Any] = {}
    settings = _settings()
    if host or port:
        api = settings.api.model_copy(update={k: v for k, v in (("host", host), ("port", port)) if v})
        overrides["api"] = api
    if overrides:
        settings = settings.model_copy(update=overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # health checks and scrapes: one line each
    try:  # before "listening": an engine that does not answer, or run_as that cannot work, exit 2
        for warning in preflight(settings):
            err.print(f"WARNING: {warning}", markup=False, highlight=False, style="bold yellow")
    except ConfigError as exc:
        _fail(str(exc))

    def listening(real: Settings) -> None:  # only once it really listens: a refused start says only why
        err.print(f"lowtide listening on {real.api.url} (state in {Path(real.state_dir).resolve()})")
        if real.auth.enabled:
            err.print(f"admin token: {real.admin_token_path} (created on first start, mode 0600)")

    try:
        serve(settings, stop_replicas_on_exit=stop_replicas_on_exit, on_listening=listening)
    except ConfigError as exc:
        _fail(str(exc))
    except ServeError as exc:
        _fail(str(exc), 1)


@app.command()
def validate(
    file: Annotated[Path, typer.Argument(help="Job spec (YAML or JSON).")],
    param: Annotated[list[str] | None, typer.Option("--param", "-p", help=PARAM_HELP)] = None,
    as_json: JsonOpt = False,
) -> None:
    """Check a job spec locally; exit 0 if valid, 2 with located errors if not."""
    from lowtide.adapters.templates import DirectoryTemplates  # noqa: PLC0415
    from lowtide.domain.spec_document import parse_document  # noqa: PLC0415
    from lowtide.domain.spec_issues import SpecInvalid, excerpt  # noqa: PLC0415
    from lowtide.domain.spec_parse import build_job_spec, image_warnings, require_images  # noqa: PLC0415
    from lowtide.domain.spec_render import parse_param_assignment  # noqa: PLC0415

    settings = _settings()
    max_gpus = _declared_max_gpus(settings)
    overrides: dict[str, Any] = {}
    locs: dict[str, str] = {}
    for text in param or []:
        try:
            key, value = parse_param_assignment(text)
        except ValueError as exc:
            _fail(f"--param {excerpt(text)}: {exc}")
        overrides[key], locs[key] = value, f"--param {excerpt(text)}"
    data = _read_spec(file)
    templates_dir = Path(settings.templates_dir)
    templates = DirectoryTemplates(templates_dir) if templates_dir.is_dir() else None
    try:
        doc = parse_document(data, fmt="json" if file.suffix.lower() == ".json" else "auto")
        spec = build_job_spec(
            doc,
            templates=templates,
            param_overrides=overrides,
            max_gpus_per_node=max_gpus,
            override_locs=locs,
            max_steps_per_job=settings.scheduler.max_steps_per_job,
            max_gpu_memory_gib=_declared_max_gpu_memory(settings),
        )
        if settings.executor.runtime != "process":
            require_images(spec, settings.executor.runtime)
    except SpecInvalid as exc:
        if as_json:
            _print_json({"valid": False, "errors": [{"loc": i.loc, "msg": i.msg} for i in exc.issues]})
            raise typer.Exit(2) from exc
        err.print(f"[red]{safe(file)}: invalid job spec ({len(exc.issues)} problem(s))[/red]")
        for issue in exc.issues:
            err.print(f"  {safe(file)}: {safe(issue.loc)}: {safe(issue.msg)}")
        raise typer.Exit(2) from exc
    warnings = [{"loc": w.loc, "msg": w.msg} for w in image_warnings(spec, settings.executor.runtime)]
    _print_warnings(warnings, str(file))
    if as_json:
        _print_json({"valid": True, "spec": spec.to_document(), "warnings": warnings})
        return
    gpus = max((s.gpus for s in spec.steps), default=0)
    memory = max((s.gpu_memory_gib for s in spec.steps if s.gpu_memory_gib is not None), default=None)
    need = "" if memory is None else f", needing up to {memory:g} GiB per GPU"
    out.print(
        f"[green]OK[/green] {safe(file)}: job '{safe(spec.name)}', {len(spec.steps)} step(s), "
        f"up to {gpus} GPU(s) per step{need}"
    )


def _declared_max_gpu_memory(settings: Settings) -> float | None:
    """The largest declared GPU memory when every node declares one (else unknown here: None)."""
    sizes = [node.gpu_memory_gib for node in settings.nodes]
    if not sizes or any(m is None for m in sizes):
        return None
    return max(m for m in sizes if m is not None)


def _declared_max_gpus(settings: Settings) -> int | None:
    sizes = []
    for node in settings.nodes:
        if node.gpus == "auto":
            return None  # known only on the host, through NVML: the server checks on submit
        sizes.append(node.gpus if isinstance(node.gpus, int) else len(node.gpus))
    return max(sizes, default=0)


@app.command()
def submit(
    file: Annotated[Path, typer.Argument(help="Job spec (YAML or JSON); - reads it from stdin.")],
    param: Annotated[list[str] | None, typer.Option("--param", "-p", help=PARAM_HELP)] = None,
    sweep: Annotated[
        list[str] | None,
        typer.Option(
            "--sweep",
            help="k=v1,v2,...: one job per value (repeatable: one per combination), grouped under one "
            "name, NAME-sweep-XXXXXX (list them with `lowtide jobs --name`).",
        ),
    ] = None,
    wait: Annotated[
        bool, typer.Option("--wait", help="Wait until the job ends; exit 0 only if it succeeded.")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Validate on the server; store nothing.")
    ] = False,
    as_json: JsonOpt = False,
    output: OutputOpt = None,
) -> None:
    """Submit a job. Warnings (what of the spec is ignored here) go to stderr; with --json, only
    JSON goes to stdout (with --wait, the final job detail plus the submit's `warnings`)."""
    stdin = str(file) == "-"
    data = sys.stdin.buffer.read() if stdin else _read_spec(file)
    where = "<stdin>" if stdin else str(file)
    content_type = "application/octet-stream" if stdin else _content_type(file)
    fmt = chosen(output, as_json)
    client = _client()
    if sweep:
        if wait:
            _fail("--wait follows one job; watch a sweep with `lowtide jobs --name NAME --watch`")
        _submit_sweep(client, data, content_type, where, param or [], sweep, dry_run, fmt)
        return

    def retrying(failure: ApiFailure, wait: float) -> None:
        err.print(f"[yellow]{safe(failure.message)}[/yellow]; retrying in {wait:g}s (same Idempotency-Key)")

    # One key per invocation: a retry after a lost answer or a 503 returns the same job.
    with _spinner(f"submitting {where}"):
        result = _call(
            client.submit,
            data,
            content_type=content_type,
            params=param or [],
            dry_run=dry_run,
            idempotency_key=None if dry_run else str(uuid.uuid4()),
            retry_for_s=0.0 if dry_run else SUBMIT_RETRY_S,
            on_retry=retrying,
            where=where,
        )
    _print_warnings(result.get("warnings"), where)
    machine = fmt is not Format.table
    if dry_run:
        emit(result, fmt) if machine else out.print(f"[green]valid[/green] {safe(where)}")
        return
    if machine and not wait:
        emit(result, fmt, _job_rows([result]))
        return
    (err if machine else out).print(
        f"submitted [bold]{safe(result['id'])}[/bold] ({safe(result['name'])}, team {safe(result['team'])})"
    )
    if wait:
        final = _wait(client, result["id"], quiet=machine)
        if machine:
            emit({**final, "warnings": result.get("warnings", [])}, fmt)
        raise typer.Exit(0 if final["job"]["state"] == "SUCCEEDED" else 1)


def _sweep_values(sweep: list[str]) -> list[list[str]]:
    """`k=v1,v2` options as lists of `k=v` assignments, one list per option (exit 2 if unreadable)."""
    axes: list[list[str]] = []
    for text in sweep:
        key, sep, values = text.partition("=")
        if not sep or not key.strip() or not values.strip():
            _fail(f"--sweep {text!r}: expected k=v1,v2,...")
        items = [v.strip() for v in values.split(",")]
        if any(not v for v in items):
            _fail(f"--sweep {text!r}: an empty value")
        axes.append([f"{key.strip()}={v}" for v in items])
    return axes


def _renamed(data: bytes, suffix: str, where: str) -> bytes:
    """The spec with its name ending in `suffix` (the sweep's group name), as YAML."""
    try:
        doc = yaml.safe_load(data)
    except yaml.YAMLError as exc:
        _fail(f"{where}: not YAML or JSON ({exc.__class__.__name__}); cannot name the sweep")
    if not isinstance(doc, dict):
        _fail(f"{where}: a job spec is a mapping")
    base = str(doc.get("name") or "sweep")[: 63 - len(suffix)].rstrip("-")
    doc["name"] = f"{base}{suffix}"
    return yaml.safe_dump(doc, sort_keys=False).encode()


def _submit_sweep(
    client: Client,
    data: bytes,
    content_type: str,
    where: str,
    params: list[str],
    sweep: list[str],
    dry_run: bool,
    fmt: Format,
) -> None:
    """One job per combination of the --sweep values, all named NAME-sweep-XXXXXX."""
    combos = [list(c) for c in itertools.product(*_sweep_values(sweep))]
    body = _renamed(data, f"-sweep-{secrets.token_hex(3)}", where)
    for combo in combos:  # all of them valid before any is stored
        with _spinner(f"validating {len(combos)} job(s)"):
            _call(
                client.submit,
                body,
                content_type="application/yaml",
                params=[*params, *combo],
                dry_run=True,
                where=f"{where} ({', '.join(combo)})",
            )
    if dry_run:
        out.print(
            f"[green]valid[/green] {safe(where)}: {len(combos)} job(s)"
        ) if fmt is Format.table else emit({"valid": True, "jobs": len(combos)}, fmt)
        return
    made: list[dict[str, Any]] = []
    for combo in combos:
        with _spinner(f"submitting job {len(made) + 1} of {len(combos)}"):
            job = _call(
                client.submit,
                body,
                content_type="application/yaml",
                params=[*params, *combo],
                idempotency_key=str(uuid.uuid4()),
                retry_for_s=SUBMIT_RETRY_S,
                where=f"{where} ({', '.join(combo)})",
            )
        made.append({**job, "sweep": dict(c.split("=", 1) for c in combo)})
    rows: list[list[object]] = [["JOB", "NAME", *(c.split("=", 1)[0] for c in combos[0]), "STATE"]]
    for job in made:
        rows.append([job["id"], job["name"], *job["sweep"].values(), job["state"]])
    if fmt is not Format.table:
        emit(made, fmt, rows)
        return
    table = Table(*map(str, rows[0]), title=f"sweep {made[0]['name']}: {len(made)} job(s)")
    for row in rows[1:]:
        table.add_row(*_cells(*row))
    out.print(table)
    out.print(f"list them: lowtide jobs --name {safe(made[0]['name'])}")


class _spinner:  # noqa: N801 (used like a function: `with _spinner(...)`)
    """A spinner on stderr while waiting, when stderr is a terminal (nothing otherwise)."""

    def __init__(self, what: str, enabled: bool = True) -> None:
        self.status = err.status(safe(what)) if enabled and err.is_terminal else None

    def update(self, what: str) -> None:
        if self.status is not None:
            self.status.update(safe(what))

    def __enter__(self) -> _spinner:
        if self.status is not None:
            self.status.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.status is not None:
            self.status.stop()


def _wait(
    client: Client, job_id: str, *, quiet: bool = False, poll: float = 1.0, spin: bool = True
) -> dict[str, Any]:
    seen: dict[str, str] = {}
    began = time.monotonic()
    with _spinner(f"waiting for job {job_id}", enabled=spin) as spinner:
        while True:
            detail: dict[str, Any] = _call(client.json, "GET", f"/v1/jobs/{job_id}")
            for step in detail["steps"]:
                if seen.get(step["name"]) != step["state"]:
                    seen[step["name"]] = step["state"]
                    if not quiet:
                        extra = (
                            f" — {safe(step['reason'])}"
                            if step["reason"] and step["state"] not in ("RUNNING",)
                            else ""
                        )
                        out.print(f"  {safe(step['name'])}: {_state_style(step['state'])}{extra}")
            if detail["job"]["state"] in TERMINAL and not any(
                s["state"] in ("RUNNING", "CANCELLING", "PREEMPTING") for s in detail["steps"]
            ):
                if not quiet:
                    job = detail["job"]
                    out.print(f"job {safe(job_id)}: {_state_style(job['state'])} {safe(job['message'])}")
                return detail
            counts = ", ".join(f"{k.lower()} {v}" for k, v in sorted(detail["job"]["steps"].items()))
            spinner.update(
                f"job {job_id}: {detail['job']['state']} ({counts}) {_dur(time.monotonic() - began)}"
            )
            time.sleep(poll)


WatchOpt = Annotated[
    bool, typer.Option("--watch", "-w", help="Refresh every second until Ctrl-C (which exits 0).")
]


def _elapsed(j: dict[str, Any], now: float) -> float | None:
    """How long a job has run: from its start to its end (or now)."""
    if not j.get("started_at"):
        return None
    return float(j.get("finished_at") or now) - float(j["started_at"])


def _job_rows(jobs_: list[dict[str, Any]]) -> list[list[object]]:
    now = time.time()
    rows: list[list[object]] = [
        ["JOB", "NAME", "TEAM", "OWNER", "PRI", "STATE", "STEPS", "SUBMITTED", "ELAPSED"]
    ]
    for j in jobs_:
        steps = " ".join(f"{k.lower()}:{v}" for k, v in sorted(j["steps"].items()))
        rows.append(
            [
                j["id"],
                j["name"],
                j["team"],
                j["owner"],
                str(j["priority"]),
                j["state"],
                steps,
                _when(j["submitted_at"]),
                _dur(_elapsed(j, now)),
            ]
        )
    return rows


def _jobs_table(data: dict[str, Any]) -> Table:
    rows = _job_rows(data["jobs"])
    table = Table(*map(str, rows[0]))
    for row in rows[1:]:
        table.add_row(*_cells(*row[:5], _state_text(str(row[5])), *row[6:]))
    return table


def _watch(render: Callable[[], Any], iterations: int | None) -> None:
    """`render()` in place, again every WATCH_S seconds, until Ctrl-C (exit 0) or `iterations`."""
    done = 0
    try:
        with Live(render(), console=out, auto_refresh=False, transient=False) as live:
            while iterations is None or done < iterations:
                _sleep(WATCH_S)
                live.update(render(), refresh=True)
                done += 1
    except KeyboardInterrupt:
        pass
    raise typer.Exit(0)


#: Stops `--watch` after this many refreshes (tests).
IterationsOpt = Annotated[int | None, typer.Option("--iterations", hidden=True)]


@app.command()
def jobs(
    state_: Annotated[list[str] | None, typer.Option("--state", help="Filter by state (repeatable).")] = None,
    team: Annotated[str | None, typer.Option(help="Filter by team.")] = None,
    owner: Annotated[str | None, typer.Option(help="Filter by owner.")] = None,
    name: Annotated[str | None, typer.Option(help="Filter by job name (e.g. a sweep's).")] = None,
    limit: Annotated[int, typer.Option(help="At most this many.")] = 50,
    watch: WatchOpt = False,
    iterations: IterationsOpt = None,
    as_json: JsonOpt = False,
    output: OutputOpt = None,
) -> None:
    """List jobs, newest first, with how long each ran (ELAPSED)."""
    params: list[tuple[str, str | int]] = [("limit", limit)]
    params += [("state", s.upper()) for s in state_ or []]
    if team:
        params.append(("team", team))
    if owner:
        params.append(("owner", owner))
    if name:
        params.append(("name", name))
    client = _client()

    def fetch() -> dict[str, Any]:
        data: dict[str, Any] = _call(client.json, "GET", "/v1/jobs", params=params)
        return data

    fmt = chosen(output, as_json)
    if watch:
        if fmt is not Format.table:
            _fail("--watch shows a table; it cannot be combined with --output/--json")
        _watch(lambda: _jobs_table(fetch()), iterations)
    data = fetch()
    if fmt is not Format.table:
        emit(data, fmt, _job_rows(data["jobs"]))
        return
    out.print(_jobs_table(data))


@app.command()
def show(
    job: Annotated[str, typer.Argument(help="Job id.")],
    watch: WatchOpt = False,
    iterations: IterationsOpt = None,
    as_json: JsonOpt = False,
    output: OutputOpt = None,
) -> None:
    """A job's steps, attempts, checkpoints and events (CSV: the steps)."""
    client = _client()

    def fetch() -> dict[str, Any]:
        d: dict[str, Any] = _call(client.json, "GET", f"/v1/jobs/{job}")
        return d

    fmt = chosen(output, as_json)
    if watch:
        if fmt is not Format.table:
            _fail("--watch shows tables; it cannot be combined with --output/--json")
        _watch(lambda: Group(*_detail(fetch())), iterations)
    d = fetch()
    if fmt is not Format.table:
        rows: list[list[object]] = [["STEP", "STATE", "GPUS", "DEPENDS", "RETRIES", "CHECKPOINT", "REASON"]]
        for s in d["steps"]:
            rows.append(
                [
                    s["name"],
                    s["state"],
                    s["gpus"],
                    " ".join(s["depends"]),
                    f"{s['retries_used']}/{s['max_retries']}",
                    s["last_checkpoint"] or "",
                    s["reason"],
                ]
            )
        emit(d, fmt, rows)
        return
    for part in _detail(d):
        out.print(part)


def _detail(d: dict[str, Any]) -> list[Any]:
    """What `show` prints of a job detail: lines and tables, in order."""
    parts: list[Any] = []
    j = d["job"]
    elapsed = _dur(_elapsed(j, time.time()))
    parts.append(
        f"[bold]{safe(j['id'])}[/bold] {safe(j['name'])}  team={safe(j['team'])} owner={safe(j['owner'])} "
        f"priority={safe(j['priority'])}"
    )
    parts.append(f"state: {_state_style(j['state'])} {safe(j['message'])}")
    parts.append(
        f"submitted {_when(j['submitted_at'])}  started {_when(j['started_at'])}  "
        f"finished {_when(j['finished_at'])}  elapsed {elapsed}"
        + (f"  rerun of {safe(j['rerun_of'])}" if j["rerun_of"] else "")
    )
    steps = Table("STEP", "STATE", "GPUS", "DEPENDS", "RETRIES", "CHECKPOINT", "REASON", title="steps")
    for s in d["steps"]:
        steps.add_row(
            *_cells(
                s["name"],
                _state_text(s["state"]),
                str(s["gpus"]),
                ",".join(s["depends"]) or "-",
                f"{s['retries_used']}/{s['max_retries']}",
                s["last_checkpoint"] or "-",
                s["reason"],
            )
        )
    parts.append(steps)
    if d["attempts"]:
        att = Table(
            "STEP", "#", "STATE", "WHERE", "STARTED", "RAN", "EXIT", "WORK LOST", "MESSAGE", title="attempts"
        )
        for a in d["attempts"]:
            where = f"{a['node']}:{','.join(map(str, a['gpus']))}" if a["gpus"] else a["node"]
            # RAN counts from when it began to run (a pending attempt has not yet: "pending").
            began = a.get("running_at")
            ran = (
                "pending"
                if began is None and a["state"] == "PENDING"
                else _dur((a["ended_at"] or time.time()) - (began if began is not None else a["started_at"]))
            )
            code = (
                str(a["exit_code"])
                if a["exit_code"] is not None
                else (f"sig{a['signal']}" if a["signal"] else "-")
            )
            reason = a.get("exit_reason")
            if reason and reason not in ("EXITED", "SIGNALLED"):  # the code alone does not say it
                code = f"{code} {reason}" if code != "-" else reason
            att.add_row(
                *_cells(
                    a["step"],
                    str(a["number"]),
                    _state_text(a["state"]),
                    where,
                    _when(a["started_at"]),
                    ran,
                    code,
                    gpu_time(a.get("lost_gpu_seconds")),
                    a["message"],
                )
            )
        parts.append(att)
        parts.append(safe(lost_work_line(d["steps"], d["attempts"])))
    if d["checkpoints"]:
        number = {a["id"]: a["number"] for a in d["attempts"]}
        ck = Table("STEP", "ATTEMPT", "CHECKPOINT", "PROGRESS", "SOURCE", "AT", title="checkpoints")
        for c in d["checkpoints"]:
            ck.add_row(
                *_cells(
                    c["step"],
                    str(number.get(c["attempt_id"], c["attempt_id"])),
                    c["label"],
                    c["progress"] or "-",
                    c["source"],
                    _when(c["reported_at"]),
                )
            )
        parts.append(ck)
    if d["events"]:
        ev = Table("AT", "STEP", "EVENT", "MESSAGE", title="events")
        for e in d["events"][-30:]:
            ev.add_row(*_cells(_when(e["at"]), e["step"] or "-", e["kind"], e["message"]))
        parts.append(ev)
    return parts


@app.command()
def logs(
    job: Annotated[str, typer.Argument(help="Job id.")],
    step_arg: Annotated[
        str | None, typer.Argument(metavar="[STEP]", help="One step (as --step; default: all steps).")
    ] = None,
    step_opt: Annotated[str | None, typer.Option("--step", "-s", help="Only this step.")] = None,
    follow: Annotated[
        bool,
        typer.Option(
            "--follow",
            "-f",
            help="Keep printing until the steps end, across retries and requeues, waiting for steps "
            "that have not started.",
        ),
    ] = False,
    tail: Annotated[
        int | None, typer.Option("--tail", "-n", min=0, help="Only the last N lines of each step first.")
    ] = None,
    since: Annotated[
        str | None,
        typer.Option(
            help="Only attempts running in the last DURATION (30s, 10m, 2h, 1d): logs carry no "
            "timestamps, so older attempts are left out whole."
        ),
    ] = None,
    attempt: Annotated[int | None, typer.Option(help="Attempt number (default: the latest).")] = None,
    raw: Annotated[
        bool, typer.Option("--raw", help="Write the bytes as the step wrote them (control characters too).")
    ] = False,
) -> None:
    """Print a job's output: every step's (each line prefixed with `[step]`), or one step's
    (--step, unprefixed). Control characters other than newline and tab are shown as escapes
    (\\x1b), so a log cannot drive the terminal; --raw writes the bytes unchanged. With -f (and no
    --attempt) each step is followed across attempts: when one ends and the step is queued again
    (a retry, a preemption), a separator line goes to stderr and the next attempt's output
    follows; a step that has not started is waited for; it stops when every step has finished."""
    if step_arg is not None and step_opt is not None and step_arg != step_opt:
        _fail(f"two steps named: {step_arg!r} and --step {step_opt!r}")
    step = step_opt or step_arg
    cutoff = None if since is None else time.time() - _parse_duration(since, "--since")
    client = _client()
    try:
        if step is not None:
            _step_logs(
                client, job, step, _LogSink(raw), follow=follow, attempt=attempt, tail=tail, cutoff=cutoff
            )
            return
        detail: dict[str, Any] = client.json("GET", f"/v1/jobs/{job}")
        names = [s["name"] for s in detail["steps"]]
        lock = threading.Lock()
        if not follow:
            if not detail["attempts"] and attempt is None:
                err.print(f"no step of job {safe(job)} has started yet (-f waits for them)")
            for name in names:
                if any(a["step"] == name for a in detail["attempts"]) or attempt is not None:
                    sink = _LogSink(raw, prefix=name, lock=lock)
                    _step_logs(
                        client, job, name, sink, follow=False, attempt=attempt, tail=tail, cutoff=cutoff
                    )
            return
        failures: list[ApiFailure] = []

        def one(name: str) -> None:
            try:
                sink = _LogSink(raw, prefix=name, lock=lock)
                _step_logs(client, job, name, sink, follow=True, attempt=attempt, tail=tail, cutoff=cutoff)
            except ApiFailure as exc:
                failures.append(exc)

        threads = [threading.Thread(target=one, args=(n,), daemon=True) for n in names]
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.2)
        if failures:
            raise failures[0]
    except ApiFailure as exc:
        _fail(exc.message, 2 if exc.client_error else 1, exc.errors)


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _parse_duration(text: str, where: str) -> float:
    """`30s`, `10m`, `2h`, `1d` (or plain seconds) in seconds; exit 2 if unreadable."""
    t = text.strip().lower()
    unit = _UNITS.get(t[-1:])
    number = t[:-1] if unit is not None else t
    try:
        value = float(number) * (unit or 1)
    except ValueError:
        _fail(f"{where} {text!r}: expected a duration such as 30s, 10m, 2h or 1d")
    if not 0 <= value < float("inf"):
        _fail(f"{where} {text!r}: expected a duration such as 30s, 10m, 2h or 1d")
    return value


def _step_logs(
    client: Client,
    job: str,
    step: str,
    sink: _LogSink,
    *,
    follow: bool,
    attempt: int | None,
    tail: int | None,
    cutoff: float | None,
) -> None:
    try:
        if cutoff is not None and attempt is None:
            detail: dict[str, Any] = client.json("GET", f"/v1/jobs/{job}")
            mine = [a for a in detail["attempts"] if a["step"] == step]
            recent = [a for a in mine if a["ended_at"] is None or a["ended_at"] >= cutoff]
            if mine and not recent and not follow:
                return  # nothing of this step ran in that window
        if not follow or attempt is not None:
            _print_attempt(client, job, step, sink, attempt=attempt, follow=follow, tail=tail)
        else:
            _follow_step(client, job, step, sink, tail=tail)
    finally:
        sink.close()


def _print_attempt(
    client: Client,
    job: str,
    step: str,
    sink: _LogSink,
    *,
    attempt: int | None,
    follow: bool,
    tail: int | None,
) -> None:
    """One attempt's log: all of it, or its last `tail` lines; with `follow`, then what comes.
    A log gone with its pod (410, cluster mode: docs/cluster.md "Logs") is said on stderr, and the
    other steps and attempts are still shown."""
    try:
        if tail is None:
            sink.write_all(client.stream_logs(job, step, attempt=attempt, follow=follow))
            return
        data = b"".join(client.stream_logs(job, step, attempt=attempt, follow=False))
        lines = data.splitlines(keepends=True)
        sink.write(b"".join(lines[-tail:] if tail else []))
        if follow:
            sink.write_all(client.stream_logs(job, step, attempt=attempt, follow=True, offset=len(data)))
    except ApiFailure as exc:
        if exc.status != 410:
            raise
        sink.close()
        err.print(f"{safe(step)}: {safe(exc.message)}", highlight=False)


#: Step states after which no attempt of the step will start.
_STEP_DONE = frozenset({"SUCCEEDED", "FAILED", "CANCELLED", "SKIPPED"})


class _LogSink:
    """Writes log bytes to stdout: decoded as UTF-8 (bad bytes replaced) and `clean`ed, or raw.
    With a `prefix`, each line starts with `[prefix] ` and only whole lines are written (under
    `lock`, so the lines of steps followed at once never interleave)."""

    def __init__(self, raw: bool, prefix: str | None = None, lock: threading.Lock | None = None) -> None:
        self.raw = raw
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.prefix = prefix
        self.lock = lock or threading.Lock()
        self.pending = b""
        self.label = f"[{clean(prefix)}] " if prefix is not None else ""

    def _out(self, chunk: bytes) -> None:
        if self.raw:
            sys.stdout.buffer.write(chunk)
        else:
            sys.stdout.write(clean(self.decoder.decode(chunk)))

    def write(self, chunk: bytes) -> None:
        with self.lock:
            if self.prefix is None:
                self._out(chunk)
            else:
                self.pending += chunk
                *lines, self.pending = self.pending.split(b"\n")
                for line in lines:
                    self._out(self.label.encode() + line + b"\n")
            sys.stdout.flush()

    def write_all(self, chunks: Iterable[bytes]) -> None:
        for chunk in chunks:
            self.write(chunk)

    def close(self) -> None:
        with self.lock:
            if self.pending:
                self._out(self.label.encode() + self.pending + b"\n")
                self.pending = b""
            if not self.raw:
                sys.stdout.write(clean(self.decoder.decode(b"", final=True)))
            sys.stdout.flush()


def _follow_step(
    client: Client, job: str, step: str, sink: _LogSink, poll: float = 0.5, tail: int | None = None
) -> None:
    """Follow `step` of `job` from its latest attempt on, across retries, until it has finished."""
    followed: int | None = None
    waiting: _spinner | None = None
    label = f"{step}: " if sink.prefix is not None else ""
    try:
        while True:
            detail: dict[str, Any] = client.json("GET", f"/v1/jobs/{job}")
            states = {s["name"]: s["state"] for s in detail["steps"]}
            numbers = sorted(a["number"] for a in detail["attempts"] if a["step"] == step)
            newer = [n for n in numbers if followed is None or n > followed]
            if newer:
                if waiting is not None:
                    waiting.__exit__()
                    waiting = None
                number = newer[-1] if followed is None else newer[0]
                if followed is not None:
                    sink.close()
                    err.print(f"--- {safe(step)}: attempt {number} ---", highlight=False)
                _print_attempt(
                    client,
                    job,
                    step,
                    sink,
                    attempt=number,
                    follow=True,
                    tail=tail if followed is None else None,
                )
                followed = number
                continue
            if step not in states or states[step] in _STEP_DONE:
                if followed is None and step not in states:  # no such step: the API says so (404)
                    sink.write_all(client.stream_logs(job, step, attempt=None, follow=False))
                elif followed is None:
                    err.print(
                        f"{safe(label)}step {safe(step)} ended {_state_style(states[step])} without running"
                    )
                return
            if followed is None and waiting is None:
                err.print(f"waiting for step {safe(step)} to start ({_state_style(states[step])})")
                # one spinner at a time (Rich): none when several steps are followed at once
                waiting = _spinner(f"waiting for step {step} to start", enabled=sink.prefix is None)
                waiting.__enter__()
            time.sleep(poll)
    finally:
        if waiting is not None:
            waiting.__exit__()


@app.command()
def cancel(
    job_ids: Annotated[list[str] | None, typer.Argument(metavar="[JOB]...", help="Job ids.")] = None,
    state_: Annotated[
        list[str] | None,
        typer.Option("--state", help="Cancel the jobs in this state (repeatable; with --team/--owner)."),
    ] = None,
    team: Annotated[str | None, typer.Option(help="Cancel this team's unfinished jobs.")] = None,
    owner: Annotated[str | None, typer.Option(help="Cancel this owner's unfinished jobs.")] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask before cancelling by filter.")] = False,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until the cancelled jobs have stopped.")] = False,
    as_json: JsonOpt = False,
    output: OutputOpt = None,
) -> None:
    """Cancel jobs, by id (`cancel J1 J2`) or by filter (`cancel --state QUEUED --team nlp`, which
    lists what it will cancel and asks first unless --yes). Running steps get notice and their
    grace period. Exit 2 if the API refused to cancel a job (the others still are cancelled)."""
    client = _client()
    fmt = chosen(output, as_json)
    ids = list(job_ids or [])
    if not ids and not (state_ or team or owner):
        _fail("name the jobs to cancel, or a filter (--state, --team, --owner)")
    if state_ or team or owner:
        wanted = [s.upper() for s in state_ or []] or ["QUEUED", "RUNNING"]
        params: list[tuple[str, str | int]] = [("limit", 1000), *(("state", s) for s in wanted)]
        params += [(k, v) for k, v in (("team", team), ("owner", owner)) if v]
        found = _call(client.json, "GET", "/v1/jobs", params=params)["jobs"]
        if not found and not ids:
            err.print("no job matches; nothing cancelled")
            if fmt is not Format.table:
                emit([], fmt, [["JOB", "STATE", "ERROR"]])
            return
        if found and not yes:
            err.print(_jobs_table({"jobs": found}))
            try:
                sure = typer.confirm(f"cancel these {len(found)} job(s)?", err=True, default=False)
            except typer.Abort:  # no answer (stdin closed)
                _fail("cancelling by filter asks first: answer y, or add --yes")
            if not sure:
                err.print("nothing cancelled")
                raise typer.Exit(1)
        ids += [j["id"] for j in found if j["id"] not in ids]
    done: list[dict[str, Any]] = []
    rows: list[list[object]] = [["JOB", "STATE", "ERROR"]]
    failed = 0  # the exit code: 2 if the API refused one (4xx), 1 for anything else
    for job in ids:
        try:
            j = client.json("POST", f"/v1/jobs/{job}/cancel")
        except ApiFailure as exc:
            failed = max(failed, 2 if exc.client_error else 1)
            err.print(f"[red]error:[/red] {safe(job)}: {safe(exc.message)}")
            rows.append([job, "", exc.message])
            continue
        done.append(j)
        rows.append([j["id"], j["state"], ""])
        if fmt is Format.table:
            out.print(f"{safe(j['id'])}: {_state_style(j['state'])}")
    if wait:
        with _spinner(f"waiting for {len(done)} job(s) to stop") as spin:
            for i, j in enumerate(done):
                spin.update(f"waiting for {j['id']} to stop ({i + 1} of {len(done)})")
                final = _wait(client, j["id"], quiet=True, spin=False)
                done[i] = final["job"]
                if fmt is Format.table:
                    out.print(f"{safe(j['id'])}: {_state_style(final['job']['state'])}")
    if fmt is not Format.table:
        if len(ids) == 1 and len(done) == 1 and not (state_ or team or owner):
            emit(done[0], fmt, rows)  # as before: one job, its record
        else:
            emit(done, fmt, rows)
    if failed:
        raise typer.Exit(failed)


@app.command()
def rerun(
    job: Annotated[str, typer.Argument(help="Job id.")],
    param: Annotated[
        list[str] | None, typer.Option("--param", "-p", help="Change a parameter: k=v (repeatable).")
    ] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until the new job ends.")] = False,
    as_json: JsonOpt = False,
    output: OutputOpt = None,
) -> None:
    """Submit a new job from a job's recorded spec and parameters (-p k=v changes some)."""
    client = _client()
    fmt = chosen(output, as_json)
    query = [("param", p) for p in param or []]
    with _spinner(f"resubmitting {job}"):
        j = _call(
            client.json,
            "POST",
            f"/v1/jobs/{job}/rerun",
            params=query,
            headers={"Idempotency-Key": str(uuid.uuid4())},
        )
    machine = fmt is not Format.table
    if machine and not wait:
        emit(j, fmt, _job_rows([j]))
        return
    (err if machine else out).print(f"submitted [bold]{safe(j['id'])}[/bold] (rerun of {safe(job)})")
    if wait:
        final = _wait(client, j["id"], quiet=machine)
        if machine:
            emit(final, fmt)
        raise typer.Exit(0 if final["job"]["state"] == "SUCCEEDED" else 1)


@app.command()
def retry(
    job_ids: Annotated[list[str], typer.Argument(metavar="JOB...", help="Job ids (FAILED or CANCELLED).")],
    wait: Annotated[bool, typer.Option("--wait", help="Wait until the retried jobs end.")] = False,
    as_json: JsonOpt = False,
    output: OutputOpt = None,
) -> None:
    """Retry FAILED or CANCELLED jobs in place, from their failed steps (like `argo retry`): the
    steps that SUCCEEDED are kept and not run again; the failed, cancelled and skipped ones go
    back to the queue with their whole retry budget. `rerun` makes a new job instead. Exit 2 for
    a bad id or a job the API would not retry (the others are still retried)."""
    fmt = chosen(output, as_json)
    bad = [j for j in job_ids if not JOB_ID_RE.match(j)]
    if bad:
        _fail(f"not a job id: {', '.join(bad)} (a job id looks like job-0123456789ab)")
    client = _client()
    done: list[dict[str, Any]] = []
    rows: list[list[object]] = [["JOB", "STATE", "QUEUED_STEPS", "WAITING_STEPS", "KEPT_STEPS", "ERROR"]]
    failed = 0  # the exit code: 2 if the API refused one (4xx), 1 for anything else
    for job in job_ids:
        try:
            retried = client.json("POST", f"/v1/jobs/{job}/retry")
        except ApiFailure as exc:
            failed = max(failed, 2 if exc.client_error else 1)
            err.print(f"[red]error:[/red] {safe(job)}: {safe(exc.message)}")
            rows.append([job, "", "", "", "", exc.message])
            continue
        queued, waiting, kept = retried["queued"], retried["waiting"], retried["kept"]
        state_now = retried["job"]["state"]
        done.append(retried)
        rows.append([job, state_now, " ".join(queued), " ".join(waiting), " ".join(kept), ""])
        if fmt is Format.table:
            out.print(f"{safe(job)}: retried, now {_state_style(state_now)}")
            for label, names in (
                ("back to the queue", queued),
                ("waiting for upstream steps", waiting),
                ("kept (succeeded, not run again)", kept),
            ):
                if names:
                    out.print(f"  {label}: {safe(', '.join(names))}")
    ended_ok = True
    if wait:
        for i, item in enumerate(done):
            final = _wait(client, item["job"]["id"], quiet=fmt is not Format.table)
            done[i] = {**item, "job": final["job"]}
            ended_ok = ended_ok and final["job"]["state"] == "SUCCEEDED"
    if fmt is not Format.table:
        emit(done[0] if len(job_ids) == 1 and len(done) == 1 else done, fmt, rows)
    if failed:
        raise typer.Exit(failed)
    if not ended_ok:
        raise typer.Exit(1)


@app.command("open")
def open_(
    browser: Annotated[bool, typer.Option("--browser", help="Also open it in a web browser.")] = False,
) -> None:
    """Print the web dashboard's address (<api url>/ui/); log in there with your token."""
    url = f"{_client().url}/ui/"
    sys.stdout.write(url + "\n")
    if browser and not webbrowser.open(url):
        _fail("no web browser could be started here; open the address above", 1)


@app.command()
def completion(
    shell: Annotated[str, typer.Argument(help="bash, zsh, fish or powershell.")],
) -> None:
    """Print the shell completion script: e.g. `lowtide completion bash >> ~/.bashrc`, or
    `source <(lowtide completion bash)`; zsh: `lowtide completion zsh > ~/.zfunc/_lowtide`; fish:
    `lowtide completion fish > ~/.config/fish/completions/lowtide.fish`."""
    from typer._completion_shared import get_completion_script  # noqa: PLC0415 (only here)

    if shell not in ("bash", "zsh", "fish", "powershell", "pwsh"):
        _fail(f"unknown shell {shell!r}: bash, zsh, fish or powershell")
    sys.stdout.write(
        get_completion_script(prog_name="lowtide", complete_var=COMPLETE_VAR, shell=shell) + "\n"
    )


@app.command()
def pool(as_json: JsonOpt = False, output: OutputOpt = None) -> None:
    """Every GPU and who holds it."""
    p = _call(_client().json, "GET", "/v1/pool")
    if _machine(p, output, as_json):
        return
    table = Table(
        "NODE",
        "GPU",
        "HOLDER",
        "JOB",
        "STEP",
        "TEAM",
        "SINCE",
        title=f"{p['free']} of {p['total']} GPUs free",
    )
    for node in p["nodes"]:
        for g in node["gpus"]:
            table.add_row(
                *_cells(
                    node["name"],
                    str(g["index"]),
                    g["holder"],
                    g["job_id"] or "-",
                    g["step"] or "-",
                    g["team"] or "-",
                    _when(g["since"]) if g["since"] else "-",
                )
            )
    out.print(table)


@app.command()
def services(
    name: Annotated[str | None, typer.Argument(help="One service (default: all).")] = None,
    as_json: JsonOpt = False,
    output: OutputOpt = None,
) -> None:
    """Inference services: replicas, load, scaling decisions and the lending envelope."""
    client = _client()
    if name is not None:
        d = _call(client.json, "GET", f"/v1/services/{name}")
        if _machine(d, output, as_json):
            return
        _print_service(d)
        if d["signals"]:
            columns = ("REPLICA", "RUNNING", "WAITING", "KV", "PREEMPT/S", "GEN TOK/S", "TTFT P90", "SLEEP")
            sig = Table(*columns, "STALE", title="load")
            for g in d["signals"]:
                preempt = _num(g.get("preemptions_per_s"))  # newer vLLM; "!" when the KV cache is short
                sig.add_row(
                    *_cells(
                        g["replica"],
                        _num(g["running"]),
                        _num(g["waiting"]),
                        _pct(g["kv_usage"]),
                        f"{preempt} !" if g.get("kv_pressure") else preempt,
                        _num(g["generation_tokens_per_s"]),
                        _secs(g["ttft_p90_s"]),
                        g.get("sleep_state") or "?",
                        g["stale_reason"] if g["stale"] else "-",
                    )
                )
            out.print(sig)
        ev = Table("AT", "REPLICA", "EVENT", "MESSAGE", title="events")
        for e in d["events"][-30:]:
            ev.add_row(*_cells(_when(e["at"]), e["replica_id"] or "-", e["kind"], e["message"]))
        out.print(ev)
        return
    data = _call(client.json, "GET", "/v1/services")
    if _machine(data, output, as_json):
        return
    if not data["services"]:
        out.print("no inference services are configured (see `services:` in lowtide.yaml)")
    for svc in data["services"]:
        _print_service(svc)
    lending = data["lending"]
    if lending:
        state = "open" if lending["lending_open"] else "closed"
        out.print(
            f"[bold]lending[/bold] ({safe(lending['mode'])}, {state}): {safe(lending['lendable_gpus'])} "
            f"GPU(s) lendable, {safe(lending['inference_claim_gpus'])} kept for inference"
        )
        for reason in lending["reasons"]:
            out.print(f"  {safe(reason)}")
        if lending["fail_safe"]:
            out.print(f"  [red]fail safe:[/red] {safe(lending['fail_safe'])}")


@app.command()
def reclaims(
    state_: Annotated[str | None, typer.Option("--state", help="OPEN, DONE or ABANDONED.")] = None,
    limit: Annotated[int, typer.Option(help="At most this many (newest).")] = 50,
    as_json: JsonOpt = False,
    output: OutputOpt = None,
) -> None:
    """GPUs taken back from research: surge → decision → notice → GPUs free → replica healthy."""
    params: dict[str, Any] = {"limit": limit}
    if state_:
        params["state"] = state_.upper()
    data = _call(_client().json, "GET", "/v1/reclaims", params=params)
    if _machine(data, output, as_json):
        return
    table = Table(
        "ID",
        "SERVICE",
        "STATE",
        "GPUS",
        "VICTIMS",
        "DETECTED",
        "DECIDE",
        "NOTICE",
        "FREED",
        "HEALTHY",
        "REASON",
    )

    def after(t: float | None, t0: float) -> str:
        return "-" if t is None else f"+{t - t0:.1f}s"

    for r in data:
        t0 = r["detected_at"]
        table.add_row(
            *_cells(
                str(r["id"]),
                r["service"] or "(lending)",
                _state_text(r["state"]),
                str(r["gpus"]),
                ",".join(map(str, r["victims"])),
                _when(t0),
                after(r["decided_at"], t0),
                after(r["notice_at"], t0),
                after(r["freed_at"], t0),
                after(r["healthy_at"], t0),
                r["reason"],
            )
        )
    out.print(table)


def _machine(data: Any, output: Format | None, as_json: bool) -> bool:
    """Print `data` as JSON or YAML when asked to (True); CSV is for jobs and show (exit 2)."""
    fmt = chosen(output, as_json)
    if fmt is Format.csv:
        _fail("--output csv is offered by jobs, show, submit --sweep and cancel; use json or yaml here")
    if fmt is Format.table:
        return False
    emit(data, fmt)
    return True


def _print_service(svc: dict[str, Any]) -> None:
    out.print(
        f"[bold]{safe(svc['name'])}[/bold] ({safe(svc['model'])}): desired {safe(svc['desired'])}, "
        f"needed {safe(svc['needed'])}, target {safe(svc['target'])} of "
        f"{safe(svc['min_replicas'])}..{safe(svc['max_replicas'])} × {safe(svc['gpus_per_replica'])} GPU(s)"
    )
    out.print(f"  {safe(svc['reason'])}")
    if svc["blocked"]:
        out.print(f"  [yellow]blocked:[/yellow] {safe(svc['blocked'])}")
    if svc.get("alert"):
        out.print(f"  [red]alert:[/red] {safe(svc['alert'])}")
    table = Table("REPLICA", "STATE", "WHERE", "PORT", "SINCE", "MESSAGE")
    for r in svc["replicas"]:
        where = f"{r['node']}:{','.join(map(str, r['gpus']))}" if r["node"] else "-"
        state = r["state"] + (f" ({r['parked_as']})" if r["parked_as"] else "")
        table.add_row(
            *_cells(r["id"], _state_text(state), where, str(r["port"]), _when(r["since"]), r["message"])
        )
    out.print(table)


def _num(v: float | None) -> str:
    return "?" if v is None else f"{v:.1f}" if v % 1 else str(int(v))


def _pct(v: float | None) -> str:
    return "?" if v is None else f"{100 * v:.0f}%"


def _secs(v: float | None) -> str:
    return "?" if v is None else f"{v:.2f}s"


@token_app.command("create")
def token_create(
    name: Annotated[str, typer.Argument(help="Who the token is for (also its owner unless --owner).")],
    role: Annotated[str, typer.Option(help="user, viewer or admin.")] = "user",
    owner: Annotated[str | None, typer.Option(help="Act as this owner (default: NAME).")] = None,
    team: Annotated[
        list[str] | None,
        typer.Option(
            "--team",
            help="A team it may submit for and see (repeatable; '*' for all; default: default). "
            "The first is the team of specs that name none.",
        ),
    ] = None,
    max_priority: Annotated[
        int | None,
        typer.Option("--max-priority", min=0, max=100, help="Highest priority it may submit (default: 50)."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Create an API token (shown once). Create a second admin token before revoking the first:
    the last active admin token cannot be revoked."""
    body: dict[str, Any] = {"name": name, "role": role}
    if owner:
        body["owner"] = owner
    if team:
        body["teams"] = team
    if max_priority is not None:
        body["max_priority"] = max_priority
    t = _call(_client().json, "POST", "/v1/tokens", json=body)
    if as_json:
        _print_json(t)
        return
    out.print(f"token for {t['owner']} ({t['role']}), id {t['id']} — store it now, it is not shown again:")
    sys.stdout.write(t["token"] + "\n")


@token_app.command("list")
def token_list(as_json: JsonOpt = False, output: OutputOpt = None) -> None:
    """List API tokens (not their secrets)."""
    ts = _call(_client().json, "GET", "/v1/tokens")
    if _machine(ts, output, as_json):
        return
    table = Table("ID", "NAME", "OWNER", "ROLE", "TEAMS", "MAX PRIORITY", "CREATED", "REVOKED")
    for t in ts:
        table.add_row(
            str(t["id"]),
            safe(t["name"]),
            safe(t["owner"]),
            safe(t["role"]),
            safe(",".join(t.get("teams") or [])),
            str(t.get("max_priority", "")),
            _when(t["created_at"]),
            _when(t["revoked_at"]),
        )
    out.print(table)


@token_app.command("revoke")
def token_revoke(token_id: Annotated[int, typer.Argument(help="Token id.")]) -> None:
    """Revoke an API token."""
    _call(_client().json, "DELETE", f"/v1/tokens/{token_id}")
    out.print(f"token {token_id} revoked")


def main() -> None:  # pragma: no cover - console entry point
    app()
