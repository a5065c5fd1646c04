"""Scale from zero (issue 9 item 7): a request to a service without a live replica is held by the
gateway, counted as demand, and served once a replica is started or woken, instead of a 503.

- the gateway alone (real HTTP, a real backend): a held request is served when `set_backends`
  gives the service a replica; the queue bound answers 503 with `retry-after`; a request held past
  its timeout gets a 503 saying so; a client that leaves stops being held; `on_held` is called;
- a real `lowtide up` with the emulator as the replica (`min_replicas: 0`): the first request
  starts a replica and is served by it; once the idle replica is parked (sleep), the next request
  wakes it and is served.

Nothing here asserts a duration: tests wait for states with bounded polls.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from lowtide.adapters.gateway import GatewayRouter, GatewayServer, GatewayTimeouts
from lowtide.config import ConfigError, load_settings
from lowtide.wiring import gateway_queue_timeout
from reclaim_stack import consecutive_ports, free_ports, lowtide_up
from support import Served, wait_until

SERVICE = "chat"
CHAT = "/v1/chat/completions"


async def _answer(request: Request) -> JSONResponse:
    return JSONResponse({"id": (await request.json()).get("id"), "object": "chat.completion"})


@pytest.fixture
def backend() -> Iterator[str]:
    served = Served(Starlette(routes=[Route(CHAT, _answer, methods=["POST"])]))
    yield served.url
    served.close()


@contextlib.contextmanager
def gateway(
    hold_max: int, hold_timeout_s: float = 60.0, **router_args: Any
) -> Iterator[tuple[GatewayRouter, str]]:
    router = GatewayRouter(**router_args)
    server = GatewayServer(router, timeouts=GatewayTimeouts(shutdown_grace_s=1))
    port = server.start(SERVICE, hold_max=hold_max, hold_timeout_s=hold_timeout_s)
    try:
        yield router, f"http://127.0.0.1:{port}"
    finally:
        server.stop()


class Sent:
    """One request sent on a thread of its own (it may be held for a while)."""

    def __init__(self, url: str, ident: str, timeout: float = 60.0) -> None:
        self.response: httpx.Response | None = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.response = httpx.post(url + CHAT, json={"id": ident}, timeout=timeout)
            except BaseException as exc:
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def result(self) -> httpx.Response:
        self.thread.join(timeout=60)
        assert self.error is None, self.error
        assert self.response is not None
        return self.response


def held_gauge(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "lowtide_gateway_held":
            return sum(s.value for s in family.samples if s.labels.get("service") == SERVICE)
    raise AssertionError("no lowtide_gateway_held family")


def test_a_held_request_is_served_once_a_replica_goes_live(backend: str) -> None:
    woken: list[int] = []
    with gateway(hold_max=4, on_held=lambda: woken.append(1)) as (router, url):
        sent = Sent(url, "first")
        wait_until(lambda: router.held(SERVICE) == 1, what="the request to be held")
        assert woken == [1]  # the control loop is told at once
        assert held_gauge(url) == 1
        router.set_backends(SERVICE, {"chat/0": backend})
        r = sent.result()
        assert r.status_code == 200 and r.json()["id"] == "first"
        assert r.headers["x-lowtide-replica"] == "chat/0"
        assert router.held(SERVICE) == 0 and held_gauge(url) == 0


def test_over_the_queue_bound_a_request_gets_503_with_retry_after(backend: str) -> None:
    with gateway(hold_max=2) as (router, url):
        held = [Sent(url, "a"), Sent(url, "b")]
        wait_until(lambda: router.held(SERVICE) == 2, what="two requests to be held")
        r = httpx.post(url + CHAT, json={"id": "c"}, timeout=30)
        assert r.status_code == 503
        assert int(r.headers["retry-after"]) > 0
        error = r.json()["error"]
        assert error["type"] == "service_unavailable" and error["code"] == 503
        assert "gateway_queue" in error["message"] and "2 requests are already waiting" in error["message"]
        router.set_backends(SERVICE, {"chat/0": backend})
        assert sorted(s.result().json()["id"] for s in held) == ["a", "b"]


def test_a_request_held_past_its_timeout_gets_a_clear_503() -> None:
    with gateway(hold_max=2, hold_timeout_s=0.3) as (router, url):
        r = httpx.post(url + CHAT, json={"id": "late"}, timeout=30)
        assert r.status_code == 503
        assert int(r.headers["retry-after"]) > 0
        error = r.json()["error"]
        assert error["type"] == "service_unavailable"
        assert "no replica of 'chat' became ready within 0.3s" in error["message"]
        assert router.held(SERVICE) == 0


def test_a_client_that_leaves_is_no_longer_held(backend: str) -> None:
    with gateway(hold_max=4) as (router, url):
        sent = Sent(url, "gone", timeout=0.5)  # the client gives up while held
        sent.thread.join(timeout=30)
        assert isinstance(sent.error, httpx.ReadTimeout)
        wait_until(lambda: router.held(SERVICE) == 0, what="the held count to drop")
        router.set_backends(SERVICE, {"chat/0": backend})
        assert httpx.post(url + CHAT, json={"id": "next"}, timeout=30).status_code == 200


def test_with_holding_off_no_replica_is_still_503_at_once() -> None:
    with gateway(hold_max=0) as (router, url):
        r = httpx.post(url + CHAT, json={"id": "x"}, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert router.held(SERVICE) == 0


def test_queue_settings_and_their_defaults(tmp_path: Path) -> None:
    def service(extra: str) -> Any:
        path = tmp_path / "lowtide.yaml"
        path.write_text(f"services:\n  - name: chat\n    model: m\n{extra}")
        return load_settings(path).services[0]

    default = service("")
    assert default.gateway_queue == 256 and default.gateway_queue_timeout is None
    assert gateway_queue_timeout(default) == default.expected_startup + 60
    set_ = service("    gateway_queue: 8\n    gateway_queue_timeout: 2m\n")
    assert set_.gateway_queue == 8 and gateway_queue_timeout(set_) == 120
    for bad, field in (
        ("gateway_queue: -1", "gateway_queue"),
        ("gateway_queue_timeout: 0s", "gateway_queue_timeout"),
    ):
        with pytest.raises(ConfigError, match=field):
            service(f"    {bad}\n")


# -- a real `lowtide up` at zero replicas -------------------------------------------------------


def test_a_request_to_a_service_at_zero_replicas_is_served_after_a_start_and_later_a_wake(
    tmp_path: Path,
) -> None:
    api_port, gw_port = free_ports(2)
    base = consecutive_ports(1)
    config = {
        "state_dir": "state",
        "tick_seconds": 0.5,
        "nodes": [{"name": "n1", "gpus": 2}],
        "api": {"port": api_port},
        "auth": {"enabled": False},
        "services": [
            {
                "name": "chat",
                "model": "demo-8b",
                "gpus_per_replica": 2,
                "min_replicas": 0,
                "max_replicas": 1,
                "park": "sleep",
                "emulate": True,
                "emulator_args": ["--cold-start", "1", "--wake", "0.5", "--no-access-log"],
                "base_port": base,
                "gateway_port": gw_port,
                "gateway_queue": 8,
                "gateway_queue_timeout": "90s",
                "drain_timeout": "2s",
                "autoscale": {
                    "concurrency_per_replica": 4,
                    "kv_usage": None,
                    "scale_up_window": "1s",
                    "scale_down_stabilization": "2s",
                },
            }
        ],
    }
    with lowtide_up(tmp_path, config, replicas_serving=0) as st:

        def states() -> dict[str, str]:
            return {r["id"]: r["state"] for r in st.get("/v1/services")["services"][0]["replicas"]}

        assert states() == {}  # at zero: nothing started on its own
        body = {"model": "demo-8b", "prompt": "hi", "max_tokens": 2}
        first = httpx.post(f"{st.gateway}/v1/completions", json=body, timeout=90)
        assert first.status_code == 200, first.text
        assert first.headers["x-lowtide-replica"] == "chat/0"

        # Idle, the replica is parked (asleep) after the stabilisation window.
        wait_until(lambda: states().get("chat/0") == "PARKED", timeout=60, what="the idle replica to sleep")
        second = httpx.post(f"{st.gateway}/v1/completions", json=body, timeout=90)
        assert second.status_code == 200, second.text
        assert second.headers["x-lowtide-replica"] == "chat/0"
        kinds = [e["kind"] for e in st.get("/v1/services/chat")["events"] if e["replica_id"] == "chat/0"]
        assert kinds[:2] == ["starting", "serving"]  # the first request started it
        assert kinds[-3:] == ["parked", "waking", "serving"]  # the second one woke it
