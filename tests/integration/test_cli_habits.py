"""The CLI's everyday habits (issue 11, deliverable 2): --version, --output, the ELAPSED column,
submit from stdin, sweeps, cancel of several jobs or by filter, rerun -p, logs of every step
(prefixed, --tail, --since, -f waiting for a step that has not started), --watch, open and
completion. Real `lowtide` commands (Typer's CliRunner) against the real API served over HTTP on
a real SQLite store; the control loop runs (in a thread) only where a test needs steps to run."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

import lowtide.cli.main as cli_main
from lowtide import __version__
from lowtide.cli.main import app
from lowtide.wiring import Embedded
from support import Served, embedded, kill_steps_and_close, wait_until

SPEC = {"name": "sft", "params": {"lr": 0.1, "bs": 8}, "steps": [{"name": "train", "command": ["true"]}]}


@dataclass
class Cli:
    lt: Embedded
    served: Served
    token: str
    config: Path

    def run(self, *args: str, input: str | None = None) -> tuple[int, str, str]:
        result = CliRunner().invoke(
            app,
            ["--config", str(self.config), "--url", self.served.url, "--token", self.token, *args],
            env={"COLUMNS": "250"},
            input=input,
        )
        return result.exit_code, result.stdout, result.stderr

    def json(self, *args: str) -> Any:
        code, stdout, stderr = self.run(*args, "--json")
        assert code == 0, stderr
        return json.loads(stdout)

    def submit(self, doc: dict[str, Any], *args: str) -> str:
        code, stdout, stderr = self.run("submit", "-", "--json", *args, input=yaml.safe_dump(doc))
        assert code == 0, stderr
        return str(json.loads(stdout)["id"])


@pytest.fixture
def cli(tmp_path: Path) -> Iterator[Cli]:
    lt = embedded(tmp_path)
    lt.store.ensure_gpus(lt.nodes, lt.clock.now())
    _, token = lt.store.create_token(name="root", owner="root", role="admin", now=lt.clock.now())
    served = Served(lt.app)
    yield Cli(lt, served, token, tmp_path / "lowtide.yaml")
    served.close()
    kill_steps_and_close(lt)


@pytest.fixture
def running(cli: Cli) -> Iterator[Cli]:
    """`cli` with its control loop ticking in a thread (steps run)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            cli.lt.loop.tick()
            stop.wait(0.05)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    yield cli
    stop.set()
    thread.join(timeout=10)


def test_version_and_output_formats_with_an_elapsed_column(cli: Cli) -> None:
    code, stdout, _ = cli.run("--version")
    assert code == 0 and stdout.strip() == f"lowtide {__version__}"
    job = cli.submit(SPEC)
    code, stdout, _ = cli.run("jobs", "--output", "csv")
    rows = list(csv.reader(io.StringIO(stdout)))
    assert code == 0 and rows[0][-1] == "ELAPSED" and rows[1][0] == job and rows[1][5] == "QUEUED"
    assert rows[1][-1] == "-"  # not started
    code, stdout, _ = cli.run("jobs", "-o", "yaml")
    assert code == 0 and yaml.safe_load(stdout)["jobs"][0]["id"] == job
    assert cli.json("jobs")["jobs"][0]["id"] == job  # --json still works
    code, stdout, _ = cli.run("jobs")
    assert code == 0 and "ELAPSED" in stdout and job in stdout
    code, stdout, _ = cli.run("show", job, "-o", "csv")
    assert code == 0 and list(csv.reader(io.StringIO(stdout)))[1][:2] == ["train", "READY"]
    code, stdout, _ = cli.run("show", job, "-o", "yaml")
    assert code == 0 and yaml.safe_load(stdout)["job"]["id"] == job
    code, stdout, _ = cli.run("show", job)
    assert code == 0 and "elapsed -" in stdout
    code, _, stderr = cli.run("pool", "-o", "csv")
    assert code == 2 and "use json or yaml" in stderr
    code, stdout, _ = cli.run("pool", "-o", "yaml")
    assert code == 0 and yaml.safe_load(stdout)["total"] == 6
    code, _, stderr = cli.run("jobs", "-o", "xml")
    assert code == 2 and "xml" in stderr


