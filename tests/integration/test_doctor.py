"""`lowtide doctor` against the vLLM stand-in run as a real process (`lowtide emulate vllm`), the
CLI run as a real process too: with and without dev mode (VLLM_SERVER_DEV_MODE), bound to
127.0.0.1 and to 0.0.0.0, nothing listening, a server whose answers carry terminal escapes, and
bad usage (exit 2); and the configuration's checks (`--config-only`, `--service`): sleep mode and
dev mode for `park: sleep`, a loopback `--host` in a configured command."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from support import Served, wait_until


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def other_addresses() -> list[str]:
    """This machine's IPv4 addresses outside 127.0.0.0/8."""
    return [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]


@pytest.fixture
def emulator() -> Iterator[Callable[..., str]]:
    """Start `lowtide emulate vllm` on a free port; returns its loopback URL once /health is 200."""
    started: list[subprocess.Popen[bytes]] = []

    def start(*, host: str = "127.0.0.1", dev_mode: bool = True) -> str:
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "VLLM_SERVER_DEV_MODE"}
        if dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "lowtide", "emulate", "vllm", "--host", host, "--port", str(port)),
                *("--model", "demo-8b", "--cold-start", "0", "--no-access-log", "--log-level", "warning"),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        started.append(proc)
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            assert proc.poll() is None, "the emulator exited"
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, timeout=30, what="the emulator to serve")
        return url

    yield start
    for proc in started:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


def doctor(*args: str, cwd: Path | None = None) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOWTIDE_CONFIG", "COLUMNS")}
    env["COLUMNS"] = "300"
    r = subprocess.run(
        [sys.executable, "-m", "lowtide", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=cwd,
    )
    return r.returncode, r.stdout, r.stderr


def checks(stdout: str) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in json.loads(stdout)["checks"]}


def test_a_loopback_replica_with_dev_mode_passes_every_check(emulator: Callable[..., str]) -> None:
    url = emulator()
    code, out, _ = doctor("doctor", "--url", url, "--park", "sleep", "--json")
    assert code == 0, out
    report = json.loads(out)
    assert report["ok"] is True and report["url"] == url
    by_name = checks(out)
    assert {n: c["status"] for n, c in by_name.items()} == dict.fromkeys(by_name, "ok")
    for name in ("health", "metrics", "metrics.running", "metrics.waiting", "metrics.kv_usage", "sleep"):
        assert by_name[name]["required"] is True
    assert "awake" in by_name["sleep"]["detail"]
    assert "loopback" in by_name and by_name["loopback"]["status"] == "ok"
    # the text form says the same
    code, text, _ = doctor("doctor", "--url", url, "--park", "sleep")
    assert code == 0 and "everything lowtide needs is there" in text
    assert "metrics.kv_usage" in text and "missing" not in text


def test_without_dev_mode_the_sleep_check_says_what_to_set(emulator: Callable[..., str]) -> None:
    url = emulator(dev_mode=False)
    code, out, _ = doctor("doctor", "--url", url, "--park", "sleep", "--json")
    assert code == 1
    sleep = checks(out)["sleep"]
    assert sleep["status"] == "missing" and sleep["required"] is True
    assert "404" in sleep["detail"] and "VLLM_SERVER_DEV_MODE=1" in sleep["detail"]
    # parked by stop, sleep mode is not needed: a warning, and the replica passes
    code, out, _ = doctor("doctor", "--url", url, "--park", "stop", "--json")
    assert code == 0
    assert checks(out)["sleep"]["status"] == "warning"
    code, text, _ = doctor("doctor", "--url", url, "--park", "sleep")
    assert code == 1 and "VLLM_SERVER_DEV_MODE=1" in text and "a required check failed" in text


