"""The composition root: settings in, a running embedded lowtide out (store, executor, loop, API).

`build()` assembles the parts without starting anything (tests use it directly); `serve()` runs
recovery, the loop thread and the HTTP server until interrupted. Step processes keep running
when the control plane stops: the next start re-adopts them. Must not: hold policy or business
rules; it only connects parts.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TextIO

import uvicorn
from fastapi import FastAPI

from lowtide.adapters.container import resolve_runtime
from lowtide.adapters.exit_watch import ExitWatcher
from lowtide.adapters.gateway import GatewayRouter, GatewayServer
from lowtide.adapters.gpu_discovery import GpuDiscoveryError, discover_gpus
from lowtide.adapters.local_executor import LocalExecutor
from lowtide.adapters.local_services import LocalServiceManager
from lowtide.adapters.metrics_sources import PromQLSource, ScrapeSource
from lowtide.adapters.net import bind_tcp
from lowtide.adapters.storage import FsspecArtifacts
from lowtide.adapters.templates import DirectoryTemplates
from lowtide.api.app import ApiContext, create_app
from lowtide.api.metrics import LoopStatus
from lowtide.config import ConfigError, ServiceConfig, Settings, lending_policy, service_spec
from lowtide.control.clock import Clock, SystemClock
from lowtide.control.inference import InferenceController, ServiceSetup
from lowtide.control.inference_ports import MetricsSource
from lowtide.control.loop import ControlLoop, LoopSettings
from lowtide.domain.gpus import Node
from lowtide.domain.layout import ArtifactLayout
from lowtide.policy.accounting import AccountingPolicy
from lowtide.policy.fairshare import FairSharePolicy
from lowtide.policy.outcomes import RetryPolicy
from lowtide.policy.scheduler import SchedulerPolicy
from lowtide.store.repo import Store

log = logging.getLogger("lowtide")


def resolve_nodes(settings: Settings) -> tuple[Node, ...]:
    """Declared GPUs as given; ``auto`` through NVML (an error if NVML is unavailable)."""
    nodes = []
    for i, node in enumerate(settings.nodes):
        if node.gpus == "auto":
            try:
                found = discover_gpus()
            except GpuDiscoveryError as exc:
                raise ConfigError(f"nodes[{i}].gpus: 'auto' needs NVML: {exc}") from exc
            indices = tuple(g.index for g in found)
        elif isinstance(node.gpus, int):
            indices = tuple(range(node.gpus))
        else:
            indices = tuple(sorted(node.gpus))
        nodes.append(Node(node.name, indices))
    return tuple(nodes)


def ensure_admin_token(store: Store, path: Path, now: float) -> str | None:
    """Create an admin token on first start (or when its file is gone) and store it with mode 0600."""
    if path.exists():
        return None
    _, raw = store.create_token(name="admin", owner="admin", role="admin", now=now)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(raw + "\n")
    path.chmod(0o600)  # in case a umask or an existing ACL widened it
    return raw


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
    executor: LocalExecutor
    loop: ControlLoop
    app: FastAPI
    clock: Clock
    inference: InferenceController | None = None
    gateway: GatewayRouter | None = None
    watcher: ExitWatcher = field(default_factory=lambda: ExitWatcher(lambda: None))

    def close(self) -> None:
        """Stop watching processes and close the store. Steps and replicas keep running (the next
        start re-adopts them)."""
        if self.inference is not None:
            self.inference.manager.close()
        self.executor.close()
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
    store = Store.open(settings.database_url)
    runtime = None if settings.executor.runtime == "process" else resolve_runtime(settings.executor.runtime)
    # A process ending or a replica answering wakes the loop at once (bound once the loop exists).
    wake = _LateCall()
    watcher = ExitWatcher(wake)
    executor = LocalExecutor(store.instance_id(), runtime=runtime, watcher=watcher)
    layout = ArtifactLayout(artifact_root=settings.artifacts, work_root=settings.work_root)
    scheduler = SchedulerPolicy(
        fair_share=FairSharePolicy(
            half_life_s=settings.scheduler.fair_share_half_life,
            team_weights=dict(settings.scheduler.team_weights),
        ),
        max_reservations=settings.scheduler.max_reservations,
    )
    inference, router = build_inference(
        settings, nodes, store, store.instance_id(), watcher=watcher, on_progress=wake
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
            api_url=settings.api.url,
            storage_options=settings.artifact_options,
        ),
    )
    templates_dir = Path(settings.templates_dir)
    ctx = ApiContext(
        store=store,
        clock=clock,
        nodes=nodes,
        layout=layout,
        templates=DirectoryTemplates(templates_dir) if templates_dir.is_dir() else None,
        auth_enabled=settings.auth.enabled,
        container_runtime=runtime.engine if runtime else None,
        on_change=loop.wake,
        inference=inference,
        accounting=AccountingPolicy(
            settings.accounting.price_per_gpu_hour, settings.accounting.currency, settings.accounting_timezone
        ),
    )
    app = create_app(ctx)
    wake.target = loop.wake
    embedded = Embedded(settings, nodes, store, executor, loop, app, clock, inference, router, watcher)
    ctx.loop_status = embedded.loop_status
    return embedded


def replica_command(cfg: ServiceConfig) -> tuple[str, ...]:
    """The replica command template: configured, the emulator, or `vllm serve`."""
    if cfg.command:
        return tuple(cfg.command)
    if cfg.emulate:
        return (
            "{python}",
            "-m",
            "lowtide",
            "emulate",
            "vllm",
            "--port",
            "{port}",
            "--model",
            "{model}",
            "--gpus",
            "{gpus}",
            *cfg.emulator_args,
        )
    sleep = ("--enable-sleep-mode",) if cfg.park == "sleep" else ()
    return ("vllm", "serve", "{model}", "--port", "{port}", "--tensor-parallel-size", "{gpus}", *sleep)


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
) -> tuple[InferenceController | None, GatewayRouter | None]:
    """The inference side, when there is anything for it to do (services, or lending rules)."""
    if not settings.services and settings.lending.mode == "continuous":
        return None, None
    router = GatewayRouter() if any(s.gateway_port is not None for s in settings.services) else None
    setups = tuple(
        ServiceSetup(
            spec=service_spec(cfg),
            command=replica_command(cfg),
            base_port=cfg.base_port,
            env=dict(cfg.env),
            python=sys.executable,
            health_timeout_s=cfg.startup_timeout,
            drain_timeout_s=cfg.drain_timeout,
            reclaim_grace_s=cfg.reclaim_grace,
            work_root=str(Path(settings.state_dir) / "services"),
        )
        for cfg in settings.services
    )
    controller = InferenceController(
        store=store,
        manager=LocalServiceManager(instance_id, watcher=watcher, on_progress=on_progress),
        sources={cfg.name: metrics_source(cfg) for cfg in settings.services},
        gateway=router,
        services=setups,
        lending=lending_policy(settings),
        nodes=nodes,
    )
    return controller, router


def start_gateways(settings: Settings, router: GatewayRouter | None) -> GatewayServer | None:
    if router is None:
        return None
    server = GatewayServer(router)
    for cfg in settings.services:
        if cfg.gateway_port is not None:
            try:
                server.start(cfg.name, settings.api.host, cfg.gateway_port)
            except Exception as exc:
                server.stop()
                raise ServeError(f"services.{cfg.name}.gateway_port: {exc}") from exc
    return server


class _GracefulServer(uvicorn.Server):
    """uvicorn re-raises a SIGTERM/SIGINT it caught once it has shut down, which ends the process
    before lowtide's own shutdown (loop, executor, gateways, replicas) has run. Here a signal only
    asks the server to stop; `serve` then returns and finishes the shutdown itself."""

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


def serve(settings: Settings, *, announce: bool = True, stop_replicas_on_exit: bool = False) -> None:
    """Run the embedded control plane until SIGINT/SIGTERM.

    Steps and inference replicas keep running when it stops (the next start re-adopts them), so
    restarting the control plane interrupts neither research nor serving; `stop_replicas_on_exit`
    stops the replicas instead (a laptop, a demo)."""
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
        created = ensure_admin_token(lt.store, settings.admin_token_path, lt.clock.now())
        if created and announce:
            log.warning("created an admin token in %s (mode 0600)", settings.admin_token_path)
    try:
        gateways = start_gateways(settings, lt.gateway)
    except ServeError:
        sock.close()
        lock.close()
        raise
    report = lt.loop.recover()
    if announce:
        log.info(
            "recovered: %d adopted, %d finished while down, %d lost (requeued), %d orphans killed",
            len(report.adopted),
            len(report.exited),
            len(report.lost),
            len(report.orphans_killed),
        )
    stop = threading.Event()
    thread = threading.Thread(
        target=lt.loop.run, args=(stop, settings.tick_seconds), name="lowtide-loop", daemon=True
    )
    thread.start()
    server = _GracefulServer(uvicorn.Config(lt.app, log_level="warning"))
    try:
        server.run(sockets=[sock])
    finally:
        stop.set()
        lt.loop.wake()
        thread.join(timeout=30)
        running = len(lt.store.active_attempts())
        if running and announce:
            log.warning("%d step(s) keep running; the next `lowtide up` re-adopts them", running)
        if gateways is not None:
            gateways.stop()
        if lt.inference is not None and stop_replicas_on_exit:
            stop_replicas(lt.inference, lt.clock)
        lt.close()
        sock.close()
        lock.close()
