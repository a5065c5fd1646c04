"""The in-image step shim (`lowtide-step-shim`) with real processes and signals: SIGTERM becomes
the notice file and the step's checkpoint; the exit code tells Argo's retry expression whether
the step was interrupted (75), finished (0, with the result marker) or failed (its own code).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from support import Served, embedded, step_attempt_token, wait_until

SHIM = [sys.executable, "-m", "lowtide.step_image.shim", "--"]


def start(tmp_path: Path, step: str, grace: float = 5.0, **env: str) -> subprocess.Popen[bytes]:
    script = tmp_path / "step.py"
    script.write_text(textwrap.dedent(step))
    full = {
        **os.environ,
        "LOWTIDE_NOTICE_FILE": str(tmp_path / "NOTICE"),
        "LOWTIDE_RESULT_FILE": str(tmp_path / "result"),
        "LOWTIDE_GRACE_SECONDS": f"{grace:g}",
        "LOWTIDE_INTERRUPTED_EXIT_CODE": "75",
        **env,
    }
    return subprocess.Popen([*SHIM, sys.executable, str(script)], env=full, cwd=tmp_path)


CHECKPOINTS_ON_NOTICE = """
    import os, signal, sys, time, pathlib
    here = pathlib.Path(__file__).parent
    stop = False
    def term(*_):
        global stop
        stop = True
    signal.signal(signal.SIGTERM, term)
    (here / "ready").write_text("1")
    while not stop:
        time.sleep(0.02)
    notice = pathlib.Path(os.environ["LOWTIDE_NOTICE_FILE"]).read_text()
    (here / "checkpoint").write_text(notice)
    sys.exit(1)  # any non-zero code after notice: interrupted
