"""The gateway as its own process (issue 12): `adapters.gateway_supervisor` starts it under the
step shim, writes its routing table, reads its status, adopts it after a restart of the control
plane, restarts it when it dies and replaces one of another build without failing a request.

Backends are small Starlette apps on free ports (tests/support.py `Served`); the gateway is the
real `gateway_process` in a process of its own; clients are httpx. "lowtide down" is a supervisor
that was closed (its watcher stopped, nothing else): the gateway process is on its own then.
Nothing asserts a duration; every wait is a bounded poll; every process is stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from lowtide.adapters.gateway import GatewayError
from lowtide.adapters.gateway_files import read_routes
from lowtide.adapters.gateway_supervisor import GatewayListen, GatewaySupervisor
from lowtide.adapters.supervision import same_process
from lowtide.control.executor_port import ProcessIdentity
from reclaim_stack import free_ports
from support import GatewayLoad, Served, wait_until

SERVICE = "chat"


class Backend:
    """A replica stand-in: `/v1/x` answers with its name; `/v1/slow` waits for `gate`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.gate = threading.Event()

        async def fast(_request: Request) -> JSONResponse:
            return JSONResponse({"backend": name})

        async def slow(_request: Request) -> JSONResponse:
            await asyncio.to_thread(self.gate.wait, 60)
            return JSONResponse({"backend": name, "slow": True})

        app = Starlette(
            routes=[Route("/v1/x", fast, methods=["POST"]), Route("/v1/slow", slow, methods=["POST"])]
        )
        self.served = Served(app)
        self.url = self.served.url

    def close(self) -> None:
        self.gate.set()
        self.served.close()


@pytest.fixture
def backends() -> Iterator[tuple[Backend, Backend]]:
    a, b = Backend("a"), Backend("b")
    yield a, b
    a.close()
    b.close()


class Gateways:
    """Supervisors over one state dir (each is one "lowtide" in turn); every gateway process they
    started is stopped at the end."""

    def __init__(self, root: Path) -> None:
        self.directory = root / "state" / "gateway"
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.made: list[GatewaySupervisor] = []

    def supervisor(
        self, *, build: str = "test-1", hold_max: int = 0, on_held: Callable[[], None] | None = None
    ) -> GatewaySupervisor:
        listen = GatewayListen(SERVICE, "127.0.0.1", self.port, hold_max=hold_max, hold_timeout_s=60)
        sup = GatewaySupervisor(
            self.directory, "inst", [listen], build=build, shutdown_grace_s=2, on_held=on_held
        )
        self.made.append(sup)
        return sup

    def stop_all(self) -> None:
        for sup in self.made:
            sup.stop(timeout_s=10)
        # Anything still running under this dir (a test failed half-way): the last supervisor finds it.
        last = GatewaySupervisor(self.directory, "inst", [], build="cleanup")
        found, others = last._find()
        for gateway in [g for g in (found, *others) if g is not None]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(gateway.proc.identity.pid, signal.SIGKILL)


@pytest.fixture
def gateways(tmp_path: Path) -> Iterator[Gateways]:
    g = Gateways(tmp_path)
    yield g
    g.stop_all()


def served_by(url: str, path: str = "/v1/x") -> str:
    r = httpx.post(url + path, json={}, timeout=30)
    assert r.status_code == 200, r.text
    return str(r.headers["x-lowtide-replica"])


def routed_to(url: str) -> str | None:
    """The replica that served a request, or None when none did (yet): the gateway applies a new
    table within its poll interval, so a wait starts before it."""
    try:
        r = httpx.post(url + "/v1/x", json={}, timeout=30)
    except httpx.HTTPError:  # no gateway listening (yet)
        return None
    return str(r.headers["x-lowtide-replica"]) if r.status_code == 200 else None


def routing_to(gateways: Gateways, url: str) -> GatewaySupervisor:
    """A started supervisor whose gateway routes every request to `url` (as chat/0)."""
    sup = gateways.supervisor()
    sup.start()
    sup.set_backends(SERVICE, {"chat/0": url})
    wait_until(lambda: routed_to(gateways.url) == "chat/0", what="routing to chat/0")
    return sup


def test_the_routing_table_is_written_atomically_private_and_only_when_it_changes(
    gateways: Gateways, backends: tuple[Backend, Backend]
) -> None:
    a, _ = backends
    sup = gateways.supervisor()
    sup.start()
    routes = gateways.directory / "routes.json"
    assert stat.S_IMODE(routes.stat().st_mode) == 0o600
    assert stat.S_IMODE(gateways.directory.stat().st_mode) == 0o700
    first = read_routes(routes)
    assert first is not None and dict(first.services[SERVICE].replicas) == {}
    sup.set_backends(SERVICE, {"chat/0": a.url + "/"})
    table = read_routes(routes)
    assert table is not None and table.generation == first.generation + 1
    assert dict(table.services[SERVICE].replicas) == {"chat/0": a.url}
    inode = routes.stat().st_ino
    sup.set_backends(SERVICE, {"chat/0": a.url})  # the same replicas: nothing written
    assert routes.stat().st_ino == inode
    assert not [p for p in gateways.directory.iterdir() if p.name.endswith(".tmp")]
    sup.set_backends("other", {"other/0": a.url})  # a service without a gateway port: ignored
    wait_until(lambda: routed_to(gateways.url) == "chat/0", what="routing to chat/0")


