"""The composition root: settings in, a running embedded lowtide out (store, executor, loop, API).

`build()` assembles the parts without starting anything (tests use it directly); `serve()` runs
the HTTP server until interrupted and, while it holds the store's lease (`control.leadership`;
several `lowtide up` on one store: one leader, hot standbys), recovery and the loop thread.
Step processes keep running when the control plane stops: the next start (or the standby that
takes over) re-adopts them. Must not: hold policy or business rules; it only connects parts.
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import re
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import uvicorn
from fastapi import FastAPI
from sqlalchemy.engine import make_url

from lowtide.adapters.container import (
    ContainerRuntime,
    RuntimeNotFoundError,
    check_engine,
    container_api_url,
    resolve_runtime,
)
from lowtide.adapters.exit_watch import ExitWatcher
from lowtide.adapters.gateway import GatewayError
from lowtide.adapters.gateway_supervisor import GatewayListen, GatewaySupervisor
from lowtide.adapters.gpu_discovery import GpuDiscoveryError, discover_gpus
from lowtide.adapters.local_executor import LocalExecutor
from lowtide.adapters.local_services import LocalServiceManager
from lowtide.adapters.metrics_sources import PromQLSource, ScrapeSource
from lowtide.adapters.net import bind_tcp
from lowtide.adapters.secrets import ConfiguredSecrets, SecretSource
from lowtide.adapters.service_routing import ForgetsReplicas, RoutedServiceManager
from lowtide.adapters.step_identity import current_user, resolve_job_users
from lowtide.adapters.storage import FsspecArtifacts
from lowtide.adapters.supervision import pin_boot_time
from lowtide.adapters.templates import DirectoryTemplates
from lowtide.api.app import ApiContext, create_app
from lowtide.api.metrics import LoopStatus
from lowtide.config import (
    ConfigError,
    ServiceConfig,
    Settings,
    auth_exposure_problem,
    lending_policy,
    scheduler_policy,
    service_spec,
)
from lowtide.control.clock import Clock, ClockWatch, SystemClock
from lowtide.control.executor_port import Executor, JobUsers
from lowtide.control.inference import InferenceController, ServiceSetup
from lowtide.control.inference_ports import MetricsSource, ServiceManager
from lowtide.control.leadership import Leadership, LeasePort, Term
from lowtide.control.lease import MARGIN_SHARE, LeaseCandidate, LeaseTiming, holder_name, seat_of
from lowtide.control.loop import ControlLoop, LoopSettings
from lowtide.control.secrets_port import SecretRule
from lowtide.control.store_health import StoreHealth
from lowtide.domain.gpus import Node
from lowtide.domain.layout import ArtifactLayout
from lowtide.policy.accounting import AccountingPolicy
from lowtide.policy.outcomes import RetryPolicy
from lowtide.store.errors import unavailable
from lowtide.store.repo import Store

log = logging.getLogger("lowtide")

#: In the state dir: the boot time process start times count from, per boot (`adapters.supervision`).
BOOT_TIME_FILE = "boot-time.json"


def resolve_nodes(settings: Settings) -> tuple[Node, ...]:
    """Declared GPUs as given; ``auto`` through NVML (an error if NVML is unavailable)."""
    nodes = []
    for i, node in enumerate(settings.nodes):
        memory = node.gpu_memory_gib
        if node.gpus == "auto":
            try:
                found = discover_gpus()
            except GpuDiscoveryError as exc:
                raise ConfigError(f"nodes[{i}].gpus: 'auto' needs NVML: {exc}") from exc
            indices = tuple(g.index for g in found)
            if memory is None and found:  # the smallest GPU's memory, so no limit is too high
                memory = min(g.memory_bytes for g in found) / 2**30
        elif isinstance(node.gpus, int):
            indices = tuple(range(node.gpus))
        else:
            indices = tuple(sorted(node.gpus))
        nodes.append(Node(node.name, indices, memory, node.sleep_host_ram_gib))
    return tuple(nodes)


#: What an admin token given in `auth.admin_token_source` must look like (`token_codec.new_raw_token`'s
#: shape, at least as long): "lt_" and 32+ URL-safe characters.
ADMIN_TOKEN_SHAPE = re.compile(r"lt_[A-Za-z0-9_-]{32,}")


def register_admin_token(store: Store, source: Path, now: float) -> bool:
    """Register the admin token held in `source` (`auth.admin_token_source`) unless the store has it
    already: several control planes may start from one Secret at once (the store's unique token
    hash keeps one row). True when this call registered it. Raises ServeError naming the setting."""
    try:
        raw = source.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ServeError(f"auth.admin_token_source: cannot read {source}: {exc}") from None
    if not ADMIN_TOKEN_SHAPE.fullmatch(raw):
        raise ServeError(
            f"auth.admin_token_source: {source} must hold one token: 'lt_' and at least 32 URL-safe "
            "characters (make one with: python -c "
            "\"import secrets; print('lt_' + secrets.token_urlsafe(32))\")"
        )
    if store.authenticate(raw) is not None:
        return False
    try:
        store.create_token(name="admin", owner="admin", role="admin", now=now, raw=raw)
    except Exception:  # another control plane registered it first (unique hash), or the store failed
        if store.authenticate(raw) is None:
            raise
        return False
    return True


def ensure_admin_token(store: Store, path: Path, now: float, source: Path | None = None) -> str | None:
    """Create an admin token on first start (or when its file is gone) and store it with mode 0600;
    with `source` (`auth.admin_token_source`), register that token instead and create none."""
    if source is not None:
        register_admin_token(store, source, now)
        return None
    if path.exists():
        return None
    _, raw = store.create_token(name="admin", owner="admin", role="admin", now=now)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(raw + "\n")
    path.chmod(0o600)  # in case a umask or an existing ACL widened it
    return raw


def secret_sources(settings: Settings) -> dict[str, SecretSource]:
    """Config `secrets:` as the adapter's sources (docs/architecture.md §11)."""
    out = {}
    for name, cfg in settings.secrets.items():
        if cfg.source.file is not None:
            out[name] = SecretSource(cfg.env, "file", cfg.source.file)
        else:
            assert cfg.source.env is not None  # validated by config: exactly one
            out[name] = SecretSource(cfg.env, "env", cfg.source.env)
    return out


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _unreachable(target: Path) -> Path | None:
    """The first directory above `target` (or itself) that other users cannot traverse."""
    for directory in reversed([target, *target.parents]):
        try:
            mode = directory.stat().st_mode
        except FileNotFoundError:
            return None  # created later, by lowtide (0711)
        if not mode & 0o001:
            return directory
    return None


