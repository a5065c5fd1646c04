"""Several users sharing one lowtide, one of them hostile: the whole story over real HTTP.

`lowtide up` runs as a real server process (as root, with `executor.run_as`, so every job's steps
run as their own uid), two researchers hold user tokens of different teams, and every request goes
through the API as theirs would. One scenario, in the order a hostile user would try things:

- Bob's step tries to read the state dir, the admin token and the database, and to plant a
  `LATEST` in Alice's checkpoint directory: every attempt fails with a permission error, and
  Alice's job resumes from its own checkpoint.
- Alice's step sees exactly the contract, its spec's `env`, its secret and the allowlisted
  variables: none of the operator's environment.
- Bob gets 404 on Alice's job, logs and rerun, and his listing does not show it.
- A submit for another team or above the token's priority is refused, located.
- A step over its `timeout` ends FAILED with the reason; CPU-only steps never run more than the
  configured number at once.

Needs root (CI runs as root) and an interpreter the step user can run (`.ci/run` makes it so).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from support import STEP_USER, ensure_step_user, wait_until

PY = sys.executable
SECRET = "wandb-value-9f31c2"
OPERATOR_CREDENTIAL = "operator-cloud-credential-77aa"
CPU_LIMIT = 3

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="steps run as other uids only when lowtide runs as root (CI runs as root)"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def code(text: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(text)]


class Lowtide:
    """`lowtide up` as a server process and an HTTP client per token."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        secret_file = root / "wandb.secret"
        secret_file.write_text(SECRET + "\n")
        secret_file.chmod(0o600)
        self.config = root / "lowtide.yaml"
        self.config.write_text(
            yaml.safe_dump(
                {
                    "state_dir": str(root / "state"),
                    "artifact_root": str(root / "artifacts"),
                    "tick_seconds": 0.2,
                    "nodes": [{"name": "node-a", "gpus": 2}],
                    "api": {"port": self.port},
                    "executor": {
                        "run_as": STEP_USER,
                        "retry_backoff": 0.2,
                        "retry_backoff_max": 1,
                        "checkpoint_poll": 0.2,
                    },
                    "scheduler": {"max_cpu_steps_per_node": CPU_LIMIT},
                    "secrets": {
                        "wandb": {
                            "env": "WANDB_API_KEY",
                            "teams": ["nlp"],
                            "source": {"file": str(secret_file)},
                        }
                    },
                }
            )
        )
        env = {
            **os.environ,
            "AWS_SECRET_ACCESS_KEY": OPERATOR_CREDENTIAL,
            "LOWTIDE_TOKEN": OPERATOR_CREDENTIAL,
            "LANG": "C.UTF-8",
        }
        self.log = (root / "server.log").open("ab")
        self.proc = subprocess.Popen(
            [PY, "-m", "lowtide", "--config", str(self.config), "up"],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=root,
            env=env,
        )
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=30)
        wait_until(self._healthy, timeout=60, what="lowtide up to answer /healthz")
        self.admin = (root / "state" / "admin.token").read_text().strip()

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError("lowtide up exited:\n" + (self.root / "server.log").read_text())
        try:
            return self.http.get("/healthz").status_code == 200
        except httpx.HTTPError:
            return False

    def call(self, method: str, url: str, token: str, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}", **kw.pop("headers", {})}
        return self.http.request(method, url, headers=headers, **kw)

    def token(self, name: str, teams: list[str], max_priority: int) -> str:
        r = self.call(
            "POST",
            "/v1/tokens",
            self.admin,
            json={"name": name, "role": "user", "teams": teams, "max_priority": max_priority},
        )
        assert r.status_code == 201, r.text
        return str(r.json()["token"])

    def submit(self, token: str, doc: dict[str, Any]) -> httpx.Response:
        return self.call(
            "POST",
            "/v1/jobs",
            token,
            content=yaml.safe_dump(doc),
            headers={"Content-Type": "application/yaml"},
        )

    def submitted(self, token: str, doc: dict[str, Any]) -> str:
        r = self.submit(token, doc)
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    def detail(self, token: str, job_id: str) -> dict[str, Any]:
        r = self.call("GET", f"/v1/jobs/{job_id}", token)
        assert r.status_code == 200, r.text
        return dict(r.json())

    def wait_done(self, token: str, job_id: str, timeout: float = 90) -> dict[str, Any]:
        def done() -> dict[str, Any] | None:
            d = self.detail(token, job_id)
            return d if d["job"]["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") else None

        return wait_until(done, timeout=timeout, interval=0.2, what=f"job {job_id} to finish")

    def logs(self, token: str, job_id: str, step: str, attempt: int | None = None) -> str:
        params = {"attempt": attempt} if attempt else {}
        r = self.call("GET", f"/v1/jobs/{job_id}/steps/{step}/logs", token, params=params)
        assert r.status_code == 200, r.text
        return r.text

    def stop(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


@pytest.fixture
def lowtide() -> Iterator[Lowtide]:
    ensure_step_user()
    root = Path(tempfile.mkdtemp(prefix="lowtide-multi-user-"))
    root.chmod(0o711)  # pytest's tmp_path is 0700: no step uid could enter it
    lt = Lowtide(root)
    try:
        yield lt
    finally:
        lt.stop()
        shutil.rmtree(root, ignore_errors=True)


ALICE_TRAIN = """
    import json, os, pathlib, sys, time
    ck = pathlib.Path(os.environ["LOWTIDE_CHECKPOINT_DIR"])
    out = pathlib.Path(os.environ["LOWTIDE_OUTPUTS"])
    out.mkdir(parents=True, exist_ok=True)
    resume = os.environ.get("LOWTIDE_RESUME_FROM")
    if resume:
        (out / "resumed-from").write_text(resume)
        sys.exit(0)
    (out / "env.json").write_text(json.dumps(dict(os.environ)))
    (ck / "ck-alice").write_text("alice's weights")
    (ck / "LATEST").write_text("ck-alice")
    (out / "checkpointed").write_text("yes")
    while not (ck / "proceed").exists():  # the test lets this attempt fail once Bob has tried
        time.sleep(0.1)
    sys.exit(3)
"""

BOB_ATTACK = """
    import json, os, pathlib, sys
    state, target = sys.argv[1], sys.argv[2]
    tried = {}
    def attempt(what, fn):
        try:
            fn()
            tried[what] = "succeeded"
        except OSError as exc:
            tried[what] = type(exc).__name__
    attempt("admin.token", lambda: open(os.path.join(state, "admin.token")).read())
    attempt("database", lambda: open(os.path.join(state, "lowtide.db"), "rb").read(16))
    attempt("state dir", lambda: os.listdir(state))
    attempt("alice LATEST", lambda: open(os.path.join(target, "LATEST"), "w").write("/tmp/evil"))
    print("tried:", json.dumps(tried, sort_keys=True), flush=True)
    denied = [w for w, how in tried.items() if how == "PermissionError"]
    if len(denied) != len(tried):
        sys.exit(0)  # an attack worked: the test sees the step succeed and fails
    raise PermissionError("every attempt was refused: " + ", ".join(denied))
"""


def test_two_researchers_and_a_hostile_one_share_lowtide_safely(lowtide: Lowtide) -> None:
    lt = lowtide
    alice = lt.token("alice", ["nlp"], max_priority=50)
    bob = lt.token("bob", ["vision"], max_priority=50)

    # -- Alice trains with a checkpoint and a secret ------------------------------------------
    alice_job = lt.submitted(
        alice,
        {
            "name": "alice-sft",
            "team": "nlp",
            "max_retries": 1,
            "steps": [
                {
                    "name": "train",
                    "command": code(ALICE_TRAIN),
                    "checkpoint": True,
                    "env": {"MY_SETTING": "on"},
                    "secrets": ["wandb"],
                }
            ],
        },
    )
    outputs = Path(lt.root, "artifacts", "jobs", alice_job, "train", "outputs")
    checkpoints = Path(lt.root, "artifacts", "jobs", alice_job, "train", "checkpoints")
    wait_until((outputs / "checkpointed").exists, timeout=60, what="alice's first checkpoint")

    # -- Bob cannot see it ----------------------------------------------------------------------
    missing = lt.call("GET", "/v1/jobs/job-000000000000", bob)
    for method, url in (
        ("GET", f"/v1/jobs/{alice_job}"),
        ("GET", f"/v1/jobs/{alice_job}/steps/train/logs"),
        ("POST", f"/v1/jobs/{alice_job}/rerun"),
        ("POST", f"/v1/jobs/{alice_job}/cancel"),
    ):
        r = lt.call(method, url, bob)
        assert r.status_code == 404, (method, url, r.text)
        assert r.json()["error"] == missing.json()["error"]
    listed = lt.call("GET", "/v1/jobs", bob).json()["jobs"]
    assert alice_job not in [j["id"] for j in listed]

    # -- ...nor charge Alice's team, nor jump the queue -------------------------------------------
    r = lt.submit(bob, {"name": "x", "team": "nlp", "steps": [{"name": "s", "command": ["true"]}]})
    assert r.status_code == 403 and [e["loc"] for e in r.json()["errors"]] == ["body.team"]
    r = lt.submit(bob, {"name": "x", "priority": 90, "steps": [{"name": "s", "command": ["true"]}]})
    assert r.status_code == 403 and [e["loc"] for e in r.json()["errors"]] == ["body.priority"]

    # -- Bob's step attacks the control plane and Alice's checkpoints ------------------------------
    bob_job = lt.submitted(
        bob,
        {
            "name": "innocent",
            "team": "vision",
            "steps": [
                {"name": "s", "command": [*code(BOB_ATTACK), str(lt.root / "state"), str(checkpoints)]}
            ],
        },
    )
    bob_done = lt.wait_done(bob, bob_job)
    bob_log = lt.logs(bob, bob_job, "s")
    assert bob_done["job"]["state"] == "FAILED", bob_log
    tried = json.loads(bob_log.split("tried: ", 1)[1].splitlines()[0])
    assert tried == {
        "admin.token": "PermissionError",
        "database": "PermissionError",
        "state dir": "PermissionError",
        "alice LATEST": "PermissionError",
    }
    assert "PermissionError: every attempt was refused" in bob_log

    # -- Alice's job resumes from her own checkpoint ----------------------------------------------
    (checkpoints / "proceed").write_text("")
    done = lt.wait_done(alice, alice_job)
    assert done["job"]["state"] == "SUCCEEDED", done
    assert (outputs / "resumed-from").read_text() == str(checkpoints / "ck-alice")

    # -- What Alice's step saw: the contract, its env, its secret; nothing of the operator's -----
    env = json.loads((outputs / "env.json").read_text())
    assert env["WANDB_API_KEY"] == SECRET and env["MY_SETTING"] == "on"
    assert OPERATOR_CREDENTIAL not in env.values()
    extra = {
        k
        for k in env
        if not k.startswith("LOWTIDE_")
        and k
        not in {
            "CUDA_VISIBLE_DEVICES",
            "PATH",
            "LANG",
            "TZ",
            "HOME",
            "USER",
            "LOGNAME",
            "TMPDIR",
            "WANDB_API_KEY",
            "MY_SETTING",
            "LC_CTYPE",  # Python itself may add it (PEP 538)
        }
    }
    assert extra == set()
    assert "LOWTIDE_TOKEN" not in env and env["LOWTIDE_JOB_ID"] == alice_job
    # ...and the secret's value is nowhere lowtide shows or keeps.
    shown = lt.call("GET", f"/v1/jobs/{alice_job}", alice).text + lt.logs(alice, alice_job, "train", 1)
    assert SECRET not in shown and "wandb" in shown
    assert SECRET not in (lt.root / "server.log").read_text()

    # -- A step over its timeout ends FAILED with the reason --------------------------------------
    slow = lt.submitted(
        alice,
        {
            "name": "hangs",
            "team": "nlp",
            "grace_seconds": 1,
            "steps": [{"name": "s", "command": ["sleep", "600"], "timeout": "2s"}],
        },
    )
    hung = lt.wait_done(alice, slow, timeout=60)
    assert hung["job"]["state"] == "FAILED"
    step = next(s for s in hung["steps"] if s["name"] == "s")
    assert step["state"] == "FAILED" and "timed out" in step["reason"], step

    # -- A CPU-only fan-out never runs more than the configured number at once --------------------
    width = 24
    fan = lt.submitted(
        bob,
        {
            "name": "fan-out",
            "team": "vision",
            "steps": [{"name": f"s{i}", "command": ["sleep", "0.3"]} for i in range(width)],
        },
    )
    most = 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        d = lt.detail(bob, fan)
        running = sum(1 for s in d["steps"] if s["state"] in ("RUNNING", "STOPPING"))
        most = max(most, running)
        if d["job"]["state"] in ("SUCCEEDED", "FAILED"):
            break
        time.sleep(0.05)
    assert d["job"]["state"] == "SUCCEEDED"
    assert 1 <= most <= CPU_LIMIT
