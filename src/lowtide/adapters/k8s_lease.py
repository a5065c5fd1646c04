"""Leader election on a `coordination.k8s.io/v1` Lease: the cluster mode's leader (docs/architecture.md §4.4).

Role: `KubeLeaseElector` acquires, renews and releases one Lease with the real `kubernetes` client
(`CoordinationV1Api`); `KubeGatedLeases` puts it in front of the store's lease (`LeasePort`), so
that `control.leadership.Leadership` — the loop's `LeaseGuard` — runs unchanged: a claim first
tries the Lease and only its holder goes on to claim the store's lease, whose fencing token still
refuses every write of a deposed leader (`store.fence`). Why this design and not a second
implementation of the leadership port: the Kubernetes Lease cannot fence the store's writes (a
paused leader's transaction lands after a takeover whatever the Lease says), and the store's lease
already gives the acting deadline, the supervisor threads and the fence; the Lease adds what only
Kubernetes can give (one leader among pods wherever they run, visible with `kubectl get lease`)
as a gate in front of it (so even a misjudged Lease cannot make two act: the store's lease still
admits one). A new leader may wait for the old store lease to expire when the old
leader died without releasing it (at most `control.lease_ttl`).

Semantics follow client-go's leader election, kubernetes/client-go @32ce75a7 (2026-07-24),
`tools/leaderelection/leaderelection.go` (`tryAcquireOrRenew`, `isLeaseValid`,
`setObservedRecord`, `tryRelease`) and `tools/leaderelection/resourcelock/leaselock.go`
(`Get`/`Create`/`Update`, `LeaderElectionRecordToLeaseSpec`):

- A Lease is *valid* until the local monotonic time at which this process last saw its record
  change (or wrote it) plus the record's `leaseDurationSeconds` (`lease_valid`). The record's
  `renewTime` is written but never compared with a local clock, so clock skew between pods does
  not matter (a skewed clock *rate* does: keep `renew deadline < duration`).
- Absent: create it (409 AlreadyExists: someone was faster, read it). Held by another and valid:
  refused. Empty `holderIdentity` (released) or expired: take over, `leaseTransitions` + 1 and a
  new `acquireTime`. Held by us: renew, keeping `acquireTime` and `leaseTransitions`. Every write
  is a PUT carrying the `resourceVersion` last read; a 409 Conflict means someone else wrote:
  read again, never overwrite. The leader first tries the PUT on the object it last saw (the
  fast path) and reads only when that fails.
- Release (graceful stop): `holderIdentity` "", `leaseDurationSeconds` 1, `renewTime` =
  `acquireTime` = now, transitions kept; only while we hold it.

Deliberate differences from client-go: a leader that sees another holder (a 409 on renew, then a
read) loses at once and calls `on_lost` (client-go's `IsLeader()` turns false at once too, but
`OnStoppedLeading` waits for RenewDeadline); the renew deadline counts from the start of the last
successful renew (client-go: from the start of the failing poll, up to a RetryPeriod later); a
lost elector never acquires again (the process exits). Timestamps are written as
`YYYY-MM-DDTHH:MM:SS.ffffffZ`: apimachinery @eed236ce `pkg/apis/meta/v1/micro_time.go` parses
MicroTime with Go's layout `RFC3339Micro` ("2006-01-02T15:04:05.000000Z07:00"), and Go's
`time.Parse` needs exactly the six digits there (src/time/format.go, case `stdFracSecond0`), which
Python's `isoformat()` drops when the microseconds are 0.

Neighbours: `control.leadership` (uses `KubeGatedLeases` as its `LeasePort`), `control.lease`
(records), `wiring` (builds these with `coordination_api()`: the pod's ServiceAccount, else
KUBECONFIG; turns `on_lost` into an exit). Must not: read the clocks itself (times come in),
touch the store except through the wrapped `LeasePort`, or decide anything about the loop.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import urllib3
from kubernetes import client as k8s_client
from kubernetes.client.exceptions import ApiException

from lowtide.adapters.kube_client import KubeConfigError, kube_api_client
from lowtide.control.leadership import LeasePort
from lowtide.control.lease import LEASE_NAME, Fence, LeaseCandidate, LeaseClaim, LeaseRecord
from lowtide.control.records import FencedOut

log = logging.getLogger("lowtide.lease")

#: Status codes that no retry cures (a wrong token, missing RBAC, an invalid object).
PERMANENT = frozenset({400, 401, 403, 422})


class KubeLeaseError(RuntimeError):
    """The Kubernetes API refused or did not answer a Lease request (`status` None: no answer)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def permanent(self) -> bool:
        return self.status in PERMANENT


def micro_time(wall: datetime) -> str:
    """A MicroTime as kube-apiserver parses it (six fractional digits, UTC, 'Z')."""
    if wall.tzinfo is None:
        raise ValueError("a Lease time must be timezone-aware")
    return wall.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True, slots=True)