def job_users(settings: Settings) -> JobUsers | None:
    """`executor.run_as` checked and resolved (docs/architecture.md §6.4); None when unset.
    Raises ConfigError naming the setting: lowtide not root, unknown user, or a work root or
    local artifact root the steps could not reach (or that lies inside the private state dir)."""
    ex = settings.executor
    if ex.run_as is None:
        return None
    if os.geteuid() != 0:
        raise ConfigError(
            f"executor.run_as: running steps as {ex.run_as!r} (one uid per job) needs lowtide to run "
            f"as root; it runs as {current_user()!r}. Start it as root, or remove executor.run_as"
        )
    try:
        users = resolve_job_users(ex.run_as, ex.job_uid_base)
    except (LookupError, ValueError) as exc:
        raise ConfigError(f"executor.run_as: {exc.args[0]}") from None
    state = Path(settings.state_dir).absolute()
    roots: list[tuple[str, Path]] = []
    if "://" not in settings.artifacts or settings.artifacts.startswith("file://"):
        roots.append(("artifact_root", Path(settings.artifacts.removeprefix("file://")).absolute()))
    work = Path(settings.work_root).absolute()
    if all(work != root for _, root in roots):
        roots.append(("executor.work_root", work))  # remote artifacts: default <state_dir>/work
    for what, root in roots:
        if _inside(root, state):
            raise ConfigError(
                f"executor.run_as: {what} {root} lies inside state_dir {state}, which steps must not "
                f"enter (mode 0700); set {what} to a directory outside it"
            )
        blocked = _unreachable(root)
        if blocked is not None:
            raise ConfigError(
                f"executor.run_as: steps cannot reach {what} {root}: {blocked} is not traversable by "
                f"other users (chmod o+x {blocked}, or choose another {what})"
            )
    # The step shim is this Python running lowtide's package, as the job's uid.
    code = {
        "the Python interpreter": Path(sys.executable).resolve().parent,
        "the Python environment": Path(sys.prefix),
        "lowtide's package": Path(__file__).resolve().parent,
    }
    for what, where in code.items():
        blocked = _unreachable(where)
        if blocked is not None:
            raise ConfigError(
                f"executor.run_as: steps cannot run {what} in {where}: {blocked} is not traversable by "
                f"other users (install lowtide where every user can read it, or chmod o+x {blocked})"
            )
    return users


def _runtime(settings: Settings) -> ContainerRuntime | None:
    if settings.executor.runtime == "process":
        return None
    try:
        return resolve_runtime(settings.executor.runtime)
    except RuntimeNotFoundError as exc:
        raise ConfigError(f"executor.runtime: {exc}") from None


def preflight(settings: Settings, *, engine_timeout_s: float = 15.0) -> list[str]:
    """What `lowtide up` checks before it says it listens: the container engine is installed and
    answers, `executor.run_as` can be used. Raises ConfigError (the CLI exits 2); returns the
    warnings to print (steps that can read lowtide's secrets, an API containers cannot reach)."""
    runtime = _runtime(settings)
    if runtime is not None:
        problem = check_engine(runtime, engine_timeout_s)
        if problem is not None:
            raise ConfigError(f"executor.runtime: {runtime.engine} is not usable: {problem}")
    warnings: list[str] = []
    users = job_users(settings)
    if users is None:
        warnings.append(
            f"steps run as lowtide's own user ({current_user()}) and can read its state dir "
            f"({Path(settings.state_dir).absolute()}), database and tokens, and each other's files: "
            "any user can become admin. Set executor.run_as (as root) to isolate them "
            "(docs/architecture.md §6.4)"
        )
    if runtime is not None:
        inside = container_api_url(settings.api.url)
        if inside != settings.api.url and settings.api.host in ("127.0.0.1", "localhost", "::1"):
            warnings.append(
                f"container steps reach the API at {inside}, but it listens on {settings.api.host} only; "
                "set api.host to 0.0.0.0 or the container bridge's address (e.g. 172.17.0.1), or "
                "api.public_url to an address containers can reach"
            )
    return warnings


#: The longest pause between two tries to open a store that is not there yet (seconds).
STORE_OPEN_RETRY_MAX_S = 10.0


def open_store(
    settings: Settings,
    *,
    opener: Callable[[str, float], Store] = lambda url, busy: Store.open(url, busy_timeout_s=busy),
    sleep: Callable[[float], None] = time.sleep,
    monotonic: Callable[[], float] = time.monotonic,
) -> Store:
    """Open (and migrate) the store, waiting up to `store_start_timeout` for one that is not there
    yet (a database still starting, a lock held): each failure that may pass is logged and tried
    again with a growing pause. Raises ServeError when the wait is over, ConfigError (naming
    `store_url`) for a failure that will not pass by waiting (a refused login, a bad URL)."""
    url = settings.database_url
    shown = sa_url_for_humans(url)
    deadline = monotonic() + settings.store_start_timeout
    pause = 0.5
    while True:
        try:
            return opener(url, settings.store_busy_timeout)
        except Exception as exc:
            outage = unavailable(exc)
            if outage is None:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise ConfigError(f"store_url {shown}: cannot open the store: {first}") from exc
            left = deadline - monotonic()
            if left <= 0:
                raise ServeError(
                    f"store_url {shown}: the store did not answer within {settings.store_start_timeout:g}s "
                    f"(store_start_timeout): {outage.reason}"
                ) from exc
            wait = min(pause, left)
            log.warning("waiting for the store %s: %s; trying again in %.1fs", shown, outage.reason, wait)
            sleep(wait)
            pause = min(STORE_OPEN_RETRY_MAX_S, pause * 2)


