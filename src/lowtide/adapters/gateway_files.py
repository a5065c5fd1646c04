"""The two files between lowtide and its gateway process: the routing table and the status.

Role: the documents the control plane (`gateway_supervisor`) and the gateway process
(`gateway_process`) exchange through the private state dir, as typed values, and how each is
written and read.

- **Routing table** (`routes.json`, written by lowtide only): a `generation` that grows with every
  change, the shutdown grace, and per service where it listens (host, port), its upstream read
  timeout, its hold queue (`hold_max`, `hold_timeout_s`) and the replicas that take new requests
  (`replica id -> url`, state `serving`; a replica taken out is simply absent: the gateway keeps
  counting what it still has in flight, which is the drain). Written atomically and durably:
  a temporary file in the same directory (mode 0600, `O_EXCL | O_NOFOLLOW`), `fsync`, `rename`
  over the old one, `fsync` of the directory (POSIX rename(2) replaces atomically: a reader sees
  the old table or the new one, never half of one; Linux ext4/xfs need the directory fsync for
  the rename itself to survive a machine crash).
- **Status** (`status-<nonce>.json`, written by one gateway process): its pid and build, the
  routing generation it has applied, what each service's listener did (port bound, or the error),
  `held_total` (requests that ever started waiting: a rise is new demand) and per service the
  requests held now, in flight per replica and upstream failures in a row per replica. Rewritten
  atomically (rename, no fsync: it describes a live process and is worthless after a crash).

Readers never raise on a bad or missing file: they return None (the caller keeps what it had).
Neighbours: `gateway_supervisor` (lowtide's side), `gateway_process` (the gateway's side).
Must not: start processes, talk HTTP, or decide anything.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

VERSION = 1
ROUTES_FILE = "routes.json"


@dataclass(frozen=True, slots=True)
class ServiceRoute:
    """One service as the gateway serves it."""

    host: str
    port: int
    read_timeout_s: float | None = None  # None: the gateway's default
    hold_max: int = 0
    hold_timeout_s: float = 300.0
    replicas: Mapping[str, str] = field(default_factory=dict)  # replica id -> base URL (serving)

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "port": self.port,
            "read_timeout_s": self.read_timeout_s,
            "hold_max": self.hold_max,
            "hold_timeout_s": self.hold_timeout_s,
            "replicas": {rid: {"url": url, "state": "serving"} for rid, url in sorted(self.replicas.items())},
        }

    @classmethod
    def from_json(cls, data: Any) -> ServiceRoute:
        if not isinstance(data, Mapping):
            raise TypeError("service")
        replicas = data.get("replicas", {})
        if not isinstance(replicas, Mapping):
            raise TypeError("replicas")
        read = data.get("read_timeout_s")
        return cls(
            host=str(data["host"]),
            port=_int(data["port"]),
            read_timeout_s=None if read is None else _float(read),
            hold_max=_int(data.get("hold_max", 0)),
            hold_timeout_s=_float(data.get("hold_timeout_s", 300.0)),
            replicas={
                str(rid): str(r["url"])
                for rid, r in replicas.items()
                if isinstance(r, Mapping) and r.get("state", "serving") == "serving"
            },
        )


@dataclass(frozen=True, slots=True)
class RoutingTable:
    generation: int
    services: Mapping[str, ServiceRoute]
    shutdown_grace_s: float = 30.0

    def to_json(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "generation": self.generation,
            "shutdown_grace_s": self.shutdown_grace_s,
            "services": {name: route.to_json() for name, route in sorted(self.services.items())},
        }

    @classmethod
    def from_json(cls, data: Any) -> RoutingTable:
        if not isinstance(data, Mapping) or data.get("version") != VERSION:
            raise ValueError("not a routing table of this version")
        services = data.get("services", {})
        if not isinstance(services, Mapping):
            raise TypeError("services")
        return cls(
            generation=_int(data["generation"]),
            services={str(name): ServiceRoute.from_json(s) for name, s in services.items()},
            shutdown_grace_s=_float(data.get("shutdown_grace_s", 30.0)),
        )


@dataclass(frozen=True, slots=True)
class Listening:
    host: str
    port: int
    error: str | None = None  # why it does not listen (None: it does)


@dataclass(frozen=True, slots=True)
class ServiceStatus:
    held: int = 0
    in_flight: Mapping[str, int] = field(default_factory=dict)  # live (at 0) and draining replicas
    failing: Mapping[str, int] = field(default_factory=dict)  # upstream failures in a row


@dataclass(frozen=True, slots=True)
class GatewayStatus:
    pid: int
    build: str
    applied_generation: int  # -1: no routing table applied yet
    listening: Mapping[str, Listening] = field(default_factory=dict)
    held_total: int = 0
    services: Mapping[str, ServiceStatus] = field(default_factory=dict)
    draining: bool = False  # stopping: no longer accepts connections

    def to_json(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "pid": self.pid,
            "build": self.build,
            "applied_generation": self.applied_generation,
            "listening": {
                n: {"host": li.host, "port": li.port, "error": li.error}
                for n, li in sorted(self.listening.items())
            },
            "held_total": self.held_total,
            "draining": self.draining,
            "services": {
                n: {"held": s.held, "in_flight": dict(s.in_flight), "failing": dict(s.failing)}
                for n, s in sorted(self.services.items())
            },
        }

    @classmethod
    def from_json(cls, data: Any) -> GatewayStatus:
        if not isinstance(data, Mapping) or data.get("version") != VERSION:
            raise ValueError("not a gateway status of this version")
        listening = {
            str(n): Listening(
                str(li["host"]), _int(li["port"]), None if li.get("error") is None else str(li["error"])
            )
            for n, li in data.get("listening", {}).items()
        }
        services = {
            str(n): ServiceStatus(
                held=_int(s.get("held", 0)),
                in_flight={str(r): _int(c) for r, c in s.get("in_flight", {}).items()},
                failing={str(r): _int(c) for r, c in s.get("failing", {}).items()},
            )
            for n, s in data.get("services", {}).items()
        }
        return cls(
            pid=_int(data["pid"]),
            build=str(data["build"]),
            applied_generation=_int(data["applied_generation"], low=-1),
            listening=listening,
            held_total=_int(data.get("held_total", 0)),
            services=services,
            draining=bool(data.get("draining", False)),
        )


# -- writing and reading ------------------------------------------------------------------------


def write_atomic(path: Path, payload: Mapping[str, Any], *, durable: bool) -> None:
    """Write `payload` as JSON to `path` atomically (temp file in the same directory, mode 0600,
    rename over); with `durable`, fsync the file before and the directory after the rename.
    Raises OSError."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = json.dumps(payload, separators=(",", ":")).encode()
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def read_json(path: Path) -> Any | None:
    """The JSON document in `path` (opened without following a link), or None when it is
    missing or unreadable (logged)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("unreadable %s: %s", path, exc)
        return None


def read_routes(path: Path) -> RoutingTable | None:
    data = read_json(path)
    if data is None:
        return None
    try:
        return RoutingTable.from_json(data)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        log.warning("invalid routing table %s: %s", path, exc)
        return None


def read_status(path: Path) -> GatewayStatus | None:
    data = read_json(path)
    if data is None:
        return None
    try:
        return GatewayStatus.from_json(data)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        log.warning("invalid gateway status %s: %s", path, exc)
        return None


def file_key(path: Path) -> tuple[int, int, int] | None:
    """(inode, size, mtime in ns) of `path`, which changes with every rename over it; None if missing."""
    try:
        st = path.lstat()
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _int(value: Any, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise TypeError(f"not an integer >= {low}: {value!r}")
    return value


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise TypeError(f"not a non-negative number: {value!r}")
    return float(value)
