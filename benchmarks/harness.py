"""What the benchmark scripts share: percentiles, free ports, and cleaning up after a `lowtide up`.

Step and replica processes outlive the control plane by design, so a benchmark that starts
`lowtide up` marks it with an environment variable (`MARKER_ENV`), which every process it starts
inherits, and afterwards kills and lists what still carries the marker. Imported by the scripts
in this folder (run as `python benchmarks/NAME.py`, so this folder is on `sys.path`).
Must not: assert anything about time (benchmarks print and write figures; docs/architecture.md §10).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess

import psutil

MARKER_ENV = "LOWTIDE_BENCH_RUN"  # set on the server; its steps and replicas inherit it


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list (NaN when empty)."""
    if not sorted_values:
        return float("nan")
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM, then SIGKILL of its whole group if it has not exited within `timeout`."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def marked_processes(marker: str) -> list[psutil.Process]:
    """Processes whose environment carries this run's marker (the server and what it started)."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error):
            if proc.pid != os.getpid() and proc.environ().get(MARKER_ENV) == marker:
                found.append(proc)
    return found


def kill_marked(marker: str) -> int:
    """Kill what this run's server started (by process group, then singly); the groups killed."""
    procs = marked_processes(marker)
    groups: set[int] = set()
    for p in procs:
        with contextlib.suppress(psutil.Error, OSError):
            groups.add(os.getpgid(p.pid))
    own = os.getpgid(0)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pgid in groups - {own}:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)
        _, alive = psutil.wait_procs(procs, timeout=5)
        if not alive:
            break
        procs = alive
    return len(groups)


def ps_leftovers(marker: str) -> list[str]:
    """`ps` lines (with environment) of anything still carrying the marker."""
    out = subprocess.run(["ps", "eww", "-e", "-o", "pid=,args="], capture_output=True, text=True, check=False)
    needle = f"{MARKER_ENV}={marker}"
    return [line.strip()[:160] for line in out.stdout.splitlines() if needle in line]