"""


def test_sigterm_becomes_the_notice_and_an_interrupted_exit(tmp_path: Path) -> None:
    shim = start(tmp_path, CHECKPOINTS_ON_NOTICE, grace=7)
    wait_until((tmp_path / "ready").exists, timeout=20, what="the step to start")
    sent = time.time()
    shim.send_signal(signal.SIGTERM)  # the kubelet, after lowtide deleted the pod
    assert shim.wait(timeout=20) == 75
    notice = json.loads((tmp_path / "checkpoint").read_text())  # the step read it before it left
    assert notice["grace_seconds"] == 7 and sent + 6 <= notice["deadline"] <= time.time() + 7
    assert not (tmp_path / "result").exists()


def test_a_step_that_ignores_notice_is_killed_at_the_grace_and_still_interrupted(tmp_path: Path) -> None:
    stubborn = """
        import signal, time, pathlib
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        (pathlib.Path(__file__).parent / "ready").write_text("1")
        while True:
            time.sleep(0.05)
    """
    shim = start(tmp_path, stubborn, grace=1)
    wait_until((tmp_path / "ready").exists, timeout=20, what="the step to start")
    began = time.monotonic()
    shim.send_signal(signal.SIGTERM)
    assert shim.wait(timeout=20) == 75
    assert time.monotonic() - began >= 0.9  # it had its grace


def test_exit_zero_is_done_with_the_result_marker_even_after_notice(tmp_path: Path) -> None:
    finishes = """
        import signal, sys, time, pathlib
        here = pathlib.Path(__file__).parent
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # it was at its last step anyway
        (here / "ready").write_text("1")
        time.sleep(30)
    """
    shim = start(tmp_path, finishes)
    wait_until((tmp_path / "ready").exists, timeout=20, what="the step to start")
    shim.send_signal(signal.SIGTERM)
    assert shim.wait(timeout=20) == 0
    assert (tmp_path / "result").read_text() == "completed"


@pytest.mark.parametrize(("code", "shim_code"), [(0, 0), (3, 3), (75, 1)])
def test_without_notice_the_steps_own_code_stands_but_never_the_interrupted_one(
    tmp_path: Path, code: int, shim_code: int
) -> None:
    shim = start(tmp_path, f"import sys; sys.exit({code})")
    assert shim.wait(timeout=20) == shim_code
    assert (tmp_path / "result").exists() == (code == 0)
    assert not (tmp_path / "NOTICE").exists()


def test_a_missing_command_and_a_missing_argv_are_clear(tmp_path: Path) -> None:
    missing = subprocess.run(
        [*SHIM, "/no/such/step"], check=False, capture_output=True, text=True, timeout=20
    )
    assert missing.returncode == 127 and "command not found: /no/such/step" in missing.stderr
    usage = subprocess.run(SHIM, check=False, capture_output=True, text=True, timeout=20)
    assert usage.returncode == 2 and "usage: lowtide-step-shim" in usage.stderr


def test_the_resume_point_set_at_admission_reaches_the_step(tmp_path: Path) -> None:
    # The kubelet's downward-API file: one key="value" line per annotation, values quoted as Go's %q.
    podinfo = tmp_path / "annotations"
    podinfo.write_text(
        'kubectl.kubernetes.io/note="a \\"quoted\\" word"\n'
        'lowtide.io/resume-from="s3://research/jobs/j/train/checkpoints/step-50"\n'
        'workflows.argoproj.io/node-id="j-123"'
    )
    prints = "import os, pathlib; pathlib.Path('seen').write_text(os.environ.get('LOWTIDE_RESUME_FROM', '-'))"
    shim = start(tmp_path, prints, LOWTIDE_PODINFO_ANNOTATIONS=str(podinfo))
    assert shim.wait(timeout=20) == 0
    assert (tmp_path / "seen").read_text() == "s3://research/jobs/j/train/checkpoints/step-50"


def test_no_annotations_file_leaves_the_environment_as_it_is(tmp_path: Path) -> None:
    prints = "import os, pathlib; pathlib.Path('seen').write_text(os.environ.get('LOWTIDE_RESUME_FROM', '-'))"
    shim = start(tmp_path, prints, LOWTIDE_PODINFO_ANNOTATIONS=str(tmp_path / "absent"))
    assert shim.wait(timeout=20) == 0
    assert (tmp_path / "seen").read_text() == "-"


PRINTS_TOKEN = (
    "import os, pathlib; pathlib.Path('seen').write_text(os.environ.get('LOWTIDE_STEP_TOKEN', '-'))"
)


def test_the_step_token_from_the_mounted_secret_reaches_the_step_unprinted(tmp_path: Path) -> None:
    # The kubelet's secret volume: the step's key of the job's Secret, as one file (no newline).
    token_file = tmp_path / "token"
    token_file.write_text("lt_step_0123456789abcdefghijklmnopqrstuv")
    env = {"LOWTIDE_STEP_TOKEN_FILE": str(token_file)}
    step = f"{PRINTS_TOKEN}; print('step done')"
    result = subprocess.run(
        [*SHIM, sys.executable, "-c", step],
        env={**os.environ, **env},
        cwd=tmp_path,
        check=False,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "seen").read_text() == "lt_step_0123456789abcdefghijklmnopqrstuv"
    assert "lt_step_" not in result.stdout.replace("step done", "") and "lt_step_" not in result.stderr


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (None, "missing: a CPU-only step, or no token for this attempt"),
        (b"", "empty"),
        (b"two words", "not one token"),
        (b"\xff\xfe", "not text"),
        (b"x" * 5000, "too long for a token"),
        ("dir", "unreadable (a directory: the read fails)"),
    ],
)
def test_no_usable_token_file_means_no_token(tmp_path: Path, content: bytes | str | None, why: str) -> None:
    token_file = tmp_path / "token"
    if content == "dir":
        token_file.mkdir()
    elif isinstance(content, bytes):
        token_file.write_bytes(content)
    env = {k: v for k, v in os.environ.items() if k != "LOWTIDE_STEP_TOKEN"}
    env["LOWTIDE_STEP_TOKEN_FILE"] = str(token_file)
    result = subprocess.run(
        [*SHIM, sys.executable, "-c", PRINTS_TOKEN], env=env, cwd=tmp_path, check=False, timeout=20
    )
    assert result.returncode == 0, why
    assert (tmp_path / "seen").read_text() == "-", why


STUBBORN_RECORDS_NOTICE = """
    import os, signal, time, pathlib
    here = pathlib.Path(__file__).parent
    def term(*_):
        (here / "notice-seen").write_text(pathlib.Path(os.environ["LOWTIDE_NOTICE_FILE"]).read_text())
    signal.signal(signal.SIGTERM, term)
    (here / "ready").write_text("1")
    while True:
        time.sleep(0.05)
