"""`lowtide-step-shim -- CMD...`: the entrypoint of a step's container in cluster mode.

Role (docs/cluster.md "The step shim in the image"): Kubernetes tells a container to stop only
with SIGTERM (a pod delete with a grace period), so this shim turns it into lowtide's step
contract. It runs CMD as a child in its own process group and waits. On SIGTERM it writes the
notice file `LOWTIDE_NOTICE_FILE` (JSON `{"deadline", "deadline_iso", "grace_seconds"}`, as the
local executor writes it), forwards SIGTERM to the step's group, gives it
`LOWTIDE_GRACE_SECONDS` and then SIGKILLs the group (the pod's own grace is longer by
`argo.grace_margin_seconds`, so the shim finishes before the kubelet's SIGKILL). It exits:
- 0 when the step exited 0 (before or after notice: exit 0 means done), after writing
  `completed` to `LOWTIDE_RESULT_FILE` (Argo reports it as the output parameter
  `lowtide-result`; a Succeeded node without it is an interrupted one);
- `LOWTIDE_INTERRUPTED_EXIT_CODE` (75) when notice was given and the step did not exit 0
  (Argo's retry expression retries exactly that code);
- else the step's own code (128 + n when a signal killed it), except that a step's own use of
  the interrupted code becomes 1 (only the shim may say "interrupted").

Per-attempt values a Workflow cannot carry (a pod's env is fixed when Argo creates it) arrive as
pod annotations that lowtide sets when it admits the pod; the kubelet writes them to the
downward-API file `LOWTIDE_PODINFO_ANNOTATIONS` before the container starts (one `key="value"`
line each, the value quoted as Go's %q: kubernetes pkg/fieldpath/fieldpath.go `FormatMap`). The
shim passes `lowtide.io/resume-from` to the step as `LOWTIDE_RESUME_FROM`.

Neighbours: `adapters.argo.workflow` puts it in front of the step's argv and sets the variables;
`adapters.argo.exits` reads its code and marker back. The local executor has its own shim
(`adapters.step_shim`), which also records exit files for re-adoption.
Must not: import anything outside the standard library (it runs inside users' images), retry
anything or read the step's output. Limit: Kubernetes does not tell a container the grace of the
delete that stopped it, so the shim assumes the job's grace (`LOWTIDE_GRACE_SECONDS`); a shorter
preemption grace ends with the kubelet's SIGKILL (exit 137) instead of the notice's checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType

INTERRUPTED_DEFAULT = 75  # EX_TEMPFAIL
EXIT_USAGE = 2
EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126
RESULT_COMPLETED = "completed"


def _float_env(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, ""))
    except ValueError:
        return default
    return value if value >= 0 else default


#: Pod annotations the shim turns into the step's environment.
ANNOTATION_ENV = {"lowtide.io/resume-from": "LOWTIDE_RESUME_FROM"}


def read_annotations(path: str) -> dict[str, str]:
    """The pod's annotations from the downward-API file (absent or unreadable: none). A value
    Go quoted with escapes JSON does not know (\\x, \\a) is skipped, never guessed."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, quoted = line.partition("=")
        if not sep or not (quoted.startswith('"') and quoted.endswith('"')):
            continue
        try:
            value = json.loads(quoted)
        except ValueError:
            continue
        if isinstance(value, str):
            found[key] = value
    return found


def step_environment(environ: dict[str, str]) -> dict[str, str]:
    """The step's environment: the shim's own, plus the per-attempt annotations it carries."""
    env = dict(environ)
    source = environ.get("LOWTIDE_PODINFO_ANNOTATIONS")
    if source:
        annotations = read_annotations(source)
        for annotation, name in ANNOTATION_ENV.items():
            if annotations.get(annotation):
                env[name] = annotations[annotation]
    return env


def _write_atomic(path: str, text: str) -> None:
    """Write `text` to `path` atomically, never following a link the step put there."""
    tmp = Path(f"{path}.tmp.{os.getpid()}")
    with contextlib.suppress(OSError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    tmp.replace(path)


class _Shim:
    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.grace_s = _float_env("LOWTIDE_GRACE_SECONDS", 30.0)
        code = os.environ.get("LOWTIDE_INTERRUPTED_EXIT_CODE", "")
        self.interrupted_code = int(code) if code.isdigit() and 1 <= int(code) <= 125 else INTERRUPTED_DEFAULT
        self.notice_file = os.environ.get("LOWTIDE_NOTICE_FILE")
        self.result_file = os.environ.get("LOWTIDE_RESULT_FILE")
        self.child: subprocess.Popen[bytes] | None = None
        self.noticed = threading.Event()
        self.early_signal = False

    def on_sigterm(self, _signum: int, _frame: FrameType | None) -> None:
        if self.noticed.is_set():
            return  # notice is given once; the deadline stands
        self.noticed.set()
        if self.child is None:
            self.early_signal = True  # before the step started: it will not start
            return
        deadline = time.time() + self.grace_s
        if self.notice_file:
            notice = {
                "deadline": deadline,
                "deadline_iso": datetime.fromtimestamp(deadline, UTC).isoformat(),
                "grace_seconds": self.grace_s,
            }
            try:
                _write_atomic(self.notice_file, json.dumps(notice))
            except OSError as exc:  # the signal still goes out: the step learns of it either way
                sys.stderr.write(f"lowtide-step-shim: cannot write notice file: {exc}\n")
        self._signal_group(signal.SIGTERM)
        killer = threading.Timer(self.grace_s, self._signal_group, args=(signal.SIGKILL,))
        killer.daemon = True
        killer.start()

    def _signal_group(self, sig: int) -> None:
        if self.child is not None and self.child.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.child.pid, sig)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.on_sigterm)
        try:
            self.child = subprocess.Popen(
                self.argv, start_new_session=True, env=step_environment(dict(os.environ))
            )
        except FileNotFoundError:
            sys.stderr.write(f"lowtide-step-shim: command not found: {self.argv[0]}\n")
            return EXIT_NOT_FOUND
        except PermissionError:
            sys.stderr.write(f"lowtide-step-shim: cannot execute: {self.argv[0]}\n")
            return EXIT_NOT_EXECUTABLE
        if self.early_signal:  # SIGTERM came while it was being started
            self.early_signal = False
            self.noticed.clear()
            self.on_sigterm(signal.SIGTERM, None)
        returncode = self.child.wait()
        return self.outcome(returncode)

    def outcome(self, returncode: int) -> int:
        if returncode == 0:
            if self.result_file:
                try:
                    _write_atomic(self.result_file, RESULT_COMPLETED)
                except OSError as exc:  # without the marker Argo's node reads as interrupted
                    sys.stderr.write(f"lowtide-step-shim: cannot write result file: {exc}\n")
                    return self.interrupted_code if self.noticed.is_set() else 1
            return 0
        if self.noticed.is_set():
            return self.interrupted_code
        code = 128 - returncode if returncode < 0 else returncode
        return 1 if code == self.interrupted_code else code


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        sys.stderr.write("usage: lowtide-step-shim -- COMMAND [ARG...]\n")
        return EXIT_USAGE
    return _Shim(args).run()


if __name__ == "__main__":
    sys.exit(main())