class ElectionRecord:
    """A Lease's spec as leader election reads it (client-go `LeaderElectionRecord`)."""

    holder: str
    duration_s: int
    acquire_time: str | None
    renew_time: str | None
    transitions: int
    preferred_holder: str | None = None
    strategy: str | None = None

    @classmethod
    def of(cls, spec: Mapping[str, Any] | None) -> ElectionRecord:
        s = spec or {}
        return cls(
            str(s.get("holderIdentity") or ""),
            int(s.get("leaseDurationSeconds") or 0),
            s.get("acquireTime"),
            s.get("renewTime"),
            int(s.get("leaseTransitions") or 0),
            s.get("preferredHolder"),
            s.get("strategy"),
        )

    def spec(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "holderIdentity": self.holder,
            "leaseDurationSeconds": self.duration_s,
            "acquireTime": self.acquire_time,
            "renewTime": self.renew_time,
            "leaseTransitions": self.transitions,
        }
        if self.preferred_holder:
            out["preferredHolder"] = self.preferred_holder
        if self.strategy:
            out["strategy"] = self.strategy
        return out


@dataclass(frozen=True, slots=True)
class Observation:
    """A record and the local monotonic time at which this process saw it change (or wrote it)."""

    record: ElectionRecord
    at: float


def lease_valid(obs: Observation | None, now: float) -> bool:
    """client-go `isLeaseValid`: observed time + the record's duration is still ahead."""
    return obs is not None and obs.at + obs.record.duration_s > now


def may_write(obs: Observation, identity: str, now: float) -> bool:
    """Whether a candidate may write the record it observed (ours, released, or expired)."""
    holder = obs.record.holder
    return holder == identity or not holder or not lease_valid(obs, now)


def next_record(old: ElectionRecord | None, identity: str, duration_s: int, wall: datetime) -> ElectionRecord:
    """What a successful try writes: a renew keeps acquireTime and transitions; a takeover of an
    existing record counts a transition; a fresh Lease starts at 0."""
    stamp = micro_time(wall)
    if old is None:
        return ElectionRecord(identity, duration_s, stamp, stamp, 0)
    if old.holder == identity:
        return ElectionRecord(identity, duration_s, old.acquire_time, stamp, old.transitions)
    return ElectionRecord(identity, duration_s, stamp, stamp, old.transitions + 1)