def sa_url_for_humans(url: str) -> str:
    """A store URL without its password, for messages."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy can parse: say nothing of it but its scheme
        return url.split("://", 1)[0] + "://…"


class _LateCall:
    """A callback whose target is bound later (the loop is built after the adapters that wake it)."""

    def __init__(self) -> None:
        self.target: Callable[[], None] | None = None

    def __call__(self) -> None:
        if self.target is not None:
            self.target()


@dataclass
class Embedded:
    settings: Settings
    nodes: tuple[Node, ...]
    store: Store
    executor: Executor  # LocalExecutor, or ArgoExecutor when executor.kind is argo
    loop: ControlLoop
    app: FastAPI
    clock: Clock
    inference: InferenceController | None = None
    gateway: GatewaySupervisor | None = None  # the gateway process (docs/architecture.md §4.4)
    watcher: ExitWatcher = field(default_factory=lambda: ExitWatcher(lambda: None))
    clock_watch: ClockWatch | None = None  # wall-clock jumps (docs/architecture.md §4.3)
    leadership: Leadership | None = None  # the lease, when serving (docs/architecture.md §4.4)
    events: Any = None  # the Kubernetes Event recorder in cluster mode (`k8s_event_recorder`)

    def close(self) -> None:
        """Stop watching processes and close the store. Steps and replicas keep running (the next
        start re-adopts them), and so does the gateway process."""
        if self.gateway is not None:
            self.gateway.close()
        if self.inference is not None:
            self.inference.manager.close()
        self.executor.close()
        if self.events is not None:
            self.events.close()  # what is queued is written, within a bound
        self.watcher.close()
        self.store.close()

    def loop_status(self) -> LoopStatus:
        last = self.loop.last_tick
        return LoopStatus(
            last_tick_at=last.at if last else None,
            last_tick_duration_s=last.duration_s if last else 0.0,
            ticks=self.loop.ticks,
            tick_errors=self.loop.errors_total,
            queued_waiting=last.waiting if last else 0,
            clock_jumps=self.clock_watch.jumps if self.clock_watch else 0,
            clock_skew_s=self.clock_watch.skew if self.clock_watch else 0.0,
            infrastructure_alerts={k: a.message for k, a in self.loop.infrastructure_alerts.items()},
            infrastructure_failures=dict(self.loop.infrastructure_failures_total),
            control=self.leadership.status() if self.leadership is not None else None,
        )


def build(settings: Settings, *, clock: Clock | None = None) -> Embedded:
    clock = clock or SystemClock()
    state = Path(settings.state_dir)
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    nodes = resolve_nodes(settings)
    artifacts = FsspecArtifacts(settings.artifacts, settings.artifact_options)
    try:
        artifacts.check()  # before the store opens: nothing to close when it fails
    except Exception as exc:  # OSError, botocore's, gcsfs'...: say which setting, and why
        raise ConfigError(f"artifact_root {settings.artifacts}: cannot be used: {exc}") from exc
    if state.stat().st_uid == os.geteuid():
        state.chmod(0o700)  # database, tokens: never readable by steps (docs/architecture.md §6.4)
    pin_boot_time(state / BOOT_TIME_FILE)  # process identities that survive a clock step (§4.3)
    users = job_users(settings)
    runtime = _runtime(settings)
    store = open_store(settings)
    store.health = StoreHealth(clock)  # outages timed on control time (docs/architecture.md §4.4)
    # A process ending or a replica answering wakes the loop at once (bound once the loop exists).
    wake = _LateCall()
    watcher = ExitWatcher(wake)
    events = k8s_event_recorder(settings)
    try:
        executor: Executor = (
            build_argo_executor(settings, store, nodes, events=events)
            if settings.executor.kind == "argo"
            else LocalExecutor(
                store.instance_id(),
                runtime=runtime,
                watcher=watcher,
                env_allowlist=settings.executor.env_allowlist,
                clock=clock,
            )
        )
    except BaseException:
        if events is not None:
            events.close(0.0)
        raise
    layout = ArtifactLayout(artifact_root=settings.artifacts, work_root=settings.work_root)
    scheduler = scheduler_policy(settings, cpus_per_node=os.cpu_count() or 1)
    inference, router = build_inference(
        settings, nodes, store, store.instance_id(), watcher=watcher, on_progress=wake, events=events
    )
    loop = ControlLoop(
        store=store,
        executor=executor,
        artifacts=artifacts,
        clock=clock,
        inference=inference,
        settings=LoopSettings(
            nodes=nodes,
            layout=layout,
            scheduler=scheduler,
            retry=RetryPolicy(settings.executor.retry_backoff, settings.executor.retry_backoff_max),
            checkpoint_poll_s=settings.executor.checkpoint_poll,
            resume_crash_window_s=settings.executor.resume_crash_window,
            api_url=settings.api.url,
            storage_options=settings.artifact_options,
            default_step_timeout_s=settings.scheduler.default_step_timeout,
            job_users=users,
        ),
        secrets=ConfiguredSecrets(secret_sources(settings)) if settings.secrets else None,
    )
    templates_dir = Path(settings.templates_dir)
    ctx = ApiContext(
        store=store,
        clock=clock,
        nodes=nodes,
        layout=layout,
        templates=DirectoryTemplates(templates_dir) if templates_dir.is_dir() else None,
        auth_enabled=settings.auth.enabled,
        cors_origins=tuple(settings.api.cors_origins),
        container_runtime=runtime.engine if runtime else None,
        on_change=loop.wake,
        inference=inference,
        accounting=AccountingPolicy(
            settings.accounting.price_per_gpu_hour, settings.accounting.currency, settings.accounting_timezone
        ),
        secret_rules={n: SecretRule(c.env, tuple(c.teams)) for n, c in settings.secrets.items()},
        max_steps_per_job=settings.scheduler.max_steps_per_job,
        store_unhealthy_after_s=settings.api.store_unhealthy_after,
        logs=argo_pod_logs(settings) if settings.executor.kind == "argo" else None,
        extra={
            "session_key_file": str(state / "session.key"),  # the dashboard's cookies (api.session)
            "dashboard_origins": tuple(settings.api.dashboard_origins),  # api.session's origin check
            "simulation_reports_dir": str(settings.simulation_reports_path),  # the Reports page
        },
    )
    app = create_app(ctx)
    wake.target = loop.wake
    embedded = Embedded(settings, nodes, store, executor, loop, app, clock, inference, router, watcher)
    embedded.events = events
    embedded.clock_watch = ClockWatch(clock)
    ctx.loop_status = embedded.loop_status
    return embedded


#: Where replicas listen: loopback, so that the gateway is the only way in (vLLM binds every
#: interface without --host: vllm/entrypoints/openai/api_server.py, ``(args.host or "", port)``).
REPLICA_HOST = "127.0.0.1"


def replica_command(cfg: ServiceConfig) -> tuple[str, ...]:
    """The replica command template: configured, the emulator, or `vllm serve` (docs/vllm.md)."""
    if cfg.command:
        return tuple(cfg.command)
    if cfg.emulate:
        return (
            "{python}",
            "-m",
            "lowtide",
            "emulate",
            "vllm",
            "--host",
            REPLICA_HOST,
            "--port",
            "{port}",
            "--model",
            "{model}",
            "--gpus",
            "{gpus}",
            *cfg.emulator_args,
        )
    sleep = ("--enable-sleep-mode",) if cfg.park == "sleep" else ()
    return (
        "vllm",
        "serve",
        "{model}",
        "--host",
        REPLICA_HOST,
        "--port",
        "{port}",
        "--tensor-parallel-size",
        "{gpus}",
        *sleep,
    )


def replica_env(cfg: ServiceConfig) -> dict[str, str]:
    """The replica's environment beyond the node's: with `park: sleep`, VLLM_SERVER_DEV_MODE=1 (vLLM
    serves /sleep, /wake_up and /is_sleeping only then: vllm/envs.py, vllm/entrypoints/serve);
    `env` from the config wins."""
    base = {"VLLM_SERVER_DEV_MODE": "1"} if cfg.park == "sleep" else {}
    return {**base, **cfg.env}


def metrics_source(cfg: ServiceConfig) -> MetricsSource:
    m = cfg.metrics
    if m.source == "prometheus":
        assert m.prometheus_url is not None  # validated by config
        return PromQLSource(
            m.prometheus_url,
            selector=m.selector,
            window_s=m.window,
            stale_after_s=m.stale_after,
            timeout_s=m.timeout,
        )
    return ScrapeSource(
        timeout_s=m.timeout, window_s=m.window, stale_after_s=m.stale_after, frozen_after_s=m.frozen_after
    )


def build_inference(
    settings: Settings,
    nodes: tuple[Node, ...],
    store: Store,
    instance_id: str,
    *,
    watcher: ExitWatcher | None = None,
    on_progress: Callable[[], None] | None = None,
    events: Any = None,
) -> tuple[InferenceController | None, GatewaySupervisor | None]:
    """The inference side, when there is anything for it to do (services, or lending rules)."""
    if not settings.services and settings.lending.mode == "continuous":
        return None, None
    # A request held for a service without a live replica wakes the loop: it is demand (issue 9).
    listens = [
        GatewayListen(
            cfg.name,
            settings.api.host,
            cfg.gateway_port,
            read_timeout_s=cfg.gateway_read_timeout,
            hold_max=cfg.gateway_queue,
            hold_timeout_s=gateway_queue_timeout(cfg),
        )
        for cfg in settings.services
        if cfg.gateway_port is not None
    ]
    # The gateway is a process of its own that outlives lowtide (`adapters.gateway_supervisor`);
    # it is started (or adopted) by `start_gateways`.
    router = (
        GatewaySupervisor(settings.gateway_path, instance_id, listens, on_held=on_progress)
        if listens
        else None
    )
    setups = tuple(
        ServiceSetup(
            spec=service_spec(cfg),
            command=replica_command(cfg),
            base_port=cfg.base_port,
            env=replica_env(cfg),
            python=sys.executable,
            health_timeout_s=cfg.startup_timeout,
            drain_timeout_s=cfg.drain_timeout,
            reclaim_grace_s=cfg.reclaim_grace,
            work_root=str(Path(settings.state_dir) / "services"),
            hung_after_s=cfg.hung_after,
            drain_from_metrics=cfg.gateway_port is None,  # no gateway counts its requests
        )
        for cfg in settings.services
    )
    controller = InferenceController(
        store=store,
        manager=service_manager(
            settings, instance_id, watcher=watcher, on_progress=on_progress, events=events
        ),
        sources={cfg.name: metrics_source(cfg) for cfg in settings.services},
        gateway=router,
        services=setups,
        lending=lending_policy(settings),
        nodes=nodes,
    )
    return controller, router


def service_manager(
    settings: Settings,
    instance_id: str,
    *,
    watcher: ExitWatcher | None = None,
    on_progress: Callable[[], None] | None = None,
    api_client: Any = None,
    events: Any = None,
) -> ServiceManager:
    """The service manager of `services[].manager`: local processes, pods of Kubernetes
    Deployments (`adapters.k8s_services`), or both routed by service. `api_client`: a
    `kubernetes.client.ApiClient` (default: in-cluster credentials, else KUBECONFIG)."""
    local = LocalServiceManager(instance_id, watcher=watcher, on_progress=on_progress)
    kube = [c for c in settings.services if c.manager == "kubernetes" and c.kubernetes is not None]
    if not kube:
        return local
    # Imported here: the kubernetes client takes a while to import and only cluster mode needs it.
    from lowtide.adapters.k8s_services import (  # noqa: PLC0415
        DeploymentTarget,
        KubernetesServiceManager,
    )

    targets = [
        DeploymentTarget(
            service=c.name,
            namespace=c.kubernetes.namespace,
            deployment=c.kubernetes.deployment,
            port=c.kubernetes.port,
            endpoint_service=c.kubernetes.endpoint_service,
            on_autoscaler=c.kubernetes.on_autoscaler,
        )
        for c in kube
        if c.kubernetes is not None
    ]
    timeout = min(c.kubernetes.request_timeout for c in kube if c.kubernetes is not None)
    k8s = KubernetesServiceManager(
        api_client if api_client is not None else kube_api_client(),
        targets,
        request_timeout_s=timeout,
        events=events,
    )
    if len(kube) == len(settings.services):
        local.close()
        return k8s
    return RoutedServiceManager(
        {c.name: (k8s if c.manager == "kubernetes" else local) for c in settings.services}
    )


def argo_workflows(store: Any, settings: Any) -> Callable[[str], Any]:
    """How the Argo executor gets a job's current Workflow (docs/cluster.md "The Argo executor at
    runtime", "Retrying a job"): the job as stored (its spec document and resolved steps,
    `store.job_detail`) compiled with `settings` (`adapters.argo.workflow.ArgoSettings`), of the
    generation its steps' `retried_at` give (`job_generation`: 0 for a job never retried), without
    its SUCCEEDED steps when retried, each step's attempt numbers going on from the attempts it
    had before its retry (started before its `retried_at`: fixed for the generation, so every
    compile of it gives the same Workflow). Raises ArgoCompileError or NotFound."""
    from lowtide.adapters.argo.workflow import compile_workflow, job_generation  # noqa: PLC0415 - cluster mode only
    from lowtide.domain.spec_parse import build_job_spec  # noqa: PLC0415
    from lowtide.domain.states import StepState  # noqa: PLC0415
    from lowtide.store.convert import resolved_from_doc  # noqa: PLC0415

    def compile_job(job_id: str) -> Any:
        detail = store.job_detail(job_id)
        spec = build_job_spec(detail.job.spec)
        resolved = {s.name: resolved_from_doc(s.resolved) for s in detail.steps}
        succeeded = {s.name for s in detail.steps if s.state == StepState.SUCCEEDED}
        generation = job_generation({s.name: s.retried_at for s in detail.steps}, succeeded)
        before: dict[str, int] = {}
        if generation:
            retried = {s.name: s.retried_at for s in detail.steps if s.retried_at is not None}
            for a in detail.attempts:
                at = retried.get(a.step_name)
                if at is not None and a.started_at < at:
                    before[a.step_name] = before.get(a.step_name, 0) + 1
        return compile_workflow(
            spec,
            job_id=job_id,
            settings=settings,
            resolved=resolved,
            generation=generation,
            succeeded=succeeded if generation else frozenset(),
            attempts_before=before,
        )

    return compile_job


def argo_settings(settings: Settings) -> Any:
    """The Workflow compiler's settings (`adapters.argo.workflow.ArgoSettings`) from the `argo:`
    section; the one place that reads it, for the executor and `lowtide argo render`. Raises
    ArgoCompileError when they cannot be used."""
    from lowtide.adapters.argo.workflow import ArgoSettings  # noqa: PLC0415 - cluster mode only

    argo = settings.argo
    return ArgoSettings(
        artifact_root=argo.artifact_root or settings.artifact_root or "",
        namespace=argo.namespace,
        service_account=argo.service_account,
        research_priority_class=argo.research_priority_class,
        grace_margin_seconds=argo.grace_margin_seconds,
        interrupted_exit_code=argo.interrupted_exit_code,
        shim_command=tuple(argo.shim_command),
        default_image=argo.default_image,
        api_url=argo.api_url,
        storage_secret=argo.storage_secret,
        secret_key=argo.secret_key,
        secret_env={name: secret.env for name, secret in settings.secrets.items()},
    )


def k8s_event_recorder(settings: Settings) -> Any:
    """The Kubernetes Event recorder (`adapters.k8s_events`; docs/cluster.md "Kubernetes Events")
    when `executor.kind` is argo or a service has `manager: kubernetes`, on its own API client
    (`argo.kubeconfig` with the Argo executor, else in-cluster credentials, else KUBECONFIG); None
    otherwise, or when that client cannot be made (the executor or manager then says why)."""
    kube = any(c.manager == "kubernetes" for c in settings.services)
    if settings.executor.kind != "argo" and not kube:
        return None
    from lowtide.adapters.k8s_events import EventRecorder  # noqa: PLC0415 - cluster mode only

    kubeconfig = settings.argo.kubeconfig if settings.executor.kind == "argo" else None
    try:
        return EventRecorder(kube_api_client(kubeconfig, setting="Kubernetes Events"))
    except ServeError:
        return None


def argo_pod_logs(settings: Settings) -> Any:
    """The log port in cluster mode (`adapters.argo.pod_logs.PodLogReader`; docs/cluster.md
    "Logs"): each attempt's log read from its pod through the Kubernetes API, on its own client
    from the executor's kubeconfig (`argo.kubeconfig`, else in-cluster credentials, else
    KUBECONFIG). Raises ConfigError naming the setting, as the executor does."""
    from lowtide.adapters.argo.pod_logs import PodLogReader  # noqa: PLC0415 - cluster mode only

    if settings.argo.kubeconfig is None:
        return PodLogReader(kube_api_client(setting="executor.kind: argo"))
    try:
        return PodLogReader(kube_api_client(settings.argo.kubeconfig, setting="argo.kubeconfig"))
    except ServeError as exc:
        raise ConfigError(str(exc)) from None


def build_argo_executor(
    settings: Settings, store: Store, nodes: Sequence[Node] | None = None, *, events: Any = None
) -> Executor:
    """`executor.kind: argo`: the Argo executor over the cluster's API (`argo.kubeconfig`, else
    in-cluster credentials, else KUBECONFIG), checking and lending the configured `nodes` (default:
    as declared in settings) as Kubernetes Nodes of those names. Raises ConfigError naming the setting."""
    from lowtide.adapters.argo.executor import ArgoExecutor  # noqa: PLC0415 - cluster mode only
    from lowtide.adapters.argo.workflow import ArgoCompileError  # noqa: PLC0415

    argo = settings.argo
    try:
        compile_settings = argo_settings(settings)
    except ArgoCompileError as exc:
        raise ConfigError(f"argo: {exc}") from None
    if argo.kubeconfig is None:
        api_client = kube_api_client(setting="executor.kind: argo")
    else:
        try:
            api_client = kube_api_client(argo.kubeconfig, setting="argo.kubeconfig")
        except ServeError as exc:
            raise ConfigError(str(exc)) from None
    return ArgoExecutor(
        api_client,
        compile_settings,
        argo_workflows(store, compile_settings),
        workflows_api=argo_workflows_api(settings),
        nodes=_declared_gpus(settings) if nodes is None else {n.name: len(n.gpus) for n in nodes},
        events=events,
    )


def _declared_gpus(settings: Settings) -> dict[str, int]:
    """Each configured node's declared GPU count, without NVML (``auto``: 0, nothing to compare
    with the Node's allocatable)."""
    return {
        n.name: n.gpus if isinstance(n.gpus, int) else 0 if n.gpus == "auto" else len(n.gpus)
        for n in settings.nodes
    }


