"""lowtide against a faithful stand-in for vLLM: the emulator run as a real process, started by
lowtide's own default command and environment (`wiring.replica_command`, `wiring.replica_env`).

- `park: sleep` really sleeps and wakes: lowtide sets VLLM_SERVER_DEV_MODE=1, without which the
  stand-in (like vLLM) answers 404 on /sleep and lowtide stops the replica instead, saying why;
- the default command binds the replica to loopback: it is not reachable on this machine's other
  addresses (the gateway is the only way in);
- a SIGSTOPped replica (vLLM hung: no answer at all, while a real one may still answer /health)
  leaves routing within the hung bound and is replaced, in a real `lowtide up`;
- scale-down keeps a replica in routing until its replacement serves (the real control loop on a
  fake clock, with a service manager whose replacement takes its time).

Nothing here asserts a duration: tests wait for states with bounded polls.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from lowtide.adapters.local_services import LocalServiceManager, Phase
from lowtide.config import ConfigError, ServiceConfig, load_settings, service_spec
from lowtide.control.clock import FakeClock
from lowtide.control.inference import ServiceSetup
from lowtide.control.inference_ports import ReplicaEvent, ReplicaLaunch
from lowtide.domain.gpus import Node
from lowtide.domain.layout import ArtifactLayout
from lowtide.domain.services import AutoscaleTargets, LendingPolicy, ServiceSpec
from lowtide.sim.harness import LoopHarness
from lowtide.sim.scripted import FakeMetrics, FakeServiceManager
from lowtide.store.repo import Store
from lowtide.wiring import REPLICA_HOST, replica_command, replica_env
from reclaim_stack import consecutive_ports, free_ports, lowtide_up
from support import wait_until

# -- one replica through the local service manager ------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Replica:
    manager: LocalServiceManager
    launch: ReplicaLaunch
    events: list[ReplicaEvent] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.launch.port}"

    def next_event(self, timeout: float = 30.0) -> ReplicaEvent:
        seen = len(self.events)

        def arrived() -> bool:
            self.events.extend(self.manager.poll(time.time()))
            return len(self.events) > seen

        wait_until(arrived, timeout=timeout, what=f"an event of {self.launch.replica_id}")
        return self.events[seen]


def launch_for(cfg: ServiceConfig, root: Path) -> ReplicaLaunch:
    """What the controller launches for slot 0 of `cfg` (its command and environment)."""
    setup = ServiceSetup(
        spec=service_spec(cfg),
        command=replica_command(cfg),
        base_port=cfg.base_port,
        env=replica_env(cfg),
        python=sys.executable,
    )
    work = root / "chat-0"
    return ReplicaLaunch(
        replica_id="chat/0",
        service="chat",
        model=cfg.model,
        node="local",
        gpus=(0,),
        port=setup.port(0),
        command=setup.render(0, (0,)),
        env={**setup.env, "CUDA_VISIBLE_DEVICES": "0"},
        work_dir=str(work),
        log_path=str(work / "replica.log"),
        health_timeout_s=60.0,
        sleep_level=setup.spec.sleep_level,
    )


@pytest.fixture
def replicas(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Replica]]:
    """Replicas a test starts; each is stopped (SIGKILL) at the end."""
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)  # only what lowtide sets counts
    started: list[Replica] = []
    yield started
    for rep in started:
        rid = rep.launch.replica_id
        with contextlib.suppress(ValueError):
            rep.manager.kill(rid, time.time(), "test over")
        with contextlib.suppress(AssertionError):
            wait_until(
                lambda rep=rep, rid=rid: (
                    rep.manager.poll(time.time()) is not None
                    and rep.manager.phase(rid) in (Phase.FAILED, Phase.STOPPED)
                ),
                timeout=20,
                what="the replica to end",
            )
        rep.manager.close()


def start(cfg: ServiceConfig, root: Path, replicas: list[Replica]) -> Replica:
    manager = LocalServiceManager(f"t{free_port()}", health_interval_s=0.05, http_timeout_s=2.0)
    rep = Replica(manager, launch_for(cfg, root))
    replicas.append(rep)
    manager.start(rep.launch, time.time())
    event = rep.next_event()
    assert event.kind == "healthy", (event, Path(rep.launch.log_path).read_text()[-2000:])
    return rep


def emulated(park: str, **extra: Any) -> ServiceConfig:
    return ServiceConfig(
        name="chat",
        model="demo-8b",
        park=park,  # type: ignore[arg-type]
        emulate=True,
        emulator_args=["--cold-start", "0.5", "--wake", "0.2", "--no-access-log"],
        base_port=free_port(),
        **extra,
    )


def test_the_default_commands_bind_loopback_and_sleep_mode_gets_dev_mode() -> None:
    real = ServiceConfig(name="chat", model="m", park="sleep")
    command = replica_command(real)
    assert command[:3] == ("vllm", "serve", "{model}")
    assert command[command.index("--host") + 1] == REPLICA_HOST == "127.0.0.1"
    assert "--enable-sleep-mode" in command
    assert replica_env(real) == {"VLLM_SERVER_DEV_MODE": "1"}
    stop = ServiceConfig(name="chat", model="m", park="stop")
    assert "--enable-sleep-mode" not in replica_command(stop) and replica_env(stop) == {}
    # The operator's own environment wins (e.g. to turn dev mode off).
    assert replica_env(real.model_copy(update={"env": {"VLLM_SERVER_DEV_MODE": "0", "X": "1"}})) == {
        "VLLM_SERVER_DEV_MODE": "0",
        "X": "1",
    }
    emu = replica_command(emulated("sleep"))
    assert emu[emu.index("--host") + 1] == "127.0.0.1"


def test_hung_after_and_gateway_read_timeout_settings(tmp_path: Path) -> None:
    cfg = tmp_path / "lowtide.yaml"

    def service(extra: str) -> ServiceConfig:
        cfg.write_text(f"services: [{{name: chat, model: m{extra}}}]\n")
        return load_settings(cfg).services[0]

    default = service("")
    assert (default.hung_after, default.gateway_read_timeout) == (30.0, 600.0)
    tuned = service(", hung_after: 2m, gateway_read_timeout: 90s")
    assert (tuned.hung_after, tuned.gateway_read_timeout) == (120.0, 90.0)
    assert service(", hung_after: null").hung_after is None  # never
    for bad, key, why in (
        (", hung_after: 0s", "hung_after", "must be a positive duration"),
        (", gateway_read_timeout: 0", "gateway_read_timeout", "must be a positive duration"),
        (", gateway_read_timeout: -1", "gateway_read_timeout", "cannot be negative"),
    ):
        with pytest.raises(ConfigError) as err:
            service(bad)
        assert f"services[0].{key}: " in str(err.value) and why in str(err.value)


def test_park_sleep_really_sleeps_and_wakes(tmp_path: Path, replicas: list[Replica]) -> None:
    rep = start(emulated("sleep"), tmp_path, replicas)
    env = psutil.Process(_emulator_pid(rep)).environ()
    assert env.get("VLLM_SERVER_DEV_MODE") == "1"  # set by lowtide, not by the test

    rep.manager.park("chat/0", "sleep", time.time())
    asleep = rep.next_event()
    assert asleep.kind == "asleep", asleep
    assert httpx.get(f"{rep.url}/is_sleeping", timeout=5).json() == {"is_sleeping": True}
    assert rep.manager.phase("chat/0") == Phase.ASLEEP
    metrics = httpx.get(f"{rep.url}/metrics", timeout=5).text
    assert 'sleep_state="weights_offloaded"} 1.0' in metrics  # confirmed by engine_sleep_state too

    rep.manager.unpark("chat/0", time.time())
    woken = rep.next_event()
    assert woken.kind == "healthy", woken
    assert httpx.get(f"{rep.url}/is_sleeping", timeout=5).json() == {"is_sleeping": False}
    done = httpx.post(f"{rep.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert done.status_code == 200


def test_without_dev_mode_sleep_is_a_404_and_lowtide_stops_the_replica_saying_why(
    tmp_path: Path, replicas: list[Replica], caplog: pytest.LogCaptureFixture
) -> None:
    cfg = emulated("sleep", env={"VLLM_SERVER_DEV_MODE": "0"})
    rep = start(cfg, tmp_path, replicas)
    assert httpx.post(f"{rep.url}/sleep", timeout=5).status_code == 404  # as vLLM without dev mode
    with caplog.at_level(logging.WARNING, logger="lowtide.adapters.local_services"):
        rep.manager.park("chat/0", "sleep", time.time())
        stopped = rep.next_event()
    assert stopped.kind == "stopped"
    assert "HTTP 404" in stopped.detail and "VLLM_SERVER_DEV_MODE=1" in stopped.detail
    assert any(
        "VLLM_SERVER_DEV_MODE" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
    )


def other_addresses() -> list[str]:
    """This machine's IPv4 addresses outside 127.0.0.0/8."""
    out = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                out.append(a.address)
    return out


