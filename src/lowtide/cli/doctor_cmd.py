"""`lowtide doctor`: does a running vLLM replica give lowtide what it needs? Says what is missing.

Usage: ``lowtide doctor --url http://127.0.0.1:8100 [--park sleep|stop] [--json]``,
``lowtide [-c lowtide.yaml] doctor --service NAME [--slot N]`` (the service's configuration, then
the replica of that slot, on ``base_port + slot``; the service's `park` decides whether the sleep
check is required) or ``lowtide [-c lowtide.yaml] doctor --config-only`` (every service's
configuration; no replica is contacted).

Checks, each reported as ``ok``, ``missing`` (required: lowtide will misbehave), ``warning`` (not
required here, but something lowtide would use is absent) or ``skipped``, with a plain sentence
of what to do (docs/vllm.md has the vLLM source behind each one):

- ``health``: ``GET /health`` answers 200. vLLM refuses connections while it loads and answers
  503 only when its engine is dead; it stays 200 while asleep and while its engine is stuck
  (`vllm/entrypoints/serve/instrumentator/health.py`, current; `api_server.py` before), so
  lowtide never takes a 200 as proof of life (a sleeping replica is said so here).
- ``metrics.<field>``: ``GET /metrics`` parses (`adapters.vllm_metrics.parse_vllm_metrics`, what
  the control loop reads) and each family lowtide reads is there: running and waiting requests
  and KV-cache usage are required (the autoscaler's signals, and the drain without a gateway);
  KV capacity, token and request counters and the TTFT / e2e / inter-token histograms are
  warnings when absent (reports and the TTFT guard lose them), as are the preemption counter,
  the waiting requests by reason and the engine sleep state (newer vLLM only:
  `adapters.vllm_metrics` cites the source).
- ``sleep``: ``GET /is_sleeping`` answers ``{"is_sleeping": bool}``. vLLM serves ``/sleep``,
  ``/wake_up`` and ``/is_sleeping`` only with ``VLLM_SERVER_DEV_MODE=1`` in its environment
  (`vllm/envs.py`; routers registered under ``if envs.VLLM_SERVER_DEV_MODE``), else 404.
  Required with ``park: sleep`` (without it lowtide stops the replica instead), else a warning.
  Nothing is put to sleep: the check only reads.
- ``loopback``: nothing answers on the replica's port at this machine's other addresses (IPv4,
  and IPv6 but link-local). vLLM binds every interface without ``--host``
  (`vllm/entrypoints/openai/api_server.py`, ``(args.host or "", args.port)``); then clients can
  bypass the gateway (drains do not see them) and, with dev mode on, reach ``/sleep`` and
  ``/collective_rpc``. A URL that is itself not loopback fails this check at once. Checked only
  on the machine the replica runs on.

Configuration checks (``--service`` and ``--config-only``; warnings, never required: the node's
own environment or a wrapper script may supply what the config does not show), named
``config.<service>.<check>``:

- ``dev_mode`` (``park: sleep``): the replica's environment as lowtide builds it
  (`wiring.replica_env`: ``VLLM_SERVER_DEV_MODE=1``, ``services[].env`` wins), or a
  ``VLLM_SERVER_DEV_MODE=...`` assignment written in the command itself, turns dev mode on as vLLM
  reads it: ``bool(int(os.getenv("VLLM_SERVER_DEV_MODE", "0")))`` (`vllm/envs.py`; a value
  ``int`` rejects, such as ``true``, makes vLLM fail when it reads it).
- ``sleep_mode`` (``park: sleep`` with a configured ``command``): the command has
  ``--enable-sleep-mode`` (``ModelConfig.enable_sleep_mode``, a ``vllm serve`` flag through
  `vllm/engine/arg_utils.py`, with ``--no-enable-sleep-mode`` as its negation; docs/vllm.md):
  without it ``/sleep`` cannot free the GPU and lowtide stops the replica instead. Not asked of
  lowtide's own emulator (``lowtide emulate vllm`` always sleeps and has no such flag) nor of the
  default command (which adds it).
- ``host`` (a configured ``command``): the command binds loopback with ``--host`` (``--host X``
  or ``--host=X``, X a loopback address or ``localhost``); without ``--host`` vLLM binds every
  interface (see ``loopback`` above). The default command binds ``wiring.REPLICA_HOST``.

The command is read as its words joined by spaces, so a flag inside a ``bash -c "..."`` string
counts; a flag set only in a ``--config`` YAML file given to vLLM is not seen (the warning says
so).

Exit codes: 0 every required check passed; 1 a required check failed; 2 bad usage (not exactly
one of --url, --service and --config-only, a URL that is not http(s)://host:port, an unknown
service, a config error). Every text from the replica is printed through `cli.output.safe` (or `--json`).
Registered by `cli.main` as ``app.command("doctor")(doctor_command)``; httpx, psutil and the
metrics parser are imported only when it runs (the CLI starts fast).
Must not: change the replica's state (no POST), talk to the lowtide API, or decide anything.
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Annotated, Literal, NoReturn
from urllib.parse import urlsplit

import typer

from lowtide.cli.output import console, safe

if TYPE_CHECKING:
    import httpx

    from lowtide.config import ServiceConfig, Settings

Status = Literal["ok", "missing", "warning", "skipped"]
TIMEOUT_S = 5.0
CONNECT_PROBE_S = 1.0


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: Status
    required: bool
    detail: str  # what was seen and, when not ok, what to do


@dataclass(frozen=True, slots=True)
class Target:
    url: str  # base URL without a trailing slash
    host: str
    port: int
    park: Literal["sleep", "stop"] | None  # None: not known (the sleep check is not required)
    config_checks: tuple[Check, ...] = ()  # with --service: its configuration's checks


def _usage(message: str) -> NoReturn:
    console(stderr=True).print(f"[red]error:[/red] {safe(message)}")
    raise typer.Exit(2)


def doctor_command(
    ctx: typer.Context,
    url: Annotated[
        str | None, typer.Option("--url", help="The replica's base URL, e.g. http://127.0.0.1:8100.")
    ] = None,
    service: Annotated[
        str | None,
        typer.Option("--service", help="A service of the config: check its configuration and its replica."),
    ] = None,
    slot: Annotated[int, typer.Option("--slot", help="With --service: which replica (0-based).", min=0)] = 0,
    park: Annotated[
        str | None, typer.Option("--park", help="sleep or stop: how the replica is parked (--url only).")
    ] = None,
    config_only: Annotated[
        bool,
        typer.Option(
            "--config-only", help="Check every service's command and environment; contact no replica."
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Check a running vLLM replica against what lowtide needs and say what is missing."""
    if config_only:
        if url is not None or service is not None or park is not None:
            _usage("--config-only checks the configuration: give it without --url, --service or --park")
        where, checks = _config_only(ctx)
        shown: str | None = None
    else:
        target = _target(ctx, url, service, slot, park)
        checks = [*target.config_checks, *diagnose(target)]
        where = shown = target.url
    failed = any(c.required and c.status == "missing" for c in checks)
    if as_json:
        payload = {"url": shown, "ok": not failed, "checks": [asdict(c) for c in checks]}
        typer.echo(json.dumps(payload, indent=2))
    else:
        out = console()
        out.print(f"lowtide doctor: {safe(where)}")
        colour = {"ok": "green", "missing": "red", "warning": "yellow", "skipped": "dim"}
        for c in checks:
            label = f"[{colour[c.status]}]{c.status:<8}[/{colour[c.status]}]"
            out.print(f"  {label} {safe(c.name):<32} {safe(c.detail)}")
        verdict = "a required check failed" if failed else "everything lowtide needs is there"
        out.print(f"{'[red]' if failed else '[green]'}{verdict}[/]")
    raise typer.Exit(1 if failed else 0)