def argo_workflows_api(settings: Settings) -> Any:
    """Where the Argo executor creates Workflows (`argo.submit_via`; docs/cluster.md "Submission
    paths"): None for the Kubernetes API (the executor's default), else argo-server's REST API
    with the bearer token read from `argo.server_token_file`. Raises ConfigError naming the field."""
    from lowtide.adapters.argo.workflow_store import ArgoServerWorkflows  # noqa: PLC0415 - cluster mode

    argo = settings.argo
    if argo.submit_via != "argo-server":
        return None
    if argo.server_url is None:  # config validation refuses this already
        raise ConfigError("argo.server_url: required with argo.submit_via: argo-server")
    token: str | None = None
    if argo.server_token_file is not None:
        try:
            token = Path(argo.server_token_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"argo.server_token_file: cannot read {argo.server_token_file}: {exc}"
            ) from None
        if not token:
            raise ConfigError(f"argo.server_token_file: {argo.server_token_file} is empty")
    return ArgoServerWorkflows(argo.server_url, token, argo.namespace, verify_tls=argo.server_verify_tls)


def kube_api_client(kubeconfig: str | None = None, *, setting: str = "services[].manager: kubernetes") -> Any:
    """`adapters.kube_client.kube_api_client`, with a start-up error that names the `setting`
    that needs the cluster."""
    from lowtide.adapters.kube_client import KubeConfigError  # noqa: PLC0415 - cluster mode only
    from lowtide.adapters.kube_client import kube_api_client as make_client  # noqa: PLC0415

    try:
        return make_client(kubeconfig)
    except KubeConfigError as exc:
        raise ServeError(
            f"{setting}: {exc}; run lowtide in a pod with a ServiceAccount, or set KUBECONFIG"
        ) from exc


