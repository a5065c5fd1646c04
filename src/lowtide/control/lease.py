"""One active control plane: the lease's values and its pure rules (docs/architecture.md §4.4).

Several `lowtide up` may share one store (a hot standby); only the holder of the store's lease
"control" acts (recovers, ticks, launches, kills, gives notice, drives replicas). The lease is a
row (holder, host, pid, fencing `token`, expiry); these are the rules every store implementation
and `control.leadership` apply, so that they agree:

- **Who may claim** (`claim_action`): nobody holds the lease (insert, token 1); we hold it
  (renew: new expiry, same token); it has expired, or its holder sits on our *seat*
  (takeover: token + 1). Otherwise the claim is refused. A seat is one state dir on one host
  (`seat_of`): a process holds its state dir's lock for its life, so a lease held by an earlier
  process of our own seat belongs to a process that is gone (a `kill -9` and restart does not wait
  out the expiry).
- **The fencing token** changes with every change of holder. A leader's store checks, inside every
  write transaction, that the row still carries its token (`store.fence`); a leader whose lease was
  taken over is refused (`records.FencedOut`) before anything is written.
- **Stepping down on its own clock** (`LeaseTiming.act_deadline`): a leader acts only until
  ``t + ttl - margin``, t the monotonic time at which its last successful renew *started*. The store
  sets the expiry at ``>= t + ttl`` (PostgreSQL: by the server's clock), so a paused or partitioned
  leader stops acting before anyone can see the lease expired. Effects that no store can fence (a
  signal, a process start) are checked against this deadline just before they happen
  (`LeaseGuard.check`), after the fenced write that books them where the loop's order allows.
- **Takeover from another host** (`takeover_kind`): in the embedded mode a control plane can only
  adopt processes of its own host, so an expired lease of another host is taken over but the new
  leader waits `foreign_grace` before recovering (its recovery would requeue the other host's
  attempts as lost); the log says so loudly. Cross-host failover needs the cluster mode.

Must not: read the clock, touch the store or do I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

#: The name of the control plane's lease row.
LEASE_NAME = "control"
#: The share of the ttl a leader keeps as a margin: it stops acting at ttl x (1 - margin) after
#: its last renew began, which covers the time between a check and the effect it guards.
MARGIN_SHARE = 0.2
#: The longest host name kept in a holder name (the column holds 128 characters).
MAX_HOST = 64


class LeaseGuard(Protocol):
    """What the acting parts of the control plane ask before every effect."""

    def may_act(self) -> bool:
        """True while this control plane holds the lease and is within its acting deadline."""
        ...

    def check(self) -> None:
        """Raise `records.FencedOut` unless `may_act()`."""
        ...


@dataclass(frozen=True, slots=True)
class LeaseCandidate:
    """A control plane asking for the lease: `holder` names this process uniquely
    (``<seat>#<pid>.<nonce>``, `holder_name`); `seat` its state dir on its host."""

    holder: str
    seat: str
    host: str
    pid: int


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """The lease row as the store holds it (times in the store's time base: the database server's
    clock on PostgreSQL, the callers' wall clock elsewhere)."""

    name: str
    holder: str
    host: str
    pid: int
    token: int
    acquired_at: float
    renewed_at: float
    expires_at: float

    def expired(self, now: float) -> bool:
        return self.expires_at <= now


@dataclass(frozen=True, slots=True)
class LeaseClaim:
    """What a claim found and did: `granted` (we hold the lease now, `lease` is our row),
    else `lease` is the holder's row; `previous` is the row we took over (None unless a takeover);
    `at` is the store's time of the decision (compare it with `lease.expires_at`, never a local
    clock)."""

    granted: bool
    lease: LeaseRecord | None
    previous: LeaseRecord | None
    at: float


@dataclass(frozen=True, slots=True)
class Fence:
    """The token a leader's writes carry: refused unless the row `name` still holds `token`."""

    name: str
    token: int


class ClaimAction(StrEnum):
    INSERT = "insert"
    RENEW = "renew"
    TAKEOVER = "takeover"
    REFUSE = "refuse"


class TakeoverKind(StrEnum):
    #: Nobody held the lease before (a fresh store).
    FIRST = "first"
    #: An earlier process of our own seat (a restart), or our own lease after we stepped down.
    RESTART = "restart"
    #: Another control plane on this host: its steps and replicas can be adopted.
    SAME_HOST = "same-host"
    #: Another host: its processes cannot be adopted from here (embedded mode).
    OTHER_HOST = "other-host"


@dataclass(frozen=True, slots=True)
class LeaseTiming:
    """How long a lease lasts (`ttl_s`) and how often it is renewed, or claimed by a standby
    (`renew_s`); config `control.lease_ttl` / `control.lease_renew`."""

    ttl_s: float = 15.0
    renew_s: float = 5.0

    def __post_init__(self) -> None:
        problem = timing_problem(self.ttl_s, self.renew_s)
        if problem:
            raise ValueError(problem)

    @property
    def margin_s(self) -> float:
        return self.ttl_s * MARGIN_SHARE

    def act_deadline(self, renew_started: float) -> float:
        """Until when (monotonic) a leader whose renew began at `renew_started` may act."""
        return renew_started + self.ttl_s - self.margin_s


def timing_problem(ttl_s: float, renew_s: float) -> str | None:
    """Why a ttl and a renew interval cannot work together (None: they can). The renew interval
    must let two renewals fail before the leader steps down at ttl x (1 - MARGIN_SHARE)."""
    if ttl_s <= 0 or renew_s <= 0:
        return "the lease ttl and renew interval must be positive"
    if renew_s > ttl_s * (1 - MARGIN_SHARE) / 2:
        return (
            f"the renew interval ({renew_s:g}s) must be at most {(1 - MARGIN_SHARE) / 2:g} x the ttl "
            f"({ttl_s:g}s), so that two failed renewals still leave the leader time to step down"
        )
    return None


def seat_of(host: str, state_id: str) -> str:
    """The seat of a state dir on a host: `state_id` is a random id kept in the state dir."""
    return f"{host[:MAX_HOST]}:{state_id}"


def holder_name(seat: str, pid: int, nonce: str) -> str:
    return f"{seat}#{pid}.{nonce}"


def holder_seat(holder: str) -> str:
    return holder.rsplit("#", 1)[0]


def claim_action(row: LeaseRecord | None, candidate: LeaseCandidate, now: float) -> ClaimAction:
    """What a claim does to the lease row (see the module docstring). `now` is the store's time."""
    if row is None:
        return ClaimAction.INSERT
    if row.holder == candidate.holder:
        return ClaimAction.RENEW
    if row.expired(now) or holder_seat(row.holder) == candidate.seat:
        return ClaimAction.TAKEOVER
    return ClaimAction.REFUSE


def granted_row(
    action: ClaimAction,
    row: LeaseRecord | None,
    candidate: LeaseCandidate,
    *,
    name: str,
    now: float,
    ttl_s: float,
) -> LeaseRecord | None:
    """The row after a claim (None when refused): a renew keeps the token and acquisition time,
    an insert starts at token 1, a takeover increments it."""
    if action == ClaimAction.REFUSE:
        return None
    if action == ClaimAction.RENEW:
        assert row is not None
        return LeaseRecord(
            name, row.holder, candidate.host, candidate.pid, row.token, row.acquired_at, now, now + ttl_s
        )
    token = 1 if row is None else row.token + 1
    return LeaseRecord(name, candidate.holder, candidate.host, candidate.pid, token, now, now, now + ttl_s)


def takeover_kind(previous: LeaseRecord | None, candidate: LeaseCandidate) -> TakeoverKind:
    """Whose lease a newly elected leader took (None previous: a fresh store, or a renew of our
    own row after we had stepped down)."""
    if previous is None:
        return TakeoverKind.FIRST
    if holder_seat(previous.holder) == candidate.seat or previous.holder == candidate.holder:
        return TakeoverKind.RESTART
    if previous.host == candidate.host:
        return TakeoverKind.SAME_HOST
    return TakeoverKind.OTHER_HOST


def fenced_message(fence: Fence, holder: str | None, token: int | None) -> str:
    """Why a write of the holder of `fence` was refused: who holds the lease now."""
    held = "nobody" if holder is None else f"{holder} (token {token})"
    return f"the lease {fence.name!r} is held by {held}, not by this control plane (token {fence.token})"
