"""The demo's language-model trainer (lowtide.examples.lm_train) keeps the step contract: on
SIGTERM it checkpoints (file, manifest with sizes and hashes, then LATEST) and exits 143; a new
attempt resumes from the checkpoint; a finished run writes model.json and exits 0."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import require_service


def run(tmp_path: Path, backend: str, *args: str, resume: str | None = None) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWTIDE_")}
    env["LOWTIDE_CHECKPOINT_DIR"] = str(tmp_path / "ckpt")
    if resume:
        env["LOWTIDE_RESUME_FROM"] = resume
    cmd = [sys.executable, "-m", "lowtide.examples.lm_train", "--out", str(tmp_path / "out")]
    return subprocess.Popen(
        [*cmd, "--backend", backend, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def check_trainer(tmp_path: Path, backend: str) -> None:
    p = run(tmp_path, backend, "--steps", "100000", "--step-seconds", "0.01", "--checkpoint-every", "100000")
    assert p.stdout is not None
    assert "backend " + backend in p.stdout.readline()
    time.sleep(0.3)
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=60)[0]
    assert p.returncode == 143, out
    ckpt = tmp_path / "ckpt"
    label = (ckpt / "LATEST").read_text().strip()
    manifest = json.loads((ckpt / f"{label}.manifest.json").read_text())
    assert manifest["format"] == "lowtide-checkpoint-manifest/1"
    for f in manifest["files"]:
        raw = (ckpt / f["path"]).read_bytes()
        assert (len(raw), hashlib.sha256(raw).hexdigest()) == (f["size"], f["sha256"])
    step = json.loads((ckpt / f"{label}.meta.json").read_text())["step"]

    p = run(tmp_path, backend, "--steps", str(step + 30), "--step-seconds", "0", resume=str(ckpt / label))
    out = p.communicate(timeout=60)[0]
    assert p.returncode == 0, out
    assert f"at step {step}" in out
    model = json.loads((tmp_path / "out" / "model.json").read_text())
    assert model["steps"] == step + 30 and model["backend"] == backend


def test_numpy_trainer_checkpoints_on_notice_and_resumes(tmp_path: Path) -> None:
    check_trainer(tmp_path, "numpy")


@pytest.mark.slow  # two imports of torch: seconds each on a busy machine
def test_torch_trainer_checkpoints_on_notice_and_resumes(tmp_path: Path) -> None:
    try:
        import torch  # noqa: F401, PLC0415 (optional: make test and make demo install the CPU wheel)
    except ImportError:
        require_service("torch", "PyTorch is not installed (make test installs torch==2.13.0, the CPU wheel)")
    check_trainer(tmp_path, "torch")
