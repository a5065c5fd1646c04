"""The `lowtide` command line (Typer + Rich).

Every command but `up` and `validate` talks to the REST API (`--url`, `$LOWTIDE_URL`, or the
config's API address) with a token (`--token`, `$LOWTIDE_TOKEN`, or the admin token file the
embedded mode wrote). Exit codes: 0 success; 2 bad input or a request the API refused (4xx), with
the located errors printed; 1 anything else (server error, unreachable, a waited-on job that did
not succeed). `--json` prints machine-readable output. Must not: touch the store directly.
"""

from __future__ import annotations

import codecs
import json
import logging
import sys
import time
import uuid
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.table import Table
from rich.text import Text

from lowtide.cli.client import ApiFailure, Client
from lowtide.cli.doctor_cmd import doctor_command
from lowtide.cli.emulate_cmd import emulate_app
from lowtide.cli.loadgen_cmd import loadgen_app
from lowtide.cli.metrics_cmd import metrics_app
from lowtide.cli.output import HELP_MARKUP, clean, console, safe
from lowtide.cli.report_cmd import gpu_time, lost_work_line, report_command
from lowtide.cli.simulate_cmd import simulate_app
from lowtide.config import ConfigError, Settings, load_settings

app = typer.Typer(
    name="lowtide",
    help="Run research jobs on the GPUs your inference fleet is not using.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=HELP_MARKUP,
)
token_app = typer.Typer(help="Manage API tokens (admin).", no_args_is_help=True, rich_markup_mode=HELP_MARKUP)
app.add_typer(token_app, name="token")
app.add_typer(metrics_app, name="metrics", help="Read vLLM /metrics the way lowtide does.")
app.add_typer(emulate_app, name="emulate", help="Emulated inference servers for machines without GPUs.")
app.add_typer(loadgen_app, name="loadgen")
app.add_typer(simulate_app, name="simulate", help="Simulate lending on a virtual clock over real traces.")
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
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]
PARAM_HELP = (
    "Set a parameter the spec declares: k=v (repeatable). A list or mapping is YAML, "
    "e.g. -p 'tags=[a, b]' or -p 'opt={beta: 0.9}'."
)