def test_submit_from_stdin_sweep_rerun_with_params(cli: Cli) -> None:
    code, stdout, stderr = cli.run("submit", "-", input=yaml.safe_dump(SPEC))
    assert code == 0 and "submitted" in stdout, stderr
    first = cli.json("jobs")["jobs"][0]
    code, stdout, stderr = cli.run(
        "submit",
        "-",
        "--sweep",
        "lr=1e-5,2e-5",
        "--sweep",
        "bs=8,16",
        "-o",
        "csv",
        input=yaml.safe_dump(SPEC),
    )
    assert code == 0, stderr
    rows = list(csv.reader(io.StringIO(stdout)))
    assert rows[0] == ["JOB", "NAME", "lr", "bs", "STATE"]
    assert sorted((r[2], r[3]) for r in rows[1:]) == [
        ("1e-5", "16"),
        ("1e-5", "8"),
        ("2e-5", "16"),
        ("2e-5", "8"),
    ]
    group = {r[1] for r in rows[1:]}
    assert len(group) == 1 and next(iter(group)).startswith("sft-sweep-")
    listed = cli.json("jobs", "--name", next(iter(group)))["jobs"]
    assert sorted(j["id"] for j in listed) == sorted(r[0] for r in rows[1:])
    params = {json.dumps(cli.json("show", j["id"])["spec"]["params"], sort_keys=True) for j in listed}
    assert len(params) == 4
    code, stdout, _ = cli.run("submit", "-", "--sweep", "lr=1e-5", input=yaml.safe_dump(SPEC))
    assert code == 0 and "sweep sft-sweep-" in stdout and "lowtide jobs --name" in stdout
    code, _, stderr = cli.run("submit", "-", "--sweep", "lr=1,2", "--wait", input=yaml.safe_dump(SPEC))
    assert code == 2 and "--wait follows one job" in stderr
    code, _, stderr = cli.run("submit", "-", "--sweep", "lr", input=yaml.safe_dump(SPEC))
    assert code == 2 and "expected k=v1,v2" in stderr
    code, _, stderr = cli.run("submit", "-", "--sweep", "nope=1,2", input=yaml.safe_dump(SPEC))
    assert code == 2 and "not a parameter" in stderr
    # rerun with a changed parameter
    new = cli.json("rerun", first["id"], "-p", "lr=0.5")
    detail = cli.json("show", new["id"])
    assert new["rerun_of"] == first["id"] and detail["spec"]["params"] == {"lr": 0.5, "bs": 8}
    code, _, stderr = cli.run("rerun", first["id"], "-p", "nope=1")
    assert code == 2 and "not a parameter" in stderr


def test_cancel_several_jobs_and_by_filter_with_confirmation(cli: Cli) -> None:
    a, b = cli.submit(SPEC), cli.submit(SPEC)
    nlp = [cli.submit({**SPEC, "team": "nlp"}) for _ in range(2)]
    vision = cli.submit({**SPEC, "team": "vision"})
    code, stdout, stderr = cli.run("cancel", a, b)
    assert code == 0, stderr
    assert f"{a}: CANCELLED" in stdout and f"{b}: CANCELLED" in stdout
    code, _, stderr = cli.run("cancel", "--state", "QUEUED", "--team", "nlp", input="n\n")
    assert code == 1 and "nothing cancelled" in stderr and all(j in stderr for j in nlp)
    assert {j["state"] for j in cli.json("jobs", "--team", "nlp")["jobs"]} == {"QUEUED"}
    code, stdout, stderr = cli.run("cancel", "--state", "QUEUED", "--team", "nlp", "--yes", "-o", "csv")
    assert code == 0, stderr
    assert sorted(r[0] for r in list(csv.reader(io.StringIO(stdout)))[1:]) == sorted(nlp)
    states = {j["id"]: j["state"] for j in cli.json("jobs")["jobs"]}
    assert states[vision] == "QUEUED" and {states[j] for j in nlp} == {"CANCELLED"}
    code, _, stderr = cli.run("cancel", "--team", "vision")  # no answer at all
    assert code == 2 and "add --yes" in stderr
    code, _, stderr = cli.run("cancel")
    assert code == 2 and "name the jobs" in stderr
    waited = cli.submit(SPEC)
    code, stdout, stderr = cli.run("cancel", waited, "--wait", "--json")
    assert code == 0 and json.loads(stdout)["state"] == "CANCELLED", stderr
    code, stdout, stderr = cli.run("cancel", vision, "no-such-job")
    assert code == 2 and f"{vision}: CANCELLED" in stdout and "no-such-job" in stderr


