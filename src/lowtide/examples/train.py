"""Example step "train": a small pure-Python trainer that honours lowtide's step contract.

It fits a linear model with mini-batch SGD. The batch for step k is chosen from k alone, so an
interrupted run that resumes from its checkpoint ends with exactly the same weights as an
uninterrupted one. On SIGTERM (lowtide's notice) it finishes the current step, writes a
checkpoint to $LOWTIDE_CHECKPOINT_DIR, then its manifest (`<label>.manifest.json`: size and
sha256 of the file, docs/architecture.md §6.2), then names it in LATEST, and exits 143
(non-zero: "interrupted", never "done"). It also checkpoints every --checkpoint-every steps. On
start it resumes from $LOWTIDE_RESUME_FROM, which lowtide sets only to a checkpoint it verified
(run by hand, without lowtide, it reads LATEST itself).

Usage: python -m lowtide.examples.train --data DIR --out DIR [--steps 200] [--lr 0.05] [--step-seconds 0.01]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import signal
import sys
import time
import urllib.request
from typing import Any

from lowtide.examples.artifact_io import join, list_names, read_json, read_text, write_json, write_text

stop_requested = False


def _on_sigterm(_signum: int, _frame: object) -> None:
    global stop_requested
    stop_requested = True


def load_rows(data_dir: str) -> list[list[float]]:
    rows: list[list[float]] = []
    for name in list_names(data_dir):
        if name.startswith("shard-"):
            rows.extend(read_json(join(data_dir, name)))
    if not rows:
        raise SystemExit(f"train: no shards in {data_dir}")
    return rows


def batch_for(step: int, n: int, size: int) -> list[int]:
    rng = random.Random(1_000_003 * step + 17)
    return [rng.randrange(n) for _ in range(size)]


def sgd_step(w: list[float], rows: list[list[float]], idx: list[int], lr: float) -> float:
    g = [0.0, 0.0, 0.0]
    loss = 0.0
    for i in idx:
        x1, x2, y = rows[i]
        err = w[0] * x1 + w[1] * x2 + w[2] - y
        loss += err * err
        g[0] += 2 * err * x1
        g[1] += 2 * err * x2
        g[2] += 2 * err
    for j in range(3):
        w[j] -= lr * g[j] / len(idx)
    return loss / len(idx)


def save_checkpoint(ckpt_dir: str, state: dict[str, Any]) -> str:
    label = f"step-{state['step']:06d}.json"
    data = json.dumps(state, indent=2, sort_keys=True)
    write_text(join(ckpt_dir, label), data)
    raw = data.encode("utf-8")
    manifest = {
        "format": "lowtide-checkpoint-manifest/1",
        "files": [{"path": label, "size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}],
    }
    write_json(join(ckpt_dir, label + ".manifest.json"), manifest)  # after the files it lists
    write_text(join(ckpt_dir, "LATEST"), label + "\n")  # written last: LATEST never names a partial file
    report(label, f"step {state['step']}")
    return label


def report(label: str, progress: str) -> None:
    """Best effort: tell the API too (the LATEST file alone is enough for lowtide)."""
    url, token = os.environ.get("LOWTIDE_API_URL"), os.environ.get("LOWTIDE_STEP_TOKEN")
    job, step = os.environ.get("LOWTIDE_JOB_ID"), os.environ.get("LOWTIDE_STEP")
    if not (url and token and job and step):
        return
    req = urllib.request.Request(
        f"{url}/v1/jobs/{job}/steps/{step}/checkpoints",
        data=json.dumps({"label": label, "progress": progress}).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST",
    )
    with contextlib.suppress(OSError):
        urllib.request.urlopen(req, timeout=2).close()


def resume_point(ckpt_dir: str | None) -> dict[str, Any] | None:
    source = os.environ.get("LOWTIDE_RESUME_FROM")
    if not source and ckpt_dir and not os.environ.get("LOWTIDE_JOB_ID"):  # by hand, not under lowtide
        latest = read_text(join(ckpt_dir, "LATEST"))
        if latest and latest.strip():
            source = join(ckpt_dir, latest.strip())
    if not source:
        return None
    state = read_json(source)
    if not isinstance(state, dict):
        print(f"train: checkpoint {source} is unreadable; starting over", flush=True)
        return None
    return state


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--checkpoint-every", type=int, default=50)
    ap.add_argument("--step-seconds", type=float, default=0.01, help="simulated work per step")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _on_sigterm)

    ckpt_dir = os.environ.get("LOWTIDE_CHECKPOINT_DIR")
    rows = load_rows(args.data)
    w = [0.0, 0.0, 0.0]
    step = 0
    updates = 0
    state = resume_point(ckpt_dir)
    if state is not None:
        w = [float(v) for v in state["w"]]
        step = int(state["step"])
        updates = int(state["updates"])
        print(f"train: resumed at step {step} (attempt {os.environ.get('LOWTIDE_ATTEMPT')})", flush=True)
    cuda = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    print(f"train: GPUs [{cuda}] steps {step}..{args.steps} lr {args.lr}", flush=True)

    loss = float("nan")
    while step < args.steps:
        loss = sgd_step(w, rows, batch_for(step, len(rows), args.batch), args.lr)
        step += 1
        updates += 1
        time.sleep(args.step_seconds)
        snapshot = {"step": step, "updates": updates, "w": w, "loss": loss}
        if stop_requested:
            if ckpt_dir:
                label = save_checkpoint(ckpt_dir, snapshot)
                print(f"train: notice received; checkpointed {label}; exiting", flush=True)
            return 143
        if ckpt_dir and step % args.checkpoint_every == 0:
            save_checkpoint(ckpt_dir, snapshot)

    write_json(join(args.out, "model.json"), {"w": w, "steps": step, "updates": updates, "loss": loss})
    print(f"train: done after {step} steps; loss {loss:.5f}; w = {[round(v, 4) for v in w]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