@app.callback()
def _main(
    config: Annotated[
        str | None, typer.Option("--config", "-c", envvar="LOWTIDE_CONFIG", help="lowtide.yaml to use.")
    ] = None,
    url: Annotated[str | None, typer.Option("--url", envvar="LOWTIDE_URL", help="API address.")] = None,
    token: Annotated[str | None, typer.Option("--token", envvar="LOWTIDE_TOKEN", help="API token.")] = None,
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
    out.print(
        f"[green]OK[/green] {safe(file)}: job '{safe(spec.name)}', {len(spec.steps)} step(s), "
        f"up to {gpus} GPU(s) per step"
    )


def _declared_max_gpus(settings: Settings) -> int | None:
    sizes = []
    for node in settings.nodes:
        if node.gpus == "auto":
            return None  # known only on the host, through NVML: the server checks on submit
        sizes.append(node.gpus if isinstance(node.gpus, int) else len(node.gpus))
    return max(sizes, default=0)


@app.command()
def submit(
    file: Annotated[Path, typer.Argument(help="Job spec (YAML or JSON).")],
    param: Annotated[list[str] | None, typer.Option("--param", "-p", help=PARAM_HELP)] = None,
    wait: Annotated[
        bool, typer.Option("--wait", help="Wait until the job ends; exit 0 only if it succeeded.")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Validate on the server; store nothing.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Submit a job. Warnings (what of the spec is ignored here) go to stderr; with --json, only
    JSON goes to stdout (with --wait, the final job detail plus the submit's `warnings`)."""
    data = _read_spec(file)
    client = _client()

    def retrying(failure: ApiFailure, wait: float) -> None:
        err.print(f"[yellow]{safe(failure.message)}[/yellow]; retrying in {wait:g}s (same Idempotency-Key)")

    # One key per invocation: a retry after a lost answer or a 503 returns the same job.
    result = _call(
        client.submit,
        data,
        content_type=_content_type(file),
        params=param or [],
        dry_run=dry_run,
        idempotency_key=None if dry_run else str(uuid.uuid4()),
        retry_for_s=0.0 if dry_run else SUBMIT_RETRY_S,
        on_retry=retrying,
        where=str(file),
    )
    _print_warnings(result.get("warnings"), str(file))
    if dry_run:
        _print_json(result) if as_json else out.print(f"[green]valid[/green] {safe(file)}")
        return
    if as_json and not wait:
        _print_json(result)
        return
    (err if as_json else out).print(
        f"submitted [bold]{safe(result['id'])}[/bold] ({safe(result['name'])}, team {safe(result['team'])})"
    )
    if wait:
        final = _wait(client, result["id"], quiet=as_json)
        if as_json:
            _print_json({**final, "warnings": result.get("warnings", [])})
        raise typer.Exit(0 if final["job"]["state"] == "SUCCEEDED" else 1)


def _wait(client: Client, job_id: str, *, quiet: bool = False, poll: float = 1.0) -> dict[str, Any]:
    seen: dict[str, str] = {}
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
        time.sleep(poll)


@app.command()
def jobs(
    state_: Annotated[list[str] | None, typer.Option("--state", help="Filter by state (repeatable).")] = None,
    team: Annotated[str | None, typer.Option(help="Filter by team.")] = None,
    owner: Annotated[str | None, typer.Option(help="Filter by owner.")] = None,
    limit: Annotated[int, typer.Option(help="At most this many.")] = 50,
    as_json: JsonOpt = False,
) -> None:
    """List jobs, newest first."""
    params: list[tuple[str, str | int]] = [("limit", limit)]
    params += [("state", s.upper()) for s in state_ or []]
    if team:
        params.append(("team", team))
    if owner:
        params.append(("owner", owner))
    data = _call(_client().json, "GET", "/v1/jobs", params=params)
    if as_json:
        _print_json(data)
        return
    table = Table("JOB", "NAME", "TEAM", "OWNER", "PRI", "STATE", "STEPS", "SUBMITTED")
    for j in data["jobs"]:
        steps = " ".join(f"{k.lower()}:{v}" for k, v in sorted(j["steps"].items()))
        table.add_row(
            *_cells(
                j["id"],
                j["name"],
                j["team"],
                j["owner"],
                str(j["priority"]),
                _state_text(j["state"]),
                steps,
                _when(j["submitted_at"]),
            )
        )
    out.print(table)


@app.command()
def show(job: Annotated[str, typer.Argument(help="Job id.")], as_json: JsonOpt = False) -> None:
    """A job's steps, attempts, checkpoints and events."""
    d = _call(_client().json, "GET", f"/v1/jobs/{job}")
    if as_json:
        _print_json(d)
        return
    j = d["job"]
    out.print(
        f"[bold]{safe(j['id'])}[/bold] {safe(j['name'])}  team={safe(j['team'])} owner={safe(j['owner'])} "
        f"priority={safe(j['priority'])}"
    )
    out.print(f"state: {_state_style(j['state'])} {safe(j['message'])}")
    out.print(
        f"submitted {_when(j['submitted_at'])}  started {_when(j['started_at'])}  "
        f"finished {_when(j['finished_at'])}" + (f"  rerun of {safe(j['rerun_of'])}" if j["rerun_of"] else "")
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
    out.print(steps)
    if d["attempts"]:
        att = Table(
            "STEP", "#", "STATE", "WHERE", "STARTED", "RAN", "EXIT", "WORK LOST", "MESSAGE", title="attempts"
        )
        for a in d["attempts"]:
            where = f"{a['node']}:{','.join(map(str, a['gpus']))}" if a["gpus"] else a["node"]
            ran = _dur((a["ended_at"] or time.time()) - a["started_at"])
            code = (
                str(a["exit_code"])
                if a["exit_code"] is not None
                else (f"sig{a['signal']}" if a["signal"] else "-")
            )
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
        out.print(att)
        out.print(safe(lost_work_line(d["steps"], d["attempts"])))
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
        out.print(ck)
    if d["events"]:
        ev = Table("AT", "STEP", "EVENT", "MESSAGE", title="events")
        for e in d["events"][-30:]:
            ev.add_row(*_cells(_when(e["at"]), e["step"] or "-", e["kind"], e["message"]))
        out.print(ev)


@app.command()
def logs(
    job: Annotated[str, typer.Argument(help="Job id.")],
    step: Annotated[str, typer.Argument(help="Step name.")],
    follow: Annotated[
        bool,
        typer.Option(
            "--follow", "-f", help="Keep printing until the step ends, across retries and requeues."
        ),
    ] = False,
    attempt: Annotated[int | None, typer.Option(help="Attempt number (default: the latest).")] = None,
    raw: Annotated[
        bool, typer.Option("--raw", help="Write the bytes as the step wrote them (control characters too).")
    ] = False,
) -> None:
    """Print a step's output. Control characters other than newline and tab are shown as escapes
    (\\x1b), so a log cannot drive the terminal; --raw writes the bytes unchanged. With -f (and no
    --attempt) the step is followed across attempts: when one ends and the step is queued again
    (a retry, a preemption), a separator line goes to stderr and the next attempt's output
    follows; it stops when the step has finished."""
    client = _client()
    sink = _LogSink(raw)
    try:
        if not follow or attempt is not None:
            sink.write_all(client.stream_logs(job, step, attempt=attempt, follow=follow))
        else:
            _follow_step(client, job, step, sink)
    except ApiFailure as exc:
        _fail(exc.message, 2 if exc.client_error else 1, exc.errors)
    finally:
        sink.close()


#: Step states after which no attempt of the step will start.
_STEP_DONE = frozenset({"SUCCEEDED", "FAILED", "CANCELLED", "SKIPPED"})


class _LogSink:
    """Writes log bytes to stdout: decoded as UTF-8 (bad bytes replaced) and `clean`ed, or raw."""

    def __init__(self, raw: bool) -> None:
        self.raw = raw
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def write(self, chunk: bytes) -> None:
        if self.raw:
            sys.stdout.buffer.write(chunk)
        else:
            sys.stdout.write(clean(self.decoder.decode(chunk)))
        sys.stdout.flush()

    def write_all(self, chunks: Iterable[bytes]) -> None:
        for chunk in chunks:
            self.write(chunk)

    def close(self) -> None:
        if not self.raw:
            sys.stdout.write(clean(self.decoder.decode(b"", final=True)))
            sys.stdout.flush()


def _follow_step(client: Client, job: str, step: str, sink: _LogSink, poll: float = 0.5) -> None:
    """Follow `step` of `job` from its latest attempt on, across retries, until it has finished."""
    followed: int | None = None
    waiting_said = False
    while True:
        detail: dict[str, Any] = client.json("GET", f"/v1/jobs/{job}")
        states = {s["name"]: s["state"] for s in detail["steps"]}
        numbers = sorted(a["number"] for a in detail["attempts"] if a["step"] == step)
        newer = [n for n in numbers if followed is None or n > followed]
        if newer:
            number = newer[-1] if followed is None else newer[0]
            if followed is not None:
                sink.close()
                err.print(f"--- {safe(step)}: attempt {number} ---", highlight=False)
            sink.write_all(client.stream_logs(job, step, attempt=number, follow=True))
            followed = number
            continue
        if step not in states or states[step] in _STEP_DONE:
            if followed is None:  # never started (or no such step): the API says why (404)
                sink.write_all(client.stream_logs(job, step, attempt=None, follow=False))
            return
        if followed is None and not waiting_said:
            err.print(f"waiting for step {safe(step)} to start ({_state_style(states[step])})")
            waiting_said = True
        time.sleep(poll)


@app.command()
def cancel(job: Annotated[str, typer.Argument(help="Job id.")], as_json: JsonOpt = False) -> None:
    """Cancel a job (running steps get notice and their grace period)."""
    j = _call(_client().json, "POST", f"/v1/jobs/{job}/cancel")
    if as_json:
        _print_json(j)
        return
    out.print(f"{safe(j['id'])}: {_state_style(j['state'])}")


@app.command()
def rerun(
    job: Annotated[str, typer.Argument(help="Job id.")],
    wait: Annotated[bool, typer.Option("--wait", help="Wait until the new job ends.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Submit a new job from a job's recorded spec and parameters."""
    client = _client()
    j = _call(client.json, "POST", f"/v1/jobs/{job}/rerun")
    if as_json and not wait:
        _print_json(j)
        return
    (err if as_json else out).print(f"submitted [bold]{safe(j['id'])}[/bold] (rerun of {safe(job)})")
    if wait:
        final = _wait(client, j["id"], quiet=as_json)
        if as_json:
            _print_json(final)
        raise typer.Exit(0 if final["job"]["state"] == "SUCCEEDED" else 1)


@app.command()
def pool(as_json: JsonOpt = False) -> None:
    """Every GPU and who holds it."""
    p = _call(_client().json, "GET", "/v1/pool")
    if as_json:
        _print_json(p)
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
) -> None:
    """Inference services: replicas, load, scaling decisions and the lending envelope."""
    client = _client()
    if name is not None:
        d = _call(client.json, "GET", f"/v1/services/{name}")
        if as_json:
            _print_json(d)
            return
        _print_service(d)
        if d["signals"]:
            sig = Table("REPLICA", "RUNNING", "WAITING", "KV", "GEN TOK/S", "TTFT P90", "STALE", title="load")
            for g in d["signals"]:
                sig.add_row(
                    *_cells(
                        g["replica"],
                        _num(g["running"]),
                        _num(g["waiting"]),
                        _pct(g["kv_usage"]),
                        _num(g["generation_tokens_per_s"]),
                        _secs(g["ttft_p90_s"]),
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
    if as_json:
        _print_json(data)
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
) -> None:
    """GPUs taken back from research: surge → decision → notice → GPUs free → replica healthy."""
    params: dict[str, Any] = {"limit": limit}
    if state_:
        params["state"] = state_.upper()
    data = _call(_client().json, "GET", "/v1/reclaims", params=params)
    if as_json:
        _print_json(data)
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
def token_list(as_json: JsonOpt = False) -> None:
    """List API tokens (not their secrets)."""
    ts = _call(_client().json, "GET", "/v1/tokens")
    if as_json:
        _print_json(ts)
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