def test_logs_of_every_step_prefixed_tail_since_and_follow(running: Cli, tmp_path: Path) -> None:
    go = tmp_path / "GO"
    doc = {
        "name": "two",
        "steps": [
            {"name": "prep", "command": ["sh", "-c", "for i in 1 2 3; do echo p$i; done"]},
            {
                "name": "train",
                "depends": ["prep"],
                "command": ["sh", "-c", f"echo t1; while [ ! -e {go} ]; do sleep 0.05; done; echo t2"],
            },
        ],
    }
    job = running.submit(doc)
    # a process of its own (CliRunner swaps sys.stdout: two at once in threads would mix)
    follower = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lowtide",
            "--url",
            running.served.url,
            "--token",
            running.token,
            "logs",
            job,
            "-f",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "LOWTIDE_CONFIG": str(running.config)},
    )
    try:
        wait_until(
            lambda: any(a["step"] == "train" for a in running.json("show", job)["attempts"]),
            what="train to start",
        )
        go.touch()
        stdout, stderr = follower.communicate(timeout=60)
    finally:
        if follower.poll() is None:
            follower.kill()
    assert follower.returncode == 0, stderr
    lines = [x for x in stdout.splitlines() if not x.split("] ", 1)[-1].startswith("=== lowtide")]
    assert [x for x in lines if x.startswith("[prep]")] == ["[prep] p1", "[prep] p2", "[prep] p3"]
    assert [x for x in lines if x.startswith("[train]")] == ["[train] t1", "[train] t2"]
    assert running.json("show", job)["job"]["state"] == "SUCCEEDED"
    code, stdout, _ = running.run("logs", job)
    assert code == 0 and "[prep] p1" in stdout and "[train] t2" in stdout
    code, stdout, _ = running.run("logs", job, "--step", "prep", "--tail", "3")  # the last: lowtide's
    assert code == 0 and stdout.splitlines()[:2] == ["p2", "p3"] and len(stdout.splitlines()) == 3
    code, stdout, _ = running.run("logs", job, "prep", "-n", "2")
    assert code == 0 and stdout.splitlines()[0] == "p3" and len(stdout.splitlines()) == 2
    code, stdout, _ = running.run("logs", job, "--since", "1h")
    assert code == 0 and "[prep] p3" in stdout
    code, _, stderr = running.run("logs", job, "--since", "soon")
    assert code == 2 and "duration" in stderr


def test_watch_refreshes_and_ctrl_c_exits_0(cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    job = cli.submit(SPEC)
    code, stdout, _ = cli.run("jobs", "--watch", "--iterations", "1")
    assert code == 0 and job in stdout
    code, stdout, _ = cli.run("show", job, "--watch", "--iterations", "1")
    assert code == 0 and "train" in stdout

    def interrupted(_: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_main, "_sleep", interrupted)
    code, stdout, _ = cli.run("jobs", "-w")
    assert code == 0 and job in stdout
    code, _, stderr = cli.run("jobs", "-w", "--json")
    assert code == 2 and "--watch" in stderr


def test_open_prints_the_dashboard_url_and_completion_scripts(cli: Cli) -> None:
    code, stdout, _ = cli.run("open")
    assert code == 0 and stdout.strip() == f"{cli.served.url}/ui/"
    for shell in ("bash", "zsh", "fish"):
        code, stdout, _ = cli.run("completion", shell)
        assert code == 0 and "_LOWTIDE_COMPLETE" in stdout
    code, _, stderr = cli.run("completion", "tcsh")
    assert code == 2 and "unknown shell" in stderr
    asked = subprocess.run(  # what the bash script does on <TAB>
        [sys.executable, "-m", "lowtide"],
        env={
            **os.environ,
            "_LOWTIDE_COMPLETE": "complete_bash",
            "COMP_WORDS": "lowtide jobs --wa",
            "COMP_CWORD": "2",
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert asked.returncode == 0 and asked.stdout.split() == ["--watch"], asked.stderr
