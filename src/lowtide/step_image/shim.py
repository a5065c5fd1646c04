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
shim passes `lowtide.io/resume-from` to the step as `LOWTIDE_RESUME_FROM`. The step token is a
secret, so it is no annotation: lowtide writes it into the job's Secret before it admits the pod,
the kubelet mounts the step's key as the file `LOWTIDE_STEP_TOKEN_FILE` (GPU steps only), and the
shim exports its content as `LOWTIDE_STEP_TOKEN` (a missing, empty or unreadable file: no token;
the token is never printed).

Neighbours: `adapters.argo.workflow` puts it in front of the step's argv and sets the variables;
`adapters.argo.exits` reads its code and marker back. The local executor has its own shim
(`adapters.step_shim`), which also records exit files for re-adoption.
Must not: import anything outside the standard library (it runs inside users' images), retry
anything but the notice question below, or read the step's output.

The grace of a notice. Kubernetes does not tell a container the grace of the delete that stopped
it, and lowtide's notice may be shorter than the job's grace (a reclaim gives at most the
service's `reclaim_grace`; a cancel may ask for less). So on SIGTERM the shim asks lowtide:
`GET $LOWTIDE_API_URL/v1/jobs/<job>/steps/<step>/notice` with the step's token, which answers
the seconds left to the attempt's deadline. lowtide deletes the pod before it records the
notice, so "no notice yet" is asked again; the shim waits at most `LOWTIDE_NOTICE_QUERY_S`
(default 2 s, each request at most 1 s) before it writes the notice file and forwards SIGTERM.
Without an answer (no API URL or token — CPU-only steps get no token —, lowtide unreachable) it
assumes the job's grace `LOWTIDE_GRACE_SECONDS`, as before: a shorter notice then ends with the
kubelet's SIGKILL (exit 137, read as the preemption it is) instead of the shim's exit 75.
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
import urllib.parse
import urllib.request
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


#: Longest token file read (a step token is about 50 characters).
_TOKEN_MAX = 4096


def read_token(path: str) -> str | None:
    """The token in `path` (whitespace around it removed); None when the file is missing,
    unreadable, empty or not one short line of text."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(_TOKEN_MAX + 1)
    except OSError:
        return None
    try:
        token = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        return None
    if not token or len(raw) > _TOKEN_MAX or any(c.isspace() or not c.isprintable() for c in token):
        return None
    return token


def step_environment(environ: dict[str, str]) -> dict[str, str]:
    """The step's environment: the shim's own, plus the per-attempt annotations it carries and
    the step token from its file."""
    env = dict(environ)
    token_file = environ.get("LOWTIDE_STEP_TOKEN_FILE")
    if token_file:
        token = read_token(token_file)
        if token is not None:
            env["LOWTIDE_STEP_TOKEN"] = token
    source = environ.get("LOWTIDE_PODINFO_ANNOTATIONS")
    if source:
        annotations = read_annotations(source)
        for annotation, name in ANNOTATION_ENV.items():
            if annotations.get(annotation):
                env[name] = annotations[annotation]
    return env


#: Longest answer read from lowtide's notice endpoint.
_ANSWER_MAX = 4096


def notice_seconds_left(env: dict[str, str], wait_s: float) -> float | None:
    """Seconds left to this attempt's notice deadline, as lowtide's API says (see the module
    docstring); None when it cannot be asked or did not say within `wait_s`."""
    url, token = env.get("LOWTIDE_API_URL"), env.get("LOWTIDE_STEP_TOKEN")
    job, step = env.get("LOWTIDE_JOB_ID"), env.get("LOWTIDE_STEP")
    if not (url and token and job and step) or urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        return None
    quote = urllib.parse.quote
    target = f"{url.rstrip('/')}/v1/jobs/{quote(job, safe='')}/steps/{quote(step, safe='')}/notice"
    request = urllib.request.Request(target, headers={"Authorization": f"Bearer {token}"})  # noqa: S310
    give_up = time.monotonic() + wait_s
    while True:
        asked = time.monotonic()
        try:
            timeout = max(0.05, min(1.0, give_up - asked))
            with urllib.request.urlopen(request, timeout=timeout) as answer:  # noqa: S310 - http(s) checked
                body = json.loads(answer.read(_ANSWER_MAX))
            left = body.get("seconds_left") if isinstance(body, dict) and body.get("noticed") else None
            if isinstance(left, int | float) and left >= 0:
                return max(0.0, float(left) - (time.monotonic() - asked))
        except (OSError, ValueError):
            pass  # unreachable, refused, an error status, a broken answer: ask again
        if time.monotonic() + 0.2 >= give_up:
            return None
        time.sleep(0.2)


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
        self.step_env = step_environment(dict(os.environ))
        self.noticed = threading.Event()
        self.early_signal = False

    def on_sigterm(self, _signum: int, _frame: FrameType | None) -> None:
        if self.noticed.is_set():
            return  # notice is given once; the deadline stands
        self.noticed.set()
        if self.child is None:
            self.early_signal = True  # before the step started: it will not start
            return
        # Asking lowtide takes up to a few seconds: not inside the signal handler.
        threading.Thread(target=self._give_notice, name="lowtide-notice", daemon=True).start()

    def _give_notice(self) -> None:
        learned = notice_seconds_left(self.step_env, wait_s=_float_env("LOWTIDE_NOTICE_QUERY_S", 2.0))
        grace = self.grace_s if learned is None else min(learned, self.grace_s)
        if learned is None and self.step_env.get("LOWTIDE_STEP_TOKEN"):
            sys.stderr.write(
                "lowtide-step-shim: lowtide did not say the notice's deadline; assuming the job's grace\n"
            )
        self._notice(grace)

    def _notice(self, grace: float) -> None:
        deadline = time.time() + grace
        if self.notice_file:
            notice = {
                "deadline": deadline,
                "deadline_iso": datetime.fromtimestamp(deadline, UTC).isoformat(),
                "grace_seconds": grace,
            }
            try:
                _write_atomic(self.notice_file, json.dumps(notice))
            except OSError as exc:  # the signal still goes out: the step learns of it either way
                sys.stderr.write(f"lowtide-step-shim: cannot write notice file: {exc}\n")
        self._signal_group(signal.SIGTERM)
        killer = threading.Timer(grace, self._signal_group, args=(signal.SIGKILL,))
        killer.daemon = True
        killer.start()

    def _signal_group(self, sig: int) -> None:
        if self.child is not None and self.child.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.child.pid, sig)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.on_sigterm)
        try:
            self.child = subprocess.Popen(self.argv, start_new_session=True, env=self.step_env)
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