def start_gateways(settings: Settings, gateway: GatewaySupervisor | None) -> GatewaySupervisor | None:
    """Adopt the running gateway process, or start it, and wait until it listens on every
    service's `gateway_port` (raises ServeError naming the service otherwise)."""
    if gateway is None:
        return None
    try:
        gateway.start()
    except GatewayError as exc:
        named = [c.name for c in settings.services if c.gateway_port is not None and repr(c.name) in str(exc)]
        where = f"services.{named[0]}.gateway_port" if named else "services[].gateway_port"
        raise ServeError(f"{where}: {exc}") from exc
    return gateway


def gateway_queue_timeout(cfg: ServiceConfig) -> float:
    """How long the gateway holds a request of `cfg` while it has no replica: the configured
    `gateway_queue_timeout`, else a cold start (`expected_startup`) plus a minute."""
    if cfg.gateway_queue_timeout is not None:
        return cfg.gateway_queue_timeout
    return cfg.expected_startup + 60.0


class _GracefulServer(uvicorn.Server):
    """uvicorn re-raises a SIGTERM/SIGINT it caught once it has shut down, which ends the process
    before lowtide's own shutdown (loop, executor, gateways, replicas) has run. Here a signal only
    asks the server to stop; `serve` then returns and finishes the shutdown itself."""

    #: Called once uvicorn has really started serving (nothing refused): `lowtide up`'s
    #: "listening on …" (issue 12: it was printed before a start that then failed).
    on_started: Callable[[], None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit and self.on_started is not None:
            self.on_started()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting for open connections
        else:
            self.should_exit = True


def stop_replicas(inference: InferenceController, clock: Clock, timeout_s: float = 60.0) -> None:
    """Stop every replica process gracefully and wait (bounded) until they are gone."""
    manager = inference.manager
    live = [r.id for r in inference.store.replicas() if manager.url(r.id) is not None]
    for rid in live:
        try:
            manager.park(rid, "stop", clock.now())
        except ValueError:
            continue
    deadline = time.monotonic() + timeout_s
    pending = set(live)
    while pending and time.monotonic() < deadline:
        for event in manager.poll(clock.now()):
            if event.kind in ("stopped", "failed"):
                pending.discard(event.replica_id)
        time.sleep(0.1)
    if pending:
        log.warning("replicas still stopping after %.0fs: %s", timeout_s, sorted(pending))


def keep_time_forward(lt: Embedded) -> None:
    """A restart after the wall clock went back: control time starts no earlier than the last
    time the store recorded (docs/architecture.md §4.3). Only for the process's `SystemClock`
    (tests that `build` with a store of made-up times keep their clocks)."""
    if isinstance(lt.clock, SystemClock):
        floor = lt.store.last_recorded_at()
        if floor is not None:
            lt.clock.not_before(floor)


def watch_clock(watch: ClockWatch | None, stop: threading.Event, every_s: float) -> None:
    """Check for wall-clock jumps every `every_s` until `stop` is set (a jump is logged once and
    counted; deadlines run on control time anyway, docs/architecture.md §4.3)."""
    if watch is None:
        return
    while not stop.wait(every_s):
        try:
            watch.check()
        except Exception:  # never let a clock reading end the thread
            log.exception("clock watch failed")


class ServeError(RuntimeError):
    """lowtide cannot start serving: the state dir is in use or the address is taken."""


def _lock_state_dir(state: Path) -> TextIO:
    """Hold an exclusive lock on the state dir for the life of this process: two control planes
    on one state would both adopt and drive the same steps."""
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    fh = (state / "lowtide.lock").open("a+", encoding="utf-8")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "unknown"
        fh.close()
        raise ServeError(f"another lowtide (pid {holder}) is running on {state}; stop it first") from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"{os.getpid()}\n")
    fh.flush()
    return fh