def _target(ctx: typer.Context, url: str | None, service: str | None, slot: int, park: str | None) -> Target:
    if park not in (None, "sleep", "stop"):
        _usage(f"--park {park!r}: use sleep or stop")
    if (url is None) == (service is None):
        _usage("give either --url http://HOST:PORT or --service NAME (or --config-only)")
    mode: Literal["sleep", "stop"] | None = "sleep" if park == "sleep" else "stop" if park else None
    found: tuple[Check, ...] = ()
    if service is not None:
        services = _settings(ctx).services
        cfg = next((s for s in services if s.name == service), None)
        if cfg is None:
            names = ", ".join(s.name for s in services) or "none"
            _usage(f"--service {service!r}: no such service in the config (services: {names})")
        if slot >= cfg.max_replicas:
            _usage(f"--slot {slot}: service {service!r} has slots 0..{cfg.max_replicas - 1}")
        url = f"http://127.0.0.1:{cfg.base_port + slot}"
        mode = mode or cfg.park
        found = tuple(config_checks(cfg))
    assert url is not None
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        _usage(f"--url {url!r}: give http://HOST:PORT (the replica's own address, not the gateway's)")
    base = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"
    return Target(base, parts.hostname, port, mode, found)


def _settings(ctx: typer.Context) -> Settings:
    from lowtide.config import ConfigError, load_settings  # noqa: PLC0415 (fast CLI start)

    config = ctx.parent.params.get("config") if ctx.parent is not None else None
    try:
        return load_settings(config)
    except ConfigError as exc:
        _usage(str(exc))


