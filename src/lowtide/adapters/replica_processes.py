"""Replica processes: how the local service manager starts, finds and kills inference replicas.

Role: the replica-specific half of process supervision for `adapters.local_services`. A replica
runs under the same supervisor as research steps, `adapters.step_shim`, in its own session and
process group, so it outlives a control-plane crash and its exit status is recorded
(``<work_dir>/replica_exit.json``, `EXIT_FILE`). The shim needs an integer ``--attempt``; replicas
use their own numbering, kept apart from step attempts by the shim's ``--instance``, which for
replicas is ``"<instance id>:replicas"``: `LocalExecutor.reap_orphans` only touches shims of its
own instance id, and `ReplicaProcesses` only shims of the ``:replicas`` one. The number is a stable
32-bit hash of the replica id (the same for every start of a replica, so a restarted control plane
can recognise the shim by its command line); the exact replica id travels in the process
environment (`REPLICA_TAG_ENV`, ``"<instance id> <replica id>"``), which every descendant inherits
(a vLLM engine core too), so leftovers are found even if they left the group. The executor's step
tag (`local_executor.TAG_ENV`) is removed from a replica's environment, so the two never meet.
``<work_dir>/replica_shim.json`` (`SHIM_FILE`) holds the shim's pid and start time for adoption.

Neighbours: `adapters.local_services` (the only user) keeps each replica's phase and decides when
to call what here; `adapters.supervision` holds the mechanics shared with `adapters.local_executor`
(shim command line, pid + start time identity, group signals, tag sweeps, atomic records).

Must not: keep per-replica state or phases, emit events, talk HTTP, decide when to start or kill
anything, or touch processes that are not proven this installation's replicas (a verified shim,
or this instance's tag).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import shlex
import signal
import socket
import subprocess
from collections.abc import Iterable, Iterator
from collections.abc import Set as AbstractSet
from datetime import UTC, datetime
from pathlib import Path

import psutil

from lowtide.adapters.local_executor import TAG_ENV as STEP_TAG_ENV
from lowtide.adapters.supervision import (
    ShimProcess,
    child_env,
    command_problem,
    find_shim,
    identify_child,
    iter_shims,
    kill_orphan_shim,
    kill_tagged,
    live_shim_args,
    process_env,
    read_exit_record,
    read_shim_file,
    reap_exited,
    record_shim,
    shim_argv,
    start_shim,
)
from lowtide.control.executor_port import ProcessIdentity
from lowtide.control.inference_ports import ReplicaLaunch

log = logging.getLogger(__name__)

EXIT_FILE = "replica_exit.json"
SHIM_FILE = "replica_shim.json"
#: ``"<instance id> <replica id>"`` in every replica process's environment (and its descendants').
REPLICA_TAG_ENV = "LOWTIDE_REPLICA_TAG"
SHIM_INSTANCE_SUFFIX = ":replicas"

# Children of this process that no manager watches any more (after `close`), kept referenced so a
# later poll reaps them instead of leaving zombies. Process-wide, as child processes are.
_DETACHED: list[subprocess.Popen[bytes]] = []


class SpawnError(Exception):
    """A replica could not be started at all; the message says why."""


def _shim_number(replica_id: str) -> int:
    """The shim's ``--attempt`` for a replica: stable across starts and control-plane restarts."""
    return int.from_bytes(hashlib.blake2b(replica_id.encode(), digest_size=4).digest(), "big")


def _parse_tag(tag: str | None) -> tuple[str, str] | None:
    if not tag:
        return None
    instance, sep, replica_id = tag.partition(" ")
    return (instance, replica_id) if sep and instance and replica_id else None


def _process_tag(proc: psutil.Process) -> tuple[str, str] | None:
    return _parse_tag(process_env(proc, REPLICA_TAG_ENV))


def _describe_exit(code: int | None, sig: int | None) -> str:
    if sig is not None:
        try:
            return f"was killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"was killed by signal {sig}"
    return f"exited with code {code}"


