"""End to end, as a user does it: `lowtide up` as a real server process, the `lowtide` CLI as real
commands, real step processes; then `kill -9` of the control plane in the middle of a job."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from support import wait_until

REPO = Path(__file__).resolve().parents[2]
DAG = REPO / "examples" / "jobs" / "sft-dag.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    root: Path
    config: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def token_file(self) -> Path:
        return self.root / "state" / "admin.token"

    def start(self) -> None:
        log = (self.root / "server.log").open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lowtide", "--config", str(self.config), "up"],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.root,
        )
        wait_until(self._healthy, timeout=30, what="lowtide up to answer /healthz")

    def _healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError("server exited:\n" + (self.root / "server.log").read_text())
        try:
            return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def cli(
        self, *args: str, token: str | None = None, check: bool = False
    ) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "LOWTIDE_CONFIG": str(self.config), "COLUMNS": "200"}
        if token is not None:
            env["LOWTIDE_TOKEN"] = token
        result = subprocess.run(
            [sys.executable, "-m", "lowtide", *args],
            check=False,
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            timeout=120,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"lowtide {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
        return result

    def json(self, *args: str) -> Any:
        return json.loads(self.cli(*args, "--json", check=True).stdout)

    def api(self, path: str) -> Any:
        """GET `path` from the API as admin: polling through the CLI costs an interpreter start
        per look, seconds on a loaded machine, and a short step can come and go between two."""
        token = self.token_file.read_text().strip()
        r = httpx.get(f"{self.url}{path}", headers={"Authorization": f"Bearer {token}"}, timeout=10)
        r.raise_for_status()
        return r.json()


def shims_of(instance_hint: Path) -> list[psutil.Process]:
    """Step shims whose work directory lies under this test's state (our processes only)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "lowtide.adapters.step_shim" in cmd and any(str(instance_hint) in part for part in cmd):
            found.append(p)
    return found


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    config = tmp_path / "lowtide.yaml"
    port = free_port()
    config.write_text(
        yaml.safe_dump(
            {
                "state_dir": "state",
                "templates_dir": str(REPO / "examples" / "templates"),
                "tick_seconds": 0.2,
                "nodes": [{"name": "node-a", "gpus": 4}, {"name": "node-b", "gpus": 2}],
                "api": {"port": port},
                "executor": {"checkpoint_poll": 0.2},
            }
        )
    )
    srv = Server(tmp_path, config, port)
    srv.start()
    yield srv
    srv.stop()
    for p in shims_of(tmp_path):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)


def test_the_admin_token_is_created_once_with_mode_0600(server: Server) -> None:
    assert server.token_file.stat().st_mode & 0o777 == 0o600
    who = server.json("token", "list")
    assert [(t["name"], t["role"]) for t in who] == [("admin", "admin")]