def test_a_replica_on_every_interface_fails_the_loopback_check(emulator: Callable[..., str]) -> None:
    url = emulator(host="0.0.0.0")
    code, out, _ = doctor("doctor", "--url", url, "--json")
    loopback = checks(out)["loopback"]
    addresses = other_addresses()
    if not addresses:  # nothing else to reach it on from here: the check has nothing to find
        assert code == 0 and loopback["status"] == "ok"
        return
    assert code == 1
    assert loopback["status"] == "missing" and "--host 127.0.0.1" in loopback["detail"]
    assert any(a in loopback["detail"] for a in addresses)
    # Asked at a non-loopback address, the answer itself shows it is reachable from outside.
    port = url.rsplit(":", 1)[1]
    code, out, _ = doctor("doctor", "--url", f"http://{addresses[0]}:{port}", "--json")
    assert code == 1 and checks(out)["loopback"]["status"] == "missing"


def test_nothing_listening_is_one_failed_check_and_the_rest_skipped() -> None:
    code, out, _ = doctor("doctor", "--url", f"http://127.0.0.1:{free_port()}", "--json")
    assert code == 1
    by_name = checks(out)
    assert by_name["health"]["status"] == "missing" and "cannot connect" in by_name["health"]["detail"]
    assert {by_name[n]["status"] for n in ("metrics", "sleep", "loopback")} == {"skipped"}


async def _health(_request: Request) -> PlainTextResponse:
    return PlainTextResponse("")


async def _metrics(_request: Request) -> PlainTextResponse:
    return PlainTextResponse("vllm:num_requests_running 1\n\x1b[2J[bold]evil line\n")


async def _not_sleeping(_request: Request) -> JSONResponse:
    return JSONResponse({"is_sleeping": "\x1b]0;title\x07"})


def test_what_a_replica_sends_is_printed_escaped() -> None:
    served = Served(
        Starlette(
            routes=[
                Route("/health", _health),
                Route("/metrics", _metrics),
                Route("/is_sleeping", _not_sleeping),
            ]
        )
    )
    try:
        code, text, _ = doctor("doctor", "--url", served.url, "--park", "sleep")
    finally:
        served.close()
    assert code == 1
    assert "\x1b" not in text and "\x07" not in text
    assert "\\x1b[2J" in text  # shown, not obeyed
    assert "metrics.waiting" in text and "missing" in text


def test_bad_usage_exits_2_saying_why(tmp_path: Path) -> None:
    cases = [
        (("doctor",), "give either --url"),
        (("doctor", "--url", "http://127.0.0.1:1", "--service", "chat"), "give either --url"),
        (("doctor", "--url", "127.0.0.1:8100"), "give http://HOST:PORT"),
        (("doctor", "--url", "http://127.0.0.1"), "give http://HOST:PORT"),
        (("doctor", "--url", "http://127.0.0.1:1", "--park", "nap"), "use sleep or stop"),
    ]
    for args, message in cases:
        code, _, err = doctor(*args, cwd=tmp_path)
        assert code == 2, args
        assert message in err, (args, err)
    config = tmp_path / "lowtide.yaml"
    config.write_text("services:\n  - name: chat\n    model: m\n    base_port: 8100\n    max_replicas: 2\n")
    code, _, err = doctor("-c", str(config), "doctor", "--service", "nope", cwd=tmp_path)
    assert code == 2 and "no such service" in err and "chat" in err
    code, _, err = doctor("-c", str(config), "doctor", "--service", "chat", "--slot", "2", cwd=tmp_path)
    assert code == 2 and "slots 0..1" in err


def test_service_resolves_to_its_replica_port_and_park_mode(
    emulator: Callable[..., str], tmp_path: Path
) -> None:
    url = emulator(dev_mode=False)
    port = int(url.rsplit(":", 1)[1])
    config = tmp_path / "lowtide.yaml"
    config.write_text(f"services:\n  - name: chat\n    model: m\n    base_port: {port}\n    park: sleep\n")
    code, out, _ = doctor("-c", str(config), "doctor", "--service", "chat", "--json", cwd=tmp_path)
    assert json.loads(out)["url"] == url
    assert code == 1 and checks(out)["sleep"]["status"] == "missing"  # park: sleep from the config
    # the service's configuration is checked first: lowtide's default command and environment
    assert checks(out)["config.chat.dev_mode"]["status"] == "ok"
    assert checks(out)["config.chat.host"]["status"] == "ok"


