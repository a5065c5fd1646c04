"""`lowtide metrics parse SOURCE [--json]`: what lowtide reads in one vLLM `/metrics` text.

For operators (is this replica's `/metrics` what lowtide expects?) and for our own checks.
SOURCE is a file or an http(s) URL (fetched once); a file may be a pasted terminal transcript
(`vllm_metrics.strip_transcript` drops its ``$ curl`` and ``...`` lines and ends it with a
newline). Prints the normalised reading: gauges, KV capacity and tokens in use, counters, each
histogram's count, sum and p50/p90/p99 since the server started (one reading has no window, so
these are lifetime quantiles), the detected version and the problems noted. Exit codes: 0 read;
2 the source cannot be read (missing file, unreachable URL, HTTP error, not UTF-8) or its content
is not a usable vLLM reading (the error is printed, and with it whatever was read before the bad
line). Registered by `cli.main` as ``app.add_typer(metrics_app, name="metrics")``.
Must not: talk to the lowtide API or decide anything.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Annotated, Any, NoReturn

import httpx
import typer
from rich.table import Table

from lowtide.adapters.vllm_metrics import parse_vllm_metrics, strip_transcript
from lowtide.cli.output import HELP_MARKUP, console, safe
from lowtide.domain.metrics import Histogram, ReplicaScrape
from lowtide.policy.signals import QUANTILES, histogram_quantile

metrics_app = typer.Typer(
    help="Read vLLM metrics the way lowtide does.", no_args_is_help=True, rich_markup_mode=HELP_MARKUP
)
FETCH_TIMEOUT_S = 10.0
MAX_BYTES = 32 * 1024 * 1024


@metrics_app.callback()
def _metrics() -> None:
    """Read vLLM metrics the way lowtide does."""


def _fail(message: str) -> NoReturn:
    console(stderr=True).print(f"[red]error:[/red] {safe(message)}")
    raise typer.Exit(2)


def read_source(source: str) -> str:
    """The text of a file or an http(s) URL; exits 2 with the reason when it cannot be read."""
    if source.startswith(("http://", "https://")):
        try:
            response = httpx.get(source, timeout=FETCH_TIMEOUT_S, follow_redirects=True, trust_env=False)
        except httpx.TimeoutException:
            _fail(f"{source}: no answer within {FETCH_TIMEOUT_S:g}s")
        except httpx.HTTPError as exc:
            _fail(f"{source}: cannot fetch: {exc or type(exc).__name__}")
        if response.status_code != 200:
            _fail(f"{source}: HTTP {response.status_code} {response.reason_phrase}")
        data = response.content
    else:
        path = Path(source)
        try:
            if path.stat().st_size > MAX_BYTES:
                _fail(f"{source}: larger than {MAX_BYTES} bytes; not a /metrics text")
            data = path.read_bytes()
        except OSError as exc:
            _fail(f"{source}: cannot read: {exc.strerror or exc}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        _fail(f"{source}: not UTF-8 text ({exc.reason} at byte {exc.start})")


def _number(value: float | None) -> float | str | None:
    """JSON-safe: None stays None (unknown), ±Inf becomes "+Inf"/"-Inf", NaN becomes None."""
    if value is None or math.isnan(value):
        return None
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return value


def _histogram_summary(h: Histogram | None) -> dict[str, Any] | None:
    if h is None:
        return None
    quantiles = {f"p{round(q * 100)}": histogram_quantile(q, h.buckets) for q in QUANTILES}
    return {
        "count": _number(h.count),
        "sum": _number(h.sum),
        **{k: _number(v) for k, v in quantiles.items()},
        "buckets": [[_number(bound), _number(count)] for bound, count in h.buckets],
    }


def summary(scrape: ReplicaScrape) -> dict[str, Any]:
    """The reading as a JSON-ready dict (what `--json` prints)."""
    kv_used = (
        scrape.kv_usage * scrape.kv_capacity_tokens
        if scrape.kv_usage is not None and scrape.kv_capacity_tokens is not None
        else None
    )
    return {
        "ok": scrape.ok,
        "error": scrape.error,
        "version": scrape.version,
        "model": scrape.model,
        "running": _number(scrape.running),
        "waiting": _number(scrape.waiting),
        "kv_usage": _number(scrape.kv_usage),
        "kv_capacity_tokens": _number(scrape.kv_capacity_tokens),
        "kv_tokens_used": _number(kv_used),
        "prompt_tokens_total": _number(scrape.prompt_tokens_total),
        "generation_tokens_total": _number(scrape.generation_tokens_total),
        "requests_total": _number(scrape.requests_total),
        "histograms": {
            "ttft": _histogram_summary(scrape.ttft),
            "e2e": _histogram_summary(scrape.e2e),
            "itl": _histogram_summary(scrape.itl),
        },
        "problems": list(scrape.problems),
    }


def _show(value: object) -> str:
    if value is None:
        return "[dim]unknown[/dim]"
    if isinstance(value, float):
        return f"{value:,.6g}"
    return safe(str(value))


def _table(data: dict[str, Any]) -> Table:
    table = Table(title="vLLM metrics as lowtide reads them", show_header=True)
    table.add_column("signal")
    table.add_column("value", justify="right")
    table.add_column("from")
    rows = [
        ("version", data["version"], "names present (V1-only / V0-only)"),
        ("model", data["model"], "model_name label"),
        ("running", data["running"], "vllm:num_requests_running (sum)"),
        ("waiting", data["waiting"], "vllm:num_requests_waiting (sum)"),
        ("KV-cache usage", data["kv_usage"], "kv_cache_usage_perc | gpu_cache_usage_perc (mean)"),
        ("KV capacity (tokens)", data["kv_capacity_tokens"], "cache_config_info blocks × block_size"),
        ("KV tokens in use", data["kv_tokens_used"], "usage × capacity"),
        ("prompt tokens (total)", data["prompt_tokens_total"], "vllm:prompt_tokens_total"),
        ("generation tokens (total)", data["generation_tokens_total"], "vllm:generation_tokens_total"),
        ("requests finished (total)", data["requests_total"], "vllm:request_success_total"),
    ]
    for label, value, origin in rows:
        table.add_row(label, _show(value), origin)
    names = {"ttft": "TTFT", "e2e": "e2e latency", "itl": "inter-token latency"}
    for key, title in names.items():
        h = data["histograms"][key]
        if h is None:
            table.add_row(f"{title}", _show(None), "histogram absent or unusable")
            continue
        table.add_row(f"{title}: count / sum", f"{_show(h['count'])} / {_show(h['sum'])}", "since start")
        table.add_row(
            f"{title}: p50 / p90 / p99 (s)",
            " / ".join(_show(h[p]) for p in ("p50", "p90", "p99")),
            "since start, Prometheus interpolation",
        )
    return table


@metrics_app.command("parse")
def parse(
    source: Annotated[
        str, typer.Argument(help="A file (a saved /metrics, or a pasted curl transcript) or an http(s) URL.")
    ],
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Read one /metrics text and print what lowtide makes of it."""
    text = read_source(source)
    if not source.startswith(("http://", "https://")):
        # A saved file may be a pasted transcript; a URL's body is the real thing, left as it is
        # (so a body cut short is still seen as truncated).
        text = strip_transcript(text)
    scrape = parse_vllm_metrics(text, at=time.time())
    data = summary(scrape)
    out = console()
    if json_out:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        out.print(_table(data))
        for problem in scrape.problems:
            out.print(f"[yellow]note:[/yellow] {safe(problem)}")
    if not scrape.ok:
        _fail(f"{source}: {scrape.error}")
