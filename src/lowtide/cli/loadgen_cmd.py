"""`lowtide loadgen`: replay a trace against an OpenAI-compatible server and print what it did.

`loadgen_app` is a Typer app whose callback is the whole command, so that the root CLI mounts it
with ``app.add_typer(loadgen_app, name="loadgen")`` and it runs as
``lowtide loadgen --trace SPEC --target URL`` (no subcommand word). The trace grammar is
`lowtide.emulator.traces.parse_trace_spec`; the replay and its report are
`lowtide.emulator.loadgen.run_load`. Exit codes: 0 the replay ran (failed requests are counted in
the report, not in the exit code); 1 requests were sent and none succeeded (e.g. the target is
down); 2 bad input (trace spec, missing file, target, numbers), with the reason printed.
Ctrl-C stops sending, waits for the requests in flight (``--drain-timeout``) and prints the
report; a second Ctrl-C aborts. Must not: talk to the lowtide API or store (it needs neither).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from typing import Annotated, Any, NoReturn

import typer

from lowtide.cli.output import HELP_MARKUP, clean
from lowtide.emulator.loadgen import LoadReport, run_load
from lowtide.emulator.traces import TraceSpec, parse_trace_spec

loadgen_app = typer.Typer(
    add_completion=False, pretty_exceptions_enable=False, subcommand_metavar="", rich_markup_mode=HELP_MARKUP
)


def _bad_input(message: str) -> NoReturn:
    typer.echo(f"error: {clean(message)}", err=True)
    raise typer.Exit(2)


async def _replay(
    spec: TraceSpec,
    target: str,
    duration: float | None,
    seed: int,
    options: dict[str, Any],
) -> LoadReport:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    drain = options.get("drain_timeout_s")

    def on_interrupt() -> None:
        typer.echo(
            f"\nstopping: waiting up to {drain} s for requests in flight (Ctrl-C again to abort)", err=True
        )
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)

    installed = False
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
        loop.add_signal_handler(signal.SIGINT, on_interrupt)
        installed = True
    try:
        requests = spec.requests(duration_s=duration, seed=seed)
        return await run_load(requests, target, duration_s=duration, stop=stop, **options)
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGINT)


@loadgen_app.callback(invoke_without_command=True)
def loadgen(
    trace: Annotated[
        str,
        typer.Option(
            "--trace",
            help="servegen:DIR, servegen-aggregate:CSV, azure:CSV or synthetic:KIND (constant, ramp, "
            "diurnal, step), then optional #key=value options such as #clients=142 #start=10h "
            "#scale=0.1 #tokens=512/128 (synthetic: ,rate=2,peak=20). Relative paths are also looked up "
            "under $LOWTIDE_DATA_DIR (default ../shared/data), e.g. servegen:traces/servegen-m-large.",
        ),
    ],
    target: Annotated[
        str,
        typer.Option("--target", help="Server base URL, e.g. http://127.0.0.1:8000 (POST /v1/completions)."),
    ],
    speedup: Annotated[float, typer.Option(help="Trace seconds per wall second.")] = 60.0,
    duration: Annotated[
        float | None,
        typer.Option(
            help="Trace seconds to replay (wall time = duration / speedup); default: the whole trace."
        ),
    ] = None,
    max_concurrency: Annotated[
        int, typer.Option(help="Requests in flight at most; arrivals beyond it are dropped and counted.")
    ] = 256,
    seed: Annotated[int, typer.Option(help="Seed for generated arrivals and token counts.")] = 0,
    model: Annotated[
        str | None, typer.Option(help="Model name to send (default: the first of GET /v1/models).")
    ] = None,
    emulator_hints: Annotated[
        bool, typer.Option(help="Send the emulator's 'prompt_tokens' field (real vLLM logs a warning).")
    ] = False,
    ignore_eos: Annotated[
        bool, typer.Option(help="Send vLLM's ignore_eos so outputs reach max_tokens.")
    ] = False,
    request_timeout: Annotated[float, typer.Option(help="Seconds a request may take in all.")] = 300.0,
    drain_timeout: Annotated[
        float, typer.Option(help="Seconds requests in flight get to finish after the last one is sent.")
    ] = 30.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Replay a trace against an OpenAI-compatible server; print TTFT/latency percentiles and errors.

    Example: lowtide loadgen --trace servegen:traces/servegen-m-large#clients=142#start=10h
    --target http://127.0.0.1:8000 --speedup 60 --duration 3600
    """
    try:
        spec = parse_trace_spec(trace)
    except ValueError as exc:
        _bad_input(str(exc))
    if not target.startswith(("http://", "https://")):
        _bad_input(f"--target must be an http(s) URL, got {target!r}")
    checks = [
        (speedup > 0, f"--speedup must be > 0, got {speedup:g}"),
        (duration is None or duration > 0, f"--duration must be > 0, got {duration}"),
        (max_concurrency >= 1, f"--max-concurrency must be >= 1, got {max_concurrency}"),
        (request_timeout > 0, f"--request-timeout must be > 0, got {request_timeout:g}"),
        (drain_timeout >= 0, f"--drain-timeout must be >= 0, got {drain_timeout:g}"),
        (spec.kind != "synthetic" or duration is not None, "synthetic traces need --duration"),
    ]
    for ok, message in checks:
        if not ok:
            _bad_input(message)
    options: dict[str, Any] = {
        "speedup": speedup,
        "max_concurrency": max_concurrency,
        "model": model,
        "emulator_hints": emulator_hints,
        "ignore_eos": ignore_eos,
        "request_timeout_s": request_timeout,
        "drain_timeout_s": drain_timeout,
        "prompt_seed": seed,
    }
    if not as_json:
        span = (
            "whole trace" if duration is None else f"{duration:g} trace s ≈ {duration / speedup:.1f} wall s"
        )
        typer.echo(f"replaying {spec.describe()} → {target} (×{speedup:g}, {span})", err=True)
    try:
        report = asyncio.run(_replay(spec, target, duration, seed, options))
    except ValueError as exc:  # a trace file that turns out malformed mid-way
        _bad_input(str(exc))
    if as_json:
        data = report.to_dict()
        data.update(trace=trace, trace_description=spec.describe(), seed=seed)
        typer.echo(json.dumps(data, indent=2, sort_keys=True))
    else:
        typer.echo(report.format_text())
    if report.sent > 0 and report.ok == 0:
        typer.echo("error: no request succeeded", err=True)
        raise typer.Exit(1)