def test_a_replica_started_with_the_default_command_is_not_reachable_on_other_addresses(
    tmp_path: Path, replicas: list[Replica]
) -> None:
    rep = start(emulated("stop"), tmp_path, replicas)
    port = rep.launch.port
    listening = [
        c.laddr
        for c in psutil.Process(_emulator_pid(rep)).net_connections(kind="inet")
        if c.status == "LISTEN"
    ]
    assert listening and {a.ip for a in listening} == {"127.0.0.1"}
    assert httpx.get(f"{rep.url}/health", timeout=5).status_code == 200
    addresses = other_addresses()
    if not addresses:
        return  # no other address on this machine: the bound address above is the whole check
    for address in addresses:
        with socket.socket() as s:
            s.settimeout(5)
            assert s.connect_ex((address, port)) != 0, f"the replica answers on {address}:{port}"


def _emulator_pid(rep: Replica) -> int:
    """The emulator process under the replica's shim (the one listening on its port)."""
    shim = rep.manager.pid("chat/0")
    assert shim is not None
    for child in psutil.Process(shim).children(recursive=True):
        if "emulate" in " ".join(child.cmdline()):
            return child.pid
    raise AssertionError("no emulator process under the shim")


# -- a hung replica in a real `lowtide up` --------------------------------------------------------