"""


def test_the_shim_learns_a_shorter_notice_from_lowtide_and_exits_75_before_the_kubelet_would_kill(
    tmp_path: Path,
) -> None:
    """A reclaim gives less than the job's grace (min(job grace, reclaim_grace)); the pod's own
    grace is the job's + margin, so a shim assuming the job's grace would be SIGKILLed by the
    kubelet first (exit 137). It asks lowtide's API, which lowtide answers only once it recorded
    the notice (after the pod delete): the shim asks again until it does."""
    (tmp_path / "lt").mkdir()
    lt = embedded(tmp_path / "lt")
    served = Served(lt.app)
    try:
        _, admin = lt.store.create_token(name="root", owner="root", role="admin", now=lt.clock.now())
        spec = {"name": "j", "steps": [{"name": "prep", "command": ["true"]}]}
        submitted = httpx.post(
            f"{served.url}/v1/jobs", json=spec, headers={"Authorization": f"Bearer {admin}"}
        )
        assert submitted.status_code == 201, submitted.text
        job = submitted.json()["id"]
        attempt_id, token = step_attempt_token(lt, job, "prep")
        env = {
            "LOWTIDE_API_URL": served.url,
            "LOWTIDE_STEP_TOKEN": token,
            "LOWTIDE_JOB_ID": job,
            "LOWTIDE_STEP": "prep",
            "LOWTIDE_NOTICE_QUERY_S": "5",
        }
        shim = start(tmp_path, STUBBORN_RECORDS_NOTICE, grace=300, **env)
        wait_until((tmp_path / "ready").exists, timeout=20, what="the step to start")
        began = time.monotonic()
        shim.send_signal(signal.SIGTERM)  # the kubelet, right after lowtide deleted the pod
        time.sleep(0.5)  # ... and lowtide records the notice a moment later
        lt.store.mark_stopping(
            attempt_id, deadline=lt.clock.now() + 2.0, reason="GPUs reclaimed", now=lt.clock.now()
        )
        assert shim.wait(timeout=30) == 75
        took = time.monotonic() - began
        notice = json.loads((tmp_path / "notice-seen").read_text())
        assert 1.0 <= notice["grace_seconds"] <= 2.0  # lowtide's deadline, not the job's 300 s
        assert took < 10  # killed at lowtide's deadline, far from the job's grace
    finally:
        served.close()
        lt.close()


def test_without_an_answer_from_lowtide_the_shim_assumes_the_jobs_grace(tmp_path: Path) -> None:
    with socket.socket() as closed:  # a port nothing listens on: connection refused
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    env = {
        "LOWTIDE_API_URL": url,
        "LOWTIDE_STEP_TOKEN": "lt_step_x",
        "LOWTIDE_JOB_ID": "job-0123456789ab",
        "LOWTIDE_STEP": "prep",
        "LOWTIDE_NOTICE_QUERY_S": "0.5",
    }
    shim = start(tmp_path, CHECKPOINTS_ON_NOTICE, grace=7, **env)
    wait_until((tmp_path / "ready").exists, timeout=20, what="the step to start")
    shim.send_signal(signal.SIGTERM)
    assert shim.wait(timeout=20) == 75
    assert json.loads((tmp_path / "checkpoint").read_text())["grace_seconds"] == 7
