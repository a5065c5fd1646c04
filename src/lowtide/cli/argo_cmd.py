"""`lowtide argo render FILE`: print the Argo Workflow a job spec becomes in cluster mode.

    lowtide argo render FILE [-p k=v ...] [--job-id ID] [-o yaml|json]

The spec is read, templates expanded and parameters set exactly as `lowtide validate` does
(`domain.spec_parse.build_job_spec` with the config's `templates_dir`), then compiled by
`adapters.argo.workflow.compile_workflow` with the config's `argo:` section (`ArgoConfig`,
converted by `wiring.argo_settings`, as for the executor). Exit codes: 0 printed; 2 bad input (the spec's
located problems, a parameter, a setting, or what cannot become a Workflow, naming the step and
field). Must not: talk to the API, Kubernetes or Argo.
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
import yaml

from lowtide.cli.output import HELP_MARKUP, console, safe

if TYPE_CHECKING:
    pass

argo_app = typer.Typer(
    add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True, rich_markup_mode=HELP_MARKUP
)
err = console(stderr=True)
#: The job id rendered when --job-id is not given (a real job gets a random one on submit).
DEFAULT_JOB_ID = "job-000000000000"


class RenderFormat(StrEnum):
    yaml = "yaml"
    json = "json"


def _bad_input(message: str, details: list[str] | None = None) -> NoReturn:
    err.print(f"[red]error:[/red] {safe(message)}")
    for line in details or []:
        err.print(f"  {safe(line)}")
    raise typer.Exit(2)


def _config_path(ctx: typer.Context) -> str | None:
    node: Any = ctx
    while node is not None:
        value = node.params.get("config")
        if isinstance(value, str):
            return value
        node = node.parent
    return None


@argo_app.command("render")
def render(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="Job spec (YAML or JSON).")],
    param: Annotated[
        list[str] | None, typer.Option("--param", "-p", help="Set a parameter the spec declares: k=v.")
    ] = None,
    job_id: Annotated[
        str, typer.Option("--job-id", help="The job id to render for (names, artifact URIs).")
    ] = DEFAULT_JOB_ID,
    output: Annotated[RenderFormat, typer.Option("--output", "-o", help="yaml or json.")] = RenderFormat.yaml,
) -> None:
    """Print the Argo Workflow FILE becomes in cluster mode (nothing is submitted): the job's
    first Workflow, named after the job id, with every step (a retried job's later Workflows,
    `<job id>-r<N>`, hold only its unfinished steps)."""
    from lowtide.adapters.argo.workflow import ArgoCompileError, compile_workflow  # noqa: PLC0415
    from lowtide.adapters.templates import DirectoryTemplates  # noqa: PLC0415
    from lowtide.config import ConfigError, load_settings  # noqa: PLC0415
    from lowtide.domain.spec_document import parse_document  # noqa: PLC0415
    from lowtide.domain.spec_issues import SpecInvalid, excerpt  # noqa: PLC0415
    from lowtide.domain.spec_parse import build_job_spec  # noqa: PLC0415
    from lowtide.domain.spec_render import parse_param_assignment  # noqa: PLC0415

    try:
        settings = load_settings(_config_path(ctx))
    except ConfigError as exc:
        _bad_input(str(exc))
    overrides: dict[str, Any] = {}
    locs: dict[str, str] = {}
    for text in param or []:
        try:
            key, value = parse_param_assignment(text)
        except ValueError as exc:
            _bad_input(f"--param {excerpt(text)}: {exc}")
        overrides[key], locs[key] = value, f"--param {excerpt(text)}"
    try:
        data = file.read_bytes()
    except OSError as exc:
        _bad_input(f"cannot read {file}: {exc.strerror or exc}")
    templates_dir = Path(settings.templates_dir)
    try:
        doc = parse_document(data, fmt="json" if file.suffix.lower() == ".json" else "auto")
        spec = build_job_spec(
            doc,
            templates=DirectoryTemplates(templates_dir) if templates_dir.is_dir() else None,
            param_overrides=overrides,
            override_locs=locs,
            max_steps_per_job=settings.scheduler.max_steps_per_job,
        )
    except SpecInvalid as exc:
        _bad_input(
            f"{file}: invalid job spec ({len(exc.issues)} problem(s))",
            [f"{file}: {issue.loc}: {issue.msg}" for issue in exc.issues],
        )
    try:
        from lowtide.wiring import argo_settings  # noqa: PLC0415 (server-side imports, not at CLI start)

        compiler_settings = argo_settings(settings)
    except ArgoCompileError as exc:
        _bad_input(f"{_config_path(ctx) or 'the configuration'}: {exc}")
    try:
        compiled = compile_workflow(spec, job_id=job_id, settings=compiler_settings)
    except ArgoCompileError as exc:
        _bad_input(f"{file}: cannot become an Argo Workflow: {exc}")
    if output is RenderFormat.json:
        typer.echo(json.dumps(compiled.manifest, indent=2))
    else:
        typer.echo(yaml.safe_dump(compiled.manifest, sort_keys=False, width=110).rstrip("\n"))
