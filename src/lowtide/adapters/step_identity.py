"""Who a step runs as and what it sees: its clean environment, its private directories, its uid.

Role (docs/architecture.md §6.4): the effects behind step isolation in the embedded mode.

- `step_environment_for`: the whole environment of a step process, built from nothing: the
  allowlist of lowtide's own environment (PATH, LANG, LC_*, TZ and `executor.env_allowlist`,
  trailing ``*`` globs), HOME/USER/LOGNAME/TMPDIR of the step, the contract
  (`control.contract.step_environment`, which holds the spec's ``env``) and the executor's tag.
  Nothing else of lowtide's environment (operator credentials, LOWTIDE_TOKEN) reaches a step.
  `adapters.supervision.child_env` (the replicas' environment) is unchanged.
- `resolve_job_users`: `executor.run_as` looked up once (``pwd.getpwnam``) at start-up; steps of
  a job then run as uid ``job_uid_base + serial`` (`control.executor_port.JobUsers`).
- `make_shared_dir`, `own_tree`: the directories a step may enter. Shared levels (the work root's
  and artifact root's ``jobs`` dirs, a job's and a step's work dir parents) are owned by lowtide
  with mode 0711: traversable, not listable. A job's private trees (an attempt's work dir, the
  job's local artifact dir) belong to its uid with mode 0700. They are walked with ``openat`` and
  ``O_NOFOLLOW`` one level at a time, so a step that swaps a directory of its own for a symlink
  cannot make lowtide (root) create, chown or chmod anything outside its tree.
- `safe_write_json`: lowtide writing a file into a directory a step owns (the notice, the shim
  record) creates its temporary file with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and renames it over
  the target: a symlink planted by the step is never followed (a plain ``open("w")`` as root would
  truncate whatever it points to).
- `is_regular_file`: lowtide reads files a step could replace (its exit status) only when they
  are regular files, so a FIFO cannot block the control loop (a narrow race remains between the
  check and the read; noted in §6.4).

Linux semantics relied on (Python 3.11 ``subprocess`` docs: ``user``, ``group``,
``extra_groups`` and ``umask`` of ``Popen`` need the privilege to setuid/setgid/setgroups, i.e.
root; ``os.open`` ``dir_fd`` and ``O_NOFOLLOW``; open(2): ``O_CREAT | O_EXCL`` fails with EEXIST
when the path exists, "including a symbolic link", and is not followed; rename(2) replaces the
directory entry and does not follow a symlink at the destination).

Neighbours: `adapters.local_executor` calls all of it; `wiring` calls `resolve_job_users`.
Must not: decide anything about scheduling, read configuration itself, touch the store, or follow a
symlink in a directory a step can write.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pwd
import stat
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from lowtide.control.executor_port import JOB_UID_SPAN, JobUsers, RunAs

#: What every step gets from lowtide's environment, besides `executor.env_allowlist`.
BASE_ALLOWLIST: tuple[str, ...] = ("PATH", "LANG", "LC_*", "TZ")
#: The per-attempt temporary directory (TMPDIR) inside the work dir.
TMP_SUBDIR = "tmp"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def allowed(name: str, patterns: Iterable[str]) -> bool:
    """True if `name` is one of `patterns` or starts with a pattern's prefix before its ``*``."""
    return any(
        name.startswith(pattern[:-1]) if pattern.endswith("*") else name == pattern for pattern in patterns
    )


def current_user() -> str:
    """The name of lowtide's own user (USER/LOGNAME of steps without `executor.run_as`)."""
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