def test_a_sigstopped_replica_leaves_routing_within_the_hung_bound_and_is_replaced(tmp_path: Path) -> None:
    api_port, gw_port = free_ports(2)
    base = consecutive_ports(2)
    config = {
        "state_dir": "state",
        "tick_seconds": 0.5,
        "nodes": [{"name": "n1", "gpus": 4}],
        "api": {"port": api_port},
        "auth": {"enabled": False},
        "services": [
            {
                "name": "chat",
                "model": "demo-8b",
                "gpus_per_replica": 2,
                "min_replicas": 1,
                "max_replicas": 2,
                "park": "stop",
                "emulate": True,
                "emulator_args": ["--cold-start", "0.5", "--no-access-log"],
                "base_port": base,
                "gateway_port": gw_port,
                "hung_after": "3s",
                "gateway_read_timeout": "2s",
                "metrics": {"timeout": "1s", "stale_after": "3s"},
                "autoscale": {"concurrency_per_replica": 4, "kv_usage": None},
            }
        ],
    }
    with lowtide_up(tmp_path, config) as st:

        def replicas() -> dict[str, str]:
            return {r["id"]: r["state"] for r in st.get("/v1/services")["services"][0]["replicas"]}

        assert replicas() == {"chat/0": "SERVING"}
        hung = next(
            p
            for p in psutil.process_iter(["cmdline"])
            if "emulate" in (cmd := " ".join(p.info["cmdline"] or []))
            and f"--port {base} " in cmd + " "
            and "step_shim" not in cmd  # the vLLM stand-in itself, not the supervisor above it
        )
        hung.suspend()  # SIGSTOP: the engine answers nothing, not even /health
        try:
            wait_until(
                lambda: replicas().get("chat/0") != "SERVING" and replicas().get("chat/1") == "SERVING",
                timeout=60,
                what="the hung replica to leave routing and a replacement to serve",
            )
            answer = httpx.post(
                f"{st.gateway}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10
            )
            assert answer.status_code == 200 and answer.headers["x-lowtide-replica"] == "chat/1"
            # The stopped process was killed, not left holding its GPUs.
            wait_until(
                lambda: not hung.is_running() or hung.status() == psutil.STATUS_ZOMBIE,
                timeout=30,
                what="the hung process to be killed",
            )
            events = (tmp_path / "server.log").read_text()
            assert "hung: " in events
        finally:
            with contextlib.suppress(psutil.Error):
                hung.resume()


