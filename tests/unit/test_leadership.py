"""Leader or standby (`control.lease`, `control.leadership`), on the in-memory store with a fake
monotonic clock: who may claim, the acting deadline, stepping down, the fence, the supervisor's
calls, the wait after taking over another host's lease; and the config that sets the timing."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from lowtide.config import ConfigError, load_settings
from lowtide.control.leadership import Leadership, Term
from lowtide.control.lease import (
    ClaimAction,
    LeaseCandidate,
    LeaseRecord,
    LeaseTiming,
    TakeoverKind,
    claim_action,
    holder_name,
    seat_of,
    takeover_kind,
)
from lowtide.control.records import FencedOut
from lowtide.store.memory import MemoryStore
from support import wait_until

WALL0 = 1_790_000_000.0


class Ticker:
    """A clock the test moves."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def cand(seat: str, pid: int, host: str = "host-a") -> LeaseCandidate:
    full = seat_of(host, seat)
    return LeaseCandidate(holder_name(full, pid, "n0"), full, host, pid)


def row(holder: LeaseCandidate, expires_at: float, token: int = 1) -> LeaseRecord:
    return LeaseRecord("control", holder.holder, holder.host, holder.pid, token, 0.0, 0.0, expires_at)


A, A2, B, FOREIGN = cand("sa", 1), cand("sa", 2), cand("sb", 3), cand("sf", 4, host="host-z")


def test_claim_rules_and_takeover_kinds() -> None:
    assert claim_action(None, A, 5.0) == ClaimAction.INSERT
    assert claim_action(row(A, 10.0), A, 5.0) == ClaimAction.RENEW
    assert claim_action(row(A, 10.0), B, 5.0) == ClaimAction.REFUSE
    assert claim_action(row(A, 10.0), B, 10.0) == ClaimAction.TAKEOVER  # expired at its expiry
    assert claim_action(row(A, 10.0), A2, 5.0) == ClaimAction.TAKEOVER  # the same seat: a restart
    assert takeover_kind(None, B) == TakeoverKind.FIRST
    assert takeover_kind(row(A, 1.0), A2) == TakeoverKind.RESTART
    assert takeover_kind(row(A, 1.0), B) == TakeoverKind.SAME_HOST
    assert takeover_kind(row(A, 1.0), FOREIGN) == TakeoverKind.OTHER_HOST
    timing = LeaseTiming(ttl_s=10.0, renew_s=2.0)
    assert timing.act_deadline(100.0) == pytest.approx(108.0)  # ttl less the 20 % margin
    with pytest.raises(ValueError, match=r"at most 0\.4"):
        LeaseTiming(ttl_s=10.0, renew_s=5.0)


class World:
    """One in-memory store, one wall clock, one monotonic clock per control plane."""

    def __init__(self) -> None:
        self.store = MemoryStore()
        self.wall = Ticker(WALL0)

    def plane(self, who: LeaseCandidate, *, grace: float = 0.0) -> tuple[Leadership, Ticker]:
        mono = Ticker(0.0)
        timing = LeaseTiming(ttl_s=10.0, renew_s=2.0)
        return Leadership(
            self.store, who, timing, wall=self.wall, monotonic=mono, foreign_grace_s=grace
        ), mono


def test_a_leader_acts_until_its_own_deadline_and_a_renew_extends_it() -> None:
    w = World()
    lead, mono = w.plane(A)
    term = lead.claim_once()
    assert term is not None and term.token == 1 and lead.may_act()
    lead.check()
    mono.t = 5.0
    assert lead.claim_once() is term  # a renew: the same term, a later deadline
    mono.t = 12.9
    assert lead.may_act()
    mono.t = 13.0  # 5 + 10 x 0.8: it stops acting before anyone could see the lease expired
    assert not lead.may_act()
    with pytest.raises(FencedOut, match="not the leader"):
        lead.check()


def test_a_leader_whose_renewals_fail_stops_at_the_deadline_and_starts_a_new_term_when_they_work() -> None:
    w = World()
    lead, mono = w.plane(A)
    first = lead.claim_once()
    claim = w.store.claim_lease

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("database unreachable")

    w.store.claim_lease = broken  # type: ignore[method-assign]
    mono.t = 4.0
    assert lead.claim_once() is first  # still within the deadline
    mono.t = 8.0
    assert lead.claim_once() is None and not lead.may_act()
    w.store.claim_lease = claim  # type: ignore[method-assign]
    mono.t = 9.0
    again = lead.claim_once()
    assert again is not None and again is not first and again.token == 1  # nobody else took it


