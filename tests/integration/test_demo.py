"""`make demo` (scripts/demo.py) compressed to 30 seconds: the dashboard URL and a login token come
first, then the story happens (a replica parks, a job gets notice, checkpoints, resumes, every job
finishes), the report is printed and nothing is left running."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.serial]

REPO = Path(__file__).resolve().parents[2]


def test_the_demo_tells_the_whole_story_and_leaves_nothing_running(tmp_path: Path) -> None:
    demo_dir = tmp_path / "demo"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOWTIDE_", "DEMO_"))}
    env.update(DEMO_MINUTES="0.5", DEMO_DIR=str(demo_dir), DEMO_TORCH="0")
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "demo.py")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    out = done.stdout
    assert done.returncode == 0, out[-4000:] + done.stderr[-2000:]

    # The URL and the token come before the day starts.
    url = re.search(r"dashboard: (http://127\.0\.0\.1:\d+)/ui/", out)
    token = re.search(r"login token: (lt_\S+)", out)
    assert url and token, out[:2000]
    assert out.index("login token:") < out.index("load:") < out.index("submitted")
    assert (demo_dir / "demo.token").read_text().strip() == token.group(1)

    # The story, as the demo counted it from the API, and as the viewer read it.
    report = json.loads((demo_dir / "report.json").read_text())
    assert report["parks"] >= 1, out[-4000:]
    assert report["preemptions"] >= 1 and report["resumes"] >= 1, out[-4000:]
    assert report["jobs"] == 5 and report["jobs_finished"] == 5, out[-4000:]
    assert report["reclaims"] >= 1 and report["research_gpu_hours"] > 0
    for marker in ("park: ", "notice: ", "preempted: ", "resume: ", "done: ", "== the day's report"):
        assert marker in out, marker
    assert re.search(r"GPU-hours harvested by research: \d+\.\d+ GPU-h", out)
    assert re.search(r"jobs finished: 5 of 5", out)
    assert all(r["failed"] == 0 and r["ok"] > 0 for r in report["requests"].values()), report["requests"]

    # Nothing left: lowtide, the gateways, the replicas and the steps are gone.
    assert "nothing left running" in out
    assert not [
        p.pid for p in psutil.process_iter(["cmdline"]) if str(demo_dir) in " ".join(p.info["cmdline"] or [])
    ]
    with pytest.raises(httpx.HTTPError):
        httpx.get(url.group(1) + "/healthz", timeout=2)
