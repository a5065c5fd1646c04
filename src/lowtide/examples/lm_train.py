"""Example step "lm_train": a tiny character language model, trained with PyTorch on the CPU when
torch is importable (`--backend torch`), else with numpy (`--backend numpy`; `auto` picks).

The corpus is generated from a seed (no download). The model predicts the next character from the
previous one (torch: embedding → linear, AdamW; numpy: a bigram logit table, SGD). It honours
lowtide's step contract like `lowtide.examples.train`: on SIGTERM (notice) it finishes the current
step, saves a checkpoint (`step-000123.pt` / `.npz`) to $LOWTIDE_CHECKPOINT_DIR, then its manifest
(`<label>.manifest.json` with size and sha256), then names it in LATEST, and exits 143; it also
checkpoints every --checkpoint-every steps and resumes from $LOWTIDE_RESUME_FROM. Each step does
real work, then sleeps the rest of --step-seconds (standing in for a GPU step), so a run's length
is predictable. The model and its loss go to --out/model.json.

Usage: python -m lowtide.examples.lm_train --out DIR [--steps 300] [--backend auto|torch|numpy]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import math
import os
import random
import signal
import sys
import time
from typing import Any

from lowtide.examples.artifact_io import join, write_json, write_text
from lowtide.examples.train import report

stop_requested = False
WORDS = (
    "the",
    "tide",
    "goes",
    "out",
    "and",
    "gpus",
    "come",
    "back",
    "research",
    "runs",
    "while",
    "service",
    "sleeps",
)


def _on_sigterm(_signum: int, _frame: object) -> None:
    global stop_requested
    stop_requested = True


def corpus(seed: int, size: int = 20000) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(size // 5))[:size]


class NumpyModel:
    """Bigram logits W[prev, next], softmax cross-entropy, plain SGD."""

    def __init__(self, vocab: int, lr: float) -> None:
        self.np: Any = importlib.import_module("numpy")
        self.w = self.np.zeros((vocab, vocab))
        self.lr = lr

    def step(self, x: list[int], y: list[int]) -> float:
        np = self.np
        logits = self.w[x]
        logits = logits - logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        loss = float(-np.log(p[np.arange(len(y)), y] + 1e-12).mean())
        p[np.arange(len(y)), y] -= 1.0
        np.add.at(self.w, x, -self.lr * p)
        return loss

    def save(self, path: str) -> None:
        with open(path, "wb") as fh:
            self.np.save(fh, self.w)

    def load(self, path: str) -> None:
        with open(path, "rb") as fh:
            self.w = self.np.load(fh)


class TorchModel:
    """Embedding → linear next-character model, AdamW, one CPU thread."""

    def __init__(self, vocab: int, lr: float) -> None:
        self.torch: Any = importlib.import_module("torch")
        torch = self.torch
        torch.set_num_threads(1)
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Embedding(vocab, 32), torch.nn.Linear(32, vocab))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)

    def step(self, x: list[int], y: list[int]) -> float:
        torch = self.torch
        logits = self.model(torch.tensor(x))
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor(y))
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return float(loss.item())

    def save(self, path: str) -> None:
        self.torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict()}, path)

    def load(self, path: str) -> None:
        state = self.torch.load(path, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])


def pick_backend(name: str) -> str:
    if name != "auto":
        return name
    try:
        importlib.import_module("torch")
    except ImportError:
        return "numpy"
    return "torch"


def save_checkpoint(ckpt_dir: str, model: NumpyModel | TorchModel, step: int, loss: float, ext: str) -> str:
    label = f"step-{step:06d}.{ext}"
    path = join(ckpt_dir, label)
    os.makedirs(ckpt_dir, exist_ok=True)
    model.save(path)
    write_text(join(ckpt_dir, label + ".meta.json"), json.dumps({"step": step, "loss": loss}))
    files = []
    for name in (label, label + ".meta.json"):
        with open(join(ckpt_dir, name), "rb") as fh:
            raw = fh.read()
        files.append({"path": name, "size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()})
    manifest = {"format": "lowtide-checkpoint-manifest/1", "files": files}
    write_json(join(ckpt_dir, label + ".manifest.json"), manifest)  # after the files it lists
    write_text(join(ckpt_dir, "LATEST"), label + "\n")  # last: LATEST never names a partial file
    report(label, f"step {step}")
    return label


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--checkpoint-every", type=int, default=50)
    ap.add_argument("--step-seconds", type=float, default=0.02, help="least wall time per step")
    ap.add_argument("--backend", choices=["auto", "torch", "numpy"], default="auto")
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _on_sigterm)

    backend = pick_backend(args.backend)
    text = corpus(args.seed)
    chars = sorted(set(text))
    ids = [chars.index(c) for c in text]
    model: NumpyModel | TorchModel = (
        TorchModel(len(chars), args.lr) if backend == "torch" else NumpyModel(len(chars), args.lr * 20)
    )
    ext = "pt" if backend == "torch" else "npy"
    ckpt_dir = os.environ.get("LOWTIDE_CHECKPOINT_DIR")
    step, loss = 0, math.log(len(chars))
    resume = os.environ.get("LOWTIDE_RESUME_FROM")
    if resume and os.path.exists(resume) and resume.endswith(f".{ext}"):
        model.load(resume)
        with open(resume + ".meta.json", encoding="utf-8") as fh:
            meta = json.load(fh)
        step, loss = int(meta["step"]), float(meta["loss"])
        print(f"lm_train: resumed from {os.path.basename(resume)} at step {step}", flush=True)
    print(
        f"lm_train: backend {backend}, GPUs [{os.environ.get('CUDA_VISIBLE_DEVICES', '')}], "
        f"steps {step}..{args.steps}, vocab {len(chars)}",
        flush=True,
    )
    while step < args.steps:
        began = time.monotonic()
        rng = random.Random(1_000_003 * step + args.seed)
        starts = [rng.randrange(len(ids) - 1) for _ in range(args.batch)]
        loss = model.step([ids[i] for i in starts], [ids[i + 1] for i in starts])
        step += 1
        if step % 25 == 0:
            print(f"lm_train: step {step} loss {loss:.4f}", flush=True)
        time.sleep(max(0.0, args.step_seconds - (time.monotonic() - began)))
        if stop_requested:
            if ckpt_dir:
                label = save_checkpoint(ckpt_dir, model, step, loss, ext)
                print(f"lm_train: notice received; checkpointed {label}; exiting", flush=True)
            return 143
        if ckpt_dir and step % args.checkpoint_every == 0:
            save_checkpoint(ckpt_dir, model, step, loss, ext)
    write_json(join(args.out, "model.json"), {"backend": backend, "steps": step, "loss": loss})
    print(f"lm_train: done after {step} steps; loss {loss:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
