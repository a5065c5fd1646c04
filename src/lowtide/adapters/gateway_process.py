"""The gateway process: every service's gateway, outside the control plane, so that serving goes
on while lowtide restarts (issue 12; docs/architecture.md §4.4).

Run by `gateway_supervisor` under the step shim, in a session of its own, as
``python -m lowtide.adapters.gateway_process --routes ROUTES --status STATUS --build BUILD``.
One process serves every service's port (one `gateway.GatewayServer`: one event loop, one
upstream connection pool), because one process is one identity to adopt, one routing table to
apply and one status to read, and the services share nothing a separate process would protect.

What it does, in its main thread, every `POLL_S` (and at once when a request starts being held):
- **Routing.** When the routing table (`gateway_files.RoutingTable`, written atomically by lowtide)
  changed (inode, size, mtime), it is read and applied: a service not served yet starts listening
  (SO_REUSEPORT, so a successor can bind the same port during a hand-over), one whose address
  changed moves, one no longer in the table stops; settings (read timeout, hold queue) change in
  place; the live replicas are replaced (`GatewayRouter.set_backends`: a replica taken out keeps
  what it has in flight: that is the drain). A port that cannot be bound is reported in the status
  and tried again every `RETRY_BIND_S`. While lowtide is down the last table stays in force: routing
  and drains go on, and a request for a service with no live replica is held as usual.
- **Status.** When anything lowtide reads changed (the applied generation, listeners, requests held
  or in flight per replica, upstream failures in a row), the status document is rewritten
  (`gateway_files.GatewayStatus`): that is how lowtide sees drains finish, scale-from-zero demand
  and hung replicas.
- **Stop.** SIGTERM (or SIGINT): the status says `draining`, the listeners close, requests in flight
  get the table's `shutdown_grace_s`, the rest are cut (`GatewayServer.stop`), the status file is
  removed, exit 0. SIGKILL loses the requests in flight, nothing else: the next gateway starts
  from the same table.

Must not: decide which replicas serve (the table says), touch the store, or write anything but
its status file.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from lowtide.adapters.gateway import GatewayError, GatewayRouter, GatewayServer, GatewayTimeouts
from lowtide.adapters.gateway_files import (
    GatewayStatus,
    Listening,
    RoutingTable,
    ServiceStatus,
    file_key,
    read_routes,
    write_atomic,
)

log = logging.getLogger("lowtide.gateway")

#: How often the routing table is looked at (seconds): a stat(2), nothing more when unchanged.
POLL_S = 0.05
#: How often a port that could not be bound is tried again (seconds).
RETRY_BIND_S = 1.0


class GatewayRunner:
    """The gateway process's state: its server, the table applied and what was last reported."""

    def __init__(self, routes: Path, status: Path, build: str) -> None:
        self.routes = routes
        self.status_path = status
        self.build = build
        self.wake = threading.Event()
        self._held_lock = threading.Lock()
        self._held_total = 0
        self.router = GatewayRouter(on_held=self._on_held)
        self.server = GatewayServer(self.router, timeouts=GatewayTimeouts(shutdown_grace_s=30.0))
        self.table: RoutingTable | None = None
        self.applied = -1
        self.listening: dict[str, Listening] = {}  # as bound (port 0 in the table: the port chosen)
        self._asked: dict[str, tuple[str, int]] = {}  # (host, port) the table asked for, per service
        self.draining = False
        self._routes_key: tuple[int, int, int] | None = None
        self._retry_at: float | None = None
        self._reported: GatewayStatus | None = None

    def _on_held(self) -> None:  # from the event loop's thread
        with self._held_lock:
            self._held_total += 1
        self.wake.set()

    # -- the main loop ------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.step()
            self.wake.wait(POLL_S)
            self.wake.clear()
        self.shutdown()

    def step(self) -> None:
        """Apply a changed routing table (or retry a failed bind), then report."""
        key = file_key(self.routes)
        retry = self._retry_at is not None and time.monotonic() >= self._retry_at
        if key != self._routes_key or retry:
            self._routes_key = key
            table = read_routes(self.routes) if key is not None else None
            if table is not None:
                self.apply(table)
        self.report()

    def apply(self, table: RoutingTable) -> None:
        failed = False
        for name, route in table.services.items():
            self.router.set_backends(name, route.replicas)
            served = self.server.address(name) is not None
            if served and self._asked.get(name) != (route.host, route.port):
                log.info("gateway for %s moves to %s:%d", name, route.host, route.port)
                self.server.stop_service(name)
                served = False
            if served:
                self.server.configure(
                    name,
                    read_timeout_s=route.read_timeout_s,
                    hold_max=route.hold_max,
                    hold_timeout_s=route.hold_timeout_s,
                )
                continue
            try:
                bound = self.server.start(
                    name,
                    route.host,
                    route.port,
                    read_timeout_s=route.read_timeout_s,
                    hold_max=route.hold_max,
                    hold_timeout_s=route.hold_timeout_s,
                    reuse_port=True,
                )
            except GatewayError as exc:
                failed = True
                if self.listening.get(name) != Listening(route.host, route.port, str(exc)):
                    log.error("%s", exc)
                self.listening[name] = Listening(route.host, route.port, str(exc))
                continue
            self._asked[name] = (route.host, route.port)
            self.listening[name] = Listening(route.host, bound)  # port 0 in the table: the one chosen
        for name in set(self.server.served()) - set(table.services):
            log.info("gateway for %s stops: no longer in the routing table", name)
            self.server.stop_service(name)
            self.router.set_backends(name, {})
        for name in set(self.listening) - set(table.services):
            del self.listening[name]
            self._asked.pop(name, None)
        self.server.timeouts = GatewayTimeouts(shutdown_grace_s=table.shutdown_grace_s)
        self.table = table
        self.applied = table.generation
        self._retry_at = time.monotonic() + RETRY_BIND_S if failed else None

    def current_status(self) -> GatewayStatus:
        in_flight = self.router.in_flight_all()
        names = set(in_flight) | set(self.listening)
        services = {}
        for name in sorted(names):
            failing = {
                rid: n
                for rid in self.router.backends(name)
                if (n := self.router.upstream_failures(name, rid))
            }
            services[name] = ServiceStatus(
                held=self.router.held(name), in_flight=in_flight.get(name, {}), failing=failing
            )
        with self._held_lock:
            held_total = self._held_total
        return GatewayStatus(
            pid=os.getpid(),
            build=self.build,
            applied_generation=self.applied,
            listening=dict(self.listening),
            held_total=held_total,
            services=services,
            draining=self.draining,
        )

    def report(self, *, force: bool = False) -> None:
        status = self.current_status()
        if status == self._reported and not force:
            return
        try:
            write_atomic(self.status_path, status.to_json(), durable=False)
        except OSError as exc:
            log.warning("cannot write the gateway status %s: %s", self.status_path, exc)
            return
        self._reported = status

    def shutdown(self) -> None:
        self.draining = True
        self.report(force=True)
        self.server.stop()
        with contextlib.suppress(OSError):
            self.status_path.unlink()


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lowtide.adapters.gateway_process")
    parser.add_argument("--routes", required=True, type=Path)
    parser.add_argument("--status", required=True, type=Path)
    parser.add_argument("--build", required=True)
    return parser.parse_args(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    stop = threading.Event()
    runner = GatewayRunner(args.routes, args.status, args.build)

    def ask_stop(signum: int, _frame: FrameType | None) -> None:
        log.info("gateway: %s: draining and stopping", signal.Signals(signum).name)
        stop.set()
        runner.wake.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, ask_stop)
    log.info("gateway %s (pid %d) starts: routes %s", args.build, os.getpid(), args.routes)
    runner.run(stop)
    log.info("gateway stopped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