def _config_only(ctx: typer.Context) -> tuple[str, list[Check]]:
    """What `--config-only` prints: where the config came from, and every service's checks."""
    services = _settings(ctx).services
    config = ctx.parent.params.get("config") if ctx.parent is not None else None
    where = f"the services of {config or 'the configuration'} (no replica contacted)"
    if not services:
        return where, [Check("config", "skipped", False, "no services in the configuration")]
    return where, [c for cfg in services for c in config_checks(cfg)]


# -- the configuration's checks (pure) -----------------------------------------------------------

DEV_MODE = "VLLM_SERVER_DEV_MODE"
_DEV_MODE_IN_COMMAND = re.compile(r"(?<![\w-])VLLM_SERVER_DEV_MODE=(\S*)")
_SLEEP_FLAG = re.compile(r"(?<![\w-])--(no-)?enable-sleep-mode(?![\w-])")
_HOST = re.compile(r"(?<![\w-])--host(?:=|\s+)(\S+)")
_FIX_IN_CONFIG = "in services[].command (or leave command out: lowtide's default command does it)"


def _dev_mode_on(value: str) -> bool | None:
    """vLLM's reading of VLLM_SERVER_DEV_MODE: ``bool(int(value))``; None when ``int`` fails."""
    try:
        return bool(int(value.strip("'\"")))
    except ValueError:
        return None


def _is_emulator(command: str) -> bool:
    return re.search(r"(?<![\w-])lowtide\s+emulate\s+vllm(?![\w-])", command) is not None


def config_checks(cfg: ServiceConfig) -> list[Check]:
    """The configuration's checks of one service (see the module docstring); no I/O."""
    from lowtide.wiring import REPLICA_HOST, replica_env  # noqa: PLC0415 (fast CLI start)

    name = cfg.name
    command = " ".join(cfg.command) if cfg.command else None
    checks: list[Check] = []
    if cfg.park == "sleep":
        checks.append(_dev_mode_check(cfg, command, replica_env(cfg).get(DEV_MODE)))
        if command is not None and not _is_emulator(command):
            checks.append(_sleep_flag_check(name, command))
    if command is None:
        checks.append(
            Check(
                f"config.{name}.host",
                "ok",
                False,
                f"lowtide's default command binds the replica to {REPLICA_HOST}",
            )
        )
    else:
        checks.append(_host_check(name, command))
    return checks


def _dev_mode_check(cfg: ServiceConfig, command: str | None, env_value: str | None) -> Check:
    name = f"config.{cfg.name}.dev_mode"
    in_command = _DEV_MODE_IN_COMMAND.search(command) if command is not None else None
    value, source = (
        (in_command.group(1), "the command") if in_command else (env_value, "the replica's environment")
    )
    fix = (
        f"service {cfg.name!r} has park: sleep, but vLLM serves /sleep, /wake_up and /is_sleeping only "
        f"with {DEV_MODE}=1 in its environment: without it lowtide stops the replica instead of putting "
        f'it to sleep (every unpark is a cold start). Set {DEV_MODE}: "1" in services[].env (lowtide '
        "sets it unless env overrides it)"
    )
    if value is None:
        return Check(name, "warning", False, f"{DEV_MODE} is not set; {fix}")
    on = _dev_mode_on(value)
    if on is None:
        return Check(
            name,
            "warning",
            False,
            f"{DEV_MODE}={value!r} in {source}: vLLM reads it with int(), which rejects it; {fix}",
        )
    if not on:
        return Check(name, "warning", False, f"{DEV_MODE}={value!r} in {source} turns dev mode off; {fix}")
    return Check(
        name, "ok", False, f"{DEV_MODE}={value} in {source}: /sleep, /wake_up and /is_sleeping served"
    )


def _sleep_flag_check(service: str, command: str) -> Check:
    name = f"config.{service}.sleep_mode"
    flags = _SLEEP_FLAG.findall(command)
    if flags and flags[-1] == "":
        return Check(name, "ok", False, "the command has --enable-sleep-mode")
    seen = "turns it off with --no-enable-sleep-mode" if flags else "lacks --enable-sleep-mode"
    return Check(
        name,
        "warning",
        False,
        f"service {service!r} has park: sleep, but its command {seen}: vLLM then cannot free the GPU on "
        f"POST /sleep and lowtide stops the replica instead. Add --enable-sleep-mode {_FIX_IN_CONFIG} "
        "(if a vLLM --config file sets it, ignore this)",
    )