class KubeLeaseElector:
    """See the module docstring. Times: `now` is this process's monotonic control time (seconds),
    `wall` the timezone-aware wall time written into the record (informational)."""

    def __init__(
        self,
        api: Any,  # kubernetes.client.CoordinationV1Api
        *,
        namespace: str,
        name: str,
        identity: str,
        duration_s: int,
        renew_deadline_s: float,
        request_timeout_s: float = 5.0,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        if not identity:
            raise ValueError("the Lease holder identity must not be empty")
        if not 0 < renew_deadline_s < duration_s:
            raise ValueError(
                f"the renew deadline ({renew_deadline_s:g}s) must be positive and shorter than the Lease "
                f"duration ({duration_s}s)"
            )
        self.api = api
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.duration_s = duration_s
        self.renew_deadline_s = renew_deadline_s
        self.request_timeout_s = request_timeout_s
        self.on_lost = on_lost
        self._lock = threading.Lock()
        self._obs: Observation | None = None
        self._object: dict[str, Any] | None = None  # the Lease as last read or written
        self._renewed: float | None = None  # start of our last successful write while leading
        self.lost: str | None = None  # why we lost the Lease (then we never try again)

    @property
    def where(self) -> str:
        return f"Lease {self.namespace}/{self.name}"

    @property
    def observation(self) -> Observation | None:
        return self._obs

    def is_leader(self, now: float) -> bool:
        """We hold the Lease and renewed it within the renew deadline."""
        obs, renewed = self._obs, self._renewed
        return (
            self.lost is None
            and renewed is not None
            and obs is not None
            and obs.record.holder == self.identity
            and now < renewed + self.renew_deadline_s
        )

    # -- acquire or renew ----------------------------------------------------------------------

    def try_acquire_or_renew(self, now: float, wall: datetime) -> bool:
        """One try (client-go `tryAcquireOrRenew`): True when we hold the Lease afterwards.
        Raises `KubeLeaseError` when the API server refuses (other than the races 404/409) or
        does not answer; a leader that stays unrenewed past the deadline loses the Lease."""
        with self._lock:
            self._check_deadline(now)  # a leader paused past its deadline lost the Lease
            if self.lost is not None:
                return False
            try:
                won = self._try(now, wall)
            except KubeLeaseError:
                self._check_deadline(now)
                raise
            if won:
                self._renewed = now
            elif self._renewed is not None:
                obs = self._obs
                holder = obs.record.holder if obs is not None else ""
                self._lose(f"the {self.where} is held by {holder or 'nobody'} now")
            return won

    def _try(self, now: float, wall: datetime) -> bool:
        obs, current = self._obs, self._object
        # 1. The leader's fast path: update the object it last saw.
        if self._renewed is not None and obs is not None and current is not None and lease_valid(obs, now):
            record = next_record(obs.record, self.identity, self.duration_s, wall)
            try:
                self._write(current, record, now)
                return True
            except _Conflict:
                log.info("%s: renewing found a newer version; reading it", self.where)
        # 2. Read it, or create it when absent.
        found = self._get()
        if found is None:
            record = next_record(None, self.identity, self.duration_s, wall)
            try:
                self._object = self._create(record)
            except _Conflict:  # AlreadyExists: another candidate created it first
                found = self._get()
                if found is None:
                    return False  # created and deleted in between: try again next time
            else:
                self._obs = Observation(record, now)
                return True
        self._see(found, now)
        obs = self._obs
        assert obs is not None
        # 3. Held by another and still valid by our own observation: refused.
        if not may_write(obs, self.identity, now):
            return False
        # 4. Renew, or take over (released or expired); a conflict means someone else won.
        record = next_record(obs.record, self.identity, self.duration_s, wall)
        try:
            self._write(found, record, now)
        except _Conflict:
            again = self._get()
            if again is not None:
                self._see(again, now)
            return False
        return True

    def _see(self, lease: dict[str, Any], now: float) -> None:
        """client-go `setObservedRecord` when the record changed: its observed time is now."""
        self._object = lease
        record = ElectionRecord.of(lease.get("spec"))
        if self._obs is None or self._obs.record != record:
            self._obs = Observation(record, now)

    def _check_deadline(self, now: float) -> None:
        renewed = self._renewed
        if renewed is not None and now >= renewed + self.renew_deadline_s:
            self._lose(
                f"the {self.where} could not be renewed within {self.renew_deadline_s:g}s (the Lease lasts "
                f"{self.duration_s}s)"
            )

    def _lose(self, reason: str) -> None:
        self._renewed = None
        self.lost = reason
        log.warning("lost the Kubernetes Lease: %s", reason)
        if self.on_lost is not None:
            try:
                self.on_lost(reason)
            except Exception:
                log.exception("reacting to the lost Kubernetes Lease failed")

    # -- release -------------------------------------------------------------------------------

    def release(self, wall: datetime) -> bool:
        """Give the Lease up if we hold it (client-go `tryRelease`): a standby takes it at its next
        try. Whether it was released; a conflict re-reads and tries again once."""
        with self._lock:
            if self._renewed is None or self.lost is not None:
                return False
            self._renewed = None
            for _ in range(2):
                found = self._get()
                if found is None:
                    return False
                old = ElectionRecord.of(found.get("spec"))
                if old.holder != self.identity:
                    return False
                stamp = micro_time(wall)
                record = ElectionRecord("", 1, stamp, stamp, old.transitions)
                try:
                    self._object = self._put(found, record)
                except _Conflict:
                    continue
                self._obs = None
                log.warning("released the %s", self.where)
                return True
            return False

    # -- the API calls ---------------------------------------------------------------------------

    def _write(self, base: dict[str, Any], record: ElectionRecord, now: float) -> None:
        self._object = self._put(base, record)
        self._obs = Observation(record, now)

    def _get(self) -> dict[str, Any] | None:
        try:
            resp = self.api.read_namespaced_lease(
                self.name, self.namespace, _preload_content=False, _request_timeout=self.request_timeout_s
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise self._error("read", exc) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise self._unreachable("read", exc) from exc
        return _body(resp)

    def _create(self, record: ElectionRecord) -> dict[str, Any]:
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": record.spec(),
        }
        try:
            resp = self.api.create_namespaced_lease(
                self.namespace, body, _preload_content=False, _request_timeout=self.request_timeout_s
            )
        except ApiException as exc:
            if exc.status == 409:
                raise _Conflict from exc
            raise self._error("create", exc) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise self._unreachable("create", exc) from exc
        return _body(resp)

    def _put(self, base: dict[str, Any], record: ElectionRecord) -> dict[str, Any]:
        """PUT `base` (with its resourceVersion) with `record` as its spec; 409 raises `_Conflict`."""
        body = {**base, "spec": record.spec()}
        try:
            resp = self.api.replace_namespaced_lease(
                self.name,
                self.namespace,
                body,
                _preload_content=False,
                _request_timeout=self.request_timeout_s,
            )
        except ApiException as exc:
            if exc.status == 409:
                raise _Conflict from exc
            raise self._error("update", exc) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise self._unreachable("update", exc) from exc
        return _body(resp)

    def _error(self, verb: str, exc: ApiException) -> KubeLeaseError:
        status = int(exc.status or 0) or None
        message = _status_message(exc)
        hint = ""
        if status == 403:
            hint = (
                f"; the control plane's ServiceAccount needs get, create and update on "
                f"leases.coordination.k8s.io in namespace {self.namespace!r} (the chart's Role grants them)"
            )
        elif status == 401:
            hint = "; the API server did not accept the credentials (in-cluster token or KUBECONFIG)"
        return KubeLeaseError(f"cannot {verb} the {self.where}: HTTP {status}: {message}{hint}", status)

    def _unreachable(self, verb: str, exc: BaseException) -> KubeLeaseError:
        return KubeLeaseError(
            f"cannot {verb} the {self.where}: the Kubernetes API server did not answer ({exc})"
        )


class _Conflict(Exception):
    """409: AlreadyExists on create, Conflict on update."""


def _body(resp: Any) -> dict[str, Any]:
    data = json.loads(resp.data)
    if not isinstance(data, dict):
        raise KubeLeaseError(
            f"the API server answered a Lease request with {type(data).__name__}, not an object"
        )
    return data


def _status_message(exc: ApiException) -> str:
    try:
        body = json.loads(exc.body or b"")
    except (TypeError, ValueError):
        return str(exc.reason or "")
    if isinstance(body, dict) and body.get("message"):
        return str(body["message"])
    return str(exc.reason or "")


def holder_host_pid(holder: str) -> tuple[str, int]:
    """Host and pid of a `control.lease.holder_name` identity (``<host>:<id>#<pid>.<nonce>``);
    ("?", 0) for an identity of another form (someone else's tool)."""
    host = holder.split(":", 1)[0] if ":" in holder else "?"
    try:
        pid = int(holder.rsplit("#", 1)[1].split(".", 1)[0])
    except (IndexError, ValueError):
        return host, 0
    return host, pid


class KubeGatedLeases:
    """The store's `LeasePort` behind the Kubernetes Lease (see the module docstring): a claim is
    granted only to the Lease's holder, which then claims the store's lease (renew or takeover by
    the store's own rules); anyone else gets a refusal naming the Lease's holder and when its Lease
    expires by our observation. Release: the store's lease first, then the Lease."""

    def __init__(
        self,
        store: LeasePort,
        elector: KubeLeaseElector,
        *,
        monotonic: Callable[[], float],
        wall: Callable[[], datetime],
    ) -> None:
        self.store = store
        self.elector = elector
        self._mono = monotonic
        self._wall = wall
        #: The last failure of the Lease (None after a try that got an answer).
        self.last_error: KubeLeaseError | None = None

    def claim_lease(
        self, candidate: LeaseCandidate, *, ttl_s: float, now: float, name: str = LEASE_NAME
    ) -> LeaseClaim:
        mono = self._mono()
        try:
            won = self.elector.try_acquire_or_renew(mono, self._wall())
        except KubeLeaseError as exc:
            self.last_error = exc
            raise
        self.last_error = None
        if not won:
            return LeaseClaim(False, self._holder_row(name, now, mono), None, now)
        return self.store.claim_lease(candidate, ttl_s=ttl_s, now=now, name=name)

    def _holder_row(self, name: str, now: float, mono: float) -> LeaseRecord | None:
        """The Lease's holder as a lease row in the caller's time base (token: leaseTransitions)."""
        obs = self.elector.observation
        if obs is None or not obs.record.holder or self.elector.lost is not None:
            return None  # (lost: the process is exiting; its last observation is stale)
        seen = now - (mono - obs.at)
        host, pid = holder_host_pid(obs.record.holder)
        return LeaseRecord(
            name,
            obs.record.holder,
            host,
            pid,
            obs.record.transitions,
            seen,
            seen,
            seen + obs.record.duration_s,
        )

    def release_lease(self, holder: str, *, now: float, name: str = LEASE_NAME) -> bool:
        released = self.store.release_lease(holder, now=now, name=name)
        try:
            self.elector.release(self._wall())
        except KubeLeaseError as exc:
            log.warning("releasing the Kubernetes Lease failed: %s; it expires on its own", exc)
        return released

    def lease(self, *, now: float, name: str = LEASE_NAME) -> tuple[LeaseRecord | None, float]:
        return self.store.lease(now=now, name=name)

    def fence_writes(self, fence: Fence | None, on_fenced: Callable[[FencedOut], None] | None = None) -> None:
        self.store.fence_writes(fence, on_fenced)


def coordination_api() -> Any:
    """A `CoordinationV1Api` on `adapters.kube_client.kube_api_client()`. Raises KubeLeaseError."""
    try:
        return k8s_client.CoordinationV1Api(kube_api_client())
    except KubeConfigError as exc:
        raise KubeLeaseError(str(exc)) from exc
