"""Leader or standby: act only while holding the store's lease (docs/architecture.md §4.4).

`Leadership` drives the lease through the store (`LeasePort`: `store.lease_repo` or its in-memory
twin) by `control.lease`'s rules, with two threads that `wiring.serve` starts:

- `run` claims the lease every `timing.renew_s`: a standby's claim succeeds once the leader's
  lease expired (or was released; a standby claims again right after the expiry it last saw);
  a leader's claim renews it and moves its acting deadline to ``start of the renew + ttl -
  margin`` (monotonic). A renew that fails (the store is down) changes nothing: the leader keeps
  acting until the deadline, then stops.
- `supervise` turns the role into actions: when a term starts it calls `on_elected` (wiring:
  recover, start the loop, the gateways), when it ends `on_deposed` (stop the loop and forget the
  watched processes, which keep running for the next leader to adopt: nothing is killed), then
  drops the fence so that this process's API writes go through unfenced again.

A term ends when the deadline passes, when a claim finds another holder, or at once when the store
refused a fenced write (`on_fenced`, from inside the refused transaction: whoever catches the
`FencedOut`, the term is over). The acting parts ask `check()`/`may_act()` (the `LeaseGuard`)
before every effect. After taking over an *other host's* lease the supervisor waits
`foreign_grace_s` before `on_elected`, so that host's attempts are not requeued as lost at once
(they may still run there: the embedded mode cannot adopt them; cross-host failover needs the
cluster mode). Every transition is logged at WARNING with the holder, host and token.
Threads never hold this object's lock while calling the store (the in-memory store calls
`on_fenced` under its own lock). Time: `wall()` only for the SQLite/memory lease rows, `monotonic()`
for every deadline.
Must not: start, stop or kill processes itself, or decide anything beyond the lease's rules.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from lowtide.control.lease import (
    LEASE_NAME,
    Fence,
    LeaseCandidate,
    LeaseClaim,
    LeaseRecord,
    LeaseTiming,
    TakeoverKind,
    takeover_kind,
)
from lowtide.control.records import FencedOut

log = logging.getLogger("lowtide.lease")

#: A standby claims this long after the lease it saw expires (and never more often).
EXPIRY_SLACK_S = 0.05


class LeasePort(Protocol):
    def claim_lease(
        self, candidate: LeaseCandidate, *, ttl_s: float, now: float, name: str = LEASE_NAME
    ) -> LeaseClaim: ...

    def release_lease(self, holder: str, *, now: float, name: str = LEASE_NAME) -> bool: ...

    def lease(self, *, now: float, name: str = LEASE_NAME) -> tuple[LeaseRecord | None, float]: ...

    def fence_writes(
        self, fence: Fence | None, on_fenced: Callable[[FencedOut], None] | None = None
    ) -> None: ...


@dataclass(frozen=True, slots=True)
class Term:
    """One stretch of leadership: its fencing token, whose lease it took, when it began."""

    token: int
    kind: TakeoverKind
    previous: LeaseRecord | None
    started: float  # monotonic


#: How often a claim is tried while the store fails (instead of every `renew_s`).
FAILING_CLAIM_S = 0.5


class Leadership:
    """See the module docstring."""

    def __init__(
        self,
        store: LeasePort,
        candidate: LeaseCandidate,
        timing: LeaseTiming,
        *,
        wall: Callable[[], float],
        monotonic: Callable[[], float],
        foreign_grace_s: float = 300.0,
    ) -> None:
        self.store = store
        self.candidate = candidate
        self.timing = timing
        self.foreign_grace_s = foreign_grace_s
        self._wall = wall
        self._mono = monotonic
        self._transition = threading.Lock()  # term and fence changes (never held over a store call)
        self._state: tuple[Term | None, float] = (None, -math.inf)  # (term, acting deadline)
        self._fenced: int | None = None  # the token of a term whose write the store refused
        self._wake = threading.Event()
        self._failing = False
        self._seen_holder: str | None = None
        #: The lease as last seen (for /healthz) and the store's time it was seen at.
        self.seen: LeaseRecord | None = None
        self.seen_at: float | None = None
        self._seen_mono = 0.0
        self.reason = "starting: the lease was not claimed yet"

    # -- the guard (control.lease.LeaseGuard) -------------------------------------------------

    def current(self) -> Term | None:
        """The term in force now (None: this control plane must not act)."""
        term, deadline = self._state
        if term is None or self._fenced == term.token or self._mono() >= deadline:
            return None
        return term

    def may_act(self) -> bool:
        return self.current() is not None

    def check(self) -> None:
        if self.current() is None:
            raise FencedOut(f"this control plane is not the leader: {self.reason}")

    # -- claiming -----------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Claim (or renew) every `renew_s` until `stop` is set (the caller made the first claim);
        a standby claims again as soon as the lease it saw expires (`next_claim_in`)."""
        while not stop.wait(self.next_claim_in()):
            try:
                self.claim_once()
            except Exception:  # never end the thread: a leader without it would stop at its deadline
                log.exception("claiming the control lease failed unexpectedly")

    def next_claim_in(self) -> float:
        """Seconds to the next claim: `renew_s`, or sooner on a standby whose last look said the
        leader's lease expires earlier (a duration in the store's time base, so clocks that
        disagree do not matter)."""
        if self._failing:  # the store is failing: claim again soon, so a leader that had to stop
            return min(self.timing.renew_s, FAILING_CLAIM_S)  # acts again a moment after it is back
        lease, at = self.seen, self.seen_at
        if self.current() is not None or lease is None or at is None or lease.holder == self.candidate.holder:
            return self.timing.renew_s
        return min(self.timing.renew_s, max(EXPIRY_SLACK_S, lease.expires_at - at + EXPIRY_SLACK_S))

    def interrupt(self) -> None:
        """Make `supervise` look again now (after setting its `stop`)."""
        self._wake.set()

    def claim_once(self) -> Term | None:
        """One claim: start, extend or end the term; the term in force afterwards."""
        started = self._mono()
        try:
            claim = self.store.claim_lease(self.candidate, ttl_s=self.timing.ttl_s, now=self._wall())
        except Exception as exc:
            if not self._failing:
                self._failing = True
                log.warning(
                    "claiming the control lease failed: %s; retrying every %gs",
                    exc,
                    min(self.timing.renew_s, FAILING_CLAIM_S),
                )
            self._wake.set()  # the supervisor re-checks the deadline
            return self.current()
        if self._failing:
            self._failing = False
            log.warning("claiming the control lease works again")
        self.seen, self.seen_at, self._seen_mono = claim.lease, claim.at, self._mono()
        if not claim.granted:
            self._standing_by(claim.lease)
            return None
        assert claim.lease is not None
        return self._granted(claim.lease.token, claim.previous, started)

    def _granted(self, token: int, previous: LeaseRecord | None, started: float) -> Term:
        deadline = self.timing.act_deadline(started)
        with self._transition:
            term = self.current()
            if term is not None and term.token == token:  # a renew
                self._state = (term, max(deadline, self._state[1]))
                return term
            term = Term(token, takeover_kind(previous, self.candidate), previous, started)
            # The fence first: nothing acts under this term before its writes carry the token.
            self.store.fence_writes(Fence(LEASE_NAME, token), functools.partial(self._on_fenced, token))
            self._fenced = None
            self._state = (term, deadline)
            self.reason = f"leader since token {token}"
        self._seen_holder = self.candidate.holder
        log.warning("%s", self._elected_message(term))
        self._wake.set()
        return term

    def _standing_by(self, lease: LeaseRecord | None) -> None:
        holder = lease.holder if lease is not None else None
        where = f"{holder} on {lease.host if lease else '?'} (token {lease.token if lease else '-'})"
        with self._transition:
            acting = self.current() is not None
            if self._state[0] is not None:
                self._state = (None, -math.inf)
            if acting:
                self.reason = f"the lease is held by {where}"
                log.warning("stepping down: %s; standing by", self.reason)
            elif holder != self._seen_holder:
                self.reason = f"standby: the lease is held by {where}"
                log.warning("%s", self.reason)
        self._seen_holder = holder
        self._wake.set()

    def _on_fenced(self, token: int, exc: FencedOut) -> None:
        """The store refused a write of the term `token`: that term is over (no lock taken here)."""
        self._fenced = token
        self.reason = f"fenced out: {exc}"
        self._wake.set()

    def _elected_message(self, term: Term) -> str:
        prev = term.previous
        me = f"leader (token {term.token}, holder {self.candidate.holder})"
        if prev is None:
            return f"{me}: the lease was free (or still ours)"
        was = f"{prev.holder} on {prev.host} (pid {prev.pid}, token {prev.token})"
        if term.kind == TakeoverKind.RESTART:
            return f"{me}: took over from an earlier process of this state dir, {was}"
        if term.kind == TakeoverKind.SAME_HOST:
            return f"{me}: took over the expired lease of {was}; adopting its steps and replicas"
        return (
            f"{me}: TOOK OVER THE EXPIRED LEASE OF ANOTHER HOST, {was}. Its steps and replicas run "
            f"on {prev.host} and cannot be adopted from here (embedded mode); recovery waits "
            f"{self.foreign_grace_s:g}s, then requeues what it cannot find as lost. Cross-host "
            "failover needs the cluster mode (docs/architecture.md §4.4)"
        )

    # -- acting on the role ---------------------------------------------------------------------

    def supervise(
        self,
        stop: threading.Event,
        on_elected: Callable[[Term], None],
        on_deposed: Callable[[Term, str], None],
        *,
        acting: Term | None = None,
    ) -> None:
        """Call `on_elected` when a term starts and `on_deposed` when it ends (and at `stop`);
        `acting`: a term the caller already acts on (it started acting before this thread)."""
        while not stop.is_set():
            term = self.current()
            if acting is not None and term is not acting:
                self._depose(acting, on_deposed, self._why_not(acting))
                acting = None
            if acting is None and term is not None and self._grace_over(term, stop):
                try:
                    on_elected(term)
                    acting = term
                except Exception:
                    log.exception("starting to act as leader failed; standing down for this term")
                    self._depose(term, on_deposed, "starting to act failed")
                    self._end_term(term)
                continue
            _, deadline = self._state
            self._wake.wait(max(0.01, min(self.timing.renew_s / 2, deadline - self._mono())))
            self._wake.clear()
        if acting is not None:
            self._depose(acting, on_deposed, "shutting down")

    def _why_not(self, term: Term) -> str:
        """Why `term` is over (for the log)."""
        current, _ = self._state
        if current is not None and current is not term:
            return f"a new term (token {current.token}) began after the acting deadline of token {term.token}"
        if current is term and self._fenced != term.token:
            self.reason = (
                f"the lease could not be renewed within {self.timing.ttl_s - self.timing.margin_s:g}s "
                f"(token {term.token}): stopped acting before it could expire"
            )
            log.warning("stepping down: %s; standing by", self.reason)
        return self.reason

    def _grace_over(self, term: Term, stop: threading.Event) -> bool:
        """After an other host's lease: wait `foreign_grace_s` holding the lease (False: the
        term or the process ended first)."""
        if term.kind != TakeoverKind.OTHER_HOST or self.foreign_grace_s <= 0:
            return True
        until = term.started + self.foreign_grace_s
        while self._mono() < until:
            if stop.is_set() or self.current() is not term:
                return False
            self._wake.wait(min(1.0, until - self._mono()))
            self._wake.clear()
        return self.current() is term

    def _depose(self, term: Term, on_deposed: Callable[[Term, str], None], reason: str) -> None:
        try:
            on_deposed(term, reason)
        except Exception:
            log.exception("stopping to act failed")
        with self._transition:  # unfence only if no newer term started meanwhile
            if self._state[0] is None or self._state[0] is term or self.current() is None:
                self.store.fence_writes(None)

    def _end_term(self, term: Term) -> None:
        with self._transition:
            if self._state[0] is term:
                self._state = (None, -math.inf)

    def release(self) -> bool:
        """Give the lease up (graceful shutdown, after the loop stopped): a standby takes over at
        its next claim. Whether this process held it."""
        with self._transition:
            self._state = (None, -math.inf)
            self.reason = "released"
        try:
            self.store.fence_writes(None)
            released = self.store.release_lease(self.candidate.holder, now=self._wall())
        except Exception as exc:
            log.warning("releasing the control lease failed: %s; it expires on its own", exc)
            return False
        if released:
            log.warning("released the control lease; a standby may take over at once")
        return released

    # -- status -------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """What /healthz and the metrics show: role, who holds the lease, when it expires."""
        lease, at = self.seen, self.seen_at
        left = (
            None if lease is None or at is None else lease.expires_at - at - (self._mono() - self._seen_mono)
        )
        return {
            "role": "leader" if self.may_act() else "standby",
            "holder": lease.holder if lease else None,
            "host": lease.host if lease else None,
            "pid": lease.pid if lease else None,
            "token": lease.token if lease else None,
            "expires_in_s": None if left is None else round(left, 3),  # may be < 0: expired
            "me": self.candidate.holder,
            "reason": self.reason,
        }
