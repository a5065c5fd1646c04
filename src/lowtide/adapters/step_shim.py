"""The step shim: a tiny supervisor that runs one attempt's command and records how it ended.

Run by `adapters.local_executor` as
``python -I -m lowtide.adapters.step_shim --instance ID --attempt N --exit-file PATH -- CMD...``
in a new session, so it leads the attempt's process group and outlives the control plane.
It starts CMD as a child in the same group (a ``killpg`` reaches both), waits for it, writes
``{"exit_code", "signal", "ended_at"}`` atomically to PATH, and exits with the child's code
(128+signal when the child was killed by a signal).

The exit file is what lets a restarted control plane learn how an attempt ended while nobody was
watching: the shim is reparented to init when its parent dies, and a dead process's status is
otherwise lost. ``--instance`` and ``--attempt`` are in the argv so a control plane that crashed
before recording the pid can still find its shims by command line.

Must not: import anything outside the standard library (it starts once per attempt and should
start fast and survive a broken environment), interpret the step's output, or retry anything.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

EXIT_NOT_FOUND = 127  # shell convention: command not found
EXIT_NOT_EXECUTABLE = 126  # shell convention: found but cannot be executed

# Signals seen before the child existed; forwarded once it does (see `_run`).
_pending: list[int] = []


def _remember(signum: int, _frame: FrameType | None) -> None:
    # A real handler, not SIG_IGN: an ignored disposition survives exec and the step would
    # inherit it, whereas a handled one is reset to the default in the child.
    _pending.append(signum)


def _wall() -> float:
    """The wall clock, with the fault-injection offset of ``LOWTIDE_FAULT_CLOCK_OFFSET_FILE`` when
    set (a testing hook: `lowtide.control.clock`, read the same way: a float, else 0)."""
    now = time.time()
    path = os.environ.get("LOWTIDE_FAULT_CLOCK_OFFSET_FILE")
    if not path:
        return now
    try:
        with open(path, encoding="utf-8") as fh:
            offset = float(fh.read(64).strip() or 0.0)
    except (OSError, ValueError):
        return now
    return now + offset if math.isfinite(offset) else now


def _write_exit_file(path: str, exit_code: int | None, sig: int | None) -> None:
    """Write the status atomically so a reader never sees half a file. The temporary file is
    created with O_EXCL | O_NOFOLLOW: the step may own the directory (and, in a container, run
    as another uid than this shim), so a symlink it planted there must never be followed."""
    tmp = Path(f"{path}.tmp.{os.getpid()}")
    payload = {"exit_code": exit_code, "signal": sig, "ended_at": _wall()}
    try:
        tmp.unlink(missing_ok=True)  # removing a planted link does not follow it
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(payload, f)
            f.flush()
            os.fsync(f.fileno())  # the status must survive a machine crash as well as ours
        tmp.replace(path)
    except OSError as exc:
        # Still exit with the right code: a parent that is alive learns it from our status.
        sys.stderr.write(f"lowtide step_shim: cannot write exit file {path!r}: {exc}\n")
        with contextlib.suppress(OSError):
            tmp.unlink()


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lowtide.adapters.step_shim")
    parser.add_argument("--instance", required=True)
    parser.add_argument("--attempt", required=True, type=int)
    parser.add_argument("--exit-file", required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        parser.error("no command given after --")
    args.command = command
    return args


def _run(command: list[str], exit_file: str) -> int:
    try:
        # Same process group as the shim (no new session): a killpg on our group reaches the step.
        child = subprocess.Popen(command)
    except OSError as exc:
        code = EXIT_NOT_FOUND if isinstance(exc, FileNotFoundError) else EXIT_NOT_EXECUTABLE
        sys.stderr.write(f"lowtide step_shim: cannot execute {command[0]!r}: {exc.strerror or exc}\n")
        sys.stderr.flush()
        _write_exit_file(exit_file, code, None)
        return code
    if _pending:
        # A stop arrived before the child could receive it (before the fork, or while the child
        # still ran our code): pass it on. In a narrow window around exec the step may see it
        # twice; a repeated SIGTERM means the same notice.
        for signum in dict.fromkeys(_pending):
            with contextlib.suppress(OSError):
                child.send_signal(signum)
    # wait() is retried across our handler's interruptions (PEP 475).
    returncode = child.wait()
    if returncode < 0:
        _write_exit_file(exit_file, None, -returncode)
    else:
        _write_exit_file(exit_file, returncode, None)
    _footer(returncode)
    return 128 - returncode if returncode < 0 else returncode


def _footer(returncode: int) -> None:
    """Close the log with how the step ended, for whoever reads it."""
    if returncode >= 0:
        what = f"exited with code {returncode}"
    else:
        try:
            what = f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            what = f"was killed by signal {-returncode}"
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(f"=== lowtide: step {what}\n")
        sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _remember)
    args = _parse(sys.argv[1:] if argv is None else argv)
    return _run(args.command, args.exit_file)


if __name__ == "__main__":
    raise SystemExit(main())