def _listen(host: str, port: int) -> socket.socket:
    """Bind the API socket before anything else starts, so a taken port fails fast and clearly."""
    try:
        return bind_tcp(host, port)
    except OSError as exc:
        raise ServeError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; set api.port (or pass --port)"
        ) from exc


#: The file in the state dir that holds its random id: with the host name, the *seat* of the
#: lease (`control.lease`): a lease held by an earlier process of the same seat is taken at once.
STATE_ID_FILE = "control.id"


def _state_id(state: Path) -> str:
    """The state dir's random id, made on first use (the caller holds the state dir's lock)."""
    path = state / STATE_ID_FILE
    try:
        value = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        value = ""
    if not value:
        value = secrets.token_hex(6)
        path.write_text(value + "\n", encoding="utf-8")
    return value


def leadership_for(
    settings: Settings, store: Store, clock: Clock, *, on_lost: Callable[[str], None] | None = None
) -> Leadership:
    """This process's candidacy for the store's lease (config `control:`, docs/architecture.md §4.4);
    with `control.lease_backend: kubernetes` behind a Kubernetes Lease (`on_lost`: it was lost)."""
    host = socket.gethostname() or "localhost"
    seat = seat_of(host, _state_id(Path(settings.state_dir)))
    pid = os.getpid()
    candidate = LeaseCandidate(holder_name(seat, pid, secrets.token_hex(3)), seat, host, pid)
    leases: LeasePort = store
    if settings.control.lease_backend == "kubernetes":
        leases = _kubernetes_leases(settings, store, clock, candidate.holder, on_lost)
    return Leadership(
        leases,
        candidate,
        LeaseTiming(settings.control.lease_ttl, settings.control.lease_renew),
        wall=clock.wall,
        monotonic=time.monotonic,
        # Argo's workflows are cluster-wide: a leader on another host adopts them at once.
        foreign_grace_s=0.0 if settings.executor.kind == "argo" else settings.control.foreign_takeover_grace,
    )