# -- make before break in the real loop -----------------------------------------------------------

NODES = (Node("n1", tuple(range(8))),)
SPEC = ServiceSpec(
    name="chat",
    model="m",
    gpus_per_replica=2,
    min_replicas=1,
    max_replicas=2,
    park="stop",
    autoscale=AutoscaleTargets(
        concurrency_per_replica=4,
        kv_usage=None,
        scale_up_window_s=5,
        scale_down_stabilization_s=20,
        tolerance=0,
    ),
)


@dataclass
class SlowStarts(FakeServiceManager):
    """`FakeServiceManager`, but replicas in `slow` stay starting until the test lets them go."""

    slow: set[str] = field(default_factory=set)

    def poll(self, now: float) -> list[ReplicaEvent]:
        held = {rid: self.running.pop(rid) for rid in list(self.running) if rid in self.slow}
        try:
            return super().poll(now)
        finally:
            self.running.update(held)


def test_scale_down_keeps_the_serving_replica_in_routing_until_the_replacement_serves(tmp_path: Path) -> None:
    manager = SlowStarts()
    metrics = FakeMetrics()
    w = LoopHarness(
        nodes=NODES,
        layout=ArtifactLayout("/art", "/work"),
        clock=FakeClock(1_796_126_400.0),
        store=Store.open(f"sqlite:///{tmp_path / 'db.sqlite'}"),
        services=(ServiceSetup(spec=SPEC, command=("serve", "{port}"), base_port=9000),),
        lending=LendingPolicy(reclaim_lead_s=30, stale_after_s=10, stale_reclaim_after_s=60),
        sources={"chat": metrics},
        manager=manager,
    )
    w.recover()
    w.tick(n=2)

    def states() -> dict[str, str]:
        return {r.id: r.state.value for r in w.store.replicas("chat")}

    assert states() == {"chat/0": "SERVING"}
    # A surge asks for a second replica, which takes its time to start...
    manager.slow.add("chat/1")
    metrics.concurrency = 6.0
    w.tick(n=3, dt=2)
    assert states() == {"chat/0": "SERVING", "chat/1": "STARTING"}
    # ...and the load falls away before it serves: one replica is desired again, but the only
    # serving one stays in routing (before: it was drained, and every request got a 503).
    metrics.concurrency = 0.5
    w.tick(n=20, dt=2)
    decision = w.inference.status["chat"].decision
    assert decision is not None and decision.desired == 1
    assert states() == {"chat/0": "SERVING", "chat/1": "STARTING"}
    # Once the replacement serves, one of the two leaves routing.
    manager.slow.clear()
    w.tick(n=3, dt=2)
    after = states()
    assert sorted(after.values()) in (["DRAINING", "SERVING"], ["PARKED", "SERVING"], ["PARKING", "SERVING"])


def test_sleep_level_two_discards_the_weights_and_the_wake_reloads_them(
    tmp_path: Path, replicas: list[Replica]
) -> None:
    """Issue 9, defect 4: `sleep_level: 2` asks for level 2 and wakes the way vLLM documents it
    (weights, `collective_rpc reload_weights`, KV cache); the replica serves again."""
    rep = start(emulated("sleep", sleep_level=2), tmp_path, replicas)
    assert rep.launch.sleep_level == 2
    rep.manager.park("chat/0", "sleep", time.time())
    assert rep.next_event().kind == "asleep"
    metrics = httpx.get(f"{rep.url}/metrics", timeout=5).text
    assert 'sleep_state="discard_all"} 1.0' in metrics  # level 2, as vLLM's engine_sleep_state says

    rep.manager.unpark("chat/0", time.time())
    assert rep.next_event().kind == "healthy"
    log = Path(rep.launch.log_path).read_text()
    assert "collective_rpc reload_weights (level of the last sleep: 2)" in log
    done = httpx.post(f"{rep.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert done.status_code == 200