def _host_check(service: str, command: str) -> Check:
    name = f"config.{service}.host"
    hosts = _HOST.findall(command)
    todo = (
        f"clients can then reach the replica without the gateway (drains do not see them) and, with dev "
        f"mode on, call /sleep and /collective_rpc. Add --host 127.0.0.1 {_FIX_IN_CONFIG}"
    )
    if not hosts:
        return Check(
            name,
            "warning",
            False,
            f"service {service!r}: its command has no --host, so vLLM binds every interface; {todo}",
        )
    host = hosts[-1].strip("'\"")
    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        return Check(name, "ok", False, f"the command binds {host} (loopback)")
    return Check(
        name,
        "warning",
        False,
        f"service {service!r}: its command binds --host {host}, not a loopback address; {todo}",
    )


# -- the checks ---------------------------------------------------------------------------------


def diagnose(target: Target) -> list[Check]:
    """Every check against `target`, in order (see the module docstring)."""
    import httpx  # noqa: PLC0415 (fast CLI start)

    with httpx.Client(timeout=TIMEOUT_S, trust_env=False, follow_redirects=False) as client:
        health, reachable = _health(client, target)
        checks = [health]
        if not reachable:
            rest = "skipped: the replica did not answer /health"
            names = ("metrics", "sleep", "loopback")
            return [*checks, *(Check(n, "skipped", False, rest) for n in names)]
        checks += _metrics(client, target)
        checks.append(_sleep(client, target))
    checks.append(_loopback(target))
    return checks


def _get(client: httpx.Client, url: str) -> httpx.Response | str:
    """The response, or why there is none (a sentence)."""
    import httpx  # noqa: PLC0415

    try:
        return client.get(url)
    except httpx.ConnectError as exc:
        return f"cannot connect ({exc or 'refused'})"
    except httpx.TimeoutException:
        return f"no answer within {TIMEOUT_S:g}s"
    except httpx.HTTPError as exc:
        return f"failed: {exc!r}"


def _health(client: httpx.Client, target: Target) -> tuple[Check, bool]:
    got = _get(client, f"{target.url}/health")
    if isinstance(got, str):
        todo = (
            "is the replica running, and on this port? vLLM refuses connections until its model is "
            "loaded (a cold start takes minutes): try again once it has started"
        )
        return Check("health", "missing", True, f"GET /health: {got}; {todo}"), False
    if got.status_code == 200:
        return Check(
            "health",
            "ok",
            True,
            "GET /health answered 200 (vLLM also answers 200 while asleep or stuck: lowtide "
            "watches its metrics and the gateway's failures too)",
        ), True
    if got.status_code == 503:
        detail = "GET /health answered 503: vLLM does so only when its engine is dead; restart the replica"
    else:
        detail = f"GET /health answered HTTP {got.status_code}: is this a vLLM server?"
    return Check("health", "missing", True, detail), True


# field -> (required, families, what lowtide uses it for)
_FIELDS: tuple[tuple[str, bool, str, str], ...] = (
    ("running", True, "vllm:num_requests_running", "the autoscaler's concurrency and drains"),
    ("waiting", True, "vllm:num_requests_waiting", "the autoscaler's concurrency and drains"),
    (
        "kv_usage",
        True,
        "vllm:kv_cache_usage_perc (V0: vllm:gpu_cache_usage_perc)",
        "the autoscaler's KV-cache signal",
    ),
    (
        "kv_capacity_tokens",
        False,
        "vllm:cache_config_info (kv_cache_size_tokens, or num_gpu_blocks and block_size)",
        "KV tokens in use",
    ),
    ("prompt_tokens_total", False, "vllm:prompt_tokens_total", "token rates"),
    ("generation_tokens_total", False, "vllm:generation_tokens_total", "token rates and the token signal"),
    ("requests_total", False, "vllm:request_success_total", "request rates"),
    ("ttft", False, "vllm:time_to_first_token_seconds", "the TTFT guard and reports"),
    ("e2e", False, "vllm:e2e_request_latency_seconds", "latency reports"),
    (
        "itl",
        False,
        "vllm:inter_token_latency_seconds (V0: vllm:time_per_output_token_seconds)",
        "latency reports",
    ),
    ("preemptions_total", False, "vllm:num_preemptions_total", "the preemption rate (a short KV cache)"),
    (
        "waiting_capacity",
        False,
        "vllm:num_requests_waiting_by_reason (newer vLLM)",
        "why requests wait (capacity or deferred)",
    ),
    (
        "sleep_state",
        False,
        "vllm:engine_sleep_state (newer vLLM)",
        "the metrics' confirmation of a sleep (it asks /is_sleeping instead)",
    ),
)


