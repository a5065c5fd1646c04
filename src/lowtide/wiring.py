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
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from fastapi import FastAPI

from lowtide.adapters.container import resolve_runtime
from lowtide.adapters.gpu_discovery import GpuDiscoveryError, discover_gpus
from lowtide.adapters.local_executor import LocalExecutor
from lowtide.adapters.storage import FsspecArtifacts
from lowtide.adapters.templates import DirectoryTemplates
from lowtide.api.app import ApiContext, create_app
from lowtide.api.metrics import LoopStatus
from lowtide.config import ConfigError, Settings
from lowtide.control.clock import Clock, SystemClock
from lowtide.control.loop import ControlLoop, LoopSettings
from lowtide.domain.gpus import Node
from lowtide.domain.layout import ArtifactLayout
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


@dataclass
class Embedded:
    settings: Settings
    nodes: tuple[Node, ...]
    store: Store
    executor: LocalExecutor
    loop: ControlLoop
    app: FastAPI
    clock: Clock

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
    executor = LocalExecutor(store.instance_id(), runtime=runtime)
    layout = ArtifactLayout(artifact_root=settings.artifacts, work_root=settings.work_root)
    scheduler = SchedulerPolicy(
        fair_share=FairSharePolicy(
            half_life_s=settings.scheduler.fair_share_half_life,
            team_weights=dict(settings.scheduler.team_weights),
        ),
        max_reservations=settings.scheduler.max_reservations,
    )
    loop = ControlLoop(
        store=store,
        executor=executor,
        artifacts=artifacts,
        clock=clock,
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
    )
    app = create_app(ctx)
    embedded = Embedded(settings, nodes, store, executor, loop, app, clock)
    ctx.loop_status = embedded.loop_status
    return embedded


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
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio turns Nagle off (TCP_NODELAY) only on sockets that do, and
    # with Nagle on every small response waits for a delayed ACK (~40 ms per request).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServeError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; set api.port (or pass --port)"
        ) from exc
    return sock


def serve(settings: Settings, *, announce: bool = True) -> None:
    """Run the embedded control plane until SIGINT/SIGTERM."""
    import uvicorn  # noqa: PLC0415 (only the server needs it)

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
    server = uvicorn.Server(uvicorn.Config(lt.app, log_level="warning"))
    try:
        server.run(sockets=[sock])
    finally:
        stop.set()
        lt.loop.wake()
        thread.join(timeout=30)
        running = len(lt.store.active_attempts())
        if running and announce:
            log.warning("%d step(s) keep running; the next `lowtide up` re-adopts them", running)
        lt.executor.close()
        lt.store.close()
        sock.close()
        lock.close()