def _kubernetes_leases(
    settings: Settings, store: Store, clock: Clock, identity: str, on_lost: Callable[[str], None] | None
) -> LeasePort:
    """The store's lease behind the coordination.k8s.io Lease `control.kubernetes_lease` (client
    from the pod's ServiceAccount or KUBECONFIG): duration `lease_ttl` rounded up, renew deadline
    the leadership's acting deadline (80 % of the ttl), retried every `lease_renew`."""
    from lowtide.adapters import k8s_lease  # noqa: PLC0415 (the kubernetes client only in this mode)
    from lowtide.adapters.kube_client import default_namespace  # noqa: PLC0415

    control = settings.control
    try:
        api = k8s_lease.coordination_api()
        namespace = control.kubernetes_lease.namespace or default_namespace()
    except k8s_lease.KubeLeaseError as exc:
        raise ServeError(str(exc)) from exc
    elector = k8s_lease.KubeLeaseElector(
        api,
        namespace=namespace,
        name=control.kubernetes_lease.name,
        identity=identity,
        duration_s=math.ceil(control.lease_ttl),
        renew_deadline_s=control.lease_ttl * (1 - MARGIN_SHARE),
        request_timeout_s=control.lease_renew,
        on_lost=on_lost,
    )
    return k8s_lease.KubeGatedLeases(
        store, elector, monotonic=time.monotonic, wall=lambda: datetime.fromtimestamp(clock.wall(), UTC)
    )


def _lease_start_problem(leadership: Leadership) -> str | None:
    """A first claim the Kubernetes API refused for good (credentials, RBAC): `lowtide up` fails."""
    error = getattr(leadership.store, "last_error", None)
    if error is not None and getattr(error, "permanent", False):
        return f"control.lease_backend is kubernetes, but {error}"
    return None


class LeaseLost(ServeError):
    """`control.lease_backend: kubernetes` and this control plane lost the Lease: `lowtide up`
    stops (its loop first) and exits with code 1, so that its pod restarts as a fresh standby
    (docs/architecture.md §4.4)."""