def test_validate_accepts_a_good_spec_and_rejects_broken_ones_with_located_errors(
    server: Server, tmp_path: Path
) -> None:
    ok = server.cli("validate", str(DAG))
    assert ok.returncode == 0 and "OK" in ok.stdout
    broken = tmp_path / "broken.yaml"
    broken.write_text(
        "name: Bad_Name\nsteps:\n  - name: a\n    command: [x]\n    depends: [b]\n    gpus: 9\n"
        "  - name: b\n    command: [x]\n    depends: [a]\n    colour: red\n"
    )
    r = server.cli("validate", str(broken))
    assert r.returncode == 2
    for expected in ("name:", "steps[0].gpus:", "steps[1].colour:", "dependency cycle a -> b -> a"):
        assert expected in r.stderr, r.stderr
    r = server.cli("validate", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "cannot read" in r.stderr
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"name": "x", "steps": [}')
    r = server.cli("validate", str(bad_json), "--json")
    assert r.returncode == 2 and json.loads(r.stdout)["valid"] is False


def test_submit_wait_runs_the_example_dag_on_the_right_gpus(server: Server) -> None:
    r = server.cli("submit", str(DAG), "-p", "steps=60", "--wait", check=True)
    assert "SUCCEEDED" in r.stdout
    jobs = server.json("jobs")["jobs"]
    detail = server.json("show", jobs[0]["id"])
    assert detail["job"]["state"] == "SUCCEEDED"
    attempts = {a["step"]: a for a in detail["attempts"]}
    assert attempts["train"]["gpus"] == [0, 1] and attempts["train"]["node"] == "node-b"  # best fit: 2 of 2
    assert attempts["eval"]["gpus"] == [0]
    log = server.cli("logs", jobs[0]["id"], "train", check=True).stdout
    assert "train: GPUs [0,1]" in log and "done after 60 steps" in log
    followed = server.cli("logs", jobs[0]["id"], "train", "-f", check=True).stdout
    assert followed == log  # the attempt has ended: follow returns what there is, then stops
    shown = server.cli("show", jobs[0]["id"], check=True).stdout
    assert "SUCCEEDED" in shown and "train" in shown
    pool = server.json("pool")
    assert (pool["total"], pool["free"]) == (6, 6)
    rerun = server.cli("rerun", jobs[0]["id"], "--wait", check=True)
    assert "SUCCEEDED" in rerun.stdout
    assert server.json("jobs")["jobs"][0]["rerun_of"] == jobs[0]["id"]


def test_bad_requests_from_the_cli_exit_2_with_the_reason(server: Server, tmp_path: Path) -> None:
    spec = tmp_path / "cycle.yaml"
    spec.write_text(
        yaml.safe_dump({"name": "c", "steps": [{"name": "a", "command": ["x"], "depends": ["a"]}]})
    )
    r = server.cli("submit", str(spec))
    assert r.returncode == 2 and "steps[0].depends" in r.stderr
    assert server.json("jobs")["jobs"] == []
    r = server.cli("jobs", token="lt_not-a-token")
    assert r.returncode == 2 and "unknown or revoked token" in r.stderr
    alice = server.json("token", "create", "alice", "--team", "nlp")["token"]  # sees nlp's jobs
    theirs = json.loads(server.cli("submit", str(DAG), "-p", "steps=2000", "--json", check=True).stdout)["id"]
    r = server.cli("cancel", theirs, token=alice)
    assert r.returncode == 2 and "belongs to admin" in r.stderr
    assert server.cli("cancel", theirs, check=True).returncode == 0
    r = server.cli("show", "job-000000000000")
    assert r.returncode == 2 and "not found" in r.stderr
    server.stop()
    r = server.cli("jobs")
    assert r.returncode == 1 and "cannot reach lowtide" in r.stderr


def test_kill_9_of_the_control_plane_loses_no_job_and_leaves_no_orphan(
    server: Server, tmp_path: Path
) -> None:
    # Long enough (~10 s) that the step still runs when a CLI call under load has seen it.
    job = json.loads(server.cli("submit", str(DAG), "-p", "steps=800", "--json", check=True).stdout)["id"]
    queued = json.loads(server.cli("submit", str(DAG), "-p", "steps=20", "--json", check=True).stdout)["id"]

    def train_running() -> dict[str, Any] | None:
        d = server.api(f"/v1/jobs/{job}")
        att = [a for a in d["attempts"] if a["step"] == "train" and a["state"] == "RUNNING"]
        return att[0] if att and att[0]["handle"] else None

    train = wait_until(train_running, timeout=120, interval=0.2, what="train to run")
    server.kill9()
    train_pid = int(train["handle"])  # the local executor's handle is the shim's pid
    assert psutil.pid_exists(train_pid), "the step died with the control plane"

    server.start()
    final = wait_until(
        lambda: (d := server.json("show", job))["job"]["state"] in ("SUCCEEDED", "FAILED") and d,
        timeout=120,
        what="the job to finish after the restart",
    )
    assert final["job"]["state"] == "SUCCEEDED"
    trains = [a for a in final["attempts"] if a["step"] == "train"]
    assert len(trains) == 1 and trains[0]["id"] == train["id"], "the running step was not re-adopted"
    wait_until(
        lambda: server.json("show", queued)["job"]["state"] == "SUCCEEDED",
        timeout=120,
        what="the other job to finish",
    )
    assert len(server.json("jobs")["jobs"]) == 2
    wait_until(lambda: not shims_of(tmp_path), timeout=10, what="no step process left")
    assert not psutil.pid_exists(train_pid) or psutil.Process(train_pid).status() == psutil.STATUS_ZOMBIE


def test_a_second_control_plane_on_the_same_state_or_port_refuses_to_start(
    server: Server, tmp_path: Path
) -> None:
    # The one that started said where it listens; the refused ones say only why (issue 12).
    assert f"lowtide listening on {server.url}" in (server.root / "server.log").read_text()
    same_state = server.cli("up")
    assert same_state.returncode == 1 and "another lowtide" in same_state.stderr
    assert "listening on" not in same_state.stderr
    other = tmp_path / "other.yaml"
    other.write_text(
        yaml.safe_dump(
            {
                "state_dir": str(tmp_path / "other-state"),
                "api": {"port": server.port},
                "nodes": [{"name": "n", "gpus": 1}],
            }
        )
    )
    taken = subprocess.run(
        [sys.executable, "-m", "lowtide", "--config", str(other), "up"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert taken.returncode == 1 and f"cannot listen on 127.0.0.1:{server.port}" in taken.stderr
    assert "lowtide listening" not in taken.stderr
    assert httpx.get(f"{server.url}/healthz", timeout=2).status_code == 200  # the first one is untouched


# -- input that cannot break the tools (issue 10): JSON only on stdout, logs across retries,
# -- undeclared parameters, warnings, auth off --------------------------------------------------


def _server_with(tmp_path: Path, **extra: Any) -> Server:
    config = tmp_path / "lowtide.yaml"
    port = free_port()
    doc: dict[str, Any] = {
        "state_dir": "state",
        "templates_dir": str(REPO / "examples" / "templates"),
        "tick_seconds": 0.2,
        "nodes": [{"name": "node-a", "gpus": 2}],
        "api": {"port": port},
        "executor": {"checkpoint_poll": 0.2, "retry_backoff": 0.2, "retry_backoff_max": 0.5},
    }
    doc.update(extra)
    config.write_text(yaml.safe_dump(doc))
    return Server(tmp_path, config, port)


@pytest.fixture
def quick_server(tmp_path: Path) -> Iterator[Server]:
    srv = _server_with(tmp_path)
    srv.start()
    yield srv
    srv.stop()
    for p in shims_of(tmp_path):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)


def test_submit_wait_json_prints_only_json_and_warnings_go_to_stderr(
    quick_server: Server, tmp_path: Path
) -> None:
    spec = tmp_path / "img.yaml"
    spec.write_text(
        yaml.safe_dump({"name": "img", "steps": [{"name": "a", "command": ["true"], "image": "reg/x:1"}]})
    )
    r = quick_server.cli("submit", str(spec), "--wait", "--json")
    assert r.returncode == 0, r.stderr
    final = json.loads(r.stdout)  # the whole of stdout is one JSON document
    assert final["job"]["state"] == "SUCCEEDED"
    assert [w["loc"] for w in final["warnings"]] == ["steps[0].image"]
    assert "submitted" in r.stderr and "warning:" in r.stderr and "steps[0].image" in r.stderr
    r = quick_server.cli("validate", str(spec), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["warnings"][0]["loc"] == "steps[0].image"


def test_an_undeclared_parameter_is_refused_by_validate_and_submit(
    quick_server: Server, tmp_path: Path
) -> None:
    spec = tmp_path / "p.yaml"
    spec.write_text(
        yaml.safe_dump({"name": "p", "params": {"lr": 1}, "steps": [{"name": "a", "command": ["true"]}]})
    )
    r = quick_server.cli("validate", str(spec), "-p", "unknown=1")
    assert r.returncode == 2 and "--param 'unknown=1': 'unknown' is not a parameter of this job" in r.stderr
    r = quick_server.cli("submit", str(spec), "-p", "lr=2", "-p", "unknown=1")
    assert r.returncode == 2 and "query.param[1]" in r.stderr and "'unknown' is not a parameter" in r.stderr
    assert quick_server.json("jobs")["jobs"] == []


def test_logs_follow_continues_across_a_retry(quick_server: Server, tmp_path: Path) -> None:
    go = tmp_path / "GO"
    script = (
        'echo "attempt $LOWTIDE_ATTEMPT"; '
        f'if [ "$LOWTIDE_ATTEMPT" = 1 ]; then while [ ! -e {go} ]; do sleep 0.05; done; exit 3; fi; '
        "echo second"
    )
    spec = tmp_path / "retry.yaml"
    spec.write_text(
        yaml.safe_dump(
            {"name": "retry", "max_retries": 1, "steps": [{"name": "run", "command": ["sh", "-c", script]}]}
        )
    )
    job = json.loads(quick_server.cli("submit", str(spec), "--json", check=True).stdout)["id"]
    env = {**os.environ, "LOWTIDE_CONFIG": str(quick_server.config), "COLUMNS": "200"}
    follow = subprocess.Popen(
        [sys.executable, "-m", "lowtide", "logs", job, "run", "-f"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    try:
        assert follow.stdout is not None
        seen = []
        while not seen or seen[-1] != "attempt 1\n":  # following attempt 1 while it runs
            seen.append(follow.stdout.readline())
            assert seen[-1], f"logs -f ended early: {seen}"
        go.touch()  # attempt 1 fails now; its retry is attempt 2
        rest, err = follow.communicate(timeout=120)
    finally:
        if follow.poll() is None:
            follow.kill()
    assert follow.returncode == 0, err
    lines = [line for line in [*seen, *rest.splitlines(keepends=True)] if not line.startswith("=== lowtide")]
    assert lines == ["attempt 1\n", "attempt 2\n", "second\n"], rest
    assert "--- run: attempt 2 ---" in err
    assert quick_server.json("show", job)["job"]["state"] == "SUCCEEDED"


def test_auth_off_warns_at_up_and_is_refused_off_loopback(tmp_path: Path) -> None:
    (tmp_path / "off").mkdir()
    srv = _server_with(tmp_path / "off", auth={"enabled": False})
    srv.start()
    try:
        assert httpx.get(f"{srv.url}/v1/whoami", timeout=5).json()["role"] == "admin"
    finally:
        srv.stop()
    log = (srv.root / "server.log").read_text()
    assert "WARNING" in log and "auth is OFF" in log and "acts as admin" in log
    r = subprocess.run(
        [sys.executable, "-m", "lowtide", "--config", str(srv.config), "up", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 2 and "auth.enabled" in r.stderr and "loopback" in r.stderr