def _port_taken(port: int) -> bool:
    """True when something already listens on `port` (an old replica would answer our checks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def _launch_problem(launch: ReplicaLaunch, env: dict[str, str], cwd: Path) -> str | None:
    """Why the replica cannot start at all, or None."""
    problem = command_problem(launch.command[0], env, cwd)
    if problem is not None:
        return problem
    if _port_taken(launch.port):
        return f"port {launch.port} is already in use"
    return None


class ReplicaProcesses:
    """The replica processes of one installation; see the module docstring."""

    def __init__(self, instance_id: str, python: str) -> None:
        self.instance_id = instance_id
        self._python = python
        self._shim_instance = instance_id + SHIM_INSTANCE_SUFFIX
        self._reap_later: list[subprocess.Popen[bytes]] = []  # exited shims, reaped by `reap`

    # -- start and end ----------------------------------------------------------------------------

    def spawn(self, launch: ReplicaLaunch, now: float) -> ShimProcess:
        """Start the replica's shim. Raises SpawnError when it cannot start (command not found or
        not executable, port in use, the OS refused)."""
        rid = launch.replica_id
        work_dir = Path(launch.work_dir).absolute()
        # Never let a replica inherit the control plane's view of the GPUs.
        env = child_env(launch.env, launch.gpus)
        env.pop(STEP_TAG_ENV, None)  # a replica is not a research step
        env[REPLICA_TAG_ENV] = f"{self.instance_id} {rid}"
        exit_file = work_dir / EXIT_FILE
        argv = shim_argv(self._python, self._shim_instance, _shim_number(rid), str(exit_file), launch.command)
        try:
            for directory in {work_dir, Path(launch.log_path).absolute().parent}:
                directory.mkdir(parents=True, exist_ok=True)
            problem = _launch_problem(launch, env, work_dir)
            if problem is not None:
                raise SpawnError(problem)
            # Leftovers of the previous run would be read as this one's.
            for stale in (exit_file, work_dir / SHIM_FILE):
                stale.unlink(missing_ok=True)
            stamp = datetime.fromtimestamp(now, UTC).isoformat(timespec="seconds")
            header = (
                f"=== lowtide {stamp}: replica {rid} (model {launch.model}) on {launch.node} gpus "
                f"[{','.join(map(str, launch.gpus))}] port {launch.port}: {shlex.join(launch.command)}\n"
            )
            popen = start_shim(argv, cwd=work_dir, env=env, log_path=launch.log_path, header=header)
        except OSError as exc:
            raise SpawnError(f"cannot start: {exc}") from exc
        try:
            identity = identify_child(popen, self._reap_later)
        except psutil.Error as exc:
            raise SpawnError(f"cannot read the start time of pid {popen.pid}: {exc}") from exc
        fields = {"instance": self.instance_id, "replica_id": rid, "port": launch.port}
        record_shim(work_dir / SHIM_FILE, identity, fields, who=f"replica {rid}")
        return ShimProcess(identity, popen, str(exit_file))

    def ended(self, proc: ShimProcess) -> str:
        """Reap a (swept) shim that has exited and say how it ended."""
        returncode: int | None = None
        if proc.popen is not None:
            returncode = proc.popen.poll()
            if returncode is None:
                self._reap_later.append(proc.popen)  # wrote its status, exits in a moment
        status = read_exit_record(proc.exit_file)
        if status is not None:
            return _describe_exit(status.exit_code, status.signal)
        if returncode is not None and returncode < 0:
            return _describe_exit(None, -returncode)
        if returncode is not None:
            return f"ended without an exit record (shim exit status {returncode})"
        return "ended while nobody watched; exit status unknown"

    def reap(self) -> None:
        """Reap the shims that have exited since they were handed over (`ended`, `detach`)."""
        reap_exited(self._reap_later)
        reap_exited(_DETACHED)

    def detach(self, popens: Iterable[subprocess.Popen[bytes]]) -> None:
        """Stop watching these children (and those waiting to be reaped); a later `reap`, by any
        manager, reaps them when they exit."""
        _DETACHED.extend(popens)
        _DETACHED.extend(self._reap_later)
        self._reap_later = []
        reap_exited(_DETACHED)

    # -- find and kill ----------------------------------------------------------------------------

    def find(self, launch: ReplicaLaunch) -> ShimProcess | None:
        """The running shim of a replica an earlier control plane started, found by its shim file
        or else in the process table; None when it has ended (an exit record) or is not found."""
        replica_id = launch.replica_id
        work_dir = Path(launch.work_dir).absolute()
        exit_file = str(work_dir / EXIT_FILE)
        if read_exit_record(exit_file) is not None:
            return None
        identity = self._find_shim(replica_id, self._read_shim_file(work_dir, replica_id))
        return None if identity is None else ShimProcess(identity, None, exit_file)

    def kill_tagged(
        self, replica_ids: AbstractSet[str] | None, *, spare: AbstractSet[str] = frozenset()
    ) -> list[tuple[psutil.Process, str]]:
        """SIGKILL processes carrying this instance's tag for `replica_ids` (None: any id not in
        `spare`). Returns the processes signalled, with their replica id."""

        def select(value: str) -> str | None:
            tag = _parse_tag(value)
            if tag is None or tag[0] != self.instance_id:
                return None
            if (tag[1] not in replica_ids) if replica_ids is not None else (tag[1] in spare):
                return None
            return tag[1]

        hit = kill_tagged(REPLICA_TAG_ENV, select)
        for proc, replica_id in hit:
            log.info("killed pid %s left by replica %s", proc.pid, replica_id)
        return hit

    def reap_orphans(self, known_ids: set[str]) -> list[str]:
        """SIGKILL the replica processes of this installation whose id is not in `known_ids`."""
        reap_exited(_DETACHED)
        killed: set[str] = set()
        for proc, _number in self._iter_shims():
            tag = _process_tag(proc)
            if tag is None or tag[0] != self.instance_id or tag[1] in known_ids:
                continue
            if not kill_orphan_shim(proc, f"replica {tag[1]}"):
                continue
            log.warning("killed orphan replica %s (shim pid %s)", tag[1], proc.pid)
            killed.add(tag[1])
        # What outlived its shim, or left its group, still carries the tag.
        killed.update(replica_id for _proc, replica_id in self.kill_tagged(None, spare=known_ids))
        return sorted(killed)

    def _iter_shims(self) -> Iterator[tuple[psutil.Process, int]]:
        """Live shims of this installation's replicas: (process, number)."""
        for proc, instance, number in iter_shims():
            if instance == self._shim_instance:
                yield proc, number

    def _is_live_shim(self, identity: ProcessIdentity, replica_id: str) -> bool:
        return live_shim_args(identity) == (self._shim_instance, _shim_number(replica_id))

    def _find_shim(self, replica_id: str, hint: ProcessIdentity | None) -> ProcessIdentity | None:
        if hint is not None and self._is_live_shim(hint, replica_id):
            return hint
        # No (valid) shim file: the earlier control plane may have died before writing it.
        number = _shim_number(replica_id)
        return find_shim(
            lambda proc, instance, found: (
                instance == self._shim_instance
                and found == number
                and _process_tag(proc) == (self.instance_id, replica_id)
            )
        )

    def _read_shim_file(self, work_dir: Path, replica_id: str) -> ProcessIdentity | None:
        found = read_shim_file(work_dir / SHIM_FILE, {"instance": self.instance_id, "replica_id": replica_id})
        return None if found is None else found[0]