def _metrics(client: httpx.Client, target: Target) -> list[Check]:
    from lowtide.adapters.vllm_metrics import parse_vllm_metrics  # noqa: PLC0415 (fast CLI start)

    got = _get(client, f"{target.url}/metrics")
    if isinstance(got, str) or got.status_code != 200:
        seen = got if isinstance(got, str) else f"HTTP {got.status_code}"
        return [
            Check(
                "metrics",
                "missing",
                True,
                f"GET /metrics: {seen}; lowtide scales and drains from it: do not start vLLM "
                "with --disable-log-stats, and check the URL is the replica's own",
            )
        ]
    scrape = parse_vllm_metrics(got.text, at=time.time())
    checks = []
    if not scrape.ok:
        checks.append(
            Check(
                "metrics",
                "missing",
                True,
                f"/metrics is not a usable vLLM reading: {scrape.error}; lowtide ignores such readings",
            )
        )
    else:
        version = f" ({scrape.version} names)" if scrape.version else ""
        checks.append(Check("metrics", "ok", True, f"/metrics parsed{version}"))
    for field, required, families, use in _FIELDS:
        value = getattr(scrape, field)
        if value is not None:
            checks.append(Check(f"metrics.{field}", "ok", required, families))
            continue
        status: Status = "missing" if required else "warning"
        checks.append(
            Check(
                f"metrics.{field}",
                status,
                required,
                f"{families} absent (or NaN): lowtide loses {use}; a vLLM that does not export it is "
                "too old or runs with a custom metrics setup (docs/vllm.md lists the families)",
            )
        )
    return checks


def _sleep(client: httpx.Client, target: Target) -> Check:
    required = target.park == "sleep"
    got = _get(client, f"{target.url}/is_sleeping")
    if not isinstance(got, str) and got.status_code == 200:
        try:
            asleep = got.json().get("is_sleeping")
        except (ValueError, AttributeError):
            asleep = None
        if isinstance(asleep, bool):
            state = (
                "asleep now (/health still says 200; lowtide routes to it only once woken)"
                if asleep
                else "awake"
            )
            return Check("sleep", "ok", required, f"GET /is_sleeping answered: {state}")
        return Check(
            "sleep",
            "missing" if required else "warning",
            required,
            "GET /is_sleeping: not {is_sleeping: bool}",
        )
    status: Status = "missing" if required else "warning"
    why = "with park: sleep lowtide stops the replica instead" if required else "needed only with park: sleep"
    if not isinstance(got, str) and got.status_code == 404:
        return Check(
            "sleep",
            status,
            required,
            "GET /is_sleeping answered 404: vLLM serves /sleep, /wake_up and /is_sleeping only with "
            "VLLM_SERVER_DEV_MODE=1 in its environment (and sleeps only with --enable-sleep-mode); "
            f"lowtide's default command sets both for park: sleep ({why})",
        )
    seen = got if isinstance(got, str) else f"HTTP {got.status_code}"
    return Check("sleep", status, required, f"GET /is_sleeping: {seen} ({why})")


def _other_addresses() -> list[str]:
    """This machine's addresses outside loopback (IPv4, and IPv6 but link-local)."""
    import psutil  # noqa: PLC0415 (fast CLI start)

    out = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                ip = ipaddress.ip_address(a.address.split("%", 1)[0])
            except ValueError:
                continue
            if not (ip.is_loopback or ip.is_link_local or ip.is_unspecified):
                out.append(str(ip))
    return out


def _accepts(address: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(CONNECT_PROBE_S)
        return s.connect_ex((address, port)) == 0


def _loopback(target: Target) -> Check:
    todo = (
        "start vLLM with --host 127.0.0.1 (lowtide's default command does) so that the gateway is the "
        "only way in: otherwise clients bypass it (drains do not see them) and, with dev mode on, "
        "reach /sleep and /collective_rpc"
    )
    host = target.host
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        return Check(
            "loopback", "missing", True, f"the replica answered at {host}, not a loopback address: {todo}"
        )
    addresses = _other_addresses()
    if not addresses:
        return Check("loopback", "ok", True, "this machine has no other address to reach it on")
    open_on = [a for a in addresses if _accepts(a, target.port)]
    if open_on:
        where = ", ".join(f"{a}:{target.port}" for a in open_on)
        return Check(
            "loopback", "missing", True, f"the replica's port also accepts connections on {where}: {todo}"
        )
    return Check(
        "loopback", "ok", True, f"not reachable on {', '.join(addresses)} (port {target.port}): loopback only"
    )
