"""lowtide's side of the gateway process: start, adopt, replace and restart it; write its routing
table; read its status. Implements the `Gateway` port (`control.inference_ports`) for the loop.

Why a process: the gateway used to run inside `lowtide up`, so every restart of the control plane
cut serving (issue 12). Now `gateway_process` runs under the step shim in a session of its own,
like replicas and step attempts, and outlives the control plane (a graceful stop or `kill -9`):
its listening sockets stay open and it keeps routing on the last table while lowtide is down.

Files (in ``<state_dir>/gateway``, mode 0700; `gateway_files` has the formats):
- ``routes.json``: the routing table, written here only, atomically and durably, with a
  generation that grows across restarts (the table is read back at start, so a restart begins
  from what the gateway already serves; services no longer configured are dropped);
- ``status-<nonce>.json``: each gateway process's status (one per process, so that a successor
  and the gateway it replaces never write the same file);
- ``gateway_shim.json``: the shim's pid and start time, its build and status file (for adoption);
  ``gateway.log``: the process's output; ``exit-<nonce>.json``: the shim's exit record.

**Identity and adoption** (`start`): the gateway is this installation's when the shim file's pid +
start time name a live shim of instance ``"<instance id>:gateway"`` (`supervision`); without a
valid shim file (lowtide died before writing it) the process table is searched for such a shim
whose command line names this state dir's routing table. One of the same **build** (lowtide's
version and a digest of the gateway's own source files) is adopted as it is. One of another build
is **replaced without dropping a connection**: the successor binds the same ports with
SO_REUSEPORT (socket(7), Linux ≥ 3.9: both sockets accept, the kernel spreads new connections),
and only once it reports every port listening is the old one sent SIGTERM, on which it stops
accepting and lets its requests in flight finish (`shutdown_grace_s`). Its in-flight counts are
still added in (`in_flight`) until it has exited, so no replica is parked under its requests.
(A connection that sits in the old socket's accept queue at the very moment it closes is reset by
Linux; uvicorn accepts as connections arrive, so the window is a few microseconds.) Nothing but
the code changing replaces a gateway: ports, timeouts and hold queues change through the table.
Before a gateway is started afresh its ports are checked with a plain bind (no SO_REUSEPORT), so a
port another program holds fails `lowtide up` at once, as it did in-process.

**While lowtide runs** a watcher thread reads the status every `POLL_S` (a stat(2) when nothing
changed): a rise of `held_total` (a request started waiting for a replica: scale-from-zero demand)
calls `on_held` (the loop's wake), so a held request causes a tick within about `POLL_S`. Every
`LIVENESS_S` it checks that the gateway still runs; a gateway that died is started again (at
most once per `RESTART_BACKOFF_S`), from the same table.

**What the loop reads** (`in_flight`, `held`, `upstream_failures`) comes from the last status.
Until the gateway has applied the latest table, a replica taken out of it counts as having at
least one request in flight (the gateway may still be sending it new ones): a drain never ends on
a count from before the gateway heard of the drain. With no gateway running, everything is 0 (its
connections died with it).

**Stopping.** `close` stops the watcher and leaves the gateway serving (a restart); `stop` (for
`lowtide up --stop-replicas-on-exit`) sends SIGTERM and waits for the drain, SIGKILL after it.

Must not: decide which replicas serve (the loop does), touch the store, or signal a process not
proven to be this installation's gateway shim.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import psutil

import lowtide
from lowtide.adapters.gateway import GatewayError
from lowtide.adapters.gateway_files import (
    ROUTES_FILE,
    GatewayStatus,
    RoutingTable,
    ServiceRoute,
    file_key,
    read_routes,
    read_status,
    write_atomic,
)
from lowtide.adapters.local_executor import TAG_ENV as STEP_TAG_ENV
from lowtide.adapters.net import bind_tcp
from lowtide.adapters.replica_processes import REPLICA_TAG_ENV
from lowtide.adapters.supervision import (
    ShimProcess,
    child_env,
    identify_child,
    iter_shims,
    live_shim_args,
    read_shim_file,
    reap_exited,
    record_shim,
    shim_argv,
    start_shim,
)
from lowtide.control.executor_port import ProcessIdentity

log = logging.getLogger(__name__)

PROCESS_MODULE = "lowtide.adapters.gateway_process"
SHIM_FILE = "gateway_shim.json"
LOG_FILE = "gateway.log"
SHIM_INSTANCE_SUFFIX = ":gateway"
SHIM_NUMBER = 0
#: How often the watcher reads the status (seconds).
POLL_S = 0.1
#: How often the watcher checks that the gateway still runs (seconds).
LIVENESS_S = 1.0
#: The least time between two starts of a gateway that keeps dying (seconds).
RESTART_BACKOFF_S = 2.0
#: How long `start` waits for a gateway to listen on every port (seconds).
READY_TIMEOUT_S = 30.0
#: Tags other adapters put in their processes' environments (their sweeps kill what carries
#: one); a gateway carries neither.
_FOREIGN_TAGS = (STEP_TAG_ENV, REPLICA_TAG_ENV)
# Gateway shims this process started and no supervisor watches any more, kept referenced so that
# a later `reap_exited` reaps them rather than leaving zombies (process-wide, as children are).
_DETACHED: list[subprocess.Popen[bytes]] = []
_GATEWAY_SOURCES = (
    "gateway.py",
    "gateway_app.py",
    "gateway_files.py",
    "gateway_pool.py",
    "gateway_process.py",
    "gateway_router.py",
    "gateway_upstream.py",
    "net.py",
)


def gateway_build() -> str:
    """lowtide's version and a digest of the gateway's code: a gateway of another build is replaced."""
    digest = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in _GATEWAY_SOURCES:
        with contextlib.suppress(OSError):
            digest.update((here / name).read_bytes())
    return f"{lowtide.__version__}+{digest.hexdigest()[:12]}"


@dataclass(frozen=True, slots=True)
class GatewayListen:
    """One service's gateway as configured."""

    service: str
    host: str
    port: int
    read_timeout_s: float | None = None
    hold_max: int = 0
    hold_timeout_s: float = 300.0