# -- the configuration's checks (--config-only, --service) ------------------------------------------

CONFIG = """\
services:
  - name: chat          # park: sleep, its own command without --enable-sleep-mode or --host
    model: m
    park: sleep
    command: [vllm, serve, "{model}", --port, "{port}"]
  - name: code          # dev mode turned off in env, the command bound to every interface
    model: m
    park: sleep
    base_port: 8200
    env: {VLLM_SERVER_DEV_MODE: "0"}
    command: [vllm, serve, "{model}", --enable-sleep-mode, --host, 0.0.0.0, --port, "{port}"]
  - name: wrapped       # everything inside a shell string; a dev mode value vLLM's int() rejects
    model: m
    park: sleep
    base_port: 8300
    command:
      - bash
      - -c
      - VLLM_SERVER_DEV_MODE=true exec vllm serve {model} --enable-sleep-mode --host=localhost --port {port}
  - name: emu           # lowtide's emulator: it always sleeps and has no --enable-sleep-mode
    model: m
    park: sleep
    base_port: 8400
    command: ["{python}", -m, lowtide, emulate, vllm, --host, 127.0.0.1, --port, "{port}", --model, "{model}"]
  - name: plain         # lowtide's default command
    model: m
    base_port: 8500
"""


def test_config_only_names_each_service_and_the_fix_without_contacting_a_replica(tmp_path: Path) -> None:
    config = tmp_path / "lowtide.yaml"
    config.write_text(CONFIG)
    code, out, err = doctor("-c", str(config), "doctor", "--config-only", "--json", cwd=tmp_path)
    assert code == 0, err  # warnings only: the node's environment or a wrapper may supply what is missing
    report = json.loads(out)
    assert report["ok"] is True and report["url"] is None
    got = {c["name"]: (c["status"], c["detail"]) for c in report["checks"]}
    assert all(not c["required"] for c in report["checks"])
    assert {n: s for n, (s, _) in got.items()} == {
        "config.chat.dev_mode": "ok",  # lowtide sets VLLM_SERVER_DEV_MODE=1 for park: sleep
        "config.chat.sleep_mode": "warning",
        "config.chat.host": "warning",
        "config.code.dev_mode": "warning",
        "config.code.sleep_mode": "ok",
        "config.code.host": "warning",
        "config.wrapped.dev_mode": "warning",
        "config.wrapped.sleep_mode": "ok",
        "config.wrapped.host": "ok",
        "config.emu.dev_mode": "ok",
        "config.emu.host": "ok",
        "config.plain.host": "ok",
    }
    sleep_mode = got["config.chat.sleep_mode"][1]
    assert "'chat'" in sleep_mode and "lacks --enable-sleep-mode" in sleep_mode
    assert "Add --enable-sleep-mode in services[].command" in sleep_mode
    assert "has no --host" in got["config.chat.host"][1] and "--host 127.0.0.1" in got["config.chat.host"][1]
    dev_mode = got["config.code.dev_mode"][1]
    assert (
        "'code'" in dev_mode and "VLLM_SERVER_DEV_MODE='0'" in dev_mode and "turns dev mode off" in dev_mode
    )
    assert 'VLLM_SERVER_DEV_MODE: "1" in services[].env' in dev_mode
    assert "--host 0.0.0.0, not a loopback address" in got["config.code.host"][1]
    assert "'true' in the command" in got["config.wrapped.dev_mode"][1]
    assert "int()" in got["config.wrapped.dev_mode"][1]
    assert "127.0.0.1" in got["config.plain.host"][1]
    # the text form says the same, one line a check, and names no replica URL
    code, text, _ = doctor("-c", str(config), "doctor", "--config-only", cwd=tmp_path)
    assert code == 0 and "no replica contacted" in text
    assert "config.chat.sleep_mode" in text and "lacks --enable-sleep-mode" in text
    assert "everything lowtide needs is there" in text


def test_config_only_is_its_own_mode() -> None:
    code, _, err = doctor("doctor", "--config-only", "--url", "http://127.0.0.1:1")
    assert code == 2 and "without --url, --service or --park" in err