def test_a_standby_takes_over_after_expiry_and_the_old_leader_stands_by() -> None:
    w = World()
    a, _ = w.plane(A)
    b, _ = w.plane(B)
    assert a.claim_once() is not None
    assert b.claim_once() is None and not b.may_act()
    assert b.status()["role"] == "standby" and b.status()["holder"] == A.holder
    w.wall.t += 10.0  # A's lease expired (A was paused: it renewed nothing)
    term = b.claim_once()
    assert term is not None and term.token == 2 and term.kind == TakeoverKind.SAME_HOST
    assert term.previous is not None and term.previous.holder == A.holder
    assert a.claim_once() is None and not a.may_act()
    assert B.holder in a.reason and a.status()["role"] == "standby"


def test_a_refused_write_ends_the_term_at_once() -> None:
    w = World()
    lead, _ = w.plane(A)
    assert lead.claim_once() is not None
    w.wall.t += 10.0
    assert w.store.claim_lease(B, ttl_s=10.0, now=w.wall()).granted  # taken over behind its back
    assert lead.may_act()  # it does not know yet...
    with pytest.raises(FencedOut):
        w.store.mark_stopping(1, deadline=0.0, reason="x", now=w.wall())  # ...until a write is refused
    assert not lead.may_act() and "fenced out" in lead.reason


@pytest.fixture
def supervised() -> Iterator[tuple[World, Leadership, Ticker, list[str], threading.Event]]:
    w = World()
    lead, mono = w.plane(FOREIGN, grace=30.0)
    calls: list[str] = []
    stop = threading.Event()
    yield w, lead, mono, calls, stop
    stop.set()
    lead.interrupt()


def test_the_supervisor_starts_and_stops_acting_with_the_term(
    supervised: tuple[World, Leadership, Ticker, list[str], threading.Event],
) -> None:
    w, lead, mono, calls, stop = supervised
    lead.foreign_grace_s = 0.0

    def elected(term: Term) -> None:
        calls.append(f"elected {term.token}")

    def deposed(term: Term, reason: str) -> None:
        calls.append(f"deposed {term.token}")

    thread = threading.Thread(target=lead.supervise, args=(stop, elected, deposed), daemon=True)
    thread.start()
    lead.claim_once()
    wait_until(lambda: calls == ["elected 1"], timeout=10, what="the election")
    mono.t = 100.0  # past its deadline without a renew
    lead.interrupt()
    wait_until(lambda: calls == ["elected 1", "deposed 1"], timeout=10, what="stepping down")
    assert w.store._fence is None  # standing by: its writes go unfenced again
    mono.t = 101.0
    lead.claim_once()  # its own lease, still unexpired in the store: a new term, the same token
    wait_until(lambda: calls[-1] == "elected 1" and len(calls) == 3, timeout=10, what="the new term")
    stop.set()
    lead.interrupt()
    thread.join(timeout=10)
    assert calls == ["elected 1", "deposed 1", "elected 1", "deposed 1"]  # and at the stop


def test_after_another_hosts_lease_recovery_waits_the_grace(
    supervised: tuple[World, Leadership, Ticker, list[str], threading.Event],
) -> None:
    w, lead, mono, calls, stop = supervised
    assert w.store.claim_lease(A, ttl_s=10.0, now=w.wall()).granted
    w.wall.t += 10.0
    term = lead.claim_once()
    assert term is not None and term.kind == TakeoverKind.OTHER_HOST
    thread = threading.Thread(
        target=lead.supervise, args=(stop, lambda t: calls.append("elected"), lambda t, r: None), daemon=True
    )
    thread.start()
    mono.t = 5.0
    lead.claim_once()  # renewing while it waits
    assert calls == []  # the monotonic clock has not reached the grace: it cannot have acted
    mono.t = 31.0
    lead.claim_once()
    lead.interrupt()
    wait_until(lambda: calls == ["elected"], timeout=10, what="recovery after the grace")


def test_config_validates_the_lease_timing(tmp_path: Path) -> None:
    root = tmp_path
    good = root / "good.yaml"
    good.write_text("control: {lease_ttl: 6s, lease_renew: 2}\n")
    control = load_settings(good).control
    assert (control.lease_ttl, control.lease_renew, control.foreign_takeover_grace) == (6.0, 2.0, 300.0)
    bad = root / "bad.yaml"
    bad.write_text("control: {lease_ttl: 6, lease_renew: 3}\n")
    with pytest.raises(ConfigError, match=r"control.*renew interval"):
        load_settings(bad)