@dataclass(slots=True)
class _Gateway:
    proc: ShimProcess
    build: str
    status_path: Path
    status: GatewayStatus | None = None
    status_key: tuple[int, int, int] | None = None

    def refresh(self) -> None:
        key = file_key(self.status_path)
        if key != self.status_key:
            self.status_key = key
            self.status = read_status(self.status_path) if key is not None else None


class GatewaySupervisor:
    """The gateway process of one installation (see the module docstring); thread-safe."""

    def __init__(
        self,
        directory: Path,
        instance_id: str,
        listens: Sequence[GatewayListen],
        *,
        python: str = sys.executable,
        build: str | None = None,
        on_held: Callable[[], None] | None = None,
        shutdown_grace_s: float = 30.0,
    ) -> None:
        self.directory = Path(directory).absolute()
        self.instance_id = instance_id
        self.listens = {li.service: li for li in listens}
        self.python = python
        self.build = build if build is not None else gateway_build()
        self.on_held = on_held
        self.shutdown_grace_s = shutdown_grace_s
        self.routes_path = self.directory / ROUTES_FILE
        self._shim_instance = instance_id + SHIM_INSTANCE_SUFFIX
        self._lock = threading.RLock()
        self._table = self._initial_table()
        self._written = -1  # the generation last written to the file
        self._current: _Gateway | None = None
        self._retiring: list[_Gateway] = []
        self._held_seen = 0
        self._started_at = -float("inf")  # time.monotonic() of the last start
        self._reap_later: list[subprocess.Popen[bytes]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- start-up and shutdown -------------------------------------------------------------------

    def start(self) -> None:
        """Adopt the running gateway, replace one of another build, or start one; write the table;
        return once the gateway listens on every configured port. Raises GatewayError."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.directory.chmod(0o700)
        with self._lock:
            self._write_table()
            found, others = self._find()
            for other in others:
                self._retire(other, "a second gateway of this installation")
            if found is not None and found.build == self.build:
                log.info("gateway: adopted pid %d (build %s)", found.proc.identity.pid, found.build)
                self._current = found
            elif found is not None:
                self._replace(found)
            else:
                self._check_ports()
                self._spawn()
            try:
                self._wait_ready()
            except GatewayError:
                if self._current is not None and self._current is not found:
                    self._terminate(self._current, wait_s=5.0)
                self._current = None
                raise
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="lowtide-gateway-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop watching; the gateway keeps serving (the next start adopts it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with self._lock:
            gateways = [g for g in (self._current, *self._retiring) if g is not None]
            _DETACHED.extend(g.proc.popen for g in gateways if g.proc.popen is not None)
            _DETACHED.extend(self._reap_later)
            self._reap_later = []

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop the gateway: SIGTERM, wait for its drain (the shutdown grace + 10 s), then SIGKILL."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with self._lock:
            gateways = [g for g in (self._current, *self._retiring) if g is not None]
            self._current, self._retiring = None, []
        wait = self.shutdown_grace_s + 10.0 if timeout_s is None else timeout_s
        for gateway in gateways:
            self._terminate(gateway, wait_s=wait)

    def url(self, service: str) -> str | None:
        """The base URL clients use for `service` (the port the gateway bound, for port 0)."""
        listen = self.listens.get(service)
        if listen is None:
            return None
        status = self.status()
        bound = status.listening.get(service) if status is not None else None
        port = bound.port if bound is not None and bound.error is None else listen.port
        wildcard = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}  # noqa: S104
        host = wildcard.get(listen.host, listen.host)
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}"

    def pid(self) -> int | None:
        """The shim's pid of the gateway in use (it leads the gateway's process group)."""
        with self._lock:
            return None if self._current is None else self._current.proc.identity.pid

    # -- the Gateway port ------------------------------------------------------------------------

    def set_backends(self, service: str, backends: Mapping[str, str]) -> None:
        """The replicas that take new requests; the table is rewritten when they changed.
        Raises OSError when it cannot be written (the loop tries again next tick)."""
        live = {rid: url.rstrip("/") for rid, url in backends.items()}
        with self._lock:
            route = self._table.services.get(service)
            if route is None or dict(route.replicas) == live:
                return
            services = {**self._table.services, service: replace(route, replicas=live)}
            previous = self._table
            self._table = RoutingTable(previous.generation + 1, services, previous.shutdown_grace_s)
            try:
                self._write_table()
            except OSError:
                self._table = previous
                raise

    def in_flight(self, service: str, replica_id: str) -> int:
        with self._lock:
            count = 0
            for gateway in self._gateways():
                status = gateway.status
                if status is not None and (s := status.services.get(service)) is not None:
                    count += s.in_flight.get(replica_id, 0)
            current = self._current
            route = self._table.services.get(service)
            if current is not None and route is not None and replica_id not in route.replicas:
                status = current.status
                if status is None or status.applied_generation < self._written:
                    count = max(count, 1)  # the gateway may not have heard of the drain yet
            return count

    def upstream_failures(self, service: str, replica_id: str) -> int:
        with self._lock:
            status = self._current.status if self._current is not None else None
            s = status.services.get(service) if status is not None else None
            return s.failing.get(replica_id, 0) if s is not None else 0

    def held(self, service: str) -> int:
        with self._lock:
            status = self._current.status if self._current is not None else None
            s = status.services.get(service) if status is not None else None
            return s.held if s is not None else 0

    def status(self) -> GatewayStatus | None:
        """The last status of the gateway in use."""
        with self._lock:
            return self._current.status if self._current is not None else None

    # -- internals -------------------------------------------------------------------------------

    def _gateways(self) -> list[_Gateway]:
        return [g for g in (self._current, *self._retiring) if g is not None]

    def _initial_table(self) -> RoutingTable:
        """The configured services, with the replicas the last table routed to (a restart starts
        from what the gateway serves), at a generation above the last one."""
        old = read_routes(self.routes_path)
        services = {
            name: ServiceRoute(
                host=li.host,
                port=li.port,
                read_timeout_s=li.read_timeout_s,
                hold_max=li.hold_max,
                hold_timeout_s=li.hold_timeout_s,
                replicas=dict(old.services[name].replicas) if old and name in old.services else {},
            )
            for name, li in self.listens.items()
        }
        return RoutingTable((old.generation if old else 0) + 1, services, self.shutdown_grace_s)

    def _write_table(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomic(self.routes_path, self._table.to_json(), durable=True)
        self._written = self._table.generation

    def _find(self) -> tuple[_Gateway | None, list[_Gateway]]:
        """The gateway of this installation's state dir that is running (the one the shim file
        names first), and any other one found (a hand-over cut short)."""
        found: list[_Gateway] = []
        recorded = read_shim_file(self.directory / SHIM_FILE, {"instance": self.instance_id})
        if recorded is not None:
            identity, data = recorded
            if live_shim_args(identity) == (self._shim_instance, SHIM_NUMBER):
                with contextlib.suppress(KeyError, TypeError):
                    found.append(
                        _Gateway(
                            ShimProcess(identity, None, str(data["exit_file"])),
                            str(data["build"]),
                            Path(str(data["status"])),
                        )
                    )
        for proc, instance, number in iter_shims():
            if instance != self._shim_instance or number != SHIM_NUMBER:
                continue
            if any(g.proc.identity.pid == proc.pid for g in found):
                continue
            with contextlib.suppress(psutil.Error, ValueError, IndexError):
                args = proc.cmdline()
                if _option(args, "--routes") != str(self.routes_path):
                    continue
                identity = ProcessIdentity(pid=proc.pid, started_at=proc.create_time())
                found.append(
                    _Gateway(
                        ShimProcess(identity, None, _option(args, "--exit-file") or ""),
                        _option(args, "--build") or "",
                        Path(_option(args, "--status") or ""),
                    )
                )
        for gateway in found:
            gateway.refresh()
        return (found[0] if found else None), found[1:]

    def _replace(self, old: _Gateway) -> None:
        """Start a gateway of this build beside `old` (SO_REUSEPORT) and stop `old` once the new one
        listens; if the new one fails, keep `old` serving."""
        log.info("gateway: replacing pid %d (build %s -> %s)", old.proc.identity.pid, old.build, self.build)
        try:
            self._spawn()
            self._wait_ready()
        except GatewayError as exc:
            log.error("gateway: the replacement failed, keeping pid %d: %s", old.proc.identity.pid, exc)
            if self._current is not None:
                self._terminate(self._current, wait_s=5.0)
            self._current = old
            return
        self._retire(old, "replaced by a gateway of this build")

    def _check_ports(self) -> None:
        for li in self.listens.values():
            try:
                bind_tcp(li.host, li.port).close()
            except OSError as exc:
                raise GatewayError(
                    f"gateway for service {li.service!r} cannot listen on {li.host}:{li.port}: "
                    f"{exc.strerror or exc}"
                ) from exc

    def _spawn(self) -> None:
        nonce = secrets.token_hex(4)
        status_path = self.directory / f"status-{nonce}.json"
        exit_file = self.directory / f"exit-{nonce}.json"
        command = [
            self.python, "-m", PROCESS_MODULE,
            "--routes", str(self.routes_path),
            "--status", str(status_path),
            "--build", self.build,
        ]  # fmt: skip
        argv = shim_argv(self.python, self._shim_instance, SHIM_NUMBER, str(exit_file), command)
        env = child_env({}, ())
        for tag in _FOREIGN_TAGS:
            env.pop(tag, None)
        stamp = datetime.now(UTC).isoformat(timespec="seconds")
        header = f"=== lowtide {stamp}: gateway (build {self.build})\n"
        try:
            popen = start_shim(
                argv, cwd=self.directory, env=env, log_path=str(self.directory / LOG_FILE), header=header
            )
            identity = identify_child(popen, self._reap_later)
        except (OSError, psutil.Error) as exc:
            raise GatewayError(f"cannot start the gateway process: {exc}") from exc
        fields = {
            "instance": self.instance_id,
            "build": self.build,
            "status": str(status_path),
            "exit_file": str(exit_file),
        }
        record_shim(self.directory / SHIM_FILE, identity, fields, who="gateway")
        self._current = _Gateway(ShimProcess(identity, popen, str(exit_file)), self.build, status_path)
        self._started_at = time.monotonic()
        self._held_seen = 0
        log.info("gateway: started pid %d (build %s)", identity.pid, self.build)

    def _wait_ready(self) -> None:
        """Until the gateway in use has applied the table and listens on every port."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            gateway = self._current
            if gateway is None:
                raise GatewayError("no gateway process")
            gateway.refresh()
            status = gateway.status
            if status is not None and status.applied_generation >= self._written:
                errors = [li.error for li in status.listening.values() if li.error]
                if errors:
                    raise GatewayError("; ".join(errors))
                if all(name in status.listening for name in self.listens):
                    self._held_seen = status.held_total
                    return
            if not gateway.proc.alive():
                where = self.directory / LOG_FILE
                raise GatewayError(f"the gateway process exited at start; see {where}: {self._log_tail()}")
            if time.monotonic() > deadline:
                raise GatewayError(
                    f"the gateway did not listen within {READY_TIMEOUT_S:g}s: {self._log_tail()}"
                )
            time.sleep(0.02)

    def _log_tail(self) -> str:
        try:
            text = (self.directory / LOG_FILE).read_text(errors="replace")
        except OSError:
            return ""
        return text[-1500:].strip()

    def _retire(self, gateway: _Gateway, why: str) -> None:
        log.info("gateway: stopping pid %d gracefully (%s)", gateway.proc.identity.pid, why)
        try:
            gateway.proc.signal_group(signal.SIGTERM)
        except PermissionError as exc:
            log.warning("gateway: cannot stop pid %d: %s", gateway.proc.identity.pid, exc)
            return
        self._retiring.append(gateway)

    def _terminate(self, gateway: _Gateway, *, wait_s: float) -> None:
        with contextlib.suppress(PermissionError):
            gateway.proc.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + wait_s
        while gateway.proc.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if gateway.proc.alive():
            log.warning(
                "gateway: pid %d still running after %.0fs; killing it", gateway.proc.identity.pid, wait_s
            )
            with contextlib.suppress(PermissionError):
                gateway.proc.signal_group(signal.SIGKILL)
        self._forget(gateway)

    def _forget(self, gateway: _Gateway) -> None:
        if gateway.proc.popen is not None:
            self._reap_later.append(gateway.proc.popen)
        reap_exited(self._reap_later)
        reap_exited(_DETACHED)
        for leftover in (gateway.status_path, Path(gateway.proc.exit_file)):
            if leftover.name:
                with contextlib.suppress(OSError):
                    leftover.unlink()

    def _watch(self) -> None:
        last_liveness = time.monotonic()
        while not self._stop.wait(POLL_S):
            try:
                self._watch_once(check_liveness=time.monotonic() - last_liveness >= LIVENESS_S)
            except Exception:
                log.exception("gateway: watching the gateway process failed")
            if time.monotonic() - last_liveness >= LIVENESS_S:
                last_liveness = time.monotonic()

    def _watch_once(self, *, check_liveness: bool) -> None:
        wake = False
        with self._lock:
            for gateway in self._gateways():
                gateway.refresh()
            current = self._current
            if current is not None and current.status is not None:
                if current.status.held_total > self._held_seen:
                    wake = True
                self._held_seen = current.status.held_total
            if check_liveness:
                for gateway in list(self._retiring):
                    if not gateway.proc.alive():
                        self._retiring.remove(gateway)
                        self._forget(gateway)
                if current is not None and not current.proc.alive():
                    log.warning("gateway: pid %d is gone; starting a new one", current.proc.identity.pid)
                    self._forget(current)
                    self._current = None
                if self._current is None and time.monotonic() - self._started_at >= RESTART_BACKOFF_S:
                    try:
                        self._spawn()
                    except GatewayError as exc:
                        log.error("gateway: %s", exc)
        if wake and self.on_held is not None:
            self.on_held()


def _option(args: Sequence[str], name: str) -> str | None:
    """The value after `name` in a command line (None: absent)."""
    for i, arg in enumerate(args[:-1]):
        if arg == name:
            return args[i + 1]
    return None