def test_the_gateway_outlives_lowtide_is_adopted_and_applies_a_drain_while_lowtide_is_down(
    gateways: Gateways, backends: tuple[Backend, Backend]
) -> None:
    a, b = backends
    sup = routing_to(gateways, a.url)
    pid = sup.pid()
    slow: dict[str, httpx.Response | Exception] = {}

    def slow_request() -> None:
        try:
            slow["r"] = httpx.post(gateways.url + "/v1/slow", json={}, timeout=60)
        except Exception as exc:  # shown by the assertion below
            slow["r"] = exc

    request = threading.Thread(target=slow_request, daemon=True)
    request.start()
    wait_until(lambda: sup.in_flight(SERVICE, "chat/0") == 1, what="the slow request in flight")
    # Drain chat/0 (chat/1 takes the new requests); then lowtide goes away.
    sup.set_backends(SERVICE, {"chat/1": b.url})
    assert sup.in_flight(SERVICE, "chat/0") >= 1  # never 0 while its request runs
    sup.close()
    # lowtide is down: the gateway routes on the last table and the drain goes on.
    wait_until(lambda: routed_to(gateways.url) == "chat/1", what="the new table applied")
    assert {served_by(gateways.url) for _ in range(5)} == {"chat/1"}
    a.gate.set()
    request.join(timeout=60)
    answer = slow.get("r")
    assert isinstance(answer, httpx.Response), f"the drained request got no answer: {answer!r}"
    assert answer.status_code == 200 and answer.json() == {"backend": "a", "slow": True}
    # The next lowtide adopts the same process and sees the drain finished.
    again = gateways.supervisor()
    again.start()
    assert again.pid() == pid
    wait_until(lambda: again.in_flight(SERVICE, "chat/0") == 0, what="chat/0 drained")
    table = read_routes(gateways.directory / "routes.json")
    assert table is not None and dict(table.services[SERVICE].replicas) == {"chat/1": b.url}
    assert served_by(gateways.url) == "chat/1"


def test_a_killed_gateway_is_restarted_while_lowtide_runs_and_routing_resumes(
    gateways: Gateways, backends: tuple[Backend, Backend]
) -> None:
    a, _ = backends
    sup = routing_to(gateways, a.url)
    old = sup.pid()
    assert old is not None
    os.killpg(old, signal.SIGKILL)
    wait_until(lambda: sup.pid() not in (None, old), timeout=30, what="a new gateway process")
    wait_until(lambda: routed_to(gateways.url) == "chat/0", timeout=30, what="routing to resume")


def test_a_dead_gateway_is_started_on_the_next_start(
    gateways: Gateways, backends: tuple[Backend, Backend]
) -> None:
    a, _ = backends
    sup = gateways.supervisor()
    sup.start()
    sup.set_backends(SERVICE, {"chat/0": a.url})
    old = sup.pid()
    assert old is not None
    sup.close()
    shim = json.loads((gateways.directory / "gateway_shim.json").read_text())
    os.killpg(old, signal.SIGKILL)
    identity = ProcessIdentity(old, float(shim["started_at"]))
    wait_until(lambda: same_process(identity) is None or not _alive(old), what="the gateway to die")
    again = gateways.supervisor()
    again.start()
    assert again.pid() not in (None, old)
    assert served_by(gateways.url) == "chat/0"  # the table survived: routing is back at once


def test_a_gateway_of_another_build_is_replaced_without_failing_a_request(
    gateways: Gateways, backends: tuple[Backend, Backend]
) -> None:
    a, _ = backends
    first = gateways.supervisor(build="old")
    first.start()
    first.set_backends(SERVICE, {"chat/0": a.url})
    wait_until(lambda: routed_to(gateways.url) == "chat/0", what="routing")
    old = first.pid()
    first.close()
    load = GatewayLoad(gateways.url + "/v1/x")
    wait_until(lambda: load.ok >= 20, what="load to flow")
    second = gateways.supervisor(build="new")
    second.start()
    assert second.pid() != old
    status = second.status()
    assert status is not None and status.build == "new"
    ok_then = load.ok
    wait_until(lambda: load.ok >= ok_then + 50, what="more requests after the hand-over")
    load.stop()
    assert load.failed == [], load.failed[:5]
    assert old is not None
    wait_until(lambda: not _alive(old), timeout=30, what="the old gateway to exit")


def test_a_held_request_wakes_lowtide_and_is_served_once_a_replica_is_routed(
    gateways: Gateways, backends: tuple[Backend, Backend]
) -> None:
    a, _ = backends
    woken = threading.Event()
    sup = gateways.supervisor(hold_max=4, on_held=woken.set)
    sup.start()
    result: dict[str, httpx.Response] = {}
    sender = threading.Thread(
        target=lambda: result.update(r=httpx.post(gateways.url + "/v1/x", json={}, timeout=60)), daemon=True
    )
    sender.start()
    assert woken.wait(10), "the held request did not wake lowtide"
    assert sup.held(SERVICE) == 1
    sup.set_backends(SERVICE, {"chat/0": a.url})
    sender.join(timeout=30)
    assert result["r"].status_code == 200 and result["r"].headers["x-lowtide-replica"] == "chat/0"
    wait_until(lambda: sup.held(SERVICE) == 0, what="the held count to drop")


def test_a_port_taken_by_another_program_fails_the_start_and_leaves_no_gateway(gateways: Gateways) -> None:
    import socket  # noqa: PLC0415

    with socket.socket() as other:
        other.bind(("127.0.0.1", gateways.port))
        other.listen()
        sup = gateways.supervisor()
        with pytest.raises(GatewayError, match=f"'chat' cannot listen on 127.0.0.1:{gateways.port}"):
            sup.start()
        assert sup.pid() is None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"
    return False