class _ExitOnLoss:
    """Turns a lost Kubernetes Lease (from the lease thread) into the end of `serve`."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.server: uvicorn.Server | None = None

    def lost(self, reason: str) -> None:
        self.reason = reason
        if self.server is not None:
            self.server.should_exit = True


class _Roles:
    """What becoming the leader and stepping down do in `serve` (docs/architecture.md §4.4):
    elected: start (or adopt) the gateway, recover (re-adopt steps and replicas), start the loop;
    deposed: stop the loop and stop watching the processes, which keep running for the next
    leader to adopt (nothing is killed)."""

    def __init__(self, settings: Settings, lt: Embedded, *, announce: bool) -> None:
        self.settings = settings
        self.lt = lt
        self.announce = announce
        self.gateways: GatewaySupervisor | None = None
        self.shutting_down = False
        #: At start-up a gateway that cannot listen fails `lowtide up`; after a takeover it is
        #: logged and tried again at the next term, and steps are scheduled meanwhile.
        self.strict = True
        self.acted = False  # led at some point (a standby's shutdown has nothing to report)
        self._stop_loop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def elected(self, term: Term) -> None:
        lt = self.lt
        self.acted = True
        keep_time_forward(lt)  # before anything is timed or recorded in this term
        if self.gateways is None:
            try:
                self.gateways = start_gateways(self.settings, lt.gateway)
            except ServeError as exc:
                if self.strict:
                    raise
                log.error("as the new leader: %s; serving stays with the gateway that runs, if any", exc)
        report = lt.loop.recover()
        if self.announce:
            log.info(
                "recovered: %d adopted, %d finished while down, %d lost (requeued), %d orphans killed",
                len(report.adopted),
                len(report.exited),
                len(report.lost),
                len(report.orphans_killed),
            )
        self._stop_loop = threading.Event()
        self._thread = threading.Thread(
            target=lt.loop.run,
            args=(self._stop_loop, self.settings.tick_seconds),
            name="lowtide-loop",
            daemon=True,
        )
        self._thread.start()

    def deposed(self, term: Term, reason: str) -> None:
        if self._stop_loop is not None:
            self._stop_loop.set()
            self.lt.loop.wake()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._stop_loop, self._thread = None, None
        if self.shutting_down:
            return  # `Embedded.close` lets go of the processes
        self.lt.executor.close()  # stop watching; the next leader adopts them
        manager = self.lt.inference.manager if self.lt.inference is not None else None
        if isinstance(manager, ForgetsReplicas):
            manager.forget()
        if self.gateways is not None:  # it keeps serving on its last table; a leader adopts it
            self.gateways.close()
            self.gateways = None
        log.warning("stopped acting (%s); steps and replicas keep running for the next leader", reason)


def serve(
    settings: Settings,
    *,
    announce: bool = True,
    stop_replicas_on_exit: bool = False,
    on_listening: Callable[[Settings], None] | None = None,
) -> None:
    """Run the embedded control plane until SIGINT/SIGTERM; `on_listening(settings)` (with the
    real port) once the API really listens, after everything that could refuse the start.

    Steps, inference replicas and the gateway process keep running when it stops (the next start
    re-adopts them), so restarting the control plane interrupts neither research nor serving;
    `stop_replicas_on_exit` stops the gateway (after its drain) and the replicas instead (a
    laptop, a demo)."""
    exposed = auth_exposure_problem(settings)  # again: `lowtide up --host` bypasses validation
    if exposed:
        raise ConfigError(exposed)
    if not settings.auth.enabled and announce:
        log.warning(
            "auth is OFF (auth.enabled: false): every local process that can reach %s, steps "
            "included, acts as admin; turn it on for any shared machine",
            settings.api.url,
        )
    lock = _lock_state_dir(Path(settings.state_dir))
    sock = _listen(settings.api.host, settings.api.port)
    if settings.api.port == 0:  # an ephemeral port: steps and the CLI must learn the real one
        real = settings.api.model_copy(update={"port": sock.getsockname()[1]})
        settings = settings.model_copy(update={"api": real})
    try:
        lt = build(settings)
    except Exception:
        sock.close()
        lock.close()
        raise
    if settings.auth.enabled:
        source = settings.auth.admin_token_source
        created = ensure_admin_token(
            lt.store, settings.admin_token_path, lt.clock.now(), Path(source) if source else None
        )
        if created and announce:
            log.warning("created an admin token in %s (mode 0600)", settings.admin_token_path)
    # One active control plane (docs/architecture.md §4.4): act only while holding the lease.
    exit_on_loss = _ExitOnLoss()
    try:
        leadership = leadership_for(settings, lt.store, lt.clock, on_lost=exit_on_loss.lost)
    except ServeError:
        lt.close()
        sock.close()
        lock.close()
        raise
    lt.leadership = lt.loop.lease = leadership
    if lt.inference is not None:
        lt.inference.lease = leadership
    roles = _Roles(settings, lt, announce=announce)
    first = leadership.claim_once()
    problem = _lease_start_problem(leadership)
    if problem is not None:
        lt.close()
        sock.close()
        lock.close()
        raise ServeError(problem)
    if first is not None:
        try:
            roles.elected(first)  # a taken gateway port fails the start, as before
        except Exception:
            leadership.release()
            sock.close()
            lock.close()
            raise
    # else: a standby (logged by the leadership): it serves the API and takes over on expiry.
    roles.strict = False
    stop = threading.Event()
    lease_threads = [
        threading.Thread(target=leadership.run, args=(stop,), name="lowtide-lease", daemon=True),
        threading.Thread(
            target=leadership.supervise,
            args=(stop, roles.elected, roles.deposed),
            kwargs={"acting": first},
            name="lowtide-roles",
            daemon=True,
        ),
    ]
    for t in lease_threads:
        t.start()
    clock_thread = threading.Thread(
        target=watch_clock,
        args=(lt.clock_watch, stop, settings.tick_seconds),
        name="lowtide-clock-watch",
        daemon=True,
    )
    clock_thread.start()
    server = _GracefulServer(uvicorn.Config(lt.app, log_level="warning"))
    exit_on_loss.server = server
    if exit_on_loss.reason is not None:
        server.should_exit = True
    if on_listening is not None:
        listening = settings
        server.on_started = lambda: on_listening(listening)
    try:
        server.run(sockets=[sock])
    finally:
        roles.shutting_down = True
        stop.set()
        leadership.interrupt()
        for t in lease_threads:
            t.join(timeout=40)  # the roles thread stops the loop first
        gateways = roles.gateways
        running = len(lt.store.active_attempts())
        if running and announce and roles.acted:
            log.warning("%d step(s) keep running; the next `lowtide up` re-adopts them", running)
        if gateways is not None and stop_replicas_on_exit:
            gateways.stop()  # drains its requests in flight first, then the replicas stop
        elif gateways is not None and announce:
            log.info("the gateway (pid %s) keeps serving; the next `lowtide up` adopts it", gateways.pid())
        if lt.inference is not None and stop_replicas_on_exit:
            stop_replicas(lt.inference, lt.clock)
        leadership.release()  # after the loop stopped: a standby takes over at once
        lt.close()
        sock.close()
        lock.close()
    if exit_on_loss.reason is not None:
        raise LeaseLost(f"lost the Kubernetes Lease ({exit_on_loss.reason}); exiting to restart as a standby")