def step_environment_for(
    contract: Mapping[str, str],
    *,
    gpus: Iterable[int],
    allowlist: Sequence[str],
    home: str,
    tmp_dir: str,
    user: str,
    tag: tuple[str, str],
    base: Mapping[str, str] | None = None,
    keep: Iterable[str] = (),
) -> dict[str, str]:
    """The complete environment of a step process (module docstring). `base` is lowtide's own
    environment (default ``os.environ``); `keep` names further variables taken from it as they
    are (a container client's DOCKER_HOST, its HOME). CUDA_VISIBLE_DEVICES names `gpus` unless
    the contract sets it."""
    source = os.environ if base is None else base
    patterns = (*BASE_ALLOWLIST, *allowlist)
    env = {k: v for k, v in source.items() if allowed(k, patterns)}
    env.setdefault("PATH", os.defpath)
    env.update({"HOME": home, "USER": user, "LOGNAME": user, "TMPDIR": tmp_dir})
    for name in keep:
        if name in source:
            env[name] = source[name]
    env.update(contract)
    if "CUDA_VISIBLE_DEVICES" not in contract:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in sorted(gpus))
    env[tag[0]] = tag[1]
    return env


def resolve_job_users(name: str, uid_base: int) -> JobUsers:
    """`executor.run_as` as data for the loop. Raises LookupError for an unknown user and
    ValueError when the uid range collides with existing users' uids."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise LookupError(f"no Unix user named {name!r} (create it: useradd --system {name})") from None
    if entry.pw_uid == 0:
        raise ValueError(f"{name!r} is root; steps must run unprivileged")
    if uid_base <= entry.pw_uid < uid_base + JOB_UID_SPAN:
        raise ValueError(f"user {name!r} has uid {entry.pw_uid}, inside the job uid range")
    return JobUsers(user=name, gid=entry.pw_gid, uid_base=uid_base)


# -- directories ----------------------------------------------------------------------------------


def make_shared_dir(path: Path) -> None:
    """Create `path` (and its parents) and, when lowtide owns it, make it 0711: every job's uid
    may pass through it, none may list or write it. ``/`` and top-level directories are never
    changed (a work root at ``/`` would otherwise chmod them)."""
    path.mkdir(parents=True, exist_ok=True)
    if len(path.absolute().parts) < 3:
        return
    st = path.lstat()
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != 0o711:
        path.chmod(0o711)


def _own_fd(fd: int, owner: RunAs) -> None:
    st = os.fstat(fd)
    if st.st_uid != owner.uid or st.st_gid != owner.gid:
        os.fchown(fd, owner.uid, owner.gid)
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.fchmod(fd, 0o700)


def _enter(name: str, dir_fd: int | None) -> int:
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise OSError(exc.errno, f"{name!r} is not a plain directory (a symlink?)") from exc
        raise


def own_tree(root: Path, subdirs: Iterable[PurePosixPath], owner: RunAs) -> None:
    """Create `root` (whose parent lowtide owns) and each relative `subdirs` path below it, every
    level owned by `owner` with mode 0700, without following a symlink anywhere inside."""
    root_fd = _enter(str(root), None)
    try:
        _own_fd(root_fd, owner)
        for sub in subdirs:
            fd = os.dup(root_fd)
            try:
                for part in sub.parts:
                    if part in ("", ".", "..", "/"):
                        raise ValueError(f"{sub} is not a plain relative path")
                    nxt = _enter(part, fd)
                    os.close(fd)
                    fd = nxt
                    _own_fd(fd, owner)
            finally:
                os.close(fd)
    finally:
        os.close(root_fd)


def relative_below(path: str, root: str) -> PurePosixPath | None:
    """`path` relative to `root` when it lies strictly below it, else None."""
    p, r = PurePosixPath(path.removeprefix("file://")), PurePosixPath(root.removeprefix("file://"))
    try:
        rel = p.relative_to(r)
    except ValueError:
        return None
    return rel if rel.parts else None


# -- files ----------------------------------------------------------------------------------------


def safe_write_json(path: str | Path, payload: Mapping[str, Any], *, mode: int = 0o644) -> None:
    """Write tmp + rename without following symlinks (module docstring). Raises OSError."""
    tmp = Path(f"{path}.tmp.{os.getpid()}")
    tmp.unlink(missing_ok=True)  # a leftover (or a planted link): removing a link never follows it
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(payload, f)
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def is_regular_file(path: str | Path) -> bool:
    """True if `path` exists and is a regular file (not a link, FIFO or device)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
